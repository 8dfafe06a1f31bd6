// Schemas of the operators (the block operators' are also used by the test
// suite's CUDA emulator, whose ops must take exactly the same arguments).
#pragma once

// Arguments every attention operator shares (the ones added later have
// defaults, so that calls written before them still work). The block
// operators end with k_rows, the row map of packed K/V rows (params.h).
#define RA_PATTERN_ARGS                                                                       \
  "int[] segment_lengths, int[] dilation_rates, bool causal, float scale, bool head_groups, " \
  "bool grouped_offsets, Tensor? key_padding_mask, Tensor? cu_seqlens, "                      \
  "int window_left=-1, int window_right=-1, int head_start=0, int total_heads=0, "            \
  "int total_kv_heads=0"

namespace ring_attention::schema {

inline constexpr const char* kBlockForward =
    "block_forward(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, "
    "int q_start, int k_start, " RA_PATTERN_ARGS ", Tensor? k_rows=None) -> ()";
inline constexpr const char* kBlockBackward =
    "block_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, "
    "Tensor lse, Tensor(a!)? dq, Tensor(b!)? dk, Tensor(c!)? dv, int q_start, int "
    "k_start, " RA_PATTERN_ARGS ", Tensor? k_rows=None) -> ()";
// The local op's rows: queries at [q_start, q_start + Lq) (or batch row b's
// at q_starts[b] on), keys at [k_start, k_start + Lk).
#define RA_ROWS_ARGS "int q_start=0, int k_start=0, Tensor? q_starts=None"
inline constexpr const char* kDilatedAttention =
    "dilated_attention(Tensor q, Tensor k, Tensor v, " RA_PATTERN_ARGS ", " RA_ROWS_ARGS
    ") -> (Tensor, Tensor)";
inline constexpr const char* kDilatedAttentionBackward =
    "dilated_attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, "
    "Tensor out, Tensor lse, " RA_PATTERN_ARGS ", " RA_ROWS_ARGS ") -> (Tensor, Tensor, Tensor)";
inline constexpr const char* kExchangeRows =
    "exchange_rows(int[] q_starts, int[] q_lens, int k_start, int k_len, int heads, int kv_heads, "
    "int[] segment_lengths, int[] dilation_rates, bool causal, bool head_groups, "
    "bool grouped_offsets, Tensor? cu_seqlens, int window_left=-1, int window_right=-1, "
    "int head_start=0, int total_heads=0, int total_kv_heads=0) -> Tensor";

}  // namespace ring_attention::schema

#undef RA_PATTERN_ARGS
#undef RA_ROWS_ARGS
