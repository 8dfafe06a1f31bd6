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

  // The query rows of a tile: row j * tq + i is position t0 + r*i of head
  // heads[j] of the set, in batch row b.
  struct QueryRows {
    int64_t b, r, t0, tq;
    const HeadSet& set;
    int64_t head(int64_t row) const { return set.heads[row / tq]; }
    int64_t pos(int64_t row) const { return t0 + (row % tq) * r; }
  };

  // One key tile of the run: keys n0 .. n0 + tk of it, at positions u0 + r*j.
  // Packed tiles hold the whole tile of the run (tw keys; a causal query tile
  // may use fewer). Its K and V rows as tile_t (kt, vt) are read only where
  // needed (read_kv): converted inputs (fp16, bf16) of a packed tile only
  // where it is packed or its non-finite V rows are added back.
  struct KeyTile {
    int64_t n0, tk, u0, tw;
    KeyRows rows;
    TileRef<tile_t> kt{}, vt{};
  };

  // The packed K (fp32 K^T, or split into bf16 parts: the other one is null)
  // and V of a key tile, in the run's slot `index`.
  struct Slot {
    int64_t index;
    tile_t* k;
    c10::BFloat16* ksplit;
    tile_t* v;
  };

  // Attend the queries of the set's heads at positions t0 + r*i, i < tq, to
  // the key run. Tile row j * tq + i is position i of head j.
  void run(int64_t b, const HeadSet& set, int64_t r, int64_t t0, int64_t tq, ActiveRun keys) {
    const int64_t nh = static_cast<int64_t>(set.heads.size()), rows = nh * tq;
    const RowRange tiles = reached_key_tiles(r, t0, t0 + (tq - 1) * r, keys);
    if (tiles.end <= tiles.begin) return;
    const QueryRows qr{b, r, t0, tq, set};
    const TileRef<tile_t> qt = start_query_tile(qr, rows);
    start_key_run(b, set.kv_head, keys, r);
    for (int64_t n0 = tiles.begin; n0 < tiles.end; n0 += kTileK)
      attend_key_tile(qr, qt, rows, keys, n0, tiles.end);
    merge_rows(
        rows, p.head_dim, o.data(), m.data(), l.data(),
        [&](int64_t i) { return out + p.q_index(b, qr.pos(i), qr.head(i)); },
        [&](int64_t i) { return lse + p.row_index(b, qr.head(i), qr.pos(i)); }, scratch.data());
  }

  // The keys [begin, end) of the run that query rows t0 .. t_last (stride r)
  // attend to, none when end <= begin: causal, the keys up to t_last;
  // windowed, the whole key tiles of the run (as packed) that meet the query
  // tile's band [t0 - left, t_last + right] (the others are skipped).
  RowRange reached_key_tiles(int64_t r, int64_t t0, int64_t t_last, ActiveRun keys) const {
    int64_t nk = keys.count;
    if (p.causal) nk = t_last < keys.first ? 0 : std::min(nk, (t_last - keys.first) / r + 1);
    if (!p.windowed) return {0, nk};
    const RowRange band = band_keys(p, keys.first, r, t0, t_last, nk);
    if (band.end <= band.begin) return {0, 0};
    return {band.begin / kTileK * kTileK, band.end};
  }

  // The query tile's rows as tile_t (and, fp32 S on AMX, split into bf16
  // parts), the running state reset and the scratch sized for `rows` rows.
  TileRef<tile_t> start_query_tile(const QueryRows& qr, int64_t rows) {
    constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    const int64_t d = p.head_dim;
    const TileRef<tile_t> qt = qr.set.heads.size() == 1
                                   ? tile_rows<tile_t>(q + p.q_index(qr.b, qr.t0, qr.set.heads[0]),
                                                       p.q_stride(qr.r), qr.tq, d, qbuf)
                                   : gather_rows<tile_t>(rows, d, qbuf, [&](int64_t row) {
                                       return q + p.q_index(qr.b, qr.pos(row), qr.head(row));
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
    return qt;
  }

  // The query tile against key tile n0 of the run (up to key nk): S = Q K^T,
  // the softmax pass, the rescale and O += P V.
  void attend_key_tile(const QueryRows& qr, const TileRef<tile_t>& qt, int64_t rows, ActiveRun keys,
                       int64_t n0, int64_t nk) {
    const int64_t tk = std::min(kTileK, nk - n0);
    const int64_t u0 = keys.first + n0 * qr.r;
    // Packed tiles are read in place: look at all their V rows, once per run
    // (while packing them, where packed).
    const int64_t tw = packed ? std::min(kTileK, keys.count - n0) : tk;
    KeyTile kv{n0, tk, u0, tw, KeyRows(p, qr.b, qr.set.kv_head, u0, qr.r, tw)};
    if (n0 < keyrun.checked_from || n0 > keyrun.checked) restart_checks(n0);
    if (!packed || std::is_same_v<scalar_t, tile_t>) read_kv(kv);

    const tile_t* vp = nullptr;  // packed V of the tile
    const tile_t* kp = nullptr;  // packed K^T of the tile (not split)
    const bool fused = packed && pass_in_epilogue(rows, qr.t0, u0, qr.r, tk);
    if constexpr (kBf16Tiles || kFp32Tiles) {
      if (packed) {
        const Slot slot = slot_of(n0 / kTileK);
        fill_slot(kv, slot, n0 / kTileK);
        packed_scores(kv, qt, rows, slot, fused);
        vp = slot.v;
        kp = slot.k;
      }
    }
    if (!packed) plain_scores(kv, qt, rows);
    softmax_pass(qr, kv, qt, kp, rows, fused);
    rescale_rows(rows, p.head_dim, m.data(), m_next.data(), l.data(), row_sum.data(), o.data(),
                 scratch.data());
    add_weighted_values(kv, vp, rows);
  }

  void read_kv(KeyTile& kv) {
    if (kv.kt.ptr != nullptr) return;
    kv.kt = kv.rows.tile(k, kv.tw, kbuf);
    kv.vt = kv.rows.tile(v, kv.tw, vbuf);
  }

  // bad: the non-finite V rows of the run's rows [n0, n0 + tw), from n0.
  void tile_bad(int64_t n0, int64_t tw) {
    const auto lo = std::lower_bound(keyrun.bad_v.begin(), keyrun.bad_v.end(), n0);
    const auto hi = std::lower_bound(lo, keyrun.bad_v.end(), n0 + tw);
    bad.assign(lo, hi);
    for (int64_t& j : bad) j -= n0;
  }

  // The run's slot of its packed key tile `tile` (slot_tile: which tile it
  // holds; ForwardTile's keyrun says which slot a tile takes).
  Slot slot_of(int64_t tile) {
    const int64_t d = p.head_dim;
    const int64_t slots = static_cast<int64_t>(keyrun.slot_tile.size());
    const int64_t index = p.windowed ? tile % slots : std::min(tile, slots - 1);
    return {index, split ? nullptr : keyrun.k.data() + index * kTileK * d,
            split ? keyrun.ksplit.data() + index * kTileK * 6 * d : nullptr,
            keyrun.v.data() + index * kTileK * d};
  }

  // The key tile packed into its slot, unless the slot holds it already
  // (its V rows looked at on the run's first visit of the tile); bad then
  // holds the tile's non-finite V rows.
  void fill_slot(KeyTile& kv, const Slot& slot, int64_t tile) {
    const int64_t d = p.head_dim, n0 = kv.n0, tw = kv.tw;
    if (keyrun.slot_tile[slot.index] == tile) return tile_bad(n0, tw);
    read_kv(kv);
    if constexpr (kFp32Tiles) {
      if (split) {
        keyrun.bad_k[slot.index].clear();
        pack_keys_split(kv.kt.ptr, kv.kt.ld, tw, d, slot.ksplit, keyrun.bad_k[slot.index]);
      }
    }
    if (!split) pack_keys(kv.kt.ptr, kv.kt.ld, tw, d, slot.k);
    if (keyrun.checked < n0 + tw) {
      // Whole tiles: the run's first visit of this one.
      TORCH_INTERNAL_ASSERT(keyrun.checked == n0);
      pack_values_checked(kv.vt.ptr, kv.vt.ld, tw, d, n0, keyrun.bad_v, slot.v);
      keyrun.checked = n0 + tw;
      tile_bad(n0, tw);
    } else {
      tile_bad(n0, tw);
      pack_values(kv.vt.ptr, kv.vt.ld, tw, d, bad, slot.v);
    }
    keyrun.slot_tile[slot.index] = tile;
  }

  // S = Q K^T (unscaled) of a packed key tile into s: split into bf16
  // parts, or fp32 / bf16 from the packed K^T, or (fused) its weights
  // straight from the product's epilogue. The products of the non-finite V
  // rows a query row reaches are added back after P V; those past tk it
  // does not reach leave bad.
  void packed_scores(const KeyTile& kv, const TileRef<tile_t>& qt, int64_t rows, const Slot& slot,
                     bool fused) {
    const int64_t d = p.head_dim, tk = kv.tk, tw = kv.tw;
    if constexpr (kFp32Tiles) {
      if (split)
        gemm_split_scores(rows, tk, d, qsplit.data(), slot.ksplit, tw, s.data(), kLd, qt, kv.kt,
                          bad_q, keyrun.bad_k[slot.index]);
    }
    if (fused) {
      if constexpr (kFp32Tiles) {
#if defined(__x86_64__)
        passed.resize(rows);
        avx2::gemm_exp(rows, tk, d, qt.ptr, qt.ld, slot.k, tw, s.data(), kLd, scale, m.data(),
                       acc_t(kCap), row_sum.data(), passed.data());
#endif
      }
    } else if (!split) {
      gemm_packed(path.gemm, rows, tk, d, qt.ptr, qt.ld, slot.k, tw, s.data(), kLd, false);
    }
    bad.erase(std::lower_bound(bad.begin(), bad.end(), tk), bad.end());
  }

  // S = scale Q K^T of an unpacked key tile into s, its V rows looked at
  // once per run (bad: the tile's non-finite ones).
  void plain_scores(const KeyTile& kv, const TileRef<tile_t>& qt, int64_t rows) {
    const int64_t d = p.head_dim, n0 = kv.n0, tw = kv.tw;
    if (keyrun.checked < n0 + tw) {
      non_finite_rows(kv.vt, keyrun.checked - n0, tw, d, n0, keyrun.bad_v);
      keyrun.checked = n0 + tw;
    }
    tile_bad(n0, tw);
    gemm(false, true, rows, kv.tk, d, scale, qt.ptr, qt.ld, kv.kt.ptr, kv.kt.ld, acc_t(0), s.data(),
         kLd);
  }

  // Each row's scores in s become its weights under its shift m_next (the
  // running shift unless the tile's scores pass it by kCap), their sum
  // row_sum. Packed tiles' scores come out unscaled: the pass scales them.
  void softmax_pass(const QueryRows& qr, const KeyTile& kv, const TileRef<tile_t>& qt,
                    const tile_t* kp, int64_t rows, bool fused) {
    constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    const int64_t tk = kv.tk;
    const acc_t s_scale = packed ? scale : acc_t(1);
    const bool* mrow = p.key_padding_mask == nullptr
                           ? nullptr
                           : p.key_padding_mask + qr.b * p.k_len + (kv.u0 - p.k_start);
    for (int64_t i = 0; i < rows; ++i) {
      acc_t* srow = &s[i * kLd];
      if (fused) {
        // The epilogue's weights and sum stand unless a score passed the
        // cap: then the row's scores again, and the pass as below.
        m_next[i] = m[i];
        if (!passed[i]) continue;
        if constexpr (kBf16Tiles || kFp32Tiles)
          gemm_packed(path.gemm, 1, tk, p.head_dim, qt.ptr + i * qt.ld, qt.ld, kp, kv.tw, srow, kLd,
                      false);
        row_sum[i] = pw.exp_row_lazy(srow, i * kLd, tk, s_scale, &m_next[i], kCap);
        continue;
      }
      mask_row(srow, tk, qr.pos(i), kv.u0, qr.r, p.causal, mrow);
      if (p.windowed) mask_band(srow, tk, p, qr.pos(i), kv.u0, qr.r);
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
  }

  // O += P V for the key tile (vp: its packed V), the products of its
  // non-finite V rows (bad) added back where a row's weight is not 0.
  void add_weighted_values(KeyTile& kv, const tile_t* vp, int64_t rows) {
    const int64_t d = p.head_dim;
    if constexpr (kBf16Tiles || kFp32Tiles) {
      if (packed) {
        if (!bad.empty()) read_kv(kv);
        gemm_weights_packed(path.gemm, rows, d, kv.tk, pw.of(s.data()), kLd, vp, kv.vt, bad,
                            o.data(), d, true);
        return;
      }
    }
    gemm_weights(rows, d, kv.tk, acc_t(1), pw.of(s.data()), kLd, kv.vt, acc_t(1), o.data(), d, bad,
                 wbuf);
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
