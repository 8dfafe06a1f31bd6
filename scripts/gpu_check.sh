#!/usr/bin/env bash
# One command for the GPU machine: versions, build the CUDA extension, CUDA tests,
# ring smoke, benchmark, summary. Run from anywhere; works in the repo root.
#
#   bash scripts/gpu_check.sh                 # everything, ~9 minutes at most
#   bash scripts/gpu_check.sh --dry-run       # the plan (and bench.py local --dry-run); no GPU needed
#   bash scripts/gpu_check.sh --stages build,tests    # a subset (build tests ring bench kernels fa4 views profile)
#   GPU_CHECK_TOTAL_S=570 bash scripts/gpu_check.sh --stages build,bench,kernels
#                                             # kernels (not in the default): ours forward and
#                                             # forward+backward with our kernels both ways,
#                                             # beside bench's default (SDPA per branch where
#                                             # the dispatch takes it), for the same-run comparison
#   bash scripts/prev_tree.sh REF; ...        # with the tree of an earlier commit in .prev
#                                             # (carried with the call): the build stage builds
#                                             # it too and the kernels stage times both, then
#                                             # bench.py compare -> bench_kernels/compare.md
#   bash scripts/gpu_check.sh --stages fa4    # flash-attn-4 (not in the default): installs it
#                                             # (scripts/fa4_install.sh; its wheels travel in two
#                                             # calls, see scripts/fa4_wheels.sh), its CUDA test,
#                                             # then bench.py local: ours, gather+SDPA, gather+FA4
#   bash scripts/gpu_check.sh --stages build,views   # the dense per-branch path (not in the
#                                             # default; benchmarks/bench.py views): out, lse and
#                                             # gradients against the float64 oracle at
#                                             # n = 10240 on every dense backend, dense
#                                             # flash-attn-4 / FlashAttention-2 and torch.mm, the
#                                             # local op at 32K-1M with its time per phase,
#                                             # the earlier tree's default (.prev) and 2M tokens.
#                                             # flash-attn-4 where its wheels have arrived
#                                             # (scripts/fa4_install.sh), else without it
#   bash scripts/gpu_check.sh --stages build,ringdense   # the ring's dense blocks (not in the
#                                             # default; benchmarks/ring_dense_check.py under
#                                             # torchrun, one process): checked against our
#                                             # kernels and SDPA, then timed against the dense
#                                             # backend called directly on the same shards
#   bash scripts/gpu_check.sh --stages build,profile   # Nsight Compute (not in the default) on
#                                             # the first launches of our forward and backward
#                                             # tensor-core kernels (scripts/profile_kernels.py)
#
# Results go to $OUT (default /tmp/gpu_check_out): summary.txt (versions + final
# table) and gpu_check.tar.gz holding build.log, tests.log, ring.log, bench.log
# (bench.py check, then bench.py local), bench/local.{jsonl,md,png}, kernels.log,
# bench_kernels/local.{jsonl,md,png} (stage kernels; with an earlier tree also
# build_prev.log, bench_kernels_prev/ and bench_kernels/compare.md), fa4.log and
# bench_fa4/local.{jsonl,md,png} (stage fa4), views.log and views/ (views.jsonl,
# prev.jsonl, summary.md; stage views), profile.log and profile/ (the ncu
# reports, stage profile), ringdense.log and ringdense/ (stage ringdense): two files, since the device tool
# brings back at most 8 (GPU_CHECK_PACK=0 leaves them unpacked).
# Each stage runs under `timeout` inside a total budget (GPU_CHECK_TOTAL_S,
# default 540 s); a failing stage is recorded and the next one runs. If the
# build fails, the benchmark still runs its baselines ('ours' is recorded as
# failed): nothing in benchmarks/ imports the extension before it is called.
# Exit status: non-zero iff the build or the tests failed.
#
# Uses the interpreter as it is (PyTorch preinstalled, no network): no .venv.
# Environment:
#   OUT                    output folder (the device tool sets it)
#   PYTHON                 interpreter (default python3)
#   GPU_CHECK_TOTAL_S      total budget in seconds (default 540)
#   GPU_CHECK_PYTEST_ARGS  extra pytest arguments (default: --maxfail=20 -n 4 --timeout 120:
#                          4 xdist workers share the GPU; 80 CUDA tests took 29 s on an H200)
#   GPU_CHECK_TESTS        test paths (default tests: every test with "cuda" in its
#                          id, but the CPU emulator's)
#   GPU_CHECK_PTXAS_V      1 (default): nvcc --ptxas-options=-v resource report in build.log
#   GPU_CHECK_ARCH         TORCH_CUDA_ARCH_LIST for the build (default: the device's, e.g. 9.0)
#   GPU_CHECK_PREV         the earlier tree to build and time beside this one (default .prev,
#                          made by scripts/prev_tree.sh; skipped when it has no setup.py)
#   GPU_CHECK_CHECK_ARGS   extra arguments for benchmarks/bench.py check
#   BENCH_ARGS             extra arguments for benchmarks/bench.py local
#   KERNELS_ARGS           extra arguments for the kernels stage's bench.py local (both trees),
#                          e.g. --seq-lens 131072 1048576 to fit both in a short budget
#   NCU                    Nsight Compute for the profile stage (default: ncu on PATH,
#                          else under /opt/nvidia/nsight-compute or /usr/local/cuda/bin)
set -uo pipefail
export PYTHONUNBUFFERED=1

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
# The extension is built in place, not installed: benchmarks/ and torchrun's
# workers import ring_attention from the checkout.
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
# Compiled FlexAttention / Triton kernels land in build/ (git-ignored), so a
# second call on a still-warm machine reuses them.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$ROOT/build/torchinductor_cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$ROOT/build/triton_cache}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check_out}
TOTAL=${GPU_CHECK_TOTAL_S:-540}
PYTEST_ARGS=${GPU_CHECK_PYTEST_ARGS:---maxfail=20 -n 4 --timeout 120}
TESTS=${GPU_CHECK_TESTS:-tests}
TEST_FILTER="cuda and not emulated"
BENCH_ARGS=${BENCH_ARGS:-}
KERNELS_ARGS=${KERNELS_ARGS:-}
CHECK_ARGS=${GPU_CHECK_CHECK_ARGS:-}
PREV=${GPU_CHECK_PREV:-.prev}
[[ -f "$PREV/setup.py" ]] && PREV=$(cd "$PREV" && pwd) || PREV=""
PREV_COMMIT=$( [[ -n "$PREV" ]] && cat "$PREV/SOURCE_COMMIT" 2>/dev/null || echo '?')
DRY=0
STAGES="build,tests,ring,bench"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --stages) STAGES="${2:?--stages needs a value, e.g. build,tests}"; shift ;;
    --stages=*) STAGES="${1#--stages=}" ;;
    -h | --help) sed -n '2,/^set -uo/{/^set -uo/d;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
