// Shared pieces of the CUDA block kernels: the per-launch problem description,
// tile decoding (which segment / rows a thread block owns), warp reductions,
// dilated-row tile loaders and the mma.sync (m16n8k16, fp32 accumulate)
// building blocks of the fp16/bf16 tensor-core kernels.
//
// Work decomposition (both ops): one launch per branch (w, r); a thread block
// owns one tile of up to BM active rows of one (segment, head, batch). Rows are
// queries (forward, dq) or keys (dk/dv). Within a branch a row belongs to one
// segment and one tile, so blocks never write the same output row: plain
// read-modify-write, no atomics. Branches run one after another on the stream.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../checks.h"
#include "../pattern.h"
#include "runtime.cuh"

namespace ring_attention::gpu {

constexpr int kThreads = 128;  // 4 warps in every kernel
constexpr unsigned kFull = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

// One launch: a q block, a k/v block and one branch of the pattern.
struct Problem {
  const void *q, *k, *v, *dout;  // (B, L, H, D), input dtype
  void *out, *lse;               // forward accumulators (acc dtype)
  const void *lse_in, *delta;    // backward: final lse, rowsum(dO * O)
  void *dq, *dk, *dv;            // backward accumulators (acc dtype)
  const bool* kpm;               // (B, Lk), true = ignore key; or nullptr
  int64_t B, H, D, Lq, Lk, q_start, k_start;
  int64_t w, r, branch, n_branches;
  int64_t h_lo;           // first head of this launch (grid.y counts heads)
  int64_t seg_lo;         // first segment shared by the q and k blocks
  int64_t tiles_per_seg;  // grid.x = segments * tiles_per_seg
  double scale;
  bool causal, head_groups;
  bool vec;  // 16-byte loads allowed (D % 8 == 0, aligned pointers)
};

// What one thread block works on. Query m of the segment sits at position
// q.first + r*m, key n at k.first + r*n (both active, same segment), and key n
// reaches query m (causal) iff n <= m + dm.
struct Tile {
  int64_t b, h, tile;
  ActiveRun q, k;
  int64_t dm;
};

__device__ inline bool decode_tile(const Problem& p, Tile& t) {
  t.b = blockIdx.z;
  t.h = p.h_lo + blockIdx.y;
  if (!branch_applies(t.h, p.branch, p.H, p.n_branches, p.head_groups)) return false;
  const int64_t seg = p.seg_lo + blockIdx.x / p.tiles_per_seg;
  t.tile = blockIdx.x % p.tiles_per_seg;
  const SegmentRuns runs = segment_runs(seg * p.w, p.w, p.r, t.h, p.q_start, p.q_start + p.Lq,
                                        p.k_start, p.k_start + p.Lk, p.causal);
  t.q = runs.q;
  t.k = runs.k;
  if (t.q.count <= 0 || t.k.count <= 0) return false;
  t.dm = (t.q.first - t.k.first) / p.r;  // exact: both are active in one segment
  return true;
}

// Keys reached by queries m <= m_last of the segment (all of them if not causal).
__device__ inline int64_t keys_reached(const Problem& p, const Tile& t, int64_t m_last) {
  if (!p.causal) return t.k.count;
  const int64_t lim = m_last + t.dm + 1;
  return lim < 0 ? 0 : (lim < t.k.count ? lim : t.k.count);
}

// Element offsets of a row (position pos, head h) in a (B, L, H, D) tensor.
__device__ inline int64_t q_offset(const Problem& p, int64_t b, int64_t h, int64_t pos) {
  return ((b * p.Lq + (pos - p.q_start)) * p.H + h) * p.D;
}
__device__ inline int64_t k_offset(const Problem& p, int64_t b, int64_t h, int64_t pos) {
  return ((b * p.Lk + (pos - p.k_start)) * p.H + h) * p.D;
}
// Index into a (B, H, Lq) tensor (lse, delta).
__device__ inline int64_t row_stat(const Problem& p, int64_t b, int64_t h, int64_t pos) {
  return (b * p.H + h) * p.Lq + (pos - p.q_start);
}
// Key padding mask entry of the key at position pos, or nullptr.
__device__ inline const bool* mask_at(const Problem& p, int64_t b, int64_t pos) {
  return p.kpm == nullptr ? nullptr : p.kpm + b * p.Lk + (pos - p.k_start);
}

// Row i of a tile (mask[i * mstride] is its padding flag) holds a reached row.
__device__ inline bool row_ok(int i, int nvalid, const bool* mask, int64_t mstride) {
  return i < nvalid && (mask == nullptr || !mask[i * mstride]);
}

__device__ inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename C>
__device__ inline C neg_inf() {
  return -static_cast<C>(INFINITY);
}
__device__ inline float cexp(float x) { return expf(x); }
__device__ inline double cexp(double x) { return exp(x); }
__device__ inline float clog(float x) { return logf(x); }
__device__ inline double clog(double x) { return log(x); }
__device__ inline float clog1p(float x) { return log1pf(x); }
__device__ inline double clog1p(double x) { return log1p(x); }
__device__ inline float cmax(float a, float b) { return fmaxf(a, b); }
__device__ inline double cmax(double a, double b) { return fmax(a, b); }

template <typename C>
__device__ inline C warp_sum(C x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}
template <typename C>
__device__ inline C warp_max(C x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = cmax(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

// Merge a block result (normalised o, blk_lse) into running (out, lse) for one
// element; old_lse is the value read before any lane wrote. Returns new out.
template <typename C>
__device__ inline C merge_value(C out, C o, C old_lse, C blk_lse, C new_lse) {
  if (old_lse == neg_inf<C>() || isnan(blk_lse)) return o;
  return out * cexp(old_lse - new_lse) + o * cexp(blk_lse - new_lse);
}
template <typename C>
__device__ inline C merged_lse(C old_lse, C blk_lse) {
  if (old_lse == neg_inf<C>() || isnan(blk_lse)) return blk_lse;
  const C hi = old_lse > blk_lse ? old_lse : blk_lse;
  const C lo = old_lse > blk_lse ? blk_lse : old_lse;
  return hi + clog1p(cexp(lo - hi));
}

// ---------------------------------------------------------------- SIMT path
// Tile of 32 rows as acc type C, s[i * ld + d], zero beyond D and for rows that
// are not ok. src points at row 0; row i is at src + i * stride.
template <typename T, typename C>
__device__ inline void load_rows_simt(C* s, int ld, int dp, const T* src, int64_t stride,
                                      int nvalid, const bool* mask, int64_t mstride, int D) {
  for (int idx = threadIdx.x; idx < 32 * dp; idx += kThreads) {
    const int i = idx / dp, d = idx % dp;
    const bool ok = d < D && row_ok(i, nvalid, mask, mstride);
    s[i * ld + d] = ok ? static_cast<C>(src[i * stride + d]) : C(0);
  }
}

// Lane-distributed row vector: x[j] = row[lane + 32 j].
template <typename T, typename C, int NPL>
__device__ inline void load_vec(C (&x)[NPL], const T* row, bool ok, int D, int lane) {
#pragma unroll
  for (int j = 0; j < NPL; ++j) {
    const int d = lane + 32 * j;
    x[j] = (ok && d < D) ? static_cast<C>(row[d]) : C(0);
  }
}

// <x, y> with x lane-distributed and y a full row in shared memory; only the
// 32-wide chunks below D are visited (the rest is zero).
template <typename C, int NPL>
__device__ inline C dot_bcast(const C (&x)[NPL], const C* y, int D) {
  C s = 0;
#pragma unroll
  for (int j = 0; j < NPL; ++j) {
    if (32 * j >= D) break;
#pragma unroll
    for (int src = 0; src < 32; ++src) s += __shfl_sync(kFull, x[j], src) * y[32 * j + src];
  }
  return s;
}

// --------------------------------------------------- tensor-core (mma) path
// Stage a raw 16-bit tile in shared memory: row i (i < nvalid and not masked)
// of the tile is at src + i * stride and goes to s[i * ld + d] for d < DP (zero
// past D and for unreached rows). Rows of s must start 16-byte aligned (ld % 8
// == 0): ldmatrix reads them. With vec (D % 8 == 0, 16-byte aligned rows) the
// copies are cp.async: they land once the thread has committed and waited for
// them (cp_async_commit, cp_async_wait) and the block is visible after the next
// __syncthreads; otherwise they are plain stores.
template <int ROWS, int DP>
__device__ inline void load_rows16(uint16_t* s, int ld, const uint16_t* src, int64_t stride,
                                   int nvalid, const bool* mask, int64_t mstride, int D, bool vec) {
  constexpr int kChunks = DP / 8;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += kThreads) {
    const int i = idx / kChunks, c = (idx % kChunks) * 8;
    const bool ok = row_ok(i, nvalid, mask, mstride);
    if (vec) {  // a chunk is wholly inside [0, D) or wholly past it
      const bool in = ok && c < D;
      cp_async_16(s + i * ld + c, in ? src + i * stride + c : src, in ? 16 : 0);
      continue;
    }
    union {
      uint4 u;
      uint16_t h[8];
    } val;
#pragma unroll
    for (int j = 0; j < 8; ++j) val.h[j] = (ok && c + j < D) ? src[i * stride + c + j] : 0;
    *reinterpret_cast<uint4*>(s + i * ld + c) = val.u;
  }
}

// Two floats rounded to T and packed into one register (lo in the low half).
template <typename T>
__device__ inline uint32_t pack2(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, c10::Half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&bits, &h, sizeof(bits));
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&bits, &h, sizeof(bits));
  }
  return bits;
}

