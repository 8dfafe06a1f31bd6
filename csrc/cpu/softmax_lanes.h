// Internal to softmax_rows*.cpp: the vector loops of the softmax passes.
// Each translation unit gets its own copy (anonymous namespace), compiled
// with its own target options (softmax_rows_bf16.cpp adds avx512_bf16).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "softmax_rows.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace ring_attention::cpu {
namespace {

// Portable versions (fp64; fp32 without AVX-512): at::vec with Sleef's exp,
// which keeps exp(-inf) = 0 and exp(NaN) = NaN.
template <typename T>
T row_max_vec(const T* x, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  T m = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  if (n >= W) {
    Vec vm(m);
    for (; j + W <= n; j += W) {
      const Vec v = Vec::loadu(x + j);
      vm = Vec::blendv(vm, v, v > vm);  // an ordered compare: NaN keeps vm
    }
    T lanes[W];
    vm.store(lanes);
    for (const T a : lanes) m = a > m ? a : m;
  }
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// out[j] = exp(scale * x[j] - sub) (out may be x); returns their sum.
template <typename T>
T exp_row_vec(const T* x, int64_t n, T scale, T sub, T* out) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec vs(sub), va(scale);
  Vec acc(0);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const Vec e = (Vec::loadu(x + j) * va - vs).exp();
    e.store(out + j);
    acc = acc + e;
  }
  T lanes[W];
  acc.store(lanes);
  T sum = 0;
  for (const T a : lanes) sum += a;
  for (; j < n; ++j) {
    out[j] = std::exp(scale * x[j] - sub);
    sum += out[j];
  }
  return sum;
}

// exp_row_lazy (softmax_rows.h) without AVX-512: the row's maximum first.
template <typename T>
T exp_row_lazy_vec(const T* x, int64_t n, T scale, T* shift, T cap, T* out) {
  const T m = row_max_vec(x, n) * scale;
  if (m - *shift > cap) *shift = m;
  return exp_row_vec(x, n, scale, *shift, out);
}

// p_out and ds_out of a row as RowGrad says, ds 0 where p is 0 (the outputs
// may be s and dp).
template <typename T>
void softmax_grad_row_vec(const T* s, const T* dp, int64_t n, RowGrad<T> g, T* p_out, T* ds_out) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec vs(g.s_scale), vl(g.lse), vc(g.ds_scale), vd(g.ds_scale * g.delta), zero(0);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const Vec p = (Vec::loadu(s + j) * vs - vl).exp();
    const Vec ds = Vec::blendv(p * (Vec::loadu(dp + j) * vc - vd), zero, p == zero);
    p.store(p_out + j);
    ds.store(ds_out + j);
  }
  for (; j < n; ++j) {
    const T p = std::exp(g.s_scale * s[j] - g.lse);
    ds_out[j] = p == T(0) ? T(0) : g.ds_scale * p * (dp[j] - g.delta);
    p_out[j] = p;
  }
}

#if defined(CPU_CAPABILITY_AVX512)

// Horizontal max / sum through memory (GCC 12's _mm512_reduce_* read an
// undefined register and warn).
inline float lanes_max(__m512 v) {
  alignas(64) float a[16];
  _mm512_store_ps(a, v);
  float m = a[0];
  for (int i = 1; i < 16; ++i) m = a[i] > m ? a[i] : m;
  return m;
}
inline float lanes_sum(__m512 v) {
  alignas(64) float a[16];
  _mm512_store_ps(a, v);
  float s = 0;
  for (const float x : a) s += x;
  return s;
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// 2^t for t below 128 (the callers' t = (score - max) log2 e is <= 0):
// 2^floor(t) * 2^f with f = t - floor(t) in [0, 1] (vreduceps, rounding
// down; within 2^-24 of exact) and a polynomial for 2^f, fitted for
// relative error on [0, 1]: degree 5 (7.5e-8; 1.6e-7 evaluated in fp32) for
// fp32 results, degree 3 (7.5e-5) where the result is rounded to bf16 (2^-9)
// anyway. vscalefps multiplies by 2^floor(t) itself, so the integer part
// costs no instruction: 7 per 16 lanes (bench.py tiles times the forward's
// one-sweep pass over a 256 x 512 tile; vrndscaleps for the integer part and
// f = t - round(t), or n = t - f, were slower). Exactly
// 0 at -inf (vreduceps gives f = 0 and vscalefps 2^-inf = 0) and below
// -149; NaN stays NaN. The callers fold log2 e into their scale and shift,
// so exp(a x - b) costs one fused multiply-add more.
template <bool kForBf16 = false>
inline __m512 exp2_ps(__m512 t) {
  constexpr int kDown = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;
  const __m512 f = _mm512_reduce_ps(t, kDown);
  __m512 y;
  if constexpr (kForBf16) {
    y = _mm512_set1_ps(7.802452147e-2f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.260671556e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.958335638e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999251962e-1f));
  } else {
    y = _mm512_set1_ps(1.877576695e-3f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(8.989340626e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.582631752e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.401536107e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931530833e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999999404e-1f));
  }
  return _mm512_scalef_ps(y, t);
}

