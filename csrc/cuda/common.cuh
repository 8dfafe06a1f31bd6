// Shared pieces of the CUDA block kernels: the per-launch problem description,
// tile decoding (which rows a thread block owns), warp reductions,
// dilated-row tile loaders and the mma.sync (m16n8k16, fp32 accumulate)
// building blocks of the fp16/bf16 tensor-core kernels.
//
// Work decomposition (both ops): one launch per branch (w, r). Rows are
// queries (forward, dq) or keys (dk/dv). A thread block owns the rows of one
// (batch, head) in one window of span = BM * r consecutive positions: for
// each segment the window meets, the at most BM active rows of that segment
// in the window form a tile. The grid is sized from the block lengths alone
// (documents only make segments shorter), so documents need no host-device
// synchronisation: a block finds its segments by a binary search in
// cu_seqlens and exits when it has none. Within a branch a row belongs to one
// segment and one window, so blocks never write the same output row: plain
// read-modify-write, no atomics. Branches run one after another on the stream.
//
// Grouped K/V heads: query head h reads K/V head h / (heads / kv_heads), and
// the query heads of a key-sharing set (params.h: same K/V head and offset)
// read the same key rows. Query-row kernels (forward, dq) stack `pack` heads
// of a set in a tile: its rows are (head, position) pairs, BM / pack
// positions of each head, so a K/V tile serves all of them and tiles of short
// segments (dilation, documents) fill up. Key rows (dk/dv) are owned by the
// block of the first head of each set, which sums over the set's heads.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../block_call.h"
#include "../params.h"
#include "../pattern.h"
#include "runtime.cuh"

namespace ring_attention::gpu {

constexpr int kThreads = 128;  // 4 warps in every kernel
constexpr unsigned kFull = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

// One launch: a checked block call and one branch of the pattern.
struct Problem : BlockParams {
  const void* delta;  // backward: rowsum(dO * O) - grad_lse, laid out like lse
  int64_t w, r, branch;
  int64_t h_lo;                  // first query head of the launch (grid.y counts heads)
  int64_t pack;                  // query heads per tile (1 for key rows), divides 4
  int64_t row_lo, row_hi, span;  // grid.x counts windows of span row positions
  // The sliding window in rows of the branch (windowed): key n of a tile
  // reaches query m iff m + dm - band_l <= n <= m + dm + band_r (in_band).
  int64_t band_l, band_r;
  bool vec;  // 16-byte loads allowed (D % 8 == 0, aligned pointers)
};

constexpr int kMaxPack = 4;

__device__ inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// One tile: query m of the tile's segment sits at position q.first + r*m,
// key n at k.first + r*n (both active, same segment), and key n reaches query
// m (causal) iff n <= m + dm (and, windowed, in_band). The run of the rows
// side (queries, or keys for KEY_ROWS) is the tile's (at most BM / pack rows
// per head), the other one the whole segment's in its block (keys: only up to
// the tile's last query, causal; only within the tile's rows' windows).
// Query rows: row slot * (BM / pack) + m is query m of heads[slot].
struct Tile {
  int64_t b, kvh;
  int64_t heads[kMaxPack];  // KEY_ROWS: heads[0] is the first of its key-sharing set
  ActiveRun q, k;
  int64_t dm;
};

// The tiles of this thread block, in position order: blockIdx.z is the batch
// row, h_lo + blockIdx.y the first query head of the tile's heads (only the
// blocks of every pack-th head of a key-sharing set have tiles; KEY_ROWS: of
// its first head), blockIdx.x the window [row_lo + x*span, row_lo +
// (x+1)*span) of row positions.
template <bool KEY_ROWS>
class BlockTiles {
 public:
  __device__ explicit BlockTiles(const Problem& p)
      : p_(p),
        lo_(p.row_lo + static_cast<int64_t>(blockIdx.x) * p.span),
        hi_(p.row_hi - lo_ > p.span ? lo_ + p.span : p.row_hi),  // no lo_ + span overflow
        h_(p.h_lo + blockIdx.y),
        walk_(p.docs, p.w, lo_) {
    const int64_t rank = p.set_rank(h_, p.branch, p.r);
    live_ = KEY_ROWS ? rank == 0 : rank >= 0 && rank % p.pack == 0;
    offset_ = p.offset(h_, p.r);
    // The next pack - 1 heads of the set (every set has a multiple of pack).
    int n = 0;
    for (int64_t g = h_; live_ && n < p.pack && g < p.kv_group_end(h_); ++g)
      if (p.shares_keys(g, h_, p.branch, p.r)) heads_[n++] = g;
  }

