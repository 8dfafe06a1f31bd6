// CPU block backward: recompute P from the final global lse, then
//   dV += P^T dO,  dS = P * (dO V^T - delta),  dQ += scale dS K,  dK += scale dS^T Q
// with delta = rowsum(dO * O) - grad_lse, key tiles outer and query tiles
// inner. The query rows of a head set (heads that read the same key rows,
// block_tasks.h) are stacked, so the products with P^T and dS^T sum over the
// set's heads into the shared K/V rows. A task owns its segments' rows of
// its head set (per branch), so no atomics are needed. A gradient not asked
// for (dq, or dk with dv) is not computed.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "block_tasks.h"
#include "kernels.h"
#include "packed_tiles.h"
#include "tile_math.h"

namespace ring_attention::cpu {
namespace {

constexpr int64_t kTileRows = 256;  // stacked query rows (heads x positions)
constexpr int64_t kTileK = 256;
// Row stride of the score tiles: a cache line more than kTileK (see the forward).
constexpr int64_t kLd = kTileK + 16;

// tile_t: the type the GEMMs read (tile_math.h).
template <typename scalar_t, typename tile_t, typename acc_t>
struct BackwardTile {
  static constexpr bool kBf16Tiles = std::is_same_v<tile_t, c10::BFloat16>;
  static constexpr bool kFp32Tiles =
      std::is_same_v<tile_t, float> && std::is_same_v<scalar_t, float>;
  const BlockParams& p;
  const scalar_t *dout, *q, *k, *v;
  const acc_t *lse, *delta;  // delta = rowsum(dout * out) - grad_lse, laid out like lse
  acc_t *dq, *dk, *dv;       // nullptr: not asked for
  acc_t scale;
  // The key tile packed for brgemm (packed_tiles.h: bf16 on AMX, fp32 on
  // AVX-512) for the products with K^T, V^T and K: S and dP come out
  // unscaled, and dS carries the scale (the softmax pass applies both).
  const bool packed;
  TileBuffer<tile_t> qbuf, dobuf, kbuf, vbuf, wbuf;
  TileBuffer<tile_t> k_t, v_t, k_rows;  // packed: K^T, V^T, K
  // fp32 packed: dV and dK of the key tile as dV^T += dO^T P and dK^T +=
  // Q^T dS (d x tk, added to dv and dk at the end of the tile), so that P and
  // dS are brgemm's B operand as the softmax pass leaves them; dO^T and Q^T
  // of the query tile are its A operand.
  TileBuffer<acc_t> dv_t, dk_t, do_t, q_t;
  Weights<tile_t, acc_t> pw, dsw;
  TileBuffer<acc_t> s, dp, dqbuf;
  std::vector<int64_t> kbad;  // non-finite K rows of the key tile

  BackwardTile(const BlockParams& p_, const acc_t* delta_)
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
        packed(p_.scale > 0 &&
               ((kBf16Tiles && packed_tiles(p_.head_dim)) || (kFp32Tiles && packed_tiles_fp32()))) {
  }

  ~BackwardTile() {
    if (kBf16Tiles && packed) release_packed_gemm();
  }

