#!/usr/bin/env bash
# Install whatever is missing for ring_attention and build its extension in
# place. Idempotent: a second run only rebuilds when csrc/ changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --disable-pip-version-check)

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch (${RING_ATTENTION_TORCH:-torch==2.13.0})"
  "${PIP[@]}" "${RING_ATTENTION_TORCH:-torch==2.13.0}"
fi
# Build tools and test tools (skipped when present; transformers: the hf extra's tests).
missing=()
for mod in setuptools wheel pytest ninja transformers; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  "${PIP[@]}" "${missing[@]}"
fi

# The package must import from THIS checkout (not another editable install).
here=$(pwd -P)
if ! (cd / && "$PY" -c "import os, sys, ring_attention as r; sys.exit(os.path.realpath(r.__file__).startswith('$here/') == 0)") 2>/dev/null; then
  echo "setup: building ring_attention._C and installing this checkout (editable)"
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "${PIP[@]}" --no-build-isolation --no-deps -e . \
    >/tmp/ring_attention_install.log 2>&1 || { tail -n 40 /tmp/ring_attention_install.log; exit 1; }
fi
# Rebuild in place when any C++/CUDA source is newer than the extension.
so=$(ls ring_attention/_C*.so 2>/dev/null | head -n 1 || true)
if [ -z "$so" ] || [ -n "$(find csrc setup.py -newer "$so" -type f 2>/dev/null | head -n 1)" ]; then
  echo "setup: rebuilding ring_attention._C"
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" setup.py -q build_ext --inplace >/tmp/ring_attention_build.log 2>&1 ||
    { tail -n 40 /tmp/ring_attention_build.log; exit 1; }
fi
