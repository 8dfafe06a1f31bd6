// The extension's knobs: every RING_ATTENTION_* environment variable the C++
// code reads is parsed here, and only here. Each accessor reads its variable
// at the call (a test may change it between calls) and parses it again only
// when the string changed; unset and empty mean the default. A value outside
// the accepted ones raises ValueError naming the variable, the accepted values
// and the value given (as the Python knobs do).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace ring_attention::config {

// RING_ATTENTION_CHUNK_MIB: the fp32 accumulator budget of a low-precision
// local op's chunk, a whole number of MiB from 0 to 2**30 (0: none, the
// 8-chunk rule alone); nullopt when unset (the device's default).
std::optional<int64_t> chunk_mib();

// The instruction sets the CPU kernels tell apart, narrowest first.
enum class CpuIsa : uint8_t { kGeneric, kAvx2, kAvx512, kAvx512Bf16, kAmx };
std::string_view isa_name(CpuIsa isa);

// RING_ATTENTION_CPU_ISA: the widest instruction set the CPU kernels may use
// (auto | generic | avx2 | avx512 | avx512_bf16 | amx; nullopt: auto, what
// the machine and the build have). A narrower one runs that ISA's path on a
// wider machine (tests run every path this way); a wider one than the
// machine has is refused where the kernels pick their path
// (cpu/tile_path.h).
std::optional<CpuIsa> cpu_isa();

// RING_ATTENTION_CPU_FP32_PACK: fp32 tiles packed once per key run (auto,
// the default: split into bf16 parts on AMX, else the ISA's packed kernels),
// packed without the split (fp32), or multiplied in place by the BLAS (0).
enum class Fp32Pack : uint8_t { kAuto, kFp32, kOff };
Fp32Pack cpu_fp32_pack();

// RING_ATTENTION_CPU_BF16_GEMM: bf16 tiles multiplied as bf16 where the CPU
// has bf16 dot products (auto, the default: oneDNN's brgemm on packed
// tiles where it runs, else MKL's bf16 GEMM), through MKL's bf16 GEMM
// without packing (mkl), or converted to fp32 first (0).
enum class Bf16Gemm : uint8_t { kAuto, kMkl, kOff };
Bf16Gemm cpu_bf16_gemm();

}  // namespace ring_attention::config
