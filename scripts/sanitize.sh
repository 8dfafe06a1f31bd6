#!/usr/bin/env bash
# Build the CPU kernels with AddressSanitizer + UndefinedBehaviorSanitizer (and
# the CUDA emulator with UndefinedBehaviorSanitizer: its fibers switch stacks,
# which AddressSanitizer would misread) in a copy of the sources under
# build/sanitize/, and run the operator, ring and emulator tests against them.
# Any report fails the run (halt_on_error). The checkout's own build is not
# touched.
#
#   bash scripts/sanitize.sh            # op, limits, NaN, ring and emulator tests (~15 min on 2 cores)
#   bash scripts/sanitize.sh --fast     # the CI subset (~3 min)
#   bash scripts/sanitize.sh -- -k gqa  # extra pytest arguments after --
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd -P)
fast=0
extra=()
while (($#)); do
  case "$1" in
    --fast) fast=1 ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "sanitize: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
bash scripts/setup.sh --no-build
py=$root/.venv/bin/python
src=$root/build/sanitize/src
mkdir -p "$root/build/logs"
# A copy of the sources: `python -m pytest` run there imports its ring_attention.
rm -rf "$src"
mkdir -p "$src"
cp -a setup.py pyproject.toml csrc ring_attention tests "$src/"
rm -f "$src"/ring_attention/_C*.so
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
log=$root/build/logs/sanitize_build.log
echo "sanitize: building the CPU kernels with ASan + UBSan (log: build/logs/sanitize_build.log)"
(cd "$src" && CFLAGS="$flags" LDFLAGS="$flags" RING_ATTENTION_CPU_ONLY=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  "$py" setup.py build_ext --inplace --build-temp "$root/build/sanitize/tmp") >"$log" 2>&1 || { tail -n 40 "$log" >&2; exit 1; }

ring=tests/test_ring.py::test_ring_matches_single_process_and_oracle
emu=tests/test_cuda_emulated.py::test_kernels_match_oracle
if ((fast)); then
  tests=(tests/test_limits.py tests/test_nan_exclusion.py tests/test_exchange_rows.py tests/test_block_ops.py
    tests/test_cpu_tile_paths.py
    "$ring[3-documents]" "$ring[3-gqa]" "$ring[3-huge_values]" "$ring[2-lse_documents_gqa]"
    "$emu[mma64-bf16-longnet-groups-mask-causal]" "$emu[simt-f32-d32-longnet-groups-mask-full]")
else
  tests=(tests/test_local_op.py tests/test_block_ops.py tests/test_opcheck.py tests/test_exchange_rows.py
    tests/test_limits.py tests/test_nan_exclusion.py tests/test_cpu_tile_paths.py tests/test_ring.py
    tests/test_cuda_emulated.py)
fi
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:alloc_dealloc_mismatch=0:new_delete_type_mismatch=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export RING_ATTENTION_EMULATOR_SANITIZE="-fsanitize=undefined -fno-sanitize-recover=undefined"
# libstdc++ too: ASan finds the real __cxa_throw only in a library loaded with it.
asan="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
echo "sanitize: running ${#tests[@]} test targets under LD_PRELOAD=$asan"
start=$SECONDS
cd "$src"
LD_PRELOAD=$asan "$py" -m pytest -q -p no:cacheprovider "${tests[@]}" "${extra[@]}"
echo "sanitize: clean ($((SECONDS - start)) s of tests)"