  __device__ bool next(Tile& t) {
    if (!live_) return false;
    const int64_t r = p_.r, q_end = p_.q_start + p_.q_len, k_end = p_.k_start + p_.k_len;
    for (; walk_.segment().start < hi_; walk_.next()) {
      const Segment seg = walk_.segment();
      if (KEY_ROWS) {
        t.k = active_run(seg, r, offset_, imax(lo_, p_.k_start), imin(hi_, k_end));
        if (t.k.count == 0) continue;
        int64_t q_lo = p_.q_start, q_hi = q_end;
        if (p_.windowed) {  // the queries whose windows meet the tile's keys
          q_lo = imax(q_lo, t.k.first - p_.window_right);
          q_hi = imin(q_hi, t.k.first + (t.k.count - 1) * r + p_.window_left + 1);
        }
        t.q = active_run(seg, r, offset_, q_lo, q_hi);
        if (t.q.count == 0 || (p_.causal && t.q.first + (t.q.count - 1) * r < t.k.first)) continue;
      } else {
        t.q = active_run(seg, r, offset_, imax(lo_, p_.q_start), imin(hi_, q_end));
        if (t.q.count == 0) continue;
        const int64_t last_q = t.q.first + (t.q.count - 1) * r;
        int64_t k_lo = p_.k_start, k_hi = p_.causal ? imin(k_end, last_q + 1) : k_end;
        if (p_.windowed) {  // the keys in the windows of the tile's queries
          k_lo = imax(k_lo, p_.band_first(t.q.first));
          k_hi = imin(k_hi, p_.band_last(last_q) + 1);
        }
        t.k = active_run(seg, r, offset_, k_lo, k_hi);
        if (t.k.count == 0) continue;
      }
      t.b = blockIdx.z;
      for (int j = 0; j < kMaxPack; ++j) t.heads[j] = heads_[j];
      t.kvh = p_.kv_head(h_);
      t.dm = (t.q.first - t.k.first) / r;  // exact: both are active in one segment
      walk_.next();
      return true;
    }
    return false;
  }

