// CUDA block backward (ring_attention::block_backward): recomputes
// P = exp(scale q.k - lse) from the final global lse and accumulates
//   dV += P^T dO,  dS = P * (dO V^T - delta),  dQ += scale dS K,  dK += scale dS^T Q
// into fp32 (fp64 for fp64 inputs) dq, dk, dv; delta = rowsum(dO * O) -
// grad_lse comes from a small pre-kernel. Per branch two launches of one
// kernel template (the first only if dq is asked for, the second only if dk
// and dv are):
//   DKDV = false: rows are query tiles (the queries of `pack` heads that read
//                 the same keys, common.cuh), columns stream over the reached
//                 keys -> dq rows (owned by the block).
//   DKDV = true:  rows are key tiles of a K/V head, columns stream over the
//                 queries reaching them, of every query head of the
//                 key-sharing set in turn -> dk, dv rows (owned by the block).
// No atomics, deterministic. In both modes X1 = R1 C1^T, X2 = R2 C2^T with
// (R1, R2, C1, C2) = (Q, dO, K, V) or (K, V, Q, dO), so X1 is S or S^T, X2 is
// dP or dP^T, and the products with C1 (and C2) finish the gradients.
//  * fp16 / bf16, head_dim <= 128, sm_80+: mma.sync m16n8k16 (fp32 accumulate),
//    4 warps x 16 rows, 32 or 64 columns per tile, operands row-major in
//    shared memory, fragments loaded with ldmatrix (.trans for the second
//    products, whose k dimension runs down the columns of C1 and C2). Column
//    tiles are double-buffered (cp.async of the next in flight while one is
//    computed, across column heads too); which columns a tile reaches is one
//    64-bit mask; a warp skips the mask where its rows reach the whole tile
//    and the products where they reach none of it.
//  * otherwise: SIMT, one lane per column of a 32-column tile.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "common.cuh"
#include "kernels.h"

namespace ring_attention::gpu {
namespace {

// delta[b, h, l] = sum_d dout[b, l, h, d] * out[b, l, h, d] - grad_lse[b, h, l]
// (grad_lse may be nullptr: zero); one warp per row.
template <typename T, typename C>
__global__ void __launch_bounds__(kThreads)
    delta_kernel(const T* dout, const T* out, const C* grad_lse, C* delta, int64_t B, int64_t L,
                 int64_t H, int64_t D) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = B * L * H, step = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t row = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; row < rows; row += step) {
    C s = 0;
    for (int64_t d = lane; d < D; d += 32)
      s += static_cast<C>(dout[row * D + d]) * static_cast<C>(out[row * D + d]);
    s = warp_sum(s);
    if (lane == 0) {
      const int64_t h = row % H, l = (row / H) % L, b = row / (H * L);
      const int64_t idx = (b * H + h) * L + l;
      delta[idx] = grad_lse == nullptr ? s : s - grad_lse[idx];
    }
  }
}

// The column range of a tile: keys (dq) or queries (dkdv) c in [c_begin,
// c_end) of the segment meet some row of the tile.
struct Span {
  int64_t c_begin, c_end;
  int nrows;
};

template <bool DKDV>
__device__ inline bool decode_span(const Problem& p, const Tile& t, Span& s) {
  if (DKDV) {  // queries m reach key n iff m >= n - dm
    s.nrows = static_cast<int>(t.k.count);
    s.c_begin = p.causal && t.dm < 0 ? -t.dm : 0;
    s.c_end = t.q.count;
  } else {
    s.nrows = static_cast<int>(t.q.count);
    s.c_begin = 0;
    s.c_end = keys_reached(p, t, s.nrows - 1);
  }
  return s.c_begin < s.c_end;
}

// The query heads whose columns (dkdv) meet the rows of a tile: its
// key-sharing set, whose contributions to dk, dv the block sums. dq mode: the
// columns (keys) are the same for all the tile's heads; one pass.
template <bool DKDV>
__device__ inline int64_t heads_end(const Problem& p, const Tile& t) {
  return DKDV ? p.kv_group_end(t.heads[0]) : t.heads[0] + 1;
}
template <bool DKDV>
__device__ inline bool column_head(const Problem& p, const Tile& t, int64_t hq) {
  return !DKDV || p.shares_keys(hq, t.heads[0], p.branch, p.r);
}

// lse in the units of the exponent; a row that reaches nothing (-inf) gives +inf
// so that its P is exactly 0.
template <typename C>
__device__ inline C lse_for_exp(C lse, C unit) {
  return lse == neg_inf<C>() ? static_cast<C>(INFINITY) : lse * unit;
}

