"""Every launch of the dense per-branch path through flash-attn-4's real Python
interface on the CPU, with fake CUDA tensors (benchmarks/fa4_interface.py):
131K at 16 x 128 and 12 x 64, causal and not; GQA (24 / 6 heads, batch 2, short
last segments); documents; grouped head offsets. Each case must route every
call to flash-attn-4, launch it, and copy nothing.

Needs flash-attn-4 for this interpreter: ``bash scripts/fa4_cpu.sh`` installs
it into build/fa4_cpu (about a minute, 110 MB downloaded; opt-in: ``bash
scripts/setup.sh --fa4``). Without it the tests skip and say what is missing.
The first run compiles each kernel variant for sm_90a on the CPU (minutes);
flash-attn-4's kernel cache (build/fa4_cpu/cache) makes later runs fast.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.fa4_interface import CASES

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "build" / "fa4_cpu" / "site"


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, dict]:
    """The check's records by case, from one subprocess (the fake mode and
    flash-attn-4's import stay out of this process)."""
    out = tmp_path_factory.mktemp("fa4") / "records.jsonl"
    check = [sys.executable, "-m", "benchmarks.fa4_interface", "--json", str(out)]
    if (SITE / ".complete").exists():  # scripts/fa4_cpu.sh's install, on its PYTHONPATH
        cmd = ["bash", "-c", 'eval "$(bash scripts/fa4_cpu.sh --env)"; exec "$@"', "-", *check]
    elif importlib.util.find_spec("flash_attn") is not None:
        cmd = check
    else:
        pytest.skip(f"flash-attn-4 is not installed for this interpreter ({SITE} is missing and "
                    "flash_attn does not import): bash scripts/fa4_cpu.sh installs it")  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_the_copy_counter_counts(records) -> None:
    """The control: a q view off by one element is copied, and counted."""
    (control,) = [r for c, r in records.items() if c.startswith("control")]
    assert control["status"] == "ok", control


@pytest.mark.parametrize("case", list(CASES))
def test_forward_launches_go_through_fa4_without_a_copy(records, case) -> None:
    rec = records[case]
    assert "error" not in rec, rec.get("where", rec["error"])
    assert rec["backends"] == ["fa4"], rec["routes"]
    assert rec["forward"]["launches"] >= rec["calls"] > 0
    assert rec["forward"]["copies"] == {}
    assert rec["status"] == "ok"


@pytest.mark.parametrize("case", list(CASES))
def test_backward_launches_go_through_fa4_without_a_copy(records, case) -> None:
    rec = records[case]
    assert "error" not in rec, rec.get("where", rec["error"])
    assert rec["backward"]["launches"] == rec["forward"]["launches"]
    assert rec["backward"]["copies"] == {}
