// The AVX2 exponential of the fp32 softmax passes, shared by the passes
// (softmax_rows_avx2.cpp) and the forward's S = Q K^T with the pass in its
// epilogue (packed_tiles_avx2.cpp), so that both give the same weights bit
// for bit. Include after `#pragma GCC target("avx2,fma")` (x86-64 only).
#pragma once

#include <immintrin.h>

namespace ring_attention::cpu::avx2 {

// 2^t = 2^n * 2^f with n = round(t) and f = t - n in [-0.5, 0.5] (exact),
// in 11 vector operations (10 without the upper clamp; the floor, convert and
// integer add of 2^floor(t) cost 3 more). t is clamped to [-127, 128] first
// (the clamps take t as their second operand, so NaN stays NaN). Adding
// 1.5 * 2^23 + 127 rounds t to an integer in the low mantissa bits of r,
// n + 127 there; shifted into the exponent field they are 2^n: 0 at n = -127
// (so exactly 0 at -inf and below 2^-126.5, where the AVX-512 lanes keep
// denormals), +inf at 128. 2^f: a degree-5 polynomial with constant term 1
// (exact at t = 0), fitted for relative error on [-0.5, 0.5] (9e-8) and its
// fp32 coefficients tuned for the error evaluated in fp32: 2^t is within
// 1.5e-7 of exact relative to it for every fp32 t in [-126, 0], and as close
// above 0 (tests/test_cpu_tile_paths.py measures it against float64).
// kClampTop = false drops the upper clamp for callers that discard every
// lane whose t passes a cap below 128 (2^t is garbage there).
template <bool kClampTop = true>
inline __m256 exp2_ps(__m256 t) {
  t = _mm256_max_ps(_mm256_set1_ps(-127.0f), t);
  if constexpr (kClampTop) t = _mm256_min_ps(_mm256_set1_ps(128.0f), t);
  const __m256 magic = _mm256_set1_ps(12582912.0f + 127.0f);
  const __m256 r = _mm256_add_ps(t, magic);
  const __m256 f = _mm256_sub_ps(t, _mm256_sub_ps(r, magic));
  __m256 y = _mm256_set1_ps(1.326000900e-3f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(9.671726264e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.550730973e-2f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.402223647e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(6.931470037e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(r), 23)));
}

// a * log2 e, rounded once from double: the base-2 scale and shift of
// exp(a x - b).
inline float log2e_times_ss(double a) { return static_cast<float>(a * 1.4426950408889634); }
inline __m256 log2e_times(double a) { return _mm256_set1_ps(log2e_times_ss(a)); }

}  // namespace ring_attention::cpu::avx2
