// The CUDA runtime surface of the block kernels, in one place: kernel launch,
// device attributes, stream and device guard, dynamic shared memory and the
// warp-level matrix instructions (mma.sync, ldmatrix), cp.async and the
// special function unit's exp2.
//
// The test suite builds the same .cu sources for the CPU with
// RING_ATTENTION_CUDA_EMULATOR naming a header that provides these names
// (tests/cuda_emulator/runtime.h: each thread block runs as cooperative
// fibers, warp collectives and mma in software), so the kernels are checked
// against the oracle on machines without a GPU.
#pragma once

#ifdef RING_ATTENTION_CUDA_EMULATOR
#include RING_ATTENTION_CUDA_EMULATOR
#else

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

// The dynamic shared memory of the running thread block, as `name`.
#define RING_ATTENTION_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]

namespace ring_attention::gpu {

using DeviceGuard = c10::cuda::OptionalCUDAGuard;

inline void check_device(const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), "ring_attention: expected a CUDA tensor, got one on ", t.device());
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

// Attribute of the current device. (ATen/cuda/CUDAContext.h would need the
// cuBLAS/cuSPARSE headers, which a bare nvcc install lacks.)
inline int device_attribute(cudaDeviceAttr attr) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, c10::cuda::current_device()));
  return value;
}

template <typename Kernel>
inline void set_max_dynamic_smem(Kernel kernel, size_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
}

template <typename Kernel, typename... Args>
inline void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args... args) {
  // clang-format reads .cuh as C++ and would split the chevrons.
  // clang-format off
  kernel<<<grid, block, smem, stream>>>(args...);
  // clang-format on
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// c += A B for one warp: mma.sync.m16n8k16, fp32 accumulate, T = c10::Half or
// c10::BFloat16 operands packed two per register (fragment layouts in
// common.cuh).
template <typename T>
__device__ inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>, "mma operands are fp16 or bf16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8x8 tiles of 16-bit values from shared memory (sm_75+): lanes 8m..8m+7
// pass the 16-byte aligned addresses of the rows of tile m, which lands in
// r[m]. The _trans form transposes each tile.
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* rows) {
  const auto addr = static_cast<unsigned>(__cvta_generic_to_shared(rows));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* rows) {
  const auto addr = static_cast<unsigned>(__cvta_generic_to_shared(rows));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 2^x in one instruction of the special function unit: ex2.approx.ftz
// (relative error about 2^-22; results below 2^-126 flush to zero; 2^-inf =
// 0). exp2f compiles to the same instruction inside a range fix-up for
// subnormal results: four instructions, on every probability of the kernels.
__device__ inline float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 16 bytes global -> shared without passing through registers (sm_80+);
// src_bytes < 16 zero-fills the rest (0: nothing is read). A thread's copies
// form a group at cp_async_commit; cp_async_wait<N> returns when at most N of
// its groups are still in flight.
__device__ inline void cp_async_16(void* dst, const void* src, int src_bytes) {
  const auto addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src),
               "r"(src_bytes));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace ring_attention::gpu

#endif
