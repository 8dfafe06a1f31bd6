#!/usr/bin/env bash
# ruff (Python) and clang-format (C++/CUDA) from the project's .venv must be
# clean, and commit subjects short.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --no-build
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/*.h' 'tests/*.cpp' 'benchmarks/*.cpp' |
  xargs .venv/bin/clang-format --dry-run --Werror
# Commit subjects: at most 72 characters (figures go in the body). Checked from
# f9b0f44, the last commit written before the rule; older subjects stay as
# written, since the journal cites their hashes.
if git rev-parse --git-dir >/dev/null 2>&1; then
  range=HEAD
  if git rev-parse -q --verify 'f9b0f44^{commit}' >/dev/null; then range=f9b0f44..HEAD; fi
  long=$(git log --format='%h %s' "$range" | awk 'length($0) - index($0, " ") > 72')
  if [[ -n "$long" ]]; then
    echo "lint: commit subjects longer than 72 characters:" >&2
    echo "$long" >&2
    exit 1
  fi
fi
echo "lint: clean"