// The row operands of head slot `slot` of a tile, from its first row: (Q, dO)
// of heads[slot] (dq), or (K, V) of the K/V head (dkdv, one slot).
template <typename T, bool DKDV, KeyMap M>
struct Rows {
  const T *r1, *r2;
  const bool* mask;  // key padding flags of the key rows (dkdv), or nullptr
  RunRows at;        // offsets of the active rows from the first
  __device__ Rows(const Problem& p, const Tile& t, int slot) {
    if (DKDV) {
      const int64_t ko = key_index<M>(p, t.b, t.k.first, t.kvh);
      r1 = static_cast<const T*>(p.k) + ko;
      r2 = static_cast<const T*>(p.v) + ko;
      mask = mask_at(p, t.b, t.k.first);
      at = key_run<M>(p, t.k.first, t.kvh, p.r);
    } else {
      const int64_t qo = p.q_index(t.b, t.q.first, t.heads[slot]);
      r1 = static_cast<const T*>(p.q) + qo;
      r2 = static_cast<const T*>(p.grad_out) + qo;
      mask = nullptr;
      at = p.q_run(p.r);
    }
  }
};

// The column operands of a tile from column c0: (K, V) of the K/V head (dq),
// or (Q, dO) of query head hq (dkdv).
template <typename T, bool DKDV, KeyMap M>
struct Columns {
  const T *c1, *c2;
  const bool* mask;  // key padding flags of the key columns (dq), or nullptr
  RunRows at;        // offsets of the active columns from the first
  __device__ Columns(const Problem& p, const Tile& t, int64_t hq, int64_t c0) {
    if (DKDV) {
      const int64_t qo = p.q_index(t.b, t.q.first + c0 * p.r, hq);
      c1 = static_cast<const T*>(p.q) + qo;
      c2 = static_cast<const T*>(p.grad_out) + qo;
      mask = nullptr;
      at = p.q_run(p.r);
    } else {
      const int64_t pos = t.k.first + c0 * p.r;
      const int64_t ko = key_index<M>(p, t.b, pos, t.kvh);
      c1 = static_cast<const T*>(p.k) + ko;
      c2 = static_cast<const T*>(p.v) + ko;
      mask = mask_at(p, t.b, pos);
      at = key_run<M>(p, pos, t.kvh, p.r);
    }
  }
};

// lse / delta index of query row m of head slot `slot` (dq mode).
__device__ inline int64_t row_stat(const Problem& p, const Tile& t, int slot, int64_t m) {
  return p.row_index(t.b, t.heads[slot], t.q.first + m * p.r);
}

// Output row m of head slot `slot`: dq (dq mode) or dk / dv (dkdv mode,
// second = dv). The block owns it: dq += scale a1, dk += scale a1, dv += a2.
template <typename C, bool DKDV, KeyMap M>
__device__ inline C* out_row(const Problem& p, const Tile& t, int slot, int64_t m, bool second) {
  if (DKDV) {
    C* base = static_cast<C*>(second ? p.dv : p.dk);
    return base + key_index<M>(p, t.b, t.k.first + m * p.r, t.kvh);
  }
  return static_cast<C*>(p.dq) + p.q_index(t.b, t.q.first + m * p.r, t.heads[slot]);
}

