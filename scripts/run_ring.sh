#!/usr/bin/env bash
# The main job: ring dilated attention across several processes, checked
# against one process. Sets up first (scripts/setup.sh), then launches
# `benchmarks/bench.py ring-run` under torchrun: one process per GPU (NCCL)
# when there are two or more GPUs, else $NPROC (default 4) CPU processes (gloo).
#
#   bash scripts/run_ring.sh --help       # every option, printed once
#   bash scripts/run_ring.sh --seq-len 32768 --backward --causal --layout zigzag
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
py=.venv/bin/python
for arg in "$@"; do
  if [[ "$arg" == -h || "$arg" == --help ]]; then
    exec "$py" benchmarks/bench.py ring-run --help
  fi
done
# Checks the arguments once, before any process starts, and says how many to start.
nproc=$("$py" benchmarks/bench.py ring-run --print-nproc "$@")
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cores / nproc > 0 ? cores / nproc : 1))}
echo "run_ring: torchrun with $nproc processes, $OMP_NUM_THREADS thread(s) each, on $cores cores"
exec "$py" -m torch.distributed.run --standalone --nproc-per-node="$nproc" \
  benchmarks/bench.py ring-run "$@"
