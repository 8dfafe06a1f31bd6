// Argument checks shared by the CPU, CUDA and Meta kernels. The Python layer
// checks first with friendlier messages; these keep direct op calls safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace ring_attention {

// Accumulator dtype: float64 for float64 inputs, float32 otherwise.
at::ScalarType acc_dtype(at::ScalarType input);

// Shape of the log-sum-exp of queries q (batch, seq, heads, dim): (batch, heads, seq).
std::vector<c10::SymInt> lse_sizes(const at::Tensor& q);

void check_pattern(at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates);

void check_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const at::Tensor& lse, int64_t q_start,
                         int64_t k_start, at::IntArrayRef segment_lengths,
                         at::IntArrayRef dilation_rates, bool head_groups,
                         const std::optional<at::Tensor>& key_padding_mask);

// dq, dk, dv are optional (a gradient not asked for is not computed); dk and
// dv come together.
void check_block_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                          const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                          const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                          at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates,
                          bool head_groups, const std::optional<at::Tensor>& key_padding_mask);

}  // namespace ring_attention
