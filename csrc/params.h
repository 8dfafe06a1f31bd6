// The parameters of one block call (block_forward or block_backward), checked
// once (csrc/checks.cpp) and then read by every kernel, CPU and CUDA alike.
// Plain data: a CUDA kernel takes it by value.
#pragma once

#include <cstdint>

#include "pattern.h"

namespace ring_attention {

struct BlockParams {
  // Inputs, contiguous, dtype of q: q (B, Lq, H, D), k and v (B, Lk, H, D).
  const void *q, *k, *v;
  const bool* key_padding_mask;  // (B, Lk), true = ignore that key; or nullptr

  // Forward: the running accumulators out (B, Lq, H, D) and lse (B, H, Lq),
  // in the accumulator dtype (float64 for float64 inputs, else float32).
  void *out, *lse;

  // Backward: grad_out and out (B, Lq, H, D) in q's dtype, the final lse; the
  // gradient accumulators (accumulator dtype) or nullptr when not asked for
  // (dk and dv come together).
  const void *grad_out, *out_in, *lse_in;
  void *dq, *dk, *dv;

  int64_t batch, heads, head_dim;
  int64_t q_start, q_len, k_start, k_len;  // global positions of the blocks
  int64_t n_branches;
  double scale;
  bool causal, head_groups;

  RA_HOST_DEVICE bool applies(int64_t h, int64_t branch) const {
    return branch_applies(h, branch, heads, n_branches, head_groups);
  }
  // Element offset of (batch b, global position pos, head h) in a query-block
  // / key-block tensor.
  RA_HOST_DEVICE int64_t q_index(int64_t b, int64_t pos, int64_t h) const {
    return ((b * q_len + (pos - q_start)) * heads + h) * head_dim;
  }
  RA_HOST_DEVICE int64_t k_index(int64_t b, int64_t pos, int64_t h) const {
    return ((b * k_len + (pos - k_start)) * heads + h) * head_dim;
  }
  // Index of (b, h, pos) in a (B, H, Lq) tensor (lse, delta).
  RA_HOST_DEVICE int64_t row_index(int64_t b, int64_t h, int64_t pos) const {
    return (b * heads + h) * q_len + (pos - q_start);
  }
};

}  // namespace ring_attention