// ------------------------------------------------------------------- SIMT
template <typename T, typename C, int NPL, int ROWS, bool DKDV>
__global__ void __launch_bounds__(kThreads) bwd_simt_kernel(const Problem p) {
  constexpr int DP = 32 * NPL, LDC = DP + 1;
  RING_ATTENTION_DYNAMIC_SMEM(smem);
  C* c1s = reinterpret_cast<C*>(smem);  // 32 x LDC
  C* c2s = c1s + 32 * LDC;              // 32 x LDC
  C* col_lse = c2s + 32 * LDC;          // dkdv: per query column
  C* col_delta = col_lse + 32;
  uint8_t* col_ok = reinterpret_cast<uint8_t*>(col_delta + 32);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = static_cast<int>(p.head_dim);
  const int dpr = (D + 31) / 32 * 32;  // columns the loops visit (<= DP)
  const C scale = static_cast<C>(p.scale);
  const C* lse = static_cast<const C*>(p.lse_in);
  const C* delta = static_cast<const C*>(p.delta);

  // Row warp * ROWS + i is row m[i] of head slot `slot` (one slot per warp).
  const int rph = 4 * ROWS / static_cast<int>(p.pack);
  const int slot = row_slot(warp * ROWS, rph).slot;
  int m[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) m[i] = row_slot(warp * ROWS + i, rph).m;

  Tile t;
  Span sp;
  for (BlockTiles<DKDV> tiles(p); tiles.next(t);) {
    if (!decode_span<DKDV>(p, t, sp)) continue;
    const Rows<T, DKDV, KeyMap::kEither> rows(p, t, slot);
    C r1[ROWS][NPL], r2[ROWS][NPL], a1[ROWS][NPL], a2[ROWS][NPL], row_lse[ROWS], row_delta[ROWS];
    bool rok[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      rok[i] = row_ok(m[i], sp.nrows, rows.mask, p.r);
      const int64_t off = rok[i] ? rows.at(m[i]) : 0;
      load_vec<T, C, NPL>(r1[i], rows.r1 + off, rok[i], D, lane);
      load_vec<T, C, NPL>(r2[i], rows.r2 + off, rok[i], D, lane);
#pragma unroll
      for (int j = 0; j < NPL; ++j) a1[i][j] = a2[i][j] = 0;
      row_lse[i] = static_cast<C>(INFINITY);
      row_delta[i] = 0;
      if (!DKDV && rok[i]) {
        const int64_t si = row_stat(p, t, slot, m[i]);
        row_lse[i] = lse_for_exp(lse[si], C(1));
        row_delta[i] = delta[si];
      }
    }

    for (int64_t hq = t.heads[0]; hq < heads_end<DKDV>(p, t); ++hq) {
      if (!column_head<DKDV>(p, t, hq)) continue;
      for (int64_t c0 = sp.c_begin; c0 < sp.c_end; c0 += 32) {
        const int nvalid = static_cast<int>(imin(32, sp.c_end - c0));
        const Columns<T, DKDV, KeyMap::kEither> cols(p, t, hq, c0);
        __syncthreads();  // the previous column tile fully consumed
        load_rows_simt<T, C>(c1s, LDC, dpr, cols.c1, cols.at, nvalid, cols.mask, p.r, D);
        load_rows_simt<T, C>(c2s, LDC, dpr, cols.c2, cols.at, nvalid, cols.mask, p.r, D);
        if (threadIdx.x < 32) {
          const int c = threadIdx.x;
          const bool ok = row_ok(c, nvalid, cols.mask, p.r);
          col_ok[c] = ok;
          if (DKDV) {
            const int64_t si = p.row_index(t.b, hq, t.q.first + (c0 + c) * p.r);
            col_lse[c] = ok ? lse_for_exp(lse[si], C(1)) : static_cast<C>(INFINITY);
            col_delta[c] = ok ? delta[si] : C(0);
          }
        }
        __syncthreads();

#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
          if (m[i] >= sp.nrows) continue;  // warp-uniform
          const int64_t cidx = c0 + lane;
          const int64_t qi = DKDV ? cidx : m[i], ki = DKDV ? m[i] : cidx;
          const bool ok = col_ok[lane] && rok[i] && (!p.causal || ki <= qi + t.dm) &&
                          (!p.windowed || in_band(p, ki, qi + t.dm));
          if (!__any_sync(kFull, ok)) continue;
          const C x1 = dot_bcast<C, NPL>(r1[i], c1s + lane * LDC, D);
          const C x2 = dot_bcast<C, NPL>(r2[i], c2s + lane * LDC, D);
          const C l = DKDV ? col_lse[lane] : row_lse[i];
          const C dl = DKDV ? col_delta[lane] : row_delta[i];
          const C pr = ok ? cexp(x1 * scale - l) : C(0);
          const C ds = ok ? pr * (x2 - dl) : C(0);
#pragma unroll 4
          for (int c = 0; c < 32; ++c) {
            const C dsc = __shfl_sync(kFull, ds, c);
            const C pc = __shfl_sync(kFull, pr, c);
            // Warp-uniform: an unreached column's K (dq) may be NaN, 0 * NaN = NaN.
            if (dsc == C(0) && (!DKDV || pc == C(0))) continue;
#pragma unroll
            for (int j = 0; j < NPL; ++j) {
              if (32 * j >= D) break;
              if (dsc != C(0)) a1[i][j] += dsc * c1s[c * LDC + 32 * j + lane];
              if (DKDV && pc != C(0)) a2[i][j] += pc * c2s[c * LDC + 32 * j + lane];
            }
          }
        }
      }
    }

#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      if (m[i] >= sp.nrows) continue;
      C* o1 = out_row<C, DKDV, KeyMap::kEither>(p, t, slot, m[i], false);
      C* o2 = DKDV ? out_row<C, DKDV, KeyMap::kEither>(p, t, slot, m[i], true) : nullptr;
#pragma unroll
      for (int j = 0; j < NPL; ++j) {
        const int d = lane + 32 * j;
        if (d >= D) continue;
        o1[d] += scale * a1[i][j];
        if (DKDV) o2[d] += a2[i][j];
      }
    }
  }
}

