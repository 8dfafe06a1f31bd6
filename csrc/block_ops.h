// Entry points of the operators for one backend: the block operators check
// their arguments once into a BlockCall (block_call.h), which the backend's
// kernel receives; the local op checks once and chunks the backend's kernel
// (local_op.h). Registered for CPU (ops.cpp), CUDA (cuda/registration.cpp) and
// the test suite's CUDA emulator.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "block_call.h"
#include "local_op.h"

namespace ring_attention {

template <BlockKernel Kernel>
void block_forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      at::Tensor& out, at::Tensor& lse, int64_t q_start, int64_t k_start,
                      RA_PATTERN_PARAMS, const std::optional<at::Tensor>& k_rows) {
  Kernel(forward_call(q, k, v, out, lse, q_start, k_start, RA_PATTERN_ARGS_OF, k_rows));
}

template <BlockKernel Kernel>
void block_backward_op(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                       const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& out, const at::Tensor& lse,
                       const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                       const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                       RA_PATTERN_PARAMS, const std::optional<at::Tensor>& k_rows) {
  Kernel(backward_call(grad_out, grad_lse, q, k, v, out, lse, dq, dk, dv, q_start, k_start,
                       RA_PATTERN_ARGS_OF, k_rows));
}

template <BlockKernel Kernel>
std::tuple<at::Tensor, at::Tensor> local_forward_op(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, RA_PATTERN_PARAMS,
                                                    RA_ROWS_PARAMS) {
  return dilated_attention_local(Kernel, q, k, v, RA_PATTERN_ARGS_OF, RA_ROWS_ARGS_OF);
}

template <BlockKernel Kernel>
std::tuple<at::Tensor, at::Tensor, at::Tensor> local_backward_op(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    RA_PATTERN_PARAMS, RA_ROWS_PARAMS) {
  return dilated_attention_backward_local(Kernel, grad_out, grad_lse, q, k, v, out, lse,
                                          RA_PATTERN_ARGS_OF, RA_ROWS_ARGS_OF);
}

}  // namespace ring_attention
