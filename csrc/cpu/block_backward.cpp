// CPU block backward: recompute P from the final global lse, then
//   dV += P^T dO,  dS = P * (dO V^T - delta),  dQ += scale dS K,  dK += scale dS^T Q
// with delta = rowsum(dO * O) - grad_lse: chunks of a few key tiles outer,
// query tiles inner, the chunk's key tiles innermost (a query tile's rows
// are read once per chunk, a key tile's once). The query rows of a head set
// (heads that read the same key rows, block_tasks.h) are stacked, so the
// products with P^T and dS^T sum over the set's heads into the shared K/V
// rows. A task owns its segments' rows of its head set (per branch), so no
// atomics are needed. A gradient not asked for (dq, or dk with dv) is not
// computed.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>

#include <array>
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
constexpr int64_t kTileK = 256;
// Row stride of the score tiles: a cache line more than kTileK (see the forward).
constexpr int64_t kLd = kTileK + 16;
// Key tiles a query tile meets in turn: its Q and dO rows (and, fp32 packed,
// their transposes) are read once for all of them.
constexpr int64_t kChunkTiles = 4;

// tile_t: the type the GEMMs read (tile_math.h).
template <typename scalar_t, typename tile_t, typename acc_t>
struct BackwardTile {
  static constexpr bool kBf16Tiles = std::is_same_v<tile_t, c10::BFloat16>;
  static constexpr bool kFp32Tiles = std::is_same_v<tile_t, float>;  // fp16/bf16 converted
  const BlockParams& p;
  const scalar_t *dout, *q, *k, *v;
  const acc_t *lse, *delta;  // delta = rowsum(dout * out) - grad_lse, laid out like lse
  acc_t *dq, *dk, *dv;       // nullptr: not asked for
  acc_t scale;
  const TilePath path;
  // Key tiles packed (packed_tiles.h) for the products with K^T, V^T and K:
  // S and dP come out unscaled, and dS carries the scale (the softmax pass
  // applies both).
  const bool packed;
  // Packed: dV and dK of a key tile as dV^T += dO^T P and dK^T += Q^T dS
  // (d x tk, added to dv and dk at the end of the chunk), so that P and dS
  // are brgemm's B operand (fp32: as the softmax pass leaves them; bf16: in
  // VNNI pairs of rows, pack_values); dO^T and Q^T of the query tile are its
  // A operand.
  const bool transposed_dkv;
  // fp32 S and dP on AMX: Q, dO, K and V split into bf16 parts
  // (split_products.h), K^T and V^T packed so.
  const bool split;
  // One key tile of the chunk: its rows (kt, vt: in place or converted),
  // packed operands (split: k_split, v_split and their non-finite rows),
  // non-finite K rows and (transposed_dkv) dV^T, dK^T.
  struct KeyTile {
    int64_t u0 = 0, tk = 0;
    KeyRows rows;  // where its K/V (and dK/dV) rows lie
    TileBuffer<tile_t> kbuf, vbuf, k_t, v_t, k_rows;
    TileBuffer<c10::BFloat16> k_split, v_split;
    TileRef<tile_t> kt{}, vt{};
    std::vector<int64_t> kbad, kbad_split, vbad_split;
    TileBuffer<acc_t> dv_t, dk_t;
  };
  std::array<KeyTile, kChunkTiles> tiles;
  TileBuffer<tile_t> qbuf, dobuf, wbuf;
  // transposed_dkv: dO^T, Q^T of the query tile (bf16: rows rounded up to
  // even, rows_k) and (bf16) P and dS in VNNI pairs.
  TileBuffer<tile_t> do_t, q_t, p_pairs, ds_pairs;
  int64_t rows_k = 0;
  // split: Q and dO of the query tile, and their non-finite rows.
  TileBuffer<c10::BFloat16> q_split, do_split;
  std::vector<int64_t> qbad_split, dobad_split;
  Weights<tile_t, acc_t> pw, dsw;
  TileBuffer<acc_t> s, dp, dqbuf, dkv_rows;

