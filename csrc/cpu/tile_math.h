// Small dense building blocks of the CPU kernels: row-major tile GEMM and
// vectorised row operations. acc_t is float (fp16/bf16/fp32 inputs) or
// double (fp64 inputs); tile_t, the type the GEMMs read, is acc_t, or bf16
// where the tile path says so (tile_path.h).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <span>
#include <type_traits>
#include <vector>

#include "softmax_rows.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace ring_attention::cpu {

// Row-major GEMM on strided tiles:
//   C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C
// where op(X) = X, or X^T when trans_X (then X is stored as K x M / N x K).
// Tiles are read in place from (B, L, H, D) tensors through their row stride,
// so fp32/fp64 inputs are never copied. Backed by the BLAS that libtorch
// exports (sgemm_/dgemm_), with a portable loop as fallback.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, double alpha,
          const double* A, int64_t lda, const double* B, int64_t ldb, double beta, double* C,
          int64_t ldc);
// bf16 tiles, fp32 C: MKL's gemm_bf16bf16f32 (exported by libtorch_cpu
// when it is built with MKL), else a plain loop (the kernels call it only
// where has_bf16_gemm()).
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const c10::BFloat16* A, int64_t lda, const c10::BFloat16* B, int64_t ldb, float beta,
          float* C, int64_t ldc);

// Whether libtorch's BLAS has MKL's bf16 GEMM (gemm_bf16bf16f32).
bool has_bf16_gemm();

// Buffers of the kernels' tiles start on a cache line: MKL's bf16 GEMM, for
// one, runs markedly slower into an fp32 C that does not (benchmarks/bench.py
// tiles; a plain std::vector of that size starts 16 bytes into a page).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* ptr, size_t) { ::operator delete(ptr, kAlign); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
};
template <typename T>
using TileBuffer = std::vector<T, CacheLineAllocator<T>>;

// A matrix tile: base pointer and row stride, in elements.
template <typename T>
struct TileRef {
  const T* ptr;
  int64_t ld;
};

// Whether x[0..n) holds no NaN and no infinity (x - x is 0 exactly then).
template <typename T>
inline bool all_finite(const T* x, int64_t n) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // Exponent bits all set: infinity or NaN. (A max over the bits, so that
    // the loop vectorises.)
    const auto* u = reinterpret_cast<const uint16_t*>(x);
    uint16_t e = 0;
    for (int64_t j = 0; j < n; ++j) e = std::max<uint16_t>(e, u[j] & 0x7F80);
    return e != 0x7F80;
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, float>) {
      // x * 0 is 0 for finite x, NaN otherwise: one compare at the end.
      const __m512 zero = _mm512_setzero_ps();
      __m512 acc = zero;
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + j), zero, acc);
      if (j < n)
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(__mmask16((1u << (n - j)) - 1), x + j), zero,
                              acc);
      return _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q) == 0;
    }
#endif
    using Vec = at::vec::Vectorized<T>;
    const T sum = at::vec::map_reduce_all<T>([](Vec a) { return a - a; },
                                             [](Vec a, Vec b) { return a + b; }, x, n);
    return sum == T(0);
  }
}

// Appends j + shift to bad for every row j in [j0, j1) of the tile B (n
// values a row) that holds a NaN or an infinity.
template <typename In>
void non_finite_rows(TileRef<In> B, int64_t j0, int64_t j1, int64_t n, int64_t shift,
                     std::vector<int64_t>& bad) {
  for (int64_t j = j0; j < j1; ++j)
    if (!all_finite(B.ptr + j * B.ld, n)) bad.push_back(j + shift);
}

// C[i] += alpha * A[i, j] * B[j] for the rows j of B in bad (non-finite K/V
// rows the GEMM took as zeros) and the rows i whose weight A[i, j] (row
// stride lda) is not 0: a key a row reaches still propagates its NaN.
template <typename In, typename T>
void add_bad_rows(int64_t M, int64_t N, T alpha, const In* A, int64_t lda, TileRef<In> B,
                  std::span<const int64_t> bad, T* C, int64_t ldc) {
  for (const int64_t j : bad) {
    for (int64_t i = 0; i < M; ++i) {
      const T a = static_cast<T>(A[i * lda + j]);
      if (a == T(0)) continue;
      for (int64_t c = 0; c < N; ++c)
        C[i * ldc + c] += alpha * a * static_cast<T>(B.ptr[j * B.ld + c]);
    }
  }
}

