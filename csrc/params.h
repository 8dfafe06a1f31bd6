// The parameters of one block call (block_forward or block_backward), checked
// once (csrc/checks.cpp) and then read by every kernel, CPU and CUDA alike.
// Plain data: a CUDA kernel takes it by value.
#pragma once

#include <cstdint>

#include "pattern.h"

namespace ring_attention {

// Element offsets of the rows of a run (rows i = 0, 1, ... of one head, r
// positions apart) from its first row: i * stride, or through a row map
// (map: the run's first entry; step entries between its rows; unit elements
// a row).
// A kernel that knows at compile time whether there is a map (MAPPED) reads
// it with at<MAPPED> and from<MAPPED>: the strided form then carries only
// the stride.
struct RunRows {
  int64_t stride;
  const int32_t* map;  // nullptr: no map
  int64_t step, unit;
  RA_HOST_DEVICE int64_t operator()(int64_t i) const {
    return map == nullptr ? at<false>(i) : at<true>(i);
  }
  template <bool MAPPED>
  RA_HOST_DEVICE int64_t at(int64_t i) const {
    if constexpr (MAPPED) return static_cast<int64_t>(map[i * step] - map[0]) * unit;
    return i * stride;
  }
  // The run from its row n on.
  template <bool MAPPED>
  RA_HOST_DEVICE RunRows from(int64_t n) const {
    if constexpr (MAPPED) return {0, map + n * step, step, unit};
    return *this;
  }
};

struct BlockParams {
  // Inputs, contiguous, dtype of q: q (B, Lq, H, D), k and v (B, Lk, KVH, D),
  // or, with a row map, packed: k and v (B, k_count, D), and key (pos, kvh)
  // in row k_rows[(pos - k_start) * kv_heads + kvh] (-1: a row no query of
  // the block reaches, never read); dk and dv then have k's shape too.
  const void *q, *k, *v;
  const int32_t* k_rows;         // (Lk, KVH) int32, or nullptr: no row map
  int64_t k_count;               // rows per batch element of packed k and v
  const bool* key_padding_mask;  // (B, Lk), true = ignore that key; or nullptr
  Documents docs;                // global boundaries, int64, on the kernels' device

  // Forward: the running accumulators out (B, Lq, H, D) and lse (B, H, Lq),
  // in the accumulator dtype (float64 for float64 inputs, else float32).
  void *out, *lse;

  // Backward: grad_out and out (B, Lq, H, D) in q's dtype, the final lse and
  // the gradient of lse (B, H, Lq, accumulator dtype; nullptr: zero); the
  // gradient accumulators (accumulator dtype, dk and dv of k's shape) or
  // nullptr when not asked for (dk and dv come together).
  const void *grad_out, *out_in, *lse_in, *grad_lse;
  void *dq, *dk, *dv;

  int64_t batch, heads, kv_heads, head_dim;
  // The query heads the call holds among all heads: local head h is global
  // head head_start + h of total_heads (its offsets and head group are the
  // global head's), reading global K/V head (head_start + h) / kv_group; the
  // call's K/V heads are those from global head head_start / kv_group on. A
  // call holding every head has head_start 0 and total_heads == heads.
  int64_t head_start, total_heads, kv_group;
  int64_t q_start, q_len, k_start, k_len;  // global positions of the blocks
  int64_t n_branches;
  double scale;
  bool causal, head_groups, grouped_offsets;
  // The sliding window of this block (set_window): query t reaches only keys
  // in [t - window_left, t + window_right], both >= 0 and at most the block's
  // largest distances (so no bound overflows; window_right is 0 when causal).
  // windowed: the window excludes some pair of the block; else the bounds
  // exclude nothing and the kernels skip them.
  int64_t window_left, window_right;
  bool windowed;

  // Keys u reached by a query t within the window: band_first(t) <= u <= band_last(t).
  RA_HOST_DEVICE int64_t band_first(int64_t t) const { return t - window_left; }
  RA_HOST_DEVICE int64_t band_last(int64_t t) const { return t + window_right; }

  // Local query head h reads local K/V head kv_head(h); the local query
  // heads reading it are [kv_group_begin(h), kv_group_end(h)).
  RA_HOST_DEVICE int64_t kv_head(int64_t h) const {
    return (head_start + h) / kv_group - head_start / kv_group;
  }
  RA_HOST_DEVICE int64_t kv_group_begin(int64_t h) const {
    const int64_t first = (head_start + h) / kv_group * kv_group - head_start;
    return first > 0 ? first : 0;
  }
  RA_HOST_DEVICE int64_t kv_group_end(int64_t h) const {
    const int64_t end = ((head_start + h) / kv_group + 1) * kv_group - head_start;
    return end < heads ? end : heads;
  }
  RA_HOST_DEVICE int64_t offset(int64_t h, int64_t r) const {
    return head_offset(head_start + h, r, total_heads, grouped_offsets);
  }
  RA_HOST_DEVICE bool applies(int64_t h, int64_t branch) const {
    return branch_applies(head_start + h, branch, total_heads, n_branches, head_groups);
  }
  // The local heads [begin, end) that branch applies to (head_groups: its
  // group's global heads that the call holds; else every head).
  RA_HOST_DEVICE int64_t branch_heads_begin(int64_t branch) const {
    return local_head(head_groups ? head_group_begin(branch, total_heads, n_branches) : 0);
  }
  RA_HOST_DEVICE int64_t branch_heads_end(int64_t branch) const {
    return head_groups ? local_head(head_group_begin(branch + 1, total_heads, n_branches)) : heads;
  }
  // Global head g as a local index, clamped to [0, heads].
  RA_HOST_DEVICE int64_t local_head(int64_t g) const {
    const int64_t h = g - head_start;
    return h < 0 ? 0 : h > heads ? heads : h;
  }
  // Query head h reads the same key rows as head `leader` in branch (branch,
  // r): same K/V head, same offset, and the branch applies to both.
  RA_HOST_DEVICE bool shares_keys(int64_t h, int64_t leader, int64_t branch, int64_t r) const {
    return kv_head(h) == kv_head(leader) && offset(h, r) == offset(leader, r) &&
           applies(h, branch) && applies(leader, branch);
  }
  // Position of h among the query heads that share its key rows (0: the
  // first of its key-sharing set), or -1 when the branch does not apply to h.
  RA_HOST_DEVICE int64_t set_rank(int64_t h, int64_t branch, int64_t r) const {
    if (!applies(h, branch)) return -1;
    int64_t rank = 0;
    for (int64_t g = kv_group_begin(h); g < h; ++g) rank += shares_keys(g, h, branch, r) ? 1 : 0;
    return rank;
  }

