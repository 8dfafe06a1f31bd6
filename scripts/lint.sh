#!/usr/bin/env bash
# ruff (Python) and clang-format (C++/CUDA) must be clean.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff --version >/dev/null 2>&1 || "$PY" -m pip install -q --disable-pip-version-check ruff
command -v clang-format >/dev/null 2>&1 || "$PY" -m pip install -q --disable-pip-version-check clang-format
"$PY" -m ruff check .
"$PY" -m ruff format --check .
git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/*.h' 'tests/*.cpp' | xargs clang-format --dry-run --Werror
echo "lint: clean"
