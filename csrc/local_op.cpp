// The local operator: the whole sequence is one query block and one key
// block. Its arguments are checked once; the chunks of rows below are blocks
// of that one checked call, run by the backend's kernel directly.
#include "local_op.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <limits>

#include "checks.h"
#include "config.h"

namespace ring_attention {
namespace {

using at::IntArrayRef;
using at::Tensor;
using OptTensor = std::optional<Tensor>;

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

// Rows of a chunk of len rows whose fp32 accumulators take bytes_per_row
// bytes a row.
int64_t chunk_rows(int64_t len, IntArrayRef segs, int64_t bytes_per_row) {
  const int64_t w = *std::max_element(segs.begin(), segs.end());
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

Tensor undefined_or(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }

// One block of the local op by the backend's kernel, a profiler event
// ("ring_attention::local_forward_block" / "..._backward_block") each.
void run_forward(BlockKernel kernel, const BlockCall& call) {
  RECORD_FUNCTION("ring_attention::local_forward_block", std::vector<c10::IValue>());
  kernel(call);
}
void run_backward(BlockKernel kernel, const BlockCall& call) {
  RECORD_FUNCTION("ring_attention::local_backward_block", std::vector<c10::IValue>());
  kernel(call);
}

// The rows of a checked call: one (q_start, k_start) for the whole batch, or
// one q_start per batch row (q_starts, read here: a wait on a GPU).
struct Rows {
  int64_t q_start, k_start;
  std::vector<int64_t> per_row;  // empty: q_start for every row
};

// The local op's checks, once: shapes, then the pattern's values against the
// rows' extent (without rows, cu_seqlens must end at the sequence length).
std::pair<CheckedPattern, Rows> check_local(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const PatternArgs& pa, const RowArgs& ra) {
  check_local_op(q, k, v, pa, ra);
  Rows rows{ra.q_start, ra.k_start, {}};
  int64_t q_end = ra.q_start;
  if (ra.q_starts.has_value()) {
    const Tensor starts = ra.q_starts->to(at::kCPU).contiguous();
    rows.per_row.assign(starts.const_data_ptr<int64_t>(),
                        starts.const_data_ptr<int64_t>() + starts.numel());
    constexpr int64_t kMaxStart = int64_t{1} << 62;
    for (const int64_t s : rows.per_row) {
      TORCH_CHECK(s >= 0 && s <= kMaxStart, "q_starts must be in [0, 2**62], got ", s);
      q_end = std::max(q_end, s);
    }
  }
  const int64_t extent = std::max(q_end + q.size(1), ra.k_start + k.size(1));
  return {checked_pattern(pa, q, k.size(2), extent, ra.whole()), std::move(rows)};
}

// Batch row b of t (all rows for b < 0).
Tensor batch_row(const Tensor& t, int64_t b) {
  return b < 0 || !t.defined() ? t : t.slice(0, b, b + 1);
}

// Calls f(b, q_start) for each group of batch rows sharing a q_start: b = -1
// (every row) without per-row starts.
template <typename F>
void for_rows(const Rows& rows, F&& f) {
  if (rows.per_row.empty()) return f(int64_t{-1}, rows.q_start);
  for (size_t b = 0; b < rows.per_row.size(); ++b) f(static_cast<int64_t>(b), rows.per_row[b]);
}

// The forward of queries q at q_start against keys at k_start into out and
// lse, in chunks of rows for low precision.
void forward_rows(BlockKernel forward, const CheckedPattern& pattern, const Tensor& q,
                  const Tensor& k, const Tensor& v, const Tensor& kpm, Tensor out, Tensor lse,
                  int64_t q_start, int64_t k_start) {
  const at::ScalarType acc = acc_dtype(q.scalar_type());
  if (acc == q.scalar_type()) {  // the output is its own accumulator
    run_forward(forward, forward_block(pattern, q, k, v, kpm, out, lse, q_start, k_start));
    return;
  }
  const int64_t len = q.size(1);
  const int64_t rows = chunk_rows(len, pattern.segment_lengths,
                                  q.size(0) * q.size(2) * q.size(3) * elementSize(acc));
  for (int64_t a = 0; a < len; a += rows) {
    const int64_t b = std::min(a + rows, len);
    Tensor out_c = at::zeros({q.size(0), b - a, q.size(2), q.size(3)}, q.options().dtype(acc));
    Tensor lse_c = neg_inf_lse(q, b - a, acc);
    run_forward(forward, forward_block(pattern, q.slice(1, a, b), k, v, kpm, out_c, lse_c,
                                       q_start + a, k_start));
    out.slice(1, a, b).copy_(out_c);
    lse.slice(2, a, b).copy_(lse_c);
  }
}

// The backward of one group of rows (forward_rows' blocks) into dq, dk, dv
// (q's dtype; the accumulators themselves for fp32 and fp64).
void backward_rows(BlockKernel backward, const CheckedPattern& pattern, const Tensor& grad_out,
                   const Tensor& grad_lse, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& kpm, const Tensor& out, const Tensor& lse, const Tensor& dq,
                   const Tensor& dk, const Tensor& dv, int64_t q_start, int64_t k_start) {
  const auto run = [&](const Tensor& go, const Tensor& glse, const Tensor& q_c, const Tensor& k_c,
                       const Tensor& v_c, const Tensor& kpm_c, const Tensor& out_c,
                       const Tensor& lse_c, const Tensor& dq_c, const Tensor& dk_c,
                       const Tensor& dv_c, int64_t qs, int64_t ks) {
    run_backward(backward, backward_block(pattern, go, glse, q_c, k_c, v_c, kpm_c, out_c, lse_c,
                                          dq_c, dk_c, dv_c, qs, ks));
  };
  const at::ScalarType acc = acc_dtype(q.scalar_type());
  if (acc == q.scalar_type()) {  // the gradients are their own accumulators
    run(grad_out, grad_lse, q, k, v, kpm, out, lse, dq, dk, dv, q_start, k_start);
    return;
  }
  const auto acc_opts = q.options().dtype(acc);
  // Three fp32 accumulators a row at a time at most: dq, dk, dv.
  const int64_t len = q.size(1), k_len = k.size(1);
  const int64_t row_bytes = q.size(0) * (q.size(2) + 2 * k.size(2)) * q.size(3) * elementSize(acc);
  const int64_t rows = chunk_rows(len, pattern.segment_lengths, row_bytes);
  const int64_t k_rows = chunk_rows(k_len, pattern.segment_lengths, row_bytes);
  // A chunk's fp32 accumulator, its rows of grad_lse and of the key padding mask.
  const auto acc_chunk = [&](const Tensor& t, int64_t a, int64_t b) {
    return at::zeros({t.size(0), b - a, t.size(2), t.size(3)}, acc_opts);
  };
  const auto grad_lse_rows = [&](int64_t a, int64_t b) {
    return grad_lse.defined() ? grad_lse.slice(2, a, b) : Tensor();
  };
  const auto kpm_rows = [&](int64_t a, int64_t b) {
    return kpm.defined() ? kpm.slice(1, a, b) : Tensor();
  };
  // Without documents, chunks of one sequence that hold whole segments of
  // every branch are closed: their queries reach only their keys. Then one
  // pass per chunk computes dq, dk and dv together (three fp32 chunks at a time).
  const std::vector<int64_t>& segs = pattern.segment_lengths;
  const bool closed = !pattern.cu_seqlens.defined() && q_start == k_start && len == k_len &&
                      std::all_of(segs.begin(), segs.end(), [&](int64_t w) {
                        return q_start % w == 0 && (rows == len || rows % w == 0);
                      });
  if (closed) {
    for (int64_t a = 0; a < len; a += rows) {
      const int64_t b = std::min(a + rows, len);
      const Tensor dq_c = acc_chunk(q, a, b), dk_c = acc_chunk(k, a, b), dv_c = acc_chunk(v, a, b);
      run(grad_out.slice(1, a, b), grad_lse_rows(a, b), q.slice(1, a, b), k.slice(1, a, b),
          v.slice(1, a, b), kpm_rows(a, b), out.slice(1, a, b), lse.slice(2, a, b), dq_c, dk_c,
          dv_c, q_start + a, k_start + a);
      dq.slice(1, a, b).copy_(dq_c);
      dk.slice(1, a, b).copy_(dk_c);
      dv.slice(1, a, b).copy_(dv_c);
    }
    return;
  }
  // Else dq by chunks of queries (against all keys), then dk, dv by chunks of
  // keys (against all queries). Each pass makes S, dP and the softmax pass of
  // its tiles again; one pass would need fp32 dk and dv for every key a
  // chunk's queries reach (all of them for a segment as long as the sequence).
  for (int64_t a = 0; a < len; a += rows) {
    const int64_t b = std::min(a + rows, len);
    const Tensor dq_c = acc_chunk(q, a, b);
    run(grad_out.slice(1, a, b), grad_lse_rows(a, b), q.slice(1, a, b), k, v, kpm,
        out.slice(1, a, b), lse.slice(2, a, b), dq_c, Tensor(), Tensor(), q_start + a, k_start);
    dq.slice(1, a, b).copy_(dq_c);
  }
  for (int64_t a = 0; a < k_len; a += k_rows) {
    const int64_t b = std::min(a + k_rows, k_len);
    const Tensor dk_c = acc_chunk(k, a, b), dv_c = acc_chunk(v, a, b);
    run(grad_out, grad_lse, q, k.slice(1, a, b), v.slice(1, a, b), kpm_rows(a, b), out, lse,
        Tensor(), dk_c, dv_c, q_start, k_start + a);
    dk.slice(1, a, b).copy_(dk_c);
    dv.slice(1, a, b).copy_(dv_c);
  }
}

}  // namespace

std::tuple<Tensor, Tensor> dilated_attention_local(BlockKernel forward, const Tensor& q,
                                                   const Tensor& k, const Tensor& v,
                                                   const PatternArgs& pa, const RowArgs& ra) {
  const auto [pattern, rows] = check_local(q, k, v, pa, ra);
  const Tensor kpm = undefined_or(pa.key_padding_mask);
  const at::ScalarType acc = acc_dtype(q.scalar_type());
  Tensor lse = neg_inf_lse(q, q.size(1), acc);
  // fp32 and fp64: the output is its own accumulator (zeros); else chunks are copied in.
  Tensor out = acc == q.scalar_type() ? at::zeros(q.sizes(), q.options())
                                      : at::empty(q.sizes(), q.options());
  for_rows(rows, [&](int64_t b, int64_t q_start) {
    forward_rows(forward, pattern, batch_row(q, b), batch_row(k, b), batch_row(v, b),
                 batch_row(kpm, b), batch_row(out, b), batch_row(lse, b), q_start, rows.k_start);
  });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> dilated_attention_backward_local(
    BlockKernel backward, const Tensor& grad_out_in, const OptTensor& grad_lse_in, const Tensor& q,
    const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const PatternArgs& pa,
    const RowArgs& ra) {
  const auto [pattern, rows] = check_local(q, k, v, pa, ra);
  check_local_backward(grad_out_in, grad_lse_in, q, out, lse);
  const Tensor kpm = undefined_or(pa.key_padding_mask);
  const Tensor grad_out = grad_out_in.to(q.scalar_type());
  const Tensor grad_lse = undefined_or(grad_lse_in);
  // fp32 and fp64: the gradients are their own accumulators (zeros); else chunks are copied in.
  const bool own = acc_dtype(q.scalar_type()) == q.scalar_type();
  const auto grad = [&](const Tensor& t) {
    return own ? at::zeros(t.sizes(), t.options()) : at::empty(t.sizes(), t.options());
  };
  Tensor dq = grad(q), dk = grad(k), dv = grad(v);
  for_rows(rows, [&](int64_t b, int64_t q_start) {
    backward_rows(backward, pattern, batch_row(grad_out, b), batch_row(grad_lse, b),
                  batch_row(q, b), batch_row(k, b), batch_row(v, b), batch_row(kpm, b),
                  batch_row(out, b), batch_row(lse, b), batch_row(dq, b), batch_row(dk, b),
                  batch_row(dv, b), q_start, rows.k_start);
  });
  return {dq, dk, dv};
}

std::tuple<Tensor, Tensor> dilated_attention_meta(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  RA_PATTERN_PARAMS, RA_ROWS_PARAMS) {
  check_local_op(q, k, v, RA_PATTERN_ARGS_OF, RA_ROWS_ARGS_OF);
  // Contiguous, as the CPU and CUDA kernels return them (whatever q's strides).
  return {at::empty_like(q, at::MemoryFormat::Contiguous),
          at::empty_symint(lse_sizes(q), q.options().dtype(acc_dtype(q.scalar_type())))};
}

std::tuple<Tensor, Tensor, Tensor> dilated_attention_backward_meta(
    const Tensor& grad_out, const OptTensor& grad_lse, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, RA_PATTERN_PARAMS, RA_ROWS_PARAMS) {
  check_local_op(q, k, v, RA_PATTERN_ARGS_OF, RA_ROWS_ARGS_OF);
  check_local_backward(grad_out, grad_lse, q, out, lse);
  const auto contiguous = at::MemoryFormat::Contiguous;
  return {at::empty_like(q, contiguous), at::empty_like(k, contiguous),
          at::empty_like(v, contiguous)};
}

}  // namespace ring_attention