  // Element offset of (batch b, global position pos, head h) in a query-block
  // tensor, of (b, pos, K/V head kvh) in a key-block tensor.
  RA_HOST_DEVICE int64_t q_index(int64_t b, int64_t pos, int64_t h) const {
    return ((b * q_len + (pos - q_start)) * heads + h) * head_dim;
  }
  // (k_index_as<MAPPED>: for a caller that knows whether k_rows is set.)
  RA_HOST_DEVICE int64_t k_index(int64_t b, int64_t pos, int64_t kvh) const {
    return k_rows != nullptr ? k_index_as<true>(b, pos, kvh) : k_index_as<false>(b, pos, kvh);
  }
  template <bool MAPPED>
  RA_HOST_DEVICE int64_t k_index_as(int64_t b, int64_t pos, int64_t kvh) const {
    const int64_t row = (pos - k_start) * kv_heads + kvh;
    if constexpr (MAPPED) return (b * k_count + k_rows[row]) * head_dim;
    return (b * k_len * kv_heads + row) * head_dim;
  }
  // Elements between the active rows r positions apart of one head. Where
  // r * row overflows (r, clamped, reaches 2**62 past the block), r exceeds
  // the block's length and a run holds one row: any stride serves, so the
  // block's length stands in for r.
  RA_HOST_DEVICE int64_t q_stride(int64_t r) const { return stride(r, q_len, heads * head_dim); }
  RA_HOST_DEVICE int64_t k_stride(int64_t r) const { return stride(r, k_len, kv_heads * head_dim); }
  RA_HOST_DEVICE static int64_t stride(int64_t r, int64_t len, int64_t row) {
    return row == 0 || r <= INT64_MAX / row ? r * row : len * row;
  }
  // The rows of the queries (head h) and keys (K/V head kvh) from position
  // pos on, r positions apart, relative to q_index / k_index of the first.
  RA_HOST_DEVICE RunRows q_run(int64_t r) const { return {q_stride(r), nullptr, 0, 0}; }
  RA_HOST_DEVICE RunRows k_run(int64_t pos, int64_t kvh, int64_t r) const {
    return k_rows != nullptr ? k_run_as<true>(pos, kvh, r) : k_run_as<false>(pos, kvh, r);
  }
  template <bool MAPPED>
  RA_HOST_DEVICE RunRows k_run_as(int64_t pos, int64_t kvh, int64_t r) const {
    if constexpr (MAPPED)
      return {0, k_rows + (pos - k_start) * kv_heads + kvh, stride(r, k_len, kv_heads), head_dim};
    return {k_stride(r), nullptr, 0, 0};
  }
  // Elements between the rows of the n active keys u0, u0 + r, ... of K/V
  // head kvh: k_stride(r) without a row map; with one, the rows' spacing
  // where the map spaces them evenly (a periodic pattern: nearly always),
  // else -1 (the caller gathers them by k_index).
  RA_HOST_DEVICE int64_t k_run_stride(int64_t u0, int64_t kvh, int64_t r, int64_t n) const {
    if (k_rows == nullptr) return k_stride(r);
    if (n <= 1) return head_dim;
    const int32_t* m = k_rows + (u0 - k_start) * kv_heads + kvh;
    const int64_t step = r * kv_heads, first = m[0], gap = m[step] - first;
    for (int64_t i = 2; i < n; ++i)
      if (m[i * step] != first + i * gap) return -1;
    return gap * head_dim;
  }
  // Index of (b, h, pos) in a (B, H, Lq) tensor (lse, delta, grad_lse).
  RA_HOST_DEVICE int64_t row_index(int64_t b, int64_t h, int64_t pos) const {
    return (b * heads + h) * q_len + (pos - q_start);
  }
};

// The window (left, right; -1: unbounded) of a block whose positions and
// causal flag p holds, as BlockParams keeps it.
inline void set_window(BlockParams& p, int64_t left, int64_t right) {
  const Window window = block_window(left, right, p.q_start, p.q_start + p.q_len, p.k_start,
                                     p.k_start + p.k_len, p.causal);
  p.window_left = window.left;
  p.window_right = window.right;
  p.windowed = window.restricts;
}

}  // namespace ring_attention