  BackwardTile(const BlockParams& p_, const TilePath& path_, const acc_t* delta_)
      : p(p_),
        dout(static_cast<const scalar_t*>(p_.grad_out)),
        q(static_cast<const scalar_t*>(p_.q)),
        k(static_cast<const scalar_t*>(p_.k)),
        v(static_cast<const scalar_t*>(p_.v)),
        lse(static_cast<const acc_t*>(p_.lse_in)),
        delta(delta_),
        dq(static_cast<acc_t*>(p_.dq)),
        dk(static_cast<acc_t*>(p_.dk)),
        dv(static_cast<acc_t*>(p_.dv)),
        scale(static_cast<acc_t>(p_.scale)),
        path(path_),
        packed(path_.packed()),
        transposed_dkv(packed && p_.dv != nullptr),
        split(path_.split()),
        pw(path_.lanes),
        dsw(path_.lanes) {}

  ~BackwardTile() {
    if ((kBf16Tiles && packed) || split) release_packed_gemm();
  }

  void load_keys(KeyTile& key, int64_t b, const HeadSet& set, int64_t r, int64_t u0, int64_t tk) {
    const int64_t d = p.head_dim;
    key.u0 = u0, key.tk = tk, key.rows = KeyRows(p, b, set.kv_head, u0, r, tk);
    key.kt = key.rows.tile(k, tk, key.kbuf);
    key.vt = key.rows.tile(v, tk, key.vbuf);
    key.kbad.clear();
    if constexpr (kBf16Tiles || kFp32Tiles) {
      if (packed) {
        key.k_rows.resize((tk + 1) * d);
        if constexpr (kFp32Tiles) {
          if (split) {
            key.k_split.resize(6 * d * tk), key.v_split.resize(6 * d * tk);
            key.kbad_split.clear(), key.vbad_split.clear();
            pack_keys_split(key.kt.ptr, key.kt.ld, tk, d, key.k_split.data(), key.kbad_split);
            pack_keys_split(key.vt.ptr, key.vt.ld, tk, d, key.v_split.data(), key.vbad_split);
          }
        }
        if (!split) {
          key.k_t.resize(tk * d), key.v_t.resize(tk * d);
          pack_keys(key.kt.ptr, key.kt.ld, tk, d, key.k_t.data());
          pack_keys(key.vt.ptr, key.vt.ld, tk, d, key.v_t.data());
        }
        if (dq != nullptr)
          pack_values_checked(key.kt.ptr, key.kt.ld, tk, d, 0, key.kbad, key.k_rows.data());
      }
    }
    if (dq != nullptr && !packed) non_finite_rows(key.kt, 0, tk, d, 0, key.kbad);
    if (transposed_dkv) key.dv_t.assign(d * tk, acc_t(0)), key.dk_t.assign(d * tk, acc_t(0));
  }

