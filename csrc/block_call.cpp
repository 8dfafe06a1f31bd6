// The one place where a call's checked arguments become the BlockParams the
// kernels read (block_call.h).
#include "block_call.h"

#include <ATen/ATen.h>

namespace ring_attention {
namespace {

// The params every block of a call shares; the op-specific pointers stay null.
BlockCall make_block(const CheckedPattern& pattern, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& key_padding_mask, int64_t q_start,
                     int64_t k_start, const at::Tensor& k_rows) {
  BlockCall call{BlockParams{},
                 pattern.segment_lengths,
                 pattern.dilation_rates,
                 q.scalar_type(),
                 q.device(),
                 q.contiguous(),
                 k.contiguous(),
                 v.contiguous(),
                 key_padding_mask.defined() ? key_padding_mask.contiguous() : at::Tensor(),
                 pattern.cu_seqlens,
                 {},  // grad_out, grad_lse, out, lse: set by backward_block
                 {},
                 {},
                 {},
                 k_rows.defined() ? k_rows.contiguous() : at::Tensor()};
  BlockParams& p = call.params;
  p.q = call.q.const_data_ptr();
  p.k = call.k.const_data_ptr();
  p.v = call.v.const_data_ptr();
  p.key_padding_mask =
      call.key_padding_mask.defined() ? call.key_padding_mask.const_data_ptr<bool>() : nullptr;
  const at::Tensor& cu = pattern.cu_seqlens;
  p.docs = cu.defined() ? Documents{cu.const_data_ptr<int64_t>(), cu.numel() - 1}
                        : Documents{nullptr, 0};
  p.batch = q.size(0);
  p.heads = q.size(2);
  p.head_start = pattern.head_start;
  p.total_heads = pattern.total_heads;
  p.kv_group = pattern.kv_group;
  p.head_dim = q.size(3);
  p.q_start = q_start;
  p.q_len = q.size(1);
  p.k_start = k_start;
  if (call.k_rows.defined()) {
    p.k_rows = call.k_rows.const_data_ptr<int32_t>();
    p.k_count = k.size(1);
    p.k_len = k_rows.size(0);
    p.kv_heads = k_rows.size(1);
  } else {
    p.k_len = k.size(1);
    p.kv_heads = k.size(2);
  }
  p.n_branches = static_cast<int64_t>(pattern.segment_lengths.size());
  p.scale = pattern.scale;
  p.causal = pattern.causal;
  p.head_groups = pattern.head_groups;
  p.grouped_offsets = pattern.grouped_offsets;
  set_window(p, pattern.window_left, pattern.window_right);
  return call;
}

void* optional_ptr(const at::Tensor& t) { return t.defined() ? t.mutable_data_ptr() : nullptr; }

at::Tensor value_or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

}  // namespace

BlockCall forward_block(const CheckedPattern& pattern, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& key_padding_mask, at::Tensor& out,
                        at::Tensor& lse, int64_t q_start, int64_t k_start,
                        const at::Tensor& k_rows) {
  BlockCall call = make_block(pattern, q, k, v, key_padding_mask, q_start, k_start, k_rows);
  call.params.out = out.mutable_data_ptr();
  call.params.lse = lse.mutable_data_ptr();
  return call;
}

BlockCall backward_block(const CheckedPattern& pattern, const at::Tensor& grad_out,
                         const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& key_padding_mask,
                         const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq,
                         const at::Tensor& dk, const at::Tensor& dv, int64_t q_start,
                         int64_t k_start, const at::Tensor& k_rows) {
  BlockCall call = make_block(pattern, q, k, v, key_padding_mask, q_start, k_start, k_rows);
  call.grad_out = grad_out.contiguous();
  if (grad_lse.defined()) call.grad_lse = grad_lse.contiguous();
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

BlockCall forward_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& out, at::Tensor& lse, int64_t q_start, int64_t k_start,
                       const PatternArgs& pattern, const std::optional<at::Tensor>& k_rows) {
  check_block_forward(q, k, v, out, lse, q_start, k_start, pattern, k_rows);
  return forward_block(checked_block_pattern(pattern, q, k, q_start, k_start, k_rows), q, k, v,
                       value_or_undefined(pattern.key_padding_mask), out, lse, q_start, k_start,
                       value_or_undefined(k_rows));
}

BlockCall backward_call(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out, const at::Tensor& lse,
                        const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                        const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                        const PatternArgs& pattern, const std::optional<at::Tensor>& k_rows) {
  check_block_backward(grad_out, grad_lse, q, k, v, out, lse, dq, dk, dv, q_start, k_start, pattern,
                       k_rows);
  return backward_block(checked_block_pattern(pattern, q, k, q_start, k_start, k_rows), grad_out,
                        value_or_undefined(grad_lse), q, k, v,
                        value_or_undefined(pattern.key_padding_mask), out, lse,
                        value_or_undefined(dq), value_or_undefined(dk), value_or_undefined(dv),
                        q_start, k_start, value_or_undefined(k_rows));
}

}  // namespace ring_attention
