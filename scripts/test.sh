#!/usr/bin/env bash
# Set up (scripts/setup.sh), build the CUDA-emulator test extension, then run
# the whole test suite (CPU; the CUDA tests run too where a GPU is present),
# one pytest-xdist worker per core (PYTEST_WORKERS=N to choose, 0: in this
# process). On 2 CPU cores: a fresh setup 6-8 min, the emulator's build 2-4
# min the first time, the suite about 12 min on 2 workers (2 cores).
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -k ring -x
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
py=.venv/bin/python

# tests/cuda_emulator runs the .cu kernels on the CPU; its extension takes 2-4
# min to compile the first time on 2 cores. Built here, with a clock, rather
# than silently inside the first test that needs it; a second run only checks
# it is current.
if [[ -f tests/cuda_emulator/build.py ]]; then
  log=build/logs/cuda_emulator.log
  mkdir -p build/logs
  start=$SECONDS
  (cd tests && exec "../$py" -c '
from cuda_emulator import build
if build.load() is None:
    print("not built:", build.MISSING)
') >"$log" 2>&1 &
  pid=$!
  shown=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if (((SECONDS - start) % 10 == 5)); then
      echo "test: building the CUDA emulator (tests/cuda_emulator; 2-4 min on 2 cores the first time) ... $((SECONDS - start)) s"
      shown=1
    fi
  done
  if ! wait "$pid"; then
    echo "test: the CUDA emulator did not build (its tests will fail); the end of $log:" >&2
    tail -n 30 "$log" >&2
  elif grep -q "^not built:" "$log"; then
    echo "test: CUDA emulator $(grep '^not built:' "$log")"
  elif ((shown)); then
    echo "test: CUDA emulator built in $((SECONDS - start)) s"
  fi
fi
# The tests in parallel: one worker per core (pytest-xdist, the test extra);
# a worker takes the next test when it is free (uneven test times).
workers=${PYTEST_WORKERS:-auto}
xdist=()
if [[ "$workers" != 0 ]]; then
  xdist=(-n "$workers" --dist worksteal)
fi
echo "test: the suite (about 14 min on 2 cores with 2 workers; workers: $workers)"
# the 25 slowest tests at the end: where the CI time goes
exec "$py" -m pytest -q --durations=25 "${xdist[@]}" "$@"
