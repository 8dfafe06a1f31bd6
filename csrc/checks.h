// Argument checks of the operators (flash-attention's order: checks ->
// params -> kernels; block_call.h makes the params). Each operator checks its
// flat schema arguments once at its entry; below that, the checked values
// travel as a CheckedPattern and a BlockCall, never re-checked (the local op
// chunks one checked call). The Python layer checks first with friendlier
// messages; these keep direct operator calls safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "params.h"

namespace ring_attention {

// The pattern arguments every attention operator shares (RA_PATTERN_ARGS in
// schemas.h), as the operator receives them.
struct PatternArgs {
  at::IntArrayRef segment_lengths, dilation_rates;
  bool causal;
  double scale;
  bool head_groups, grouped_offsets;
  const std::optional<at::Tensor>& key_padding_mask;
  const std::optional<at::Tensor>& cu_seqlens;
  int64_t window_left, window_right;  // -1: unbounded on that side
  // The call's heads among all heads (params.h): its first query head's
  // global index, and the global query and K/V head counts (0: the call's
  // own, head_start 0).
  int64_t head_start, total_heads, total_kv_heads;
};

// The C++ parameters of RA_PATTERN_ARGS in schema order, and the PatternArgs
// made of them: an operator's signature ends with RA_PATTERN_PARAMS and its
// body reads RA_PATTERN_ARGS_OF (a new pattern argument is added here, in the
// schema text and in PatternArgs, nowhere else).
// clang-format off
#define RA_PATTERN_PARAMS                                                                       \
  at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool causal, double scale,   \
  bool head_groups, bool grouped_offsets, const std::optional<at::Tensor>& key_padding_mask,    \
  const std::optional<at::Tensor>& cu_seqlens, int64_t window_left, int64_t window_right,      \
  int64_t head_start, int64_t total_heads, int64_t total_kv_heads
#define RA_PATTERN_ARGS_OF                                                                      \
  ::ring_attention::PatternArgs{segment_lengths, dilation_rates, causal, scale, head_groups,     \
                                grouped_offsets, key_padding_mask, cu_seqlens, window_left,      \
                                window_right, head_start, total_heads, total_kv_heads}
// clang-format on

// Accumulator dtype: float64 for float64 inputs, float32 otherwise.
at::ScalarType acc_dtype(at::ScalarType input);

// Shape of the log-sum-exp of queries q (batch, seq, heads, dim): (batch, heads, seq).
std::vector<c10::SymInt> lse_sizes(const at::Tensor& q);

// Segment lengths or dilation rates clamped to `cap` (branch_cap in
// pattern.h): the same attention, sizes that cannot overflow.
std::vector<int64_t> clamped_branches(at::IntArrayRef values, int64_t cap);

void check_pattern(at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates);

// window_left, window_right: each >= -1 (-1: unbounded).
void check_window(int64_t window_left, int64_t window_right);

// The local op's rows (RA_ROWS_ARGS in schemas.h): queries at [q_start,
// q_start + Lq), or batch row b's from q_starts[b] on (int64 (batch,), read
// on the host), keys at [k_start, k_start + Lk).
struct RowArgs {
  int64_t q_start, k_start;
  const std::optional<at::Tensor>& q_starts;
  // Whether the call is one sequence attending to itself (no rows given).
  bool whole() const { return q_start == 0 && k_start == 0 && !q_starts.has_value(); }
};
#define RA_ROWS_PARAMS int64_t q_start, int64_t k_start, const std::optional<at::Tensor>&q_starts
#define RA_ROWS_ARGS_OF \
  ::ring_attention::RowArgs { q_start, k_start, q_starts }

// The call's heads: every head (total_heads 0: heads % kv_heads == 0), or
// query heads [head_start, head_start + heads) of total_heads and exactly the
// K/V heads they read (params.h).
void check_heads(const c10::SymInt& heads, const c10::SymInt& kv_heads, const PatternArgs& pattern);

// Shape, dtype and device checks of the local operator (on symbolic sizes:
// the Meta kernels use them as they are). Without rows, q, k and v have one
// sequence length.
void check_local_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const PatternArgs& pattern, const RowArgs& rows);

// The backward's own tensors: grad_out of q's shape (any floating dtype: it
// is cast to q's), out of q's shape and dtype, lse and grad_lse (optional)
// of lse_sizes(q) in the accumulator dtype.
void check_local_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                          const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse);

// Shape, dtype and device checks of the block operators (on symbolic sizes).
// k and v have kv_heads heads, a divisor of q's heads; or, with a row map
// k_rows (Lk, kv_heads) int32 on q's device, k and v are packed rows
// (B, n, D) and the map's values (checked on the CPU) lie in [-1, n).
void check_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const at::Tensor& lse, int64_t q_start,
                         int64_t k_start, const PatternArgs& pattern,
                         const std::optional<at::Tensor>& k_rows);

// grad_lse, dq, dk, dv are optional (a gradient not asked for is not
// computed); dk and dv come together.
void check_block_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                          const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse,
                          const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                          const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                          const PatternArgs& pattern, const std::optional<at::Tensor>& k_rows);

// The pattern of a call after its checks: what every block of the call
// shares. Built once per operator call (checked_pattern); the local op's
// chunks and the kernels take it as it is.
struct CheckedPattern {
  std::vector<int64_t> segment_lengths, dilation_rates;  // clamped to branch_cap
  double scale;
  bool causal, head_groups, grouped_offsets;
  int64_t window_left, window_right;          // -1: unbounded
  int64_t head_start, total_heads, kv_group;  // BlockParams' head range
  // int64, contiguous, on the inputs' device (checked_documents); undefined:
  // no documents.
  at::Tensor cu_seqlens;
};

// The values of a call's pattern arguments, checked for blocks that end at
// or before `extent` (the sequence length, exactly, for the local op on one
// sequence: then cu_seqlens must end there), for q's device and heads and
// the call's kv_heads. The shapes must have been checked (check_local_op,
// check_block_*).
CheckedPattern checked_pattern(const PatternArgs& pattern, const at::Tensor& q, int64_t kv_heads,
                               int64_t extent, bool exact);

// cu_seqlens, a 1-D integer tensor on `device`, as an int64 contiguous
// tensor. Its values are checked only on the CPU (reading them on a GPU would
// wait for it): [0, ..., total], non-decreasing, total >= min_total
// (== min_total when exact). The last tensor checked on a thread is
// remembered with its version: the ring's steps and the planner's many calls
// with one documents tensor read its values once.
at::Tensor checked_documents(const at::Tensor& cu_seqlens, c10::Device device, int64_t min_total,
                             bool exact);

// A block operator's pattern, checked for its blocks: queries q at q_start
// and keys k (or k_rows' rows) at k_start, which end at the later of the two
// blocks' ends (checked_pattern, not exact). The shapes must have been
// checked (check_block_forward, check_block_backward).
CheckedPattern checked_block_pattern(const PatternArgs& pattern, const at::Tensor& q,
                                     const at::Tensor& k, int64_t q_start, int64_t k_start,
                                     const std::optional<at::Tensor>& k_rows);

}  // namespace ring_attention
