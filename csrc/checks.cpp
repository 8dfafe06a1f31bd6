#include "checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

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

// The last boundary of cu_seqlens: the sequence length (exact) or at or after
// the end of the blocks.
void check_total(int64_t total, int64_t min_total, bool exact) {
  if (exact) {
    TORCH_CHECK(total == min_total, "cu_seqlens must end at the sequence length ", min_total,
                ", got ", total);
  } else {
    TORCH_CHECK(total >= min_total, "cu_seqlens must end at or after the end of the blocks (",
                min_total, "), got ", total);
  }
}

// The row map of packed k and v (B, n, D): (Lk, kv_heads) int32, contiguous,
// on q's device, its values in [-1, n) (read on the CPU only).
void check_row_map(const at::Tensor& k_rows, const at::Tensor& q, const at::Tensor& k) {
  TORCH_CHECK(k_rows.dim() == 2, "k_rows must be 2-D (k_len, kv_heads), got ", k_rows.dim(), "-D");
  TORCH_CHECK(k_rows.scalar_type() == at::kInt, "k_rows must have dtype int32, got ",
              k_rows.scalar_type());
  TORCH_CHECK(k_rows.device() == q.device(), "k_rows must be on q's device ", q.device(), ", got ",
              k_rows.device());
  TORCH_CHECK(k_rows.is_contiguous(), "k_rows must be contiguous");
  if (!k_rows.device().is_cpu() || k_rows.numel() == 0) return;
  const auto [lo, hi] = at::aminmax(k_rows);
  const int64_t low = lo.item<int64_t>(), high = hi.item<int64_t>();
  TORCH_CHECK(low >= -1 && high < k.size(1), "k_rows must hold rows of k in [-1, ", k.size(1),
              "), got values in [", low, ", ", high, "]");
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_start,
               int64_t k_start, const PatternArgs& pattern,
               const std::optional<at::Tensor>& k_rows) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined(),
              "q, k and v must be tensors, got None for ",
              !q.defined()   ? "q"
              : !k.defined() ? "k"
                             : "v");
  check_pattern(pattern.segment_lengths, pattern.dilation_rates);
  check_window(pattern.window_left, pattern.window_right);
  TORCH_CHECK(std::isfinite(pattern.scale) && pattern.scale > 0,
              "scale must be a finite positive number, got ", pattern.scale);
  TORCH_CHECK(q.dim() == 4, "q must be 4-D (batch, seq, heads, head_dim), got ", q.dim(), "-D");
  const bool packed = k_rows.has_value();
  if (packed) {
    TORCH_CHECK(k.dim() == 3 && v.dim() == 3,
                "k and v must be 3-D (batch, rows, head_dim) with k_rows, got ", k.dim(), "-D and ",
                v.dim(), "-D");
  } else {
    TORCH_CHECK(k.dim() == 4 && v.dim() == 4,
                "k and v must be 4-D (batch, seq, kv_heads, head_dim), got ", k.dim(), "-D and ",
                v.dim(), "-D");
  }
  TORCH_CHECK(k.sym_sizes() == v.sym_sizes(), "k and v must have the same shape, got ",
              k.sym_sizes(), " and ", v.sym_sizes());
  TORCH_CHECK(k.sym_size(0) == q.sym_size(0) && k.sym_size(-1) == q.sym_size(3),
              "k must match q in batch and head_dim: q ", q.sym_sizes(), ", k ", k.sym_sizes());
  if (packed) check_row_map(*k_rows, q, k);
  const c10::SymInt& heads = q.sym_size(2);
  const c10::SymInt& kv_heads = packed ? k_rows->sym_size(1) : k.sym_size(2);
  const c10::SymInt& k_len = packed ? k_rows->sym_size(0) : k.sym_size(1);
  check_heads(heads, kv_heads, pattern);
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
  if (pattern.key_padding_mask.has_value()) {
    check_same_geometry("key_padding_mask", *pattern.key_padding_mask, {k.sym_size(0), k_len},
                        at::kBool, q);
  }
  if (pattern.cu_seqlens.has_value()) check_cu_seqlens_type(*pattern.cu_seqlens, q.device());
}

