// The local operator: the whole sequence is one query block and one key
// block, computed by the block operators through the dispatcher (so on any
// device they are registered for).
#include "local_op.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <algorithm>
#include <limits>

#include "checks.h"
#include "config.h"

namespace ring_attention {
namespace {

using at::IntArrayRef;
using at::Tensor;
using OptTensor = std::optional<Tensor>;

void call_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                        int64_t q_start, int64_t k_start, const PatternArgs& pa) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ring_attention::block_forward", "")
                       .typed<void(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&,
                                   int64_t, int64_t, IntArrayRef, IntArrayRef, bool, double, bool,
                                   bool, const OptTensor&, const OptTensor&)>();
  op.call(q, k, v, out, lse, q_start, k_start, pa.segment_lengths, pa.dilation_rates, pa.causal,
          pa.scale, pa.head_groups, pa.grouped_offsets, pa.key_padding_mask, pa.cu_seqlens);
}

void call_block_backward(const Tensor& grad_out, const OptTensor& grad_lse, const Tensor& q,
                         const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                         const OptTensor& dq, const OptTensor& dk, const OptTensor& dv,
                         int64_t q_start, int64_t k_start, const PatternArgs& pa) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ring_attention::block_backward", "")
          .typed<void(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
                      const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                      const OptTensor&, int64_t, int64_t, IntArrayRef, IntArrayRef, bool, double,
                      bool, bool, const OptTensor&, const OptTensor&)>();
  op.call(grad_out, grad_lse, q, k, v, out, lse, dq, dk, dv, q_start, k_start, pa.segment_lengths,
          pa.dilation_rates, pa.causal, pa.scale, pa.head_groups, pa.grouped_offsets,
          pa.key_padding_mask, pa.cu_seqlens);
}

// The local op's own checks; the block operators check the rest.
void check_local(const Tensor& q, const Tensor& k, const Tensor& v, const PatternArgs& pa) {
  check_local_op(q, k, v, pa);
  if (pa.cu_seqlens.has_value()) check_cu_seqlens(*pa.cu_seqlens, q.device(), q.size(1), true);
}

// Low-precision inputs accumulate in fp32 one chunk of rows at a time and cast
// each chunk into the output: the fp32 accumulators (out; dq, dk, dv) are at
// most a chunk long. A chunk is as long as a budget for them allows
// (RING_ATTENTION_CHUNK_MIB; 1 GiB by default) and never shorter than 8 chunks
// give (at least 1024 rows, a whole number of the longest segment when that
// fits). Long chunks keep a GPU busy: a chunk launches each branch once, one
// thread block per window of 128 active rows (64 in the backward) and head;
// in 8 chunks at n = 32768 the branch of dilation 12 had 48 blocks (16 heads)
// for 132 SMs. On the CPU a chunk packs its key runs again and its threads
// wait at each branch's end, and chunks that cut segments make the backward
// take two passes (benchmarks/RESULTS.md).
constexpr int64_t kChunks = 8;
constexpr int64_t kMinChunkRows = 1024;
constexpr int64_t kDefaultChunkMiB = 1024;

// The accumulator budget of a chunk in bytes: RING_ATTENTION_CHUNK_MIB where
// set (config.h).
int64_t chunk_budget_bytes() {
  const std::optional<int64_t> mib = config::chunk_mib();
  return mib.value_or(kDefaultChunkMiB) << 20;
}

// Rows of a chunk of q's sequence whose fp32 accumulators take bytes_per_row
// bytes a row.
int64_t chunk_rows(const Tensor& q, IntArrayRef segs, int64_t bytes_per_row) {
  const int64_t len = q.size(1), w = *std::max_element(segs.begin(), segs.end());
  int64_t rows = std::max(kMinChunkRows, (len + kChunks - 1) / kChunks);
  if (w <= rows) rows = (rows + w - 1) / w * w;
  int64_t budget = chunk_budget_bytes() / std::max<int64_t>(bytes_per_row, 1);
  if (w <= budget) budget = budget / w * w;
  return std::min(std::max(rows, budget), len);
}

