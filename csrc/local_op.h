// The local (single-process) operator dilated_attention and its backward: the
// whole sequence is one query block and one key block, checked once and run
// by a backend's block kernel in chunks of rows (no re-checking per chunk);
// and their Meta kernels. Their autograd is Python's (ring_attention/ops.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "block_call.h"

namespace ring_attention {

std::tuple<at::Tensor, at::Tensor> dilated_attention_local(BlockKernel forward, const at::Tensor& q,
                                                           const at::Tensor& k, const at::Tensor& v,
                                                           const PatternArgs& pattern,
                                                           const RowArgs& rows);

std::tuple<at::Tensor, at::Tensor, at::Tensor> dilated_attention_backward_local(
    BlockKernel backward, const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const PatternArgs& pattern, const RowArgs& rows);

std::tuple<at::Tensor, at::Tensor> dilated_attention_meta(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, RA_PATTERN_PARAMS,
                                                          RA_ROWS_PARAMS);

std::tuple<at::Tensor, at::Tensor, at::Tensor> dilated_attention_backward_meta(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    RA_PATTERN_PARAMS, RA_ROWS_PARAMS);

}  // namespace ring_attention
