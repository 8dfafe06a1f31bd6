#include "plan.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "checks.h"
#include "pattern.h"

namespace ring_attention {

at::Tensor exchange_rows(at::IntArrayRef q_starts, at::IntArrayRef q_lens, int64_t k_start,
                         int64_t k_len, int64_t heads, int64_t kv_heads, at::IntArrayRef segs,
                         at::IntArrayRef dils, bool causal, bool head_groups, bool grouped_offsets,
                         const std::optional<at::Tensor>& cu_seqlens, int64_t window_left,
                         int64_t window_right) {
  check_pattern(segs, dils);
  check_window(window_left, window_right);
  TORCH_CHECK(q_starts.size() == q_lens.size(), "q_starts and q_lens must have the same length");
  TORCH_CHECK(heads >= 1 && k_len >= 0 && k_start >= 0,
              "exchange_rows needs heads >= 1, k_start >= 0, k_len >= 0");
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "kv_heads must divide heads (", heads,
              "), got kv_heads = ", kv_heads);
  const auto n_branches = static_cast<int64_t>(segs.size());
  TORCH_CHECK(!head_groups || heads >= n_branches,
              "head_groups needs at least as many heads as branches: ", heads, " heads, ",
              n_branches, " branches");
  int64_t end = k_start + k_len;
  for (size_t i = 0; i < q_starts.size(); ++i) {
    TORCH_CHECK(q_starts[i] >= 0 && q_lens[i] >= 0, "q_starts and q_lens must be >= 0");
    end = std::max(end, q_starts[i] + q_lens[i]);
  }
  const std::vector<int64_t> ws = clamped_branches(segs, branch_cap(end, heads)),
                             rs = clamped_branches(dils, branch_cap(end, heads));
  const at::Tensor cu =
      cu_seqlens.has_value() ? checked_documents(*cu_seqlens, at::kCPU, end, false) : at::Tensor();
  const Documents docs = cu.defined() ? Documents{cu.const_data_ptr<int64_t>(), cu.numel() - 1}
                                      : Documents{nullptr, 0};

  // The offsets the query heads of each K/V head have in a branch: a key row
  // is needed once for all the query heads that share its offset.
  const int64_t group = heads / kv_heads, k_end = k_start + k_len;
  std::vector<uint8_t> needed(static_cast<size_t>(k_len * kv_heads), 0);
  std::vector<int64_t> offsets;
  for (int64_t i = 0; i < n_branches; ++i) {
    const int64_t w = ws[i], r = rs[i];
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      offsets.clear();
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        if (!branch_applies(h, i, heads, n_branches, head_groups)) continue;
        const int64_t o = head_offset(h, r, heads, grouped_offsets);
        if (std::find(offsets.begin(), offsets.end(), o) == offsets.end()) offsets.push_back(o);
      }
      if (offsets.empty()) continue;
      for (size_t qi = 0; qi < q_starts.size(); ++qi) {
        const int64_t q_lo = q_starts[qi], q_hi = q_lo + q_lens[qi];
        const int64_t lo = std::max(q_lo, k_start), hi = std::min(q_hi, k_end);
        if (q_lens[qi] <= 0 || k_len <= 0) continue;
        const Window window =
            block_window(window_left, window_right, q_lo, q_hi, k_start, k_end, causal);
        // Segments meeting both ranges: from the one holding the later start.
        for (SegmentWalk walk(docs, w, lo); walk.segment().start < hi; walk.next()) {
          for (const int64_t o : offsets) {
            const SegmentRuns runs = segment_runs(walk.segment(), r, o, q_lo, q_hi, k_start, k_end,
                                                  causal, window.left, window.right);
            for (int64_t m = 0; m < runs.k.count; ++m)
              needed[(runs.k.first + m * r - k_start) * kv_heads + kvh] = 1;
          }
        }
      }
    }
  }
  std::vector<int64_t> rows;
  for (int64_t idx = 0; idx < k_len * kv_heads; ++idx)
    if (needed[idx]) rows.push_back(idx);
  return at::tensor(rows, at::kLong);
}

}  // namespace ring_attention
