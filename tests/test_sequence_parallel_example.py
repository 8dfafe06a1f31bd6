"""examples/sequence_parallel.py runs the ring, Ulysses and the hybrid under
torchrun (4 gloo processes) and matches one process in each mode."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "sequence_parallel.py")


def test_sequence_parallel_example_runs_every_mode() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           SCRIPT, "--mode", "all", "--seq-len", "1503"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    found = dict(re.findall(r"(\w+): 4 ranks.*max \|sharded - one process\| = (\S+)", res.stdout))
    assert set(found) == {"ring", "ulysses", "hybrid"}, res.stdout
    for mode, err in found.items():
        assert float(err) < 1e-4, (mode, err)
    assert "all-to-all 0.00, ring" in res.stdout  # the ring moves no all-to-all bytes
