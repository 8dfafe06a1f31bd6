"""Running benchmarks/bench.py from the tests (tests/test_benchmarks_*.py):
the command, its output, the records it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench.py"
TINY = ["--segments", "64", "160", "--dilations", "1", "3"]


def bench_run(*args: str, env: dict | None = None, timeout: float = 180):
    """Run ``bench.py ARGS``; the finished process (it must succeed)."""
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True, text=True, timeout=timeout, env=run_env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def bench(*args: str, env: dict | None = None, timeout: float = 180) -> str:
    """Run ``bench.py ARGS``; its stdout (stderr on failure in the message)."""
    return bench_run(*args, env=env, timeout=timeout).stdout


def prose_width(report: str) -> int:
    """The widest line of a markdown report outside its tables."""
    return max(len(line) for line in report.splitlines() if not line.startswith("|"))


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