IFS=, read -ra _stages <<<"$STAGES"
for _s in "${_stages[@]}"; do
  case "$_s" in
    build | tests | ring | bench | kernels | fa4 | views | profile | ringdense) ;;
    *) echo "gpu_check: unknown stage '$_s' (stages: build tests ring bench kernels fa4 views profile ringdense)" >&2; exit 2 ;;
  esac
done

# Caps per stage (seconds); each is also cut to what the total budget leaves
# after the reserves of the stages that follow it.
CAP_INFO=30
CAP_BUILD=300
CAP_TESTS=300
CAP_RING=120
RESERVE_AFTER_BUILD=240 # tests + ring + some bench must still fit
RESERVE_AFTER_TESTS=200 # ring + some bench
RESERVE_AFTER_RING=150  # bench
BENCH_MIN=60            # skip the bench when less is left
BENCH_MARGIN=45         # between bench.py's own --budget-s and its hard timeout
KERNELS_RESERVE=150     # what bench leaves for kernels when that stage is asked for
FA4_RESERVE=150         # what bench and kernels leave for fa4 when that stage is asked for
VIEWS_RESERVE=300       # what the stages before leave for views when it is asked for
PROFILE_RESERVE=120     # what bench, kernels and fa4 leave for profile when it is asked for
CHECK_CAP=150           # bench.py check, inside the bench stage
SUMMARY_MARGIN=15