// ------------------------------------------------------------ tensor cores
template <int DP>
constexpr int mma_cols() {
  return DP > 64 ? 32 : 64;
}

// The shared memory of a block: the row tile (R1, R2), two stages of column
// tiles (C1, C2), the stages' reached columns as bit masks and (dkdv) their
// columns' lse / delta. Rows are LD apart (16-byte aligned for ldmatrix).
template <int DP, bool DKDV>
struct BwdShared {
  static constexpr int BM = 64, BN = mma_cols<DP>(), LD = DP + 8;
  static constexpr size_t kTiles = (2 * BM * LD + 4 * BN * LD) * sizeof(uint16_t);
  static constexpr size_t bytes() {
    return kTiles + 2 * sizeof(uint64_t) + (DKDV ? 4 * BN * sizeof(float) : 0);
  }
  uint16_t *r1, *r2;   // BM x LD each
  uint16_t *c1, *c2;   // 2 stages x BN x LD each
  uint64_t* kbits;     // 2 stages
  float *lse, *delta;  // dkdv: 2 stages x BN each
  __device__ explicit BwdShared(unsigned char* smem)
      : r1(reinterpret_cast<uint16_t*>(smem)),
        r2(r1 + BM * LD),
        c1(r2 + BM * LD),
        c2(c1 + 2 * BN * LD),
        kbits(reinterpret_cast<uint64_t*>(smem + kTiles)),
        lse(reinterpret_cast<float*>(kbits + 2)),
        delta(lse + 2 * BN) {}
  __device__ uint16_t* c1_stage(int st) const { return c1 + st * BN * LD; }
  __device__ uint16_t* c2_stage(int st) const { return c2 + st * BN * LD; }
};

// The column steps of a tile, in order: column tiles c0 = c_begin, c_begin +
// BN, ... < c_end of each column head in turn (dq: one).
template <bool DKDV, int BN>
struct ColumnSteps {
  int64_t hq, c0;
  __device__ ColumnSteps(const Span& sp, const Tile& t) : hq(t.heads[0]), c0(sp.c_begin) {}
  __device__ bool done(const Problem& p, const Tile& t) const {
    return hq >= heads_end<DKDV>(p, t);
  }
  __device__ void advance(const Problem& p, const Tile& t, const Span& sp) {
    c0 += BN;
    if (c0 < sp.c_end) return;
    c0 = sp.c_begin;
    do {
      ++hq;
    } while (hq < heads_end<DKDV>(p, t) && !column_head<DKDV>(p, t, hq));
  }
};

// The lse and delta of this thread's column of a column step (dkdv, thread
// < BN), in exponent units (+inf, 0 where the column is not reached).
struct ColumnStats {
  float lse = INFINITY, delta = 0.f;
};

// The row tile into shared memory: (R1, R2) of each of the pack head slots,
// rows_per_head rows each (part of the first cp.async group).
template <int DP, bool DKDV, KeyMap M>
__device__ __forceinline__ void stage_row_tile(const Problem& p, const BwdShared<DP, DKDV>& sm,
                                               const Tile& t, const Span& sp, int rows_per_head) {
  constexpr int LD = BwdShared<DP, DKDV>::LD;
  constexpr bool kRowsMapped = DKDV && M == KeyMap::kMapped;  // K/V rows are the rows (dkdv)
  for (int j = 0; j < p.pack; ++j) {
    const Rows<uint16_t, DKDV, M> rows(p, t, j);
    load_rows16<DP, 64, kRowsMapped>(
        {sm.r1 + j * rows_per_head * LD, sm.r2 + j * rows_per_head * LD}, LD, rows_per_head,
        {rows.r1, rows.r2}, rows.at, sp.nrows, rows.mask, p.r, static_cast<int>(p.head_dim), p.vec);
  }
}

