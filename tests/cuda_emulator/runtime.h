// A CPU emulation of the CUDA surface in csrc/cuda/runtime.cuh, for testing the
// block kernels on machines without a GPU: the names the kernels use, mapped
// onto the execution model of emulator.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "emulator.h"

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __grid_constant__
#define __grid_constant__
#endif

using std::isnan;

// ------------------------------------------------ the CUDA names the kernels use
#define RING_ATTENTION_DYNAMIC_SMEM(name) unsigned char* const name = ::cuda_emulator::g_block->smem

inline void __syncthreads() { cuda_emulator::syncthreads(); }
inline int __syncthreads_or(int pred) { return cuda_emulator::syncthreads(pred != 0) ? 1 : 0; }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  cuda_emulator::warp_collective(cuda_emulator::Slot{cuda_emulator::Kind::sync, mask, {}});
}
template <typename T>
inline T __shfl_sync(unsigned mask, T x, int src, int width = 32) {
  if (width != 32) cuda_emulator::fail("shuffle width must be 32");
  return cuda_emulator::shuffle(mask, x, src);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T x, int lane_mask, int width = 32) {
  if (width != 32) cuda_emulator::fail("shuffle width must be 32");
  return cuda_emulator::shuffle(mask, x, (cuda_emulator::g_block->current % 32) ^ lane_mask);
}
inline int __any_sync(unsigned mask, int pred) {
  const cuda_emulator::Slot* all = cuda_emulator::warp_collective(
      cuda_emulator::Slot{cuda_emulator::Kind::vote, mask, {pred != 0 ? 1u : 0u}});
  for (int i = 0; i < 32; ++i)
    if (all[i].v[0] != 0) return 1;
  return 0;
}
inline int __all_sync(unsigned mask, int pred) {
  const cuda_emulator::Slot* all = cuda_emulator::warp_collective(
      cuda_emulator::Slot{cuda_emulator::Kind::vote, mask, {pred != 0 ? 1u : 0u}});
  for (int i = 0; i < 32; ++i)
    if (all[i].v[0] == 0) return 0;
  return 1;
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  const cuda_emulator::Slot* all = cuda_emulator::warp_collective(
      cuda_emulator::Slot{cuda_emulator::Kind::vote, mask, {pred != 0 ? 1u : 0u}});
  unsigned bits = 0;
  for (int i = 0; i < 32; ++i)
    if (all[i].v[0] != 0) bits |= 1u << i;
  return bits;
}
[[noreturn]] inline void __trap() { cuda_emulator::fail("__trap()"); }

namespace ring_attention::gpu {

struct DeviceGuard {
  explicit DeviceGuard(c10::Device) {}
};

inline void check_device(const at::Tensor& t) {
  TORCH_CHECK(t.is_cpu(), "cuda_emulator: expected a CPU tensor, got one on ", t.device());
}

inline cudaStream_t current_stream() { return nullptr; }

inline int device_attribute(cudaDeviceAttr attr) {
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor:
      return cuda_emulator::config().compute_capability / 10;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      return cuda_emulator::config().smem_optin;
    default:
      TORCH_CHECK(false, "cuda_emulator: device attribute ", static_cast<int>(attr),
                  " is not emulated");
  }
}

template <typename Kernel>
inline void set_max_dynamic_smem(Kernel kernel, size_t bytes) {
  TORCH_CHECK(bytes <= static_cast<size_t>(cuda_emulator::config().smem_optin),
              "cuda_emulator: cudaFuncSetAttribute above the opt-in limit");
  cuda_emulator::smem_limits()[reinterpret_cast<const void*>(kernel)] = bytes;
}

template <typename Kernel, typename... Args>
inline void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t, Args... args) {
  cuda_emulator::launch(kernel, grid, block, smem, args...);
}

template <typename T>
inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cuda_emulator::mma<T>(c, a, b0, b1);
}

inline void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* rows) {
  cuda_emulator::ldmatrix(r, rows, false);
}
inline void cp_async_16(void* dst, const void* src, int src_bytes) {
  cuda_emulator::cp_async_16(dst, src, src_bytes);
}
inline void cp_async_commit() { cuda_emulator::cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
  cuda_emulator::cp_async_wait(N);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* rows) {
  cuda_emulator::ldmatrix(r, rows, true);
}
// ex2.approx.ftz: subnormal results flush to zero (its approximation error,
// about 2^-22 relative, is not modelled)
inline float fast_exp2(float x) {
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}

}  // namespace ring_attention::gpu