T0=$SECONDS
elapsed() { echo $((SECONDS - T0)); }
remaining() { echo $((TOTAL - (SECONDS - T0))); }
# budget CAP RESERVE: min(CAP, remaining - RESERVE), at least 0
budget() {
  local cap=$1 reserve=$2 r
  r=$(($(remaining) - reserve))
  ((r > cap)) && r=$cap
  ((r < 0)) && r=0
  echo "$r"
}
want() { [[ ",$STAGES," == *",$1,"* ]]; }
# reserve_after STAGE: what the build, tests and ring stages leave for the
# stages after them: the RESERVE_AFTER_* of the default run where one of
# tests / ring / bench follows, else the reserves of the later stages asked
# for (so that `--stages build,tests,kernels` gives the tests their time).
reserve_after() {
  local r=0
  case $1 in
    build) want tests || want ring || want bench && { echo $RESERVE_AFTER_BUILD; return; } ;;
    tests) want ring || want bench && { echo $RESERVE_AFTER_TESTS; return; } ;;
    ring) want bench && { echo $RESERVE_AFTER_RING; return; } ;;
  esac
  want kernels && r=$((r + KERNELS_RESERVE))
  want fa4 && r=$((r + FA4_RESERVE))
  want views && r=$((r + VIEWS_RESERVE))
  want profile && r=$((r + PROFILE_RESERVE))
  echo "$r"
}
# left_for STAGE: the seconds STAGE may take: what the budget leaves after the
# summary and the reserves of the later stages that were asked for.
left_for() {
  local r=$(($(remaining) - SUMMARY_MARGIN))
  case $1 in
    bench) want kernels && r=$((r - KERNELS_RESERVE)) ;&
    kernels) want fa4 && r=$((r - FA4_RESERVE)) ;&
    fa4) want views && r=$((r - VIEWS_RESERVE)) ;&
    views) want profile && r=$((r - PROFILE_RESERVE)) ;;
  esac
  echo "$r"
}

NAMES=()
STATUS=()
SECS=()
NOTES=()
record() { # name status seconds note
  NAMES+=("$1")
  STATUS+=("$2")
  SECS+=("$3")
  NOTES+=("$4")
  echo "== [$1] $2 (${3} s) $4"
}

banner() { echo; echo "=================== $* (t=$(elapsed) s, $(remaining) s left)"; }

# bench_local HARD LOG DIR [ARGS...]: bench.py local on CUDA into $OUT/DIR, its
# own budget BENCH_MARGIN below the hard limit HARD, appended to LOG; the
# status is bench.py's (124/137: killed at the hard limit).
bench_local() {
  local hard=$1 log=$2 dir=$3 soft
  shift 3
  if ((hard < 30)); then # (timeout 0 would mean no limit)
    echo "## bench.py local: skipped, only $hard s left" | tee -a "$log"
    return 124
  fi
  soft=$((hard - BENCH_MARGIN))
  ((soft < 30)) && soft=30
  echo "## bench.py local (budget $soft s, hard limit $hard s)" | tee -a "$log"
  timeout --kill-after=10 "$hard" "$PY" benchmarks/bench.py local --device cuda \
    --out-dir "$OUT/$dir" --budget-s "$soft" "$@" 2>&1 | tee -a "$log"
}

