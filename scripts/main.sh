#!/usr/bin/env bash
# The main job: ring dilated attention across several processes (one per GPU
# with NCCL when there are at least two GPUs, else 4 CPU processes on gloo),
# checked against a single process. Extra arguments go to ring_main.py, e.g.
#   scripts/main.sh --seq-len 32768 --backward --causal --layout zigzag
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then nproc_per_node=$gpus; else nproc_per_node=${NPROC:-4}; fi
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node="$nproc_per_node" \
  benchmarks/ring_main.py "$@"
