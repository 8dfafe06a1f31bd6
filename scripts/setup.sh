#!/usr/bin/env bash
# Set up this checkout: a virtual environment in .venv/ (reused when present),
# PyTorch, the build, test, benchmark and lint tools (pyproject.toml's extras),
# and the extension built in place. Idempotent: a second run installs nothing
# and rebuilds only when csrc/, setup.py or torch changed. Logs: build/logs/.
#
#   bash scripts/setup.sh              # everything
#   bash scripts/setup.sh --no-build   # the environment only (scripts/lint.sh)
#   bash scripts/setup.sh --fa4        # also flash-attn-4 for the CPU interface check
#                                      # (scripts/fa4_cpu.sh: ~1 min, 300 MB; opt-in)
#
# A new .venv sees the base interpreter's packages (--system-site-packages)
# when that interpreter already has torch >= 2.4 (e.g. a GPU machine with
# PyTorch preinstalled): nothing is downloaded for torch then.
#
# Environment: PYTHON (base interpreter of a new .venv, default python3),
# RING_ATTENTION_TORCH (what to pip install when torch is missing, default
# torch==2.13.0), MAX_JOBS (parallel compile jobs, default: all cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd -P)
venv=$root/.venv
py=$venv/bin/python
logs=$root/build/logs
build=1
fa4=0
for arg in "$@"; do
  case "$arg" in
    --no-build) build=0 ;;
    --fa4) fa4=1 ;;
    -h | --help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$logs"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip=("$py" -m pip install --no-input)

# ---------------------------------------------------------------- the venv
if ! "$py" -c "" 2>/dev/null; then
  base=${PYTHON:-python3}
  rm -rf "$venv"
  if "$base" -c 'import sys, torch; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 4))' 2>/dev/null; then
    echo "setup: creating .venv (with $base's packages: torch $("$base" -c 'import torch; print(torch.__version__)'))"
    "$base" -m venv --system-site-packages "$venv"
    # A base that is itself a virtual environment shares only ITS base's
    # packages that way: point .venv at the base's site-packages too.
    if ! "$py" -c "import torch" 2>/dev/null; then
      "$base" -c 'import site; print("\n".join(site.getsitepackages()))' >"$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/base_environment.pth"
    fi
  else
    echo "setup: creating .venv ($base)"
    "$base" -m venv "$venv"
  fi
fi

# ---------------------------------------------------------------- torch, tools
# One quick probe (nothing heavy imported): where torch is, what is missing or
# too old among the build tools and pyproject.toml's extras (test, bench,
# lint), and whether ring_attention is installed from THIS checkout.
probe() {
  cd / && "$py" - "$root" <<'PY'
import importlib.metadata as md
import importlib.util
import os
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
from pip._vendor.packaging.requirements import Requirement

root = sys.argv[1]
spec = importlib.util.find_spec("torch")
print("torch_dir=" + (os.path.dirname(spec.origin) if spec and spec.origin else ""))
with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)
reqs = [r for r in project["build-system"]["requires"] if not r.startswith("torch")]
reqs.append("ninja")  # torch's BuildExtension compiles in parallel with it
for extra in project["project"].get("optional-dependencies", {}).values():
    reqs += extra
for text in dict.fromkeys(reqs):
    req = Requirement(text)
    if req.name == project["project"]["name"]:
        continue  # an extra naming another extra ("ring_attention[hf]"): listed above
    try:
        ok = req.specifier.contains(md.version(req.name), prereleases=True)
    except md.PackageNotFoundError:
        ok = False
    if not ok:
        print("missing=" + text)
spec = importlib.util.find_spec("ring_attention")  # run from /: not the checkout's folder
here = spec is not None and os.path.realpath(spec.origin).startswith(root + os.sep)
print("installed_here=" + str(int(here)))
PY
}
value() { printf '%s\n' "${facts[@]}" | sed -n "s/^$1=//p"; }
mapfile -t facts < <(probe)
if [[ -z "$(value torch_dir)" ]]; then
  req=${RING_ATTENTION_TORCH:-torch==2.13.0}
  echo "setup: installing $req into .venv (a large download unless a local wheel is found)"
  "${pip[@]}" "$req" 2>&1 | { grep -v '^WARNING: Location' || true; }
fi
mapfile -t missing < <(value missing)
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  "${pip[@]}" -q "${missing[@]}" 2>&1 | { grep -v '^WARNING: Location' || true; }
fi
if ((fa4)); then
  PYTHON=$py bash scripts/fa4_cpu.sh
fi
((build)) || exit 0

# ---------------------------------------------------------------- the extension
# The build's [n/N] compile steps are shown as they happen; all of it goes to the log.
show_progress() {
  awk -v root="$root/" '
    match($0, /\[[0-9]+\/[0-9]+\]/) {
      step = substr($0, RSTART, RLENGTH); src = ""
      n = split($0, w, " ")
      for (i = 1; i < n; i++) if (w[i] == "-c" && w[i + 1] ~ /\.(cpp|cu)$/) src = w[i + 1]
      sub(root, "", src)
      printf "setup:   %s %s\n", step, (src == "" ? "link" : src); fflush()
    }'
}
run_build() { # log file, command...
  local log=$1 start=$SECONDS
  shift
  if ! MAX_JOBS=${MAX_JOBS:-$(nproc)} "$@" 2>&1 | tee "$log" | show_progress; then
    echo "setup: build FAILED; the end of ${log#"$root"/}:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
  echo "setup: built ring_attention._C in $((SECONDS - start)) s (log: ${log#"$root"/})"
}

if [[ "$(value installed_here)" != 1 ]]; then
  echo "setup: building ring_attention._C and installing this checkout into .venv (editable)"
  run_build "$logs/install.log" "${pip[@]}" -v --no-build-isolation --no-deps -e .
fi
mapfile -t facts < <(probe) # torch may have been installed above
so=$(ls ring_attention/_C*.so 2>/dev/null | head -n 1 || true)
# Rebuilt when a source, setup.py or the installed torch is newer than the extension.
if [[ -z "$so" || -n "$(find csrc setup.py "$(value torch_dir)/version.py" -newer "$so" 2>/dev/null | head -n 1)" ]]; then
  echo "setup: rebuilding ring_attention._C (sources changed)"
  run_build "$logs/build_ext.log" "$py" setup.py build_ext --inplace
fi