// The boundaries of int64 contiguous CPU cu_seqlens: [0, ...], non-decreasing.
// Returns the last one.
int64_t check_document_bounds(const at::Tensor& cu) {
  TORCH_CHECK(cu.numel() >= 1, "cu_seqlens must not be empty: it starts with 0");
  const int64_t* b = cu.const_data_ptr<int64_t>();
  const int64_t n = cu.numel();
  TORCH_CHECK(b[0] == 0, "cu_seqlens must start at 0, got ", b[0]);
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK(b[i] >= b[i - 1], "cu_seqlens must be non-decreasing, got cu_seqlens[", i - 1,
                "] = ", b[i - 1], " > cu_seqlens[", i, "] = ", b[i]);
  }
  return b[n - 1];
}

// The last documents tensor whose values a thread checked: held weakly (its
// address cannot be reused while the entry lives), with its version and
// last boundary.
struct CheckedDocuments {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> tensor{
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  int64_t version = -1, total = 0;
};

}  // namespace

void check_heads(const c10::SymInt& heads, const c10::SymInt& kv_heads, const PatternArgs& p) {
  const auto n_branches = static_cast<int64_t>(p.segment_lengths.size());
  if (p.total_heads == 0) {
    TORCH_CHECK(p.head_start == 0 && p.total_kv_heads == 0,
                "head_start and total_kv_heads need total_heads (0: the call holds every head), "
                "got head_start = ",
                p.head_start, ", total_kv_heads = ", p.total_kv_heads);
    TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0,
                "k and v must have kv_heads heads dividing q's heads (grouped K/V): q has ", heads,
                " heads, k has kv_heads = ", kv_heads);
    TORCH_CHECK(!p.head_groups || heads >= n_branches,
                "head_groups needs at least as many heads as branches: ", heads, " heads, ",
                n_branches, " branches");
    return;
  }
  constexpr int64_t kMaxHeads = int64_t{1} << 31;
  TORCH_CHECK(p.total_heads >= 1 && p.total_heads <= kMaxHeads && p.total_kv_heads >= 1 &&
                  p.total_heads % p.total_kv_heads == 0,
              "total_kv_heads must divide total_heads (at most 2**31), got total_heads = ",
              p.total_heads, ", total_kv_heads = ", p.total_kv_heads);
  TORCH_CHECK(p.head_start >= 0 && heads >= 1 && heads <= p.total_heads - p.head_start,
              "q's heads must be heads [head_start, head_start + heads) of total_heads = ",
              p.total_heads, ", got head_start = ", p.head_start, " and ", heads, " heads");
  const int64_t group = p.total_heads / p.total_kv_heads;
  const c10::SymInt kv_needed = (heads + (p.head_start - 1)) / group - p.head_start / group + 1;
  TORCH_CHECK(kv_heads == kv_needed, "k and v must hold the ", kv_needed,
              " K/V heads that query heads [", p.head_start, ", ", p.head_start, " + ", heads,
              ") read (", group, " query heads per K/V head), got ", kv_heads);
  TORCH_CHECK(!p.head_groups || p.total_heads >= n_branches,
              "head_groups needs at least as many heads as branches: ", p.total_heads, " heads, ",
              n_branches, " branches");
}

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

void check_window(int64_t left, int64_t right) {
  TORCH_CHECK(left >= -1 && right >= -1,
              "window must be (left, right), each >= -1 (-1: unbounded), got window_left = ", left,
              ", window_right = ", right);
}

void check_local_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const PatternArgs& pattern, const RowArgs& rows) {
  check_qkv(q, k, v, rows.q_start, rows.k_start, pattern, std::nullopt);
  if (rows.whole()) {
    TORCH_CHECK(k.sym_size(1) == q.sym_size(1), "k and v must have q's sequence length (dim 1): q ",
                q.sym_sizes(), ", k ", k.sym_sizes());
  }
  if (rows.q_starts.has_value()) {
    const at::Tensor& s = *rows.q_starts;
    TORCH_CHECK(s.dim() == 1 && s.sym_size(0) == q.sym_size(0) && s.scalar_type() == at::kLong,
                "q_starts must be int64 of shape (batch,) = (", q.sym_size(0), ",), got ",
                s.scalar_type(), " of shape ", s.sym_sizes());
    TORCH_CHECK(rows.q_start == 0, "q_start must be 0 with q_starts, got ", rows.q_start);
  }
}

