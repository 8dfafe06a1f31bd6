#!/usr/bin/env bash
# Compile every csrc/cuda/*.cu to an object file (sm_80 and sm_90; --arch)
# with the flags torch's CUDAExtension uses, and the CUDA build's host-only
# csrc/cuda/*.cpp with setup.py's C++ flags (warnings are errors). Needs nvcc
# and torch (headers), no GPU. Prints one line per file; exits non-zero if any
# file fails. A kernel (or any device function) that ptxas reports spilling
# registers to local memory fails its file too (scripts/ptxas_spills.py
# prints each such function with its spill stores / loads), so a change that
# makes a kernel spill fails CI. The largest source starts first, and each
# nvcc compiles its architectures in parallel (--threads), so the last file
# to finish keeps both cores busy. Then checks that the objects' project symbols are defined
# by them or by the CPU sources (scripts/cuda_link_check.py; the built CPU
# extension stands for those).
#   usage: scripts/compile_cuda.sh [-j N] [--arch LIST] [--keep DIR]
#     -j N        N parallel compile jobs (default 2)
#     --arch LIST the architectures, comma-separated (default 80,90; CI
#                 compiles 90 only: the sources have no sm_80-only code, so
#                 the front end sees the same code and only ptxas differs)
#     --keep DIR  keep the objects (DIR/<name>.o) and the compiler's output
#                 with ptxas' resource report (DIR/<name>.log), e.g. for
#                 scripts/sass_loop.py
set -euo pipefail

jobs=2
keep=""
archs=80,90
while [[ $# -gt 0 ]]; do
  case "$1" in
    -j) jobs="${2:?-j needs a number}"; shift ;;
    --arch) archs="${2:?--arch needs a list, e.g. 80,90}"; shift ;;
    --keep) keep="${2:?--keep needs a folder}"; shift ;;
    *) echo "compile_cuda: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc_bin="$(command -v nvcc || true)"
if [[ -z "$nvcc_bin" && -x /usr/local/cuda/bin/nvcc ]]; then nvcc_bin=/usr/local/cuda/bin/nvcc; fi
if [[ -z "$nvcc_bin" ]]; then
  echo "compile_cuda: nvcc not found (PATH or /usr/local/cuda/bin)" >&2
  exit 1
fi
python="${PYTHON:-python3}"

mapfile -t includes < <("$python" -c '
import sysconfig
from torch.utils.cpp_extension import include_paths
for p in include_paths():
    print(p)
print(sysconfig.get_paths()["include"])')
abi="$("$python" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')"

flags=(-std=c++17 -O3 --expt-relaxed-constexpr -Xcompiler -fPIC
  "-D_GLIBCXX_USE_CXX11_ABI=${abi}" -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)
IFS=, read -ra arch_list <<<"$archs"
for a in "${arch_list[@]}"; do
  if [[ ! $a =~ ^[0-9]+a?$ ]]; then
    echo "compile_cuda: --arch takes compute capabilities like 80,90,90a, got $archs" >&2
    exit 2
  fi
  flags+=(-gencode "arch=compute_$a,code=sm_$a")
done
for inc in "${includes[@]}"; do flags+=(-isystem "$inc"); done
# A CPU-only torch wheel ships c10/cuda headers without their generated config
# header; it only carries export macros, so skip it there.
if [[ ! -f "${includes[0]}/c10/cuda/impl/cuda_cmake_macros.h" ]]; then
  flags+=(-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE)
fi

# ptxas' resource report (registers, stack, spills) of every function, in
# each file's log: scripts/ptxas_spills.py reads it. The SIMT kernels (fp32,
# fp64, fp16/bf16 before sm_80, the backward past head_dim 128; not the
# tensor-core path) still spill tens of bytes and are allowed by name until
# they are fixed (csrc/cuda/README.md); every other function must not spill.
flags+=(--ptxas-options=-v)
allow_spills='_simt_kernel<'
if [[ -n "$keep" ]]; then
  mkdir -p "$keep"
  out="$(cd "$keep" && pwd)"
else
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
fi

cxx_flags=(-O3 -std=c++20 -fvisibility=hidden -fopenmp -Wall -Wextra -Werror -fPIC
  "-D_GLIBCXX_USE_CXX11_ABI=${abi}" -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H)
for inc in "${includes[@]}"; do cxx_flags+=(-isystem "$inc"); done

shopt -s nullglob
sources=("$root"/csrc/cuda/*.cu)
if [[ ${#sources[@]} -eq 0 ]]; then
  echo "compile_cuda: no csrc/cuda/*.cu files" >&2
  exit 1
fi
# Largest first: a proxy for the compile time, so the longest job never starts last.
mapfile -t sources < <(ls -S "${sources[@]}" "$root"/csrc/cuda/*.cpp)

compile_one() {
  local src="$1" file name log start cmd
  file="$(basename "$src")"
  name="${file%.*}"
  log="$out/$name.log"
  start=$SECONDS
  if [[ $file == *.cu ]]; then
    cmd=("$nvcc_bin" "${flags[@]}" --threads "${#arch_list[@]}")
  else
    cmd=("${CXX:-c++}" "${cxx_flags[@]}")
  fi
  if "${cmd[@]}" -c "$src" -o "$out/$name.o" >"$log" 2>&1; then
    local spills="" note=""
    if [[ $file == *.cu ]]; then
      if ! spills="$("$python" "$root/scripts/ptxas_spills.py" --allow "$allow_spills" "$log")"; then
        rm -f "$out/$name.o"
        echo "FAIL csrc/cuda/$file ($((SECONDS - start)) s): registers spill to local memory"
        sed 's/^/    /' <<<"$spills"
        return 1
      fi
      local allowed
      allowed="$(grep -c '^allowed: ' <<<"$spills" || true)"
      if ((allowed > 0)); then note=", $allowed SIMT kernels spill (allowed):"; fi
    fi
    echo "ok   csrc/cuda/$file ($((SECONDS - start)) s$note)"
    if [[ -n "$note" ]]; then grep '^allowed: ' <<<"$spills" | sed 's/^allowed: /    /'; fi
  else
    rm -f "$out/$name.o"
    echo "FAIL csrc/cuda/$file ($((SECONDS - start)) s)"
    sed 's/^/    /' "$log"
    return 1
  fi
}

for src in "${sources[@]}"; do
  while (($(jobs -rp | wc -l) >= jobs)); do wait -n || true; done
  compile_one "$src" &
done
wait || true

status=0
for src in "${sources[@]}"; do
  name="$(basename "$src")"
  [[ -f "$out/${name%.*}.o" ]] || status=1
done
# The objects against the CPU sources they link with (scripts/cuda_link_check.py).
so=("$root"/ring_attention/_C*.so)
if ((status == 0)); then
  if [[ ${#so[@]} -gt 0 ]]; then
    "$python" "$root/scripts/cuda_link_check.py" "$out"/*.o --cpu-extension "${so[0]}" || status=1
  elif [[ "${CI:-}" == true ]]; then
    echo "compile_cuda: no built CPU extension to check the link against" >&2
    status=1
  else
    echo "compile_cuda: link not checked (build the CPU extension first: scripts/setup.sh)"
  fi
fi
exit "$status"
