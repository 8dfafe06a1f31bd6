#include "split_products.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "packed_tiles.h"
#include "tile_math.h"

namespace ring_attention::cpu {
namespace {

constexpr uint32_t kTop = 0xFFFF0000u;  // the bits a bf16 keeps
enum Part { kH, kM, kL };

inline uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// x's parts, each as a float's bits whose low half is 0.
struct Parts {
  uint32_t part[3];
};
inline Parts split(float x) {
  const uint32_t h = bits(x) & kTop;
  const float r = x - from_bits(h);
  const uint32_t m = bits(r) & kTop;
  return {{h, m, bits(r - from_bits(m))}};
}
inline uint16_t bf16_bits(uint32_t part) { return static_cast<uint16_t>(part >> 16); }

#if defined(CPU_CAPABILITY_AVX512)
struct PartsV {
  __m512i part[3];
};
inline PartsV split(__m512 x) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(kTop));
  const __m512i h = _mm512_and_si512(_mm512_castps_si512(x), top);
  const __m512 r = _mm512_sub_ps(x, _mm512_castsi512_ps(h));
  const __m512i m = _mm512_and_si512(_mm512_castps_si512(r), top);
  return {{h, m, _mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(m)))}};
}
inline __m256i bf16_bits(__m512i part) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(part, 16));
}
#endif

// Row x (n values) as the A operand's row out ([h m l h m h], n apart).
// Returns whether x was finite.
bool split_row(const float* x, int64_t n, c10::BFloat16* out) {
  auto* o = reinterpret_cast<uint16_t*>(out);
  int64_t c = 0;
  bool finite = true;
#if defined(CPU_CAPABILITY_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; c < n; c += 16) {
    const __mmask16 live = n - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - c)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + c);
    acc = _mm512_fmadd_ps(v, _mm512_setzero_ps(), acc);  // NaN where v is not finite
    const PartsV s = split(v);
    const __m256i h = bf16_bits(s.part[kH]), m = bf16_bits(s.part[kM]);
    _mm256_mask_storeu_epi16(o + c, live, h);
    _mm256_mask_storeu_epi16(o + n + c, live, m);
    _mm256_mask_storeu_epi16(o + 2 * n + c, live, bf16_bits(s.part[kL]));
    _mm256_mask_storeu_epi16(o + 3 * n + c, live, h);
    _mm256_mask_storeu_epi16(o + 4 * n + c, live, m);
    _mm256_mask_storeu_epi16(o + 5 * n + c, live, h);
  }
  finite = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q) == 0;
#endif
  for (; c < n; ++c) {
    finite = finite && std::isfinite(x[c]);
    const Parts s = split(x[c]);
    constexpr Part kRow[6] = {kH, kM, kL, kH, kM, kH};
    for (int b = 0; b < 6; ++b) o[b * n + c] = bf16_bits(s.part[kRow[b]]);
  }
  return finite;
}

// The VNNI words of the row pair (a[c], b[c]), c < n, for the six blocks of
// the B operand ([h h h m m l]): block k's words at out + k * block_stride +
// c.
void pack_pair(const float* a, const float* b, int64_t n, uint32_t* out, int64_t block_stride) {
  int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i top = _mm512_set1_epi32(static_cast<int>(kTop));
  for (; c < n; c += 16) {
    const __mmask16 live = n - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - c)) - 1);
    const PartsV sa = split(_mm512_maskz_loadu_ps(live, a + c));
    const PartsV sb = split(_mm512_maskz_loadu_ps(live, b + c));
    const auto word = [&](Part p) {
      return _mm512_or_si512(_mm512_srli_epi32(sa.part[p], 16), _mm512_and_si512(sb.part[p], top));
    };
    const __m512i h = word(kH), m = word(kM);
    _mm512_mask_storeu_epi32(out + c, live, h);
    _mm512_mask_storeu_epi32(out + block_stride + c, live, h);
    _mm512_mask_storeu_epi32(out + 2 * block_stride + c, live, h);
    _mm512_mask_storeu_epi32(out + 3 * block_stride + c, live, m);
    _mm512_mask_storeu_epi32(out + 4 * block_stride + c, live, m);
    _mm512_mask_storeu_epi32(out + 5 * block_stride + c, live, word(kL));
  }
