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
template <typename T, int DP, int MT, int BN, KeyMap M>
__global__ void __launch_bounds__(kThreads) fwd_mma_kernel(__grid_constant__ const Problem p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // host only launches this on sm_80+
#else
  static_assert(BN % 16 == 0 && BN <= 64 && M != KeyMap::kEither);
  constexpr bool kMapped = M == KeyMap::kMapped;
  constexpr int BM = 64 * MT, LD = DP + 8, NJ = BN / 8, ND = DP / 8;
  constexpr uint64_t kAllKeys = ~uint64_t{0} >> (64 - BN);
  RING_ATTENTION_DYNAMIC_SMEM(smem);
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem);                 // BM x LD
  uint16_t* ks = qs + BM * LD;                                      // 2 stages x BN x LD
  uint16_t* vs = ks + 2 * BN * LD;                                  // 2 stages x BN x LD
  uint64_t* kbits = reinterpret_cast<uint64_t*>(vs + 2 * BN * LD);  // 2 stages: reached keys
  uint8_t* vbad = reinterpret_cast<uint8_t*>(kbits + 2);            // BN: V row had inf/NaN

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
  const int D = static_cast<int>(p.head_dim);
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  const uint16_t* k = static_cast<const uint16_t*>(p.k);
  const uint16_t* v = static_cast<const uint16_t*>(p.v);
  const RunRows q_rows = p.q_run(p.r);
  const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
  float* out = static_cast<float*>(p.out);
  float* lse = static_cast<float*>(p.lse);
  // This warp's 16 MT rows are queries m0 + [0, 16 MT) of head heads[slot]
  // (BM / pack >= 16 MT: they never straddle two heads).
  const int rph = BM / static_cast<int>(p.pack);
  const RowSlot ws = row_slot(warp * 16 * MT, rph);
  const int slot = ws.slot, m0 = ws.m;

  Tile t;
  for (BlockTiles<false> tiles(p); tiles.next(t);) {
    const int nrows = static_cast<int>(t.q.count);  // <= rph: one window
    const int64_t nk = keys_reached(p, t, nrows - 1);
    if (nk <= 0) continue;

    // Key tile at n0 into stage st (the copies form one cp.async group), and
    // its reached keys as a bit mask in kbits[st] (bit c: key n0 + c). Key n0
    // is n0 active rows past the tile's first (offsets from it: the index
    // products once per tile of rows, not per key tile).
    const int64_t k_first = key_index<M>(p, t.b, t.k.first, t.kvh);
    const RunRows keys = key_run<M>(p, t.k.first, t.kvh, p.r);
    const bool* mk_first = mask_at(p, t.b, t.k.first);
    const auto stage_keys = [&](int64_t n0, int st) {
      const int nvalid = static_cast<int>(imin(BN, nk - n0));
      const bool* mk = mk_first == nullptr ? nullptr : mk_first + n0 * p.r;
      const int64_t off = k_first + keys.at<kMapped>(n0);
      load_rows16<DP, BN, kMapped>({ks + st * BN * LD, vs + st * BN * LD}, LD, BN,
                                   {k + off, v + off}, keys.from<kMapped>(n0), nvalid, mk, p.r, D,
                                   p.vec);
      cp_async_commit();
      if (warp == 0) {
        const uint32_t lo = __ballot_sync(kFull, row_ok(lane, nvalid, mk, p.r));
        const uint32_t hi = __ballot_sync(kFull, row_ok(lane + 32, nvalid, mk, p.r));
        if (lane == 0) kbits[st] = static_cast<uint64_t>(hi) << 32 | lo;
      }
    };
    for (int j = 0; j < p.pack; ++j) {
      load_rows16<DP, BM, false>({qs + j * rph * LD}, LD, rph,
                                 {q + p.q_index(t.b, t.q.first, t.heads[j])}, q_rows, nrows,
                                 nullptr, 0, D, p.vec);
    }
    stage_keys(0, 0);  // with the query tile: the first group

    // This thread's rows: queries m0 + 16 mt + g + 8 i. Causal: key n <=
    // m + dm. The warp's first row reaches the fewest keys, its last the most.
    const int64_t first_reach = m0 + t.dm, last_reach = m0 + 16 * MT - 1 + t.dm;
    float o[MT][ND][4] = {};
    float m_run[MT][2], l_run[MT][2];
    bool poisoned[MT][2];  // the row reached a non-finite V row
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        m_run[mt][i] = -INFINITY;
        l_run[mt][i] = 0.f;
        poisoned[mt][i] = false;
      }

    for (int64_t n0 = 0, it = 0; n0 < nk; n0 += BN, ++it) {
      const int st = static_cast<int>(it & 1);
      if (n0 + BN < nk) {
        stage_keys(n0 + BN, st ^ 1);  // its stage was last read before the previous barrier
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // stage st complete for every thread
      const uint16_t* kt = ks + st * BN * LD;
      uint16_t* vt = vs + st * BN * LD;
      const uint64_t kmask = kbits[st];
      // Block-uniform: every row of the block reaches every key of the tile,
      // so a non-finite V row reaches exactly the rows whose products it
      // enters. Otherwise non-finite V rows enter P.V as zeros; the rows that
      // reach them are poisoned (NaN) below, the others never see them.
      bool any_vbad = false;
      if (kmask != kAllKeys || (p.causal && n0 + BN - 1 > t.dm) || p.windowed) {
        const bool vrow_bad = zero_nonfinite16<T, DP, BN>(vt, LD);
        if (threadIdx.x % (kThreads / BN) == 0) vbad[threadIdx.x / (kThreads / BN)] = vrow_bad;
        any_vbad = __syncthreads_or(vrow_bad) != 0;
      }

      // Warp-uniform: rows past the tile's, or (causal, windowed) rows that
      // reach no key of this tile, would add nothing.
      if (m0 < nrows && (!p.causal || n0 <= last_reach) &&
          (!p.windowed || (n0 <= last_reach + p.band_r && n0 + BN - 1 >= first_reach - p.band_l))) {
        float s[MT][NJ][4] = {};
        mma_ss<T, MT, NJ, DP>(s, qs + warp * 16 * MT * LD, LD, kt, LD, lane);

        // Every key of the tile reached by every row of the warp: no mask.
        const bool full =
            kmask == kAllKeys && (!p.causal || n0 + BN - 1 <= first_reach) &&
            (!p.windowed || (n0 >= last_reach - p.band_l && n0 + BN - 1 <= first_reach + p.band_r));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          // Two loops, not `full || ...` per element: that compiled to a
          // branch and a convergence barrier around every score.
          if (full) {
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) s[mt][j][e] *= scale_log2;
          } else {
            // Causal or windowed: key column c of the tile reaches row i iff
            // lo <= c <= hi (causal: the window's right bound is 0, its left
            // one the block's whole reach); with the tile's reached keys one
            // bit mask a row, so that a score costs one bit test (tested per
            // score, the bounds compiled to a branch around every score).
            // Bit c of reach[i]: key column c + 2 tg reaches row i.
            uint64_t reach[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const int64_t diag = first_reach + 16 * mt + g + 8 * i - n0 - 2 * tg;
              reach[i] = kmask >> (2 * tg);
              if (p.causal || p.windowed)
                reach[i] &=
                    bit_range(tile_limit(diag - p.band_l, BN), tile_limit(diag + p.band_r, BN));
            }
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int c = j * 8 + (e & 1);  // the column less 2 tg
                const bool ok = (reach[e >> 1] >> c & 1) != 0;
                s[mt][j][e] = ok ? s[mt][j][e] * scale_log2 : -INFINITY;
              }
          }
          float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
          for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][j][e]);
          float m_use[2], alpha[2];
          bool grew[2];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 2));
            const float m_new = fmaxf(m_run[mt][i], mx[i]);
            m_use[i] = m_new == -INFINITY ? 0.f : m_new;
            // Where the running max did not grow, the earlier terms keep
            // their scale (alpha = 1; or 0 on 0 while nothing is reached).
            grew[i] = m_new > m_run[mt][i];
            alpha[i] = grew[i] ? fast_exp2(m_run[mt][i] - m_use[i]) : 1.f;
            m_run[mt][i] = m_new;
            l_run[mt][i] *= alpha[i];
          }
          // Warp-uniform: the accumulators (4 ND per thread and m-tile) are
          // rescaled only on tiles where some row's max grew.
          if (__any_sync(kFull, grew[0] || grew[1])) {
#pragma unroll
            for (int j = 0; j < ND; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) o[mt][j][e] *= alpha[e >> 1];
          }