 private:
  const Problem& p_;
  int64_t lo_, hi_, h_, offset_;
  int64_t heads_[kMaxPack] = {};
  bool live_;
  SegmentWalk walk_;
};

// Row `row` of a query-row tile of rows_per_head rows per head: head slot and
// query index in the segment.
struct RowSlot {
  int slot, m;
};
__device__ inline RowSlot row_slot(int row, int rows_per_head) {
  return {row / rows_per_head, row % rows_per_head};
}

// Keys reached by queries m <= m_last of the tile (all of them if not causal).
__device__ inline int64_t keys_reached(const Problem& p, const Tile& t, int64_t m_last) {
  if (!p.causal) return t.k.count;
  const int64_t lim = m_last + t.dm + 1;
  return lim < 0 ? 0 : (lim < t.k.count ? lim : t.k.count);
}

// Key n reaches query m of a tile within the window, diag = m + dm.
__device__ inline bool in_band(const Problem& p, int64_t n, int64_t diag) {
  return n >= diag - p.band_l && n <= diag + p.band_r;
}

// A column index of a tile relative to x, as an int clipped to [-1, hi]
// (the window's bounds may lie far outside a tile).
__device__ inline int tile_limit(int64_t x, int hi) {
  return static_cast<int>(imax(-1, imin(hi, x)));
}

// The bits lo..hi of a 64-bit mask (none where hi < lo), for lo, hi in
// [-1, 64] (tile_limit's range).
__device__ inline uint64_t bit_range(int lo, int hi) {
  lo = lo < 0 ? 0 : lo;
  hi = hi > 63 ? 63 : hi;
  return hi < lo ? 0 : (~uint64_t{0} >> (63 - hi)) & (~uint64_t{0} << lo);
}

// Key padding mask entry of the key at position pos, or nullptr.
__device__ inline const bool* mask_at(const Problem& p, int64_t b, int64_t pos) {
  return p.key_padding_mask == nullptr ? nullptr
                                       : p.key_padding_mask + b * p.k_len + (pos - p.k_start);
}

// How a kernel addresses the K/V rows (params.h): strided or through the row
// map, known at compile time (the tensor-core kernels: one instantiation each,
// chosen at launch by key_map_of), or read from k_rows at run time (SIMT).
enum class KeyMap { kStrided, kMapped, kEither };

__host__ inline KeyMap key_map_of(const Problem& p) {
  return p.k_rows != nullptr ? KeyMap::kMapped : KeyMap::kStrided;
}

// k_index and k_run of p for a kernel addressing keys as M.
template <KeyMap M>
__device__ inline int64_t key_index(const Problem& p, int64_t b, int64_t pos, int64_t kvh) {
  if constexpr (M == KeyMap::kEither) return p.k_index(b, pos, kvh);
  return p.k_index_as<M == KeyMap::kMapped>(b, pos, kvh);
}
template <KeyMap M>
__device__ inline RunRows key_run(const Problem& p, int64_t pos, int64_t kvh, int64_t r) {
  if constexpr (M == KeyMap::kEither) return p.k_run(pos, kvh, r);
  return p.k_run_as<M == KeyMap::kMapped>(pos, kvh, r);
}

// Row i of a tile (mask[i * mstride] is its padding flag) holds a reached row.
__device__ inline bool row_ok(int i, int nvalid, const bool* mask, int64_t mstride) {
  return i < nvalid && (mask == nullptr || !mask[i * mstride]);
}

template <typename C>
__device__ inline C neg_inf() {
  return -static_cast<C>(INFINITY);
}
__device__ inline float cexp(float x) { return expf(x); }
__device__ inline double cexp(double x) { return exp(x); }
__device__ inline float clog(float x) { return logf(x); }
__device__ inline double clog(double x) { return log(x); }
__device__ inline float clog1p(float x) { return log1pf(x); }
__device__ inline double clog1p(double x) { return log1p(x); }
__device__ inline float cmax(float a, float b) { return fmaxf(a, b); }
__device__ inline double cmax(double a, double b) { return fmax(a, b); }

template <typename C>
__device__ inline C warp_sum(C x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}
template <typename C>
__device__ inline C warp_max(C x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = cmax(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

// Merge a block result (normalised o, blk_lse) into running (out, lse) for one
// element; old_lse is the value read before any lane wrote. Returns new out.
template <typename C>
__device__ inline C merge_value(C out, C o, C old_lse, C blk_lse, C new_lse) {
  if (old_lse == neg_inf<C>() || isnan(blk_lse)) return o;
  return out * cexp(old_lse - new_lse) + o * cexp(blk_lse - new_lse);
}
template <typename C>
__device__ inline C merged_lse(C old_lse, C blk_lse) {
  if (old_lse == neg_inf<C>() || isnan(blk_lse)) return blk_lse;
  const C hi = old_lse > blk_lse ? old_lse : blk_lse;
  const C lo = old_lse > blk_lse ? blk_lse : old_lse;
  if (hi == static_cast<C>(INFINITY)) return hi;  // a +inf score: +inf, not inf - inf
  return hi + clog1p(cexp(lo - hi));
}

// ---------------------------------------------------------------- SIMT path
// Tile of 32 rows as acc type C, s[i * ld + d], zero beyond D and for rows that
// are not ok. src points at row 0; row i is at src + at(i) (params.h, RunRows).
template <typename T, typename C>
__device__ inline void load_rows_simt(C* s, int ld, int dp, const T* src, RunRows at, int nvalid,
                                      const bool* mask, int64_t mstride, int D) {
  for (int idx = threadIdx.x; idx < 32 * dp; idx += kThreads) {
    const int i = idx / dp, d = idx % dp;
    const bool ok = d < D && row_ok(i, nvalid, mask, mstride);
    s[i * ld + d] = ok ? static_cast<C>(src[at(i) + d]) : C(0);
  }
}

// Lane-distributed row vector: x[j] = row[lane + 32 j].
template <typename T, typename C, int NPL>
__device__ inline void load_vec(C (&x)[NPL], const T* row, bool ok, int D, int lane) {
#pragma unroll
  for (int j = 0; j < NPL; ++j) {
    const int d = lane + 32 * j;
    x[j] = (ok && d < D) ? static_cast<C>(row[d]) : C(0);
  }
}

// <x, y> with x lane-distributed and y a full row in shared memory; only the
// 32-wide chunks below D are visited (the rest is zero).
template <typename C, int NPL>
__device__ inline C dot_bcast(const C (&x)[NPL], const C* y, int D) {
  C s = 0;
#pragma unroll
  for (int j = 0; j < NPL; ++j) {
    if (32 * j >= D) break;
#pragma unroll
    for (int src = 0; src < 32; ++src) s += __shfl_sync(kFull, x[j], src) * y[32 * j + src];
  }
  return s;
}

// --------------------------------------------------- tensor-core (mma) path
// Stage raw 16-bit tiles of `rows` rows (at most MAX_ROWS) in shared memory,
// N of them with the same rows (K and V, Q and dO): row i (i < nvalid and not
// masked) of tile n is at src[n] + at(i) and goes to s[n][i * ld + d]
// for d < DP (zero past D and for unreached rows). Rows of s must start
// 16-byte aligned (ld % 8 == 0): ldmatrix reads them. With vec (D % 8 == 0,
// 16-byte aligned rows) the copies are cp.async: they land once the thread has
// committed and waited for them (cp_async_commit, cp_async_wait) and the block
// is visible after the next __syncthreads; otherwise they are plain stores.
// Where the 16-byte chunks of a row divide among the threads, a thread copies
// one chunk column of every kThreads / chunks-th row, the offset advanced by
// one add a row (the index arithmetic per chunk, rematerialized under the
// kernels' register pressure, cost about 45 instructions a chunk); rows
// through a row map (MAPPED) advance a pointer into the map instead, 32-bit
// differences of its entries scaled once a row (entries past nvalid, which
// may lie past the map's end, are not read).
template <int DP, int MAX_ROWS, bool MAPPED, int N>
__device__ inline void load_rows16(uint16_t* const (&s)[N], int ld, int rows,
                                   const uint16_t* const (&src)[N], RunRows at, int nvalid,
                                   const bool* mask, int64_t mstride, int D, bool vec) {
  constexpr int kChunks = DP / 8;
  const auto copy = [&](int i, int c, int64_t off) {
    const bool ok = row_ok(i, nvalid, mask, mstride);
    if (vec) {  // a chunk is wholly inside [0, D) or wholly past it
      const bool in = ok && c < D;
#pragma unroll
      for (int n = 0; n < N; ++n)
        cp_async_16(s[n] + i * ld + c, in ? src[n] + off : src[n], in ? 16 : 0);
      return;
    }
#pragma unroll
    for (int n = 0; n < N; ++n) {
      union {
        uint4 u;
        uint16_t h[8];
      } val;
#pragma unroll
      for (int j = 0; j < 8; ++j) val.h[j] = (ok && c + j < D) ? src[n][off + j] : 0;
      *reinterpret_cast<uint4*>(s[n] + i * ld + c) = val.u;
    }
  };
  if constexpr (kThreads % kChunks == 0) {
    constexpr int kStep = kThreads / kChunks;  // rows between a thread's chunks
    const int i0 = threadIdx.x / kChunks, c = (threadIdx.x % kChunks) * 8;
    if constexpr (MAPPED) {
      const int32_t first = at.map[0];
      const int32_t* m = at.map + i0 * at.step;
#pragma unroll
      for (int k = 0; k < (MAX_ROWS + kStep - 1) / kStep; ++k, m += kStep * at.step) {
        const int i = i0 + k * kStep;
        if (i >= rows) break;
        copy(i, c, i < nvalid ? static_cast<int64_t>(*m - first) * at.unit + c : 0);
      }
    } else {
      int64_t off = i0 * at.stride + c;
#pragma unroll
      for (int k = 0; k < (MAX_ROWS + kStep - 1) / kStep; ++k, off += kStep * at.stride) {
        const int i = i0 + k * kStep;
        if (i >= rows) break;
        copy(i, c, off);
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < rows * kChunks; idx += kThreads) {
      const int i = idx / kChunks, c = (idx % kChunks) * 8;
      copy(i, c, i < nvalid ? at.at<MAPPED>(i) + c : 0);
    }
  }
}

// Keys a row does not reach have weight 0, and 0 * NaN = NaN: a non-finite
// K or V row of such a key must not enter a product with the tile's weights.
// Zeroes the non-finite values (inf, NaN) of a ROWS x DP tile of 16-bit T in
// shared memory, each thread its part of one row (kThreads / ROWS threads per
// row, adjacent lanes); returns whether the thread's row held any (the same on
// the row's threads). The tile must be complete (after a barrier) and is
// readable again after the next one. Reads 16 bytes at a time and writes only
// where it found one.
template <typename T, int DP, int ROWS>
__device__ inline bool zero_nonfinite16(uint16_t* s, int ld) {
  constexpr int kParts = kThreads / ROWS, kCols = DP / kParts;
  static_assert(kThreads % ROWS == 0 && DP % kParts == 0 && kCols % 8 == 0);
  // The exponent bits of both halves of a 32-bit word: a half is inf / NaN
  // iff all of its exponent bits are set.
  constexpr uint32_t kExp = std::is_same_v<T, c10::BFloat16> ? 0x7F807F80u : 0x7C007C00u;
  uint4* row =
      reinterpret_cast<uint4*>(s + (threadIdx.x / kParts) * ld + (threadIdx.x % kParts) * kCols);
  bool bad = false;
#pragma unroll 2  // unrolled whole, the loads' registers made the dq kernel spill more
  for (int c = 0; c < kCols / 8; ++c) {
    const uint4 x = row[c];
    uint32_t w[4] = {x.x, x.y, x.z, x.w};
    bool found = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t unset = (w[i] & kExp) ^ kExp;  // a half is 0 where all were set
      if ((unset & 0xFFFFu) == 0) w[i] &= 0xFFFF0000u;
      if ((unset >> 16) == 0) w[i] &= 0x0000FFFFu;
      found |= (unset & 0xFFFFu) == 0 || (unset >> 16) == 0;
    }
    if (found) {
      row[c] = uint4{w[0], w[1], w[2], w[3]};
      bad = true;
    }
  }
#pragma unroll
  for (int o = 1; o < kParts; o <<= 1) bad |= __shfl_xor_sync(kFull, bad ? 1 : 0, o) != 0;
  return bad;
}

// Two floats rounded to T and packed into one register (lo in the low half).
template <typename T>
__device__ inline uint32_t pack2(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, c10::Half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&bits, &h, sizeof(bits));
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&bits, &h, sizeof(bits));
  }
  return bits;
}

