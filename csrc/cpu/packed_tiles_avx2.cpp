// The fp32 products of the packed tiles in AVX2 + FMA (TileGemm::kFp32Avx2):
// libtorch's brgemm has fp32 kernels only for AVX-512, and MKL's sgemm on
// the tiles in place copies both operands at every call (on an AVX2-only
// AMD EPYC a large share of the forward's time; benchmarks/RESULTS.md).
// Compiled for AVX2 in every x86-64 build (the target pragma below);
// select_path() picks it only where the CPU has AVX2 and FMA.
//
// C (M x N) is computed in blocks of 6 rows x 16 columns held in 12
// registers: per step along the reduction, two loads of B's row and six
// broadcasts of A's entries feed 12 fused multiply-adds. The reduction runs
// in slices of kKc, 24 rows of A at a time, so that A's slice (24 x kKc)
// and a 16-column panel of B's (kKc x 16) stay in L1 while the panel serves
// four row blocks. Where B's rows would fall into few L1 sets (a row stride
// of 1 or 2 KiB: K^T of 256 or 512 keys) its panels are copied contiguous
// first, each serving all of A's rows. Ragged edges: fewer rows, and 8 or
// fewer columns in the last panel with masked loads and stores (nothing past
// N is read or written). Exact IEEE fp32 arithmetic (fused multiply-adds, in order along
// the reduction within a slice). gemm_exp: the forward's S with the softmax
// pass (avx2_exp.h) in the blocks' epilogue, on B's panels copied contiguous.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "packed_tiles.h"

#if defined(__x86_64__)
#include <immintrin.h>

// After the library headers: their inline functions are shared with the other
// units and must not be compiled for a wider ISA than the build's.
#pragma GCC push_options
#pragma GCC target("avx2,fma")

#include "avx2_exp.h"

namespace ring_attention::cpu::avx2 {
namespace {

constexpr int kMr = 6;        // rows of a register block
constexpr int64_t kNr = 16;   // columns of a register block (two vectors)
constexpr int64_t kKc = 256;  // reduction slice
constexpr int64_t kMb = 24;   // rows of A per slice and panel

// Lanes below n (1..8) on.
inline __m256i lane_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The softmax pass in the epilogue of S's blocks (gemm_exp): the base-2
// scale, cap and per-row shifts of exp_row_lazy, and what it leaves per row.
struct ExpRows {
  __m256 va, vcap;
  const float* shift2;  // per row: its shift times log2 e
  float* lanes;         // per row: 8 lane sums of its weights
  uint8_t* passed;      // per row: 1 where a score passed the cap
};

// C[MR x 8 NV] (+)= A[MR x K] B[K x 8 NV]; where kMasked, the last vector's
// lanes outside `mask` are neither read from B nor read or written in C.
// kExp: C gets the weights exp2(C va - shift2) instead, rows `row` on of ep.
template <int MR, int NV, bool kMasked, bool kExp>
void block(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
           int64_t ldc, bool accumulate, __m256i mask, const ExpRows* ep, int64_t row) {
  __m256 c[MR][NV];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) c[i][v] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    __m256 b[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v)
      b[v] = kMasked && v == NV - 1 ? _mm256_maskload_ps(B + k * ldb + 8 * v, mask)
                                    : _mm256_loadu_ps(B + k * ldb + 8 * v);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(A + i * lda + k);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) c[i][v] = _mm256_fmadd_ps(a, b[v], c[i][v]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const float* dst = C + i * ldc + 8 * v;
      if (accumulate)
        c[i][v] = _mm256_add_ps(
            c[i][v], kMasked && v == NV - 1 ? _mm256_maskload_ps(dst, mask) : _mm256_loadu_ps(dst));
    }
    if constexpr (kExp) {
      // exp_row_lazy's pass on the block's row (the same t, so the same
      // weights): lanes outside the mask are -inf (weight 0); a score whose
      // exponent passes the cap marks the row (NaN passes nothing).
      const __m256 vs = _mm256_set1_ps(ep->shift2[row + i]);
      const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      __m256 top = neg_inf, sum = _mm256_setzero_ps();
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) {
        c[i][v] = _mm256_fmsub_ps(c[i][v], ep->va, vs);
        if (kMasked && v == NV - 1)
          c[i][v] = _mm256_blendv_ps(neg_inf, c[i][v], _mm256_castsi256_ps(mask));
        top = _mm256_max_ps(c[i][v], top);
        c[i][v] = exp2_ps<false>(c[i][v]);  // a row past the cap is computed again
        sum = _mm256_add_ps(sum, c[i][v]);
      }
      if (_mm256_movemask_ps(_mm256_cmp_ps(top, ep->vcap, _CMP_GT_OQ)) != 0)
        ep->passed[row + i] = 1;
      float* lanes = ep->lanes + 8 * (row + i);
      _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_loadu_ps(lanes), sum));
    }
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      float* dst = C + i * ldc + 8 * v;
      if (kMasked && v == NV - 1)
        _mm256_maskstore_ps(dst, mask, c[i][v]);
      else
        _mm256_storeu_ps(dst, c[i][v]);
    }
  }
}

