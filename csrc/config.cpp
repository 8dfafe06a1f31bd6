#include "config.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>

namespace ring_attention::config {
namespace {

// One variable's last string and its parsed value: parse runs again only
// when the string changes (a bad value raises every time and is not kept).
template <typename T>
class Knob {
 public:
  using Parse = T (*)(const char* var, const std::string& value);
  Knob(const char* var, Parse parse) : var_(var), parse_(parse) {}

  T get() {
    const char* env = std::getenv(var_);
    const std::string now = env == nullptr ? "" : env;
    std::lock_guard<std::mutex> lock(mutex_);
    if (!cached_ || now != last_) {
      value_ = parse_(var_, now);
      last_ = now;
      cached_ = true;
    }
    return value_;
  }

 private:
  const char* var_;
  Parse parse_;
  std::mutex mutex_;
  bool cached_ = false;
  std::string last_;
  T value_{};
};

// A value from a list of names ("" is the first entry's).
template <typename T, size_t N>
T choose(const char* var, const std::string& value,
         const std::pair<std::string_view, T> (&names)[N]) {
  if (value.empty()) return names[0].second;
  for (const auto& [name, v] : names)
    if (value == name) return v;
  std::ostringstream accepted;
  for (size_t i = 0; i < N; ++i) accepted << (i ? ", '" : "['") << names[i].first << "'";
  TORCH_CHECK_VALUE(false, var, " must be one of ", accepted.str(), "], got '", value, "'");
}

constexpr int64_t kMaxChunkMiB = int64_t{1} << 30;  // 1 PiB: no overflow in bytes

std::optional<int64_t> parse_chunk_mib(const char* var, const std::string& value) {
  if (value.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long mib = std::strtoll(value.c_str(), &end, 10);
  TORCH_CHECK_VALUE(
      end != value.c_str() && *end == '\0' && errno == 0 && mib >= 0 && mib <= kMaxChunkMiB, var,
      " must be a whole number of MiB from 0 to ", kMaxChunkMiB, ", got '", value, "'");
  return static_cast<int64_t>(mib);
}

constexpr std::pair<std::string_view, std::optional<CpuIsa>> kIsaNames[] = {
    {"auto", std::nullopt},      {"generic", CpuIsa::kGeneric},        {"avx2", CpuIsa::kAvx2},
    {"avx512", CpuIsa::kAvx512}, {"avx512_bf16", CpuIsa::kAvx512Bf16}, {"amx", CpuIsa::kAmx},
};

std::optional<CpuIsa> parse_isa(const char* var, const std::string& value) {
  return choose(var, value, kIsaNames);
}

Fp32Pack parse_fp32_pack(const char* var, const std::string& value) {
  constexpr std::pair<std::string_view, Fp32Pack> names[] = {
      {"auto", Fp32Pack::kAuto}, {"fp32", Fp32Pack::kFp32}, {"0", Fp32Pack::kOff}};
  return choose(var, value, names);
}

Bf16Gemm parse_bf16_gemm(const char* var, const std::string& value) {
  constexpr std::pair<std::string_view, Bf16Gemm> names[] = {
      {"auto", Bf16Gemm::kAuto}, {"mkl", Bf16Gemm::kMkl}, {"0", Bf16Gemm::kOff}};
  return choose(var, value, names);
}

}  // namespace

std::string_view isa_name(CpuIsa isa) {
  for (const auto& [name, v] : kIsaNames)
    if (v == isa) return name;
  return "?";
}

std::optional<int64_t> chunk_mib() {
  static Knob<std::optional<int64_t>> knob("RING_ATTENTION_CHUNK_MIB", parse_chunk_mib);
  return knob.get();
}

std::optional<CpuIsa> cpu_isa() {
  static Knob<std::optional<CpuIsa>> knob("RING_ATTENTION_CPU_ISA", parse_isa);
  return knob.get();
}

Fp32Pack cpu_fp32_pack() {
  static Knob<Fp32Pack> knob("RING_ATTENTION_CPU_FP32_PACK", parse_fp32_pack);
  return knob.get();
}

Bf16Gemm cpu_bf16_gemm() {
  static Knob<Bf16Gemm> knob("RING_ATTENTION_CPU_BF16_GEMM", parse_bf16_gemm);
  return knob.get();
}

}  // namespace ring_attention::config
