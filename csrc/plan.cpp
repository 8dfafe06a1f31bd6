#include "plan.h"

#include <ATen/ATen.h>

#include <vector>

#include "checks.h"
#include "pattern.h"

namespace ring_attention {

at::Tensor exchange_rows(at::IntArrayRef q_starts, at::IntArrayRef q_lens, int64_t k_start,
                         int64_t k_len, int64_t heads, at::IntArrayRef segs, at::IntArrayRef dils,
                         bool causal, bool head_groups) {
  check_pattern(segs, dils);
  TORCH_CHECK(q_starts.size() == q_lens.size(), "q_starts and q_lens must have the same length");
  TORCH_CHECK(heads >= 1 && k_len >= 0 && k_start >= 0, "heads >= 1, k_start >= 0, k_len >= 0");
  const int64_t n_branches = static_cast<int64_t>(segs.size());
  const int64_t k_end = k_start + k_len;
  std::vector<uint8_t> needed(static_cast<size_t>(k_len * heads), 0);
  for (size_t qi = 0; qi < q_starts.size(); ++qi) {
    const int64_t q_lo = q_starts[qi], q_hi = q_lo + q_lens[qi];
    if (q_lens[qi] <= 0 || k_len <= 0) continue;
    for (int64_t i = 0; i < n_branches; ++i) {
      const int64_t w = segs[i], r = dils[i];
      int64_t s_lo, s_hi;
      if (!shared_segments(w, q_lo, q_lens[qi], k_start, k_len, s_lo, s_hi)) continue;
      for (int64_t h = 0; h < heads; ++h) {
        if (!branch_applies(h, i, heads, n_branches, head_groups)) continue;
        for (int64_t s = s_lo; s < s_hi; ++s) {
          const SegmentRuns runs = segment_runs(s * w, w, r, h, q_lo, q_hi, k_start, k_end, causal);
          for (int64_t m = 0; m < runs.k.count; ++m) {
            needed[(runs.k.first + m * r - k_start) * heads + h] = 1;
          }
        }
      }
    }
  }
  std::vector<int64_t> rows;
  for (int64_t idx = 0; idx < k_len * heads; ++idx)
    if (needed[idx]) rows.push_back(idx);
  return at::tensor(rows, at::kLong);
}

}  // namespace ring_attention