  // A chunk of nk keys (first at u0, stride r; at most kChunkTiles key
  // tiles) of the set's K/V head against all the queries of the set's heads.
  void run(int64_t b, const HeadSet& set, int64_t r, int64_t u0, int64_t nk, ActiveRun queries) {
    const int64_t d = p.head_dim, nh = static_cast<int64_t>(set.heads.size());
    const int64_t q_stride = p.q_stride(r);
    const int64_t n_tiles = ceil_div(nk, kTileK);
    for (int64_t t = 0; t < n_tiles; ++t)
      load_keys(tiles[t], b, set, r, u0 + t * kTileK * r, std::min(kTileK, nk - t * kTileK));

    // Causal: queries before the first key of the chunk reach none of it.
    int64_t m_begin = 0, m_end = queries.count;
    if (p.causal && u0 > queries.first) m_begin = ceil_div(u0 - queries.first, r);
    if (p.windowed) {  // queries whose window meets the chunk's keys
      const int64_t u_last = u0 + (nk - 1) * r;
      const RowRange in =
          rows_within(queries.first, queries.count, r, u0 - p.window_right, u_last + p.window_left);
      m_begin = std::max(m_begin, in.begin), m_end = in.end;
    }
    const int64_t tq_max = std::max<int64_t>(1, kTileRows / nh);
    for (int64_t m0 = m_begin; m0 < m_end; m0 += tq_max) {
      // Tile row j * tq + i is position t0 + r*i of head j.
      const int64_t tq = std::min(tq_max, m_end - m0), rows = nh * tq;
      const int64_t t0 = queries.first + m0 * r, t_last = t0 + (tq - 1) * r;
      const auto row_index = [&](int64_t row) {
        return p.q_index(b, t0 + (row % tq) * r, set.heads[row / tq]);
      };
      const int64_t qoff = p.q_index(b, t0, set.heads[0]);
      const TileRef<tile_t> qt =
          nh == 1 ? tile_rows<tile_t>(q + qoff, q_stride, tq, d, qbuf)
                  : gather_rows<tile_t>(rows, d, qbuf, [&](int64_t i) { return q + row_index(i); });
      const TileRef<tile_t> dot =
          nh == 1
              ? tile_rows<tile_t>(dout + qoff, q_stride, tq, d, dobuf)
              : gather_rows<tile_t>(rows, d, dobuf, [&](int64_t i) { return dout + row_index(i); });
      if constexpr (kBf16Tiles || kFp32Tiles) {
        if (transposed_dkv) {
          rows_k = kBf16Tiles ? rows + rows % 2 : rows;
          do_t.resize(d * rows_k), q_t.resize(d * rows_k);
          transpose_tile(dot.ptr, dot.ld, rows, d, do_t.data());
          transpose_tile(qt.ptr, qt.ld, rows, d, q_t.data());
        }
      }
      if constexpr (kFp32Tiles) {
        if (split) {
          q_split.resize(rows * 6 * d), do_split.resize(rows * 6 * d);
          qbad_split.clear(), dobad_split.clear();
          split_queries(qt.ptr, qt.ld, rows, d, q_split.data(), qbad_split);
          split_queries(dot.ptr, dot.ld, rows, d, do_split.data(), dobad_split);
        }
      }
      // dQ: in place for one head, else summed in a buffer over the chunk.
      if (dq != nullptr && nh != 1) dqbuf.resize(rows * d);
      acc_t* dq_c = dq == nullptr ? nullptr : nh == 1 ? dq + qoff : dqbuf.data();
      const int64_t dq_ld = nh == 1 ? q_stride : d;
      int64_t attended = 0;
      for (int64_t t = 0; t < n_tiles && !(p.causal && tiles[t].u0 > t_last); ++t) {
        const KeyTile& key = tiles[t];
        // Window: key tiles wholly outside the query tile's band are skipped.
        if (p.windowed &&
            (key.u0 + (key.tk - 1) * r < p.band_first(t0) || key.u0 > p.band_last(t_last)))
          continue;
        attend(tiles[t], b, set, r, t0, tq, qt, dot, dq_c, dq_ld, nh == 1 || attended > 0);
        ++attended;
      }
      if (dq == nullptr || nh == 1 || attended == 0) continue;
      for (int64_t i = 0; i < rows; ++i) {
        acc_t* dst = dq + row_index(i);
        const acc_t* src = &dqbuf[i * d];
        for (int64_t c = 0; c < d; ++c) dst[c] += src[c];
      }
    }
    if constexpr (kBf16Tiles || kFp32Tiles) {
      if (transposed_dkv) {
        for (int64_t t = 0; t < n_tiles; ++t) {
          const KeyTile& key = tiles[t];
          add_transposed(key.dv_t.data(), key.tk, d, key.rows, dv);
          add_transposed(key.dk_t.data(), key.tk, d, key.rows, dk);
        }
      }
    }
  }

