#!/usr/bin/env bash
# The whole test suite (CPU; CUDA tests run too where a GPU is present).
# Extra arguments go to pytest, e.g. scripts/test.sh -k ring -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
