// Work decomposition shared by the CPU forward and backward kernels.
//
// For one branch (w, r), a task is (batch, head set, run of segments). A head
// set holds the query heads that read the same key rows: one K/V head, one
// offset, the branch applying to each. Their query rows are stacked into one
// tile, so every K/V tile is loaded (converted, for fp16/bf16) once for all
// of them. Within a branch a query row belongs to one head set and segment,
// and a key row of a K/V head to one offset and segment, so the tasks of a
// branch never write the same output rows (when a K/V head's head sets are
// whole): they run in parallel without atomics, branches one after another.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "../params.h"
#include "../pattern.h"

namespace ring_attention::cpu {

struct HeadSet {
  int64_t kv_head, offset;
  std::vector<int64_t> heads;
};

struct SegmentTask {
  int64_t b;
  size_t head_set;            // index into BranchWork::head_sets
  size_t seg_begin, seg_end;  // indices into BranchWork::segments
};

struct BranchWork {
  int64_t w, r;
  std::vector<Segment> segments;  // meeting both the query and the key block, in order
  std::vector<HeadSet> head_sets;
  std::vector<SegmentTask> tasks;
};

// The work of branch i. Head sets hold at most max_set_heads heads (larger
// sets are split; only a kernel that writes no key rows may ask for that).
inline BranchWork branch_work(const BlockParams& p, int64_t i, int64_t w, int64_t r,
                              size_t max_set_heads) {
  BranchWork work{w, r, {}, {}, {}};
  if (p.q_len <= 0 || p.k_len <= 0) return work;
  // A segment meeting both blocks ends after the later of their starts, so
  // the walk starts at the segment holding that position.
  const int64_t q_end = p.q_start + p.q_len, k_end = p.k_start + p.k_len;
  const int64_t lo = p.q_start > p.k_start ? p.q_start : p.k_start;
  const int64_t hi = q_end < k_end ? q_end : k_end;
  for (SegmentWalk walk(p.docs, w, lo); walk.segment().start < hi; walk.next())
    work.segments.push_back(walk.segment());
  if (work.segments.empty()) return work;

  for (int64_t h = 0; h < p.heads; ++h) {
    if (p.set_rank(h, i, r) != 0) continue;
    HeadSet set{p.kv_head(h), p.offset(h, r), {}};
    for (int64_t g = h; g < p.kv_group_end(h); ++g) {
      if (!p.shares_keys(g, h, i, r)) continue;
      if (set.heads.size() == max_set_heads) {
        work.head_sets.push_back(set);
        set.heads.clear();
      }
      set.heads.push_back(g);
    }
    work.head_sets.push_back(set);
  }

  // Group small segments so a task holds a few hundred active rows per head.
  constexpr int64_t kTaskRows = 256;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (size_t set = 0; set < work.head_sets.size(); ++set) {
      size_t begin = 0;
      int64_t rows = 0;
      for (size_t s = 0; s < work.segments.size(); ++s) {
        rows += ceil_div(work.segments[s].end - work.segments[s].start, r);
        if (rows >= kTaskRows || s + 1 == work.segments.size()) {
          work.tasks.push_back({b, set, begin, s + 1});
          begin = s + 1;
          rows = 0;
        }
      }
    }
  }
  return work;
}

inline SegmentRuns segment_runs(const BlockParams& p, const BranchWork& work, size_t s,
                                int64_t offset) {
  return ring_attention::segment_runs(work.segments[s], work.r, offset, p.q_start,
                                      p.q_start + p.q_len, p.k_start, p.k_start + p.k_len, p.causal,
                                      p.window_left, p.window_right);
}

// Runs f(state, task) for each task of the branch on at::parallel_for's
// threads, each thread taking the next task not yet taken, the costliest
// first (head rows x keys of its segments), with its own state from
// make_state(). Tasks differ in cost (LongNet's r = 6 branch over 8 heads
// stacks heads 0 and 6, 1 and 7, and runs the others alone), and a static
// split of the task list left one thread idle for a quarter of such a branch.
// Which thread runs a task does not change its result.
template <typename MakeState, typename F>
void for_each_task(const BlockParams& p, const BranchWork& work, MakeState make_state, F f) {
  const int64_t n = static_cast<int64_t>(work.tasks.size());
  std::vector<int64_t> cost(n, 0), order(n);
  for (int64_t t = 0; t < n; ++t) {
    const SegmentTask& task = work.tasks[t];
    const HeadSet& set = work.head_sets[task.head_set];
    for (size_t s = task.seg_begin; s < task.seg_end; ++s) {
      const SegmentRuns runs = segment_runs(p, work, s, set.offset);
      cost[t] += static_cast<int64_t>(set.heads.size()) * runs.q.count * runs.k.count;
    }
  }
  std::iota(order.begin(), order.end(), int64_t(0));
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t k = next.fetch_add(1); k < n; k = next.fetch_add(1))
      f(state, work.tasks[order[k]]);
  });
}

// Rows [begin, end) of a run (positions first + r*n, n < count) that lie in
// [lo, hi] (a window's band).
struct RowRange {
  int64_t begin, end;
};

inline RowRange rows_within(int64_t first, int64_t count, int64_t r, int64_t lo, int64_t hi) {
  const int64_t begin = lo <= first ? 0 : ceil_div(lo - first, r);
  const int64_t end = hi < first ? 0 : std::min(count, (hi - first) / r + 1);
  return {std::min(begin, count), end};
}

// The keys (first + r*n, n < nk) in the bands of the queries t0 .. t_last.
inline RowRange band_keys(const BlockParams& p, int64_t first, int64_t r, int64_t t0,
                          int64_t t_last, int64_t nk) {
  return rows_within(first, nk, r, p.band_first(t0), p.band_last(t_last));
}

// Scores of query t against a key tile (positions u0 + r*j, j < tk) set to
// -inf outside t's window.
template <typename T>
inline void mask_band(T* srow, int64_t tk, const BlockParams& p, int64_t t, int64_t u0, int64_t r) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const RowRange in = rows_within(u0, tk, r, p.band_first(t), p.band_last(t));
  std::fill(srow, srow + std::max<int64_t>(in.begin, 0), neg_inf);
  std::fill(srow + std::max(in.begin, in.end), srow + tk, neg_inf);
}

}  // namespace ring_attention::cpu
