#!/usr/bin/env bash
# The GPU machine's work, as one prepared plan of two calls of the device tool
# (15 minutes of device time in all, a machine start included, released after
# 30 s idle), or as stages named by hand. Run from anywhere; works in the repo
# root.
#
#   bash scripts/gpu_check.sh --plan [--budget-left S]   # the two calls: stages, budgets, carries,
#                                             # the exact run invocations (no GPU needed)
#   bash scripts/gpu_check.sh --dry-run       # the whole plan, both calls, on the CPU with
#                                             # stand-ins (tiny shapes, stub wheels, no build):
#                                             # every stage's command runs end to end
#   GPU_BUDGET_LEFT_S=<status budget_left_s> bash scripts/gpu_check.sh --call 1   # on the GPU
#   GPU_BUDGET_LEFT_S=<status budget_left_s> bash scripts/gpu_check.sh --call 2   # at once after
#   bash scripts/gpu_check.sh --stages build,tests   # stages by hand, GPU_CHECK_TOTAL_S in all
#
# The plan (--plan prints it with its budgets):
#   call 1 (carry .fa4/a .prev): info, fa4 (part a of flash-attn-4's wheels unpacked),
#     build (this tree and .prev = scripts/prev_tree.sh c4a8cfc, the old default),
#     torch (this tree's default with flash-attn-4 hidden), prev (the default of .prev),
#     tests (the CUDA tests of the dense path, only if time is left)
#   call 2 (carry .fa4/b): info, fa4 (part b: flash-attn-4 installed), check (out, lse and
#     gradients against the float64 oracle), views (the local op at 131K, 1M, 32K x 16x128,
#     12x64 x causal or not x fwd, fwd+bwd: % of the matmul rate, phases), ringdense (dense
#     causal ring of 1 against flash-attn-4 called directly; the ring's dilated blocks,
#     dense route against our kernels: the figure for auto), baselines (gather + SDPA,
#     gather + flash-attn-4, FlexAttention at the same points), big (2M tokens fwd+bwd,
#     peak memory), tests (only if time is left)
# Stages run in priority order, each in its budget; a stage that does not fit in
# what is left is skipped with a line saying so. Each stage writes into $OUT/<stage>/
# (its log, a header.json with the command line, environment, commit and limit,
# its result files) and packs it into $OUT/c<call>-<NN>-<stage>.tar.gz as it
# finishes (a command cut short still returns what finished; the device tool
# brings back 8 files: summary.txt and at most 7 archives); summary.txt gets a
# row per stage as it ends and, last, the PASS/FAIL of the targets
# (benchmarks/gpu_targets.py) over every archive of this machine's calls (kept in
# build/gpu_check_results while it stays warm).
#
# Stages (--stages): info fa4 build tests torch prev check views ringdense baselines
#   big ring bench kernels profile. ring: torchrun smoke of the ring (1 process,
#   2 gloo processes on one GPU, an NCCL group); bench: bench.py check + local;
#   kernels: our kernels both ways (and .prev's) with bench.py local; profile:
#   Nsight Compute on our tensor-core kernels (scripts/profile_kernels.py).
#
# Exit status: non-zero iff the build or the tests failed.
# Uses the interpreter as it is (PyTorch preinstalled, no network): no .venv.
# Environment:
#   OUT                    output folder (the device tool sets it)
#   PYTHON                 interpreter (default python3)
#   GPU_BUDGET_LEFT_S      device time left (the device tool's status budget_left_s) for
#                          --plan and --call (or --budget-left; default 900)
#   GPU_CHECK_TOTAL_S      total budget of a --stages run (default 540)
#   GPU_CHECK_PYTEST_ARGS  extra pytest arguments (default: --maxfail=20 -n 4 --timeout 120)
#   GPU_CHECK_TESTS        test paths (default: the plan's, tests/ with --stages)
#   GPU_CHECK_PTXAS_V      1 (default): nvcc --ptxas-options=-v resource report in build.log
#   GPU_CHECK_ARCH         TORCH_CUDA_ARCH_LIST for the build (default: the device's)
#   GPU_CHECK_PREV         the earlier tree (default .prev; skipped when it has no setup.py)
#   GPU_CHECK_RESULTS      where the archives of this machine's calls are kept
#                          (default build/gpu_check_results; --call 1 empties it)
#   GPU_CHECK_CHECK_ARGS, BENCH_ARGS, KERNELS_ARGS: extra arguments for the bench stage's
#                          bench.py check and local, the kernels stage's bench.py local
#   NCU                    Nsight Compute for the profile stage
set -uo pipefail
export PYTHONUNBUFFERED=1

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
ARGV=("$0" "$@")
# The extension is built in place, not installed: benchmarks/ and torchrun's
# workers import ring_attention from the checkout.
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
# Compiled FlexAttention / Triton kernels land in build/ (git-ignored), so a
# second call on a still-warm machine reuses them.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$ROOT/build/torchinductor_cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$ROOT/build/triton_cache}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check_out}
PYTEST_ARGS=${GPU_CHECK_PYTEST_ARGS:---maxfail=20 -n 4 --timeout 120}
TEST_FILTER="cuda and not emulated"
BENCH_ARGS=${BENCH_ARGS:-}
KERNELS_ARGS=${KERNELS_ARGS:-}
CHECK_ARGS=${GPU_CHECK_CHECK_ARGS:-}
RESULTS=${GPU_CHECK_RESULTS:-$ROOT/build/gpu_check_results}
BUDGET_LEFT=${GPU_BUDGET_LEFT_S:-900}

