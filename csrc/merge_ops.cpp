// Registration of the merge operators (merge.h): schemas, CPU and Meta
// kernels; the CUDA kernel (cuda/merge.cu) registers in cuda/registration.cpp.
#include <torch/library.h>

#include "merge.h"

namespace ring_attention {
namespace {

void merge_branches_meta(const at::Tensor& parts, const at::Tensor& part_lse,
                         const at::Tensor& index, at::Tensor& out, at::Tensor& lse,
                         bool first_in_out) {
  check_merge(parts, part_lse, index, out, lse, first_in_out);
}

void sum_branches_meta(const at::Tensor& parts, const at::Tensor& index, at::Tensor& out) {
  check_merge(parts, std::nullopt, index, out, std::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ring_attention, m) {
  m.def(schema::kMergeBranches);
  m.def(schema::kSumBranches);
}

TORCH_LIBRARY_IMPL(ring_attention, CPU, m) {
  m.impl("merge_branches", &merge_branches_op<cpu::merge_rows>);
  m.impl("sum_branches", &sum_branches_op<cpu::merge_rows>);
}

TORCH_LIBRARY_IMPL(ring_attention, Meta, m) {
  m.impl("merge_branches", &merge_branches_meta);
  m.impl("sum_branches", &sum_branches_meta);
}

}  // namespace ring_attention
