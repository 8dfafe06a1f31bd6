// CPU block backward: recompute P from the final global lse, then
//   dV += P^T dO,  dS = P * (dO V^T - delta),  dQ += scale dS K,  dK += scale dS^T Q
// with key tiles outer (dK, dV stay in registers of the tile) and query tiles
// inner. A task owns its segments' rows, so no atomics are needed.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

#include "../checks.h"
#include "block_tasks.h"
#include "kernels.h"
#include "tile_math.h"

namespace ring_attention::cpu {
namespace {

constexpr int64_t kTileQ = 64;
constexpr int64_t kTileK = 64;

template <typename scalar_t, typename acc_t>
struct BackwardTile {
  const BlockGeometry& g;
  const scalar_t *dout, *q, *k, *v, *out;
  const acc_t* lse;
  const bool* kpm;
  acc_t *dq, *dk, *dv;
  acc_t scale;
  std::vector<acc_t> qt, dot, kr, kt, vt, s, dp, pt, dst, dk_acc, dv_acc, dq_tile, delta;

  BackwardTile(const BlockGeometry& g_, const scalar_t* dout_, const scalar_t* q_,
               const scalar_t* k_, const scalar_t* v_, const scalar_t* out_, const acc_t* lse_,
               const bool* kpm_, acc_t* dq_, acc_t* dk_, acc_t* dv_, acc_t scale_)
      : g(g_), dout(dout_), q(q_), k(k_), v(v_), out(out_), lse(lse_), kpm(kpm_), dq(dq_),
        dk(dk_), dv(dv_), scale(scale_) {
    const int64_t d = g.dim;
    for (auto* buf : {&qt, &dot, &dq_tile}) buf->resize(kTileQ * d);
    for (auto* buf : {&kr, &kt, &vt, &dk_acc, &dv_acc}) buf->resize(kTileK * d);
    for (auto* buf : {&s, &dp, &pt, &dst}) buf->resize(kTileQ * kTileK);
    delta.resize(kTileQ);
  }

  int64_t q_offset(int64_t b, int64_t pos, int64_t h) const {
    return ((b * g.q_len + (pos - g.q_start)) * g.heads + h) * g.dim;
  }
  int64_t k_offset(int64_t b, int64_t pos, int64_t h) const {
    return ((b * g.k_len + (pos - g.k_start)) * g.heads + h) * g.dim;
  }