# ------------------------------------------------------------------ the plan
# Stage budgets (planned seconds) and caps (the most a stage may take when the
# stages before it left time). One table for the plan and for --stages.
declare -A BUDGET=([info]=10 [fa4]=20 [build]=120 [tests]=45 [torch]=30 [prev]=30
  [check]=45 [views]=90 [ringdense]=60 [baselines]=80 [big]=25 [ring]=120 [bench]=150
  [kernels]=150 [profile]=120)
declare -A CAP=([info]=30 [fa4]=60 [build]=240 [tests]=120 [torch]=30 [prev]=30
  [check]=60 [views]=120 [ringdense]=90 [baselines]=100 [big]=40 [ring]=120 [bench]=300
  [kernels]=300 [profile]=300)
# The calls: stages in priority order (also the order they run in), carries,
# command budgets. The device time: START_S for the machine's start (call 1),
# OVERHEAD_S a call for the transfers, RERUN_S kept for one stage's rerun.
CALL_STAGES=("" "info fa4 build torch prev tests" "info fa4 check views ringdense baselines big tests")
CALL_CARRY=("" ".fa4/a .prev" ".fa4/b")
CALL_TOTAL=(0 220 340)
START_S=180
OVERHEAD_S=20
RERUN_S=120
MARGIN_S=10   # for the targets summary and the last archive
TIMEOUT_PAD=30 # the run's timeout_s over the command's budget
# the CUDA tests of the plan: the dense path and the kernels it reads (80 tests,
# 29 s on an H200 with 4 workers)
PLAN_TESTS="tests/test_block_rows.py tests/test_branches.py tests/test_build.py"
# the bench points: the targets' lengths first
VIEWS_N=131072,1048576,32768

# call_total CALL LEFT: the command budget of CALL when LEFT s of device time are
# left before it (call 1 pays the start and keeps call 2's share).
call_total() {
  local call=$1 left=$2 t
  if ((call == 1)); then
    t=$((left - START_S - OVERHEAD_S - CALL_TOTAL[2] - OVERHEAD_S - RERUN_S))
  else
    t=$((left - OVERHEAD_S - RERUN_S))
  fi
  ((t > CALL_TOTAL[call])) && t=${CALL_TOTAL[call]}
  ((t < 0)) && t=0
  echo "$t"
}
# allot TOTAL STAGE...: "stage seconds" for each stage that fits, in priority
# order, and "stage -NEED" for one that does not (run later only if time is left)
allot() {
  local total=$1 used=$MARGIN_S s
  shift
  for s in "$@"; do
    if ((used + BUDGET[$s] <= total)); then
      echo "$s ${BUDGET[$s]}"
      used=$((used + BUDGET[$s]))
    else
      echo "$s -${BUDGET[$s]}"
    fi
  done
}

print_plan() {
  local left=$BUDGET_LEFT t1 t2 left2 s b
  t1=$(call_total 1 "$left")
  left2=$((left - START_S - OVERHEAD_S - t1))
  t2=$(call_total 2 "$left2")
  echo "gpu_check plan: ${left} s of device time left; assumed: the machine starts in ${START_S} s," \
    "${OVERHEAD_S} s of transfers a call, ${RERUN_S} s kept for rerunning one stage"
  for call in 1 2; do
    local t=$t1 l=$left
    ((call == 2)) && t=$t2 l=$left2
    echo "call $call: carry ${CALL_CARRY[$call]}; command budget ${t} s (of ${CALL_TOTAL[$call]});" \
      "timeout_s $((t + TIMEOUT_PAD)); stages in priority order:"
    while read -r s b; do
      if ((b >= 0)); then
        printf '  stage %-9s %4d s (cap %d s)  %s\n' "$s" "$b" "${CAP[$s]}" "$(stage_what "$s" "$call")"
      else
        printf '  stage %-9s skipped unless %d s are left: %s\n' "$s" "$((-b))" "$(stage_what "$s" "$call")"
      fi
    done < <(allot "$t" ${CALL_STAGES[$call]})
  done
  local total=$((START_S + t1 + OVERHEAD_S + t2 + OVERHEAD_S))
  echo "total: start ${START_S} + call 1 $((t1 + OVERHEAD_S)) + call 2 $((t2 + OVERHEAD_S)) = ${total} s" \
    "($((total / 60)) min $((total % 60)) s) of ${left} s; $((left - total)) s left for one rerun"
  echo "The two run invocations (issue call 2 as soon as call 1 returns: the machine goes back" \
    "after 30 s idle; set GPU_BUDGET_LEFT_S from status's budget_left_s just before each):"
  local c2=$left2
  for call in 1 2; do
    local t=$t1 l=$left carry=""
    ((call == 2)) && t=$t2 l=$c2
    for s in ${CALL_CARRY[$call]}; do carry+="${carry:+, }\"$s\""; done
    echo "run $call: {\"command\": \"GPU_BUDGET_LEFT_S=$l bash scripts/gpu_check.sh --call $call\"," \
      "\"carry\": [$carry], \"timeout_s\": $((t + TIMEOUT_PAD))}"
  done
  echo "a rerun (same warm machine, at once): {\"command\": \"GPU_BUDGET_LEFT_S=<left> bash" \
    "scripts/gpu_check.sh --call 2 --only STAGE\", \"carry\": [], \"timeout_s\": ${RERUN_S}}"
  echo "carried (made here: bash scripts/fa4_wheels.sh; bash scripts/prev_tree.sh c4a8cfc):"
  local tree
  tree=$(git ls-files -z 2>/dev/null | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
  local prev=${GPU_CHECK_PREV:-.prev}
  for s in .fa4/a .fa4/b "$prev"; do
    if [[ -e $s ]]; then
      local bytes
      bytes=$(du -cb "$s" | tail -n 1 | cut -f1)
      echo "  $s: $((bytes / 1048576)) MiB (with the tree, $(((bytes + ${tree:-0}) / 1048576)) MiB of 64)"
    else
      echo "  $s: MISSING here"
    fi
  done
  [[ -f $prev/SOURCE_COMMIT ]] && echo "  .prev is commit $(cut -c1-12 "$prev/SOURCE_COMMIT")" \
    "$([[ $(cat "$prev/SOURCE_COMMIT") == c4a8cfc* ]] || echo '(NOT c4a8cfc, the old default)')"
  return 0
}

stage_what() { # stage call: one line on what the stage does
  case $1 in
    info) echo "nvidia-smi, versions, commit -> summary.txt" ;;
    fa4) echo "scripts/fa4_install.sh: unpack the carried part$([[ $2 == 1 ]] && echo ' a' || echo ' b, install flash-attn-4')" ;;
    build) echo "setup.py build_ext --inplace, this tree and .prev at once (ptxas report)" ;;
    tests) echo "pytest -k '$TEST_FILTER' $PLAN_TESTS" ;;
    torch) echo "bench.py views --methods torch (flash-attn-4 hidden): 131K, 1M x 16x128 x causal or not x fwd, fwd+bwd" ;;
    prev) echo "bench.py views --methods prev --prev .prev (the old default): the same points" ;;
    check) echo "bench.py views --stages check: out, lse, dq, dk, dv vs the float64 oracle, n = 10240" ;;
    views) echo "bench.py views --methods default: $VIEWS_N x 16x128, 12x64 x causal or not x fwd, fwd+bwd (phases: median of 3)" ;;
    ringdense) echo "torchrun -m benchmarks.ring_dense_check: dense causal ring of 1 vs flash-attn-4 directly; dilated blocks (LongNet, 131K over 8 ranks) dense vs our kernels" ;;
    baselines) echo "bench.py views --methods fa4,gather,flex: the same points, 131K first" ;;
    big) echo "bench.py views --stages big: 2M tokens, 16x128, fwd+bwd, peak memory" ;;
    *) echo "(by hand)" ;;
  esac
}