// C = alpha * A[M,K] @ B[K,N] + beta * C, where A (row stride lda) holds
// weights that are 0 for the keys a row does not reach (masked, future,
// another row's segment). 0 * NaN is NaN, so a non-finite K/V row of a key
// nobody reaches would otherwise spread to every row of the tile: the rows
// of B in bad (non_finite_rows, ascending; the callers find them once per
// tile and reuse them) enter as zeros, and their products are added back
// where the weight is not 0.
template <typename In, typename T>
void gemm_weights(int64_t M, int64_t N, int64_t K, T alpha, const In* A, int64_t lda, TileRef<In> B,
                  T beta, T* C, int64_t ldc, std::span<const int64_t> bad, TileBuffer<In>& buf) {
  if (bad.empty()) return gemm(false, false, M, N, K, alpha, A, lda, B.ptr, B.ld, beta, C, ldc);
  buf.resize(K * N);
  for (int64_t j = 0; j < K; ++j) std::copy(B.ptr + j * B.ld, B.ptr + j * B.ld + N, &buf[j * N]);
  for (const int64_t j : bad) std::fill(&buf[j * N], &buf[(j + 1) * N], In(0));
  gemm(false, false, M, N, K, alpha, A, lda, buf.data(), N, beta, C, ldc);
  add_bad_rows(M, N, alpha, A, lda, B, bad, C, ldc);
}

// Scores of one query row (position t) against a key tile (positions u0,
// u0 + r, ..., tk keys) set to -inf where the row does not reach the key:
// after t (causal), or padded (mrow: the tile's key_padding_mask entries at
// stride r, or nullptr).
template <typename T>
inline void mask_row(T* srow, int64_t tk, int64_t t, int64_t u0, int64_t r, bool causal,
                     const bool* mrow) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  int64_t valid = tk;
  if (causal) valid = t < u0 ? 0 : std::min(tk, (t - u0) / r + 1);
  for (int64_t j = valid; j < tk; ++j) srow[j] = neg_inf;
  if (mrow != nullptr) {
    for (int64_t j = 0; j < valid; ++j)
      if (mrow[j * r]) srow[j] = neg_inf;
  }
}

template <typename T>
inline void scale_row(T* x, int64_t n, T s) {
  using Vec = at::vec::Vectorized<T>;
  at::vec::map([s](Vec a) { return a * Vec(s); }, x, x, n);
}

// dst[0..n) = src[0..n), converted.
template <typename D, typename S>
inline void convert_row(D* dst, const S* src, int64_t n) {
  if constexpr (std::is_same_v<D, S>)
    std::copy(src, src + n, dst);
  else
    at::vec::convert(src, dst, n);
}

// Rows first, first + stride, ... of a (B, L, H, D) tensor as a tile_t
// tile: in place when the types agree, else converted into buf (ld = d).
template <typename tile_t, typename scalar_t>
inline TileRef<tile_t> tile_rows(const scalar_t* first, int64_t stride, int64_t rows, int64_t d,
                                 TileBuffer<tile_t>& buf) {
  if constexpr (std::is_same_v<scalar_t, tile_t>) {
    return {first, stride};
  } else {
    if (static_cast<int64_t>(buf.size()) < rows * d) buf.resize(rows * d);
    for (int64_t i = 0; i < rows; ++i) convert_row(&buf[i * d], first + i * stride, d);
    return {buf.data(), d};
  }
}

// Rows row_ptr(0), ..., row_ptr(rows - 1) (pointers into (B, L, H, D)
// tensors, e.g. the rows of several heads stacked) as one tile_t tile in buf.
template <typename tile_t, typename RowPtr>
inline TileRef<tile_t> gather_rows(int64_t rows, int64_t d, TileBuffer<tile_t>& buf,
                                   RowPtr row_ptr) {
  if (static_cast<int64_t>(buf.size()) < rows * d) buf.resize(rows * d);
  for (int64_t i = 0; i < rows; ++i) convert_row(&buf[i * d], row_ptr(i), d);
  return {buf.data(), d};
}

// The weights (P or dS, acc_t) as the GEMMs read them: the acc_t rows
// themselves, or rows rounded to tile_t into buf (round_row; a no-op when
// the types agree; the softmax passes of softmax_rows.h write the rounded
// rows directly, into row(offset)).
template <typename tile_t, typename acc_t>
struct Weights {
  static constexpr bool kRounded = !std::is_same_v<tile_t, acc_t>;
  Lanes lanes;  // of the fp32 passes (the tile path's)
  TileBuffer<tile_t> buf;

