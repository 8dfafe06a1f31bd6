#!/usr/bin/env bash
# ruff (Python) and clang-format (C++/CUDA) from the project's .venv must be clean.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --no-build
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/*.h' 'tests/*.cpp' 'benchmarks/*.cpp' |
  xargs .venv/bin/clang-format --dry-run --Werror
echo "lint: clean"
