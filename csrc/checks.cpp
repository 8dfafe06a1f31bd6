#include "checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace ring_attention {
namespace {

// Sizes are compared as SymInts so the Meta kernels work under dynamic shapes.
void check_same_geometry(const char* name, const at::Tensor& t, c10::SymIntArrayRef sizes,
                         at::ScalarType dtype, const at::Tensor& like) {
  TORCH_CHECK(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK(t.sym_sizes() == sizes, name, " must have shape ", sizes, ", got ", t.sym_sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == like.device(), name, " must be on ", like.device(), ", got ",
              t.device());
}

void check_cu_seqlens_type(const at::Tensor& cu, c10::Device device) {
  TORCH_CHECK(cu.dim() == 1, "cu_seqlens must be 1-D [0, end_1, ..., total], got ", cu.dim(), "-D");
  TORCH_CHECK(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong,
              "cu_seqlens must have dtype int32 or int64, got ", cu.scalar_type());
  TORCH_CHECK(cu.device() == device, "cu_seqlens must be on q's device ", device, ", got ",
              cu.device());
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_start,
               int64_t k_start, const PatternArgs& pattern) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined(),
              "q, k and v must be tensors, got None for ",
              !q.defined()   ? "q"
              : !k.defined() ? "k"
                             : "v");
  check_pattern(pattern.segment_lengths, pattern.dilation_rates);
  TORCH_CHECK(q.dim() == 4, "q must be 4-D (batch, seq, heads, head_dim), got ", q.dim(), "-D");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4,
              "k and v must be 4-D (batch, seq, kv_heads, head_dim), got ", k.dim(), "-D and ",
              v.dim(), "-D");
  TORCH_CHECK(k.sym_sizes() == v.sym_sizes(), "k and v must have the same shape, got ",
              k.sym_sizes(), " and ", v.sym_sizes());
  TORCH_CHECK(k.sym_size(0) == q.sym_size(0) && k.sym_size(3) == q.sym_size(3),
              "k must match q in batch and head_dim: q ", q.sym_sizes(), ", k ", k.sym_sizes());
  const c10::SymInt& heads = q.sym_size(2);
  const c10::SymInt& kv_heads = k.sym_size(2);
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0,
              "k and v must have kv_heads heads dividing q's heads (grouped K/V): q has ", heads,
              " heads, k has kv_heads = ", kv_heads);
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), "q must have a floating dtype, got ",
              q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k and v must have the same dtype, got ", q.scalar_type(), ", ", k.scalar_type(),
              ", ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "q, k and v must be on the same device");
  // Block starts at most 2**62 (and lengths, tensor sizes, far below): block
  // ends and the clamped branches (pattern.h) cannot overflow.
  constexpr int64_t kMaxStart = int64_t{1} << 62;
  TORCH_CHECK(q_start >= 0 && k_start >= 0 && q_start <= kMaxStart && k_start <= kMaxStart,
              "q_start and k_start must be in [0, 2**62], got ", q_start, " and ", k_start);
  const auto n_branches = static_cast<int64_t>(pattern.segment_lengths.size());
  TORCH_CHECK(!pattern.head_groups || heads >= n_branches,
              "head_groups needs at least as many heads as branches: ", heads, " heads, ",
              n_branches, " branches");
  if (pattern.key_padding_mask.has_value()) {
    check_same_geometry("key_padding_mask", *pattern.key_padding_mask,
                        {k.sym_size(0), k.sym_size(1)}, at::kBool, q);
  }
  if (pattern.cu_seqlens.has_value()) check_cu_seqlens_type(*pattern.cu_seqlens, q.device());
}