if [[ $DRY -eq 1 ]]; then
  echo "gpu_check dry run: repo $ROOT, python $PY, OUT=$OUT, total budget ${TOTAL} s, stages $STAGES"
  echo "  info : nvidia-smi, torch/CUDA/cuDNN/Triton versions, nvcc, git commit  -> summary.txt"
  echo "  build: rm ring_attention/_C*.so; TORCH_CUDA_ARCH_LIST=<device cc, e.g. 9.0> MAX_JOBS=16" \
    "$PY setup.py build_ext --inplace (timeout <= $CAP_BUILD s) + a tiny CUDA call -> build.log"
  echo "  tests: timeout <= $CAP_TESTS s $PY -m pytest -q $TESTS -k '$TEST_FILTER' $PYTEST_ARGS -> tests.log"
  echo "  ring : timeout <= $CAP_RING s, torchrun + benchmarks/bench.py ring-run --check yes:" \
    "1 process (bf16, n=32768, fwd+bwd), 2 gloo processes on one GPU (fp32 causal zigzag," \
    "bf16), 1 process in an NCCL group (bf16) -> ring.log"
  echo "  bench: the rest of the budget: $PY benchmarks/bench.py check --device cuda --configs" \
    "12x64 16x128 $CHECK_ARGS" \
    "(timeout <= $CHECK_CAP s), then bench.py local --device cuda --out-dir \$OUT/bench" \
    "--budget-s <left - $BENCH_MARGIN s> $BENCH_ARGS -> bench.log, bench/local.{jsonl,md,png}"
  echo "  kernels: (only when named in --stages; bench leaves it ${KERNELS_RESERVE} s)" \
    "RING_ATTENTION_FORWARD=kernel RING_ATTENTION_BACKWARD=kernel $PY benchmarks/bench.py local" \
    "--device cuda --passes fwd fwdbwd --methods ours --search-step 0 $KERNELS_ARGS" \
    "--out-dir \$OUT/bench_kernels -> kernels.log"
  if [[ -n "$PREV" ]]; then
    echo "  prev : $PREV (commit $PREV_COMMIT): built with" \
      "this one (-> build_prev.log); the kernels stage times it too, half its budget each" \
      "(PYTHONPATH=$PREV -> bench_kernels_prev), then bench.py compare -> bench_kernels/compare.md"
  fi
  echo "  fa4  : (only when named in --stages; bench and kernels leave it ${FA4_RESERVE} s)" \
    "bash scripts/fa4_install.sh (the wheels of scripts/fa4_wheels.sh, carried as .fa4/a and" \
    ".fa4/b), pytest -k 'fa4 and cuda', bench.py local --methods ours gather fa4" \
    "--search-step 0 --out-dir \$OUT/bench_fa4 -> fa4.log"
  echo "  views: (only when named in --stages; the stages before leave it ${VIEWS_RESERVE} s)" \
    "bash scripts/fa4_install.sh (flash-attn-4 if both parts arrived), $PY benchmarks/bench.py views" \
    "--device cuda --out \$OUT/views --budget-s <left - 20 s>${PREV:+ --prev $PREV}: check (oracle," \
    "n = 10240), dense (FA4, FA2, torch.mm), bench (32K, 131K, 1M x 12x64, 16x128; dense" \
    "path with phases, default${PREV:+, the default of $PREV}), big (2M fwd+bwd peak) -> views.log, views/;" \
    "first $PY benchmarks/bench.py host --rounds 1 --reps 3 (the path's host time per call, CPU, <= 45 s)" \
    "-> views_host.log, views_host/"
  echo "  profile: (only when named in --stages; the stages before leave it ${PROFILE_RESERVE} s)" \
    "ncu --clock-control none -k regex:<fwd|bwd>_mma_kernel --launch-count 1 <8 sections>" \
    "$PY scripts/profile_kernels.py --n 32768 (h 16 d 128, h 12 d 64) -> profile.log, profile/*.{ncu-rep,txt,_sass.csv.gz}"
  echo "  ringdense: (only when named in --stages; what the stages before leave)" \
    "torchrun --nproc-per-node=1 -m benchmarks.ring_dense_check --device cuda --out \$OUT/ringdense" \
    "-> ringdense.log, ringdense/ring_dense_rank0.jsonl"
  echo "  then : everything but summary.txt packed into \$OUT/gpu_check.tar.gz (GPU_CHECK_PACK=0: not)"
  echo "  exit status: non-zero iff build or tests failed"
  bash -n "${BASH_SOURCE[0]}" && echo "  bash -n: ok"
  # shellcheck disable=SC2086
  "$PY" benchmarks/bench.py local --dry-run --device cuda --out-dir "$OUT/bench" $BENCH_ARGS
  rc=$?
  if want views; then # every stage of bench.py views on the CPU, toy sizes
    mkdir -p "$OUT"
    "$PY" benchmarks/bench.py views --dry-run --out "$OUT/views" --budget-s 240 \
      ${PREV:+--prev "$PREV"} >"$OUT/views_dry.log" 2>&1 || rc=$?
    tail -n 40 "$OUT/views_dry.log"
  fi
  if want ringdense; then # the same script on the CPU, toy sizes
    mkdir -p "$OUT"
    "$PY" -m benchmarks.ring_dense_check --dry-run --out "$OUT/ringdense" >"$OUT/ringdense_dry.log" 2>&1 || rc=$?
    tail -n 12 "$OUT/ringdense_dry.log"
  fi
  exit $rc
fi

mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"

# ------------------------------------------------------------------ info
banner info
t=$SECONDS
{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on ${HOSTNAME:-?}"
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
  timeout 60 "$PY" - <<'EOF' 2>&1
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
} 2>&1 | tee -a "$SUMMARY"
record info done $((SECONDS - t)) ""

# (not $CC: that is the C compiler variable, which nvcc and Inductor read)
ARCH=$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(0); print(f"{m}.{n}")' 2>/dev/null || echo "")
HAVE_GPU=1
if [[ -z "$ARCH" ]]; then
  HAVE_GPU=0
  ARCH=9.0
  echo "gpu_check: no CUDA device visible to torch; building for $ARCH anyway"
fi
ARCH=${GPU_CHECK_ARCH:-$ARCH}

BUILD_OK=1
TESTS_OK=1
PREV_OK=0 # the earlier tree (GPU_CHECK_PREV) built (now, or by an earlier call)
if [[ -n "$PREV" ]] && ! want build && compgen -G "$PREV/ring_attention/_C*.so" >/dev/null; then
  PREV_OK=1