#endif
  for (; c < n; ++c) {
    const Parts sa = split(a[c]), sb = split(b[c]);
    constexpr Part kCol[6] = {kH, kH, kH, kM, kM, kL};
    for (int k = 0; k < 6; ++k)
      out[k * block_stride + c] = (sa.part[kCol[k]] >> 16) | (sb.part[kCol[k]] & kTop);
  }
}

// The strided rows of a tile come from memory (a row of a (B, L, H, D)
// tensor every H * D values), where the hardware prefetcher does not follow
// them: the row kAhead rows on is fetched while this one is split.
constexpr int64_t kAhead = 8;
inline void prefetch_row(const float* x, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) __builtin_prefetch(x + c);
}

// One fp32 score, as the fp32 product makes it.
float dot(const float* a, const float* b, int64_t d) {
  float sum = 0;
  for (int64_t c = 0; c < d; ++c) sum += a[c] * b[c];
  return sum;
}

}  // namespace

void split_queries(const float* x, int64_t ld, int64_t rows, int64_t d, c10::BFloat16* out,
                   std::vector<int64_t>& bad) {
  for (int64_t i = 0; i < rows; ++i) {
    if (i + kAhead < rows) prefetch_row(x + (i + kAhead) * ld, d);
    if (split_row(x + i * ld, d, out + i * 6 * d)) continue;
    std::fill(out + i * 6 * d, out + (i + 1) * 6 * d, c10::BFloat16(0));
    bad.push_back(i);
  }
}

void pack_keys_split(const float* k, int64_t ld, int64_t w, int64_t d, c10::BFloat16* out,
                     std::vector<int64_t>& bad) {
  // 32 keys at a time: their K^T (d x 32, in L1) first, so that a pair of its
  // rows is two contiguous rows.
  constexpr int64_t kKeys = 32;
  TileBuffer<float> kt(d * kKeys);
  auto* words = reinterpret_cast<uint32_t*>(out);
  for (int64_t j0 = 0; j0 < w; j0 += kKeys) {
    const int64_t jn = std::min(kKeys, w - j0);
    transpose_tile(k + j0 * ld, ld, jn, d, kt.data());
    const size_t first = bad.size();
    non_finite_rows(TileRef<float>{k, ld}, j0, j0 + jn, d, 0, bad);
    for (size_t b = first; b < bad.size(); ++b)
      for (int64_t c = 0; c < d; ++c) kt[c * jn + (bad[b] - j0)] = 0;
    for (int64_t i = 0; i < d / 2; ++i)
      pack_pair(&kt[2 * i * jn], &kt[(2 * i + 1) * jn], jn, words + i * w + j0, (d / 2) * w);
  }
}

void gemm_split_scores(int64_t rows, int64_t N, int64_t d, const c10::BFloat16* q6,
                       const c10::BFloat16* k6, int64_t ldb, float* C, int64_t ldc,
                       TileRef<float> q, TileRef<float> k, std::span<const int64_t> bad_rows,
                       std::span<const int64_t> bad_keys) {
  gemm_packed(TileGemm::kFp32Split, rows, N, 6 * d, q6, 6 * d, k6, ldb, C, ldc, false);
  for (const int64_t i : bad_rows)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = dot(q.ptr + i * q.ld, k.ptr + j * k.ld, d);
  for (const int64_t j : bad_keys) {
    if (j >= N) break;
    for (int64_t i = 0; i < rows; ++i) C[i * ldc + j] = dot(q.ptr + i * q.ld, k.ptr + j * k.ld, d);
  }
}

}  // namespace ring_attention::cpu
