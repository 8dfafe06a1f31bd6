// The softmax passes over one row of scores (fp32 or fp64), between the
// GEMMs of the CPU kernels. The fp32 passes run in the lanes the tile path
// names (tile_path.h): 16 of AVX-512 with an exponential of 7 vector
// instructions (softmax_lanes.h), 8 of AVX2 + FMA with one of 11 (avx2_exp.h,
// softmax_rows_avx2.cpp), or at::vec with Sleef's exponential; the bf16-tile
// kernels get P and dS already rounded to bf16 from the same pass (one read
// of the row instead of three passes over it).
//
// Non-finite values: a masked score is -inf and its weight is exactly 0; a
// NaN score stays NaN through exp (so it reaches l, P and the output); the
// row maximum skips NaN, so a finite maximum still scales the other entries.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <limits>

namespace ring_attention::cpu {

// The vector code of the fp32 passes (fp64 always runs at::vec).
enum class Lanes : uint8_t { kVec, kAvx2, kAvx512 };

// Maximum of x[0..n) over its non-NaN entries; -inf when there are none.
float row_max(const float* x, int64_t n);
double row_max(const double* x, int64_t n);

// Whether x[0..n) holds a NaN.
bool has_nan(const float* x, int64_t n);
bool has_nan(const double* x, int64_t n);

// x[j] = exp(scale * x[j] - sub) for j < n; returns the sum of the new x.
float exp_row(float* x, int64_t n, float scale, float sub, Lanes lanes);
double exp_row(double* x, int64_t n, double scale, double sub, Lanes lanes);
// p[j] = bf16(exp(scale * x[j] - sub)), x unchanged; returns the sum of the
// unrounded exponentials (to a relative 1e-4: the bf16 rounding of p is
// 4e-3). Only where the CPU has avx512_bf16 (bf16_tiles()).
float exp_row(const float* x, int64_t n, float scale, float sub, c10::BFloat16* p);

// exp_row with a shift that need not be the row's maximum: x[j] =
// exp(scale * x[j] - *shift) while every scale * x[j] - *shift <= cap (so
// the weights stay below e^cap); where the row's maximum passes that,
// *shift is raised to scale * max first. Returns the sum. The online
// softmax keeps its running shift (and skips rescaling its accumulators)
// unless a tile's maximum rises past it by cap, and needs no separate pass
// for the maximum. *shift finite.
float exp_row_lazy(float* x, int64_t n, float scale, float* shift, float cap, Lanes lanes);
double exp_row_lazy(double* x, int64_t n, double scale, double* shift, double cap, Lanes lanes);
// The same with p[j] = bf16(...), x unchanged (avx512_bf16 only).
float exp_row_lazy(const float* x, int64_t n, float scale, float* shift, float cap,
                   c10::BFloat16* p);

// The constants of one row's backward: p = exp(s_scale * s - lse) and
// ds = ds_scale * p * (dp - delta). (The scale enters here where a GEMM
// left S unscaled, and through ds_scale where dS feeds GEMMs without one.)
template <typename T>
struct RowGrad {
  T s_scale, lse, ds_scale, delta;
};

// Backward of one row with a finite lse: p and ds as RowGrad says, with
// ds = 0 where p = 0 (a masked key's dp may be NaN from its V row). In place
// (s becomes p, dp becomes ds), or rounded to bf16 into p_out and ds_out (s
// and dp unchanged; avx512_bf16 only).
void softmax_grad_row(float* s, float* dp, int64_t n, RowGrad<float> g, Lanes lanes);
void softmax_grad_row(double* s, double* dp, int64_t n, RowGrad<double> g, Lanes lanes);
void softmax_grad_row(const float* s, const float* dp, int64_t n, RowGrad<float> g,
                      c10::BFloat16* p_out, c10::BFloat16* ds_out);

// softmax_grad_row for a row whose lse is not finite (it reaches a
// non-finite key): its masked keys (score -inf) keep P = dS = 0, since
// exp(-inf - NaN) would be NaN and reach the gradients of keys the row does
// not reach; its reached keys give NaN, as they should.
template <typename T>
inline void softmax_grad_row_nonfinite(T* s, T* dp, int64_t n, RowGrad<T> g) {
  for (int64_t j = 0; j < n; ++j) {
    if (s[j] == -std::numeric_limits<T>::infinity()) {
      s[j] = T(0);
      dp[j] = T(0);
    } else {
      s[j] = std::exp(g.s_scale * s[j] - g.lse);
      dp[j] = s[j] == T(0) ? T(0) : g.ds_scale * s[j] * (dp[j] - g.delta);
    }
  }
}

// Lanes::kAvx2 (softmax_rows_avx2.cpp; x86-64 only, the CPU must have AVX2
// and FMA).
namespace avx2 {
float row_max(const float* x, int64_t n);
float exp_row(float* x, int64_t n, float scale, float sub);
float exp_row_lazy(float* x, int64_t n, float scale, float* shift, float cap);
void softmax_grad_row(float* s, float* dp, int64_t n, RowGrad<float> g);
}  // namespace avx2

}  // namespace ring_attention::cpu