// Fragment layouts of mma.m16n8k16 (g = lane / 4, tg = lane % 4):
//   A (16x16, row-major): a0 (g, 2tg..), a1 (g+8, 2tg..), a2 (g, 2tg+8..), a3 (g+8, 2tg+8..)
//   B (16x8, k x n):      b0 (k 2tg.., n g), b1 (k 2tg+8.., n g)
//   C (16x8):             c0,c1 (g, 2tg..), c2,c3 (g+8, 2tg..)
// ldmatrix.x4 gives register m of every lane from the 8x8 tile whose row
// addresses lanes 8m..8m+7 pass: lane l gets row l/4, columns 2(l%4) and the
// next (.trans: column l/4, rows 2(l%4) and the next). So A's four 8x8
// quarters, or B's b0/b1 for two n-blocks, come with one instruction.

// c[NJ] += A * B^T, A: 16 x K row-major (lda), B: NJ*8 x K row-major (ldb),
// both in shared memory.
template <typename T, int NJ, int K>
__device__ inline void mma_ss(float (&c)[NJ][4], const uint16_t* A, int lda, const uint16_t* B,
                              int ldb, int lane) {
  static_assert(NJ % 2 == 0 && K % 16 == 0, "mma_ss: NJ even, K a multiple of 16");
  const int r = lane % 8, hi = (lane / 8) & 1, pair = lane / 16;
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a[4];
    ldmatrix_x4(a, A + (r + 8 * hi) * lda + k0 + 8 * pair);
#pragma unroll
    for (int j = 0; j < NJ; j += 2) {
      uint32_t b[4];  // b0, b1 of n-block j, then of j + 1
      ldmatrix_x4(b, B + ((j + pair) * 8 + r) * ldb + k0 + 8 * hi);
      mma_m16n8k16<T>(c[j], a, b[0], b[1]);
      mma_m16n8k16<T>(c[j + 1], a, b[2], b[3]);
    }
  }
}