// Fragment layouts of mma.m16n8k16 (g = lane / 4, tg = lane % 4):
//   A (16x16, row-major): a0 (g, 2tg..), a1 (g+8, 2tg..), a2 (g, 2tg+8..), a3 (g+8, 2tg+8..)
//   B (16x8, k x n):      b0 (k 2tg.., n g), b1 (k 2tg+8.., n g)
//   C (16x8):             c0,c1 (g, 2tg..), c2,c3 (g+8, 2tg..)
// ldmatrix.x4 gives register m of every lane from the 8x8 tile whose row
// addresses lanes 8m..8m+7 pass: lane l gets row l/4, columns 2(l%4) and the
// next (.trans: column l/4, rows 2(l%4) and the next). So A's four 8x8
// quarters, or B's b0/b1 for two n-blocks, come with one instruction.

// c[mt] += A_mt * B^T for MT m-tiles: A_mt is the 16 x K row-major tile at
// A + 16 mt rows (lda), B: NJ*8 x K row-major (ldb), both in shared memory.
// Each B fragment loaded serves the MT m-tiles.
template <typename T, int MT, int NJ, int K>
__device__ inline void mma_ss(float (&c)[MT][NJ][4], const uint16_t* A, int lda, const uint16_t* B,
                              int ldb, int lane) {
  static_assert(NJ % 2 == 0 && K % 16 == 0, "mma_ss: NJ even, K a multiple of 16");
  const int r = lane % 8, hi = (lane / 8) & 1, pair = lane / 16;
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      ldmatrix_x4(a[mt], A + (16 * mt + r + 8 * hi) * lda + k0 + 8 * pair);
#pragma unroll
    for (int j = 0; j < NJ; j += 2) {
      uint32_t b[4];  // b0, b1 of n-block j, then of j + 1
      ldmatrix_x4(b, B + ((j + pair) * 8 + r) * ldb + k0 + 8 * hi);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_m16n8k16<T>(c[mt][j], a[mt], b[0], b[1]);
        mma_m16n8k16<T>(c[mt][j + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// c[mt] += X_mt * V for MT m-tiles, where X_mt (16 x 8*KJ) is held as C
// fragments x[mt][KJ] (rounded to T) and V: 8*KJ x NJ*8 row-major (ldv) in
// shared memory. Each V fragment loaded serves the MT m-tiles.
template <typename T, int MT, int NJ, int KJ>
__device__ inline void mma_rs(float (&c)[MT][NJ][4], const float (&x)[MT][KJ][4], const uint16_t* V,
                              int ldv, int lane) {
  static_assert(NJ % 2 == 0 && KJ % 2 == 0, "mma_rs: NJ and KJ even");
  const int r = lane % 8, hi = (lane / 8) & 1, pair = lane / 16;
#pragma unroll
  for (int kk = 0; kk < KJ / 2; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      a[mt][0] = pack2<T>(x[mt][2 * kk][0], x[mt][2 * kk][1]);
      a[mt][1] = pack2<T>(x[mt][2 * kk][2], x[mt][2 * kk][3]);
      a[mt][2] = pack2<T>(x[mt][2 * kk + 1][0], x[mt][2 * kk + 1][1]);
      a[mt][3] = pack2<T>(x[mt][2 * kk + 1][2], x[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int j = 0; j < NJ; j += 2) {
      uint32_t b[4];  // b0, b1 of n-block j, then of j + 1
      ldmatrix_x4_trans(b, V + (kk * 16 + 8 * hi + r) * ldv + (j + pair) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_m16n8k16<T>(c[mt][j], a[mt], b[0], b[1]);
        mma_m16n8k16<T>(c[mt][j + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// The fragments of one m-tile as the MT = 1 operand of mma_ss / mma_rs.
template <int N>
__device__ inline auto one_tile(float (&c)[N][4]) -> float (&)[1][N][4] {
  return reinterpret_cast<float (&)[1][N][4]>(c);
}

// ---------------------------------------------------------------- host side
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The launch description of a checked block call (the branch fields are set
// per launch). head_dim <= 256 on CUDA.
inline Problem make_problem(const BlockCall& call) {
  check_device(call.q);
  TORCH_CHECK(call.params.head_dim <= 256, "head_dim must be <= 256 on CUDA, got ",
              call.params.head_dim);
  Problem p{};
  static_cast<BlockParams&>(p) = call.params;
  p.vec = p.head_dim % 8 == 0 && aligned16(p.q) && aligned16(p.k) && aligned16(p.v) &&
          (p.grad_out == nullptr || aligned16(p.grad_out));
  return p;
}

// Whether fp16/bf16 run on the tensor cores: sm_80+ and head_dim up to
// max_head_dim (the forward's 256; the backward's 128, past which the dk / dv
// accumulators of a 16-row tile would not fit the registers).
inline bool use_tensor_cores(const Problem& p, int64_t max_head_dim) {
  return device_attribute(cudaDevAttrComputeCapabilityMajor) >= 8 && p.head_dim <= max_head_dim;
}

// Raise the dynamic shared memory limit of a kernel when it needs > 48 KiB.
template <typename Kernel>
inline void prepare_smem(Kernel kernel, size_t bytes) {
  const int limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  TORCH_CHECK(bytes <= static_cast<size_t>(limit), "ring_attention: kernel needs ", bytes,
              " bytes of shared memory, the device allows ", limit);
  if (bytes > 48 * 1024) set_max_dynamic_smem(kernel, bytes);
}

// Query heads per tile of a query-row launch of branch i over heads [h_lo,
// h_hi): the largest divisor of kMaxPack that divides the size of every
// key-sharing set, so that no tile has an empty head slot.
inline int64_t pack_heads(const Problem& p, int64_t i, int64_t h_lo, int64_t h_hi) {
  int64_t pack = kMaxPack;
  for (int64_t h = h_lo; h < h_hi; ++h) {
    if (p.set_rank(h, i, p.r) != 0) continue;
    int64_t size = 0;
    for (int64_t g = h; g < h_hi; ++g) size += p.shares_keys(g, h, i, p.r) ? 1 : 0;
    while (size % pack != 0) pack /= 2;
  }
  return pack;
}

// Launch `kernel` once per branch; key_rows: its rows are keys (else
// queries), bm its tile height.
template <typename Kernel>
inline void launch_branches(Kernel kernel, Problem p, at::IntArrayRef segs, at::IntArrayRef dils,
                            bool key_rows, int bm, size_t smem) {
  const int64_t q_end = p.q_start + p.q_len, k_end = p.k_start + p.k_len;
  if (p.q_len <= 0 || p.k_len <= 0 || (p.causal && q_end <= p.k_start)) return;
  prepare_smem(kernel, smem);
  TORCH_CHECK(p.batch <= 65535 && p.heads <= 65535,
              "ring_attention: batch and heads must be <= 65535");
  const cudaStream_t stream = current_stream();
  const int64_t rows_lo = key_rows ? p.k_start : p.q_start, rows_hi = key_rows ? k_end : q_end;
  for (int64_t i = 0; i < p.n_branches; ++i) {
    p.w = segs[i];
    p.r = dils[i];
    p.branch = i;
    p.h_lo = p.branch_heads_begin(i);
    const int64_t h_hi = p.branch_heads_end(i);
    // A segment meeting both blocks (at most w long) ends after the later
    // start and starts before the earlier end; windows start on multiples of
    // span, so that without documents a segment (w a multiple of span) is
    // covered by whole tiles. Starts reach 2**62 and w, r (clamped) as far
    // again: span is capped at 2**62 (fewer rows per tile, never more) and
    // no sum is formed past rows_hi.
    p.band_l = p.window_left / p.r;
    p.band_r = p.window_right / p.r;
    p.pack = key_rows ? 1 : pack_heads(p, i, p.h_lo, h_hi);
    constexpr int64_t kMaxSpan = int64_t{1} << 62;
    const int64_t tile_rows = bm / p.pack;
    p.span = p.r > kMaxSpan / tile_rows ? kMaxSpan : tile_rows * p.r;
    const int64_t later_start = std::max(p.q_start, p.k_start);
    const int64_t earlier_end = std::min(q_end, k_end);
    p.row_lo = std::max(rows_lo, later_start - p.w + 1) / p.span * p.span;
    p.row_hi = p.w - 1 > rows_hi - earlier_end ? rows_hi : earlier_end + p.w - 1;
    if (p.row_hi <= p.row_lo || h_hi <= p.h_lo) continue;
    const int64_t windows = ceil_div(p.row_hi - p.row_lo, p.span);
    TORCH_CHECK(windows <= 0x7fffffff, "ring_attention: too many tiles (", windows, ")");
    const dim3 grid(static_cast<unsigned>(windows), static_cast<unsigned>(h_hi - p.h_lo),
                    static_cast<unsigned>(p.batch));
    launch(kernel, grid, dim3(kThreads), smem, stream, p);
  }
}

// SIMT kernels hold NPL >= ceil(D / 32) values per lane; the loops stop at D,
// so a larger tier is correct (it only costs registers). fp32 gets three
// tiers, the other dtypes (fp64: gradcheck; fp16/bf16: pre-sm_80 GPUs and
// the backward past head_dim 128) one, to keep the build short.
inline int simt_npl(int64_t D) { return D <= 64 ? 2 : D <= 128 ? 4 : 8; }
// Padded head dim of the tensor-core kernels (D <= 256).
inline int mma_dp(int64_t D) {
  return D <= 64 ? 64 : D <= 96 ? 96 : D <= 128 ? 128 : D <= 192 ? 192 : 256;
}

}  // namespace ring_attention::gpu
