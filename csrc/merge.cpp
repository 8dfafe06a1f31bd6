// The merge operators' checks and their CPU kernel (merge.h).
#include "merge.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"

namespace ring_attention {

namespace {

bool floating(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

}  // namespace

void check_merge(const at::Tensor& parts, const std::optional<at::Tensor>& part_lse,
                 const at::Tensor& index, const at::Tensor& out,
                 const std::optional<at::Tensor>& lse, bool first_in_out) {
  TORCH_CHECK(parts.dim() == 2, "parts must be 2-D (rows, head_dim), got ", parts.dim(), "-D");
  TORCH_CHECK(out.dim() == 4, "out must be 4-D (batch, rows, heads, head_dim), got ", out.dim(),
              "-D");
  TORCH_CHECK(index.dim() == 4, "index must be 4-D (slots, batch, rows, heads), got ", index.dim(),
              "-D");
  TORCH_CHECK(floating(parts.scalar_type()),
              "parts must be float32, float64, float16 or bfloat16, got ", parts.scalar_type());
  TORCH_CHECK(out.scalar_type() == parts.scalar_type(), "out must have parts' dtype ",
              parts.scalar_type(), ", got ", out.scalar_type());
  TORCH_CHECK(index.scalar_type() == at::kInt, "index must be int32, got ", index.scalar_type());
  TORCH_CHECK(out.device() == parts.device() && index.device() == parts.device(),
              "parts, index and out must be on one device, got ", parts.device(), ", ",
              index.device(), " and ", out.device());
  TORCH_CHECK(parts.sym_size(1) == out.sym_size(3), "parts must have out's head_dim ",
              out.sym_size(3), ", got ", parts.sym_size(1));
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK(index.sym_size(i + 1) == out.sym_size(i), "index must have shape (slots, ",
                out.sym_sizes().slice(0, 3), "), got ", index.sym_sizes());
  TORCH_CHECK(part_lse.has_value() == lse.has_value(),
              "part_lse and lse must be given together (a merge) or not at all (a sum)");
  if (!part_lse.has_value()) return;
  const at::ScalarType acc = acc_dtype(parts.scalar_type());
  if (first_in_out) {
    TORCH_CHECK(part_lse->dim() == 1 && part_lse->sym_size(0) >= parts.sym_size(0),
                "part_lse must have at least parts' ", parts.sym_size(0),
                " rows (first_in_out), got ", part_lse->sym_sizes());
  } else {
    TORCH_CHECK(part_lse->dim() == 1 && part_lse->sym_size(0) == parts.sym_size(0),
                "part_lse must have shape (", parts.sym_size(0), "), got ", part_lse->sym_sizes());
  }
  TORCH_CHECK(lse->dim() == 3 && lse->sym_sizes() == out.sym_sizes().slice(0, 3),
              "lse must have shape ", out.sym_sizes().slice(0, 3), ", got ", lse->sym_sizes());
  TORCH_CHECK(part_lse->scalar_type() == acc && lse->scalar_type() == acc,
              "part_lse and lse must have dtype ", acc, ", got ", part_lse->scalar_type(), " and ",
              lse->scalar_type());
  TORCH_CHECK(part_lse->device() == parts.device() && lse->device() == parts.device(),
              "part_lse and lse must be on parts' device ", parts.device());
}

MergeCall merge_call(const at::Tensor& parts, const std::optional<at::Tensor>& part_lse,
                     const at::Tensor& index, at::Tensor& out, std::optional<at::Tensor> lse,
                     bool first_in_out) {
  check_merge(parts, part_lse, index, out, lse, first_in_out);
  TORCH_CHECK(parts.is_contiguous(), "parts must be contiguous");
  TORCH_CHECK(index.is_contiguous(), "index must be contiguous");
  TORCH_CHECK(out.size(3) <= 1 || out.stride(3) == 1, "out must have stride 1 in head_dim, got ",
              out.stride(3));
  MergeCall c;
  c.parts = parts.data_ptr();
  c.index = index.data_ptr<int32_t>();
  c.out = out.data_ptr();
  c.slots = index.size(0);
  c.batch = out.size(0);
  c.length = out.size(1);
  c.heads = out.size(2);
  c.dim = out.size(3);
  c.part_rows = parts.size(0);
  c.dtype = parts.scalar_type();
  c.device = parts.device();
  for (int i = 0; i < 3; ++i) c.out_stride[i] = out.stride(i);
  if (part_lse.has_value()) {
    TORCH_CHECK(part_lse->is_contiguous(), "part_lse must be contiguous");
    c.part_lse = part_lse->data_ptr();
    c.lse = lse->data_ptr();
    c.lse_rows = part_lse->size(0);
    c.first_in_out = first_in_out;
    for (int i = 0; i < 3; ++i) c.lse_stride[i] = lse->stride(i);
  }
  return c;
}

namespace cpu {

namespace {

template <typename T>
void merge_typed(const MergeCall& c) {
  using Acc = at::opmath_type<T>;
  const auto* parts = static_cast<const T*>(c.parts);
  const auto* plse = static_cast<const Acc*>(c.part_lse);
  const int64_t rows = c.batch * c.length * c.heads, d = c.dim;
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    std::vector<Acc> acc(static_cast<size_t>(d));
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (c.length * c.heads), t = row / c.heads % c.length, h = row % c.heads;
      T* out =
          static_cast<T*>(c.out) + b * c.out_stride[0] + t * c.out_stride[1] + h * c.out_stride[2];
      const auto part = [&](int64_t s) -> int64_t {
        const int64_t i = c.index[s * rows + row];
        return i >= 0 && i < (s == 0 && c.first_in_out ? c.lse_rows : c.part_rows) ? i : -1;
      };
      std::fill(acc.begin(), acc.end(), Acc(0));
      Acc m = -std::numeric_limits<Acc>::infinity(), sum = 0;
      bool nan = false;
      if (plse != nullptr) {
        for (int64_t s = 0; s < c.slots; ++s) {
          const int64_t i = part(s);
          if (i < 0) continue;
          if (std::isnan(plse[i])) nan = true;
          m = plse[i] > m ? plse[i] : m;
        }
      }
      for (int64_t s = 0; s < c.slots && !nan; ++s) {
        const int64_t i = part(s);
        if (i < 0) continue;
        Acc weight = 1;
        if (plse != nullptr) {
          if (plse[i] == -std::numeric_limits<Acc>::infinity()) continue;
          weight = std::exp(plse[i] - m);
          sum += weight;
        }
        const T* p = s == 0 && c.first_in_out ? out : parts + i * d;
        for (int64_t j = 0; j < d; ++j) acc[j] += weight * static_cast<Acc>(p[j]);
      }
      Acc scale = 1;
      if (plse != nullptr) {
        Acc* lse = static_cast<Acc*>(c.lse) + b * c.lse_stride[0] + t * c.lse_stride[1] +
                   h * c.lse_stride[2];
        if (nan) {
          *lse = std::numeric_limits<Acc>::quiet_NaN();
          std::fill(acc.begin(), acc.end(), *lse);
        } else if (sum == 0) {
          *lse = -std::numeric_limits<Acc>::infinity();
        } else {
          *lse = m + std::log(sum);
          scale = Acc(1) / sum;
        }
      }
      for (int64_t j = 0; j < d; ++j) out[j] = static_cast<T>(acc[j] * scale);
    }
  });
}

}  // namespace

void merge_rows(const MergeCall& call) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, call.dtype, "merge_rows",
                                  [&] { merge_typed<scalar_t>(call); });
}

}  // namespace cpu

}  // namespace ring_attention
