// CPU block forward: flash-style tiles over the active rows of each
// (branch, head set, segment), online softmax in acc_t, merged into the
// running (out, lse) accumulators. The query rows of a head set (heads that
// read the same key rows, block_tasks.h) are stacked in one tile, so a K/V
// tile is loaded once for all of them. Dilated rows are read in place through
// their row stride; memory is O(tile), never seq x seq.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "block_tasks.h"
#include "kernels.h"
#include "key_rows.h"
#include "packed_tiles.h"
#include "split_products.h"
#include "tile_math.h"
#include "tile_path.h"

namespace ring_attention::cpu {
namespace {

constexpr int64_t kTileRows = 256;  // stacked query rows (heads x positions)
// With fp32 S split on AMX, twice that: a key tile's split K (3x the bytes of
// fp32 K^T) and V, which come from L3 once a key run outgrows L2, then serve
// twice the query rows (S and P V faster; benchmarks/RESULTS.md, its
// journal's 2026-11-26 fp32 notes).
constexpr int64_t kSplitTileRows = 512;
constexpr int64_t kTileK = 512;
// Row stride of the score and weight tiles: a cache line more than kTileK,
// so that a tile's rows do not share cache sets (MKL's bf16 S = Q K^T is
// slower at a stride of 512: benchmarks/bench.py tiles).
constexpr int64_t kLd = kTileK + 16;
// Forward tasks may split a head set (they write query rows only): at most
// this many heads share a tile, so that MQA still has tasks to spread.
constexpr size_t kMaxSetHeads = 4;
// Packed K (and V) kept for a key run, per thread: at most this many
// elements (512 KiB of bf16; LongNet's runs at head dim 64 fit whole; fp32
// split K: 6 bf16 parts a value, 3 MiB).
constexpr int64_t kMaxPacked = int64_t(1) << 18;
// A row's shift (its running m) rises only when a key tile's scores pass it
// by this much: its weights stay below e^8 (fp32 and bf16 hold them as
// precisely as weights below 1), and the tiles after its first need no pass
// for their maximum and rarely a rescale.
constexpr double kCap = 8.0;
// A row's first shift: the maximum of its first scores in the tile.
constexpr int64_t kGuessKeys = 64;

// tile_t: the type the GEMMs read (tile_math.h).
template <typename scalar_t, typename tile_t, typename acc_t>
struct ForwardTile {
  static constexpr bool kBf16Tiles = std::is_same_v<tile_t, c10::BFloat16>;
  // fp32 tiles: fp32 inputs read in place, fp16/bf16 converted.
  static constexpr bool kFp32Tiles = std::is_same_v<tile_t, float>;
  const BlockParams& p;
  const scalar_t *q, *k, *v;
  acc_t *out, *lse;
  acc_t scale;
  const TilePath path;
  // K and V packed once per key run (packed_tiles.h); the scale then enters
  // in the softmax pass. fp32 S on AMX: Q and K split into bf16 parts
  // (split_products.h), K packed so.
  const bool packed, split;
  TileBuffer<tile_t> qbuf, kbuf, vbuf, wbuf;
  TileBuffer<c10::BFloat16> qsplit;
  Weights<tile_t, acc_t> pw;
  TileBuffer<acc_t> s, o;
  // Per query row: running shift (at most kCap below the running maximum) and
  // sum, and the tile's shift and sum.
  std::vector<acc_t> m, l, m_next, row_sum, scratch;
  std::vector<int64_t> bad, bad_q;  // (bad_q: the query tile's non-finite rows, when split)
  std::vector<uint8_t> passed;      // rows whose scores passed the cap in S's epilogue
  // The key run last attended, kept for all its query tiles: its non-finite
  // V rows (indices into the run, ascending; rows [checked_from, checked)
  // looked at: all from 0 on, unless a window skips tiles) and, when packed,
  // its K/V tiles: tile t in slot min(t, slots - 1) (split: K in ksplit, and
  // its non-finite keys). A run longer than the slots keeps its first tiles
  // and packs the rest into the last slot at every visit (slot t % slots
  // would evict each tile before its next visit: all of them packed again
  // for every query tile). With a window, whose query tiles meet a few
  // advancing key tiles each, slot t % slots.
  struct {
    int64_t b = -1, kv_head = -1, first = -1, r = -1, checked_from = 0, checked = 0;
    std::vector<int64_t> bad_v, slot_tile;
    std::vector<std::vector<int64_t>> bad_k;
    TileBuffer<tile_t> k, v;
    TileBuffer<c10::BFloat16> ksplit;
  } keyrun;

