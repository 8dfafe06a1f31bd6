// The local (single-process) operator dilated_attention and its backward,
// built from the block operators (so they run on any device those run on),
// their Meta kernels and the C++ autograd of dilated_attention.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace ring_attention {

std::tuple<at::Tensor, at::Tensor> dilated_attention_local(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef segment_lengths,
    at::IntArrayRef dilation_rates, bool causal, double scale, bool head_groups,
    bool grouped_offsets, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& cu_seqlens);

std::tuple<at::Tensor, at::Tensor, at::Tensor> dilated_attention_backward_local(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool causal, double scale,
    bool head_groups, bool grouped_offsets, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& cu_seqlens);

std::tuple<at::Tensor, at::Tensor> dilated_attention_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef segment_lengths,
    at::IntArrayRef dilation_rates, bool causal, double scale, bool head_groups,
    bool grouped_offsets, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& cu_seqlens);

std::tuple<at::Tensor, at::Tensor, at::Tensor> dilated_attention_backward_meta(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool causal, double scale,
    bool head_groups, bool grouped_offsets, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& cu_seqlens);

// Autograd kernel: (out, lse) differentiable in q, k, v; double backward
// raises.
std::tuple<at::Tensor, at::Tensor> dilated_attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef segment_lengths,
    at::IntArrayRef dilation_rates, bool causal, double scale, bool head_groups,
    bool grouped_offsets, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& cu_seqlens);

}  // namespace ring_attention
