#!/usr/bin/env bash
# Build the CPU kernels with AddressSanitizer + UndefinedBehaviorSanitizer (and
# the CUDA emulator with UndefinedBehaviorSanitizer: its fibers switch stacks,
# which AddressSanitizer would misread) in a copy of the sources under
# build/sanitize/, and run the operator, ring and emulator tests against them.
# Any report fails the run (halt_on_error). The checkout's own build is not
# touched. --memcheck instead runs valgrind's memcheck, which finds reads of
# uninitialised memory (ASan does not), on a build without AVX-512 under
# build/memcheck/ (valgrind does not run AVX-512 code: the AVX-512 and AMX
# paths stay unchecked there); it fails on a report whose stack, or the
# origin of whose value, is in the extension (torch's own are counted only).
#
#   bash scripts/sanitize.sh            # op, limits, NaN, ring and emulator tests (~15 min on 2 cores)
#   bash scripts/sanitize.sh --fast     # the CI subset (~8 min on 2 cores)
#   bash scripts/sanitize.sh -- -k gqa  # extra pytest arguments after --
#   bash scripts/sanitize.sh --memcheck # the block operators' CPU tests under valgrind (~15 min)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd -P)
mode=asan
fast=0
extra=()
while (($#)); do
  case "$1" in
    --fast) fast=1 ;;
    --memcheck) mode=memcheck ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "sanitize: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ $mode == memcheck ]] && ! command -v valgrind >/dev/null; then
  echo "sanitize: valgrind not found (apt install valgrind)" >&2
  exit 2
fi
bash scripts/setup.sh --no-build
py=$root/.venv/bin/python
name=$([[ $mode == asan ]] && echo sanitize || echo memcheck)
work=$root/build/$name
src=$work/src
mkdir -p "$root/build/logs"
# A copy of the sources: `python -m pytest` run there imports its ring_attention.
rm -rf "$src"
mkdir -p "$src"
cp -a setup.py pyproject.toml csrc ring_attention tests "$src/"
rm -f "$src"/ring_attention/_C*.so
log=$root/build/logs/${name}_build.log
build_start=$SECONDS
emu_pid=""
if [[ $mode == asan ]]; then
  export RING_ATTENTION_EMULATOR_SANITIZE="-fsanitize=undefined -fno-sanitize-recover=undefined"
fi
if [[ $mode == asan && -f tests/cuda_emulator/build.py ]]; then
  # The emulator's UBSan build (into the copy's build/) runs beside the CPU
  # kernels' build rather than inside the first emulator test, where the
  # other core would wait on it. It imports the checkout's ring_attention,
  # not the copy's: the ASan build loads only under LD_PRELOAD.
  emu_log=$root/build/logs/${name}_emulator_build.log
  (cd "$src/tests" && PYTHONPATH=$root exec "$py" -c '
from cuda_emulator import build
if build.load() is None:
    print("not built:", build.MISSING)
') >"$emu_log" 2>&1 &
  emu_pid=$!
fi
if [[ $mode == asan ]]; then
  flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
  build_env=(CFLAGS="$flags" LDFLAGS="$flags")
  echo "sanitize: building the CPU kernels with ASan + UBSan (log: build/logs/${name}_build.log)"
else
  build_env=(RING_ATTENTION_GENERIC_CPU=1)
  echo "sanitize: building the CPU kernels without AVX-512 (log: build/logs/${name}_build.log)"
fi
(cd "$src" && env "${build_env[@]}" RING_ATTENTION_CPU_ONLY=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  "$py" setup.py build_ext --inplace --build-temp "$work/tmp") >"$log" 2>&1 || {
  tail -n 40 "$log" >&2
  [[ -z $emu_pid ]] || wait "$emu_pid" || true # leave no build behind
  exit 1
}
if [[ -n $emu_pid ]]; then
  if ! wait "$emu_pid"; then
    echo "sanitize: the UBSan emulator did not build; the end of build/logs/${name}_emulator_build.log:" >&2
    tail -n 30 "$emu_log" >&2
    exit 1
  fi
  echo "sanitize: built the emulator with UBSan beside the CPU kernels ($((SECONDS - build_start)) s for both)"
fi

ring=tests/test_ring.py::test_ring_matches_single_process_and_oracle
emu=tests/test_cuda_emulated.py::test_kernels_match_oracle
if [[ $mode == memcheck ]]; then
  tests=(tests/test_block_ops.py)
  ((${#extra[@]})) || extra=(-k "not cuda")
elif ((fast)); then
  # The ring's cases all run in one launch per world size: one launch (3 ranks).
  # The longest targets first, so that a worker starts them early.
  tests=("$ring[3-documents]" "$ring[3-gqa]" "$ring[3-huge_values]" "$ring[3-lse_documents_gqa]"
    "$emu[mma64-bf16-longnet-groups-mask-causal]" "$emu[simt-f32-d72-longnet-groups-mask-full]"
    tests/test_limits.py tests/test_nan_exclusion.py tests/test_exchange_rows.py tests/test_block_ops.py
    tests/test_cpu_tile_paths.py)
else
  tests=(tests/test_local_op.py tests/test_block_ops.py tests/test_opcheck.py tests/test_exchange_rows.py
    tests/test_limits.py tests/test_nan_exclusion.py tests/test_cpu_tile_paths.py tests/test_ring.py
    tests/test_cuda_emulated.py)
fi
start=$SECONDS
cd "$src"

if [[ $mode == memcheck ]]; then
  report=$root/build/logs/memcheck.log
  echo "sanitize: running ${tests[*]} ${extra[*]} under valgrind (report: build/logs/memcheck.log)"
  status=0
  PYTHONPATH=$src valgrind --error-limit=no --num-callers=40 --track-origins=yes --log-file="$report" \
    "$py" -m pytest -q -p no:cacheprovider "${tests[@]}" "${extra[@]}" || status=$?
  # One error per block of "==pid== " lines; ours when a frame of it (or of
  # where the value came from) is in the extension.
  ours=$(awk '/^==[0-9]+== [A-Z]/ {if (blk && hit) n++; blk=1; hit=0} /_C\.cpython|ring_attention::/ {hit=1}
    /^==[0-9]+== $/ {if (blk && hit) n++; blk=0; hit=0} END {print n + 0}' "$report")
  total=$(grep -Eo 'ERROR SUMMARY: [0-9]+ errors from [0-9]+ contexts' "$report" | tail -n 1)
  echo "sanitize: memcheck $total in all; reports through the extension: $ours ($((SECONDS - start)) s of tests)"
  ((ours == 0 && status == 0))
  exit
fi

export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:alloc_dealloc_mismatch=0:new_delete_type_mismatch=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# libstdc++ too: ASan finds the real __cxa_throw only in a library loaded with it.
asan="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
# One pytest-xdist worker per core, as scripts/test.sh (PYTEST_WORKERS=N to
# choose, 0: in this process); each worker runs under the preloaded runtimes.
workers=${PYTEST_WORKERS:-auto}
xdist=()
if [[ "$workers" != 0 ]]; then
  xdist=(-n "$workers" --dist worksteal)
fi
echo "sanitize: running ${#tests[@]} test targets under LD_PRELOAD=$asan (workers: $workers)"
LD_PRELOAD=$asan "$py" -m pytest -q -p no:cacheprovider "${xdist[@]}" "${tests[@]}" "${extra[@]}"
echo "sanitize: clean ($((SECONDS - start)) s of tests)"
