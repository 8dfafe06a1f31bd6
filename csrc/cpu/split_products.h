// fp32 score products (S = Q K^T, the backward's dP = dO V^T too) on AMX.
// Each fp32 operand x splits exactly into three bf16 parts, x = h + m + l
// (by truncation: h holds x's top 8 significant bits, m the next 8, l the
// last 8, all with x's sign), and A B^T is the sum of the six part products
// that reach fp32's precision:
//
//   A B^T ~ Ah Bh^T + Am Bh^T + Al Bh^T + Ah Bm^T + Am Bm^T + Ah Bl^T
//
// (the three left out are below 2^-23 of |A| |B|, fp32's own rounding):
// one bf16 product over a reduction 6x as long, A = [Ah Am Al Ah Am Ah]
// (rows x 6d) against the rows [Bh; Bh; Bh; Bm; Bm; Bl] of B^T (6d x w, in
// brgemm's VNNI layout as packed_tiles.h). AMX multiplies bf16 pairs exactly
// and accumulates in fp32; at the forward's tiles the six products take
// less time than brgemm's fp32 kernel, with the same error against float64
// (benchmarks/bench.py tiles; figures in benchmarks/RESULTS.md).
// The scheme ("bf16x6") is from Henry, Tang and Heinecke, "Leveraging the
// bfloat16 Artificial Intelligence Datatype For Higher-Precision
// Computations" (ARITH 2019).
//
// Only the score products split: their reduction is the head dim, so the
// operands' parts are made once per query tile and once per key tile. The
// products with P and dS would split those weights at every tile, which
// costs as much as it saves (measured: the weights' split pass alone took
// as long as the softmax pass, and the split V of a key run (3x the bytes)
// no longer stays in L2).
//
// A NaN or infinity does not split (inf - inf is NaN): a query row or key
// holding one enters the split product as zeros, and its scores are then
// made one fp32 dot product each (infinite or NaN as the fp32 product makes
// them), so that the other scores of the tile stay exactly as they were.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <span>
#include <vector>

#include "tile_math.h"

namespace ring_attention::cpu {

// rows x d fp32 rows (row stride ld) as the A operand of the scores
// product: out holds rows x 6d values; rows holding a NaN or an infinity
// enter as zeros and are appended to bad (ascending).
void split_queries(const float* x, int64_t ld, int64_t rows, int64_t d, c10::BFloat16* out,
                   std::vector<int64_t>& bad);

// K rows k[j * ld ...], j < w, as the B operand of the scores product (w
// keys wide): out holds 6d x w values; keys holding a NaN or an infinity
// enter as zeros and are appended to bad (ascending).
void pack_keys_split(const float* k, int64_t ld, int64_t w, int64_t d, c10::BFloat16* out,
                     std::vector<int64_t>& bad);

// S (rows x N, stride ldc) = Q K^T from split_queries (d wide) and
// pack_keys_split (ldb = w keys; N <= w: its first N), then the scores of
// their bad rows and keys from the fp32 rows q and k themselves.
void gemm_split_scores(int64_t rows, int64_t N, int64_t d, const c10::BFloat16* q6,
                       const c10::BFloat16* k6, int64_t ldb, float* C, int64_t ldc,
                       TileRef<float> q, TileRef<float> k, std::span<const int64_t> bad_rows,
                       std::span<const int64_t> bad_keys);

}  // namespace ring_attention::cpu