fi
# ------------------------------------------------------------------ build
if want build; then
  banner build
  b=$(budget $CAP_BUILD "$(reserve_after build)")
  ((b < 120)) && b=120 # a build cut short helps nobody
  t=$SECONDS
  rm -f ring_attention/_C*.so
  extra=()
  if [[ "${GPU_CHECK_PTXAS_V:-1}" == 1 ]]; then extra=(NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }--ptxas-options=-v"); fi
  if [[ -n "$PREV" ]]; then # the earlier tree builds at the same time (its own log)
    rm -f "$PREV"/ring_attention/_C*.so
    echo "and in $PREV (commit $PREV_COMMIT) -> build_prev.log"
    (cd "$PREV" && env TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=16 "${extra[@]}" \
      timeout --kill-after=10 "$b" "$PY" setup.py build_ext --inplace >"$OUT/build_prev.log" 2>&1) &
    prev_pid=$!
  fi
  echo "TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=16 ${extra[*]} $PY setup.py build_ext --inplace (timeout $b s)"
  env TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=16 "${extra[@]}" \
    timeout --kill-after=10 "$b" "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1
  rc=$?
  if [[ -n "$PREV" ]]; then
    wait "$prev_pid"
    prev_rc=$?
    ((prev_rc == 0)) && PREV_OK=1
    echo "earlier tree: build rc=$prev_rc"
  fi
  note="rc=$rc"
  if [[ $rc -ne 0 ]]; then
    BUILD_OK=0
    [[ $rc -eq 124 ]] && note="timed out after $b s"
    tail -n 60 "$OUT/build.log"
  else
    # the freshly built extension imports and runs a tiny CUDA call
    timeout 120 "$PY" - >>"$OUT/build.log" 2>&1 <<'EOF'
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
    tail -n 3 "$OUT/build.log"
    if [[ $rc -ne 0 ]]; then
      BUILD_OK=0
      note="built, but import / tiny CUDA call failed (rc=$rc)"
    else
      note="$(grep -c 'registers' "$OUT/build.log" || true) ptxas reports"
      spills=$(grep -E 'bytes spill (stores|loads)' "$OUT/build.log" | grep -vc ' 0 bytes spill stores, 0 bytes spill loads' || true)
      stack=$(grep -Eo '[0-9]+ bytes stack frame' "$OUT/build.log" | grep -vc '^0 bytes' || true)
      note="$note; $spills with spills, $stack with a stack frame"
    fi
  fi
  [[ -n "$PREV" ]] && note="$note; the earlier tree: rc=$prev_rc (build_prev.log)"
  ((BUILD_OK)) && st=ok || st=FAIL
  record build "$st" $((SECONDS - t)) "$note"
  if [[ "${GPU_CHECK_PTXAS_V:-1}" == 1 && -s "$OUT/build.log" ]]; then
    echo "ptxas resource report (kernels with spills or a stack frame, first 20):"
    grep -B2 -E '([1-9][0-9]* bytes stack frame|[1-9][0-9]* bytes spill)' "$OUT/build.log" |
      grep -E 'Compiling entry|Function properties|stack frame|registers' | head -n 20
  fi
fi

# ------------------------------------------------------------------ tests
if want tests; then
  banner tests
  t=$SECONDS
  if ((!BUILD_OK)); then
    TESTS_OK=0
    echo "skipped: the build failed" >"$OUT/tests.log"
    record tests "SKIP/FAIL" 0 "build failed"
  elif ((!HAVE_GPU)); then
    TESTS_OK=0
    echo "skipped: no GPU" >"$OUT/tests.log"
    record tests "SKIP/FAIL" 0 "no GPU"
  else
    b=$(budget $CAP_TESTS "$(reserve_after tests)")
    ((b < 60)) && b=60
    # shellcheck disable=SC2086
    timeout --kill-after=10 "$b" "$PY" -m pytest -q -p no:cacheprovider -rfE --durations=10 \
      $TESTS -k "$TEST_FILTER" $PYTEST_ARGS 2>&1 | tee "$OUT/tests.log"
    rc=$?
    last=$(grep -E '(passed|failed|error|no tests ran)' "$OUT/tests.log" | tail -n 1)
    note="rc=$rc: $last"
    [[ $rc -eq 124 ]] && note="timed out after $b s: $(tail -n 1 "$OUT/tests.log")"
    [[ $rc -eq 5 ]] && note="no CUDA tests were collected"
    if [[ $rc -ne 0 ]]; then TESTS_OK=0; fi
    ((TESTS_OK)) && st=ok || st=FAIL
    record tests "$st" $((SECONDS - t)) "$note"
  fi
