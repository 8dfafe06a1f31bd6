// Which code a CPU block call runs: select_path() alone decides, once per
// call, from the inputs' dtype, the head dim and the scale, the machine (its
// instruction sets, as the build can use them; oneDNN's state) and the
// knobs (config.h). The kernels (block_forward.cpp, block_backward.cpp) act on
// what it returns.
//
// ISA: the machine's widest instruction set (generic < avx2 < avx512 <
// avx512_bf16 < amx; avx512 and above in builds for AVX-512, setup.py),
// capped by RING_ATTENTION_CPU_ISA. Knobs: RING_ATTENTION_CPU_BF16_GEMM
// (BF16), RING_ATTENTION_CPU_FP32_PACK (FP32). "d even": VNNI pairs along the
// head dim; "oneDNN": torch.backends.mkldnn on and libtorch's brgemm runs bf16
// VNNI products (bf16_brgemm()); "MKL": libtorch's BLAS has MKL's bf16 GEMM.
//
//   inputs          | when (first row that holds)                    | path           | lanes
//   ----------------+------------------------------------------------+----------------+--------
//   fp64            | always                                         | kBlas (dgemm)  | kVec
//   bf16            | ISA >= avx512_bf16, MKL, BF16 auto, d even,    | kBf16Packed    | kAvx512
//                   |   oneDNN, scale > 0                            |                |
//   bf16            | ISA >= avx512_bf16, MKL, BF16 auto or mkl      | kBf16Mkl       | kAvx512
//   fp32, fp16,     | fp32 inputs, ISA amx, FP32 auto, d even,       | kFp32Split     | kAvx512
//   bf16 (no bf16   |   oneDNN, scale > 0                            |                |
//   tiles above)    | ISA >= avx512, FP32 auto or fp32, scale > 0    | kFp32Brgemm    | kAvx512
//                   | ISA avx2, FP32 auto or fp32, scale > 0         | kFp32Avx2      | kAvx2
//                   | otherwise (ISA generic, FP32 0, scale <= 0)    | kBlas (sgemm)  | ISA's
//
// ("ISA's" lanes: kAvx512 from avx512 up, kAvx2 at avx2, kVec at generic.)
// fp16 inputs, and bf16 ones without bf16 tiles, are converted to fp32 tiles
// as the kernels read them (K and V before they are packed). RING_ATTENTION_CPU_ISA above what the
// machine runs raises ValueError naming the values it accepts here.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../config.h"
#include "softmax_rows.h"

namespace ring_attention::cpu {

enum class TileGemm : uint8_t {
  kBlas,        // tiles in place (fp16/bf16 converted to fp32): sgemm_ / dgemm_
  kFp32Avx2,    // fp32, K/V packed per key run: the AVX2 kernels (packed_tiles.h)
  kFp32Brgemm,  // fp32, K/V packed per key run: oneDNN's brgemm fp32 kernels
  kFp32Split,   // kFp32Brgemm with S (and dP) as six bf16 products (split_products.h)
  kBf16Mkl,     // bf16 tiles in place: MKL's gemm_bf16bf16f32
  kBf16Packed,  // bf16, K/V packed in VNNI pairs: oneDNN's brgemm
};

struct TilePath {
  TileGemm gemm;
  Lanes lanes;  // the softmax passes' vector code (softmax_rows.h)

  // The GEMMs read bf16 tiles (tile_t bf16), else acc_t tiles.
  bool bf16_tiles() const { return gemm == TileGemm::kBf16Mkl || gemm == TileGemm::kBf16Packed; }
  // K and V are packed (once per key run in the forward, per key tile in the
  // backward) and multiplied by gemm_packed; S comes out unscaled.
  bool packed() const { return gemm != TileGemm::kBlas && gemm != TileGemm::kBf16Mkl; }
  bool split() const { return gemm == TileGemm::kFp32Split; }
};

// The path of a block call on inputs of `dtype`, head dim d, softmax scale.
TilePath select_path(c10::ScalarType dtype, int64_t head_dim, double scale);

// The kernels' passes, as path_runs() counts them.
enum class Pass : uint8_t { kForward, kBackward };

// select_path() for a block call of `pass` about to run on that path: the
// run is counted (path_runs()). block_forward and block_backward call this.
TilePath run_path(Pass pass, c10::ScalarType dtype, int64_t head_dim, double scale);

// The name of a path: the TileGemm without its k, then the lanes, e.g.
// "Fp32Avx2/avx2".
std::string path_name(TilePath path);

// The name of select_path's choice for inputs of `dtype` ("float64",
// "float32", "bfloat16" or "float16") (Python: ring_attention._C.
// cpu_tile_path, for tests and benchmarks).
std::string describe_path(std::string_view dtype, int64_t head_dim, double scale);

// How many block calls of this process ran each path, by pass: "forward
// Bf16Packed/avx512" -> count, the paths run at least once (Python:
// ring_attention._C.cpu_tile_path_runs: what a test sees the kernels run).
std::vector<std::pair<std::string, uint64_t>> path_runs();

// The machine's widest ISA as the build can use it (RING_ATTENTION_CPU_ISA
// not applied).
config::CpuIsa machine_isa();

}  // namespace ring_attention::cpu
