#include "packed_tiles.h"

#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "tile_math.h"

namespace ring_attention::cpu {

namespace {

#if defined(CPU_CAPABILITY_AVX512)
// r[i] holds row i of a 16 x 16 block of 32-bit lanes; on return r[c] holds
// column c: 32-bit and 64-bit interleaves within 128-bit lanes, then two
// exchanges of 128-bit lanes (bit patterns only: bf16 pairs pass as well).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // r[4g + m]: rows 4g .. 4g + 3 of columns 4L + m, lane L.
  for (int g = 0; g < 4; ++g) {
    const auto pd = [&](int i) { return _mm512_castps_pd(t[4 * g + i]); };
    r[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(0), pd(2)));
    r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(0), pd(2)));
    r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(1), pd(3)));
    r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(1), pd(3)));
  }
  for (int h = 0; h < 2; ++h) {
    for (int m = 0; m < 4; ++m) {
      t[8 * h + m] = _mm512_shuffle_f32x4(r[8 * h + m], r[8 * h + 4 + m], 0x88);
      t[8 * h + 4 + m] = _mm512_shuffle_f32x4(r[8 * h + m], r[8 * h + 4 + m], 0xdd);
    }
  }
  for (int m = 0; m < 8; ++m) {
    r[m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88);
    r[8 + m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0xdd);
  }
}

// 16 values of a row as 32-bit lanes (bf16 widened: bit patterns only), and back.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_cvtepu16_epi32(h));
}
inline void store16(float* x, __m512 v) { _mm512_storeu_ps(x, v); }
inline void store16(c10::BFloat16* x, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtepi32_epi16(_mm512_castps_si512(v)));
}
#endif

// out[c * ld_out + i] = src[i * ld + c] for i < rows, c < cols: 16 x 16
// blocks in registers where built for AVX-512, else 16 rows at a time so
// that the reads stay in L1 and the writes are whole lines.
template <typename T>
void transpose_rows(const T* src, int64_t ld, int64_t rows, int64_t cols, T* out, int64_t ld_out) {
  int64_t i0 = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i0 + 16 <= rows; i0 += 16) {
    int64_t c0 = 0;
    for (; c0 + 16 <= cols; c0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = load16(src + (i0 + i) * ld + c0);
      transpose16(r);
      for (int c = 0; c < 16; ++c) store16(out + (c0 + c) * ld_out + i0, r[c]);
    }
    for (int64_t c = c0; c < cols; ++c)
      for (int64_t i = i0; i < i0 + 16; ++i) out[c * ld_out + i] = src[i * ld + c];
  }
#endif
  constexpr int64_t kBlock = 16;
  for (; i0 < rows; i0 += kBlock) {
    const int64_t in = std::min(kBlock, rows - i0);
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t i = 0; i < in; ++i) out[c * ld_out + i0 + i] = src[(i0 + i) * ld + c];
  }
}

}  // namespace

bool bf16_brgemm() {
#if defined(__x86_64__)
  static const bool bf16_dot = __builtin_cpu_supports("avx512bf16");
#else
  constexpr bool bf16_dot = false;
#endif
  // libtorch's brgemm takes VNNI operands only through oneDNN, which
  // torch.backends.mkldnn turns off and on at any time, and only where
  // libtorch was built with oneDNN's ukernels: the first call with oneDNN on
  // tries one small product (A times the identity in VNNI layout, which must
  // give A back).
  if (!bf16_dot || !at::globalContext().userEnabledMkldnn()) return false;
  static const bool runs = [] {
    const c10::BFloat16 a[4] = {1.0f, 2.0f, 3.0f, 4.0f}, b[4] = {1.0f, 0.0f, 0.0f, 1.0f};
    float c[4] = {};
    try {
      at::native::cpublas::brgemm(2, 2, 2, 2, 2, 2, false, a, b, c, /*is_vnni=*/true);
      at::native::cpublas::brgemm_release(/*is_vnni=*/true);
    } catch (const c10::Error&) {
      return false;
    }
    return c[0] == 1.0f && c[1] == 2.0f && c[2] == 3.0f && c[3] == 4.0f;
  }();
  return runs;
}

