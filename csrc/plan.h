// Exchange planner: which key rows of a block (per head) some query of a set
// of query ranges reaches. The ring sends exactly these rows, compacted.
#pragma once

#include <ATen/core/Tensor.h>

namespace ring_attention {

// Sorted flat indices row * heads + h (row relative to k_start) of the key
// rows of [k_start, k_start + k_len) that some query of the ranges
// [q_starts[i], q_starts[i] + q_lens[i]) reaches.
at::Tensor exchange_rows(at::IntArrayRef q_starts, at::IntArrayRef q_lens, int64_t k_start,
                         int64_t k_len, int64_t heads, at::IntArrayRef segment_lengths,
                         at::IntArrayRef dilation_rates, bool causal, bool head_groups);

}  // namespace ring_attention