# ------------------------------------------------------------------ arguments
MODE=stages
CALL=0
ONLY=""
STAGES="build,tests,ring,bench"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --plan) MODE=plan ;;
    --dry-run) MODE=dry ;;
    --call) CALL="${2:?--call needs 1 or 2}"; MODE=call; shift ;;
    --only) ONLY="${2:?--only needs a stage}"; shift ;;
    --budget-left) BUDGET_LEFT="${2:?--budget-left needs seconds}"; shift ;;
    --stages) STAGES="${2:?--stages needs a value, e.g. build,tests}"; shift ;;
    --stages=*) STAGES="${1#--stages=}" ;;
    -h | --help) sed -n '2,/^set -uo/{/^set -uo/d;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [[ $MODE == call && $CALL != 1 && $CALL != 2 ]]; then
  echo "gpu_check: --call takes 1 or 2, not '$CALL'" >&2
  exit 2
fi
for _s in ${STAGES//,/ } $ONLY; do
  if [[ -z "${BUDGET[$_s]:-}" ]]; then
    echo "gpu_check: unknown stage '$_s' (stages: ${!BUDGET[*]})" >&2
    exit 2
  fi
done
if [[ $MODE == plan ]]; then
  print_plan
  exit 0
fi

# ------------------------------------------------------------------ running stages
DRY=0
PREV=${GPU_CHECK_PREV:-.prev}
[[ -f "$PREV/setup.py" ]] && PREV=$(cd "$PREV" && pwd) || PREV=""
PREV_COMMIT=$([[ -n "$PREV" ]] && cat "$PREV/SOURCE_COMMIT" 2>/dev/null || echo '?')
PREV_OK=0 # the earlier tree built (now, or by an earlier call on this machine)
[[ -n "$PREV" ]] && compgen -G "$PREV/ring_attention/_C*.so" >/dev/null && PREV_OK=1
BUILD_OK=1
TESTS_OK=1
HAVE_GPU=0
ARCH=""
T0=$SECONDS
TOTAL=0
NN=0
elapsed() { echo $((SECONDS - T0)); }
remaining() { echo $((TOTAL - (SECONDS - T0))); }

ROWS=0
record() { # name status seconds note: a row in summary.txt as the stage ends
  if ((!ROWS)); then
    printf '| %-9s | %-9s | %6s | %s\n' stage status seconds note | tee -a "$SUMMARY"
    printf '|-----------|-----------|--------|------\n' | tee -a "$SUMMARY"
    ROWS=1
  fi
  printf '| %-9s | %-9s | %6s | %s\n' "$1" "$2" "$3" "$4" | tee -a "$SUMMARY"
}

# write_header STAGE LIMIT DIR: the stage's header.json (argv, environment,
# commit, limit): every archive says how it was made
write_header() {
  "$PY" - "$1" "$2" "$3/header.json" "$CALL" "$DRY" "${ARGV[@]}" <<'EOF' || true
import datetime, json, os, subprocess, sys
stage, limit, path, call, dry, *argv = sys.argv[1:]
prefixes = ("RING_ATTENTION_", "GPU_", "FLASH_ATTENTION_", "CUTE_DSL_", "CUDA_", "TORCH",
            "PYTORCH_", "TRITON_", "OMP_", "PYTHONPATH", "BENCH_", "KERNELS_", "NCU", "OUT")
try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            timeout=10).stdout.strip() or "?"
except Exception:
    commit = "?"
json.dump({"stage": stage, "call": int(call), "dry_run": dry == "1", "limit_s": int(limit),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit, "argv": argv,
           "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}},
          open(path, "w"), indent=1)
EOF
}

# pack STAGE: $OUT/STAGE/ into one archive now (kept in $RESULTS too)
pack() {
  local name
  NN=$((NN + 1))
  name=$(printf '%s%02d-%s.tar.gz' "$([[ $CALL -gt 0 ]] && echo "c$CALL-")" "$NN" "$1")
  if [[ -d "$OUT/$1" ]] && tar -C "$OUT" -czf "$OUT/$name" "$1"; then
    rm -rf "${OUT:?}/$1"
    mkdir -p "$RESULTS" && cp "$OUT/$name" "$RESULTS/"
  fi
}

# views STAGE LIMIT ARGS...: bench.py views into $OUT/STAGE (its own budget 10 s
# under the limit); ST/NOTE from its exit status and records
views() {
  local s=$1 limit=$2 rc ok bad
  shift 2
  local dry=()
  ((DRY)) && dry=(--dry-run --n 256)
  timeout --kill-after=10 "$limit" "$PY" benchmarks/bench.py views --device cuda --out "$OUT/$s" \
    --budget-s $((limit - 10)) "$@" "${dry[@]}" 2>&1 | tee "$OUT/$s/$s.log" | grep -v '^{' | tail -n 40
  rc=${PIPESTATUS[0]}
  ok=$(cat "$OUT/$s"/*.jsonl 2>/dev/null | grep -c '"status": "ok"' || true)
  bad=$(cat "$OUT/$s"/*.jsonl 2>/dev/null | grep -Ec '"status": "(FAIL|error)' || true)
  NOTE="rc=$rc; $ok points ok, $bad failed or in error"
  [[ $rc -eq 124 || $rc -eq 137 ]] && NOTE="cut at its limit ($limit s); $ok points ok, $bad failed"
  ((rc == 0)) && ST=ok || ST=FAIL
}

needs_gpu() { # STAGE: SKIP (and true) where a stage needs the GPU or the build
  if ((DRY)); then return 1; fi
  if ((!BUILD_OK || !HAVE_GPU)); then
    ST=SKIP NOTE="build failed or no GPU"
    echo "skipped: $NOTE" >"$OUT/$1/$1.log"
    return 0
  fi
  return 1
}

stage_info() {
  local limit=$1
  {
    echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on ${HOSTNAME:-?}: ${ARGV[*]}"
    echo "## git"
    git rev-parse HEAD 2>/dev/null || echo "(no git metadata in this copy)"
    git status --short 2>/dev/null | head -n 30
    echo "## nvidia-smi"
    timeout 20 nvidia-smi 2>&1 || echo "nvidia-smi failed"
    timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
      --format=csv 2>&1 || true
    echo "## nvcc"
    (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>&1 | tail -n 2
    echo "## python / torch"
    timeout "$limit" "$PY" - <<'EOF' 2>&1
import platform, sys
import torch
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:
    print("triton: not importable", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}, cc {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.1f} GiB")
else:
    print("torch.cuda.is_available() is False")
EOF
  } 2>&1 | tee "$OUT/info/info.log" >>"$SUMMARY"
  ST=done NOTE="$(grep -m1 '^device \|is_available' "$OUT/info/info.log")"
}

FA4_ENV=0
fa4_env() { # flash-attn-4 on PYTHONPATH for the stages after, where installed
  local dest=${FA4_DEST:-build/fa4}
  if ((!FA4_ENV)) && [[ -f "$dest/site/.complete" ]]; then
    # shellcheck disable=SC1090
    source <(bash scripts/fa4_install.sh --env)
    FA4_ENV=1
  fi
}

stage_fa4() {
  bash scripts/fa4_install.sh >"$OUT/fa4/fa4.log" 2>&1
  local rc=$?
  cat "$OUT/fa4/fa4.log"
  if ((rc == 0)); then
    fa4_env
    ST=ok NOTE="flash-attn-4 installed ($(grep -o 'cutlass-dsl .*' "$OUT/fa4/fa4.log" | head -n 1))"
  elif ((rc == 3 && CALL == 1)); then
    ST=ok NOTE="part a unpacked; part b follows in call 2"
  else
    ST=FAIL NOTE="rc=$rc: $(tail -n 1 "$OUT/fa4/fa4.log") (the dense path runs FlashAttention-2)"
  fi
}

stage_build() {
  local limit=$1 rc prev_rc=0 prev_pid extra=()
  if ((DRY)); then # a stub: setup.py parses in both trees, nothing compiles
    "$PY" setup.py --name >"$OUT/build/build.log" 2>&1
    rc=$?
    [[ -n "$PREV" ]] && (cd "$PREV" && "$PY" setup.py --name) >>"$OUT/build/build.log" 2>&1
    ((rc == 0)) && ST=ok || ST=FAIL
    NOTE="dry run: setup.py --name in this tree${PREV:+ and $PREV} (rc=$rc)"
    return
  fi
  rm -f ring_attention/_C*.so
  if [[ "${GPU_CHECK_PTXAS_V:-1}" == 1 ]]; then extra=(NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }--ptxas-options=-v"); fi
  if [[ -n "$PREV" ]]; then # the earlier tree builds at the same time (its own log)
    rm -f "$PREV"/ring_attention/_C*.so
    echo "and in $PREV (commit $PREV_COMMIT) -> build_prev.log"
    (cd "$PREV" && env TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=16 "${extra[@]}" \
      timeout --kill-after=10 "$limit" "$PY" setup.py build_ext --inplace >"$OUT/build/build_prev.log" 2>&1) &
    prev_pid=$!
  fi
  echo "TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=16 ${extra[*]} $PY setup.py build_ext --inplace (timeout $limit s)"
  env TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=16 "${extra[@]}" \
    timeout --kill-after=10 "$limit" "$PY" setup.py build_ext --inplace >"$OUT/build/build.log" 2>&1
  rc=$?
  if [[ -n "$PREV" ]]; then
    wait "$prev_pid"
    prev_rc=$?
    ((prev_rc == 0)) && PREV_OK=1
    echo "earlier tree: build rc=$prev_rc"
  fi
  NOTE="rc=$rc"
  if [[ $rc -ne 0 ]]; then
    BUILD_OK=0
    [[ $rc -eq 124 ]] && NOTE="timed out after $limit s"
    tail -n 60 "$OUT/build/build.log"
  else
    # the freshly built extension imports and runs a tiny CUDA call
    timeout 120 "$PY" - >>"$OUT/build/build.log" 2>&1 <<'EOF'
import torch
import ring_attention as ra
print("extension:", ra._C.__file__)
if torch.cuda.is_available():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 640, 4, 64, generator=g) for _ in range(3))
    ref = ra.dilated_attention(q.double(), k.double(), v.double(), [128, 256], [1, 2])
    out = ra.dilated_attention(*(t.cuda().bfloat16() for t in (q, k, v)), [128, 256], [1, 2])
    torch.cuda.synchronize()
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    print(f"tiny CUDA call: rel. error vs float64 CPU {err:.2e}")
    assert err < 2e-2, err
EOF
    rc=$?
    tail -n 3 "$OUT/build/build.log"
    if [[ $rc -ne 0 ]]; then
      BUILD_OK=0
      NOTE="built, but import / tiny CUDA call failed (rc=$rc)"
    else
      local spills stack
      NOTE="$(grep -c 'registers' "$OUT/build/build.log" || true) ptxas reports"
      spills=$(grep -E 'bytes spill (stores|loads)' "$OUT/build/build.log" | grep -vc ' 0 bytes spill stores, 0 bytes spill loads' || true)
      stack=$(grep -Eo '[0-9]+ bytes stack frame' "$OUT/build/build.log" | grep -vc '^0 bytes' || true)
      NOTE="$NOTE; $spills with spills, $stack with a stack frame"
    fi
  fi
  [[ -n "$PREV" ]] && NOTE="$NOTE; the earlier tree ($PREV_COMMIT): rc=$prev_rc (build_prev.log)"
  ((BUILD_OK)) && ST=ok || ST=FAIL
  if [[ "${GPU_CHECK_PTXAS_V:-1}" == 1 && -s "$OUT/build/build.log" ]]; then
    echo "ptxas resource report (kernels with spills or a stack frame, first 20):"
    grep -B2 -E '([1-9][0-9]* bytes stack frame|[1-9][0-9]* bytes spill)' "$OUT/build/build.log" |
      grep -E 'Compiling entry|Function properties|stack frame|registers' | head -n 20
  fi
}

stage_tests() {
  local limit=$1 rc last tests=${GPU_CHECK_TESTS:-$TESTS_DEFAULT}
  if ((DRY)); then # collected, not run
    # shellcheck disable=SC2086
    "$PY" -m pytest -q -p no:cacheprovider --collect-only $tests -k "$TEST_FILTER" \
      >"$OUT/tests/tests.log" 2>&1
    rc=$?
    ((rc == 0)) && ST=ok || ST=FAIL
    NOTE="dry run: $(tail -n 1 "$OUT/tests/tests.log")"
    return
  fi
  if ((!BUILD_OK || !HAVE_GPU)); then
    TESTS_OK=0
    ST="SKIP/FAIL" NOTE="$( ((BUILD_OK)) && echo "no GPU" || echo "build failed")"
    echo "skipped: $NOTE" >"$OUT/tests/tests.log"
    return
  fi
  # shellcheck disable=SC2086
  timeout --kill-after=10 "$limit" "$PY" -m pytest -q -p no:cacheprovider -rfE --durations=10 \
    $tests -k "$TEST_FILTER" $PYTEST_ARGS 2>&1 | tee "$OUT/tests/tests.log" | tail -n 30
  rc=${PIPESTATUS[0]}
  last=$(grep -E '(passed|failed|error|no tests ran)' "$OUT/tests/tests.log" | tail -n 1)
  NOTE="rc=$rc: $last"
  [[ $rc -eq 124 ]] && NOTE="timed out after $limit s: $(tail -n 1 "$OUT/tests/tests.log")"
  [[ $rc -eq 5 ]] && NOTE="no CUDA tests were collected"
  if [[ $rc -ne 0 ]]; then TESTS_OK=0; fi
  ((TESTS_OK)) && ST=ok || ST=FAIL
}

stage_torch() {
  needs_gpu torch && return
  views torch "$1" --stages bench --methods torch --n 131072,1048576 --configs 16x128
}

stage_prev() {
  local prev=$PREV
  ((DRY)) && prev=$ROOT # the stand-in: this tree (the old one is not built here)
  if [[ -z "$prev" ]] || ((!DRY && !PREV_OK)); then
    ST=SKIP NOTE="no built earlier tree (.prev: bash scripts/prev_tree.sh c4a8cfc, carried in call 1)"
    echo "skipped: $NOTE" >"$OUT/prev/prev.log"
    return
  fi
  needs_gpu prev && return
  views prev "$1" --stages bench --methods prev --prev "$prev" --n 131072,1048576 --configs 16x128
  NOTE="$NOTE; the default of $( ((DRY)) && echo "this tree (dry-run stand-in)" || echo "$PREV_COMMIT")"
}

stage_check() {
  needs_gpu check && return
  views check "$1" --stages check
}

stage_views() {
  needs_gpu views && return
  views views "$1" --stages bench --methods default --n "$VIEWS_N"
}

stage_baselines() {
  needs_gpu baselines && return
  views baselines "$1" --stages bench --methods fa4,gather,flex --n "$VIEWS_N"
}

stage_big() {
  needs_gpu big && return
  views big "$1" --stages big
}

stage_ringdense() {
  local limit=$1 rc
  needs_gpu ringdense && return
  if ((DRY)); then
    RING_ATTENTION_DENSE_BACKEND=cpu timeout "$limit" "$PY" -m benchmarks.ring_dense_check \
      --dry-run --out "$OUT/ringdense" >"$OUT/ringdense/ringdense.log" 2>&1
  else
    timeout --kill-after=10 "$limit" "$PY" -m torch.distributed.run --nproc-per-node=1 \
      -m benchmarks.ring_dense_check --device cuda --out "$OUT/ringdense" >"$OUT/ringdense/ringdense.log" 2>&1
  fi
  rc=$?
  grep -v '^{' "$OUT/ringdense/ringdense.log" | tail -n 20
  ((rc == 0)) && ST=ok || ST=FAIL
  NOTE="rc=$rc (limit $limit s)"
}

stage_ring() {
  local limit=$1 t=$SECONDS fails runs
  needs_gpu ring && return
  ring_run() { # name nproc args...: one torchrun launch of bench.py ring-run, checked
    local name=$1 nproc=$2 left rc
    shift 2
    left=$((limit - (SECONDS - t)))
    if ((left < 15)); then
      echo "## $name: skipped (ring budget spent)"
      return 0
    fi
    echo "## $name"
    if ((DRY)); then
      echo "(dry run: not launched) torchrun --nproc-per-node=$nproc benchmarks/bench.py ring-run $*"
      echo "rc=0"
      return 0
    fi
    OMP_NUM_THREADS=4 timeout --kill-after=5 "$left" "$PY" -m torch.distributed.run --standalone \
      --nproc-per-node="$nproc" benchmarks/bench.py ring-run --check yes --backward "$@"
    rc=$?
    echo "rc=$rc"
    return $rc
  }
  {
    ring_run "1 process, bf16, LongNet, n=32768" 1 --device cuda --dtype bfloat16 \
      --seq-len 32768 --segments 2048 4096 8192 16384 32768 --dilations 1 2 4 6 12 --heads 12
    ring_run "2 gloo processes on one GPU, fp32, causal, zigzag" 2 --device cuda \
      --backend gloo --dtype float32 --seq-len 8192 --causal --layout zigzag
    ring_run "2 gloo processes on one GPU, bf16" 2 --device cuda --backend gloo \
      --dtype bfloat16 --seq-len 8192
    ring_run "1 process in an NCCL group (handshake and plan through NCCL), bf16" 1 \
      --device cuda --backend nccl --dtype bfloat16 --seq-len 8192
  } 2>&1 | tee "$OUT/ring/ring.log"
  fails=$(grep -Ec '^rc=[1-9]' "$OUT/ring/ring.log" || true)
  runs=$(grep -Ec '^rc=' "$OUT/ring/ring.log" || true)
  ((fails == 0 && runs > 0)) && ST=ok || ST=FAIL
  NOTE="$runs ring runs, $fails failed; $(grep -c 'PASS' "$OUT/ring/ring.log" || true) checks passed"
}

# bench_local LIMIT LOG DIR [ARGS...]: bench.py local into $OUT/DIR, its own
# budget 45 s below LIMIT, appended to LOG
bench_local() {
  local hard=$1 log=$2 dir=$3 soft
  shift 3
  local dry=()
  ((DRY)) && dry=(--dry-run)
  soft=$((hard - 45))
  ((soft < 30)) && soft=30
  echo "## bench.py local (budget $soft s, limit $hard s)" | tee -a "$log"
  timeout --kill-after=10 "$hard" "$PY" benchmarks/bench.py local --device cuda \
    --out-dir "$OUT/$dir" --budget-s "$soft" "$@" "${dry[@]}" 2>&1 | tee -a "$log"
}

stage_bench() {
  local limit=$1 t=$SECONDS cap check_rc rc
  needs_gpu bench && return
  {
    echo "## bench.py check"
    cap=$((limit / 2))
    ((cap > 150)) && cap=150
    if ((DRY)); then
      echo "(dry run: bench.py check not run)"
      echo "rc=0"
    else
      # shellcheck disable=SC2086
      timeout --kill-after=10 "$cap" "$PY" benchmarks/bench.py check --device cuda \
        --configs 12x64 16x128 $CHECK_ARGS
      echo "rc=$?"
    fi
  } 2>&1 | tee "$OUT/bench/bench.log"
  check_rc=$(grep -Eo '^rc=[0-9]+' "$OUT/bench/bench.log" | tail -n 1 | cut -d= -f2)
  # shellcheck disable=SC2086
  bench_local $((limit - (SECONDS - t))) "$OUT/bench/bench.log" bench/local $BENCH_ARGS
  rc=$?
  NOTE="check rc=$check_rc; local rc=$rc"
  [[ $rc -eq 0 && "$check_rc" == 0 ]] && ST=ok || ST=FAIL
}

stage_kernels() {
  local limit=$1 rc prev_rc half=$1
  needs_gpu kernels && return
  # with the earlier tree built: half the limit each, the same points
  ((PREV_OK)) && half=$((limit / 2))
  (
    export RING_ATTENTION_FORWARD=kernel RING_ATTENTION_BACKWARD=kernel
    # shellcheck disable=SC2086
    bench_local "$half" "$OUT/kernels/kernels.log" kernels/ours --passes fwd fwdbwd --methods ours \
      --search-step 0 $KERNELS_ARGS
  )
  rc=$?
  NOTE="rc=$rc (our kernels both ways)"
  if ((PREV_OK)); then
    (
      export RING_ATTENTION_FORWARD=kernel RING_ATTENTION_BACKWARD=kernel PYTHONPATH=$PREV
      echo "## the earlier tree: $PREV (commit $PREV_COMMIT)"
      # shellcheck disable=SC2086
      bench_local "$half" "$OUT/kernels/kernels.log" kernels/prev --passes fwd fwdbwd \
        --methods ours --search-step 0 $KERNELS_ARGS
    )
    prev_rc=$?
    "$PY" benchmarks/bench.py compare "$OUT/kernels/ours" "$OUT/kernels/prev" \
      --out "$OUT/kernels/compare.md" 2>&1 | tee -a "$OUT/kernels/kernels.log"
    NOTE="$NOTE; the earlier tree rc=$prev_rc, kernels/compare.md"
    ((prev_rc == 0)) || rc=$prev_rc
  fi
  ((rc == 0)) && ST=ok || ST=FAIL
}

stage_profile() {
  local limit=$1 t=$SECONDS n left kind h d extra
  needs_gpu profile && return
  # ncu on PATH, else the newest Nsight Compute under /opt/nvidia or CUDA's bin
  NCU=${NCU:-$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | tail -n 1)}
  if [[ ! -x "$NCU" ]] || ((DRY)); then
    ST=SKIP NOTE="no ncu here$( ((DRY)) && echo ' (dry run)')"
    echo "skipped: $NOTE" >"$OUT/profile/profile.log"
    return
  fi
  # The first launch of each tensor-core kernel (one branch), bf16 at
  # h 16, d 128; then the same at d 64 (h 12). One ncu run per kernel.
  for spec in "fwd 16 128" "bwd 16 128" "fwd 12 64" "bwd 12 64"; do
    read -r kind h d <<<"$spec"
    left=$((limit - (SECONDS - t)))
    ((left < 20)) && break
    extra=()
    [[ $kind == bwd ]] && extra=(--backward)
    echo "## ncu: ${kind}_mma_kernel, h $h, d $d"
    timeout --kill-after=10 "$left" "$NCU" --clock-control none -k "regex:${kind}_mma_kernel" \
      --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --section SourceCounters \
      -o "$OUT/profile/${kind}_h${h}_d${d}" -f \
      "$PY" scripts/profile_kernels.py --n 32768 --heads "$h" --head-dim "$d" "${extra[@]}"
    "$NCU" --import "$OUT/profile/${kind}_h${h}_d${d}.ncu-rep" --page details \
      >"$OUT/profile/${kind}_h${h}_d${d}.txt" 2>&1 || true
    # per SASS instruction: executions and sampled warp stalls, for reading without ncu
    "$NCU" --import "$OUT/profile/${kind}_h${h}_d${d}.ncu-rep" --page source --print-source sass \
      --csv 2>&1 | gzip >"$OUT/profile/${kind}_h${h}_d${d}_sass.csv.gz" || true
  done 2>&1 | tee "$OUT/profile/profile.log"
  n=$(find "$OUT/profile" -name '*.ncu-rep' | wc -l)
  ((n > 0)) && ST=ok || ST=FAIL
  NOTE="$n ncu reports (profile/*.ncu-rep, details in profile/*.txt)"
}

# run STAGE... : in order (= priority), each in its budget, within TOTAL
run_stages() {
  local -a stages=("$@") budgets=()
  local s b i j later avail limit t
  while read -r s b; do budgets+=("$b"); done < <(allot "$TOTAL" "${stages[@]}")
  for i in "${!stages[@]}"; do
    s=${stages[$i]}
    later=0
    for ((j = i + 1; j < ${#stages[@]}; j++)); do
      ((budgets[j] > 0)) && later=$((later + budgets[j]))
    done
    avail=$(($(remaining) - MARGIN_S - later))
    # a build cut short helps nobody: it may take the later stages' time
    # (they are then skipped), up to its cap
    [[ $s == build ]] && avail=$(($(remaining) - MARGIN_S))
    limit=$avail
    ((limit > CAP[$s])) && limit=${CAP[$s]}
    echo
    echo "=================== $s (t=$(elapsed) s, $(remaining) s left, limit $limit s)"
    if ((budgets[i] < 0 && avail < -budgets[i])) || ((limit < BUDGET[$s] / 2 || limit < 5)); then
      record "$s" SKIP 0 "does not fit: needs ${BUDGET[$s]} s, $avail s left after the stages before it and the reserves of the later ones"
      continue
    fi
    mkdir -p "$OUT/$s"
    [[ $s == info ]] || write_header "$s" "$limit" "$OUT/$s"
    t=$SECONDS
    ST=FAIL NOTE=""
    "stage_$s" "$limit"
    record "$s" "$ST" $((SECONDS - t)) "$NOTE"
    if [[ $s == info ]]; then # all of it is in summary.txt: no archive
      rm -rf "${OUT:?}/info"
    else
      pack "$s"
    fi
  done
}

finish() { # the targets over this machine's archives, the file list, the exit status
  {
    echo
    echo "## gpu_check: $(elapsed) s of ${TOTAL} s"
    if ((CALL > 0)); then
      "$PY" -m benchmarks.gpu_targets "$RESULTS" 2>&1
    fi
    echo "files in $OUT: $(cd "$OUT" && find . -maxdepth 1 -type f | sed 's|^\./||' | sort | tr '\n' ' ')"
  } | tee -a "$SUMMARY"
  ((BUILD_OK && TESTS_OK))
}

start_run() { # OUT SUMMARY: a fresh output folder, the device
  mkdir -p "$OUT"
  SUMMARY=$OUT/summary.txt
  : >"$SUMMARY"
  T0=$SECONDS
  NN=0
  if ((!DRY)); then
    ARCH=$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(0); print(f"{m}.{n}")' 2>/dev/null || echo "")
    HAVE_GPU=1
    if [[ -z "$ARCH" ]]; then
      HAVE_GPU=0
      ARCH=9.0
      echo "gpu_check: no CUDA device visible to torch; building for $ARCH anyway"
    fi
    ARCH=${GPU_CHECK_ARCH:-$ARCH}
  fi
  ROWS=0
}

# run_call CALL: one call of the plan (--only: that stage alone)
run_call() {
  CALL=$1
  TOTAL=$(call_total "$CALL" "$BUDGET_LEFT")
  if [[ -n $ONLY ]]; then # a rerun: what is left, less the transfers and the idle tail
    TOTAL=$((BUDGET_LEFT - OVERHEAD_S - 30))
    ((TOTAL > CAP[$ONLY] + MARGIN_S)) && TOTAL=$((CAP[$ONLY] + MARGIN_S))
  fi
  TESTS_DEFAULT=$PLAN_TESTS
  ((CALL == 1)) && [[ -z $ONLY ]] && rm -rf "$RESULTS"
  start_run
  echo "gpu_check call $CALL: ${BUDGET_LEFT} s of device time left -> a ${TOTAL} s budget" \
    "(${CALL_TOTAL[$CALL]} planned)" | tee -a "$SUMMARY"
  fa4_env
  if [[ -n $ONLY ]]; then
    run_stages "$ONLY"
  else
    # shellcheck disable=SC2086
    run_stages ${CALL_STAGES[$CALL]}
  fi
  finish
}

if [[ $MODE == dry ]]; then
  # The whole plan on the CPU: each call into its own folder, stand-in wheels
  # for flash-attn-4 (part a in call 1, part b in call 2), budgets three times
  # the plan's (a loaded CPU); every stage must end ok.
  DRY=1
  root_out=$OUT
  dry=$root_out/dry
  rm -rf "$dry"
  bash scripts/fa4_install.sh --stand-in "$dry/parts" >/dev/null || exit 1
  export FA4_DEST=$dry/fa4
  RESULTS=$dry/results
  # every stage allotted (the plan's allotment is --plan's)
  for k in "${!BUDGET[@]}"; do BUDGET[$k]=$((BUDGET[$k] * 3)) CAP[$k]=$((CAP[$k] * 3)); done
  for call in 1 2; do
    CALL_TOTAL[call]=$MARGIN_S
    for s in ${CALL_STAGES[$call]}; do CALL_TOTAL[call]=$((CALL_TOTAL[call] + BUDGET[$s])); done
  done
  START_S=0 RERUN_S=0 OVERHEAD_S=0 BUDGET_LEFT=$((CALL_TOTAL[1] + CALL_TOTAL[2]))
  rc=0
  for call in 1 2; do
    OUT=$root_out/call$call
    rm -rf "$OUT"
    export FA4_PARTS=$dry/parts/call$call
    echo "######## dry run of call $call (OUT=$OUT)"
    run_call "$call" || rc=1
    BUDGET_LEFT=$((BUDGET_LEFT - TOTAL))
    bad=$(grep -E '^\| [a-z0-9]+ +\| ' "$OUT/summary.txt" | grep -v '^| stage' | grep -Evc '\| (ok|done) ' || true)
    files=$(find "$OUT" -maxdepth 1 -type f | wc -l)
    echo "dry run of call $call: $bad stages not ok; $files files in $OUT (the device tool brings back 8)"
    ((bad == 0 && files <= 8)) || rc=1
  done
  bash -n "${BASH_SOURCE[0]}" && echo "bash -n: ok"
  echo "dry run: $( ((rc == 0)) && echo PASS || echo FAIL)"
  exit $rc
fi

if [[ $MODE == call ]]; then
  run_call "$CALL"
  exit $?
fi

# --stages: by hand, in the order given, within GPU_CHECK_TOTAL_S
TOTAL=${GPU_CHECK_TOTAL_S:-540}
TESTS_DEFAULT=tests
start_run
fa4_env
run_stages ${STAGES//,/ }
finish
