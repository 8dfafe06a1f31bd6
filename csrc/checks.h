// Argument checks of the operators, and the one place where a block call's
// arguments become its BlockParams. The Python layer checks first with
// friendlier messages; these keep direct op calls safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "params.h"

namespace ring_attention {

// The pattern arguments every operator shares (RA_PATTERN_ARGS in schemas.h).
struct PatternArgs {
  at::IntArrayRef segment_lengths, dilation_rates;
  bool causal;
  double scale;
  bool head_groups, grouped_offsets;
  const std::optional<at::Tensor>& key_padding_mask;
  const std::optional<at::Tensor>& cu_seqlens;
};

// Accumulator dtype: float64 for float64 inputs, float32 otherwise.
at::ScalarType acc_dtype(at::ScalarType input);

// Shape of the log-sum-exp of queries q (batch, seq, heads, dim): (batch, heads, seq).
std::vector<c10::SymInt> lse_sizes(const at::Tensor& q);

// Segment lengths or dilation rates clamped to `cap` (branch_cap in
// pattern.h): the same attention, sizes that cannot overflow.
std::vector<int64_t> clamped_branches(at::IntArrayRef values, int64_t cap);

void check_pattern(at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates);

// cu_seqlens: a 1-D integer tensor on `device`. Its values are checked only
// on the CPU (reading them on a GPU would wait for it): [0, ..., total],
// non-decreasing, total >= min_total (== min_total when exact).
void check_cu_seqlens(const at::Tensor& cu_seqlens, c10::Device device, int64_t min_total,
                      bool exact);

// Shape, dtype and device checks of the local operator (q, k, v of one
// sequence length; on symbolic sizes).
void check_local_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const PatternArgs& pattern);

// Shape, dtype and device checks of the block operators (on symbolic sizes:
// the Meta kernels use them as they are). k and v have kv_heads heads, a
// divisor of q's heads.
void check_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const at::Tensor& lse, int64_t q_start,
                         int64_t k_start, const PatternArgs& pattern);

// grad_lse, dq, dk, dv are optional (a gradient not asked for is not
// computed); dk and dv come together.
void check_block_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                          const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse,
                          const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                          const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                          const PatternArgs& pattern);

// A checked block call: its params and the contiguous tensors their
// pointers point into (kept alive by this struct).
struct BlockCall {
  BlockParams params;
  std::vector<int64_t> segment_lengths, dilation_rates;
  at::ScalarType dtype;  // of q, k, v
  at::Device device;
  at::Tensor q, k, v, key_padding_mask, cu_seqlens, grad_out, grad_lse, out, lse;
};

BlockCall forward_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& out, at::Tensor& lse, int64_t q_start, int64_t k_start,
                       const PatternArgs& pattern);

BlockCall backward_call(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out, const at::Tensor& lse,
                        const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                        const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                        const PatternArgs& pattern);

}  // namespace ring_attention