fi

# ------------------------------------------------------------------ ring smoke
if want ring; then
  banner ring
  t=$SECONDS
  if ((!BUILD_OK)); then
    echo "skipped: the build failed" >"$OUT/ring.log"
    record ring SKIP 0 "build failed"
  else
    b=$(budget $CAP_RING "$(reserve_after ring)")
    ((b < 30)) && b=30
    # name nproc args...: one torchrun launch of bench.py ring-run, checked against one process
    ring_run() {
      local name=$1 nproc=$2 left rc
      shift 2
      left=$((b - (SECONDS - t)))
      if ((left < 15)); then
        echo "## $name: skipped (ring budget spent)"
        return 0
      fi
      echo "## $name"
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
    } 2>&1 | tee "$OUT/ring.log"
    fails=$(grep -Ec '^rc=[1-9]' "$OUT/ring.log" || true)
    runs=$(grep -Ec '^rc=' "$OUT/ring.log" || true)
    ((fails == 0 && runs > 0)) && st=ok || st=FAIL
    record ring "$st" $((SECONDS - t)) "$runs ring runs, $fails failed; $(grep -c 'PASS' "$OUT/ring.log" || true) checks passed"
  fi
fi

# ------------------------------------------------------------------ bench
if want bench; then
  banner bench
  t=$SECONDS
  hard=$(left_for bench)
  if ((hard < BENCH_MIN)); then
    echo "skipped: budget ($hard s left)" >"$OUT/bench.log"
    record bench SKIP 0 "only $hard s left"
  else
    ((BUILD_OK)) || echo "note: the build failed: 'ours' is recorded as failed; the baselines still run"
    {
      echo "## bench.py check"
      # at most CHECK_CAP, and BENCH_MIN left for bench.py local
      cap=$((hard - BENCH_MIN))
      ((cap > CHECK_CAP)) && cap=$CHECK_CAP
      # shellcheck disable=SC2086
      timeout --kill-after=10 "$cap" "$PY" benchmarks/bench.py check --device cuda \
        --configs 12x64 16x128 $CHECK_ARGS
      echo "rc=$?"
    } 2>&1 | tee "$OUT/bench.log"
    check_rc=$(grep -Eo '^rc=[0-9]+' "$OUT/bench.log" | tail -n 1 | cut -d= -f2)
    hard=$(left_for bench)
    # shellcheck disable=SC2086
    bench_local "$hard" "$OUT/bench.log" bench $BENCH_ARGS
    rc=$?
    note="check rc=$check_rc; local rc=$rc (hard limit $hard s)"
    [[ $rc -eq 124 || $rc -eq 137 ]] && note="check rc=$check_rc; local killed at the hard limit ($hard s); bench/local.jsonl holds the points so far"
    largest=$(grep -E 'largest n that ran' "$OUT/bench/local.md" 2>/dev/null | tail -n 1)
    [[ -n "$largest" ]] && note="$note; ${largest#- }"
    [[ $rc -eq 0 && "$check_rc" == 0 ]] && st=ok || st=FAIL
    record bench "$st" $((SECONDS - t)) "$note"
  fi
fi

# ------------------------------------------------------------------ kernels
if want kernels; then
  banner kernels
  t=$SECONDS
  hard=$(left_for kernels)
  if ((!BUILD_OK || hard < BENCH_MIN)); then
    echo "skipped: build failed or budget ($hard s left)" >"$OUT/kernels.log"
    record kernels SKIP 0 "build failed or only $hard s left"
  else
    # With the earlier tree built: half the budget each, the same points
    # (compare.md pairs them); the earlier one runs this checkout's benchmarks.
    ((PREV_OK)) && hard=$((hard / 2))
    (
      export RING_ATTENTION_FORWARD=kernel RING_ATTENTION_BACKWARD=kernel
      # shellcheck disable=SC2086
      bench_local "$hard" "$OUT/kernels.log" bench_kernels --passes fwd fwdbwd --methods ours \
        --search-step 0 $KERNELS_ARGS
    )
    rc=$?
    note="rc=$rc (our kernels both ways; hard limit $hard s)"
    if ((PREV_OK)); then
      (
        export RING_ATTENTION_FORWARD=kernel RING_ATTENTION_BACKWARD=kernel PYTHONPATH=$PREV
        echo "## the earlier tree: $PREV (commit $PREV_COMMIT)"
        # shellcheck disable=SC2086
        bench_local "$hard" "$OUT/kernels.log" bench_kernels_prev --passes fwd fwdbwd \
          --methods ours --search-step 0 $KERNELS_ARGS
      )
      prev_rc=$?
      "$PY" benchmarks/bench.py compare "$OUT/bench_kernels" "$OUT/bench_kernels_prev" \
        --out "$OUT/bench_kernels/compare.md" 2>&1 | tee -a "$OUT/kernels.log"
      note="$note; the earlier tree rc=$prev_rc, bench_kernels/compare.md"
      ((prev_rc == 0)) || rc=$prev_rc
    fi
    ((rc == 0)) && st=ok || st=FAIL
    record kernels "$st" $((SECONDS - t)) "$note"
  fi
