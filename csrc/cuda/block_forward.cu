// CUDA block forward (ring_attention::block_forward; arguments in params.h):
// flash-style tiles over the active rows of each (branch, segment, head set,
// batch), online softmax with fp32 (fp64 for fp64 inputs) state, merged into
// the running (out, lse) accumulators. Never materialises seq x seq. A tile's
// rows are the queries of `pack` heads that read the same keys (common.cuh),
// so each K/V tile serves all of them.
//
//  * fp16 / bf16, head_dim <= 256, sm_80+: tensor cores (mma.sync m16n8k16,
//    fp32 accumulate). 4 warps, two m-tiles of 16 query rows per warp (128
//    rows a block; one m-tile above head_dim 128) x 64 keys per tile (32
//    above head_dim 64, 16 above 192); Q, K, V row-major in shared memory,
//    fragments loaded with ldmatrix (V with .trans); S and O live in
//    registers, P is re-packed from the S fragments. K/V tiles are
//    double-buffered: the copy (cp.async) of tile n+1 is in flight while
//    tile n is computed. Which keys a tile reaches is one 64-bit mask
//    (ballots, staged with the tile); tiles every row of a warp reaches
//    whole skip the mask, tiles none reaches skip the products, and tiles
//    every row of the block reaches whole skip the scan for non-finite V
//    rows (and its barrier).
//  * otherwise (fp32, fp64, older GPUs): SIMT kernel, one lane per key of a
//    32-key tile, each warp owns ROWS query rows.
#include <ATen/Dispatch.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "common.cuh"
#include "kernels.h"

