"""scripts/ptxas_spills.py, which makes scripts/compile_cuda.sh fail a CUDA
source whose ptxas report shows a function spilling registers: on reports
written here in ptxas' format."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "ptxas_spills.py")


def _entry(name: str, arch: str, stack: int, stores: int, loads: int, regs: int) -> str:
    return (
        f"ptxas info    : Compiling entry function '{name}' for '{arch}'\n"
        f"ptxas info    : Function properties for {name}\n"
        f"    {stack} bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads\n"
        f"ptxas info    : Used {regs} registers, used 1 barriers, {stack} bytes cumulative stack"
        " size, 1024 bytes cmem[0]\n"
    )


CLEAN = _entry("_Z3fwdv", "sm_90", 232, 0, 0, 254) + _entry("_Z3bwdv", "sm_80", 0, 0, 0, 200)
SPILLS = CLEAN + _entry("_Z5spillv", "sm_90", 288, 72, 256, 255)
# A device function that is not inlined has its own properties (no entry line).
SUBROUTINE = CLEAN + (
    "ptxas info    : Function properties for _Z6helperv\n"
    "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
)


def _run(tmp_path, text: str, *args: str) -> subprocess.CompletedProcess:
    log = tmp_path / "file.log"
    log.write_text(text)
    return subprocess.run([sys.executable, SCRIPT, *args, str(log)], capture_output=True, text=True)


def test_a_report_without_spills_passes(tmp_path) -> None:
    res = _run(tmp_path, CLEAN)
    assert res.returncode == 0 and res.stdout == "", res.stdout + res.stderr


def test_a_spilling_kernel_fails_with_its_figures(tmp_path) -> None:
    res = _run(tmp_path, SPILLS)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "spill()" in res.stdout and "(sm_90): 72 bytes spill stores, 256 bytes spill loads" in (
        res.stdout
    )
    assert "fwd()" not in res.stdout and "1 of 3 functions spill" in res.stdout


def test_a_spilling_subroutine_fails(tmp_path) -> None:
    res = _run(tmp_path, SUBROUTINE)
    assert res.returncode == 1 and "helper()" in res.stdout, res.stdout + res.stderr


def test_table_lists_every_function(tmp_path) -> None:
    res = _run(tmp_path, SPILLS, "--table")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("sm_90 regs 254 stack 232 spill 0/0 fwd()"), lines
    assert lines[1].startswith("sm_80 regs 200 stack 0 spill 0/0 bwd()"), lines
    assert lines[2].startswith("sm_90 regs 255 stack 288 spill 72/256 spill()"), lines


def test_allowed_functions_are_listed_and_pass(tmp_path) -> None:
    res = _run(tmp_path, SPILLS, "--allow", "^spill")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("allowed: spill() (sm_90): 72 bytes spill stores"), res.stdout
    res = _run(tmp_path, SPILLS + SUBROUTINE[len(CLEAN) :], "--allow", "^spill")
    assert res.returncode == 1 and "1 of 4 functions spill" in res.stdout, res.stdout
