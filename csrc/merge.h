// The merge operators of the per-branch dense path (ring_attention/branches.py):
// every dense call of a window writes its rows into one buffer of *parts*
// (its output and LSE in the forward, its dq / dk / dv in the backward), and
// one pass over the window's (batch, position, head) rows combines them:
//
//   merge_branches: the forward. For each row, the parts that `index` names
//     (one per slot; an entry outside [0, parts) names none) merge by their
//     log-sum-exp in fp32 (fp64 for fp64): m = max lse_s, w_s = exp(lse_s -
//     m), out = sum w_s part_s / sum w_s, lse = m + log(sum w_s); a row with
//     no part gets out = 0, lse = -inf; a NaN lse makes the row NaN. With
//     first_in_out, slot 0's part of a row is the row's own out (the call of
//     slot 0 wrote it there): its values are read from out, not from parts,
//     and its index names its LSE in part_lse only, so part_lse may have
//     more rows than parts (slot 0's part rows follow parts' rows). Each row
//     reads its out before writing it, both by the same thread.
//   sum_branches: the backward. out = sum of the parts `index` names,
//     accumulated in fp32 (fp64), 0 where it names none.
//
// Tensors: parts (P, D) contiguous; part_lse (P, or P' >= P with
// first_in_out) contiguous in the
// accumulation dtype; index int32 (S, B, W, H) contiguous; out (B, W, H, D)
// with stride(3) == 1 (a window of the op's output, any other strides); lse
// (B, W, H), any strides (a window of the op's (B, H, n) lse, transposed).
// Every row of out (and lse) is written.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace ring_attention {

namespace schema {
inline constexpr const char* kMergeBranches =
    "merge_branches(Tensor parts, Tensor part_lse, Tensor index, Tensor(a!) out, Tensor(b!) lse, "
    "bool first_in_out=False) -> ()";
inline constexpr const char* kSumBranches =
    "sum_branches(Tensor parts, Tensor index, Tensor(a!) out) -> ()";
}  // namespace schema

// A checked merge or sum: sizes, strides (elements) and pointers.
struct MergeCall {
  const void* parts = nullptr;
  const void* part_lse = nullptr;  // nullptr: a sum
  const int32_t* index = nullptr;
  void* out = nullptr;
  void* lse = nullptr;
  int64_t slots = 0, batch = 0, length = 0, heads = 0, dim = 0, part_rows = 0;
  int64_t lse_rows = 0;               // rows of part_lse (slot 0's bound with first_in_out)
  bool first_in_out = false;          // slot 0's values: the row's own out
  int64_t out_stride[3] = {0, 0, 0};  // batch, position, head
  int64_t lse_stride[3] = {0, 0, 0};
  at::ScalarType dtype = at::kFloat;  // of parts and out
  at::Device device = at::kCPU;
};

// Checks (messages name the argument) on symbolic sizes: the Meta kernels.
void check_merge(const at::Tensor& parts, const std::optional<at::Tensor>& part_lse,
                 const at::Tensor& index, const at::Tensor& out,
                 const std::optional<at::Tensor>& lse, bool first_in_out = false);

// Checks, then the call's pointers (part_lse and lse together or neither).
MergeCall merge_call(const at::Tensor& parts, const std::optional<at::Tensor>& part_lse,
                     const at::Tensor& index, at::Tensor& out, std::optional<at::Tensor> lse,
                     bool first_in_out = false);

using MergeKernel = void (*)(const MergeCall&);

namespace cpu {
void merge_rows(const MergeCall& call);
}
namespace gpu {
void merge_rows(const MergeCall& call);
}

template <MergeKernel Kernel>
void merge_branches_op(const at::Tensor& parts, const at::Tensor& part_lse, const at::Tensor& index,
                       at::Tensor& out, at::Tensor& lse, bool first_in_out) {
  Kernel(merge_call(parts, part_lse, index, out, lse, first_in_out));
}

template <MergeKernel Kernel>
void sum_branches_op(const at::Tensor& parts, const at::Tensor& index, at::Tensor& out) {
  Kernel(merge_call(parts, std::nullopt, index, out, std::nullopt));
}

}  // namespace ring_attention