namespace ring_attention::gpu {
namespace {

// ------------------------------------------------------------------- SIMT
template <typename T, typename C, int NPL, int ROWS>
__global__ void __launch_bounds__(kThreads) fwd_simt_kernel(const Problem p) {
  constexpr int DP = 32 * NPL, BM = 4 * ROWS, LDK = DP + 1;
  RING_ATTENTION_DYNAMIC_SMEM(smem);
  C* ks = reinterpret_cast<C*>(smem);  // 32 x LDK
  C* vs = ks + 32 * LDK;               // 32 x DP
  uint8_t* kok = reinterpret_cast<uint8_t*>(vs + 32 * DP);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = static_cast<int>(p.head_dim);
  const int dpr = (D + 31) / 32 * 32;  // columns the loops visit (<= DP)
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const C scale = static_cast<C>(p.scale);
  C* out = static_cast<C*>(p.out);
  C* lse = static_cast<C*>(p.lse);
  // Row warp * ROWS + i is query m[i] of head heads[slot] (one slot per warp).
  const int rph = BM / static_cast<int>(p.pack);
  const int slot = row_slot(warp * ROWS, rph).slot;
  int m[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) m[i] = row_slot(warp * ROWS + i, rph).m;

  Tile t;
  for (BlockTiles<false> tiles(p); tiles.next(t);) {
    const int nrows = static_cast<int>(t.q.count);  // <= rph: one window
    const int64_t nk = keys_reached(p, t, nrows - 1);
    if (nk <= 0) continue;
    const int64_t h = t.heads[slot];

    C qv[ROWS][NPL], acc[ROWS][NPL], m_run[ROWS], l_run[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int64_t pos = t.q.first + m[i] * p.r;
      load_vec<T, C, NPL>(qv[i], m[i] < nrows ? q + p.q_index(t.b, pos, h) : q, m[i] < nrows, D,
                          lane);
#pragma unroll
      for (int j = 0; j < NPL; ++j) acc[i][j] = 0;
      m_run[i] = neg_inf<C>();
      l_run[i] = 0;
    }

    for (int64_t n0 = 0; n0 < nk; n0 += 32) {
      const int nvalid = static_cast<int>(imin(32, nk - n0));
      const int64_t pos0 = t.k.first + n0 * p.r;
      const bool* mk = mask_at(p, t.b, pos0);
      const int64_t off = p.k_index(t.b, pos0, t.kvh);
      const RunRows at = p.k_run(pos0, t.kvh, p.r);
      __syncthreads();  // previous tile fully consumed
      load_rows_simt<T, C>(ks, LDK, dpr, k + off, at, nvalid, mk, p.r, D);
      load_rows_simt<T, C>(vs, DP, dpr, v + off, at, nvalid, mk, p.r, D);
      if (threadIdx.x < 32) kok[threadIdx.x] = row_ok(threadIdx.x, nvalid, mk, p.r);
      __syncthreads();

#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        if (m[i] >= nrows) continue;  // warp-uniform
        const C s = dot_bcast<C, NPL>(qv[i], ks + lane * LDK, D);
        const bool ok = kok[lane] && (!p.causal || n0 + lane <= m[i] + t.dm) &&
                        (!p.windowed || in_band(p, n0 + lane, m[i] + t.dm));
        const C x = ok ? s * scale : neg_inf<C>();
        const C m_new = cmax(m_run[i], warp_max(x));
        const C m_use = m_new == neg_inf<C>() ? C(0) : m_new;
        const C alpha = cexp(m_run[i] - m_use);
        const C pr = cexp(x - m_use);
        m_run[i] = m_new;
        l_run[i] = l_run[i] * alpha + pr;  // lane-partial sums, reduced at the end
#pragma unroll
        for (int j = 0; j < NPL; ++j) acc[i][j] *= alpha;
        if (!__any_sync(kFull, pr != C(0))) continue;
#pragma unroll 4
        for (int c = 0; c < 32; ++c) {
          const C pc = __shfl_sync(kFull, pr, c);
          if (pc == C(0)) continue;  // warp-uniform; an unreached key's V may be NaN
#pragma unroll
          for (int j = 0; j < NPL; ++j)
            if (32 * j < D) acc[i][j] += pc * vs[c * DP + 32 * j + lane];
        }
      }
    }

#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const C l = warp_sum(l_run[i]);
      if (m[i] >= nrows || l == C(0)) continue;  // warp-uniform; no key reached
      const int64_t pos = t.q.first + m[i] * p.r;
      const int64_t li = p.row_index(t.b, h, pos);
      const C old = lse[li];
      __syncwarp();  // every lane has read lse before lane 0 writes it
      // a +inf score: the shift is +inf and l NaN; the lse is +inf
      const C blk = m_run[i] == static_cast<C>(INFINITY) ? m_run[i] : m_run[i] + clog(l);
      const C nl = merged_lse(old, blk);
      C* orow = out + p.q_index(t.b, pos, h);
#pragma unroll
      for (int j = 0; j < NPL; ++j) {
        const int d = lane + 32 * j;
        if (d < D) orow[d] = merge_value(orow[d], acc[i][j] / l, old, blk, nl);
      }
      if (lane == 0) lse[li] = nl;
    }
  }
}

// ------------------------------------------------------------ tensor cores
// Each warp owns MT m-tiles of 16 query rows (BM = 64 MT rows a block): every
// K / V fragment it loads from shared memory serves MT m-tiles. BN keys a
// tile (at most 64). M: strided or mapped K/V rows (common.cuh, KeyMap).

// Where the key tiles of a row tile come from: K and V at the first key, the
// run of the key rows from it, the key padding flag of the first key (or
// nullptr) and the keys the tile's rows reach. Block-uniform, so it sits in
// shared memory rather than in every thread's registers through the key
// loop, where the accumulators need them (ptxas spilled at head dim 128).
struct KeySource {
  const uint16_t *k, *v;
  const bool* mask;
  RunRows rows;
  int64_t count;
};