// VNNI for bf16: element (r, c) of a K x N operand sits at
// (r / 2) * 2N + 2c + r % 2, so each 32-bit word holds rows 2i and 2i + 1 of
// one column.
void pack_keys(const c10::BFloat16* k, int64_t ld, int64_t w, int64_t d, c10::BFloat16* out) {
  // B = K^T: row c of B is column c of K, so word i of key j (its elements
  // 2i, 2i + 1) goes to word (i, j): a transpose of 32-bit words, 16 keys
  // by 16 words in registers, else 16 keys at a time so that the reads stay
  // in L1 and the writes are whole lines (not transpose_rows: outside the
  // registers a word of two bf16 is read with memcpy, not as a uint32_t).
  auto* dst = reinterpret_cast<uint32_t*>(out);
  const int64_t words = d / 2;
  constexpr int64_t kBlock = 16;
  for (int64_t j0 = 0; j0 < w; j0 += kBlock) {
    const int64_t jn = std::min(kBlock, w - j0);
    int64_t i0 = 0;
#if defined(CPU_CAPABILITY_AVX512)
    for (; jn == kBlock && i0 + 16 <= words; i0 += 16) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(k + (j0 + j) * ld + 2 * i0);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (i0 + i) * w + j0, r[i]);
    }
#endif
    for (int64_t i = i0; i < words; ++i) {
      uint32_t* o = dst + i * w + j0;
      for (int64_t j = 0; j < jn; ++j)
        std::memcpy(o + j, k + (j0 + j) * ld + 2 * i, sizeof(uint32_t));
    }
  }
}

void pack_values(const c10::BFloat16* v, int64_t ld, int64_t w, int64_t d,
                 std::span<const int64_t> zero, c10::BFloat16* out) {
  const auto* src = reinterpret_cast<const uint16_t*>(v);
  auto* dst = reinterpret_cast<uint16_t*>(out);
  auto z = zero.begin();
  const auto row = [&](int64_t j) -> const uint16_t* {
    while (z != zero.end() && *z < j) ++z;
    return (j < w && (z == zero.end() || *z != j)) ? src + j * ld : nullptr;
  };
  for (int64_t j = 0; j < w; j += 2) {
    const uint16_t* a = row(j);
    const uint16_t* b = row(j + 1);
    uint16_t* o = dst + j * d;
    int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512)
    // 16 columns of the pair at a time: each 32-bit word is (a[c], b[c]).
    const __m512i zero_words = _mm512_setzero_si512();
    const auto words = [](const uint16_t* x, int64_t c) {
      return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c)));
    };
    for (; c + 16 <= d; c += 16) {
      const __m512i lo = a != nullptr ? words(a, c) : zero_words;
      const __m512i hi = b != nullptr ? words(b, c) : zero_words;
      _mm512_storeu_si512(o + 2 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
#endif
    for (; c < d; ++c) {
      o[2 * c] = a != nullptr ? a[c] : 0;
      o[2 * c + 1] = b != nullptr ? b[c] : 0;
    }
  }
}

void transpose_tile(const c10::BFloat16* src, int64_t ld, int64_t rows, int64_t cols,
                    c10::BFloat16* out) {
  const int64_t rows_out = rows + rows % 2;
  transpose_rows(src, ld, rows, cols, out, rows_out);
  if (rows_out != rows)
    for (int64_t c = 0; c < cols; ++c) out[c * rows_out + rows] = c10::BFloat16(0);
}