  // The query tile (tq positions from t0, stride r, of each of the set's
  // heads; rows qt, dot) against one key tile: dV, dK (or their transposes)
  // and dQ into dq_c (row stride dq_ld), added to it when dq_accumulate.
  void attend(KeyTile& key, int64_t b, const HeadSet& set, int64_t r, int64_t t0, int64_t tq,
              TileRef<tile_t> qt, TileRef<tile_t> dot, acc_t* dq_c, int64_t dq_ld,
              bool dq_accumulate) {
    constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    const int64_t d = p.head_dim, nh = static_cast<int64_t>(set.heads.size()), rows = nh * tq;
    const int64_t tk = key.tk, u0 = key.u0;
    // Packed: the softmax pass scales S and dS; else the GEMMs with K and dS do.
    const acc_t pass_scale = packed ? scale : acc_t(1);
    const acc_t ds_gemm_scale = packed ? acc_t(1) : scale;
    const bool* mrow = p.key_padding_mask == nullptr
                           ? nullptr
                           : p.key_padding_mask + b * p.k_len + (u0 - p.k_start);
    s.resize(rows * kLd);
    dp.resize(rows * kLd);
    pw.reserve(rows * kLd);
    dsw.reserve(rows * kLd);
    if constexpr (kBf16Tiles || kFp32Tiles) {
      if constexpr (kFp32Tiles) {
        if (split) {
          gemm_split_scores(rows, tk, d, q_split.data(), key.k_split.data(), tk, s.data(), kLd, qt,
                            key.kt, qbad_split, key.kbad_split);
          gemm_split_scores(rows, tk, d, do_split.data(), key.v_split.data(), tk, dp.data(), kLd,
                            dot, key.vt, dobad_split, key.vbad_split);
        }
      }
      if (packed && !split) {
        gemm_packed(path.gemm, rows, tk, d, qt.ptr, qt.ld, key.k_t.data(), tk, s.data(), kLd,
                    false);
        gemm_packed(path.gemm, rows, tk, d, dot.ptr, dot.ld, key.v_t.data(), tk, dp.data(), kLd,
                    false);
      }
    }
    if (!packed) {
      gemm(false, true, rows, tk, d, scale, qt.ptr, qt.ld, key.kt.ptr, key.kt.ld, acc_t(0),
           s.data(), kLd);
      gemm(false, true, rows, tk, d, acc_t(1), dot.ptr, dot.ld, key.vt.ptr, key.vt.ld, acc_t(0),
           dp.data(), kLd);
    }
    for (int64_t i = 0; i < rows; ++i) {
      acc_t* srow = &s[i * kLd];
      acc_t* dprow = &dp[i * kLd];
      const int64_t t = t0 + (i % tq) * r;
      const int64_t stat = p.row_index(b, set.heads[i / tq], t);
      const RowGrad<acc_t> g{pass_scale, lse[stat], pass_scale, delta[stat]};
      if (lse[stat] != neg_inf) {
        mask_row(srow, tk, t, u0, r, p.causal, mrow);
        if (p.windowed) mask_band(srow, tk, p, t, u0, r);
      }
      if (std::isfinite(lse[stat])) {
        if constexpr (Weights<tile_t, acc_t>::kRounded) {
          softmax_grad_row(srow, dprow, tk, g, pw.row(i * kLd), dsw.row(i * kLd));
        } else {
          softmax_grad_row(srow, dprow, tk, g, path.lanes);
        }
        continue;
      }
      if (lse[stat] == neg_inf) {  // reaches nothing: no gradient
        std::fill(srow, srow + tk, acc_t(0));
        std::fill(dprow, dprow + tk, acc_t(0));
      } else {
        softmax_grad_row_nonfinite(srow, dprow, tk, g);
      }
      pw.round_row(srow, i * kLd, tk);
      dsw.round_row(dprow, i * kLd, tk);
    }
    // dV += P^T dO, dK += scale dS^T Q (summed over the stacked heads): as
    // transposes in the key tile's buffers, or straight into the
    // accumulators through the key row stride.
    if constexpr (kFp32Tiles) {
      if (transposed_dkv) {
        gemm_packed(path.gemm, d, tk, rows, do_t.data(), rows, s.data(), kLd, key.dv_t.data(), tk,
                    true);
        gemm_packed(path.gemm, d, tk, rows, q_t.data(), rows, dp.data(), kLd, key.dk_t.data(), tk,
                    true);
      }
    }
    if constexpr (kBf16Tiles) {
      if (transposed_dkv) {
        p_pairs.resize(rows_k * tk), ds_pairs.resize(rows_k * tk);
        pack_values(pw.row(0), kLd, rows, tk, {}, p_pairs.data());
        pack_values(dsw.row(0), kLd, rows, tk, {}, ds_pairs.data());
        gemm_packed(path.gemm, d, tk, rows_k, do_t.data(), rows_k, p_pairs.data(), tk,
                    key.dv_t.data(), tk, true);
        gemm_packed(path.gemm, d, tk, rows_k, q_t.data(), rows_k, ds_pairs.data(), tk,
                    key.dk_t.data(), tk, true);
      }
    }
    if (dv != nullptr && !transposed_dkv) {
      // Into the accumulators through the key row stride, or (rows not
      // evenly spaced) into dkv_rows and added row by row.
      const KeyRows& kr = key.rows;
      if (!kr.even()) dkv_rows.resize(tk * d);
      const auto product = [&](acc_t alpha, const auto* w, TileRef<tile_t> x, acc_t* grad) {
        if (kr.even()) {
          gemm(true, false, tk, d, rows, alpha, w, kLd, x.ptr, x.ld, acc_t(1), grad + kr.offset,
               kr.stride);
        } else {
          gemm(true, false, tk, d, rows, alpha, w, kLd, x.ptr, x.ld, acc_t(0), dkv_rows.data(), d);
          kr.add(dkv_rows.data(), d, tk, grad);
        }
      };
      product(acc_t(1), pw.of(s.data()), dot, dv);
      product(ds_gemm_scale, dsw.of(dp.data()), qt, dk);
    }
    if (dq == nullptr) return;
    // dQ += scale dS K.
    if constexpr (kBf16Tiles || kFp32Tiles) {
      if (packed) {
        gemm_weights_packed(path.gemm, rows, d, tk, dsw.of(dp.data()), kLd, key.k_rows.data(),
                            key.kt, key.kbad, dq_c, dq_ld, dq_accumulate);
      }
    }
    if (!packed)
      gemm_weights(rows, d, tk, ds_gemm_scale, dsw.of(dp.data()), kLd, key.kt,
                   dq_accumulate ? acc_t(1) : acc_t(0), dq_c, dq_ld, key.kbad, wbuf);
  }

