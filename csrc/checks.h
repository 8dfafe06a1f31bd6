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
  bool head_groups;
  const std::optional<at::Tensor>& key_padding_mask;
};

// Accumulator dtype: float64 for float64 inputs, float32 otherwise.
at::ScalarType acc_dtype(at::ScalarType input);

// Shape of the log-sum-exp of queries q (batch, seq, heads, dim): (batch, heads, seq).
std::vector<c10::SymInt> lse_sizes(const at::Tensor& q);

void check_pattern(at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates);

// Shape, dtype and device checks of the block operators (on symbolic sizes:
// the Meta kernels use them as they are).
void check_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const at::Tensor& lse, int64_t q_start,
                         int64_t k_start, const PatternArgs& pattern);

// dq, dk, dv are optional (a gradient not asked for is not computed); dk and
// dv come together.
void check_block_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
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
  at::Tensor q, k, v, key_padding_mask, grad_out, out, lse;
};

BlockCall forward_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& out, at::Tensor& lse, int64_t q_start, int64_t k_start,
                       const PatternArgs& pattern);

BlockCall backward_call(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                        const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                        const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                        const PatternArgs& pattern);

}  // namespace ring_attention
