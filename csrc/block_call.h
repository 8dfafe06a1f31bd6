// A checked call of a block kernel: the BlockParams the kernels read and the
// contiguous tensors their pointers point into. The one place where a call's
// checked arguments (checks.h) become params; the checks themselves live in
// checks.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "checks.h"
#include "params.h"

namespace ring_attention {

// A checked block call: its params and the contiguous tensors their
// pointers point into (kept alive by this struct).
struct BlockCall {
  BlockParams params;
  std::vector<int64_t> segment_lengths, dilation_rates;
  at::ScalarType dtype;  // of q, k, v
  at::Device device;
  at::Tensor q, k, v, key_padding_mask, cu_seqlens, grad_out, grad_lse, out, lse;
  at::Tensor k_rows;  // the row map, or undefined
};

// A backend's kernel of one block operator (csrc/cpu, csrc/cuda).
using BlockKernel = void (*)(const BlockCall&);

// The block call of queries q at q_start against keys k, v at k_start under
// a checked pattern, with its forward accumulators or its backward inputs and
// gradients (k_rows: the row map of packed k and v, or undefined). No
// checks: the caller has checked the operator's arguments.
BlockCall forward_block(const CheckedPattern& pattern, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& key_padding_mask, at::Tensor& out,
                        at::Tensor& lse, int64_t q_start, int64_t k_start,
                        const at::Tensor& k_rows = at::Tensor());

// Undefined tensors: no key padding mask, no grad_lse, a gradient not asked for.
BlockCall backward_block(const CheckedPattern& pattern, const at::Tensor& grad_out,
                         const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& key_padding_mask,
                         const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq,
                         const at::Tensor& dk, const at::Tensor& dv, int64_t q_start,
                         int64_t k_start, const at::Tensor& k_rows = at::Tensor());

// A block operator's call: its arguments checked (checks.h), then its block.
BlockCall forward_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& out, at::Tensor& lse, int64_t q_start, int64_t k_start,
                       const PatternArgs& pattern, const std::optional<at::Tensor>& k_rows);

BlockCall backward_call(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out, const at::Tensor& lse,
                        const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                        const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                        const PatternArgs& pattern, const std::optional<at::Tensor>& k_rows);

}  // namespace ring_attention