// The shared memory of a block: the query tile, two stages of K and V
// tiles, the stages' reached keys (bit c: key c of the tile), the row tile's
// KeySource and which V rows of the tile being computed are not finite.
// Rows are LD apart (16-byte aligned for ldmatrix).
template <int DP, int MT, int BN>
struct FwdShared {
  static constexpr int BM = 64 * MT, LD = DP + 8;
  static constexpr size_t kTiles = (BM + 4 * BN) * LD * sizeof(uint16_t);
  static constexpr size_t bytes() { return kTiles + 2 * sizeof(uint64_t) + sizeof(KeySource) + BN; }
  uint16_t* q;      // BM x LD
  uint16_t* k;      // 2 stages x BN x LD
  uint16_t* v;      // 2 stages x BN x LD
  uint64_t* kbits;  // 2 stages
  KeySource* keys;  // 1
  uint8_t* vbad;    // BN
  __device__ explicit FwdShared(unsigned char* smem)
      : q(reinterpret_cast<uint16_t*>(smem)),
        k(q + BM * LD),
        v(k + 2 * BN * LD),
        kbits(reinterpret_cast<uint64_t*>(smem + kTiles)),
        keys(reinterpret_cast<KeySource*>(kbits + 2)),
        vbad(reinterpret_cast<uint8_t*>(keys + 1)) {}
  __device__ uint16_t* k_stage(int st) const { return k + st * BN * LD; }
  __device__ uint16_t* v_stage(int st) const { return v + st * BN * LD; }
};

// This thread's query rows of a row tile, row g + 8 i of m-tile mt: the
// output accumulators (C fragments over the head dim), the running max (in
// log2 units) and sum (quad-partial until write_rows), and whether the row
// reached a non-finite V row.
template <int MT, int ND>
struct FwdRows {
  float o[MT][ND][4] = {};
  float m_run[MT][2], l_run[MT][2];
  bool poisoned[MT][2];
  __device__ FwdRows() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        m_run[mt][i] = -INFINITY;
        l_run[mt][i] = 0.f;
        poisoned[mt][i] = false;
      }
  }
};

// The row tile's KeySource into shared memory (visible to the whole block on
// return): its keys start at t.k.first, nk of them reached. The previous
// row tile's key loop has read its KeySource before its last barrier.
template <int DP, int MT, int BN, KeyMap M>
__device__ __forceinline__ void publish_key_source(const Problem& p,
                                                   const FwdShared<DP, MT, BN>& sm, const Tile& t,
                                                   int64_t nk) {
  const int64_t first = key_index<M>(p, t.b, t.k.first, t.kvh);
  const KeySource src{static_cast<const uint16_t*>(p.k) + first,
                      static_cast<const uint16_t*>(p.v) + first, mask_at(p, t.b, t.k.first),
                      key_run<M>(p, t.k.first, t.kvh, p.r), nk};
  if (threadIdx.x == 0) *sm.keys = src;
  __syncthreads();
}

// The queries of the tile's pack heads into shared memory: rows_per_head
// rows a head (part of the first cp.async group).
template <int DP, int MT, int BN>
__device__ __forceinline__ void stage_query_tile(const Problem& p, const FwdShared<DP, MT, BN>& sm,
                                                 const Tile& t, int rows_per_head) {
  constexpr int LD = FwdShared<DP, MT, BN>::LD;
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  for (int j = 0; j < p.pack; ++j) {
    load_rows16<DP, 64 * MT, false>({sm.q + j * rows_per_head * LD}, LD, rows_per_head,
                                    {q + p.q_index(t.b, t.q.first, t.heads[j])}, p.q_run(p.r),
                                    static_cast<int>(t.q.count), nullptr, 0,
                                    static_cast<int>(p.head_dim), p.vec);
  }
}

// Key tile n0 of the row tile into stage st: K and V (one cp.async group)
// and its reached keys as a bit mask in kbits[st] (bit c: key n0 + c). Key
// n0 is n0 active rows past the KeySource's first.
template <int DP, int MT, int BN, KeyMap M>
__device__ __forceinline__ void stage_key_tile(const Problem& p, const FwdShared<DP, MT, BN>& sm,
                                               int64_t n0, int st) {
  constexpr bool kMapped = M == KeyMap::kMapped;
  constexpr int LD = FwdShared<DP, MT, BN>::LD;
  const KeySource& src = *sm.keys;
  const int nvalid = static_cast<int>(imin(BN, src.count - n0));
  const bool* mk = src.mask == nullptr ? nullptr : src.mask + n0 * p.r;
  const int64_t off = src.rows.at<kMapped>(n0);
  load_rows16<DP, BN, kMapped>({sm.k_stage(st), sm.v_stage(st)}, LD, BN, {src.k + off, src.v + off},
                               src.rows.from<kMapped>(n0), nvalid, mk, p.r,
                               static_cast<int>(p.head_dim), p.vec);
  cp_async_commit();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const uint32_t lo = __ballot_sync(kFull, row_ok(lane, nvalid, mk, p.r));
    const uint32_t hi = __ballot_sync(kFull, row_ok(lane + 32, nvalid, mk, p.r));
    if (lane == 0) sm.kbits[st] = static_cast<uint64_t>(hi) << 32 | lo;
  }
}