  // One key tile of tk keys (first at u0, stride r) of the set's K/V head
  // against all the queries of the set's heads.
  void run(int64_t b, const HeadSet& set, int64_t r, int64_t u0, int64_t tk, ActiveRun queries) {
    constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    const int64_t d = p.head_dim, nh = static_cast<int64_t>(set.heads.size());
    const int64_t q_stride = p.q_stride(r), k_stride = p.k_stride(r);
    const int64_t koff = p.k_index(b, u0, set.kv_head);
    const TileRef<tile_t> kt = tile_rows<tile_t>(k + koff, k_stride, tk, d, kbuf);
    const TileRef<tile_t> vt = tile_rows<tile_t>(v + koff, k_stride, tk, d, vbuf);
    kbad.clear();
    if (dq != nullptr) non_finite_rows(kt, 0, tk, d, 0, kbad);
    if constexpr (kBf16Tiles || kFp32Tiles) {
      if (packed) {
        k_t.resize(tk * d), v_t.resize(tk * d), k_rows.resize((tk + 1) * d);
        pack_keys(kt.ptr, kt.ld, tk, d, k_t.data());
        pack_keys(vt.ptr, vt.ld, tk, d, v_t.data());
        if (dq != nullptr) pack_values(kt.ptr, kt.ld, tk, d, kbad, k_rows.data());
      }
    }
    const bool transposed_dkv = kFp32Tiles && packed && dv != nullptr;
    if (transposed_dkv) dv_t.assign(d * tk, acc_t(0)), dk_t.assign(d * tk, acc_t(0));
    // Packed: the softmax pass scales S and dS; else the GEMMs with K and dS do.
    const acc_t pass_scale = packed ? scale : acc_t(1);
    const acc_t ds_gemm_scale = packed ? acc_t(1) : scale;
    const bool* mrow = p.key_padding_mask == nullptr
                           ? nullptr
                           : p.key_padding_mask + b * p.k_len + (u0 - p.k_start);

    // Causal: queries before the first key of the tile reach none of it.
    int64_t m_begin = 0;
    if (p.causal && u0 > queries.first) m_begin = ceil_div(u0 - queries.first, r);
    const int64_t tq_max = std::max<int64_t>(1, kTileRows / nh);
    for (int64_t m0 = m_begin; m0 < queries.count; m0 += tq_max) {
      // Tile row j * tq + i is position t0 + r*i of head j.
      const int64_t tq = std::min(tq_max, queries.count - m0), rows = nh * tq;
      const int64_t t0 = queries.first + m0 * r;
      const auto row_head = [&](int64_t row) { return set.heads[row / tq]; };
      const auto row_pos = [&](int64_t row) { return t0 + (row % tq) * r; };
      const auto row_index = [&](int64_t row) { return p.q_index(b, row_pos(row), row_head(row)); };
      const int64_t qoff = p.q_index(b, t0, set.heads[0]);
      const TileRef<tile_t> qt =
          nh == 1 ? tile_rows<tile_t>(q + qoff, q_stride, tq, d, qbuf)
                  : gather_rows<tile_t>(rows, d, qbuf, [&](int64_t i) { return q + row_index(i); });
      const TileRef<tile_t> dot =
          nh == 1
              ? tile_rows<tile_t>(dout + qoff, q_stride, tq, d, dobuf)
              : gather_rows<tile_t>(rows, d, dobuf, [&](int64_t i) { return dout + row_index(i); });
      s.resize(rows * kLd);
      dp.resize(rows * kLd);
      pw.reserve(rows * kLd);
      dsw.reserve(rows * kLd);
      if constexpr (kBf16Tiles || kFp32Tiles) {
        if (packed) {
          gemm_packed(rows, tk, d, qt.ptr, qt.ld, k_t.data(), tk, s.data(), kLd, false);
          gemm_packed(rows, tk, d, dot.ptr, dot.ld, v_t.data(), tk, dp.data(), kLd, false);
          if constexpr (kBf16Tiles) release_packed_gemm();  // MKL's GEMMs come next
        }
      }
      if (!packed) {
        gemm(false, true, rows, tk, d, scale, qt.ptr, qt.ld, kt.ptr, kt.ld, acc_t(0), s.data(),
             kLd);
        gemm(false, true, rows, tk, d, acc_t(1), dot.ptr, dot.ld, vt.ptr, vt.ld, acc_t(0),
             dp.data(), kLd);
      }
      for (int64_t i = 0; i < rows; ++i) {
        acc_t* srow = &s[i * kLd];
        acc_t* dprow = &dp[i * kLd];
        const int64_t t = row_pos(i);
        const int64_t stat = p.row_index(b, row_head(i), t);
        const RowGrad<acc_t> g{pass_scale, lse[stat], pass_scale, delta[stat]};
        if (lse[stat] != neg_inf) mask_row(srow, tk, t, u0, r, p.causal, mrow);
        if (std::isfinite(lse[stat])) {
          if constexpr (Weights<tile_t, acc_t>::kRounded) {
            softmax_grad_row(srow, dprow, tk, g, pw.row(i * kLd), dsw.row(i * kLd));
          } else {
            softmax_grad_row(srow, dprow, tk, g);
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
      // dV += P^T dO, dK += scale dS^T Q (summed over the stacked heads),
      // straight into the accumulators through the key row stride.
      if constexpr (kFp32Tiles) {
        if (transposed_dkv) {
          do_t.resize(d * rows), q_t.resize(d * rows);
          transpose_tile(dot.ptr, dot.ld, rows, d, do_t.data());
          transpose_tile(qt.ptr, qt.ld, rows, d, q_t.data());
          gemm_packed(d, tk, rows, do_t.data(), rows, s.data(), kLd, dv_t.data(), tk, true);
          gemm_packed(d, tk, rows, q_t.data(), rows, dp.data(), kLd, dk_t.data(), tk, true);
        }
      }
      if (dv != nullptr && !transposed_dkv) {
        gemm(true, false, tk, d, rows, acc_t(1), pw.of(s.data()), kLd, dot.ptr, dot.ld, acc_t(1),
             dv + koff, k_stride);
        gemm(true, false, tk, d, rows, ds_gemm_scale, dsw.of(dp.data()), kLd, qt.ptr, qt.ld,
             acc_t(1), dk + koff, k_stride);
      }
      if (dq == nullptr) continue;
      // dQ += scale dS K: in place for one head, else through a buffer.
      if (nh != 1) dqbuf.resize(rows * d);
      acc_t* dq_c = nh == 1 ? dq + qoff : dqbuf.data();
      const int64_t dq_ld = nh == 1 ? q_stride : d;
      if constexpr (kBf16Tiles || kFp32Tiles) {
        if (packed) {
          gemm_weights_packed(rows, d, tk, dsw.of(dp.data()), kLd, k_rows.data(), kt, kbad, dq_c,
                              dq_ld, nh == 1);
          if constexpr (kBf16Tiles) release_packed_gemm();
        }
      }
      if (!packed)
        gemm_weights(rows, d, tk, ds_gemm_scale, dsw.of(dp.data()), kLd, kt,
                     nh == 1 ? acc_t(1) : acc_t(0), dq_c, dq_ld, kbad, wbuf);
      if (nh == 1) continue;
      for (int64_t i = 0; i < rows; ++i) {
        acc_t* dst = dq + row_index(i);
        const acc_t* src = &dqbuf[i * d];
        for (int64_t c = 0; c < d; ++c) dst[c] += src[c];
      }
    }
    if constexpr (kFp32Tiles) {
      if (transposed_dkv) {
        add_transposed(dv_t.data(), tk, d, dv + koff, k_stride);
        add_transposed(dk_t.data(), tk, d, dk + koff, k_stride);
      }
    }
  }

  // dst[j * ld + c] += src_t[c * tk + j] for j < tk, c < d (src_t is d x tk).
  void add_transposed(const acc_t* src_t, int64_t tk, int64_t d, acc_t* dst, int64_t ld) {
    do_t.resize(tk * d);
    transpose_tile(src_t, tk, d, tk, do_t.data());
    for (int64_t j = 0; j < tk; ++j) {
      acc_t* row = dst + j * ld;
      const acc_t* add = do_t.data() + j * d;
      for (int64_t c = 0; c < d; ++c) row[c] += add[c];
    }
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
        acc_t sum = 0;
        for (int64_t c = 0; c < p.head_dim; ++c)
          sum += static_cast<acc_t>(dout[off + c]) * static_cast<acc_t>(out[off + c]);
        const int64_t idx = (b * p.heads + h) * p.q_len + t;
        delta[idx] = grad_lse == nullptr ? sum : sum - grad_lse[idx];
      }
    }
  });
  return delta;
}

template <typename scalar_t, typename tile_t>
void backward_kernel(const BlockCall& call) {
  using acc_t = at::opmath_type<scalar_t>;
  const BlockParams& p = call.params;
  const std::vector<acc_t> delta = softmax_delta<scalar_t, acc_t>(p);
  for (int64_t i = 0; i < p.n_branches; ++i) {
    // Whole head sets: a set's task owns the K/V rows it writes.
    const BranchWork work = branch_work(p, i, call.segment_lengths[i], call.dilation_rates[i],
                                        static_cast<size_t>(p.heads));
    const int64_t r = work.r;
    at::parallel_for(0, static_cast<int64_t>(work.tasks.size()), 1, [&](int64_t lo, int64_t hi) {
      BackwardTile<scalar_t, tile_t, acc_t> tile(p, delta.data());
      for (int64_t ti = lo; ti < hi; ++ti) {
        const SegmentTask& task = work.tasks[ti];
        const HeadSet& set = work.head_sets[task.head_set];
        for (size_t s = task.seg_begin; s < task.seg_end; ++s) {
          const SegmentRuns runs = segment_runs(p, work, s, set.offset);
          for (int64_t n0 = 0; n0 < runs.k.count; n0 += kTileK) {
            tile.run(task.b, set, r, runs.k.first + n0 * r, std::min(kTileK, runs.k.count - n0),
                     runs.q);
          }
        }
      }
    });
  }
}

}  // namespace

void block_backward(const BlockCall& call) {
  if (call.params.dq == nullptr && call.params.dk == nullptr) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, call.dtype, "block_backward_cpu", [&] {
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (bf16_tiles()) return backward_kernel<scalar_t, scalar_t>(call);
    }
    backward_kernel<scalar_t, at::opmath_type<scalar_t>>(call);
  });
}

}  // namespace ring_attention::cpu
