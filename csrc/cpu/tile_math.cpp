#include "tile_math.h"

#include <dlfcn.h>

namespace ring_attention::cpu {
namespace {

// Fortran BLAS (LP64), as exported by libtorch_cpu (MKL or OpenBLAS).
template <typename T>
using blas_gemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*,
                              const T*, const T*, const int*, const T*, const int*, const T*, T*,
                              const int*);

// libtorch_cpu is loaded with local symbol scope, so look inside it by name.
template <typename T>
blas_gemm_fn<T> find_blas(const char* name) {
  void* sym = dlsym(RTLD_DEFAULT, name);
  if (sym == nullptr) {
    if (void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD)) sym = dlsym(lib, name);
  }
  return reinterpret_cast<blas_gemm_fn<T>>(sym);
}

template <typename T>
void gemm_loops(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda,
                const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      T acc = 0;
      for (int64_t k = 0; k < K; ++k)
        acc += (ta ? A[k * lda + i] : A[i * lda + k]) * (tb ? B[j * ldb + k] : B[k * ldb + j]);
      C[i * ldc + j] = alpha * acc + (beta == T(0) ? T(0) : beta * C[i * ldc + j]);
    }
  }
}

template <typename T>
void gemm_impl(blas_gemm_fn<T> blas, bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha,
               const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (blas == nullptr) return gemm_loops(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
  const char ca = ta ? 'T' : 'N', cb = tb ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int ia = static_cast<int>(lda), ib = static_cast<int>(ldb), ic = static_cast<int>(ldc);
  blas(&cb, &ca, &m, &n, &k, &alpha, B, &ib, A, &ia, &beta, C, &ic);
}

}  // namespace

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  static const blas_gemm_fn<float> blas = find_blas<float>("sgemm_");
  gemm_impl(blas, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
          int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  static const blas_gemm_fn<double> blas = find_blas<double>("dgemm_");
  gemm_impl(blas, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace ring_attention::cpu
