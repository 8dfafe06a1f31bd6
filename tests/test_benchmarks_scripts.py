"""The scripts around the benchmarks, run without a GPU: gpu_check.sh (its
plan, the earlier tree, the files it brings back, the views stage),
prev_tree.sh, profile_kernels.py and fa4_install.sh."""

from __future__ import annotations

import lzma
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from bench_helpers import ROOT


def test_gpu_check_dry_run_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "bash -n: ok" in out and "bench.py local" in out and "ring-run" in out
    assert "72 points" in out


def test_prev_tree_exports_an_earlier_commit(tmp_path: Path) -> None:
    """scripts/prev_tree.sh: the sources of a commit (no build outputs) and
    its hash, for gpu_check.sh to build and time beside this checkout."""
    dest = tmp_path / "prev"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "prev_tree.sh"), "HEAD~1", str(dest)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want = subprocess.run(["git", "rev-parse", "HEAD~1"], capture_output=True, text=True,
                          cwd=ROOT).stdout.strip()  # fmt: skip
    assert (dest / "SOURCE_COMMIT").read_text().strip() == want
    for path in ("setup.py", "csrc/cuda/block_forward.cu", "ring_attention/__init__.py"):
        assert (dest / path).is_file(), path
    assert not list(dest.rglob("*.so")) and not (dest / "tests").exists()
    bad = subprocess.run(
        ["bash", str(ROOT / "scripts" / "prev_tree.sh"), "no-such-ref", str(tmp_path / "x")],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert bad.returncode != 0 and not (tmp_path / "x").exists()


def test_gpu_check_plans_the_earlier_tree(tmp_path: Path) -> None:
    """With an exported tree, gpu_check.sh's plan builds it beside this one and
    times both in the kernels stage; without one it does not mention it."""
    tree = tmp_path / "prev"
    tree.mkdir()
    (tree / "setup.py").write_text("")
    (tree / "SOURCE_COMMIT").write_text("0123456789abcdef\n")
    plans = []
    for prev in (tree, tmp_path / "none"):
        env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
               "GPU_CHECK_PREV": str(prev)}  # fmt: skip
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--stages",
             "build,kernels"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        plans.append(proc.stdout)
    assert f"prev : {tree} (commit 0123456789abcdef)" in plans[0]
    assert "bench_kernels/compare.md" in plans[0]
    assert "prev :" not in plans[1]


def test_gpu_check_brings_back_two_files(tmp_path: Path) -> None:
    """The device tool returns at most 8 files: gpu_check.sh leaves the summary
    and one archive of its logs (here without a GPU: the tests stage fails,
    the fa4 stage finds no wheels)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out),
           "FA4_PARTS": str(tmp_path / "none"), "FA4_DEST": str(tmp_path / "fa4")}  # fmt: skip
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--stages", "tests,fa4"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.txt"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["fa4.log", "tests.log"]
        log = tar.extractfile("fa4.log").read().decode()
    assert "part a missing" in log
    summary = (out / "summary.txt").read_text()
    assert "| fa4    | SKIP" in summary and "| tests  | SKIP/FAIL" in summary


def test_gpu_check_views_stage_without_a_gpu(tmp_path: Path) -> None:
    """The views stage (bench.py views on a GPU) is planned, and
    without a GPU recorded as skipped, its log packed like the others'."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out)}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--stages", "views"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    assert "| views  | SKIP" in summary and "no GPU" in summary
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert tar.getnames() == ["views.log"]


def test_profile_driver_runs_our_kernels() -> None:
    """scripts/profile_kernels.py (what gpu_check.sh's profile stage runs under
    Nsight Compute) runs a forward and backward on our kernels."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "profile_kernels.py"), "--device", "cpu",
         "--n", "3000", "--heads", "2", "--head-dim", "16", "--dtype", "float32", "--backward"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(forward kernel, backward kernel)" in proc.stdout
    assert "out finite: True" in proc.stdout


def test_fa4_install_puts_the_two_parts_together(tmp_path: Path) -> None:
    """scripts/fa4_install.sh, with stand-in packages in the layout that
    scripts/fa4_wheels.sh makes: part a and part b arrive in separate calls;
    the second installs, and flash_attn.cute and cutlass (found through the
    DSL's package folder, which PYTHONPATH must name) import."""
    big = "./nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_cutlass_ir.cu13.so"
    a, b = tmp_path / "call1" / "a", tmp_path / "call2" / "b"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (a / "path.txt").write_text(big + "\n")
    (a / "cutlass_ir.so.xz").write_bytes(lzma.compress(b"module bytes"))
    with zipfile.ZipFile(b / "stand_in-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("flash_attn/__init__.py", "")
        whl.writestr("flash_attn/cute/__init__.py", "__version__ = 'stand-in'\n")
    rest = tmp_path / "rest"
    (rest / "nvidia_cutlass_dsl/dsl_packages/cutlass").mkdir(parents=True)
    (rest / "nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py").write_text("")
    with tarfile.open(b / "libs_cu13_rest.tar.xz", "w:xz") as tar:
        tar.add(rest, arcname=".")
    dest = tmp_path / "dest"

    def install(parts: Path, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHON": sys.executable, "FA4_PARTS": str(parts),
               "FA4_DEST": str(dest), "PYTHONPATH": ""}  # fmt: skip
        return subprocess.run(
            ["bash", str(ROOT / "scripts" / "fa4_install.sh"), *args],
            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
        )  # fmt: skip

    first = install(tmp_path / "call1")
    assert first.returncode == 3 and "part b missing" in first.stdout, first.stdout
    second = install(tmp_path / "call2")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "imports from" in second.stdout
    assert (dest / "site" / big).read_bytes() == b"module bytes"
    env_line = install(tmp_path / "call2", "--env").stdout
    assert "dsl_packages" in env_line and str(dest) in env_line
