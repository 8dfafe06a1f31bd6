#include "softmax_rows.h"

#include "softmax_lanes.h"

namespace ring_attention::cpu {

float row_max(const float* x, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // vmaxps returns its second operand when either is NaN: the running max.
  // (The zero-masking form with a full mask: GCC 12's plain _mm512_max_ps
  // reads an undefined register and warns.)
  const auto max = [](__m512 x, __m512 m) { return _mm512_maskz_max_ps(__mmask16(0xFFFF), x, m); };
  __m512 m0 = neg_inf, m1 = neg_inf, m2 = neg_inf, m3 = neg_inf;
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    m0 = max(_mm512_loadu_ps(x + j), m0);
    m1 = max(_mm512_loadu_ps(x + j + 16), m1);
    m2 = max(_mm512_loadu_ps(x + j + 32), m2);
    m3 = max(_mm512_loadu_ps(x + j + 48), m3);
  }
  for (; j < n; j += 16) m0 = max(_mm512_mask_loadu_ps(neg_inf, tail_mask(n - j), x + j), m0);
  return lanes_max(max(max(m0, m1), max(m2, m3)));
#else
#if defined(__x86_64__)
  // (Exact in any lanes: the widest the CPU has.)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return avx2::row_max(x, n);
#endif
  return row_max_vec(x, n);
#endif
}
double row_max(const double* x, int64_t n) { return row_max_vec(x, n); }

template <typename T>
static bool has_nan_loop(const T* x, int64_t n) {
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) nan |= x[j] != x[j];
  return nan;
}
bool has_nan(const float* x, int64_t n) { return has_nan_loop(x, n); }
bool has_nan(const double* x, int64_t n) { return has_nan_loop(x, n); }

namespace {

#if defined(CPU_CAPABILITY_AVX512)
float exp_row_avx512(float* x, int64_t n, float scale, float sub) {
  return exp_row_lanes(x, n, scale, sub, [x](int64_t j, __m512 e, __mmask16 k) {
    _mm512_mask_storeu_ps(x + j, k, e);
  });
}

float exp_row_lazy_avx512(float* x, int64_t n, float scale, float* shift, float cap) {
  int64_t done = 0;
  const float sum = exp_row_capped_lanes(
      x, n, scale, *shift, cap, &done,
      [x](int64_t j, __m512 e, __mmask16 k) { _mm512_mask_storeu_ps(x + j, k, e); });
  if (done == n) return sum;
  // Past the cap: shift by the maximum of the lanes left (all those done are
  // below it) and bring the lanes done to that shift.
  const float m = row_max(x + done, n - done) * scale;
  const float f = std::exp(*shift - m);
  for (int64_t j = 0; j < done; ++j) x[j] *= f;
  *shift = m;
  return sum * f + exp_row_avx512(x + done, n - done, scale, m);
}

void softmax_grad_row_avx512(float* s, float* dp, int64_t n, RowGrad<float> g) {
  softmax_grad_lanes(s, dp, n, g, [s, dp](int64_t j, __m512 p, __m512 ds, __mmask16 k) {
    _mm512_mask_storeu_ps(s + j, k, p);
    _mm512_mask_storeu_ps(dp + j, k, ds);
  });
}
#endif

}  // namespace

// Lanes::kAvx512 only in builds for it, kAvx2 only on x86-64 (select_path).
float exp_row(float* x, int64_t n, float scale, float sub, Lanes lanes) {
#if defined(CPU_CAPABILITY_AVX512)
  if (lanes == Lanes::kAvx512) return exp_row_avx512(x, n, scale, sub);
#endif
#if defined(__x86_64__)
  if (lanes == Lanes::kAvx2) return avx2::exp_row(x, n, scale, sub);
#endif
  return exp_row_vec(x, n, scale, sub, x);
}
double exp_row(double* x, int64_t n, double scale, double sub, Lanes) {
  return exp_row_vec(x, n, scale, sub, x);
}

float exp_row_lazy(float* x, int64_t n, float scale, float* shift, float cap, Lanes lanes) {
#if defined(CPU_CAPABILITY_AVX512)
  if (lanes == Lanes::kAvx512) return exp_row_lazy_avx512(x, n, scale, shift, cap);
#endif
#if defined(__x86_64__)
  if (lanes == Lanes::kAvx2) return avx2::exp_row_lazy(x, n, scale, shift, cap);
#endif
  return exp_row_lazy_vec(x, n, scale, shift, cap, x);
}
double exp_row_lazy(double* x, int64_t n, double scale, double* shift, double cap, Lanes) {
  return exp_row_lazy_vec(x, n, scale, shift, cap, x);
}

void softmax_grad_row(float* s, float* dp, int64_t n, RowGrad<float> g, Lanes lanes) {
#if defined(CPU_CAPABILITY_AVX512)
  if (lanes == Lanes::kAvx512) return softmax_grad_row_avx512(s, dp, n, g);
#endif
#if defined(__x86_64__)
  if (lanes == Lanes::kAvx2) return avx2::softmax_grad_row(s, dp, n, g);
#endif
  softmax_grad_row_vec(s, dp, n, g, s, dp);
}
void softmax_grad_row(double* s, double* dp, int64_t n, RowGrad<double> g, Lanes) {
  softmax_grad_row_vec(s, dp, n, g, s, dp);
}

}  // namespace ring_attention::cpu