#pragma unroll
          for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              s[mt][j][e] = fast_exp2(s[mt][j][e] - m_use[e >> 1]);
              l_run[mt][e >> 1] += s[mt][j][e];  // quad-partial sums, reduced at the end
            }
          if (any_vbad) {  // block-uniform
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                if (s[mt][j][e] != 0.f && vbad[j * 8 + 2 * tg + (e & 1)])
                  poisoned[mt][e >> 1] = true;
          }
        }
        mma_rs<T, MT, ND, NJ>(o, s, vt, LD, lane);
      }
      __syncthreads();  // stage st and vbad fully read before they are rewritten
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float old[2], l[2];
      bool write[2];
      int64_t pos[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        l[i] = l_run[mt][i] + __shfl_xor_sync(kFull, l_run[mt][i], 1);
        l[i] += __shfl_xor_sync(kFull, l[i], 2);
        // (every lane shuffles: no short-circuit)
        poisoned[mt][i] |= __shfl_xor_sync(kFull, poisoned[mt][i] ? 1 : 0, 1) != 0;
        poisoned[mt][i] |= __shfl_xor_sync(kFull, poisoned[mt][i] ? 1 : 0, 2) != 0;
        const int m = m0 + 16 * mt + g + 8 * i;
        write[i] = m < nrows && l[i] != 0.f;
        pos[i] = t.q.first + m * p.r;
        old[i] = write[i] ? lse[p.row_index(t.b, t.heads[slot], pos[i])] : 0.f;
      }
      __syncwarp();  // every lane has read lse before any lane writes it
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (!write[i]) continue;
        // a +inf score: the shift is +inf and l NaN; the lse is +inf
        const float blk =
            m_run[mt][i] == INFINITY ? INFINITY : (m_run[mt][i] + log2f(l[i])) / kLog2e;
        const float inv_l = 1.f / l[i];
        const float nl = merged_lse(old[i], blk);
        float* orow = out + p.q_index(t.b, pos[i], t.heads[slot]);
#pragma unroll
        for (int j = 0; j < ND; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int d = j * 8 + 2 * tg + e;
            const float value = poisoned[mt][i] ? NAN : o[mt][j][2 * i + e] * inv_l;
            if (d < D) orow[d] = merge_value(orow[d], value, old[i], blk, nl);
          }
        if (tg == 0) lse[p.row_index(t.b, t.heads[slot], pos[i])] = nl;
      }
    }
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
  const size_t smem = (BM + 4 * BN) * (DP + 8) * sizeof(uint16_t) + 2 * sizeof(uint64_t) + BN;
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