// Column step `cs` into stage st: C1, C2 (one cp.async group) and the bit
// mask of its reached columns (bit c: column c0 + c) in kbits[st]. Returns
// (dkdv) this thread's column's lse / delta, to be stored in the stage once
// the step before has been computed.
template <int DP, bool DKDV, KeyMap M>
__device__ __forceinline__ ColumnStats
stage_column_step(const Problem& p, const BwdShared<DP, DKDV>& sm, const Tile& t, const Span& sp,
                  const ColumnSteps<DKDV, mma_cols<DP>()>& cs, int st) {
  constexpr int BN = mma_cols<DP>(), LD = BwdShared<DP, DKDV>::LD;
  constexpr bool kColsMapped = !DKDV && M == KeyMap::kMapped;  // K/V rows are the columns (dq)
  const int nvalid = static_cast<int>(imin(BN, sp.c_end - cs.c0));
  const Columns<uint16_t, DKDV, M> cols(p, t, cs.hq, cs.c0);
  load_rows16<DP, BN, kColsMapped>({sm.c1_stage(st), sm.c2_stage(st)}, LD, BN, {cols.c1, cols.c2},
                                   cols.at, nvalid, cols.mask, p.r, static_cast<int>(p.head_dim),
                                   p.vec);
  cp_async_commit();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const uint32_t lo = __ballot_sync(kFull, row_ok(lane, nvalid, cols.mask, p.r));
    const uint32_t hi = __ballot_sync(kFull, row_ok(lane + 32, nvalid, cols.mask, p.r));
    if (lane == 0) sm.kbits[st] = static_cast<uint64_t>(hi) << 32 | lo;
  }
  ColumnStats stats;
  if (DKDV && threadIdx.x < BN) {
    const int c = threadIdx.x;
    const bool ok = row_ok(c, nvalid, cols.mask, p.r);
    const int64_t si = p.row_index(t.b, cs.hq, t.q.first + (cs.c0 + c) * p.r);
    const float* lse = static_cast<const float*>(p.lse_in);
    const float* delta = static_cast<const float*>(p.delta);
    stats.lse = ok ? lse_for_exp(lse[si], kLog2e) : INFINITY;
    stats.delta = ok ? delta[si] : 0.f;
  }
  return stats;
}

// This thread's rows m0 + g + 8 i of its head slot: whether each is a
// reached row, and (dq) its lse (exponent units) and delta.
struct RowStats {
  bool ok[2];
  float lse[2], delta[2];
};
template <bool DKDV, KeyMap M>
__device__ __forceinline__ RowStats row_stats(const Problem& p, const Tile& t, const Span& sp,
                                              RowSlot ws) {
  const int g = threadIdx.x % 32 / 4;
  const Rows<uint16_t, DKDV, M> rows(p, t, ws.slot);
  RowStats r;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int m = ws.m + g + 8 * i;
    r.ok[i] = row_ok(m, sp.nrows, rows.mask, p.r);
    r.lse[i] = INFINITY;
    r.delta[i] = 0.f;
    if (!DKDV && r.ok[i]) {
      const int64_t si = row_stat(p, t, ws.slot, m);
      r.lse[i] = lse_for_exp(static_cast<const float*>(p.lse_in)[si], kLog2e);
      r.delta[i] = static_cast<const float*>(p.delta)[si];
    }
  }
  return r;
}

// Which pairs of the warp's rows m0 .. m0 + 15 and a column tile at c0 are
// reached. Causal: row m (query, dq) reaches column c (key) iff c <= m + dm
// (dkdv: key row m is reached by query column c iff c >= m - dm).
// Windowed: iff m + dm - band_l <= c <= m + dm + band_r (dkdv: m - dm -
// band_r <= c <= m - dm + band_l).
template <bool DKDV, int BN>
struct ColumnReach {
  int64_t m0, dm, band_lo_off, band_hi_off;  // the window's columns of row m: m + [lo, hi]
  __device__ ColumnReach(const Problem& p, const Tile& t, int64_t m0_)
      : m0(m0_),
        dm(t.dm),
        band_lo_off(DKDV ? -t.dm - p.band_r : t.dm - p.band_l),
        band_hi_off(DKDV ? -t.dm + p.band_l : t.dm + p.band_r) {}
  // Warp-uniform: some pair reached.
  __device__ bool any(const Problem& p, int64_t c0) const {
    const int64_t lo_m = m0, hi_m = m0 + 15;
    const bool none = DKDV ? c0 + BN - 1 < lo_m - dm : c0 > hi_m + dm;
    const bool none_w = c0 + BN - 1 < lo_m + band_lo_off || c0 > hi_m + band_hi_off;
    return !(p.causal && none) && !(p.windowed && none_w);
  }
  // Warp-uniform: every pair reached (all_cols: every column of the tile is
  // a reached one, all_rows: every row).
  __device__ bool whole(const Problem& p, int64_t c0, bool all_cols, bool all_rows) const {
    const int64_t lo_m = m0, hi_m = m0 + 15;
    const bool full_w = c0 >= hi_m + band_lo_off && c0 + BN - 1 <= lo_m + band_hi_off;
    return all_cols && all_rows &&
           (!p.causal || (DKDV ? c0 >= hi_m - dm : c0 + BN - 1 <= lo_m + dm)) &&
           (!p.windowed || full_w);
  }
};

