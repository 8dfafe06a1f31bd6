#include "tile_path.h"

#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <sstream>

#include "packed_tiles.h"
#include "tile_math.h"

namespace ring_attention::cpu {

using config::CpuIsa;

CpuIsa machine_isa() {
#if defined(__x86_64__)
  static const CpuIsa isa = [] {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return CpuIsa::kGeneric;
#if defined(CPU_CAPABILITY_AVX512)
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
      return CpuIsa::kAvx2;
    if (!__builtin_cpu_supports("avx512bf16")) return CpuIsa::kAvx512;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16"))
      return CpuIsa::kAvx512Bf16;
    return CpuIsa::kAmx;
#else
    return CpuIsa::kAvx2;  // (the AVX-512 code is not in this build)
#endif
  }();
  return isa;
#else
  return CpuIsa::kGeneric;
#endif
}

namespace {

// The ISA the kernels may use: the machine's, capped by RING_ATTENTION_CPU_ISA.
CpuIsa isa_for_call() {
  const CpuIsa machine = machine_isa();
  const std::optional<CpuIsa> asked = config::cpu_isa();
  if (!asked.has_value()) return machine;
  if (*asked > machine) {
    std::ostringstream accepted;
    accepted << "'auto'";
    for (int i = 0; i <= static_cast<int>(machine); ++i)
      accepted << ", '" << config::isa_name(static_cast<CpuIsa>(i)) << "'";
    TORCH_CHECK_VALUE(false, "RING_ATTENTION_CPU_ISA='", config::isa_name(*asked),
                      "' is wider than this machine and build run: it must be one of [",
                      accepted.str(), "]");
  }
  return *asked;
}

Lanes lanes_of(CpuIsa isa) {
  if (isa >= CpuIsa::kAvx512) return Lanes::kAvx512;
  return isa == CpuIsa::kAvx2 ? Lanes::kAvx2 : Lanes::kVec;
}

}  // namespace

TilePath select_path(c10::ScalarType dtype, int64_t head_dim, double scale) {
  // Every knob is read (and checked) whatever the call needs of it.
  const CpuIsa isa = isa_for_call();
  const config::Bf16Gemm bf16 = config::cpu_bf16_gemm();
  const config::Fp32Pack fp32 = config::cpu_fp32_pack();
  if (dtype == c10::kDouble) return {TileGemm::kBlas, Lanes::kVec};
  const bool even = head_dim % 2 == 0, positive = scale > 0;
  if (dtype == c10::kBFloat16 && isa >= CpuIsa::kAvx512Bf16 && has_bf16_gemm() &&
      bf16 != config::Bf16Gemm::kOff) {
    if (bf16 == config::Bf16Gemm::kAuto && even && positive && bf16_brgemm())
      return {TileGemm::kBf16Packed, Lanes::kAvx512};
    return {TileGemm::kBf16Mkl, Lanes::kAvx512};
  }
  // fp32 tiles (fp16 and bf16 converted as they are read).
  const bool pack = positive && fp32 != config::Fp32Pack::kOff;
  if (pack && isa >= CpuIsa::kAvx512) {
    // AMX as oneDNN sees it: bf16 VNNI products run, and pack (AMX's layout).
    // The split takes fp32 inputs only (it scores non-finite rows from them).
    if (dtype == c10::kFloat && isa == CpuIsa::kAmx && fp32 == config::Fp32Pack::kAuto && even &&
        bf16_brgemm() && at::native::cpublas::could_pack(at::kBFloat16))
      return {TileGemm::kFp32Split, Lanes::kAvx512};
    return {TileGemm::kFp32Brgemm, Lanes::kAvx512};
  }
  if (pack && isa == CpuIsa::kAvx2) return {TileGemm::kFp32Avx2, Lanes::kAvx2};
  return {TileGemm::kBlas, lanes_of(isa)};
}

namespace {

constexpr int kGemms = static_cast<int>(TileGemm::kBf16Packed) + 1;
constexpr int kLanes = static_cast<int>(Lanes::kAvx512) + 1;

// The runs of each (pass, gemm, lanes): a relaxed increment per block call.
std::atomic<uint64_t> runs[2][kGemms][kLanes];

}  // namespace

TilePath run_path(Pass pass, c10::ScalarType dtype, int64_t head_dim, double scale) {
  const TilePath path = select_path(dtype, head_dim, scale);
  runs[static_cast<int>(pass)][static_cast<int>(path.gemm)][static_cast<int>(path.lanes)].fetch_add(
      1, std::memory_order_relaxed);
  return path;
}

std::string path_name(TilePath path) {
  const char* gemm = "?";
  switch (path.gemm) {
    case TileGemm::kBlas:
      gemm = "Blas";
      break;
    case TileGemm::kFp32Avx2:
      gemm = "Fp32Avx2";
      break;
    case TileGemm::kFp32Brgemm:
      gemm = "Fp32Brgemm";
      break;
    case TileGemm::kFp32Split:
      gemm = "Fp32Split";
      break;
    case TileGemm::kBf16Mkl:
      gemm = "Bf16Mkl";
      break;
    case TileGemm::kBf16Packed:
      gemm = "Bf16Packed";
      break;
  }
  const char* lanes = path.lanes == Lanes::kAvx512 ? "avx512"
                      : path.lanes == Lanes::kAvx2 ? "avx2"
                                                   : "vec";
  return std::string(gemm) + "/" + lanes;
}

std::string describe_path(std::string_view dtype, int64_t head_dim, double scale) {
  c10::ScalarType type = c10::kFloat;
  if (dtype == "float64")
    type = c10::kDouble;
  else if (dtype == "bfloat16")
    type = c10::kBFloat16;
  else if (dtype == "float16")
    type = c10::kHalf;
  else
    TORCH_CHECK_VALUE(dtype == "float32", "dtype must be one of float64, float32, bfloat16, ",
                      "float16, got '", dtype, "'");
  return path_name(select_path(type, head_dim, scale));
}

std::vector<std::pair<std::string, uint64_t>> path_runs() {
  std::vector<std::pair<std::string, uint64_t>> out;
  for (int pass = 0; pass < 2; ++pass)
    for (int gemm = 0; gemm < kGemms; ++gemm)
      for (int lanes = 0; lanes < kLanes; ++lanes) {
        const uint64_t n = runs[pass][gemm][lanes].load(std::memory_order_relaxed);
        if (n == 0) continue;
        const TilePath path{static_cast<TileGemm>(gemm), static_cast<Lanes>(lanes)};
        out.emplace_back(std::string(pass == 0 ? "forward " : "backward ") + path_name(path), n);
      }
  return out;
}

}  // namespace ring_attention::cpu
