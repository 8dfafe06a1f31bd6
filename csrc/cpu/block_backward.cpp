// CPU block backward: recompute P from the final global lse, then
//   dV += P^T dO,  dS = P * (dO V^T - delta),  dQ += scale dS K,  dK += scale dS^T Q
// with key tiles outer and query tiles inner. A task owns its segments' rows
// (per branch), so no atomics are needed. A gradient not asked for (dq, or dk
// with dv) is not computed.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

#include "block_tasks.h"
#include "kernels.h"
#include "tile_math.h"

namespace ring_attention::cpu {
namespace {

constexpr int64_t kTileQ = 128;
constexpr int64_t kTileK = 64;

template <typename scalar_t, typename acc_t>
struct BackwardTile {
  const BlockParams& g;
  const scalar_t *dout, *q, *k, *v;
  const acc_t *lse, *delta;  // delta = rowsum(dout * out), laid out like lse
  const bool* kpm;
  acc_t *dq, *dk, *dv;  // nullptr: not asked for
  acc_t scale;
  std::vector<acc_t> qbuf, dobuf, kbuf, vbuf, s, dp;

  BackwardTile(const BlockParams& g_, const scalar_t* dout_, const scalar_t* q_, const scalar_t* k_,
               const scalar_t* v_, const acc_t* lse_, const acc_t* delta_, const bool* kpm_,
               acc_t* dq_, acc_t* dk_, acc_t* dv_, acc_t scale_)
      : g(g_),
        dout(dout_),
        q(q_),
        k(k_),
        v(v_),
        lse(lse_),
        delta(delta_),
        kpm(kpm_),
        dq(dq_),
        dk(dk_),
        dv(dv_),
        scale(scale_) {
    const int64_t d = g.head_dim;
    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      qbuf.resize(kTileQ * d);
      dobuf.resize(kTileQ * d);
      kbuf.resize(kTileK * d);
      vbuf.resize(kTileK * d);
    }
    s.resize(kTileQ * kTileK);
    dp.resize(kTileQ * kTileK);
  }