// X1 = R1 C1^T and X2 = R2 C2^T of the warp's rows against the column tile
// in stage st become P (or P^T) and dS (or dS^T), zero where a pair is not
// reached; then a1 += dS C1 and (dkdv) a2 += P^T C2.
template <typename T, int DP, bool DKDV>
__device__ __forceinline__ void column_products(const Problem& p, const BwdShared<DP, DKDV>& sm,
                                                const ColumnReach<DKDV, mma_cols<DP>()>& reach,
                                                const RowStats& rs, int st, int64_t c0, bool full,
                                                float (&a1)[DP / 8][4],
                                                float (&a2)[DKDV ? DP / 8 : 1][4]) {
  constexpr int BN = mma_cols<DP>(), LD = BwdShared<DP, DKDV>::LD, NJ = BN / 8, ND = DP / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
  const uint16_t* c1t = sm.c1_stage(st);
  const uint16_t* c2t = sm.c2_stage(st);
  float x1[NJ][4] = {}, x2[NJ][4] = {};
  mma_ss<T, 1, NJ, DP>(one_tile(x1), sm.r1 + warp * 16 * LD, LD, c1t, LD, lane);
  mma_ss<T, 1, NJ, DP>(one_tile(x2), sm.r2 + warp * 16 * LD, LD, c2t, LD, lane);
  const float* clse = sm.lse + st * BN;
  const float* cdelta = sm.delta + st * BN;
  // P (or P^T) into x1 and dS (or dS^T) into x2 for element e of column
  // block j, zero where the pair is not reached.
  const auto grads = [&](int j, int e, bool ok) {
    const int i = e >> 1, col = j * 8 + 2 * tg + (e & 1);
    const float l = DKDV ? clse[col] : rs.lse[i];
    const float dl = DKDV ? cdelta[col] : rs.delta[i];
    const float pr = ok ? fast_exp2(x1[j][e] * scale_log2 - l) : 0.f;
    x2[j][e] = ok ? pr * (x2[j][e] - dl) : 0.f;
    x1[j][e] = pr;
  };
  // Two loops, not `full || ...` per element: that compiled to a branch and
  // a convergence barrier around every element.
  if (full) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) grads(j, e, true);
  } else {
    // Causal bound of this thread's rows as a column index of the tile,
    // less 2 tg; bit c - 2 tg of km: column c reached; and the window's,
    // band_lo[i] <= c <= band_hi[i].
    int lim[2], band_lo[2], band_hi[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t m = reach.m0 + g + 8 * i;
      lim[i] = tile_limit((DKDV ? m - reach.dm - c0 : m + reach.dm - c0) - 2 * tg, BN);
      band_lo[i] = tile_limit(m + reach.band_lo_off - c0 - 2 * tg, BN);
      band_hi[i] = tile_limit(m + reach.band_hi_off - c0 - 2 * tg, BN);
    }
    const uint64_t km = sm.kbits[st] >> (2 * tg);
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e >> 1, c = j * 8 + (e & 1);  // the column less 2 tg
        const bool causal_ok = DKDV ? c >= lim[i] : c <= lim[i];
        const bool band_ok = c >= band_lo[i] && c <= band_hi[i];
        grads(
            j, e,
            (km >> c & 1) != 0 && rs.ok[i] && (!p.causal || causal_ok) && (!p.windowed || band_ok));
      }
  }
  mma_rs<T, 1, ND, NJ>(one_tile(a1), one_tile(x2), c1t, LD, lane);
  if constexpr (DKDV) mma_rs<T, 1, ND, NJ>(one_tile(a2), one_tile(x1), c2t, LD, lane);
}

// This thread's rows m0 + g + 8 i of the tile's gradients, which the block
// owns: dq += scale a1 (dq mode), or dk += scale a1, dv += a2 (dkdv).
template <int DP, bool DKDV, KeyMap M>
__device__ __forceinline__ void write_gradients(const Problem& p, const Tile& t, const Span& sp,
                                                RowSlot ws, const float (&a1)[DP / 8][4],
                                                const float (&a2)[DKDV ? DP / 8 : 1][4]) {
  const int tg = threadIdx.x % 4, g = threadIdx.x % 32 / 4;
  const int D = static_cast<int>(p.head_dim);
  const float scale = static_cast<float>(p.scale);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int m = ws.m + g + 8 * i;
    if (m >= sp.nrows) continue;
    float* o1 = out_row<float, DKDV, M>(p, t, ws.slot, m, false);
    float* o2 = DKDV ? out_row<float, DKDV, M>(p, t, ws.slot, m, true) : nullptr;
#pragma unroll
    for (int j = 0; j < DP / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int d = j * 8 + 2 * tg + e;
        if (d >= D) continue;
        o1[d] += scale * a1[j][2 * i + e];
        if constexpr (DKDV) o2[d] += a2[j][2 * i + e];
      }
  }
}

