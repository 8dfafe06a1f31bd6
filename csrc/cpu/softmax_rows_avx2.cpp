// The fp32 softmax passes in 8 lanes of AVX2 + FMA (Lanes::kAvx2): the same
// passes as the AVX-512 ones (softmax_lanes.h) for CPUs without AVX-512, and
// on wider ones when RING_ATTENTION_CPU_ISA asks for the AVX2 path. Compiled
// for AVX2 in every x86-64 build (the target pragma below); select_path()
// picks these lanes only where the CPU has AVX2 and FMA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "softmax_rows.h"

#if defined(__x86_64__)
#include <immintrin.h>

// After the library headers: their inline functions are shared with the other
// units and must not be compiled for a wider ISA than the build's.
#pragma GCC push_options
#pragma GCC target("avx2,fma")

#include "avx2_exp.h"

namespace ring_attention::cpu::avx2 {
namespace {

inline float lanes_max(__m256 v) {
  alignas(32) float a[8];
  _mm256_store_ps(a, v);
  float m = a[0];
  for (int i = 1; i < 8; ++i) m = a[i] > m ? a[i] : m;
  return m;
}
inline float lanes_sum(__m256 v) {
  alignas(32) float a[8];
  _mm256_store_ps(a, v);
  float s = 0;
  for (const float x : a) s += x;
  return s;
}

// Lanes below `left` on (all from 8 on).
inline __m256i tail_mask(int64_t left) {
  const int n = static_cast<int>(std::min<int64_t>(left, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// x[0..8) where the mask is on, `fill` elsewhere.
inline __m256 load_or(const float* x, __m256i mask, __m256 fill) {
  return _mm256_blendv_ps(fill, _mm256_maskload_ps(x, mask), _mm256_castsi256_ps(mask));
}

// vmaxps returns its second operand when either is NaN: the running max.
inline __m256 max_skip_nan(__m256 x, __m256 m) { return _mm256_max_ps(x, m); }

}  // namespace

float row_max(const float* x, int64_t n) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m0 = neg_inf, m1 = neg_inf, m2 = neg_inf, m3 = neg_inf;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    m0 = max_skip_nan(_mm256_loadu_ps(x + j), m0);
    m1 = max_skip_nan(_mm256_loadu_ps(x + j + 8), m1);
    m2 = max_skip_nan(_mm256_loadu_ps(x + j + 16), m2);
    m3 = max_skip_nan(_mm256_loadu_ps(x + j + 24), m3);
  }
  for (; j < n; j += 8) m0 = max_skip_nan(load_or(x + j, tail_mask(n - j), neg_inf), m0);
  return lanes_max(max_skip_nan(max_skip_nan(m0, m1), max_skip_nan(m2, m3)));
}

float exp_row(float* x, int64_t n, float scale, float sub) {
  const __m256 vs = log2e_times(sub), va = log2e_times(scale);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256 e0 = exp2_ps(_mm256_fmsub_ps(_mm256_loadu_ps(x + j), va, vs));
    const __m256 e1 = exp2_ps(_mm256_fmsub_ps(_mm256_loadu_ps(x + j + 8), va, vs));
    _mm256_storeu_ps(x + j, e0);
    _mm256_storeu_ps(x + j + 8, e1);
    acc0 = _mm256_add_ps(acc0, e0);
    acc1 = _mm256_add_ps(acc1, e1);
  }
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; j < n; j += 8) {
    // Lanes past the end load -inf: their exponential is 0.
    const __m256i k = tail_mask(n - j);
    const __m256 e = exp2_ps(_mm256_fmsub_ps(load_or(x + j, k, neg_inf), va, vs));
    _mm256_maskstore_ps(x + j, k, e);
    acc0 = _mm256_add_ps(acc0, e);
  }
  return lanes_sum(_mm256_add_ps(acc0, acc1));
}