void check_local_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                          const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse) {
  TORCH_CHECK(grad_out.defined(), "grad_out must be a tensor, got None");
  TORCH_CHECK(at::isFloatingType(grad_out.scalar_type()),
              "grad_out must have a floating dtype, got ", grad_out.scalar_type());
  check_same_geometry("grad_out", grad_out, q.sym_sizes(), grad_out.scalar_type(), q);
  check_same_geometry("out", out, q.sym_sizes(), q.scalar_type(), q);
  const at::ScalarType acc = acc_dtype(q.scalar_type());
  check_same_geometry("lse", lse, lse_sizes(q), acc, q);
  if (grad_lse.has_value()) check_same_geometry("grad_lse", *grad_lse, lse_sizes(q), acc, q);
}

void check_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const at::Tensor& lse, int64_t q_start,
                         int64_t k_start, const PatternArgs& pattern,
                         const std::optional<at::Tensor>& k_rows) {
  check_qkv(q, k, v, q_start, k_start, pattern, k_rows);
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
                          const PatternArgs& pattern, const std::optional<at::Tensor>& k_rows) {
  check_qkv(q, k, v, q_start, k_start, pattern, k_rows);
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

CheckedPattern checked_pattern(const PatternArgs& pattern, const at::Tensor& q, int64_t kv_heads,
                               int64_t extent, bool exact) {
  const bool all = pattern.total_heads == 0;
  const int64_t total = all ? q.size(2) : pattern.total_heads;
  const int64_t group = all ? q.size(2) / kv_heads : total / pattern.total_kv_heads;
  const int64_t cap = branch_cap(extent, total);
  return CheckedPattern{clamped_branches(pattern.segment_lengths, cap),
                        clamped_branches(pattern.dilation_rates, cap),
                        pattern.scale,
                        pattern.causal,
                        pattern.head_groups,
                        pattern.grouped_offsets,
                        pattern.window_left,
                        pattern.window_right,
                        all ? 0 : pattern.head_start,
                        total,
                        group,
                        pattern.cu_seqlens.has_value()
                            ? checked_documents(*pattern.cu_seqlens, q.device(), extent, exact)
                            : at::Tensor()};
}

at::Tensor checked_documents(const at::Tensor& cu, c10::Device device, int64_t min_total,
                             bool exact) {
  check_cu_seqlens_type(cu, device);
  at::Tensor bounds = cu.to(at::kLong).contiguous();
  if (!bounds.device().is_cpu()) return bounds;  // reading them would wait for the device
  thread_local CheckedDocuments last;
  const bool versioned = !cu.is_inference();  // inference tensors have no version
  const bool known = versioned && last.tensor.lock().get() == cu.unsafeGetTensorImpl() &&
                     last.version == static_cast<int64_t>(cu._version());
  const int64_t total = known ? last.total : check_document_bounds(bounds);
  if (versioned && !known) {
    last.tensor =
        c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(cu.getIntrusivePtr());
    last.version = static_cast<int64_t>(cu._version());
    last.total = total;
  }
  check_total(total, min_total, exact);
  return bounds;
}

CheckedPattern checked_block_pattern(const PatternArgs& pattern, const at::Tensor& q,
                                     const at::Tensor& k, int64_t q_start, int64_t k_start,
                                     const std::optional<at::Tensor>& k_rows) {
  const int64_t k_len = k_rows.has_value() ? k_rows->size(0) : k.size(1);
  const int64_t kv_heads = k_rows.has_value() ? k_rows->size(1) : k.size(2);
  const int64_t blocks_end = std::max(q_start + q.size(1), k_start + k_len);
  return checked_pattern(pattern, q, kv_heads, blocks_end, false);
}

}  // namespace ring_attention