using BlockFn = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t,
                         bool, __m256i, const ExpRows*, int64_t);
// By rows (1..6), then [one vector, two] x [whole, masked].
template <int MR, bool kExp>
constexpr BlockFn kBlocks[4] = {block<MR, 1, false, kExp>, block<MR, 1, true, kExp>,
                                block<MR, 2, false, kExp>, block<MR, 2, true, kExp>};
template <bool kExp>
constexpr const BlockFn* kByRows[kMr + 1] = {nullptr,          kBlocks<1, kExp>, kBlocks<2, kExp>,
                                             kBlocks<3, kExp>, kBlocks<4, kExp>, kBlocks<5, kExp>,
                                             kBlocks<6, kExp>};

// The block of 16 columns (or `cols`, the others 0) of B's rows [k0, k0 + kc)
// as a contiguous panel (kc x 16).
void copy_panel(const float* B, int64_t ldb, int64_t kc, int64_t cols, float* panel) {
  for (int64_t k = 0; k < kc; ++k) {
    const float* row = B + k * ldb;
    if (cols == kNr) {
      _mm256_store_ps(panel + k * kNr, _mm256_loadu_ps(row));
      _mm256_store_ps(panel + k * kNr + 8, _mm256_loadu_ps(row + 8));
    } else {
      for (int64_t c = 0; c < kNr; ++c) panel[k * kNr + c] = c < cols ? row[c] : 0.0f;
    }
  }
}

// Whether kc rows of B, ldb floats apart, fall into so few sets of L1 (64
// sets of 8 lines of 64 bytes) that a panel of them (a line a row) does not
// stay there: K^T packed 512 keys a row (2 KiB apart) uses 2 sets, 16 lines
// for the panel's 64.
bool conflicting_rows(int64_t ldb, int64_t kc) {
  const int64_t bytes = ldb * static_cast<int64_t>(sizeof(float));
  if (bytes % 64 != 0) return false;
  const int64_t sets = 64 / std::gcd<int64_t>(64, bytes / 64);
  return sets <= 8 && kc > 8 * sets;
}

// One slice (kc rows of B) of C (+)= A B with B's panels copied contiguous,
// each then serving all of A's rows (A and B at the slice's start).
template <bool kExp>
void panel_slice(int64_t M, int64_t N, int64_t kc, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc, bool acc, const ExpRows* ep) {
  alignas(64) float panel[kKc * kNr];
  for (int64_t j0 = 0; j0 < N; j0 += kNr) {
    const int64_t cols = std::min(kNr, N - j0);
    const int64_t last = cols - 8 * (cols > 8 ? 1 : 0);  // lanes of the last vector
    const __m256i mask = lane_mask(last);
    const int which = (cols > 8 ? 2 : 0) + (last < 8 ? 1 : 0);
    copy_panel(B + j0, ldb, kc, cols, panel);
    for (int64_t i = 0; i < M; i += kMr)
      kByRows<kExp>[std::min<int64_t>(kMr, M - i)][which](kc, A + i* lda, lda, panel, kNr,
                                                          C + i* ldc + j0, ldc, acc, mask, ep, i);
  }
}

}  // namespace

