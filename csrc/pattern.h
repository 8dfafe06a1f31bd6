// The one definition of the dilated-attention pattern (docs/design.md §1),
// shared by every kernel (CPU and CUDA) and by the exchange planner.
//
// Positions are global. Documents (cu_seqlens) cut them into [d_j, d_j+1);
// without documents there is one unbounded document. Branch (w, r) cuts each
// document [d, e) into segments [d + s*w, min(d + (s+1)*w, e)). Position t of
// segment [a, b) is active for query head h iff (t - a) mod r == offset(h, r),
// so the active positions of a segment are a + offset + r*m. Query t reaches
// key u in the branch iff both are active and in one segment (and u <= t for
// causal attention).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RA_HOST_DEVICE __host__ __device__
#else
#define RA_HOST_DEVICE
#endif

namespace ring_attention {

RA_HOST_DEVICE inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Branch (w, r) seen by positions below `extent` (relative positions are
// below it too) and `heads` query heads equals branch (min(w, cap), min(r, cap))
// with cap = max(extent, heads) + 1: a segment longer than every document is
// the document, and a dilation above both every relative position and every
// head index activates exactly relative position offset(h, r) = h. Kernels and
// the planner take clamped values, so no size computation sees a huge w or r.
inline int64_t branch_cap(int64_t extent, int64_t heads) {
  return (extent > heads ? extent : heads) + 1;
}

// Offset of query head h in a branch of dilation r: h mod r, or with grouped
// offsets (torchscale's LongNet) h / ceil(heads / r), which gives contiguous
// groups of heads one offset each.
RA_HOST_DEVICE inline int64_t head_offset(int64_t h, int64_t r, int64_t heads, bool grouped) {
  return grouped ? h / ceil_div(heads, r) : h % r;
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

// Document boundaries bounds[0] = 0 <= bounds[1] <= ... <= bounds[count], on
// the device that reads them; bounds == nullptr: no documents.
struct Documents {
  const int64_t* bounds;
  int64_t count;
};

struct Segment {
  int64_t start, end;
};

// The segments of branch w in position order, from the one that contains
// position t on. Touches O(log documents) bounds to start and O(1) per step.
// Malformed bounds (only the CPU checks their values) give wrong segments,
// never a read out of bounds or a step that does not advance.
class SegmentWalk {
 public:
  RA_HOST_DEVICE SegmentWalk(Documents docs, int64_t w, int64_t t) : docs_(docs), w_(w) {
    if (docs_.bounds == nullptr || docs_.count <= 0) {
      doc_ = -1;
      doc_start_ = 0;
      doc_end_ = kNoEnd;
    } else {
      int64_t lo = 0, hi = docs_.count - 1;  // the last document starting at or before t
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (docs_.bounds[mid] <= t) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      doc_ = lo;
      const int64_t start = docs_.bounds[doc_];
      doc_start_ = start < t ? start : t;
      doc_end_ = document_end(t);
    }
    seg_.start = doc_start_ + (t - doc_start_) / w_ * w_;
    seg_.end = segment_end(seg_.start);
  }

  RA_HOST_DEVICE const Segment& segment() const { return seg_; }

  RA_HOST_DEVICE void next() {
    const int64_t t = seg_.end;
    if (t >= doc_end_) {  // the next non-empty document starts at t
      ++doc_;
      while (doc_ + 1 < docs_.count && docs_.bounds[doc_ + 1] <= t) ++doc_;
      doc_start_ = t;
      doc_end_ = document_end(t);
    }
    seg_.start = t;
    seg_.end = segment_end(t);
  }

 private:
  // No documents, or past the last one: the document never ends. Every
  // int64 position lies before it, and sums are saturated below, not formed.
  static constexpr int64_t kNoEnd = INT64_MAX;

  // End of the current document, which holds position t (past the last
  // document: unbounded).
  RA_HOST_DEVICE int64_t document_end(int64_t t) const {
    if (doc_ >= docs_.count) return kNoEnd;
    const int64_t end = docs_.bounds[doc_ + 1];
    return end > t ? end : (t < kNoEnd ? t + 1 : kNoEnd);
  }
  // End of the segment starting at t <= doc_end_: t + w, clipped to the
  // document (compared as a difference, so t + w is never formed past it).
  RA_HOST_DEVICE int64_t segment_end(int64_t t) const {
    return doc_end_ - t > w_ ? t + w_ : doc_end_;
  }

  Documents docs_;
  int64_t w_;
  int64_t doc_, doc_start_, doc_end_;
  Segment seg_;
};

// The active rows of one (branch, head, segment) restricted to a position
// range: positions first + r*m for m in [0, count).
struct ActiveRun {
  int64_t first;
  int64_t count;
};

// Active positions (offset, dilation r) of segment seg that lie in [lo, hi).
RA_HOST_DEVICE inline ActiveRun active_run(Segment seg, int64_t r, int64_t offset, int64_t lo,
                                           int64_t hi) {
  const int64_t a = lo > seg.start ? lo : seg.start;
  const int64_t b = hi < seg.end ? hi : seg.end;
  const int64_t rel = a - seg.start;  // first p >= a with (p - seg.start) mod r == offset
  const int64_t p0 = seg.start + offset + (rel <= offset ? 0 : ceil_div(rel - offset, r) * r);
  return {p0, p0 < b ? ceil_div(b - p0, r) : 0};
}

// The active query rows of one (branch, head offset, segment) that lie in
// [q_lo, q_hi), and the key rows in [k_lo, k_hi) they reach: same segment,
// same offset, and for causal attention no later than the last of those
// queries. This is the whole reachability rule; kernels and the exchange
// planner all use it.
struct SegmentRuns {
  ActiveRun q, k;
};

RA_HOST_DEVICE inline SegmentRuns segment_runs(Segment seg, int64_t r, int64_t offset, int64_t q_lo,
                                               int64_t q_hi, int64_t k_lo, int64_t k_hi,
                                               bool causal) {
  SegmentRuns runs;
  runs.q = active_run(seg, r, offset, q_lo, q_hi);
  if (runs.q.count == 0) {
    runs.k = {seg.start, 0};
    return runs;
  }
  if (causal) {
    const int64_t last_q = runs.q.first + (runs.q.count - 1) * r;
    if (last_q + 1 < k_hi) k_hi = last_q + 1;
  }
  runs.k = active_run(seg, r, offset, k_lo, k_hi);
  return runs;
}

}  // namespace ring_attention