// The params every block call shares; the op-specific pointers stay null.
BlockCall make_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_start,
                    int64_t k_start, const PatternArgs& pattern) {
  const int64_t blocks_end = std::max(q_start + q.size(1), k_start + k.size(1));
  at::Tensor cu;
  if (pattern.cu_seqlens.has_value()) {
    check_cu_seqlens(*pattern.cu_seqlens, q.device(), blocks_end, false);
    cu = pattern.cu_seqlens->to(at::kLong).contiguous();
  }
  BlockCall call{
      BlockParams{},
      clamped_branches(pattern.segment_lengths, branch_cap(blocks_end, q.size(2))),
      clamped_branches(pattern.dilation_rates, branch_cap(blocks_end, q.size(2))),
      q.scalar_type(),
      q.device(),
      q.contiguous(),
      k.contiguous(),
      v.contiguous(),
      pattern.key_padding_mask.has_value() ? pattern.key_padding_mask->contiguous() : at::Tensor(),
      cu,
      {},  // grad_out, grad_lse, out, lse: set by backward_call
      {},
      {},
      {}};
  BlockParams& p = call.params;
  p.q = call.q.const_data_ptr();
  p.k = call.k.const_data_ptr();
  p.v = call.v.const_data_ptr();
  p.key_padding_mask =
      call.key_padding_mask.defined() ? call.key_padding_mask.const_data_ptr<bool>() : nullptr;
  p.docs = cu.defined() ? Documents{cu.const_data_ptr<int64_t>(), cu.numel() - 1}
                        : Documents{nullptr, 0};
  p.batch = q.size(0);
  p.heads = q.size(2);
  p.kv_heads = k.size(2);
  p.head_dim = q.size(3);
  p.q_start = q_start;
  p.q_len = q.size(1);
  p.k_start = k_start;
  p.k_len = k.size(1);
  p.n_branches = static_cast<int64_t>(pattern.segment_lengths.size());
  p.scale = pattern.scale;
  p.causal = pattern.causal;
  p.head_groups = pattern.head_groups;
  p.grouped_offsets = pattern.grouped_offsets;
  return call;
}

void* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->mutable_data_ptr() : nullptr;
}

}  // namespace

std::vector<int64_t> clamped_branches(at::IntArrayRef values, int64_t cap) {
  std::vector<int64_t> out(values.begin(), values.end());
  for (int64_t& x : out) x = std::min(x, cap);
  return out;
}

std::vector<c10::SymInt> lse_sizes(const at::Tensor& q) {
  return {q.sym_size(0), q.sym_size(2), q.sym_size(1)};
}

at::ScalarType acc_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

void check_pattern(at::IntArrayRef segs, at::IntArrayRef dils) {
  TORCH_CHECK(!segs.empty(), "segment_lengths must not be empty");
  TORCH_CHECK(segs.size() == dils.size(),
              "segment_lengths and dilation_rates must have the same length, got ", segs.size(),
              " and ", dils.size());
  for (size_t i = 0; i < segs.size(); ++i) {
    TORCH_CHECK(segs[i] >= 1, "segment_lengths[", i, "] must be >= 1, got ", segs[i]);
    TORCH_CHECK(dils[i] >= 1 && dils[i] <= segs[i], "dilation_rates[", i,
                "] must be in [1, segment_lengths[", i, "] = ", segs[i], "], got ", dils[i]);
  }
}

void check_cu_seqlens(const at::Tensor& cu, c10::Device device, int64_t min_total, bool exact) {
  check_cu_seqlens_type(cu, device);
  if (!cu.device().is_cpu()) return;
  TORCH_CHECK(cu.numel() >= 1, "cu_seqlens must not be empty: it starts with 0");
  const at::Tensor c = cu.to(at::kLong).contiguous();
  const int64_t* b = c.const_data_ptr<int64_t>();
  const int64_t n = c.numel();
  TORCH_CHECK(b[0] == 0, "cu_seqlens must start at 0, got ", b[0]);
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK(b[i] >= b[i - 1], "cu_seqlens must be non-decreasing, got cu_seqlens[", i - 1,
                "] = ", b[i - 1], " > cu_seqlens[", i, "] = ", b[i]);
  }
  if (exact) {
    TORCH_CHECK(b[n - 1] == min_total, "cu_seqlens must end at the sequence length ", min_total,
                ", got ", b[n - 1]);
  } else {
    TORCH_CHECK(b[n - 1] >= min_total, "cu_seqlens must end at or after the end of the blocks (",
                min_total, "), got ", b[n - 1]);
  }
}

