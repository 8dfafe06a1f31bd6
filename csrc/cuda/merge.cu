// The merge operators' CUDA kernel (merge.h): one pass over a window's
// (batch, position, head) rows, each row read from the parts its index
// names and written once.
//
// A row belongs to `tpr` adjacent threads (min(D / V, 32)), each holding V
// values of the head dim: V = 16 bytes of T (8 fp16 / bf16, 4 fp32, 2 fp64)
// where the head dim, the part buffer and every stride of out allow 16-byte
// accesses, else 1. Each thread reads the row's slot indices and part LSEs
// itself (a few cached words), so no row state goes through shared memory
// and the kernel has no barrier; a thread with more than V values of a row
// loops over them. Accumulation in fp32 (fp64 for fp64).
#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../merge.h"
#include "runtime.cuh"

namespace ring_attention::gpu {

namespace {

constexpr int kMergeThreads = 128;
// 8 blocks an SM leave 64 registers a thread: without it ptxas held sm_80 to
// 32 and spilled 8-16 bytes to local memory (compile_cuda.sh --keep, ptxas -v)
constexpr int kMergeBlocks = 8;

struct MergeArgs {
  const void* parts;
  const void* part_lse;  // nullptr: a sum
  const int32_t* index;
  void* out;
  void* lse;
  int64_t rows, length, heads, dim, part_rows, slots;
  int64_t out_stride[3], lse_stride[3];
  int64_t lse_rows;   // rows of part_lse: slot 0's bound with first_in_out
  bool first_in_out;  // slot 0's values: the row's own out (read, then written, by each thread)
  int tpr;            // threads per row
};

__device__ inline float acc_exp(float x) { return expf(x); }
__device__ inline double acc_exp(double x) { return exp(x); }
__device__ inline float acc_log(float x) { return logf(x); }
__device__ inline double acc_log(double x) { return log(x); }

// V values of T at p (16 bytes and 16-byte aligned where V > 1) as
// accumulator values, and back: the 16-bit types through their bits, so that
// no value goes through memory a thread's registers cannot hold.
template <typename T, typename Acc, int V>
__device__ inline void load_vec(const T* p, Acc (&x)[V]) {
  if constexpr (V == 1) {
    x[0] = static_cast<Acc>(*p);
  } else if constexpr (std::is_same_v<T, float>) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
  } else if constexpr (std::is_same_v<T, double>) {
    const double2 f = *reinterpret_cast<const double2*>(p);
    x[0] = f.x, x[1] = f.y;
  } else {
    static_assert(V == 8, "16-bit types: 8 values in 16 bytes");
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < V; ++j)
      x[j] = static_cast<Acc>(T(static_cast<uint16_t>(w[j / 2] >> (16 * (j % 2))), T::from_bits()));
  }
}

// One 16-byte store (st.global.v4 / v2; the emulator stores the words).
__device__ inline void store16(void* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
#ifdef RING_ATTENTION_CUDA_EMULATOR
  *static_cast<uint4*>(p) = uint4{a, b, c, d};
#else
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
#endif
}
__device__ inline void store16(float* p, float a, float b, float c, float d) {
#ifdef RING_ATTENTION_CUDA_EMULATOR
  *reinterpret_cast<float4*>(p) = float4{a, b, c, d};
#else
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#endif
}
__device__ inline void store16(double* p, double a, double b) {
#ifdef RING_ATTENTION_CUDA_EMULATOR
  *reinterpret_cast<double2*>(p) = double2{a, b};
#else
  asm volatile("st.global.v2.f64 [%0], {%1, %2};\n" ::"l"(p), "d"(a), "d"(b) : "memory");
#endif
}

template <typename T, typename Acc, int V>
__device__ inline void store_vec(T* p, const Acc (&x)[V]) {
  if constexpr (V == 1) {
    *p = static_cast<T>(x[0]);
  } else if constexpr (std::is_same_v<T, float>) {
    store16(p, x[0], x[1], x[2], x[3]);
  } else if constexpr (std::is_same_v<T, double>) {
    store16(p, x[0], x[1]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] =
          static_cast<uint32_t>(T(x[2 * i]).x) | (static_cast<uint32_t>(T(x[2 * i + 1]).x) << 16);
    store16(p, w[0], w[1], w[2], w[3]);
  }
}

// A row's parts are fetched kSlots at a time, every index, LSE and value of
// a chunk issued before the first is used (each of them waits on the one
// before: index, then LSE, then the part); a row with more slots merges its
// chunks online, the running max rescaling what came before. Each part
// value is held as its 16 raw bytes (4 registers) until it is added. Four
// at once within the 64 registers 8 blocks an SM leave; in fp64 (never a
// dense path's dtype: only the operators' own callers) two, 4 blocks an SM,
// since its exp and log spilled at 64 registers even one at a time.
template <typename Acc>
constexpr int kSlots = sizeof(Acc) == 8 ? 2 : 4;
template <typename Acc>
constexpr int kBlocksPerSM = sizeof(Acc) == 8 ? 4 : kMergeBlocks;

template <typename T, int V>
using Raw = std::conditional_t<(V > 1), uint4, T>;

template <typename T, typename Acc, int V>
__device__ inline void widen(const Raw<T, V>& r, Acc (&x)[V]) {
  if constexpr (V == 1) {
    x[0] = static_cast<Acc>(r);
  } else {
    load_vec<T, Acc, V>(reinterpret_cast<const T*>(&r), x);
  }
}

