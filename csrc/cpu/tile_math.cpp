#include "tile_math.h"

#include <dlfcn.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace ring_attention::cpu {
namespace {

// Fortran BLAS (LP64), as exported by libtorch_cpu (MKL or OpenBLAS): In
// inputs, T alpha, beta and C (MKL's gemm_bf16bf16f32 has bf16 inputs).
template <typename In, typename T = In>
using blas_gemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*,
                              const T*, const In*, const int*, const In*, const int*, const T*, T*,
                              const int*);

// libtorch_cpu is loaded with local symbol scope, so look inside it by name.
template <typename Fn>
Fn find_blas(const char* name) {
  void* sym = dlsym(RTLD_DEFAULT, name);
  if (sym == nullptr) {
    if (void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD)) sym = dlsym(lib, name);
  }
  return reinterpret_cast<Fn>(sym);
}

template <typename In, typename T>
void gemm_loops(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const In* A,
                int64_t lda, const In* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      T acc = 0;
      for (int64_t k = 0; k < K; ++k)
        acc += static_cast<T>(ta ? A[k * lda + i] : A[i * lda + k]) *
               static_cast<T>(tb ? B[j * ldb + k] : B[k * ldb + j]);
      C[i * ldc + j] = alpha * acc + (beta == T(0) ? T(0) : beta * C[i * ldc + j]);
    }
  }
}

// BLAS takes 32-bit strides. A row stride beyond that (dilated rows of many
// wide heads: r * heads * head_dim > 2**31 - 1) goes through a dense copy.
constexpr int64_t kMaxLd = std::numeric_limits<int>::max();

template <typename T>
void copy_rows(const T* src, int64_t src_ld, T* dst, int64_t dst_ld, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i)
    std::copy(src + i * src_ld, src + i * src_ld + cols, dst + i * dst_ld);
}

template <typename In, typename T>
void gemm_impl(blas_gemm_fn<In, T> blas, bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha,
               const In* A, int64_t lda, const In* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (blas == nullptr) return gemm_loops(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  if (lda > kMaxLd || ldb > kMaxLd || ldc > kMaxLd) {
    // Stored shapes: A is (K, M) when transposed else (M, K); B (N, K) or (K, N).
    const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K;
    const int64_t b_rows = tb ? N : K, b_cols = tb ? K : N;
    std::vector<In> a, b;
    std::vector<T> c;
    if (lda > kMaxLd) {
      a.resize(a_rows * a_cols);
      copy_rows(A, lda, a.data(), a_cols, a_rows, a_cols);
      A = a.data();
      lda = a_cols;
    }
    if (ldb > kMaxLd) {
      b.resize(b_rows * b_cols);
      copy_rows(B, ldb, b.data(), b_cols, b_rows, b_cols);
      B = b.data();
      ldb = b_cols;
    }
    if (ldc <= kMaxLd) return gemm_impl(blas, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    c.resize(M * N);
    copy_rows<T>(C, ldc, c.data(), N, M, N);
    gemm_impl(blas, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, c.data(), N);
    copy_rows<T>(c.data(), N, C, ldc, M, N);
    return;
  }
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
  const char ca = ta ? 'T' : 'N', cb = tb ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int ia = static_cast<int>(lda), ib = static_cast<int>(ldb), ic = static_cast<int>(ldc);
  blas(&cb, &ca, &m, &n, &k, &alpha, B, &ib, A, &ia, &beta, C, &ic);
}

}  // namespace

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  static const auto blas = find_blas<blas_gemm_fn<float>>("sgemm_");
  gemm_impl(blas, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
          int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  static const auto blas = find_blas<blas_gemm_fn<double>>("dgemm_");
  gemm_impl(blas, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

namespace {
blas_gemm_fn<c10::BFloat16, float> bf16_blas() {
  static const auto blas = find_blas<blas_gemm_fn<c10::BFloat16, float>>("gemm_bf16bf16f32_");
  return blas;
}
}  // namespace

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const c10::BFloat16* A,
          int64_t lda, const c10::BFloat16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  gemm_impl(bf16_blas(), ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

bool has_bf16_gemm() { return bf16_blas() != nullptr; }

}  // namespace ring_attention::cpu
