// Work decomposition shared by the CPU forward and backward kernels.
//
// For one branch (w, r), a task is (batch, head, run of segments). Within a
// branch a query row and a key row belong to exactly one segment, so tasks of
// one branch never touch the same output rows: they run in parallel without
// atomics, and branches run one after another.
#pragma once

#include <cstdint>
#include <vector>

#include "../pattern.h"

namespace ring_attention::cpu {

struct BlockGeometry {
  int64_t batch, heads, dim;
  int64_t q_start, q_len, k_start, k_len;
  bool causal, head_groups;
  int64_t n_branches;

  // Element offset of (batch b, global position pos, head h) in a
  // (B, L, H, D) query-block / key-block tensor.
  int64_t q_offset(int64_t b, int64_t pos, int64_t h) const {
    return ((b * q_len + (pos - q_start)) * heads + h) * dim;
  }
  int64_t k_offset(int64_t b, int64_t pos, int64_t h) const {
    return ((b * k_len + (pos - k_start)) * heads + h) * dim;
  }
};

struct SegmentTask {
  int64_t b, h, seg_begin, seg_end;  // segment indices [seg_begin, seg_end)
};

// Segments that intersect both the query and the key range.
inline bool shared_segments(const BlockGeometry& g, int64_t w, int64_t& s_lo, int64_t& s_hi) {
  if (g.q_len <= 0 || g.k_len <= 0) return false;
  const int64_t q_lo = g.q_start / w, q_hi = (g.q_start + g.q_len - 1) / w;
  const int64_t k_lo = g.k_start / w, k_hi = (g.k_start + g.k_len - 1) / w;
  s_lo = q_lo > k_lo ? q_lo : k_lo;
  s_hi = (q_hi < k_hi ? q_hi : k_hi) + 1;
  return s_lo < s_hi;
}

inline std::vector<SegmentTask> branch_tasks(const BlockGeometry& g, int64_t branch, int64_t w,
                                             int64_t r) {
  std::vector<SegmentTask> tasks;
  int64_t s_lo, s_hi;
  if (!shared_segments(g, w, s_lo, s_hi)) return tasks;
  // Group small segments so a task holds a few hundred active rows.
  const int64_t rows_per_segment = ceil_div(w, r);
  const int64_t chunk = rows_per_segment >= 256 ? 1 : 256 / rows_per_segment;
  for (int64_t b = 0; b < g.batch; ++b) {
    for (int64_t h = 0; h < g.heads; ++h) {
      if (!branch_applies(h, branch, g.heads, g.n_branches, g.head_groups)) continue;
      for (int64_t s = s_lo; s < s_hi; s += chunk) {
        tasks.push_back({b, h, s, s + chunk < s_hi ? s + chunk : s_hi});
      }
    }
  }
  return tasks;
}

inline SegmentRuns segment_runs(const BlockGeometry& g, int64_t s, int64_t w, int64_t r,
                                int64_t h) {
  return ring_attention::segment_runs(s * w, w, r, h, g.q_start, g.q_start + g.q_len, g.k_start,
                                      g.k_start + g.k_len, g.causal);
}

}  // namespace ring_attention::cpu
