// The one definition of the dilated-attention pattern (docs/design.md §1), shared
// by every kernel (CPU and CUDA) and by the exchange planner.
//
// A branch (w, r) splits positions into segments [s*w, s*w + w). For head h,
// position t is active iff (t mod w) mod r == h mod r. Active positions of a
// segment therefore form the progression seg_start + (h mod r) + r*m.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RA_HOST_DEVICE __host__ __device__
#else
#define RA_HOST_DEVICE
#endif

namespace ring_attention {

RA_HOST_DEVICE inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Position t is active for head h in branch (w, r).
RA_HOST_DEVICE inline bool is_active(int64_t t, int64_t w, int64_t r, int64_t h) {
  return (t % w) % r == h % r;
}

// Smallest p >= lo with (p - seg_start) % r == offset, for lo >= seg_start.
RA_HOST_DEVICE inline int64_t first_active(int64_t lo, int64_t seg_start, int64_t r,
                                           int64_t offset) {
  const int64_t rel = lo - seg_start;
  if (rel <= offset) return seg_start + offset;
  return seg_start + offset + ceil_div(rel - offset, r) * r;
}

// Number of active positions in [lo, hi) when the first active one is p0.
RA_HOST_DEVICE inline int64_t active_count(int64_t p0, int64_t hi, int64_t r) {
  return p0 < hi ? ceil_div(hi - p0, r) : 0;
}

// head_groups=True: heads split into n_branches contiguous groups whose sizes
// differ by at most one, the first groups taking the extra heads.
RA_HOST_DEVICE inline int64_t head_group_begin(int64_t group, int64_t heads, int64_t n_branches) {
  const int64_t base = heads / n_branches, extra = heads % n_branches;
  return group * base + (group < extra ? group : extra);
}

RA_HOST_DEVICE inline bool branch_applies(int64_t h, int64_t branch, int64_t heads,
                                          int64_t n_branches, bool head_groups) {
  if (!head_groups) return true;
  return h >= head_group_begin(branch, heads, n_branches) &&
         h < head_group_begin(branch + 1, heads, n_branches);
}

// The active rows of one (branch, head, segment) restricted to a position
// range: positions first + r*m for m in [0, count).
struct ActiveRun {
  int64_t first;
  int64_t count;
};

// Active positions of head h in segment [seg_start, seg_start + w) that also
// lie in [lo, hi).
RA_HOST_DEVICE inline ActiveRun active_run(int64_t seg_start, int64_t w, int64_t r, int64_t h,
                                           int64_t lo, int64_t hi) {
  const int64_t a = lo > seg_start ? lo : seg_start;
  const int64_t seg_end = seg_start + w;
  const int64_t b = hi < seg_end ? hi : seg_end;
  const int64_t p0 = first_active(a, seg_start, r, h % r);
  return {p0, a < b ? active_count(p0, b, r) : 0};
}

// The active query rows of head h in one segment that lie in [q_lo, q_hi),
// and the key rows in [k_lo, k_hi) they reach: same head, same segment, and
// for causal attention no later than the last of those queries. This is the
// whole reachability rule; kernels and the exchange planner all use it.
struct SegmentRuns {
  ActiveRun q, k;
};

RA_HOST_DEVICE inline SegmentRuns segment_runs(int64_t seg_start, int64_t w, int64_t r, int64_t h,
                                               int64_t q_lo, int64_t q_hi, int64_t k_lo,
                                               int64_t k_hi, bool causal) {
  SegmentRuns runs;
  runs.q = active_run(seg_start, w, r, h, q_lo, q_hi);
  if (runs.q.count == 0) {
    runs.k = {seg_start, 0};
    return runs;
  }
  if (causal) {
    const int64_t last_q = runs.q.first + (runs.q.count - 1) * r;
    if (last_q + 1 < k_hi) k_hi = last_q + 1;
  }
  runs.k = active_run(seg_start, w, r, h, k_lo, k_hi);
  return runs;
}

// Segments of branch w that meet both [q_lo, q_lo + q_len) and
// [k_lo, k_lo + k_len): indices [lo, hi); false if there are none.
RA_HOST_DEVICE inline bool shared_segments(int64_t w, int64_t q_lo, int64_t q_len, int64_t k_lo,
                                           int64_t k_len, int64_t& lo, int64_t& hi) {
  if (q_len <= 0 || k_len <= 0) return false;
  const int64_t q_first = q_lo / w, q_last = (q_lo + q_len - 1) / w;
  const int64_t k_first = k_lo / w, k_last = (k_lo + k_len - 1) / w;
  lo = q_first > k_first ? q_first : k_first;
  hi = (q_last < k_last ? q_last : k_last) + 1;
  return lo < hi;
}

}  // namespace ring_attention
