"""examples/hf_sliding_sp.py: a tiny gpt-oss (sinks, sliding and full layers)
trained with transformers' Trainer on 4 gloo ranks (ring 2 x Ulysses 2) has
one process's loss curve; the script says so and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "hf_sliding_sp.py")


def test_sliding_example_matches_one_process() -> None:
    cmd = [sys.executable, SCRIPT, "--steps", "8"]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "ring 2 x Ulysses 2 (16 tokens each)" in res.stdout, res.stdout
    rows = re.findall(r"^\s*(\d+) \|\s*(\S+) \|\s*(\S+)$", res.stdout, re.M)
    assert [int(r[0]) for r in rows] == list(range(1, 9)), res.stdout
    one, hybrid = ([float(r[i]) for r in rows] for i in (1, 2))
    for a, b in zip(one, hybrid, strict=True):  # the table's 6 decimals
        assert abs(a - b) <= 2e-6, res.stdout
    assert one[-1] < one[0], res.stdout  # it trains
    worst = float(re.search(r"relative (\S+) \(tolerance", res.stdout).group(1))
    assert worst <= 1e-5, res.stdout