// c[NJ] += X * V where X (16 x 8*KJ) is held as C fragments x[KJ] (rounded to
// T) and V: 8*KJ x NJ*8 row-major (ldv) in shared memory.
template <typename T, int NJ, int KJ>
__device__ inline void mma_rs(float (&c)[NJ][4], const float (&x)[KJ][4], const uint16_t* V,
                              int ldv, int lane) {
  static_assert(NJ % 2 == 0 && KJ % 2 == 0, "mma_rs: NJ and KJ even");
  const int r = lane % 8, hi = (lane / 8) & 1, pair = lane / 16;
#pragma unroll
  for (int kk = 0; kk < KJ / 2; ++kk) {
    const uint32_t a[4] = {
        pack2<T>(x[2 * kk][0], x[2 * kk][1]), pack2<T>(x[2 * kk][2], x[2 * kk][3]),
        pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]), pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3])};
#pragma unroll
    for (int j = 0; j < NJ; j += 2) {
      uint32_t b[4];  // b0, b1 of n-block j, then of j + 1
      ldmatrix_x4_trans(b, V + (kk * 16 + 8 * hi + r) * ldv + (j + pair) * 8);
      mma_m16n8k16<T>(c[j], a, b[0], b[1]);
      mma_m16n8k16<T>(c[j + 1], a, b[2], b[3]);
    }
  }
}