// Merge: the forward's log-sum-exp merge (part_lse given); else a sum.
template <typename T, typename Acc, int V, bool Merge>
__global__ void __launch_bounds__(kMergeThreads, kBlocksPerSM<Acc>)
    merge_kernel(const MergeArgs a) {
  constexpr Acc kInf = std::numeric_limits<Acc>::infinity();
  const int tpr = a.tpr, per_block = kMergeThreads / tpr;
  const int sub = static_cast<int>(threadIdx.x) / tpr, lane = static_cast<int>(threadIdx.x) % tpr;
  if (sub >= per_block) return;  // the threads a row count leaves over
  const auto* parts = static_cast<const T*>(a.parts);
  const auto* plse = static_cast<const Acc*>(a.part_lse);
  const int64_t vecs = a.dim / V, step = static_cast<int64_t>(gridDim.x) * per_block;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * per_block + sub; row < a.rows;
       row += step) {
    const int64_t b = row / (a.length * a.heads), t = row / a.heads % a.length, h = row % a.heads;
    T* out =
        static_cast<T*>(a.out) + b * a.out_stride[0] + t * a.out_stride[1] + h * a.out_stride[2];
    // the row's max LSE, sum of exp(lse - max) and NaN, as of the last chunk
    Acc m = -kInf, sum = 0;
    bool nan = false;
    for (int64_t c = lane; c < vecs; c += tpr) {
      Acc acc[V];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = 0;
      m = -kInf, sum = 0, nan = false;
      for (int64_t s0 = 0; s0 < a.slots; s0 += kSlots<Acc>) {
        constexpr int kS = kSlots<Acc>;
        int32_t idx[kS];
        Acc l[kS];
        Raw<T, V> raw[kS];
#pragma unroll
        for (int j = 0; j < kS; ++j) {
          const int32_t i = s0 + j < a.slots ? a.index[(s0 + j) * a.rows + row] : -1;
          const int64_t bound = s0 + j == 0 && a.first_in_out ? a.lse_rows : a.part_rows;
          idx[j] = i >= 0 && i < bound ? i : -1;
        }
#pragma unroll
        for (int j = 0; j < kS; ++j) {
          l[j] = idx[j] < 0 ? -kInf : Merge ? plse[idx[j]] : Acc(0);
          nan |= isnan(l[j]);
        }
#pragma unroll
        for (int j = 0; j < kS; ++j) {
          if (l[j] > -kInf)  // parts of unreached rows are never read
            raw[j] = *reinterpret_cast<const Raw<T, V>*>(
                s0 + j == 0 && a.first_in_out
                    ? out + c * V
                    : parts + static_cast<int64_t>(idx[j]) * a.dim + c * V);
        }
        Acc top = m;  // (NaN compares false: it is flagged, not a max)
#pragma unroll
        for (int j = 0; j < kS; ++j) top = l[j] > top ? l[j] : top;
        if (!(top > -kInf)) continue;
        if constexpr (Merge) {
          const Acc r = acc_exp(m - top);  // exp(-inf) = 0 for the first chunk
          sum *= r;
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] *= r;
          m = top;
        }
#pragma unroll
        for (int j = 0; j < kS; ++j) {
          if (!(l[j] > -kInf)) continue;
          const Acc w = Merge ? acc_exp(l[j] - m) : Acc(1);
          sum += w;
          Acc x[V];
          widen<T, Acc, V>(raw[j], x);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[v] += w * x[v];
        }
      }
      const Acc scale = !Merge || sum == 0 ? Acc(1) : Acc(1) / sum;
#pragma unroll
      for (int j = 0; j < V; ++j)
        acc[j] = nan ? std::numeric_limits<Acc>::quiet_NaN() : acc[j] * scale;
      store_vec<T, Acc, V>(out + c * V, acc);
    }
    if (Merge && lane == 0) {
      Acc* lse = static_cast<Acc*>(a.lse) + b * a.lse_stride[0] + t * a.lse_stride[1] +
                 h * a.lse_stride[2];
      *lse = nan ? std::numeric_limits<Acc>::quiet_NaN() : sum == 0 ? -kInf : m + acc_log(sum);
    }
  }
}

template <typename T, typename Acc, int V>
void launch_merge(MergeArgs a) {
  const auto kernel =
      a.part_lse != nullptr ? merge_kernel<T, Acc, V, true> : merge_kernel<T, Acc, V, false>;
  const int64_t vecs = a.dim / V;
  a.tpr = static_cast<int>(vecs < 32 ? vecs : 32);
  const int64_t per_block = kMergeThreads / a.tpr;
  int64_t blocks = (a.rows + per_block - 1) / per_block;
  blocks = blocks < 65535 ? blocks : 65535;  // the rest by the grid-stride loop
  launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kMergeThreads), 0, current_stream(), a);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void merge_rows(const MergeCall& c) {
  const DeviceGuard guard(c.device);
  MergeArgs a{c.parts,
              c.part_lse,
              c.index,
              c.out,
              c.lse,
              c.batch * c.length * c.heads,
              c.length,
              c.heads,
              c.dim,
              c.part_rows,
              c.slots,
              {},
              {},
              c.lse_rows,
              c.first_in_out,
              1};
  for (int i = 0; i < 3; ++i) {
    a.out_stride[i] = c.out_stride[i];
    a.lse_stride[i] = c.lse_stride[i];
  }
  if (a.rows == 0 || a.dim == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.dtype, "merge_rows_cuda", [&] {
    using Acc = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    constexpr int V = 16 / sizeof(scalar_t);
    bool vec = a.dim % V == 0 && aligned16(a.parts) && aligned16(a.out);
    for (int i = 0; i < 3; ++i) vec = vec && a.out_stride[i] % V == 0;
    if (vec) {
      launch_merge<scalar_t, Acc, V>(a);
    } else {
      launch_merge<scalar_t, Acc, 1>(a);
    }
  });
}

}  // namespace ring_attention::gpu
