#include "plan.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <new>
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

// Residues [lo, hi) modulo a dilation r, 0 <= lo < hi <= r.
struct Interval {
  int64_t lo, hi;
};
using Residues = std::vector<Interval>;  // disjoint, at most a few

// The residues mod r of the len consecutive integers from first >= 0.
Residues residues(int64_t first, int64_t len, int64_t r) {
  if (len <= 0) return {};
  if (len >= r) return {{0, r}};
  const int64_t a = first % r;
  if (len <= r - a) return {{a, a + len}};
  return {{a, r}, {0, len - (r - a)}};
}

Residues intersect(const Residues& x, const Residues& y) {
  Residues out;
  for (const Interval& a : x) {
    for (const Interval& b : y) {
      const int64_t lo = std::max(a.lo, b.lo), hi = std::min(a.hi, b.hi);
      if (lo < hi) out.push_back({lo, hi});
    }
  }
  return out;
}

void check_range(const std::string& start_name, const std::string& len_name, int64_t start,
                 int64_t len) {
  TORCH_CHECK(start >= 0 && len >= 0 && start < kLimit && len < kLimit - start,
              "exchange_rows: ", start_name, " and ", len_name, " must be >= 0 with ", start_name,
              " + ", len_name, " < 2**62 (positions are int64), got ", start_name, " = ", start,
              " and ", len_name, " = ", len);
}

// One branch of the planner: its dilation and the query heads it applies to
// (global indices among `heads`, within the call's head range).
struct Branch {
  int64_t r, heads, group;  // group: query heads per K/V head
  int64_t h_lo, h_hi;       // the query heads the branch applies to
  bool grouped;

  // The offsets some query head of the branch has.
  Residues offsets() const {
    if (!grouped) return residues(h_lo, h_hi - h_lo, r);
    return {{head_offset(h_lo, r, heads, true), head_offset(h_hi - 1, r, heads, true) + 1}};
  }

  // Calls f(kvh) once for every K/V head read by a query head of offset o.
  template <typename F>
  void kv_heads_of(int64_t o, F&& f) const {
    if (grouped) {  // heads [o * size, (o + 1) * size) have offset o
      const int64_t size = ceil_div(heads, r);
      const int64_t lo = std::max(h_lo, o * size), hi = std::min(h_hi, (o + 1) * size);
      for (int64_t kvh = lo / group; lo < hi && kvh <= (hi - 1) / group; ++kvh) f(kvh);
      return;
    }
    // heads o, o + r, ...: from each one's K/V head to the next K/V head's first
    int64_t h = h_lo + ((o - h_lo % r) % r + r) % r;
    while (h < h_hi) {
      const int64_t kvh = h / group, next = (kvh + 1) * group;
      f(kvh);
      if (next >= h_hi) break;
      h += ceil_div(next - h, r) * r;
    }
  }
};

// Sorts `rows` and drops repeats: by a byte map over their span where that is
// at most 16 bytes a row (reached rows are mostly dense), else by sorting.
void compact(std::vector<int64_t>& rows) {
  if (rows.size() < 2) return;
  const auto [lo_it, hi_it] = std::minmax_element(rows.begin(), rows.end());
  const int64_t lo = *lo_it, span = *hi_it - lo + 1;
  if (span / 16 <= static_cast<int64_t>(rows.size())) {
    std::vector<uint8_t> seen(static_cast<size_t>(span), 0);
    for (const int64_t x : rows) seen[static_cast<size_t>(x - lo)] = 1;
    rows.clear();
    for (int64_t i = 0; i < span; ++i)
      if (seen[static_cast<size_t>(i)]) rows.push_back(lo + i);
    return;
  }
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
}

}  // namespace