// Block-uniform: every row of the block reaches every key of the tile, so a
// non-finite V row reaches exactly the rows whose products it enters.
// Otherwise non-finite V rows of stage st enter P.V as zeros, flagged in
// vbad; the rows that reach them are poisoned (NaN), the others never see
// them. Returns whether the stage had any (block-uniform).
template <typename T, int DP, int MT, int BN>
__device__ __forceinline__ bool zero_bad_values(const Problem& p, const FwdShared<DP, MT, BN>& sm,
                                                int st, uint64_t kmask, int64_t n0, int64_t dm) {
  constexpr uint64_t kAllKeys = ~uint64_t{0} >> (64 - BN);
  if (kmask == kAllKeys && !(p.causal && n0 + BN - 1 > dm) && !p.windowed) return false;
  const bool vrow_bad = zero_nonfinite16<T, DP, BN>(sm.v_stage(st), FwdShared<DP, MT, BN>::LD);
  if (threadIdx.x % (kThreads / BN) == 0) sm.vbad[threadIdx.x / (kThreads / BN)] = vrow_bad;
  return __syncthreads_or(vrow_bad) != 0;
}

// The key columns of a tile's warp rows: the rows reach keys n iff
// first_reach - band_l <= n <= last_reach + band_r (causal: n <= m + dm,
// windowed: within the band; the warp's first row reaches the fewest keys,
// its last the most).
struct WarpReach {
  int64_t first, last;
  // Warp-uniform: rows past the tile's, or (causal, windowed) rows that
  // reach no key of the tile at n0, would add nothing.
  __device__ bool any(const Problem& p, int64_t n0, int bn, bool rows_live) const {
    return rows_live && (!p.causal || n0 <= last) &&
           (!p.windowed || (n0 <= last + p.band_r && n0 + bn - 1 >= first - p.band_l));
  }
  // Every key of the tile at n0 reached by every row of the warp (kmask: all
  // its keys reached): no mask.
  __device__ bool whole(const Problem& p, int64_t n0, int bn, bool all_keys) const {
    return all_keys && (!p.causal || n0 + bn - 1 <= first) &&
           (!p.windowed || (n0 >= last - p.band_l && n0 + bn - 1 <= first + p.band_r));
  }
};

// The scores of m-tile mt in log2 units, -inf where the key column does
// not reach the row. Causal or windowed: key column c of the tile reaches
// row i iff lo <= c <= hi (causal: the window's right bound is 0, its left
// one the block's whole reach); with the tile's reached keys one bit mask a
// row, so that a score costs one bit test (tested per score, the bounds
// compiled to a branch around every score). Bit c of reach[i]: key column
// c + 2 tg reaches row i.
template <int BN>
__device__ __forceinline__ void mask_scores(const Problem& p, float (&s)[BN / 8][4], float scale,
                                            uint64_t kmask, int64_t diag0, int tg) {
  uint64_t reach[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t diag = diag0 + 8 * i;
    reach[i] = kmask >> (2 * tg);
    if (p.causal || p.windowed)
      reach[i] &= bit_range(tile_limit(diag - p.band_l, BN), tile_limit(diag + p.band_r, BN));
  }
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = j * 8 + (e & 1);  // the column less 2 tg
      const bool ok = (reach[e >> 1] >> c & 1) != 0;
      s[j][e] = ok ? s[j][e] * scale : -INFINITY;
    }
}

