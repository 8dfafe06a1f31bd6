// The CUDA kernels of the operator library (CUDA builds only; the schemas and
// the other backends are in ops.cpp).
#include <torch/library.h>

#include "../block_ops.h"
#include "../local_op.h"
#include "kernels.h"

namespace ring_attention {

TORCH_LIBRARY_IMPL(ring_attention, CUDA, m) {
  m.impl("block_forward", &block_forward_op<gpu::block_forward>);
  m.impl("block_backward", &block_backward_op<gpu::block_backward>);
  m.impl("dilated_attention", &dilated_attention_local);
  m.impl("dilated_attention_backward", &dilated_attention_backward_local);
}

}  // namespace ring_attention
