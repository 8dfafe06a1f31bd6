// Entry points of the block operators for one backend: the operator's
// arguments are checked once into a BlockCall (checks.h), which the backend's
// kernel receives. Registered for CPU (ops.cpp), CUDA (cuda/registration.cu)
// and the test suite's CUDA emulator.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "checks.h"

namespace ring_attention {

using BlockKernel = void (*)(const BlockCall&);

template <BlockKernel Kernel>
void block_forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      at::Tensor& out, at::Tensor& lse, int64_t q_start, int64_t k_start,
                      at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool causal,
                      double scale, bool head_groups, bool grouped_offsets,
                      const std::optional<at::Tensor>& key_padding_mask,
                      const std::optional<at::Tensor>& cu_seqlens) {
  const PatternArgs pattern{segment_lengths, dilation_rates,  causal,           scale,
                            head_groups,     grouped_offsets, key_padding_mask, cu_seqlens};
  Kernel(forward_call(q, k, v, out, lse, q_start, k_start, pattern));
}

template <BlockKernel Kernel>
void block_backward_op(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                       const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& out, const at::Tensor& lse,
                       const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                       const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                       at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool causal,
                       double scale, bool head_groups, bool grouped_offsets,
                       const std::optional<at::Tensor>& key_padding_mask,
                       const std::optional<at::Tensor>& cu_seqlens) {
  const PatternArgs pattern{segment_lengths, dilation_rates,  causal,           scale,
                            head_groups,     grouped_offsets, key_padding_mask, cu_seqlens};
  Kernel(
      backward_call(grad_out, grad_lse, q, k, v, out, lse, dq, dk, dv, q_start, k_start, pattern));
}

}  // namespace ring_attention
