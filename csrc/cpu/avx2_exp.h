// The AVX2 exponential of the fp32 softmax passes, shared by the passes
// (softmax_rows_avx2.cpp) and the forward's S = Q K^T with the pass in its
// epilogue (packed_tiles_avx2.cpp), so that both give the same weights bit
// for bit. Include after `#pragma GCC target("avx2,fma")` (x86-64 only).
#pragma once

#include <immintrin.h>

namespace ring_attention::cpu::avx2 {

// 2^t: 2^floor(t) * 2^f with f = t - floor(t) in [0, 1) (exact) and the
// AVX-512 lanes' degree-5 polynomial for 2^f (relative error 1.6e-7
// evaluated in fp32). t is clamped to [-127, 128] first: 2^floor(t) is then
// built in the exponent bits, 0 at -127 (so exactly 0 at -inf and below
// 2^-126, where the AVX-512 lanes keep denormals) and +inf at 128. The clamps
// take t as their second operand, so NaN stays NaN.
inline __m256 exp2_ps(__m256 t) {
  t = _mm256_max_ps(_mm256_set1_ps(-127.0f), t);
  t = _mm256_min_ps(_mm256_set1_ps(128.0f), t);
  const __m256 fl = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, fl);
  __m256 y = _mm256_set1_ps(1.877576695e-3f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(8.989340626e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.582631752e-2f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.401536107e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(6.931530833e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(9.999999404e-1f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fl), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// a * log2 e, rounded once from double: the base-2 scale and shift of
// exp(a x - b).
inline float log2e_times_ss(double a) { return static_cast<float>(a * 1.4426950408889634); }
inline __m256 log2e_times(double a) { return _mm256_set1_ps(log2e_times_ss(a)); }

}  // namespace ring_attention::cpu::avx2
