// CPU block forward: flash-style tiles over the active rows of each
// (branch, head, segment), online softmax in acc_t, merged into the running
// (out, lse) accumulators. Dilated rows are read in place through their row
// stride r*H*D; memory is O(tile), never seq x seq.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

#include "block_tasks.h"
#include "kernels.h"
#include "tile_math.h"

namespace ring_attention::cpu {
namespace {

constexpr int64_t kTileQ = 128;
constexpr int64_t kTileK = 512;

template <typename scalar_t, typename acc_t>
struct ForwardTile {
  const BlockParams& g;
  const scalar_t *q, *k, *v;
  const bool* kpm;  // (B, Lk) or nullptr
  acc_t *out, *lse;
  acc_t scale;
  std::vector<acc_t> qbuf, kbuf, vbuf, s, o, m, l;

  ForwardTile(const BlockParams& g_, const scalar_t* q_, const scalar_t* k_, const scalar_t* v_,
              const bool* kpm_, acc_t* out_, acc_t* lse_, acc_t scale_)
      : g(g_), q(q_), k(k_), v(v_), kpm(kpm_), out(out_), lse(lse_), scale(scale_) {
    const int64_t d = g.head_dim;
    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      qbuf.resize(kTileQ * d);
      kbuf.resize(kTileK * d);
      vbuf.resize(kTileK * d);
    }
    s.resize(kTileQ * kTileK);
    o.resize(kTileQ * d);
    m.resize(kTileQ);
    l.resize(kTileQ);
  }

  // Attend tq active queries (first at position t0, stride r) to the key run.
  void run(int64_t b, int64_t h, int64_t r, int64_t t0, int64_t tq, ActiveRun keys) {
    constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    const int64_t d = g.head_dim, stride = r * g.heads * d;
    const int64_t t_last = t0 + (tq - 1) * r;
    int64_t nk = keys.count;
    if (g.causal) nk = t_last < keys.first ? 0 : std::min(nk, (t_last - keys.first) / r + 1);
    if (nk == 0) return;

    const TileRef<acc_t> qt = tile_rows<acc_t>(q + g.q_index(b, t0, h), stride, tq, d, qbuf);
    std::fill(o.begin(), o.begin() + tq * d, acc_t(0));
    std::fill(m.begin(), m.end(), neg_inf);
    std::fill(l.begin(), l.end(), acc_t(0));

    for (int64_t n0 = 0; n0 < nk; n0 += kTileK) {
      const int64_t tk = std::min(kTileK, nk - n0);
      const int64_t u0 = keys.first + n0 * r;
      const TileRef<acc_t> kt = tile_rows<acc_t>(k + g.k_index(b, u0, h), stride, tk, d, kbuf);
      const TileRef<acc_t> vt = tile_rows<acc_t>(v + g.k_index(b, u0, h), stride, tk, d, vbuf);
      gemm(false, true, tq, tk, d, scale, qt.ptr, qt.ld, kt.ptr, kt.ld, acc_t(0), s.data(), tk);

      for (int64_t i = 0; i < tq; ++i) {
        acc_t* srow = &s[i * tk];
        const int64_t t = t0 + i * r;
        // Keys past the query (causal) are not reached.
        int64_t valid = tk;
        if (g.causal) valid = t < u0 ? 0 : std::min(tk, (t - u0) / r + 1);
        for (int64_t j = valid; j < tk; ++j) srow[j] = neg_inf;
        if (kpm != nullptr) {
          const bool* mrow = kpm + b * g.k_len + (u0 - g.k_start);
          for (int64_t j = 0; j < valid; ++j)
            if (mrow[j * r]) srow[j] = neg_inf;
        }
        const acc_t m_new = max_nan(row_max(srow, tk), m[i]);
        if (m_new == neg_inf) {
          std::fill(srow, srow + tk, acc_t(0));
          continue;
        }
        const acc_t alpha = std::exp(m[i] - m_new);
        l[i] = l[i] * alpha + exp_sub_sum(srow, tk, m_new);
        if (alpha != acc_t(1)) scale_row(&o[i * d], d, alpha);
        m[i] = m_new;
      }
      gemm(false, false, tq, d, tk, acc_t(1), s.data(), tk, vt.ptr, vt.ld, acc_t(1), o.data(), d);
    }

    for (int64_t i = 0; i < tq; ++i) {
      if (!(l[i] > acc_t(0)) && !std::isnan(l[i])) continue;
      scale_row(&o[i * d], d, acc_t(1) / l[i]);
      acc_t* out_row = out + g.q_index(b, t0 + i * r, h);
      acc_t& lse_ref = lse[g.row_index(b, h, t0 + i * r)];
      merge_row(out_row, lse_ref, &o[i * d], m[i] + std::log(l[i]), d);
    }
  }
};

template <typename scalar_t>
void forward_kernel(const BlockCall& call) {
  using acc_t = at::opmath_type<scalar_t>;
  const BlockParams& g = call.params;
  const auto *qp = static_cast<const scalar_t*>(g.q), *kp = static_cast<const scalar_t*>(g.k),
             *vp = static_cast<const scalar_t*>(g.v);
  acc_t *op = static_cast<acc_t*>(g.out), *lp = static_cast<acc_t*>(g.lse);
  for (int64_t i = 0; i < g.n_branches; ++i) {
    const int64_t w = call.segment_lengths[i], r = call.dilation_rates[i];
    const std::vector<SegmentTask> tasks = branch_tasks(g, i, w, r);
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
      ForwardTile<scalar_t, acc_t> tile(g, qp, kp, vp, g.key_padding_mask, op, lp,
                                        static_cast<acc_t>(g.scale));
      for (int64_t ti = lo; ti < hi; ++ti) {
        const SegmentTask& task = tasks[ti];
        for (int64_t s = task.seg_begin; s < task.seg_end; ++s) {
          const SegmentRuns runs = segment_runs(g, s, w, r, task.h);
          if (runs.k.count == 0) continue;
          for (int64_t m0 = 0; m0 < runs.q.count; m0 += kTileQ) {
            tile.run(task.b, task.h, r, runs.q.first + m0 * r, std::min(kTileQ, runs.q.count - m0),
                     runs.k);
          }
        }
      }
    });
  }
}

}  // namespace

void block_forward(const BlockCall& call) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, call.dtype, "block_forward_cpu",
                                  [&] { forward_kernel<scalar_t>(call); });
}

}  // namespace ring_attention::cpu