fi

# ------------------------------------------------------------------ fa4
if want fa4; then
  banner fa4
  t=$SECONDS
  bash scripts/fa4_install.sh >"$OUT/fa4.log" 2>&1
  rc=$?
  cat "$OUT/fa4.log"
  hard=$(left_for fa4)
  if ((rc != 0)); then
    record fa4 SKIP $((SECONDS - t)) "not installed (fa4_install.sh rc=$rc: $(tail -n 1 "$OUT/fa4.log"))"
  elif ((!BUILD_OK || hard < BENCH_MIN)); then
    record fa4 SKIP $((SECONDS - t)) "build failed or only $hard s left"
  else
    # shellcheck disable=SC1090
    source <(bash scripts/fa4_install.sh --env)
    {
      echo "## the CUDA test of gather + flash-attn-4"
      timeout --kill-after=10 120 "$PY" -m pytest -q -p no:cacheprovider -rfEs \
        tests/test_benchmarks_methods.py -k "fa4 and cuda"
      echo "rc=$?"
    } 2>&1 | tee -a "$OUT/fa4.log"
    test_rc=$(grep -Eo '^rc=[0-9]+' "$OUT/fa4.log" | tail -n 1 | cut -d= -f2)
    hard=$(left_for fa4)
    bench_local "$hard" "$OUT/fa4.log" bench_fa4 --methods ours gather fa4 --search-step 0
    rc=$?
    ((rc == 0 && test_rc == 0)) && st=ok || st=FAIL
    record fa4 "$st" $((SECONDS - t)) "test rc=$test_rc; local rc=$rc (hard limit $hard s)"
  fi
fi

# ------------------------------------------------------------------ views
if want views; then
  banner views
  t=$SECONDS
  hard=$(left_for views)
  if ((!BUILD_OK || !HAVE_GPU || hard < BENCH_MIN)); then
    echo "skipped: build failed, no GPU or only $hard s left" >"$OUT/views.log"
    record views SKIP 0 "$(cat "$OUT/views.log")"
  else
    # flash-attn-4 where both parts of its wheels have arrived (else the
    # dense path runs FlashAttention-2 and the FA4 points say why not)
    if bash scripts/fa4_install.sh >"$OUT/views_fa4.log" 2>&1; then
      # shellcheck disable=SC1090
      source <(bash scripts/fa4_install.sh --env)
      fa4_note="flash-attn-4 installed"
    else
      fa4_note="no flash-attn-4 ($(tail -n 1 "$OUT/views_fa4.log"))"
    fi
    prev=()
    ((PREV_OK)) && prev=(--prev "$PREV")
    # the dense path's own host time per call on this machine's CPU (backends
    # stubbed, meta tensors: benchmarks/host_overhead.py), at most 45 s
    h0=$SECONDS
    timeout --kill-after=5 45 "$PY" benchmarks/bench.py host --rounds 1 --reps 3 \
      --out "$OUT/views_host" >"$OUT/views_host.log" 2>&1 || true
    tail -n 12 "$OUT/views_host.log"
    hard=$((hard - (SECONDS - h0)))
    timeout --kill-after=10 "$hard" "$PY" benchmarks/bench.py views --device cuda \
      --out "$OUT/views" --budget-s $((hard - 20)) "${prev[@]}" 2>&1 | tee "$OUT/views.log"
    rc=${PIPESTATUS[0]}
    fails=$(grep -c '"status": "FAIL"' "$OUT/views/views.jsonl" 2>/dev/null || true)
    ((rc == 0)) && st=ok || st=FAIL
    record views "$st" $((SECONDS - t)) "rc=$rc; $fails checks over tolerance; $fa4_note; views/summary.md"
  fi
fi