  // Row j of the key tile's rows in grad += src_t[c * tk + j] for j < tk,
  // c < d (src_t is d x tk).
  void add_transposed(const acc_t* src_t, int64_t tk, int64_t d, const KeyRows& kr, acc_t* grad) {
    dkv_rows.resize(tk * d);
    transpose_tile(src_t, tk, d, tk, dkv_rows.data());
    kr.add(dkv_rows.data(), d, tk, grad);
  }
};

// delta[b, h, t] = sum_c dout[b, t, h, c] * out[b, t, h, c] - grad_lse[b, h, t]
template <typename scalar_t, typename acc_t>
std::vector<acc_t> softmax_delta(const BlockParams& p) {
  const auto* dout = static_cast<const scalar_t*>(p.grad_out);
  const auto* out = static_cast<const scalar_t*>(p.out_in);
  const auto* grad_lse = static_cast<const acc_t*>(p.grad_lse);
  std::vector<acc_t> delta(p.batch * p.heads * p.q_len);
  at::parallel_for(0, p.batch * p.q_len, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t bt = lo; bt < hi; ++bt) {
      const int64_t b = bt / p.q_len, t = bt % p.q_len;
      for (int64_t h = 0; h < p.heads; ++h) {
        const int64_t off = (bt * p.heads + h) * p.head_dim;
        const acc_t sum = at::vec::map2_reduce_all<scalar_t>([](auto x, auto y) { return x * y; },
                                                             [](auto x, auto y) { return x + y; },
                                                             dout + off, out + off, p.head_dim);
        const int64_t idx = (b * p.heads + h) * p.q_len + t;
        delta[idx] = grad_lse == nullptr ? sum : sum - grad_lse[idx];
      }
    }
  });
  return delta;
}

template <typename scalar_t, typename tile_t>
void backward_kernel(const BlockCall& call, const TilePath& path) {
  using acc_t = at::opmath_type<scalar_t>;
  const BlockParams& p = call.params;
  const std::vector<acc_t> delta = softmax_delta<scalar_t, acc_t>(p);
  for (int64_t i = 0; i < p.n_branches; ++i) {
    // Whole head sets: a set's task owns the K/V rows it writes.
    const BranchWork work = branch_work(p, i, call.segment_lengths[i], call.dilation_rates[i],
                                        static_cast<size_t>(p.heads));
    const int64_t r = work.r;
    using Tile = BackwardTile<scalar_t, tile_t, acc_t>;
    for_each_task(
        p, work, [&] { return Tile(p, path, delta.data()); },
        [&](Tile& tile, const SegmentTask& task) {
          const HeadSet& set = work.head_sets[task.head_set];
          for (size_t s = task.seg_begin; s < task.seg_end; ++s) {
            const SegmentRuns runs = segment_runs(p, work, s, set.offset);
            constexpr int64_t chunk = kTileK * kChunkTiles;
            for (int64_t n0 = 0; n0 < runs.k.count; n0 += chunk) {
              tile.run(task.b, set, r, runs.k.first + n0 * r, std::min(chunk, runs.k.count - n0),
                       runs.q);
            }
          }
        });
  }
}

}  // namespace

void block_backward(const BlockCall& call) {
  if (call.params.dq == nullptr && call.params.dk == nullptr) return;
  const TilePath path =
      run_path(Pass::kBackward, call.dtype, call.params.head_dim, call.params.scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, call.dtype, "block_backward_cpu", [&] {
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (path.bf16_tiles()) return backward_kernel<scalar_t, scalar_t>(call, path);
    }
    backward_kernel<scalar_t, at::opmath_type<scalar_t>>(call, path);
  });
}

}  // namespace ring_attention::cpu