// Cost: the segments of each branch that meet both a query range and the key
// range, plus the rows emitted. Per segment, only the offsets whose active
// rows hold a query of the range and a key of the block (causal: a key no
// later than the last query) are visited, and each of them reaches at least
// one key row; heads are enumerated per offset, never one by one.
at::Tensor exchange_rows(at::IntArrayRef q_starts, at::IntArrayRef q_lens, int64_t k_start,
                         int64_t k_len, int64_t heads, int64_t kv_heads, at::IntArrayRef segs,
                         at::IntArrayRef dils, bool causal, bool head_groups, bool grouped_offsets,
                         const std::optional<at::Tensor>& cu_seqlens, int64_t window_left,
                         int64_t window_right, int64_t head_start, int64_t total_heads,
                         int64_t total_kv_heads) {
  check_pattern(segs, dils);
  check_window(window_left, window_right);
  TORCH_CHECK(q_starts.size() == q_lens.size(),
              "exchange_rows: q_starts and q_lens must have the same length, got ", q_starts.size(),
              " and ", q_lens.size());
  TORCH_CHECK(heads >= 1 && heads < kLimit, "exchange_rows: heads must be in [1, 2**62), got ",
              heads);
  TORCH_CHECK(kv_heads >= 1, "exchange_rows: kv_heads must be >= 1, got ", kv_heads);
  const std::optional<at::Tensor> none;
  check_heads(heads, kv_heads,
              PatternArgs{segs, dils, causal, 1.0, head_groups, grouped_offsets, none, none,
                          window_left, window_right, head_start, total_heads, total_kv_heads});
  check_range("k_start", "k_len", k_start, k_len);
  TORCH_CHECK(k_len <= INT64_MAX / kv_heads,
              "exchange_rows: k_len * kv_heads must fit in int64 (the flat indices row * "
              "kv_heads + g), got k_len = ",
              k_len, " and kv_heads = ", kv_heads);
  const auto n_branches = static_cast<int64_t>(segs.size());
  // The call's heads among all of them: global query heads [h0, h0 + heads)
  // of `all`, reading global K/V heads from kv0 on (the rows' kvh is local).
  const int64_t all = total_heads == 0 ? heads : total_heads, h0 = head_start;
  const int64_t group = total_heads == 0 ? heads / kv_heads : total_heads / total_kv_heads;
  const int64_t kv0 = h0 / group;
  const int64_t k_end = k_start + k_len;
  int64_t end = k_end;
  for (size_t i = 0; i < q_starts.size(); ++i) {
    const std::string at = "[" + std::to_string(i) + "]";
    check_range("q_starts" + at, "q_lens" + at, q_starts[i], q_lens[i]);
    end = std::max(end, q_starts[i] + q_lens[i]);
  }
  const std::vector<int64_t> ws = clamped_branches(segs, branch_cap(end, all)),
                             rs = clamped_branches(dils, branch_cap(end, all));
  const at::Tensor cu =
      cu_seqlens.has_value() ? checked_documents(*cu_seqlens, at::kCPU, end, false) : at::Tensor();
  const Documents docs = cu.defined() ? Documents{cu.const_data_ptr<int64_t>(), cu.numel() - 1}
                                      : Documents{nullptr, 0};

  std::vector<int64_t> rows;  // flat indices row * kv_heads + kvh, row relative to k_start
  try {
    for (int64_t i = 0; i < n_branches && k_len > 0; ++i) {
      const Branch branch{
          rs[i],
          all,
          group,
          std::max(h0, head_groups ? head_group_begin(i, all, n_branches) : 0),
          std::min(h0 + heads, head_groups ? head_group_begin(i + 1, all, n_branches) : all),
          grouped_offsets};
      if (branch.h_lo >= branch.h_hi) continue;
      const int64_t w = ws[i], r = rs[i];
      const Residues offsets = branch.offsets();
      for (size_t qi = 0; qi < q_starts.size(); ++qi) {
        const int64_t q_lo = q_starts[qi], q_hi = q_lo + q_lens[qi];
        if (q_lo >= q_hi) continue;
        const Window window =
            block_window(window_left, window_right, q_lo, q_hi, k_start, k_end, causal);
        // Segments meeting both ranges: from the one holding the later start.
        const int64_t lo = std::max(q_lo, k_start), hi = std::min(q_hi, k_end);
        for (SegmentWalk walk(docs, w, lo); walk.segment().start < hi; walk.next()) {
          const Segment seg = walk.segment();
          const int64_t qa = std::max(q_lo, seg.start), qb = std::min(q_hi, seg.end);
          const int64_t ka = std::max({k_start, seg.start, qa - window.left});
          const int64_t kb = std::min({k_end, seg.end, causal ? qb : k_end, qb + window.right});
          if (qa >= qb || ka >= kb) continue;
          // Offsets with a query in [qa, qb) and a key in [ka, kb) (causal:
          // keys before qb, so no later than that offset's last query; a
          // window: keys within it of some query).
          const Residues live = intersect(intersect(offsets, residues(qa - seg.start, qb - qa, r)),
                                          residues(ka - seg.start, kb - ka, r));
          for (const Interval& iv : live) {
            for (int64_t o = iv.lo; o < iv.hi; ++o) {
              const ActiveRun k = segment_runs(seg, r, o, q_lo, q_hi, k_start, k_end, causal,
                                               window.left, window.right)
                                      .k;
              branch.kv_heads_of(o, [&](int64_t kvh) {
                for (int64_t m = 0; m < k.count; ++m)
                  rows.push_back((k.first + m * r - k_start) * kv_heads + (kvh - kv0));
              });
            }
          }
        }
      }
      compact(rows);
    }
  } catch (const std::bad_alloc&) {
    TORCH_CHECK(false, "exchange_rows: the reached rows do not fit in memory (k_len = ", k_len,
                ", kv_heads = ", kv_heads, ", ", q_starts.size(), " query ranges)");
  }
  return at::tensor(rows, at::kLong);
}

}  // namespace ring_attention