void check_local_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const PatternArgs& pattern) {
  check_qkv(q, k, v, 0, 0, pattern);
  TORCH_CHECK(k.sym_size(1) == q.sym_size(1), "k and v must have q's sequence length (dim 1): q ",
              q.sym_sizes(), ", k ", k.sym_sizes());
}

void check_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const at::Tensor& lse, int64_t q_start,
                         int64_t k_start, const PatternArgs& pattern) {
  check_qkv(q, k, v, q_start, k_start, pattern);
  const at::ScalarType acc = acc_dtype(q.scalar_type());
  check_same_geometry("out", out, q.sym_sizes(), acc, q);
  check_same_geometry("lse", lse, lse_sizes(q), acc, q);
  TORCH_CHECK(out.is_contiguous() && lse.is_contiguous(), "out and lse must be contiguous");
}

void check_block_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                          const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse,
                          const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                          const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                          const PatternArgs& pattern) {
  check_qkv(q, k, v, q_start, k_start, pattern);
  const at::ScalarType acc = acc_dtype(q.scalar_type());
  check_same_geometry("grad_out", grad_out, q.sym_sizes(), q.scalar_type(), q);
  check_same_geometry("out", out, q.sym_sizes(), q.scalar_type(), q);
  check_same_geometry("lse", lse, lse_sizes(q), acc, q);
  if (grad_lse.has_value()) check_same_geometry("grad_lse", *grad_lse, lse_sizes(q), acc, q);
  TORCH_CHECK(dk.has_value() == dv.has_value(), "dk and dv must be given together");
  const auto check_grad = [&](const char* name, const std::optional<at::Tensor>& grad,
                              const at::Tensor& like) {
    if (!grad.has_value()) return;
    check_same_geometry(name, *grad, like.sym_sizes(), acc, q);
    TORCH_CHECK(grad->is_contiguous(), name, " must be contiguous");
  };
  check_grad("dq", dq, q);
  check_grad("dk", dk, k);
  check_grad("dv", dv, k);
}

BlockCall forward_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& out, at::Tensor& lse, int64_t q_start, int64_t k_start,
                       const PatternArgs& pattern) {
  check_block_forward(q, k, v, out, lse, q_start, k_start, pattern);
  BlockCall call = make_call(q, k, v, q_start, k_start, pattern);
  call.params.out = out.mutable_data_ptr();
  call.params.lse = lse.mutable_data_ptr();
  return call;
}

BlockCall backward_call(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out, const at::Tensor& lse,
                        const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                        const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                        const PatternArgs& pattern) {
  check_block_backward(grad_out, grad_lse, q, k, v, out, lse, dq, dk, dv, q_start, k_start,
                       pattern);
  BlockCall call = make_call(q, k, v, q_start, k_start, pattern);
  call.grad_out = grad_out.contiguous();
  if (grad_lse.has_value()) call.grad_lse = grad_lse->contiguous();
  call.out = out.contiguous();
  call.lse = lse.contiguous();
  BlockParams& p = call.params;
  p.grad_out = call.grad_out.const_data_ptr();
  p.grad_lse = call.grad_lse.defined() ? call.grad_lse.const_data_ptr() : nullptr;
  p.out_in = call.out.const_data_ptr();
  p.lse_in = call.lse.const_data_ptr();
  p.dq = optional_ptr(dq);
  p.dk = optional_ptr(dk);
  p.dv = optional_ptr(dv);
  return call;
}

}  // namespace ring_attention