// ---------------------------------------------------------------- host side
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The launch description of a checked block call (the branch fields are set
// per launch). head_dim <= 256 on CUDA.
inline Problem make_problem(const BlockCall& call) {
  const BlockParams& b = call.params;
  check_device(call.q);
  TORCH_CHECK(b.head_dim <= 256, "head_dim must be <= 256 on CUDA, got ", b.head_dim);
  Problem p{};
  p.q = b.q;
  p.k = b.k;
  p.v = b.v;
  p.dout = b.grad_out;
  p.out = b.out;
  p.lse = b.lse;
  p.lse_in = b.lse_in;
  p.dq = b.dq;
  p.dk = b.dk;
  p.dv = b.dv;
  p.kpm = b.key_padding_mask;
  p.B = b.batch;
  p.H = b.heads;
  p.D = b.head_dim;
  p.Lq = b.q_len;
  p.Lk = b.k_len;
  p.q_start = b.q_start;
  p.k_start = b.k_start;
  p.scale = b.scale;
  p.causal = b.causal;
  p.head_groups = b.head_groups;
  p.vec = p.D % 8 == 0 && aligned16(p.q) && aligned16(p.k) && aligned16(p.v) &&
          (p.dout == nullptr || aligned16(p.dout));
  return p;
}

// Whether fp16/bf16 run on the tensor cores (sm_80+, head_dim <= 128).
inline bool use_tensor_cores(const Problem& p) {
  return device_attribute(cudaDevAttrComputeCapabilityMajor) >= 8 && p.D <= 128;
}

// Raise the dynamic shared memory limit of a kernel when it needs > 48 KiB.
template <typename Kernel>
inline void prepare_smem(Kernel kernel, size_t bytes) {
  const int limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  TORCH_CHECK(bytes <= static_cast<size_t>(limit), "ring_attention: kernel needs ", bytes,
              " bytes of shared memory, the device allows ", limit);
  if (bytes > 48 * 1024) set_max_dynamic_smem(kernel, bytes);
}

// Launch `kernel` once per branch; rows_len is the length of the block whose
// rows the kernel tiles (Lq for queries, Lk for keys), bm its tile height.
template <typename Kernel>
inline void launch_branches(Kernel kernel, Problem p, at::IntArrayRef segs, at::IntArrayRef dils,
                            int64_t rows_len, int bm, size_t smem) {
  prepare_smem(kernel, smem);
  TORCH_CHECK(p.B <= 65535 && p.H <= 65535, "ring_attention: batch and heads must be <= 65535");
  const cudaStream_t stream = current_stream();
  p.n_branches = static_cast<int64_t>(segs.size());
  for (int64_t i = 0; i < p.n_branches; ++i) {
    const int64_t w = segs[i], r = dils[i];
    int64_t s_lo, s_hi;
    if (!shared_segments(w, p.q_start, p.Lq, p.k_start, p.Lk, s_lo, s_hi)) continue;
    const int64_t h_lo = p.head_groups ? head_group_begin(i, p.H, p.n_branches) : 0;
    const int64_t h_hi = p.head_groups ? head_group_begin(i + 1, p.H, p.n_branches) : p.H;
    if (h_hi <= h_lo) continue;
    const int64_t rows = ceil_div(w < rows_len ? w : rows_len, r);  // max rows per segment
    p.w = w;
    p.r = r;
    p.branch = i;
    p.h_lo = h_lo;
    p.seg_lo = s_lo;
    p.tiles_per_seg = ceil_div(rows, bm);
    const int64_t blocks = (s_hi - s_lo) * p.tiles_per_seg;
    TORCH_CHECK(blocks <= 0x7fffffff, "ring_attention: too many tiles (", blocks, ")");
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(h_hi - h_lo),
                    static_cast<unsigned>(p.B));
    launch(kernel, grid, dim3(kThreads), smem, stream, p);
  }
}

// SIMT kernels hold NPL >= ceil(D / 32) values per lane; the loops stop at D,
// so a larger tier is correct (it only costs registers). fp32 gets three
// tiers, the other dtypes (fp64: gradcheck; fp16/bf16: head_dim > 128 or
// pre-sm_80 GPUs) one, to keep the build short.
inline int simt_npl(int64_t D) { return D <= 64 ? 2 : D <= 128 ? 4 : 8; }
// Padded head dim of the tensor-core kernels (D <= 128).
inline int mma_dp(int64_t D) { return D <= 64 ? 64 : D <= 96 ? 96 : 128; }

}  // namespace ring_attention::gpu
