// The parameters of one block call (block_forward or block_backward), checked
// once (csrc/checks.cpp) and then read by every kernel, CPU and CUDA alike.
// Plain data: a CUDA kernel takes it by value.
#pragma once

#include <cstdint>

#include "pattern.h"

namespace ring_attention {

struct BlockParams {
  // Inputs, contiguous, dtype of q: q (B, Lq, H, D), k and v (B, Lk, KVH, D).
  const void *q, *k, *v;
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
  int64_t q_start, q_len, k_start, k_len;  // global positions of the blocks
  int64_t n_branches;
  double scale;
  bool causal, head_groups, grouped_offsets;

  // Query head h reads K/V head h / (heads / kv_heads).
  RA_HOST_DEVICE int64_t kv_head(int64_t h) const { return h / (heads / kv_heads); }
  RA_HOST_DEVICE int64_t offset(int64_t h, int64_t r) const {
    return head_offset(h, r, heads, grouped_offsets);
  }
  RA_HOST_DEVICE bool applies(int64_t h, int64_t branch) const {
    return branch_applies(h, branch, heads, n_branches, head_groups);
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
    for (int64_t g = h / (heads / kv_heads) * (heads / kv_heads); g < h; ++g)
      rank += shares_keys(g, h, branch, r) ? 1 : 0;
    return rank;
  }

  // Element offset of (batch b, global position pos, head h) in a query-block
  // tensor, of (b, pos, K/V head kvh) in a key-block tensor.
  RA_HOST_DEVICE int64_t q_index(int64_t b, int64_t pos, int64_t h) const {
    return ((b * q_len + (pos - q_start)) * heads + h) * head_dim;
  }
  RA_HOST_DEVICE int64_t k_index(int64_t b, int64_t pos, int64_t kvh) const {
    return ((b * k_len + (pos - k_start)) * kv_heads + kvh) * head_dim;
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
  // Index of (b, h, pos) in a (B, H, Lq) tensor (lse, delta, grad_lse).
  RA_HOST_DEVICE int64_t row_index(int64_t b, int64_t h, int64_t pos) const {
    return (b * heads + h) * q_len + (pos - q_start);
  }
};

}  // namespace ring_attention