# ------------------------------------------------------------------ profile
if want profile; then
  banner profile
  t=$SECONDS
  b=$(left_for profile)
  # ncu on PATH, else the newest Nsight Compute under /opt/nvidia or CUDA's bin
  NCU=${NCU:-$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | tail -n 1)}
  if ((!BUILD_OK || !HAVE_GPU || b < 30)) || [[ ! -x "$NCU" ]]; then
    echo "skipped: build failed, no GPU, no ncu or only $b s left" >"$OUT/profile.log"
    record profile SKIP 0 "$(cat "$OUT/profile.log")"
  else
    mkdir -p "$OUT/profile"
    # The first launch of each tensor-core kernel (one branch), bf16 at
    # h 16, d 128; then the same at d 64 (h 12). One ncu run per kernel.
    for spec in "fwd 16 128" "bwd 16 128" "fwd 12 64" "bwd 12 64"; do
      read -r kind h d <<<"$spec"
      left=$((b - (SECONDS - t)))
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
      # per SASS instruction: executions and sampled warp stalls (where the
      # latency-bound kernels wait), for reading without ncu
      "$NCU" --import "$OUT/profile/${kind}_h${h}_d${d}.ncu-rep" --page source --print-source sass \
        --csv 2>&1 | gzip >"$OUT/profile/${kind}_h${h}_d${d}_sass.csv.gz" || true
    done 2>&1 | tee "$OUT/profile.log"
    n=$(find "$OUT/profile" -name '*.ncu-rep' | wc -l)
    ((n > 0)) && st=ok || st=FAIL
    record profile "$st" $((SECONDS - t)) "$n ncu reports (profile/*.ncu-rep, details in profile/*.txt)"
  fi
fi

# ------------------------------------------------------------------ ringdense
if want ringdense; then
  banner ringdense
  t=$SECONDS
  hard=$(left_for ringdense)
  if ((!BUILD_OK || !HAVE_GPU || hard < 30)); then
    echo "skipped: build failed, no GPU or only $hard s left" >"$OUT/ringdense.log"
    record ringdense SKIP 0 "$(cat "$OUT/ringdense.log")"
  else
    timeout --kill-after=10 "$hard" "$PY" -m torch.distributed.run --nproc-per-node=1 \
      -m benchmarks.ring_dense_check --device cuda --out "$OUT/ringdense" 2>&1 | tee "$OUT/ringdense.log"
    rc=${PIPESTATUS[0]}
    ((rc == 0)) && st=ok || st=FAIL
    record ringdense "$st" $((SECONDS - t)) "rc=$rc (hard limit $hard s); ringdense.log"
  fi
fi

# ------------------------------------------------------------------ summary
{
  echo
  echo "## gpu_check summary ($(elapsed) s of ${TOTAL} s)"
  printf '| %-6s | %-9s | %6s | %s\n' stage status seconds note
  printf '|--------|-----------|--------|------\n'
  for i in "${!NAMES[@]}"; do
    printf '| %-6s | %-9s | %6s | %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${NOTES[$i]}"
  done
  if [[ -s "$OUT/bench_kernels/compare.md" ]]; then
    echo
    echo "### our kernels against the earlier tree (bench_kernels/compare.md)"
    cat "$OUT/bench_kernels/compare.md"
  fi
  if [[ -s "$OUT/views/summary.md" ]]; then
    echo
    cat "$OUT/views/summary.md"
  fi
  if [[ -s "$OUT/bench/local.md" ]]; then
    echo
    echo "### targets (from bench/local.md)"
    sed -n '/^### targets/,$p' "$OUT/bench/local.md" | sed '1d'
  fi
} | tee -a "$SUMMARY"

# The device tool brings back at most 8 files: what this run wrote beside the
# summary goes into one archive.
written=()
for f in build.log build_prev.log tests.log ring.log bench.log kernels.log fa4.log views.log \
  views_fa4.log profile.log ringdense.log bench bench_kernels bench_kernels_prev bench_fa4 views \
  profile ringdense; do
  [[ -e "$OUT/$f" ]] && written+=("$f")
done
if [[ "${GPU_CHECK_PACK:-1}" == 1 && ${#written[@]} -gt 0 ]]; then
  if tar -C "$OUT" -czf "$OUT/gpu_check.tar.gz" "${written[@]}"; then
    (cd "$OUT" && rm -rf "${written[@]}")
    echo "packed into $OUT/gpu_check.tar.gz (tar -xzf): ${written[*]}" | tee -a "$SUMMARY"
  fi
fi
echo "files in $OUT: $(cd "$OUT" && find . -type f | sed 's|^\./||' | sort | tr '\n' ' ')" | tee -a "$SUMMARY"

if ((!BUILD_OK || !TESTS_OK)); then
  exit 1
fi
exit 0