  // One key tile of tk keys (first at u0, stride r) against all its queries.
  void run(int64_t b, int64_t h, int64_t r, int64_t u0, int64_t tk, ActiveRun queries) {
    constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    const int64_t d = g.dim, tkp = pad_tile(tk);
    std::fill(kr.begin(), kr.end(), acc_t(0));
    std::fill(kt.begin(), kt.end(), acc_t(0));
    std::fill(vt.begin(), vt.end(), acc_t(0));
    for (int64_t j = 0; j < tk; ++j) {
      const int64_t off = k_offset(b, u0 + j * r, h);
      load_row(&kr[j * d], k + off, d, acc_t(1));
      for (int64_t c = 0; c < d; ++c) {
        kt[c * tkp + j] = static_cast<acc_t>(k[off + c]);
        vt[c * tkp + j] = static_cast<acc_t>(v[off + c]);
      }
    }
    std::fill(dk_acc.begin(), dk_acc.end(), acc_t(0));
    std::fill(dv_acc.begin(), dv_acc.end(), acc_t(0));

    // Causal: queries before the first key of the tile reach none of it.
    int64_t m_begin = 0;
    if (g.causal && u0 > queries.first) m_begin = ceil_div(u0 - queries.first, r);
    for (int64_t m0 = m_begin; m0 < queries.count; m0 += kTileQ) {
      const int64_t tq = std::min(kTileQ, queries.count - m0), tqp = pad_tile(tq);
      const int64_t t0 = queries.first + m0 * r;
      std::fill(qt.begin(), qt.begin() + tqp * d, acc_t(0));
      std::fill(dot.begin(), dot.begin() + tqp * d, acc_t(0));
      for (int64_t i = 0; i < tq; ++i) {
        const int64_t off = q_offset(b, t0 + i * r, h);
        load_row(&qt[i * d], q + off, d, scale);
        load_row(&dot[i * d], dout + off, d, acc_t(1));
        acc_t dsum = 0;
        for (int64_t c = 0; c < d; ++c) dsum += dot[i * d + c] * static_cast<acc_t>(out[off + c]);
        delta[i] = dsum;
      }
      gemm<acc_t>(tqp, tkp, d, qt.data(), d, kt.data(), tkp, s.data(), tkp, false);
      gemm<acc_t>(tqp, tkp, d, dot.data(), d, vt.data(), tkp, dp.data(), tkp, false);
      for (int64_t i = 0; i < tqp; ++i) {
        acc_t* srow = &s[i * tkp];
        acc_t* dprow = &dp[i * tkp];
        if (i >= tq) {
          std::fill(srow, srow + tkp, acc_t(0));
          std::fill(dprow, dprow + tkp, acc_t(0));
          continue;
        }
        const int64_t t = t0 + i * r;
        const acc_t row_lse = lse[(b * g.heads + h) * g.q_len + (t - g.q_start)];
        int64_t valid = tk;
        if (g.causal) valid = t < u0 ? 0 : std::min(tk, (t - u0) / r + 1);
        for (int64_t j = 0; j < tkp; ++j) {
          bool reached = j < valid && row_lse != neg_inf;
          if (reached && kpm != nullptr) reached = !kpm[b * g.k_len + (u0 + j * r - g.k_start)];
          const acc_t p = reached ? std::exp(srow[j] - row_lse) : acc_t(0);
          srow[j] = p;
          dprow[j] = reached ? p * (dprow[j] - delta[i]) : acc_t(0);
        }
      }
      // pt = P^T, dst = dS^T (tkp x tqp).
      for (int64_t i = 0; i < tqp; ++i)
        for (int64_t j = 0; j < tkp; ++j) {
          pt[j * tqp + i] = s[i * tkp + j];
          dst[j * tqp + i] = dp[i * tkp + j];
        }
      gemm<acc_t>(tkp, d, tqp, pt.data(), tqp, dot.data(), d, dv_acc.data(), d, true);
      gemm<acc_t>(tkp, d, tqp, dst.data(), tqp, qt.data(), d, dk_acc.data(), d, true);
      gemm<acc_t>(tqp, d, tkp, dp.data(), tkp, kr.data(), d, dq_tile.data(), d, false);
      for (int64_t i = 0; i < tq; ++i) {
        acc_t* dst_row = dq + q_offset(b, t0 + i * r, h);
        for (int64_t c = 0; c < d; ++c) dst_row[c] += scale * dq_tile[i * d + c];
      }
    }
    for (int64_t j = 0; j < tk; ++j) {
      const int64_t off = k_offset(b, u0 + j * r, h);
      for (int64_t c = 0; c < d; ++c) {
        dk[off + c] += dk_acc[j * d + c];
        dv[off + c] += dv_acc[j * d + c];
      }
    }
  }
};

template <typename scalar_t>
void backward_kernel(const BlockGeometry& g, const at::Tensor& dout, const at::Tensor& q,
                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                     const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                     at::IntArrayRef segs, at::IntArrayRef dils, double scale, const bool* kpm) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = 0; i < g.n_branches; ++i) {
    const int64_t w = segs[i], r = dils[i];
    const std::vector<SegmentTask> tasks = branch_tasks(g, i, w, r);
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
      BackwardTile<scalar_t, acc_t> tile(
          g, dout.const_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(),
          k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
          out.const_data_ptr<scalar_t>(), lse.const_data_ptr<acc_t>(), kpm,
          dq.mutable_data_ptr<acc_t>(), dk.mutable_data_ptr<acc_t>(), dv.mutable_data_ptr<acc_t>(),
          static_cast<acc_t>(scale));
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

void block_backward_cpu(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                        at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, int64_t q_start,
                        int64_t k_start, at::IntArrayRef segment_lengths,
                        at::IntArrayRef dilation_rates, bool causal, double scale,
                        bool head_groups, const std::optional<at::Tensor>& key_padding_mask) {
  check_block_backward(grad_out, q, k, v, out, lse, dq, dk, dv, q_start, k_start, segment_lengths,
                       dilation_rates, head_groups, key_padding_mask);
  const at::Tensor dc = grad_out.contiguous(), qc = q.contiguous(), kc = k.contiguous(),
                   vc = v.contiguous(), oc = out.contiguous(), lc = lse.contiguous();
  at::Tensor mask;
  if (key_padding_mask.has_value()) mask = key_padding_mask->contiguous();
  const BlockGeometry g{q.size(0), q.size(2), q.size(3), q_start, q.size(1), k_start, k.size(1),
                        causal, head_groups, static_cast<int64_t>(segment_lengths.size())};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, q.scalar_type(), "block_backward_cpu", [&] {
        backward_kernel<scalar_t>(g, dc, qc, kc, vc, oc, lc, dq, dk, dv, segment_lengths,
                                  dilation_rates, scale,
                                  mask.defined() ? mask.const_data_ptr<bool>() : nullptr);
      });
}

}  // namespace ring_attention::cpu