// One online-softmax step of m-tile mt over a key tile's scores s (log2
// units): the running max and sum move on, the accumulators are rescaled
// where a row's max grew, and s becomes P (the weights of the P.V product).
template <int MT, int ND, int NJ>
__device__ __forceinline__ void online_softmax(FwdRows<MT, ND>& rows, int mt, float (&s)[NJ][4]) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
  float m_use[2], alpha[2];
  bool grew[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 2));
    const float m_new = fmaxf(rows.m_run[mt][i], mx[i]);
    m_use[i] = m_new == -INFINITY ? 0.f : m_new;
    // Where the running max did not grow, the earlier terms keep their
    // scale (alpha = 1; or 0 on 0 while nothing is reached).
    grew[i] = m_new > rows.m_run[mt][i];
    alpha[i] = grew[i] ? fast_exp2(rows.m_run[mt][i] - m_use[i]) : 1.f;
    rows.m_run[mt][i] = m_new;
    rows.l_run[mt][i] *= alpha[i];
  }
  // Warp-uniform: the accumulators (4 ND per thread and m-tile) are
  // rescaled only on tiles where some row's max grew.
  if (__any_sync(kFull, grew[0] || grew[1])) {
#pragma unroll
    for (int j = 0; j < ND; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) rows.o[mt][j][e] *= alpha[e >> 1];
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[j][e] = fast_exp2(s[j][e] - m_use[e >> 1]);
      rows.l_run[mt][e >> 1] += s[j][e];  // quad-partial sums, reduced at the end
    }
}

// The rows of m-tile mt whose weight on a non-finite V row of the tile
// (vbad) is not 0 become poisoned.
template <int MT, int ND, int NJ>
__device__ __forceinline__ void mark_poisoned(FwdRows<MT, ND>& rows, int mt,
                                              const float (&s)[NJ][4], const uint8_t* vbad,
                                              int tg) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (s[j][e] != 0.f && vbad[j * 8 + 2 * tg + (e & 1)]) rows.poisoned[mt][e >> 1] = true;
}

// S = Q K^T of the warp's rows against the key tile in stage st, then for
// each m-tile the mask, the online softmax and the poisoned rows; then
// O += P V.
template <typename T, int DP, int MT, int BN>
__device__ __forceinline__ void attend_key_tile(const Problem& p, const FwdShared<DP, MT, BN>& sm,
                                                FwdRows<MT, DP / 8>& rows, int st, int64_t n0,
                                                const WarpReach& reach, bool full, bool any_vbad) {
  constexpr int LD = FwdShared<DP, MT, BN>::LD, NJ = BN / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
  const uint64_t kmask = sm.kbits[st];
  float s[MT][NJ][4] = {};
  mma_ss<T, MT, NJ, DP>(s, sm.q + warp * 16 * MT * LD, LD, sm.k_stage(st), LD, lane);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    // Two loops, not `full || ...` per element: that compiled to a branch
    // and a convergence barrier around every score.
    if (full) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][j][e] *= scale_log2;
    } else {
      mask_scores<BN>(p, s[mt], scale_log2, kmask, reach.first + 16 * mt + g - n0 - 2 * tg, tg);
    }
    online_softmax(rows, mt, s[mt]);
    if (any_vbad) mark_poisoned(rows, mt, s[mt], sm.vbad, tg);  // block-uniform
  }
  mma_rs<T, MT, DP / 8, NJ>(rows.o, s, sm.v_stage(st), LD, lane);
}