// The column loop of a tile: column steps double-buffered (the copy of the
// next in flight while one is computed, across column heads too), the first
// staged already (its stats in stage 0). Accumulates the warp's rows'
// gradients into a1 and (dkdv) a2.
template <typename T, int DP, bool DKDV, KeyMap M>
__device__ __forceinline__ void attend_columns(const Problem& p, const BwdShared<DP, DKDV>& sm,
                                               const Tile& t, const Span& sp, RowSlot ws,
                                               ColumnSteps<DKDV, mma_cols<DP>()> cur,
                                               float (&a1)[DP / 8][4],
                                               float (&a2)[DKDV ? DP / 8 : 1][4]) {
  constexpr int BN = mma_cols<DP>();
  constexpr uint64_t kAllCols = ~uint64_t{0} >> (64 - BN);
  const RowStats rs = row_stats<DKDV, M>(p, t, sp, ws);
  const bool rows_all_ok = __all_sync(kFull, rs.ok[0] && rs.ok[1]);
  const ColumnReach<DKDV, BN> reach(p, t, ws.m);
  for (int it = 0; !cur.done(p, t); ++it) {
    const int st = it & 1;
    ColumnSteps<DKDV, BN> next = cur;
    next.advance(p, t, sp);
    const bool more = !next.done(p, t);
    ColumnStats stats;
    if (more) {
      stats = stage_column_step<DP, DKDV, M>(p, sm, t, sp, next,
                                             st ^ 1);  // read before the last barrier
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // stage st complete for every thread
    const int64_t c0 = cur.c0;
    const uint64_t kmask = sm.kbits[st];
    if constexpr (!DKDV) {
      // dQ += dS K: a key no row reaches has dS = 0 and its K row may be
      // non-finite: zeroed, unless every row of the block reaches every key
      // of the tile (block-uniform). A row that reaches it has a non-finite
      // lse (the forward's), so its P, dS and dQ stay NaN without that row.
      if (kmask != kAllCols || (p.causal && c0 + BN - 1 > t.dm) || p.windowed) {
        zero_nonfinite16<T, DP, BN>(sm.c1_stage(st), BwdShared<DP, DKDV>::LD);
        __syncthreads();
      }
    }
    if (ws.m < sp.nrows && reach.any(p, c0)) {
      column_products<T, DP, DKDV>(p, sm, reach, rs, st, c0,
                                   reach.whole(p, c0, kmask == kAllCols, rows_all_ok), a1, a2);
    }
    if (DKDV && more && threadIdx.x < BN) {  // stage st ^ 1 was last read before the barrier
      sm.lse[(st ^ 1) * BN + threadIdx.x] = stats.lse;
      sm.delta[(st ^ 1) * BN + threadIdx.x] = stats.delta;
    }
    cur = next;
    __syncthreads();  // stage st fully read before it is rewritten
  }
}

template <typename T, int DP, bool DKDV, KeyMap M>
__global__ void __launch_bounds__(kThreads) bwd_mma_kernel(__grid_constant__ const Problem p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // host only launches this on sm_80+
#else
  static_assert(M != KeyMap::kEither);
  constexpr int BN = mma_cols<DP>(), NA = DKDV ? DP / 8 : 1;
  RING_ATTENTION_DYNAMIC_SMEM(smem);
  const BwdShared<DP, DKDV> sm(smem);
  // This warp's 16 rows are rows m0 + [0, 16) of head slot `slot`.
  const int rph = 64 / static_cast<int>(p.pack);
  const RowSlot ws = row_slot(threadIdx.x / 32 * 16, rph);
  Tile t;
  Span sp;
  for (BlockTiles<DKDV> tiles(p); tiles.next(t);) {
    if (!decode_span<DKDV>(p, t, sp)) continue;
    __syncthreads();  // the previous tile's rows fully read
    stage_row_tile<DP, DKDV, M>(p, sm, t, sp, rph);
    const ColumnSteps<DKDV, BN> first(sp, t);
    const ColumnStats stats = stage_column_step<DP, DKDV, M>(p, sm, t, sp, first, 0);
    if (DKDV && threadIdx.x < BN) {  // with the row tile: the first group
      sm.lse[threadIdx.x] = stats.lse;
      sm.delta[threadIdx.x] = stats.delta;
    }
    float a1[DP / 8][4] = {}, a2[NA][4] = {};
    attend_columns<T, DP, DKDV, M>(p, sm, t, sp, ws, first, a1, a2);
    write_gradients<DP, DKDV, M>(p, t, sp, ws, a1, a2);
  }
#endif
}

// ------------------------------------------------------------------- host
template <typename T, typename C, int NPL>
void launch_simt(const Problem& p, at::IntArrayRef segs, at::IntArrayRef dils) {
  constexpr int ROWS = NPL <= 2 ? 4 : 2;
  const size_t smem = (2 * 32 * (32 * NPL + 1) + 64) * sizeof(C) + 32;
  if (p.dq != nullptr)
    launch_branches(bwd_simt_kernel<T, C, NPL, ROWS, false>, p, segs, dils, false, 4 * ROWS, smem);
  if (p.dk != nullptr)
    launch_branches(bwd_simt_kernel<T, C, NPL, ROWS, true>, p, segs, dils, true, 4 * ROWS, smem);
}

template <typename T, typename C>
void dispatch_simt(const Problem& p, at::IntArrayRef segs, at::IntArrayRef dils) {
  // Every dtype takes the narrowest tier its head_dim allows: the shared
  // memory grows with NPL (tier 8 needs > 64 KiB, beyond sm_75's limit).
  switch (simt_npl(p.head_dim)) {
    case 2:
      return launch_simt<T, C, 2>(p, segs, dils);
    case 4:
      return launch_simt<T, C, 4>(p, segs, dils);
  }
  launch_simt<T, C, 8>(p, segs, dils);
}

template <typename T, int DP, KeyMap M>
void launch_mma(const Problem& p, at::IntArrayRef segs, at::IntArrayRef dils) {
  if (p.dq != nullptr)
    launch_branches(bwd_mma_kernel<T, DP, false, M>, p, segs, dils, false, 64,
                    BwdShared<DP, false>::bytes());
  if (p.dk != nullptr)
    launch_branches(bwd_mma_kernel<T, DP, true, M>, p, segs, dils, true, 64,
                    BwdShared<DP, true>::bytes());
}

template <typename T, int DP>
void launch_mma(const Problem& p, at::IntArrayRef segs, at::IntArrayRef dils) {
  if (key_map_of(p) == KeyMap::kMapped) return launch_mma<T, DP, KeyMap::kMapped>(p, segs, dils);
  launch_mma<T, DP, KeyMap::kStrided>(p, segs, dils);
}

template <typename T>
void dispatch_mma(const Problem& p, at::IntArrayRef segs, at::IntArrayRef dils) {
  switch (mma_dp(p.head_dim)) {  // head_dim <= 128 here
    case 64:
      return launch_mma<T, 64>(p, segs, dils);
    case 96:
      return launch_mma<T, 96>(p, segs, dils);
    default:
      return launch_mma<T, 128>(p, segs, dils);
  }
}

}  // namespace