  // One key tile of tk keys (first at u0, stride r) against all its queries.
  void run(int64_t b, int64_t h, int64_t r, int64_t u0, int64_t tk, ActiveRun queries) {
    constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    const int64_t d = g.head_dim, stride = r * g.heads * d;
    const int64_t koff = g.k_index(b, u0, h);
    const TileRef<acc_t> kt = tile_rows<acc_t>(k + koff, stride, tk, d, kbuf);
    const TileRef<acc_t> vt = tile_rows<acc_t>(v + koff, stride, tk, d, vbuf);

    // Causal: queries before the first key of the tile reach none of it.
    int64_t m_begin = 0;
    if (g.causal && u0 > queries.first) m_begin = ceil_div(u0 - queries.first, r);
    for (int64_t m0 = m_begin; m0 < queries.count; m0 += kTileQ) {
      const int64_t tq = std::min(kTileQ, queries.count - m0);
      const int64_t t0 = queries.first + m0 * r;
      const int64_t qoff = g.q_index(b, t0, h);
      const TileRef<acc_t> qt = tile_rows<acc_t>(q + qoff, stride, tq, d, qbuf);
      const TileRef<acc_t> dot = tile_rows<acc_t>(dout + qoff, stride, tq, d, dobuf);
      gemm(false, true, tq, tk, d, scale, qt.ptr, qt.ld, kt.ptr, kt.ld, acc_t(0), s.data(), tk);
      gemm(false, true, tq, tk, d, acc_t(1), dot.ptr, dot.ld, vt.ptr, vt.ld, acc_t(0), dp.data(),
           tk);
      for (int64_t i = 0; i < tq; ++i) {
        acc_t* srow = &s[i * tk];
        acc_t* dprow = &dp[i * tk];
        const int64_t t = t0 + i * r;
        const int64_t row = g.row_index(b, h, t);
        const acc_t row_lse = lse[row], row_delta = delta[row];
        if (row_lse == neg_inf) {  // reaches nothing: no gradient
          std::fill(srow, srow + tk, acc_t(0));
          std::fill(dprow, dprow + tk, acc_t(0));
          continue;
        }
        int64_t valid = tk;
        if (g.causal) valid = t < u0 ? 0 : std::min(tk, (t - u0) / r + 1);
        for (int64_t j = valid; j < tk; ++j) srow[j] = neg_inf;
        if (kpm != nullptr) {
          const bool* mrow = kpm + b * g.k_len + (u0 - g.k_start);
          for (int64_t j = 0; j < valid; ++j)
            if (mrow[j * r]) srow[j] = neg_inf;
        }
        softmax_grad_row(srow, dprow, tk, row_lse, row_delta);
      }
      // dV += P^T dO, dK += scale dS^T Q, dQ += scale dS K, straight into the
      // accumulators through the same row stride.
      if (dv != nullptr) {
        gemm(true, false, tk, d, tq, acc_t(1), s.data(), tk, dot.ptr, dot.ld, acc_t(1), dv + koff,
             stride);
        gemm(true, false, tk, d, tq, scale, dp.data(), tk, qt.ptr, qt.ld, acc_t(1), dk + koff,
             stride);
      }
      if (dq != nullptr) {
        gemm(false, false, tq, d, tk, scale, dp.data(), tk, kt.ptr, kt.ld, acc_t(1), dq + qoff,
             stride);
      }
    }
  }
};

template <typename scalar_t>
void backward_kernel(const BlockCall& call) {
  using acc_t = at::opmath_type<scalar_t>;
  const BlockParams& g = call.params;
  const auto* dout = static_cast<const scalar_t*>(g.grad_out);
  const auto* out = static_cast<const scalar_t*>(g.out_in);
  // delta[b, h, t] = sum_c dout[b, t, h, c] * out[b, t, h, c]
  std::vector<acc_t> delta(g.batch * g.heads * g.q_len);
  at::parallel_for(0, g.batch * g.q_len, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t bt = lo; bt < hi; ++bt) {
      const int64_t b = bt / g.q_len, t = bt % g.q_len;
      for (int64_t h = 0; h < g.heads; ++h) {
        const int64_t off = (bt * g.heads + h) * g.head_dim;
        acc_t sum = 0;
        for (int64_t c = 0; c < g.head_dim; ++c)
          sum += static_cast<acc_t>(dout[off + c]) * static_cast<acc_t>(out[off + c]);
        delta[(b * g.heads + h) * g.q_len + t] = sum;
      }
    }
  });
  for (int64_t i = 0; i < g.n_branches; ++i) {
    const int64_t w = call.segment_lengths[i], r = call.dilation_rates[i];
    const std::vector<SegmentTask> tasks = branch_tasks(g, i, w, r);
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
      BackwardTile<scalar_t, acc_t> tile(
          g, dout, static_cast<const scalar_t*>(g.q), static_cast<const scalar_t*>(g.k),
          static_cast<const scalar_t*>(g.v), static_cast<const acc_t*>(g.lse_in), delta.data(),
          g.key_padding_mask, static_cast<acc_t*>(g.dq), static_cast<acc_t*>(g.dk),
          static_cast<acc_t*>(g.dv), static_cast<acc_t>(g.scale));
      for (int64_t ti = lo; ti < hi; ++ti) {
        const SegmentTask& task = tasks[ti];
        for (int64_t s = task.seg_begin; s < task.seg_end; ++s) {
          const SegmentRuns runs = segment_runs(g, s, w, r, task.h);
          for (int64_t n0 = 0; n0 < runs.k.count; n0 += kTileK) {
            tile.run(task.b, task.h, r, runs.k.first + n0 * r, std::min(kTileK, runs.k.count - n0),
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, call.dtype, "block_backward_cpu",
                                  [&] { backward_kernel<scalar_t>(call); });
}

}  // namespace ring_attention::cpu