// The key loop of a row tile: key tiles of BN double-buffered (the copy of
// tile n + 1 in flight while tile n is computed), the first one staged
// already; m0: the warp's first row, nrows the tile's rows.
template <typename T, int DP, int MT, int BN, KeyMap M>
__device__ __forceinline__ void attend_keys(const Problem& p, const FwdShared<DP, MT, BN>& sm,
                                            FwdRows<MT, DP / 8>& rows, const Tile& t, int64_t nk,
                                            int m0, int nrows) {
  constexpr uint64_t kAllKeys = ~uint64_t{0} >> (64 - BN);
  // This thread's rows: queries m0 + 16 mt + g + 8 i. Causal: key n <= m + dm.
  const WarpReach reach{m0 + t.dm, m0 + 16 * MT - 1 + t.dm};
  for (int64_t n0 = 0, it = 0; n0 < nk; n0 += BN, ++it) {
    const int st = static_cast<int>(it & 1);
    if (n0 + BN < nk) {
      stage_key_tile<DP, MT, BN, M>(p, sm, n0 + BN, st ^ 1);  // read before the last barrier
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // stage st complete for every thread
    const uint64_t kmask = sm.kbits[st];
    const bool any_vbad = zero_bad_values<T>(p, sm, st, kmask, n0, t.dm);
    if (reach.any(p, n0, BN, m0 < nrows))
      attend_key_tile<T>(p, sm, rows, st, n0, reach, reach.whole(p, n0, BN, kmask == kAllKeys),
                         any_vbad);
    __syncthreads();  // stage st and vbad fully read before they are rewritten
  }
}

// heads[slot] of a tile, read without a run-time index into the array (an
// indexed read kept the element's address live through the key loop, and
// spilled it, at head dim 192).
__device__ __forceinline__ int64_t head_of(const Tile& t, int slot) {
  int64_t h = t.heads[0];
#pragma unroll
  for (int j = 1; j < kMaxPack; ++j)
    if (j == slot) h = t.heads[j];
  return h;
}

// This thread's rows merged into (out, lse): the block's lse and
// normalised output (NaN for poisoned rows) against the running ones.
// Rows that reached no key (l = 0) and rows past the tile's stay.
template <int MT, int ND>
__device__ __forceinline__ void write_rows(const Problem& p, const Tile& t, RowSlot ws, int nrows,
                                           FwdRows<MT, ND>& rows) {
  const int lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
  const int D = static_cast<int>(p.head_dim);
  float* out = static_cast<float*>(p.out);
  float* lse = static_cast<float*>(p.lse);
  const int64_t h = head_of(t, ws.slot);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float old[2], l[2];
    bool write[2];
    int64_t pos[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l[i] = rows.l_run[mt][i] + __shfl_xor_sync(kFull, rows.l_run[mt][i], 1);
      l[i] += __shfl_xor_sync(kFull, l[i], 2);
      // (every lane shuffles: no short-circuit)
      bool& poisoned = rows.poisoned[mt][i];
      poisoned |= __shfl_xor_sync(kFull, poisoned ? 1 : 0, 1) != 0;
      poisoned |= __shfl_xor_sync(kFull, poisoned ? 1 : 0, 2) != 0;
      const int m = ws.m + 16 * mt + g + 8 * i;
      write[i] = m < nrows && l[i] != 0.f;
      pos[i] = t.q.first + m * p.r;
      old[i] = write[i] ? lse[p.row_index(t.b, h, pos[i])] : 0.f;
    }
    __syncwarp();  // every lane has read lse before any lane writes it
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!write[i]) continue;
      // a +inf score: the shift is +inf and l NaN; the lse is +inf
      const float m_run = rows.m_run[mt][i];
      const float blk = m_run == INFINITY ? INFINITY : (m_run + log2f(l[i])) / kLog2e;
      const float inv_l = 1.f / l[i];
      const float nl = merged_lse(old[i], blk);
      float* orow = out + p.q_index(t.b, pos[i], h);
#pragma unroll
      for (int j = 0; j < ND; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int d = j * 8 + 2 * tg + e;
          const float value = rows.poisoned[mt][i] ? NAN : rows.o[mt][j][2 * i + e] * inv_l;
          if (d < D) orow[d] = merge_value(orow[d], value, old[i], blk, nl);
        }
      if (tg == 0) lse[p.row_index(t.b, h, pos[i])] = nl;
    }
  }
}

