// The softmax passes that round P and dS to bf16 as they go. This code is
// compiled for avx512_bf16 (vcvtneps2bf16: one instruction per 16 lanes,
// round to nearest even); the kernels call it only where bf16_tiles(), which
// requires that the CPU has it.
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "softmax_rows.h"

// After the library headers: their inline functions are shared with the
// other units and must not be compiled for avx512_bf16.
#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
#endif
#include "softmax_lanes.h"

namespace ring_attention::cpu {
namespace {

#if defined(CPU_CAPABILITY_AVX512)
inline void store_bf16(c10::BFloat16* dst, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(dst, k, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#else
constexpr int64_t kChunk = 256;  // fp32 lanes converted while in cache
#endif

}  // namespace

float exp_row(const float* x, int64_t n, float scale, float sub, c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return exp_row_lanes<true>(x, n, scale, sub,
                             [p](int64_t j, __m512 e, __mmask16 k) { store_bf16(p + j, e, k); });
#else
  float e[kChunk];
  float sum = 0;
  for (int64_t j = 0; j < n; j += kChunk) {
    const int64_t len = std::min(kChunk, n - j);
    sum += exp_row_vec(x + j, len, scale, sub, e);
    at::vec::convert(e, p + j, len);
  }
  return sum;
#endif
}

float exp_row_lazy(const float* x, int64_t n, float scale, float* shift, float cap,
                   c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  int64_t done = 0;
  const float sum = exp_row_capped_lanes<true>(
      x, n, scale, *shift, cap, &done,
      [p](int64_t j, __m512 e, __mmask16 k) { store_bf16(p + j, e, k); });
  if (done == n) return sum;
  // Past the cap: the whole row again (x is unchanged), shifted by its maximum.
  *shift = row_max(x, n) * scale;
  return exp_row(x, n, scale, *shift, p);
#else
  const float m = row_max(x, n) * scale;
  if (m - *shift > cap) *shift = m;
  return exp_row(x, n, scale, *shift, p);
#endif
}

void softmax_grad_row(const float* s, const float* dp, int64_t n, RowGrad<float> g,
                      c10::BFloat16* p_out, c10::BFloat16* ds_out) {
#if defined(CPU_CAPABILITY_AVX512)
  softmax_grad_lanes<true>(s, dp, n, g,
                           [p_out, ds_out](int64_t j, __m512 p, __m512 ds, __mmask16 k) {
                             store_bf16(p_out + j, p, k);
                             store_bf16(ds_out + j, ds, k);
                           });
#else
  float p[kChunk], ds[kChunk];
  for (int64_t j = 0; j < n; j += kChunk) {
    const int64_t len = std::min(kChunk, n - j);
    softmax_grad_row_vec(s + j, dp + j, len, g, p, ds);
    at::vec::convert(p, p_out + j, len);
    at::vec::convert(ds, ds_out + j, len);
  }
#endif
}

}  // namespace ring_attention::cpu

#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC pop_options
#endif