void pack_values_checked(const c10::BFloat16* v, int64_t ld, int64_t w, int64_t d, int64_t shift,
                         std::vector<int64_t>& bad, c10::BFloat16* out) {
  // The VNNI pairs interleave two rows: check the rows first (they are then
  // in cache for the copy), listed in the tile's own indices until packed.
  const size_t first = bad.size();
  for (int64_t j = 0; j < w; ++j)
    if (!all_finite(v + j * ld, d)) bad.push_back(j);
  pack_values(v, ld, w, d, std::span<const int64_t>(bad).subspan(first), out);
  for (size_t i = first; i < bad.size(); ++i) bad[i] += shift;
}

namespace {

// oneDNN's brgemm takes 32-bit strides (beyond them it fails to allocate):
// a row stride past that (dilated rows of many wide heads) goes through a
// dense copy of A, or of C.
constexpr int64_t kMaxLd = std::numeric_limits<int>::max();

template <typename T>
void brgemm_dense(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                  float* C, int64_t ldc, bool accumulate) {
  if (M == 0 || N == 0) return;
  constexpr bool vnni = std::is_same_v<T, c10::BFloat16>;
  if (lda > kMaxLd) {
    std::vector<T> a(M * K);
    for (int64_t i = 0; i < M; ++i) std::copy(A + i * lda, A + i * lda + K, a.data() + i * K);
    return brgemm_dense(M, N, K, a.data(), K, B, ldb, C, ldc, accumulate);
  }
  if (ldc > kMaxLd) {
    std::vector<float> c(M * N, 0.0f);
    brgemm_dense(M, N, K, A, lda, B, ldb, c.data(), N, false);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j)
        C[i * ldc + j] = accumulate ? C[i * ldc + j] + c[i * N + j] : c[i * N + j];
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, vnni);
}

}  // namespace

void gemm_packed(TileGemm kernel, int64_t M, int64_t N, int64_t K, const c10::BFloat16* A,
                 int64_t lda, const c10::BFloat16* B, int64_t ldb, float* C, int64_t ldc,
                 bool accumulate) {
  TORCH_INTERNAL_ASSERT(kernel == TileGemm::kBf16Packed || kernel == TileGemm::kFp32Split);
  brgemm_dense(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

void release_packed_gemm() { at::native::cpublas::brgemm_release(/*is_vnni=*/true); }

void transpose_tile(const float* src, int64_t ld, int64_t rows, int64_t cols, float* out) {
#if defined(__x86_64__) && !defined(CPU_CAPABILITY_AVX512)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return avx2::transpose(src, ld, rows, cols, out, rows);
#endif
  transpose_rows(src, ld, rows, cols, out, rows);
}

void pack_keys(const float* k, int64_t ld, int64_t w, int64_t d, float* out) {
  transpose_tile(k, ld, w, d, out);
}

void pack_values(const float* v, int64_t ld, int64_t w, int64_t d, std::span<const int64_t> zero,
                 float* out) {
  for (int64_t j = 0; j < w; ++j) std::copy(v + j * ld, v + j * ld + d, out + j * d);
  for (const int64_t j : zero) std::fill(out + j * d, out + (j + 1) * d, 0.0f);
}

void pack_values_checked(const float* v, int64_t ld, int64_t w, int64_t d, int64_t shift,
                         std::vector<int64_t>& bad, float* out) {
  for (int64_t j = 0; j < w; ++j) {
    float* row = out + j * d;
    std::copy(v + j * ld, v + j * ld + d, row);
    if (all_finite(row, d)) continue;
    std::fill(row, row + d, 0.0f);
    bad.push_back(j + shift);
  }
}

void gemm_packed(TileGemm kernel, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
#if defined(__x86_64__)
  if (kernel == TileGemm::kFp32Avx2) return avx2::gemm(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
#endif
  TORCH_INTERNAL_ASSERT(kernel == TileGemm::kFp32Brgemm || kernel == TileGemm::kFp32Split);
  brgemm_dense(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

}  // namespace ring_attention::cpu
