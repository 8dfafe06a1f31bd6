// K and V tiles packed once, and the GEMMs that read them: oneDNN's
// batch-reduce GEMM (at::native::cpublas::brgemm, exported by libtorch). For
// bf16 (AMX, or avx512_bf16's dot products) its B operand is in VNNI layout
// (pairs of rows along the reduction interleaved); for fp32 plain and
// contiguous, and without AVX-512 (where brgemm has no fp32 kernels) the
// same layouts go to the AVX2 kernels of packed_tiles_avx2.cpp. A key tile
// is packed once and reused by every query tile that attends to it; the GEMM
// reads Q and P in place. That beats MKL's bf16 GEMM, which copies both
// operands at every call, on AMX (`benchmarks/bench.py tiles` times both at
// the forward's tile shapes) and without it (AMD Zen 4, avx512_bf16: there
// MKL's bf16 GEMM converts to fp32); figures in benchmarks/RESULTS.md.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <span>
#include <vector>

#include "tile_math.h"
#include "tile_path.h"

namespace ring_attention::cpu {

// Whether libtorch's brgemm multiplies bf16 operands in VNNI layout here:
// the CPU has bf16 dot products (avx512_bf16; AMX CPUs have them too),
// oneDNN is on (torch.backends.mkldnn; asked at every call) and a first
// small product through it gave the right result (libtorch built without
// oneDNN's ukernels refuses it).
bool bf16_brgemm();

// K rows k[j * ld ...], j < w, each d wide, as the B operand (d x w) of
// S = Q K^T: out holds d * w values.
void pack_keys(const c10::BFloat16* k, int64_t ld, int64_t w, int64_t d, c10::BFloat16* out);

// V rows (w of them) as the B operand (w' x d) of O = P V, w' = w rounded up
// to even (the pad row is 0): out holds w' * d values. Rows listed in zero
// (ascending, < w) enter as zeros.
void pack_values(const c10::BFloat16* v, int64_t ld, int64_t w, int64_t d,
                 std::span<const int64_t> zero, c10::BFloat16* out);

// C[M, N] (row stride ldc) = A[M, K] (row stride lda) @ B, or += when
// accumulate (kernel: kBf16Packed, or kFp32Split for its bf16 parts); B packed by pack_keys (ldb =
// w; N <= w: its first N keys) or pack_values (ldb = d = N; K <= w', even: its first K rows).
//
// libtorch's brgemm sets up the AMX tiles only when its kernel changes, so
// a thread calls release_packed_gemm() before any other GEMM (MKL's release
// the tiles when they finish) and after its last gemm_packed.
void gemm_packed(TileGemm kernel, int64_t M, int64_t N, int64_t K, const c10::BFloat16* A,
                 int64_t lda, const c10::BFloat16* B, int64_t ldb, float* C, int64_t ldc,
                 bool accumulate);

void release_packed_gemm();

// out (cols x rows', contiguous; rows' = rows rounded up to even, the pad
// column 0) = the transpose of rows x cols at src (row stride ld): the A
// operand of a product whose reduction runs over src's rows, against a B
// operand that pack_values packed (the backward's dV^T = dO^T P).
void transpose_tile(const c10::BFloat16* src, int64_t ld, int64_t rows, int64_t cols,
                    c10::BFloat16* out);

// fp32 K and V in the same roles, plain row-major and contiguous (K^T as
// d x w, V as w x d), for brgemm's fp32 kernels (AVX-512) or the AVX2 ones
// (tile_path.h: TileGemm kFp32Brgemm, kFp32Split, kFp32Avx2).
// out (cols x rows, contiguous) = the transpose of rows x cols at src (row
// stride ld): 16 x 16 blocks in AVX-512 registers where built for it, else
// 8 x 8 in AVX2 registers where the CPU has them.
void transpose_tile(const float* src, int64_t ld, int64_t rows, int64_t cols, float* out);
void pack_keys(const float* k, int64_t ld, int64_t w, int64_t d, float* out);
void pack_values(const float* v, int64_t ld, int64_t w, int64_t d, std::span<const int64_t> zero,
                 float* out);

// pack_values of rows not yet looked at: appends j + shift to bad (in
// order) for each row j < w holding a NaN or an infinity, which enters as
// zeros. fp32 reads the strided rows from memory once (the copy is checked
// in L1) instead of a check (non_finite_rows) and then a copy; bf16 (VNNI
// interleaves rows in pairs) checks first and packs from cache.
void pack_values_checked(const c10::BFloat16* v, int64_t ld, int64_t w, int64_t d, int64_t shift,
                         std::vector<int64_t>& bad, c10::BFloat16* out);
void pack_values_checked(const float* v, int64_t ld, int64_t w, int64_t d, int64_t shift,
                         std::vector<int64_t>& bad, float* out);
// The fp32 product through `kernel`'s GEMM: the AVX2 kernels for
// kFp32Avx2, else brgemm's fp32 kernels.
void gemm_packed(TileGemm kernel, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate);

// The AVX2 kernels (packed_tiles_avx2.cpp; x86-64 only, the CPU must have
// AVX2 and FMA): C[M, N] (+)= A[M, K] @ B[K, N], all row-major with row
// strides; and out[c * ld_out + i] = src[i * ld + c] (i < rows, c < cols).
namespace avx2 {
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
          float* C, int64_t ldc, bool accumulate);
void transpose(const float* src, int64_t ld, int64_t rows, int64_t cols, float* out,
               int64_t ld_out);
// gemm (not accumulating) with the forward's softmax pass on a row's later
// key tiles in its epilogue, while the block is in registers: C[i, j] =
// exp(scale * S[i, j] - shift[i]) for S = A B, the weights exp_row_lazy
// gives with Lanes::kAvx2 bit for bit, and sums[i] their sum (in another
// order). Where a score of row i passes its shift by more than cap,
// passed[i] = 1 and its row of C and sums[i] are not of use: the caller
// computes that row's scores again (gemm, M = 1: the same scores) and runs
// exp_row_lazy on them.
void gemm_exp(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
              int64_t ldb, float* C, int64_t ldc, float scale, const float* shift, float cap,
              float* sums, uint8_t* passed);
}  // namespace avx2

// C[rows, N] (+)= W[rows, tk] @ B for weights W (P or dS; row stride ldw,
// rows of at least tk + 1 values) and B the tile's rows bt as pack_values
// packed them (its non-finite rows bad entered as zeros): an odd bf16 tile's
// pad weight is set to 0 first, and the products of the bad rows are added
// back where a weight is not 0 (tile_math.h, gemm_weights).
template <typename T>
void gemm_weights_packed(TileGemm kernel, int64_t rows, int64_t N, int64_t tk, T* W, int64_t ldw,
                         const T* packed, TileRef<T> bt, std::span<const int64_t> bad, float* C,
                         int64_t ldc, bool accumulate) {
  constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
  const int64_t pad = kPairs ? tk % 2 : 0;
  if (pad == 1)
    for (int64_t i = 0; i < rows; ++i) W[i * ldw + tk] = T(0);
  gemm_packed(kernel, rows, N, tk + pad, W, ldw, packed, N, C, ldc, accumulate);
  add_bad_rows(rows, N, 1.0f, W, ldw, bt, bad, C, ldc);
}

}  // namespace ring_attention::cpu
