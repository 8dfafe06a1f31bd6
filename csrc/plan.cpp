#include "plan.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <vector>

#include "checks.h"
#include "pattern.h"

namespace ring_attention {
namespace {

// Positions (range ends included) and head counts stay below 2**62: with the
// branches clamped to at most max(end, heads) + 1 (pattern.h), no sum here or
// in pattern.h passes int64.
constexpr int64_t kLimit = int64_t{1} << 62;

void check_range(const std::string& start_name, const std::string& len_name, int64_t start,
                 int64_t len) {
  TORCH_CHECK(start >= 0 && len >= 0 && start < kLimit && len < kLimit - start,
              "exchange_rows: ", start_name, " and ", len_name, " must be >= 0 with ", start_name,
              " + ", len_name, " < 2**62 (positions are int64), got ", start_name, " = ", start,
              " and ", len_name, " = ", len);
}

}  // namespace

at::Tensor exchange_rows(at::IntArrayRef q_starts, at::IntArrayRef q_lens, int64_t k_start,
                         int64_t k_len, int64_t heads, int64_t kv_heads, at::IntArrayRef segs,
                         at::IntArrayRef dils, bool causal, bool head_groups, bool grouped_offsets,
                         const std::optional<at::Tensor>& cu_seqlens) {
  check_pattern(segs, dils);
  TORCH_CHECK(q_starts.size() == q_lens.size(),
              "exchange_rows: q_starts and q_lens must have the same length, got ", q_starts.size(),
              " and ", q_lens.size());
  TORCH_CHECK(heads >= 1 && heads < kLimit, "exchange_rows: heads must be in [1, 2**62), got ",
              heads);
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "kv_heads must divide heads (", heads,
              "), got kv_heads = ", kv_heads);
  check_range("k_start", "k_len", k_start, k_len);
  TORCH_CHECK(k_len <= INT64_MAX / kv_heads,
              "exchange_rows: k_len * kv_heads must fit in int64 (the flat indices row * "
              "kv_heads + g), got k_len = ",
              k_len, " and kv_heads = ", kv_heads);
  const auto n_branches = static_cast<int64_t>(segs.size());
  TORCH_CHECK(!head_groups || heads >= n_branches,
              "head_groups needs at least as many heads as branches: ", heads, " heads, ",
              n_branches, " branches");
  int64_t end = k_start + k_len;
  for (size_t i = 0; i < q_starts.size(); ++i) {
    const std::string at = "[" + std::to_string(i) + "]";
    check_range("q_starts" + at, "q_lens" + at, q_starts[i], q_lens[i]);
    end = std::max(end, q_starts[i] + q_lens[i]);
  }
  const std::vector<int64_t> ws = clamped_branches(segs, branch_cap(end, heads)),
                             rs = clamped_branches(dils, branch_cap(end, heads));
  at::Tensor cu;
  if (cu_seqlens.has_value()) {
    check_cu_seqlens(*cu_seqlens, at::kCPU, end, false);
    cu = cu_seqlens->to(at::kLong).contiguous();
  }
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
        // Segments meeting both ranges: from the one holding the later start.
        for (SegmentWalk walk(docs, w, lo); walk.segment().start < hi; walk.next()) {
          for (const int64_t o : offsets) {
            const SegmentRuns runs =
                segment_runs(walk.segment(), r, o, q_lo, q_hi, k_start, k_end, causal);
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