Tensor neg_inf_lse(const Tensor& q, int64_t rows, at::ScalarType acc) {
  return at::full({q.size(0), q.size(2), rows}, -std::numeric_limits<double>::infinity(),
                  q.options().dtype(acc));
}

}  // namespace

std::tuple<Tensor, Tensor> dilated_attention_local(const Tensor& q, const Tensor& k,
                                                   const Tensor& v, IntArrayRef segs,
                                                   IntArrayRef dils, bool causal, double scale,
                                                   bool head_groups, bool grouped_offsets,
                                                   const OptTensor& kpm, const OptTensor& cu) {
  const PatternArgs pa{segs, dils, causal, scale, head_groups, grouped_offsets, kpm, cu};
  check_local(q, k, v, pa);
  const at::ScalarType acc = acc_dtype(q.scalar_type());
  const int64_t len = q.size(1);
  Tensor lse = neg_inf_lse(q, len, acc);
  if (acc == q.scalar_type()) {  // the output is its own accumulator
    Tensor out = at::zeros(q.sizes(), q.options());
    call_block_forward(q, k, v, out, lse, 0, 0, pa);
    return {out, lse};
  }
  Tensor out = at::empty(q.sizes(), q.options());
  const int64_t rows = chunk_rows(q, segs, q.size(0) * q.size(2) * q.size(3) * elementSize(acc));
  for (int64_t a = 0; a < len; a += rows) {
    const int64_t b = std::min(a + rows, len);
    Tensor out_c = at::zeros({q.size(0), b - a, q.size(2), q.size(3)}, q.options().dtype(acc));
    Tensor lse_c = neg_inf_lse(q, b - a, acc);
    call_block_forward(q.slice(1, a, b), k, v, out_c, lse_c, a, 0, pa);
    out.slice(1, a, b).copy_(out_c);
    lse.slice(2, a, b).copy_(lse_c);
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> dilated_attention_backward_local(
    const Tensor& grad_out_in, const OptTensor& grad_lse, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, IntArrayRef segs, IntArrayRef dils,
    bool causal, double scale, bool head_groups, bool grouped_offsets, const OptTensor& kpm,
    const OptTensor& cu) {
  const PatternArgs pa{segs, dils, causal, scale, head_groups, grouped_offsets, kpm, cu};
  check_local(q, k, v, pa);
  TORCH_CHECK(grad_out_in.defined(), "grad_out must be a tensor, got None");
  const at::ScalarType acc = acc_dtype(q.scalar_type());
  const Tensor grad_out = grad_out_in.to(q.scalar_type());
  if (acc == q.scalar_type()) {  // the gradients are their own accumulators
    Tensor dq = at::zeros(q.sizes(), q.options()), dk = at::zeros(k.sizes(), k.options()),
           dv = at::zeros(v.sizes(), v.options());
    call_block_backward(grad_out, grad_lse, q, k, v, out, lse, dq, dk, dv, 0, 0, pa);
    return {dq, dk, dv};
  }
  Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options()),
         dv = at::empty(v.sizes(), v.options());
  const auto acc_opts = q.options().dtype(acc);
  // Three fp32 accumulators a row at a time at most: dq, dk, dv.
  const int64_t len = q.size(1);
  const int64_t rows =
      chunk_rows(q, segs, q.size(0) * (q.size(2) + 2 * k.size(2)) * q.size(3) * elementSize(acc));
  // A chunk's fp32 accumulator, its rows of grad_lse and of the key padding
  // mask (PatternArgs holds references: each call site keeps the slice).
  const auto acc_chunk = [&](const Tensor& t, int64_t a, int64_t b) {
    return at::zeros({t.size(0), b - a, t.size(2), t.size(3)}, acc_opts);
  };
  const auto grad_lse_rows = [&](int64_t a, int64_t b) {
    return grad_lse.has_value() ? OptTensor(grad_lse->slice(2, a, b)) : std::nullopt;
  };
  const auto kpm_rows = [&](int64_t a, int64_t b) {
    return kpm.has_value() ? OptTensor(kpm->slice(1, a, b)) : std::nullopt;
  };
  // Without documents, chunks that hold whole segments of every branch are
  // closed: their queries reach only their keys. Then one pass per chunk
  // computes dq, dk and dv together (three fp32 chunks at a time).
  const bool closed = !cu.has_value() && std::all_of(segs.begin(), segs.end(), [&](int64_t w) {
    return rows == len || rows % w == 0;
  });
  if (closed) {
    for (int64_t a = 0; a < len; a += rows) {
      const int64_t b = std::min(a + rows, len);
      const Tensor dq_c = acc_chunk(q, a, b), dk_c = acc_chunk(k, a, b), dv_c = acc_chunk(v, a, b);
      const OptTensor kpm_c = kpm_rows(a, b);
      const PatternArgs pa_c{segs, dils, causal, scale, head_groups, grouped_offsets, kpm_c, cu};
      call_block_backward(grad_out.slice(1, a, b), grad_lse_rows(a, b), q.slice(1, a, b),
                          k.slice(1, a, b), v.slice(1, a, b), out.slice(1, a, b),
                          lse.slice(2, a, b).contiguous(), dq_c, dk_c, dv_c, a, a, pa_c);
      dq.slice(1, a, b).copy_(dq_c);
      dk.slice(1, a, b).copy_(dk_c);
      dv.slice(1, a, b).copy_(dv_c);
    }
    return {dq, dk, dv};
  }
  // Else dq by chunks of queries (against all keys), then dk, dv by chunks of
  // keys (against all queries). Each pass makes S, dP and the softmax pass of
  // its tiles again; one pass would need fp32 dk and dv for every key a
  // chunk's queries reach (all of them for a segment as long as the sequence).
  for (int64_t a = 0; a < len; a += rows) {
    const int64_t b = std::min(a + rows, len);
    const Tensor dq_c = acc_chunk(q, a, b);
    call_block_backward(grad_out.slice(1, a, b), grad_lse_rows(a, b), q.slice(1, a, b), k, v,
                        out.slice(1, a, b), lse.slice(2, a, b).contiguous(), dq_c, std::nullopt,
                        std::nullopt, a, 0, pa);
    dq.slice(1, a, b).copy_(dq_c);
  }
  for (int64_t a = 0; a < len; a += rows) {
    const int64_t b = std::min(a + rows, len);
    const Tensor dk_c = acc_chunk(k, a, b), dv_c = acc_chunk(v, a, b);
    const OptTensor kpm_c = kpm_rows(a, b);
    const PatternArgs pa_c{segs, dils, causal, scale, head_groups, grouped_offsets, kpm_c, cu};
    call_block_backward(grad_out, grad_lse, q, k.slice(1, a, b), v.slice(1, a, b), out, lse,
                        std::nullopt, dk_c, dv_c, 0, a, pa_c);
    dk.slice(1, a, b).copy_(dk_c);
    dv.slice(1, a, b).copy_(dv_c);
  }
  return {dq, dk, dv};
}

std::tuple<Tensor, Tensor> dilated_attention_meta(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  IntArrayRef segs, IntArrayRef dils, bool causal,
                                                  double scale, bool head_groups,
                                                  bool grouped_offsets, const OptTensor& kpm,
                                                  const OptTensor& cu) {
  check_local_op(q, k, v,
                 PatternArgs{segs, dils, causal, scale, head_groups, grouped_offsets, kpm, cu});
  // Contiguous, as the CPU and CUDA kernels return them (whatever q's strides).
  return {at::empty_like(q, at::MemoryFormat::Contiguous),
          at::empty_symint(lse_sizes(q), q.options().dtype(acc_dtype(q.scalar_type())))};
}

std::tuple<Tensor, Tensor, Tensor> dilated_attention_backward_meta(
    const Tensor&, const OptTensor&, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor&, const Tensor&, IntArrayRef segs, IntArrayRef dils, bool causal, double scale,
    bool head_groups, bool grouped_offsets, const OptTensor& kpm, const OptTensor& cu) {
  check_local_op(q, k, v,
                 PatternArgs{segs, dils, causal, scale, head_groups, grouped_offsets, kpm, cu});
  const auto contiguous = at::MemoryFormat::Contiguous;
  return {at::empty_like(q, contiguous), at::empty_like(k, contiguous),
          at::empty_like(v, contiguous)};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The pattern arguments of a call, kept for its backward.
void save_pattern(AutogradContext* ctx, IntArrayRef segs, IntArrayRef dils, bool causal,
                  double scale, bool head_groups, bool grouped_offsets, const OptTensor& kpm,
                  const OptTensor& cu) {
  ctx->saved_data["segs"] = segs.vec();
  ctx->saved_data["dils"] = dils.vec();
  ctx->saved_data["causal"] = causal;
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["head_groups"] = head_groups;
  ctx->saved_data["grouped_offsets"] = grouped_offsets;
  ctx->saved_data["kpm"] = kpm;
  ctx->saved_data["cu"] = cu;
}

// The backward as an autograd node of its own: with create_graph=True its
// outputs get this node, whose backward (double backward) raises instead of
// silently giving zeros.
class DilatedAttentionBackwardFunction
    : public torch::autograd::Function<DilatedAttentionBackwardFunction> {
 public:
  static variable_list forward(AutogradContext*, const Tensor& grad_out, const OptTensor& grad_lse,
                               const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                               const Tensor& lse, IntArrayRef segs, IntArrayRef dils, bool causal,
                               double scale, bool head_groups, bool grouped_offsets,
                               const OptTensor& kpm, const OptTensor& cu) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ring_attention::dilated_attention_backward", "")
                         .typed<decltype(dilated_attention_backward_local)>();
    auto [dq, dk, dv] = op.call(grad_out, grad_lse, q, k, v, out, lse, segs, dils, causal, scale,
                                head_groups, grouped_offsets, kpm, cu);
    return {dq, dk, dv};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false,
                "ring_attention.dilated_attention: double backward is not supported (the "
                "gradients of q, k, v are not differentiable)");
    return {};
  }
};

