// The CUDA kernels of the operator library (CUDA builds only; the schemas and
// the other backends are in ops.cpp). Host code only, so a .cpp: compiled by
// the C++ compiler, nvcc's device passes never parse torch/library.h.
#include <torch/library.h>

#include "../block_ops.h"
#include "../merge.h"
#include "kernels.h"

namespace ring_attention {

TORCH_LIBRARY_IMPL(ring_attention, CUDA, m) {
  m.impl("block_forward", &block_forward_op<gpu::block_forward>);
  m.impl("block_backward", &block_backward_op<gpu::block_backward>);
  m.impl("dilated_attention", &local_forward_op<gpu::block_forward>);
  m.impl("dilated_attention_backward", &local_backward_op<gpu::block_backward>);
  m.impl("merge_branches", &merge_branches_op<gpu::merge_rows>);
  m.impl("sum_branches", &sum_branches_op<gpu::merge_rows>);
}

}  // namespace ring_attention
