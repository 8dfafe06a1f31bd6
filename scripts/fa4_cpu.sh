#!/usr/bin/env bash
# flash-attn-4 for THIS machine's interpreter, without a GPU: the pinned
# wheels (scripts/fa4_pins.txt) installed with `pip --target` into
# build/fa4_cpu/site, beside the torch of .venv. Its Python interface and the
# CuTe DSL's compile then run on the CPU with fake CUDA tensors
# (benchmarks/fa4_interface.py, tests/test_fa4_interface.py); nothing runs a
# kernel. About 110 MB downloaded, 300 MB installed (measured figures:
# benchmarks/journal/2026-12-07-gpu-plan.md).
#
#   bash scripts/fa4_cpu.sh                      # install (nothing to do when complete)
#   source <(bash scripts/fa4_cpu.sh --env)      # PYTHONPATH and the cross-compile target
#
# Exit status: 0 installed and importable, 1 otherwise (pip's or the
# import's error above). Environment: PYTHON (default .venv/bin/python, else
# python3), FA4_CPU_DEST (default build/fa4_cpu).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
DEST=$(realpath -m "${FA4_CPU_DEST:-build/fa4_cpu}")
SITE=$DEST/site
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
# The DSL adds its packages to sys.path from a .pth file, which PYTHONPATH
# entries do not run: name that folder too. FA4's documented cross-compile
# variables: Hopper (sm_90a) with an H100's / H200's 132 SMs. Its kernel
# cache goes beside the install, so a second run compiles nothing.
env_lines() {
  echo "export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export FLASH_ATTENTION_ARCH=sm_90 CUTE_DSL_ARCH=sm_90a FLASH_ATTENTION_NUM_SMS=132"
  echo "export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$DEST/cache"
}
if [[ "${1:-}" == "--env" ]]; then
  env_lines
  exit 0
fi
pins=$(sed -e 's/#.*//' -e 's/^cpu-only: *//' scripts/fa4_pins.txt | grep -v '^ *$')
stamp=$(echo "$pins" | sha256sum | cut -c1-16)
if [[ "$(cat "$SITE/.complete" 2>/dev/null)" != "$stamp" ]]; then
  rm -rf "$SITE"
  mkdir -p "$SITE"
  t=$SECONDS
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-input --disable-pip-version-check --no-deps --no-compile \
    --only-binary=:all: --target "$SITE" $pins || exit 1
  echo "$stamp" >"$SITE/.complete"
  echo "fa4_cpu: installed into $SITE in $((SECONDS - t)) s ($(du -sh "$SITE" | cut -f1))"
fi
eval "$(env_lines)"
"$PY" -c 'import benchmarks.fa4_interface as f; print("fa4_cpu: flash_attn.cute imports:", f.load_interface().__file__)' || exit 1
