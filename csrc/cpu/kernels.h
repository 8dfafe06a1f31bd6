// CPU kernels of the block operators (registered in csrc/ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace ring_attention::cpu {

void block_forward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& out, at::Tensor& lse, int64_t q_start, int64_t k_start,
                       at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool causal,
                       double scale, bool head_groups,
                       const std::optional<at::Tensor>& key_padding_mask);

void block_backward_cpu(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                        const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                        const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                        at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates,
                        bool causal, double scale, bool head_groups,
                        const std::optional<at::Tensor>& key_padding_mask);

}  // namespace ring_attention::cpu