class DilatedAttentionFunction : public torch::autograd::Function<DilatedAttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, IntArrayRef segs, IntArrayRef dils, bool causal,
                               double scale, bool head_groups, bool grouped_offsets,
                               const OptTensor& kpm, const OptTensor& cu) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ring_attention::dilated_attention", "")
                         .typed<decltype(dilated_attention_local)>();
    auto [out, lse] =
        op.call(q, k, v, segs, dils, causal, scale, head_groups, grouped_offsets, kpm, cu);
    ctx->save_for_backward({q, k, v, out, lse});
    save_pattern(ctx, segs, dils, causal, scale, head_groups, grouped_offsets, kpm, cu);
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const OptTensor grad_lse = grads[1].defined() ? OptTensor(grads[1]) : std::nullopt;
    const auto& d = ctx->saved_data;
    const auto res = DilatedAttentionBackwardFunction::apply(
        grad_out, grad_lse, q, k, v, out, lse, d.at("segs").toIntVector(),
        d.at("dils").toIntVector(), d.at("causal").toBool(), d.at("scale").toDouble(),
        d.at("head_groups").toBool(), d.at("grouped_offsets").toBool(),
        d.at("kpm").toOptional<Tensor>(), d.at("cu").toOptional<Tensor>());
    return {res[0],   res[1],   res[2],   Tensor(), Tensor(), Tensor(),
            Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

std::tuple<Tensor, Tensor> dilated_attention_autograd(const Tensor& q, const Tensor& k,
                                                      const Tensor& v, IntArrayRef segs,
                                                      IntArrayRef dils, bool causal, double scale,
                                                      bool head_groups, bool grouped_offsets,
                                                      const OptTensor& kpm, const OptTensor& cu) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined(),
              "q, k and v must be tensors, got None for ",
              !q.defined()   ? "q"
              : !k.defined() ? "k"
                             : "v");  // (autograd reads their devices)
  auto res = DilatedAttentionFunction::apply(q, k, v, segs, dils, causal, scale, head_groups,
                                             grouped_offsets, kpm, cu);
  return {res[0], res[1]};
}

}  // namespace ring_attention
