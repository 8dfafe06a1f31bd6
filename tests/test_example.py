"""Smoke test of examples/longnet_encoder.py with a tiny step count."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "longnet_encoder.py")


def test_longnet_encoder_example_runs() -> None:
    cmd = [sys.executable, SCRIPT, "--steps", "3", "--eval-every", "2", "--seq-len", "64",
           "--batch", "4", "--seed", "1", "--threads", "1"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    # FLOPs / reach of both models, then the table: steps 0, 2 and 3.
    assert "dilated" in out and "local" in out and "GFLOP" in out
    rows = [
        line for line in out.splitlines() if "|" in line and line.split("|")[0].strip().isdigit()
    ]
    assert [int(r.split("|")[0]) for r in rows] == [0, 2, 3], out
    for r in rows:
        dl, da, ll, la = r.split("|")[1].split() + r.split("|")[2].split()
        assert float(dl) > 0 and float(ll) > 0
        assert da.endswith("%") and la.endswith("%")
    assert "runtime" in out
