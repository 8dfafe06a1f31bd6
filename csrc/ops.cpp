// The operator library: schemas, and the CPU and Meta kernels. The CUDA
// kernels are registered in cuda/registration.cpp (CUDA builds only); the
// autograd of dilated_attention is Python's (ring_attention/ops.py).
#include <torch/library.h>

#include "block_ops.h"
#include "checks.h"
#include "cpu/kernels.h"
#include "local_op.h"
#include "plan.h"
#include "schemas.h"

namespace ring_attention {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Meta kernels of the block operators: the shape checks, on symbolic sizes.
void block_forward_meta(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                        int64_t q_start, int64_t k_start, RA_PATTERN_PARAMS,
                        const OptTensor& k_rows) {
  check_block_forward(q, k, v, out, lse, q_start, k_start, RA_PATTERN_ARGS_OF, k_rows);
}

void block_backward_meta(const Tensor& grad_out, const OptTensor& grad_lse, const Tensor& q,
                         const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                         const OptTensor& dq, const OptTensor& dk, const OptTensor& dv,
                         int64_t q_start, int64_t k_start, RA_PATTERN_PARAMS,
                         const OptTensor& k_rows) {
  check_block_backward(grad_out, grad_lse, q, k, v, out, lse, dq, dk, dv, q_start, k_start,
                       RA_PATTERN_ARGS_OF, k_rows);
}

}  // namespace

TORCH_LIBRARY(ring_attention, m) {
  m.def(schema::kBlockForward);
  m.def(schema::kBlockBackward);
  m.def(schema::kDilatedAttention);
  m.def(schema::kDilatedAttentionBackward);
  m.def(schema::kExchangeRows, &exchange_rows);
}

TORCH_LIBRARY_IMPL(ring_attention, CPU, m) {
  m.impl("block_forward", &block_forward_op<cpu::block_forward>);
  m.impl("block_backward", &block_backward_op<cpu::block_backward>);
  m.impl("dilated_attention", &local_forward_op<cpu::block_forward>);
  m.impl("dilated_attention_backward", &local_backward_op<cpu::block_backward>);
}

TORCH_LIBRARY_IMPL(ring_attention, Meta, m) {
  m.impl("block_forward", &block_forward_meta);
  m.impl("block_backward", &block_backward_meta);
  m.impl("dilated_attention", &dilated_attention_meta);
  m.impl("dilated_attention_backward", &dilated_attention_backward_meta);
}

}  // namespace ring_attention