void block_backward(const BlockCall& call) {
  Problem p = make_problem(call);
  const DeviceGuard guard(call.device);
  if (call.q.numel() == 0 || call.k.numel() == 0 || (p.dq == nullptr && p.dk == nullptr)) return;
  const at::Tensor delta = at::empty({p.batch, p.heads, p.q_len}, call.lse.options());
  p.delta = delta.const_data_ptr();
  const at::IntArrayRef segs = call.segment_lengths, dils = call.dilation_rates;
  const int64_t rows = p.batch * p.q_len * p.heads;
  const unsigned delta_blocks =
      static_cast<unsigned>(std::min<int64_t>(ceil_div(rows, kThreads / 32), 1 << 20));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, call.dtype, "block_backward_cuda", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    launch(delta_kernel<scalar_t, acc_t>, dim3(delta_blocks), dim3(kThreads), 0, current_stream(),
           static_cast<const scalar_t*>(p.grad_out), static_cast<const scalar_t*>(p.out_in),
           static_cast<const acc_t*>(p.grad_lse), delta.mutable_data_ptr<acc_t>(), p.batch, p.q_len,
           p.heads, p.head_dim);
    if constexpr (std::is_same_v<scalar_t, double> || std::is_same_v<scalar_t, float>) {
      dispatch_simt<scalar_t, acc_t>(p, segs, dils);
    } else if (use_tensor_cores(p, 128)) {
      dispatch_mma<scalar_t>(p, segs, dils);
    } else {
      dispatch_simt<scalar_t, float>(p, segs, dils);
    }
  });
}

}  // namespace ring_attention::gpu