// a * log2 e and b * log2 e, rounded once from double: the base-2 scale and
// shift of exp(a x - b).
inline __m512 log2e_times(double a) {
  return _mm512_set1_ps(static_cast<float>(a * 1.4426950408889634));
}

// exp(scale * x - sub) of a row, 16 lanes at a time, handed to
// store(j, e, mask); returns their sum.
template <bool kForBf16 = false, typename Store>
inline float exp_row_lanes(const float* x, int64_t n, float scale, float sub, Store store) {
  const __m512 vs = log2e_times(sub), va = log2e_times(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 e0 = exp2_ps<kForBf16>(_mm512_fmsub_ps(_mm512_loadu_ps(x + j), va, vs));
    const __m512 e1 = exp2_ps<kForBf16>(_mm512_fmsub_ps(_mm512_loadu_ps(x + j + 16), va, vs));
    store(j, e0, __mmask16(0xFFFF));
    store(j + 16, e1, __mmask16(0xFFFF));
    acc0 = _mm512_add_ps(acc0, e0);
    acc1 = _mm512_add_ps(acc1, e1);
  }
  for (; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    // Lanes past the end load -inf: their exponential is 0.
    const __m512 e =
        exp2_ps<kForBf16>(_mm512_fmsub_ps(_mm512_mask_loadu_ps(neg_inf, k, x + j), va, vs));
    store(j, e, k);
    acc0 = _mm512_add_ps(acc0, e);
  }
  return lanes_sum(_mm512_add_ps(acc0, acc1));
}

// exp_row_lanes while each lane's exponent scale * x - sub stays at most cap
// (natural units): returns the sum of the lanes done, and in *done how many:
// n, or the start of the first block (64 lanes, 16 in the tail) with an
// exponent past cap (+inf included), which and whose successors are left
// untouched. NaN lanes pass (their exponential is NaN).
template <bool kForBf16 = false, typename Store>
inline float exp_row_capped_lanes(const float* x, int64_t n, float scale, float sub, float cap,
                                  int64_t* done, Store store) {
  const __m512 vs = log2e_times(sub), va = log2e_times(scale), vcap = log2e_times(cap);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // vmaxps returns its second operand when either is NaN: the running max.
  const auto max = [](__m512 t, __m512 m) { return _mm512_maskz_max_ps(__mmask16(0xFFFF), t, m); };
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    __m512 t[4];
    __m512 m = neg_inf;
    for (int u = 0; u < 4; ++u) {
      t[u] = _mm512_fmsub_ps(_mm512_loadu_ps(x + j + 16 * u), va, vs);
      m = max(t[u], m);
    }
    if (_mm512_cmp_ps_mask(m, vcap, _CMP_GT_OQ) != 0) break;
    for (int u = 0; u < 4; ++u) {
      const __m512 e = exp2_ps<kForBf16>(t[u]);
      store(j + 16 * u, e, __mmask16(0xFFFF));
      if (u % 2 == 0)
        acc0 = _mm512_add_ps(acc0, e);
      else
        acc1 = _mm512_add_ps(acc1, e);
    }
  }
  if (j + 64 > n) {
    for (; j < n; j += 16) {
      const __mmask16 k = tail_mask(n - j);
      // Lanes past the end load -inf: their exponential is 0.
      const __m512 t = _mm512_fmsub_ps(_mm512_mask_loadu_ps(neg_inf, k, x + j), va, vs);
      if (_mm512_cmp_ps_mask(t, vcap, _CMP_GT_OQ) != 0) break;
      const __m512 e = exp2_ps<kForBf16>(t);
      store(j, e, k);
      acc0 = _mm512_add_ps(acc0, e);
    }
  }
  *done = std::min(j, n);
  return lanes_sum(_mm512_add_ps(acc0, acc1));
}

// p and ds of a row's lanes j .. j + 15, handed to store(j, p, ds, mask).
template <bool kForBf16 = false, typename Store>
inline void softmax_grad_lanes(const float* s, const float* dp, int64_t n, RowGrad<float> g,
                               Store store) {
  const __m512 vs = log2e_times(g.s_scale), vl = log2e_times(g.lse);
  const __m512 vc = _mm512_set1_ps(g.ds_scale), vd = _mm512_set1_ps(g.ds_scale * g.delta);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 p = exp2_ps<kForBf16>(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j), vs, vl));
    const __mmask16 nonzero = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    const __m512 ds =
        _mm512_maskz_mul_ps(nonzero, p, _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, dp + j), vc, vd));
    store(j, p, ds, k);
  }
}

#endif

}  // namespace
}  // namespace ring_attention::cpu