void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
          float* C, int64_t ldc, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
    return;
  }
  if (conflicting_rows(ldb, std::min(K, kKc))) {
    for (int64_t k0 = 0; k0 < K; k0 += kKc)
      panel_slice<false>(M, N, std::min(kKc, K - k0), A + k0, lda, B + k0 * ldb, ldb, C, ldc,
                         accumulate || k0 > 0, nullptr);
    return;
  }
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t kc = std::min(kKc, K - k0);
    const bool acc = accumulate || k0 > 0;
    for (int64_t i0 = 0; i0 < M; i0 += kMb) {
      const int64_t i1 = std::min(M, i0 + kMb);
      for (int64_t j0 = 0; j0 < N; j0 += kNr) {
        const int64_t cols = std::min(kNr, N - j0);
        const int vectors = cols > 8 ? 2 : 1;
        const int64_t last = cols - 8 * (vectors - 1);  // lanes of the last vector
        const __m256i mask = lane_mask(last);
        const int which = (vectors - 1) * 2 + (last < 8 ? 1 : 0);
        for (int64_t i = i0; i < i1; i += kMr) {
          kByRows<false>[std::min<int64_t>(kMr, i1 - i)][which](
              kc, A + i* lda + k0, lda, B + k0* ldb + j0, ldb, C + i* ldc + j0, ldc, acc, mask,
              nullptr, 0);
        }
      }
    }
  }
}

void gemm_exp(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
              int64_t ldb, float* C, int64_t ldc, float scale, const float* shift, float cap,
              float* sums, uint8_t* passed) {
  if (M <= 0 || N <= 0 || K <= 0) return;
  std::vector<float> shift2(M), lanes(8 * M, 0.0f);
  for (int64_t i = 0; i < M; ++i) shift2[i] = log2e_times_ss(shift[i]);
  std::fill(passed, passed + M, uint8_t(0));
  const ExpRows ep{log2e_times(scale), log2e_times(cap), shift2.data(), lanes.data(), passed};
  // The slices before the last as gemm's panel path does them (the same
  // sums in the same order), the pass on the last.
  int64_t k0 = 0;
  for (; k0 + kKc < K; k0 += kKc)
    panel_slice<false>(M, N, kKc, A + k0, lda, B + k0 * ldb, ldb, C, ldc, k0 > 0, nullptr);
  panel_slice<true>(M, N, K - k0, A + k0, lda, B + k0 * ldb, ldb, C, ldc, k0 > 0, &ep);
  for (int64_t i = 0; i < M; ++i) {
    float s = 0;
    for (int l = 0; l < 8; ++l) s += lanes[8 * i + l];
    sums[i] = s;
  }
}

void transpose(const float* src, int64_t ld, int64_t rows, int64_t cols, float* out,
               int64_t ld_out) {
  // 8 x 8 blocks in registers: 32-bit, 64-bit and 128-bit lane exchanges.
  int64_t i0 = 0;
  for (; i0 + 8 <= rows; i0 += 8) {
    int64_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + (i0 + i) * ld + c0);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int g = 0; g < 8; g += 4) {
        r[g + 0] = _mm256_shuffle_ps(t[g + 0], t[g + 2], 0x44);
        r[g + 1] = _mm256_shuffle_ps(t[g + 0], t[g + 2], 0xEE);
        r[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
        r[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
      }
      for (int m = 0; m < 4; ++m) {
        t[m] = _mm256_permute2f128_ps(r[m], r[m + 4], 0x20);
        t[m + 4] = _mm256_permute2f128_ps(r[m], r[m + 4], 0x31);
      }
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + (c0 + c) * ld_out + i0, t[c]);
    }
    for (int64_t c = c0; c < cols; ++c)
      for (int64_t i = i0; i < i0 + 8; ++i) out[c * ld_out + i] = src[i * ld + c];
  }
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t i = i0; i < rows; ++i) out[c * ld_out + i] = src[i * ld + c];
}

}  // namespace ring_attention::cpu::avx2

#pragma GCC pop_options
#endif
