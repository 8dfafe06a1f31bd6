"""A launcher's processes that never call ``init_process_group``: torchrun sets
``WORLD_SIZE`` > 1, and the sharded entry points with ``group=None`` raise a
``RuntimeError`` naming the fix on every rank, instead of each process
silently computing the whole sequence alone. With ``WORLD_SIZE`` unset or 1 a
plain process still computes the whole sequence, as before.

Real processes: torchrun starts two, each runs the script below and reports
what every entry point did, first under torchrun's environment, then with
``WORLD_SIZE=1`` and with it unset."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from child_env import with_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = """
import json, os
import torch
import ring_attention as ra

x = torch.randn(1, 8, 2, 4)
calls = {
    "ring_dilated_attention": lambda: ra.ring_dilated_attention(x, x, x, [8], [1]),
    "RingDilatedAttention": lambda: ra.RingDilatedAttention([8], [1])(x, x, x),
    "shard_sequence": lambda: ra.shard_sequence(x, 1),
    "gather_sequence": lambda: ra.gather_sequence(x, 1),
}


def outcomes():
    found = {}
    for name, call in calls.items():
        try:
            found[name] = ["returned", list(call().shape)]
        except Exception as exc:
            found[name] = [type(exc).__name__, str(exc)]
    return found


report = {"launched": outcomes()}
os.environ["WORLD_SIZE"] = "1"
report["one"] = outcomes()
del os.environ["WORLD_SIZE"]
report["unset"] = outcomes()
print("REPORT " + os.environ["RANK"] + " " + json.dumps(report), flush=True)
"""


def test_launched_processes_without_a_group_raise_naming_the_fix(tmp_path) -> None:
    script = tmp_path / "no_group.py"
    script.write_text(_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(script)]  # fmt: skip
    env = dict(with_path(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    reports = {}
    for line in res.stdout.splitlines():
        if line.startswith("REPORT "):
            _, rank, payload = line.split(" ", 2)
            reports[int(rank)] = json.loads(payload)
    assert sorted(reports) == [0, 1], res.stdout
    for rank, report in reports.items():
        for name, (kind, text) in report["launched"].items():
            assert kind == "RuntimeError", (rank, name, kind, text)
            assert "WORLD_SIZE=2" in text and "init_process_group" in text, (rank, name, text)
        for env_case in ("one", "unset"):  # one process: the whole sequence, as before
            for name, outcome in report[env_case].items():
                assert outcome == ["returned", [1, 8, 2, 4]], (rank, env_case, name, outcome)