  ForwardTile(const BlockParams& p_, const TilePath& path_)
      : p(p_),
        q(static_cast<const scalar_t*>(p_.q)),
        k(static_cast<const scalar_t*>(p_.k)),
        v(static_cast<const scalar_t*>(p_.v)),
        out(static_cast<acc_t*>(p_.out)),
        lse(static_cast<acc_t*>(p_.lse)),
        scale(static_cast<acc_t>(p_.scale)),
        path(path_),
        packed(path_.packed()),
        split(path_.split()),
        pw(path_.lanes) {}

  ~ForwardTile() {
    if ((kBf16Tiles && packed) || split) release_packed_gemm();
  }

  // The run's rows looked at restart at row n0 (a window skipped the tiles
  // before it): the packed tiles go with the rows they were checked with.
  void restart_checks(int64_t n0) {
    keyrun.checked_from = keyrun.checked = n0;
    keyrun.bad_v.clear();
    std::fill(keyrun.slot_tile.begin(), keyrun.slot_tile.end(), -1);
  }

  void start_key_run(int64_t b, int64_t kv_head, ActiveRun keys, int64_t r) {
    if (keyrun.b == b && keyrun.kv_head == kv_head && keyrun.first == keys.first && keyrun.r == r)
      return;
    keyrun.b = b, keyrun.kv_head = kv_head, keyrun.first = keys.first, keyrun.r = r;
    keyrun.checked_from = keyrun.checked = 0;
    keyrun.bad_v.clear();
    if (!packed) return;
    const int64_t d = p.head_dim, fit = std::max<int64_t>(1, kMaxPacked / (kTileK * d));
    const int64_t slots = std::min(ceil_div(keys.count, kTileK), fit);
    keyrun.slot_tile.assign(slots, -1);
    keyrun.bad_k.resize(slots);
    if (split)
      keyrun.ksplit.resize(slots * kTileK * 6 * d);
    else
      keyrun.k.resize(slots * kTileK * d);
    keyrun.v.resize(slots * kTileK * d);
  }

  // Whether a key tile's softmax pass runs in the epilogue of its S = Q K^T
  // (avx2::gemm_exp, while S's blocks are in registers, instead of a pass
  // over the stored tile): the AVX2 path, every row past its first key tile
  // (a finite shift) and nothing of the tile masked (no window, no key
  // padding mask; causal rows reach the whole tile: its last key is at or
  // before the first query t0).
  bool pass_in_epilogue(int64_t rows, int64_t t0, int64_t u0, int64_t r, int64_t tk) const {
    if (!kFp32Tiles || path.gemm != TileGemm::kFp32Avx2 || path.lanes != Lanes::kAvx2 || split)
      return false;
    if (p.windowed || p.key_padding_mask != nullptr || (p.causal && u0 + (tk - 1) * r > t0))
      return false;
    return std::all_of(m.begin(), m.begin() + rows, [](acc_t x) { return std::isfinite(x); });
  }