float exp_row_lazy(float* x, int64_t n, float scale, float* shift, float cap) {
  // The AVX-512 lanes' one sweep (softmax_lanes.h, exp_row_capped_lanes) in
  // blocks of 32 lanes, 8 in the tail: exp while every lane's exponent stays
  // at most cap (NaN lanes pass), and where a block's passes it, the lanes
  // done brought to the shift of the maximum of those left.
  const __m256 vs = log2e_times(*shift), va = log2e_times(scale), vcap = log2e_times(cap);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  int64_t j = 0;
  bool passed = false;
  for (; j + 32 <= n; j += 32) {
    __m256 t[4];
    __m256 m = neg_inf;
    for (int u = 0; u < 4; ++u) {
      t[u] = _mm256_fmsub_ps(_mm256_loadu_ps(x + j + 8 * u), va, vs);
      m = max_skip_nan(t[u], m);
    }
    if (_mm256_movemask_ps(_mm256_cmp_ps(m, vcap, _CMP_GT_OQ)) != 0) {
      passed = true;
      break;
    }
    for (int u = 0; u < 4; ++u) {
      const __m256 e = exp2_ps(t[u]);
      _mm256_storeu_ps(x + j + 8 * u, e);
      if (u % 2 == 0)
        acc0 = _mm256_add_ps(acc0, e);
      else
        acc1 = _mm256_add_ps(acc1, e);
    }
  }
  if (!passed) {
    for (; j < n; j += 8) {
      const __m256i k = tail_mask(n - j);
      // Lanes past the end load -inf: their exponential is 0.
      const __m256 t = _mm256_fmsub_ps(load_or(x + j, k, neg_inf), va, vs);
      if (_mm256_movemask_ps(_mm256_cmp_ps(t, vcap, _CMP_GT_OQ)) != 0) break;
      const __m256 e = exp2_ps(t);
      _mm256_maskstore_ps(x + j, k, e);
      acc0 = _mm256_add_ps(acc0, e);
    }
  }
  const int64_t done = std::min(j, n);
  const float sum = lanes_sum(_mm256_add_ps(acc0, acc1));
  if (done == n) return sum;
  // Past the cap: shift by the maximum of the lanes left (all those done are
  // below it) and bring the lanes done to that shift.
  const float m = row_max(x + done, n - done) * scale;
  const float f = std::exp(*shift - m);
  for (int64_t i = 0; i < done; ++i) x[i] *= f;
  *shift = m;
  return sum * f + exp_row(x + done, n - done, scale, m);
}

void softmax_grad_row(float* s, float* dp, int64_t n, RowGrad<float> g) {
  const __m256 vs = log2e_times(g.s_scale), vl = log2e_times(g.lse);
  const __m256 vc = _mm256_set1_ps(g.ds_scale), vd = _mm256_set1_ps(g.ds_scale * g.delta);
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256i k = tail_mask(n - j);
    const bool whole = n - j >= 8;
    const __m256 sv = whole ? _mm256_loadu_ps(s + j) : _mm256_maskload_ps(s + j, k);
    const __m256 dv = whole ? _mm256_loadu_ps(dp + j) : _mm256_maskload_ps(dp + j, k);
    const __m256 p = exp2_ps(_mm256_fmsub_ps(sv, vs, vl));
    // ds = 0 where p = 0 (a masked key's dp may be NaN from its V row).
    const __m256 nonzero = _mm256_cmp_ps(p, zero, _CMP_NEQ_UQ);
    const __m256 ds = _mm256_and_ps(nonzero, _mm256_mul_ps(p, _mm256_fmsub_ps(dv, vc, vd)));
    if (whole) {
      _mm256_storeu_ps(s + j, p);
      _mm256_storeu_ps(dp + j, ds);
    } else {
      _mm256_maskstore_ps(s + j, k, p);
      _mm256_maskstore_ps(dp + j, k, ds);
    }
  }
}

}  // namespace ring_attention::cpu::avx2

#pragma GCC pop_options
#endif
