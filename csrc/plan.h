// Exchange planner: which key rows of a block (per K/V head) some query of a
// set of query ranges reaches. The ring sends exactly these rows, compacted.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace ring_attention {

// Sorted flat indices row * kv_heads + kvh (row relative to k_start) of the
// key rows of [k_start, k_start + k_len) that some query, of any query head
// reading K/V head kvh, of the ranges [q_starts[i], q_starts[i] + q_lens[i])
// reaches. cu_seqlens (CPU) holds the global document boundaries; a query t
// reaches keys in [t - window_left, t + window_right] only (-1: unbounded).
// The heads may be a range of all heads (head_start, total_heads,
// total_kv_heads: as the attention operators take them); kvh is then local.
at::Tensor exchange_rows(at::IntArrayRef q_starts, at::IntArrayRef q_lens, int64_t k_start,
                         int64_t k_len, int64_t heads, int64_t kv_heads,
                         at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates,
                         bool causal, bool head_groups, bool grouped_offsets,
                         const std::optional<at::Tensor>& cu_seqlens, int64_t window_left,
                         int64_t window_right, int64_t head_start, int64_t total_heads,
                         int64_t total_kv_heads);

}  // namespace ring_attention
