// Small dense building blocks of the CPU kernels: row-major tile GEMM and
// vectorised row operations. acc_t is float (fp16/bf16/fp32 inputs) or
// double (fp64 inputs).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace ring_attention::cpu {

// Tiles are padded to multiples of this, so oneDNN's brgemm JIT cache sees a
// bounded set of shapes.
constexpr int64_t kTilePad = 16;

inline int64_t pad_tile(int64_t n) { return (n + kTilePad - 1) / kTilePad * kTilePad; }

// True when ATen's brgemm (oneDNN ukernel) runs fp32 on this CPU.
bool brgemm_f32_available();

// C[M,N] (+)= A[M,K] @ B[K,N], all row-major with leading dimensions.
template <typename T>
inline void gemm_fallback(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda,
                          const T* B, int64_t ldb, T* C, int64_t ldc, bool add_c) {
  using Vec = at::vec::Vectorized<T>;
  const int64_t vn = N - N % Vec::size();
  for (int64_t i = 0; i < M; ++i) {
    T* c = C + i * ldc;
    if (!add_c) std::fill(c, c + N, T(0));
    for (int64_t kk = 0; kk < K; ++kk) {
      const T a = A[i * lda + kk];
      if (a == T(0)) continue;
      const T* b = B + kk * ldb;
      const Vec av(a);
      int64_t j = 0;
      for (; j < vn; j += Vec::size()) {
        at::vec::fmadd(av, Vec::loadu(b + j), Vec::loadu(c + j)).store(c + j);
      }
      for (; j < N; ++j) c[j] += a * b[j];
    }
  }
}

template <typename T>
inline void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
                 int64_t ldb, T* C, int64_t ldc, bool add_c) {
  if constexpr (std::is_same_v<T, float>) {
    if (brgemm_f32_available()) {
      at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_c, A, B, C);
      return;
    }
  }
  gemm_fallback<T>(M, N, K, A, lda, B, ldb, C, ldc, add_c);
}

// Row maximum that propagates NaN (a NaN score must not be hidden).
template <typename T>
inline T row_max(const T* x, int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) m = (x[j] > m || std::isnan(x[j])) ? x[j] : m;
  return m;
}

template <typename T>
inline T max_nan(T a, T b) {
  return (std::isnan(a) || a > b) ? a : b;
}

// x[j] = exp(x[j] - sub); returns the sum. exp(-inf) = 0 for masked entries.
template <typename T>
inline T exp_sub_sum(T* x, int64_t n, T sub) {
  using Vec = at::vec::Vectorized<T>;
  T sum = 0;
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    const Vec vs(sub);
    Vec acc(0);
    for (; j + Vec::size() <= n; j += Vec::size()) {
      Vec e = (Vec::loadu(x + j) - vs).exp_u20();
      e.store(x + j);
      acc = acc + e;
    }
    sum = at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, acc);
  }
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - sub);
    sum += x[j];
  }
  return sum;
}

template <typename T>
inline void scale_row(T* x, int64_t n, T s) {
  using Vec = at::vec::Vectorized<T>;
  at::vec::map([s](Vec a) { return a * Vec(s); }, x, x, n);
}

// Convert n elements of src to acc_t, multiplied by s.
template <typename acc_t, typename scalar_t>
inline void load_row(acc_t* dst, const scalar_t* src, int64_t n, acc_t s) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<acc_t>(src[j]) * s;
}

// Merge a block's normalised (o, lse) into running accumulators (out, lse).
template <typename acc_t>
inline void merge_row(acc_t* out, acc_t& lse, const acc_t* o, acc_t blk_lse, int64_t d) {
  constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  if (blk_lse == neg_inf) return;
  if (lse == neg_inf || std::isnan(blk_lse)) {
    std::copy(o, o + d, out);
    lse = blk_lse;
    return;
  }
  const acc_t hi = std::max(lse, blk_lse), lo = std::min(lse, blk_lse);
  const acc_t new_lse = hi + std::log1p(std::exp(lo - hi));
  const acc_t a = std::exp(lse - new_lse), b = std::exp(blk_lse - new_lse);
  for (int64_t j = 0; j < d; ++j) out[j] = out[j] * a + o[j] * b;
  lse = new_lse;
}

}  // namespace ring_attention::cpu