template <typename T, int DP, int MT, int BN, KeyMap M>
__global__ void __launch_bounds__(kThreads) fwd_mma_kernel(__grid_constant__ const Problem p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // host only launches this on sm_80+
#else
  static_assert(BN % 16 == 0 && BN <= 64 && M != KeyMap::kEither);
  RING_ATTENTION_DYNAMIC_SMEM(smem);
  const FwdShared<DP, MT, BN> sm(smem);
  // This warp's 16 MT rows are queries m0 + [0, 16 MT) of head heads[slot]
  // (BM / pack >= 16 MT: they never straddle two heads).
  const int rph = 64 * MT / static_cast<int>(p.pack);
  const RowSlot ws = row_slot(threadIdx.x / 32 * 16 * MT, rph);
  Tile t;
  for (BlockTiles<false> tiles(p); tiles.next(t);) {
    const int nrows = static_cast<int>(t.q.count);  // <= rph: one window
    const int64_t nk = keys_reached(p, t, nrows - 1);
    if (nk <= 0) continue;
    publish_key_source<DP, MT, BN, M>(p, sm, t, nk);
    stage_query_tile(p, sm, t, rph);
    stage_key_tile<DP, MT, BN, M>(p, sm, 0, 0);  // with the query tile: the first group
    FwdRows<MT, DP / 8> rows;
    attend_keys<T, DP, MT, BN, M>(p, sm, rows, t, nk, ws.m, nrows);
    write_rows(p, t, ws, nrows, rows);
  }
#endif
}

// ------------------------------------------------------------------- host
template <typename T, typename C, int NPL>
void launch_simt(const Problem& p, at::IntArrayRef segs, at::IntArrayRef dils) {
  constexpr int ROWS = NPL <= 2 ? 4 : 2;
  const size_t smem = (32 * (32 * NPL + 1) + 32 * 32 * NPL) * sizeof(C) + 32;
  launch_branches(fwd_simt_kernel<T, C, NPL, ROWS>, p, segs, dils, false, 4 * ROWS, smem);
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

// Tiles by head dim: two m-tiles per warp (128 query rows a block) up to
// head_dim 128, one above; 64 keys a tile up to head_dim 64, 32 up to 192,
// 16 above, so that the accumulators fit the registers (ptxas, sm_90:
// 200-254 registers, no spills) and the shared memory every sm_80+ GPU's 99
// KiB (head_dim 256: 67 KiB). Up to 128 these are FlashAttention-2's sm_80
// tiles for non-causal attention; none is yet timed on a GPU.
template <int DP>
constexpr int mma_m_tiles() {
  return DP <= 128 ? 2 : 1;
}
template <int DP>
constexpr int mma_keys() {
  return DP <= 64 ? 64 : DP <= 192 ? 32 : 16;
}

template <typename T, int DP>
void launch_mma(const Problem& p, at::IntArrayRef segs, at::IntArrayRef dils) {
  constexpr int MT = mma_m_tiles<DP>(), BM = 64 * MT, BN = mma_keys<DP>();
  constexpr size_t smem = FwdShared<DP, MT, BN>::bytes();
  if (key_map_of(p) == KeyMap::kMapped) {
    launch_branches(fwd_mma_kernel<T, DP, MT, BN, KeyMap::kMapped>, p, segs, dils, false, BM, smem);
  } else {
    launch_branches(fwd_mma_kernel<T, DP, MT, BN, KeyMap::kStrided>, p, segs, dils, false, BM,
                    smem);
  }
}

template <typename T>
void dispatch_mma(const Problem& p, at::IntArrayRef segs, at::IntArrayRef dils) {
  switch (mma_dp(p.head_dim)) {
    case 64:
      return launch_mma<T, 64>(p, segs, dils);
    case 96:
      return launch_mma<T, 96>(p, segs, dils);
    case 128:
      return launch_mma<T, 128>(p, segs, dils);
    case 192:
      return launch_mma<T, 192>(p, segs, dils);
    default:
      return launch_mma<T, 256>(p, segs, dils);
  }
}

}  // namespace

void block_forward(const BlockCall& call) {
  const Problem p = make_problem(call);
  const DeviceGuard guard(call.device);
  if (call.q.numel() == 0 || call.k.numel() == 0) return;
  const at::IntArrayRef segs = call.segment_lengths, dils = call.dilation_rates;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, call.dtype, "block_forward_cuda", [&] {
    if constexpr (std::is_same_v<scalar_t, double> || std::is_same_v<scalar_t, float>) {
      dispatch_simt<scalar_t, scalar_t>(p, segs, dils);
    } else if (use_tensor_cores(p, 256)) {
      dispatch_mma<scalar_t>(p, segs, dils);
    } else {
      dispatch_simt<scalar_t, float>(p, segs, dils);
    }
  });
}

}  // namespace ring_attention::gpu
