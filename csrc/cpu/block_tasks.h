// Work decomposition shared by the CPU forward and backward kernels.
//
// For one branch (w, r), a task is (batch, head, run of segments). Within a
// branch a query row and a key row belong to exactly one segment, so tasks of
// one branch never touch the same output rows: they run in parallel without
// atomics, and branches run one after another.
#pragma once

#include <cstdint>
#include <vector>

#include "../params.h"
#include "../pattern.h"

namespace ring_attention::cpu {

struct SegmentTask {
  int64_t b, h, seg_begin, seg_end;  // segment indices [seg_begin, seg_end)
};

inline std::vector<SegmentTask> branch_tasks(const BlockParams& p, int64_t branch, int64_t w,
                                             int64_t r) {
  std::vector<SegmentTask> tasks;
  int64_t s_lo, s_hi;
  if (!shared_segments(w, p.q_start, p.q_len, p.k_start, p.k_len, s_lo, s_hi)) return tasks;
  // Group small segments so a task holds a few hundred active rows.
  const int64_t rows_per_segment = ceil_div(w, r);
  const int64_t chunk = rows_per_segment >= 256 ? 1 : 256 / rows_per_segment;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads; ++h) {
      if (!p.applies(h, branch)) continue;
      for (int64_t s = s_lo; s < s_hi; s += chunk) {
        tasks.push_back({b, h, s, s + chunk < s_hi ? s + chunk : s_hi});
      }
    }
  }
  return tasks;
}

inline SegmentRuns segment_runs(const BlockParams& p, int64_t s, int64_t w, int64_t r, int64_t h) {
  return ring_attention::segment_runs(s * w, w, r, h, p.q_start, p.q_start + p.q_len, p.k_start,
                                      p.k_start + p.k_len, p.causal);
}

}  // namespace ring_attention::cpu