  // Attend the queries of the set's heads at positions t0 + r*i, i < tq, to
  // the key run. Tile row j * tq + i is position i of head j.
  void run(int64_t b, const HeadSet& set, int64_t r, int64_t t0, int64_t tq, ActiveRun keys) {
    constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    const int64_t d = p.head_dim, nh = static_cast<int64_t>(set.heads.size()), rows = nh * tq;
    const int64_t t_last = t0 + (tq - 1) * r;
    int64_t nk = keys.count;
    if (p.causal) nk = t_last < keys.first ? 0 : std::min(nk, (t_last - keys.first) / r + 1);
    // Window: the key tiles (whole tiles of the run, as packed) that meet the
    // query tile's band [t0 - left, t_last + right]; the others are skipped.
    int64_t n_begin = 0;
    if (p.windowed) {
      const RowRange band = band_keys(p, keys.first, r, t0, t_last, nk);
      if (band.end <= band.begin) return;
      n_begin = band.begin / kTileK * kTileK, nk = band.end;
    }
    if (nk <= n_begin) return;

    const auto row_head = [&](int64_t row) { return set.heads[row / tq]; };
    const auto row_pos = [&](int64_t row) { return t0 + (row % tq) * r; };
    const TileRef<tile_t> qt =
        nh == 1 ? tile_rows<tile_t>(q + p.q_index(b, t0, set.heads[0]), p.q_stride(r), tq, d, qbuf)
                : gather_rows<tile_t>(rows, d, qbuf, [&](int64_t row) {
                    return q + p.q_index(b, row_pos(row), row_head(row));
                  });
    s.resize(rows * kLd);
    pw.reserve(rows * kLd);
    if constexpr (kFp32Tiles) {
      if (split) {
        qsplit.resize(rows * 6 * d);
        bad_q.clear();
        split_queries(qt.ptr, qt.ld, rows, d, qsplit.data(), bad_q);
      }
    }
    o.assign(rows * d, acc_t(0));
    m.assign(rows, neg_inf);
    l.assign(rows, acc_t(0));
    m_next.resize(rows), row_sum.resize(rows), scratch.resize(4 * rows);
    start_key_run(b, set.kv_head, keys, r);
    // Packed: S comes out unscaled and the softmax pass scales it.
    const acc_t s_scale = packed ? scale : acc_t(1);

    for (int64_t n0 = n_begin; n0 < nk; n0 += kTileK) {
      const int64_t tk = std::min(kTileK, nk - n0);
      const int64_t u0 = keys.first + n0 * r;
      // Packed tiles hold the whole tile of the run (tw keys; a causal query
      // tile may use fewer), read in place: look at all its V rows, once per
      // run (while packing them, where packed).
      const int64_t tw = packed ? std::min(kTileK, keys.count - n0) : tk;
      const KeyRows key_rows(p, b, set.kv_head, u0, r, tw);
      if (n0 < keyrun.checked_from || n0 > keyrun.checked) restart_checks(n0);
      // The tile's K and V rows as tile_t. Converted inputs (fp16, bf16) of
      // a packed tile are converted only where it is packed or its
      // non-finite V rows are added back.
      TileRef<tile_t> kt{}, vt{};
      const auto read_kv = [&] {
        if (kt.ptr != nullptr) return;
        kt = key_rows.tile(k, tw, kbuf);
        vt = key_rows.tile(v, tw, vbuf);
      };
      if (!packed || std::is_same_v<scalar_t, tile_t>) read_kv();
      const auto tile_bad = [&] {
        const auto lo = std::lower_bound(keyrun.bad_v.begin(), keyrun.bad_v.end(), n0);
        const auto hi = std::lower_bound(lo, keyrun.bad_v.end(), n0 + tw);
        bad.assign(lo, hi);
        for (int64_t& j : bad) j -= n0;
      };

      const tile_t* vp = nullptr;  // packed V of the tile
      const tile_t* kp = nullptr;  // packed K^T of the tile (not split)
      const bool fused = packed && pass_in_epilogue(rows, t0, u0, r, tk);
      if constexpr (kBf16Tiles || kFp32Tiles) {
        if (packed) {
          const int64_t tile = n0 / kTileK;
          const int64_t slots = static_cast<int64_t>(keyrun.slot_tile.size());
          const int64_t slot = p.windowed ? tile % slots : std::min(tile, slots - 1);
          // K in the slot: fp32, or split (the other one is empty).
          tile_t* kslot = split ? nullptr : keyrun.k.data() + slot * kTileK * d;
          c10::BFloat16* kslot_split =
              split ? keyrun.ksplit.data() + slot * kTileK * 6 * d : nullptr;
          tile_t* vslot = keyrun.v.data() + slot * kTileK * d;
          if (keyrun.slot_tile[slot] != tile) {
            read_kv();
            if constexpr (kFp32Tiles) {
              if (split) {
                keyrun.bad_k[slot].clear();
                pack_keys_split(kt.ptr, kt.ld, tw, d, kslot_split, keyrun.bad_k[slot]);
              }
            }
            if (!split) pack_keys(kt.ptr, kt.ld, tw, d, kslot);
            if (keyrun.checked < n0 + tw) {
              // Whole tiles: the run's first visit of this one.
              TORCH_INTERNAL_ASSERT(keyrun.checked == n0);
              pack_values_checked(vt.ptr, vt.ld, tw, d, n0, keyrun.bad_v, vslot);
              keyrun.checked = n0 + tw;
              tile_bad();
            } else {
              tile_bad();
              pack_values(vt.ptr, vt.ld, tw, d, bad, vslot);
            }
            keyrun.slot_tile[slot] = tile;
          } else {
            tile_bad();
          }
          vp = vslot;
          if constexpr (kFp32Tiles) {
            if (split)
              gemm_split_scores(rows, tk, d, qsplit.data(), kslot_split, tw, s.data(), kLd, qt, kt,
                                bad_q, keyrun.bad_k[slot]);
          }
          kp = kslot;
          if (fused) {
            if constexpr (kFp32Tiles) {
#if defined(__x86_64__)
              passed.resize(rows);
              avx2::gemm_exp(rows, tk, d, qt.ptr, qt.ld, kslot, tw, s.data(), kLd, scale, m.data(),
                             acc_t(kCap), row_sum.data(), passed.data());
#endif
            }
          } else if (!split) {
            gemm_packed(path.gemm, rows, tk, d, qt.ptr, qt.ld, kslot, tw, s.data(), kLd, false);
          }
          // The products of the non-finite V rows a query row reaches are
          // added back after P V; those past tk it does not reach.
          bad.erase(std::lower_bound(bad.begin(), bad.end(), tk), bad.end());
        }
      }
      if (!packed) {
        if (keyrun.checked < n0 + tw) {
          non_finite_rows(vt, keyrun.checked - n0, tw, d, n0, keyrun.bad_v);
          keyrun.checked = n0 + tw;
        }
        tile_bad();
        gemm(false, true, rows, tk, d, scale, qt.ptr, qt.ld, kt.ptr, kt.ld, acc_t(0), s.data(),
             kLd);
      }

      const bool* mrow = p.key_padding_mask == nullptr
                             ? nullptr
                             : p.key_padding_mask + b * p.k_len + (u0 - p.k_start);
      for (int64_t i = 0; i < rows; ++i) {
        acc_t* srow = &s[i * kLd];
        if (fused) {
          // The epilogue's weights and sum stand unless a score passed the
          // cap: then the row's scores again, and the pass as below.
          m_next[i] = m[i];
          if (!passed[i]) continue;
          if constexpr (kBf16Tiles || kFp32Tiles)
            gemm_packed(path.gemm, 1, tk, d, qt.ptr + i * qt.ld, qt.ld, kp, tw, srow, kLd, false);
          row_sum[i] = pw.exp_row_lazy(srow, i * kLd, tk, s_scale, &m_next[i], kCap);
          continue;
        }
        mask_row(srow, tk, row_pos(i), u0, r, p.causal, mrow);
        if (p.windowed) mask_band(srow, tk, p, row_pos(i), u0, r);
        // The running shift stays unless the tile's scores pass it by kCap.
        // A row's first scores start it at the maximum of their first
        // kGuessKeys (one pass, not one for the maximum and one for exp).
        const bool started = m[i] != neg_inf;
        m_next[i] = started ? m[i] : row_max(srow, std::min(tk, kGuessKeys)) * s_scale;
        if (started || std::isfinite(m_next[i])) {
          row_sum[i] = pw.exp_row_lazy(srow, i * kLd, tk, s_scale, &m_next[i], kCap);
          continue;
        }
        // None of those reached (masked), or not finite: shift by the row's
        // maximum, which skips NaN scores (they turn l and the row's P to NaN).
        acc_t m_new = row_max(srow, tk) * s_scale;
        row_sum[i] = 0;
        m_next[i] = m_new;
        if (m_new == neg_inf && !has_nan(srow, tk)) {
          pw.zero_row(srow, i * kLd, tk);  // reaches nothing yet
          continue;
        }
        if (m_new == neg_inf) m_new = m_next[i] = 0;  // only NaN: any finite shift
        row_sum[i] = pw.exp_row(srow, i * kLd, tk, s_scale, m_new);
      }
      rescale_rows(rows, d, m.data(), m_next.data(), l.data(), row_sum.data(), o.data(),
                   scratch.data());
      if constexpr (kBf16Tiles || kFp32Tiles) {
        if (packed) {
          if (!bad.empty()) read_kv();
          gemm_weights_packed(path.gemm, rows, d, tk, pw.of(s.data()), kLd, vp, vt, bad, o.data(),
                              d, true);
          continue;
        }
      }
      gemm_weights(rows, d, tk, acc_t(1), pw.of(s.data()), kLd, vt, acc_t(1), o.data(), d, bad,
                   wbuf);
    }

    merge_rows(
        rows, d, o.data(), m.data(), l.data(),
        [&](int64_t i) { return out + p.q_index(b, row_pos(i), row_head(i)); },
        [&](int64_t i) { return lse + p.row_index(b, row_head(i), row_pos(i)); }, scratch.data());
  }
};

template <typename scalar_t, typename tile_t>
void forward_kernel(const BlockCall& call, const TilePath& path) {
  using acc_t = at::opmath_type<scalar_t>;
  const BlockParams& p = call.params;
  for (int64_t i = 0; i < p.n_branches; ++i) {
    const BranchWork work =
        branch_work(p, i, call.segment_lengths[i], call.dilation_rates[i], kMaxSetHeads);
    const int64_t r = work.r;
    using Tile = ForwardTile<scalar_t, tile_t, acc_t>;
    for_each_task(
        p, work, [&] { return Tile(p, path); },
        [&](Tile& tile, const SegmentTask& task) {
          const HeadSet& set = work.head_sets[task.head_set];
          const int64_t tile_rows = tile.split ? kSplitTileRows : kTileRows;
          const int64_t tq =
              std::max<int64_t>(1, tile_rows / static_cast<int64_t>(set.heads.size()));
          for (size_t s = task.seg_begin; s < task.seg_end; ++s) {
            const SegmentRuns runs = segment_runs(p, work, s, set.offset);
            if (runs.k.count == 0) continue;
            for (int64_t m0 = 0; m0 < runs.q.count; m0 += tq) {
              tile.run(task.b, set, r, runs.q.first + m0 * r, std::min(tq, runs.q.count - m0),
                       runs.k);
            }
          }
        });
  }
}

}  // namespace

void block_forward(const BlockCall& call) {
  const TilePath path =
      run_path(Pass::kForward, call.dtype, call.params.head_dim, call.params.scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, call.dtype, "block_forward_cpu", [&] {
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (path.bf16_tiles()) return forward_kernel<scalar_t, scalar_t>(call, path);
    }
    forward_kernel<scalar_t, at::opmath_type<scalar_t>>(call, path);
  });
}

}  // namespace ring_attention::cpu
