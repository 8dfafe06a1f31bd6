#!/usr/bin/env bash
# flash-attn-4 and its CuTe-DSL libraries for the GPU machine, which has no
# network: downloads the pinned wheels here (PyPI) and splits them into two
# folders that each travel in one call of the device tool (64 MiB a call, the
# working tree included; the CUDA 13 libraries wheel alone is 92 MB):
#
#   .fa4/a/  the DSL's MLIR library, xz-compressed        (~48 MiB)
#   .fa4/b/  the other wheels, the rest of the libraries  (~23 MiB)
#
# On the GPU machine, scripts/fa4_install.sh unpacks whichever part a call
# carried into build/fa4 (kept while the machine stays warm) and installs once
# both are there. Two calls, back to back on the same machine:
#
#   call 1, carry .fa4/a .prev:  bash scripts/gpu_check.sh --call 1   (unpacks part a)
#   call 2, carry .fa4/b:        bash scripts/gpu_check.sh --call 2   (installs, measures)
# (bash scripts/gpu_check.sh --plan prints both invocations with their budgets)
#
# Usage: bash scripts/fa4_wheels.sh   (from anywhere; ~4 minutes, mostly xz)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The pins (scripts/fa4_pins.txt) but the "cpu-only" ones: the GPU image has
# torch, einops, cuda-bindings, protobuf, typing-extensions.
mapfile -t PINS < <(sed -e 's/#.*//' scripts/fa4_pins.txt | grep -v -e '^ *$' -e '^cpu-only:')
PY=${PYTHON:-python3}
DL=build/fa4_download
rm -rf .fa4 "$DL"
mkdir -p .fa4/a .fa4/b "$DL"
# The GPU machine runs CPython 3.12 on x86-64 Linux.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DL" "${PINS[@]}"

libs=$(ls "$DL"/nvidia_cutlass_dsl_libs_cu13-*.whl)
for w in "$DL"/*.whl; do [[ $w == "$libs" ]] || cp "$w" .fa4/b/; done
# The libraries wheel, unpacked: its one large module to part a, the rest to b.
"$PY" - "$libs" "$DL/libs" <<'EOF'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
EOF
big=$(cd "$DL/libs" && find . -name '_cutlass_ir.cu13.*.so')
[[ -n $big ]] || { echo "fa4_wheels: no _cutlass_ir module in $libs" >&2; exit 1; }
echo "$big" >.fa4/a/path.txt
xz -9e -T0 -c "$DL/libs/$big" >.fa4/a/cutlass_ir.so.xz
rm "$DL/libs/$big"
tar -C "$DL/libs" -cf - . | xz -9e -T0 >.fa4/b/libs_cu13_rest.tar.xz

tree=$(git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f1)
for part in a b; do
  bytes=$(du -cb .fa4/$part | tail -n 1 | cut -f1)
  total=$((bytes + tree))
  echo "fa4_wheels: .fa4/$part $((bytes / 1048576)) MiB; with the tree $((total / 1048576)) MiB of 64"
  ((total < 64 * 1048576)) || { echo "fa4_wheels: .fa4/$part does not fit one call" >&2; exit 1; }
done