  explicit Weights(Lanes lanes_) : lanes(lanes_) {}
  void reserve(int64_t n) {
    if constexpr (kRounded)
      if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  }
  void round_row(const acc_t* w, int64_t offset, int64_t n) {
    if constexpr (kRounded) at::vec::convert(w, buf.data() + offset, n);
  }
  tile_t* row(int64_t offset) { return buf.data() + offset; }
  // Row w (at offset) set to exp(scale * w - sub); returns the sum of the
  // exponentials.
  acc_t exp_row(acc_t* w, int64_t offset, int64_t n, acc_t scale, acc_t sub) {
    if constexpr (kRounded)
      return cpu::exp_row(w, n, scale, sub, row(offset));
    else
      return cpu::exp_row(w, n, scale, sub, lanes);
  }
  // The same with a shift that rises only past cap (softmax_rows.h).
  acc_t exp_row_lazy(acc_t* w, int64_t offset, int64_t n, acc_t scale, acc_t* shift, acc_t cap) {
    if constexpr (kRounded)
      return cpu::exp_row_lazy(w, n, scale, shift, cap, row(offset));
    else
      return cpu::exp_row_lazy(w, n, scale, shift, cap, lanes);
  }
  void zero_row(acc_t* w, int64_t offset, int64_t n) {
    if constexpr (kRounded)
      std::fill(row(offset), row(offset) + n, tile_t(0));
    else
      std::fill(w, w + n, acc_t(0));
  }
  const tile_t* of(const acc_t* w) const {
    if constexpr (std::is_same_v<tile_t, acc_t>)
      return w;
    else
      return buf.data();
  }
  tile_t* of(acc_t* w) {
    if constexpr (std::is_same_v<tile_t, acc_t>)
      return w;
    else
      return buf.data();
  }
};

// The online softmax's rescale after a key tile, for rows [0, n): a row
// whose shift rose from m to m_next has its sum l and output row o_i (d
// values) scaled by exp(m - m_next) before the tile's row sum is added
// (alpha: n values of scratch; the exponentials run vectorised over rows).
template <typename acc_t>
void rescale_rows(int64_t n, int64_t d, acc_t* m, const acc_t* m_next, acc_t* l,
                  const acc_t* row_sum, acc_t* o, acc_t* alpha) {
  // exp(m - m_next): 1 where the shift stayed (-inf included), 0 where it
  // rose from -inf (the row's o is still 0 then).
  // (Sleef's exponential, whose exp(0) is 1 exactly: no rescale then.)
  for (int64_t i = 0; i < n; ++i) alpha[i] = m[i] == m_next[i] ? acc_t(0) : m[i] - m_next[i];
  exp_row(alpha, n, acc_t(1), acc_t(0), Lanes::kVec);
  for (int64_t i = 0; i < n; ++i) {
    l[i] = l[i] * alpha[i] + row_sum[i];
    if (alpha[i] != acc_t(1)) scale_row(o + i * d, d, alpha[i]);
    m[i] = m_next[i];
  }
}

// Merge a block's unnormalised rows (o_i / l_i with lse m_i + log l_i) into
// the running accumulators (out(i) -> d values, lse(i) -> one), for rows
// [0, n). The logarithms and exponentials run vectorised over the rows (a
// tile's rows merge once per branch, and per row they cost as much as the
// merge's arithmetic); scratch: 4n values.
template <typename acc_t, typename RowOut, typename RowLse>
void merge_rows(int64_t n, int64_t d, const acc_t* o, const acc_t* m, const acc_t* l, RowOut out,
                RowLse lse, acc_t* scratch) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const Vec pos_inf(std::numeric_limits<acc_t>::infinity());
  // The block's lse, the merged lse, and the weights of the running and the
  // block's rows (1 / l folded into the latter). A +inf score makes the
  // shift +inf and l NaN (exp(inf - inf)): that lse is +inf, not NaN.
  acc_t *blk = scratch, *merged = scratch + n, *wa = scratch + 2 * n, *wb = scratch + 3 * n;
  for (int64_t i = 0; i < n; ++i) merged[i] = *lse(i);
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int64_t c = std::min<int64_t>(Vec::size(), n - i);
    const Vec run = Vec::loadu(merged + i, c), vl = Vec::loadu(l + i, c);
    const Vec shift = Vec::loadu(m + i, c);
    const Vec b = Vec::blendv(shift + vl.log(), shift, shift == pos_inf);
    const Vec hi = at::vec::maximum(run, b), lo = at::vec::minimum(run, b);
    const Vec both = Vec::blendv(hi + (lo - hi).exp().log1p(), hi, hi == pos_inf);
    b.store(blk + i, c);
    both.store(merged + i, c);
    (run - both).exp().store(wa + i, c);
    ((b - both).exp() / vl).store(wb + i, c);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!(l[i] > acc_t(0)) && !std::isnan(l[i])) continue;  // reaches nothing
    acc_t* dst = out(i);
    acc_t& row_lse = *lse(i);
    const acc_t* src = o + i * d;
    if (row_lse == neg_inf || std::isnan(blk[i])) {  // first block, or a NaN one: taken as is
      const acc_t inv = acc_t(1) / l[i];
      for (int64_t j = 0; j < d; ++j) dst[j] = src[j] * inv;
      row_lse = blk[i];
      continue;
    }
    const acc_t a = wa[i], b = wb[i];
    for (int64_t j = 0; j < d; ++j) dst[j] = dst[j] * a + src[j] * b;
    row_lse = merged[i];
  }
}

}  // namespace ring_attention::cpu
