"""The scripts around the benchmarks, run without a GPU: gpu_check.sh (its
plan of two calls and their budgets, its dry run of the whole plan, the
files it brings back), prev_tree.sh, profile_kernels.py and fa4_install.sh."""

from __future__ import annotations

import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from bench_helpers import ROOT


def _gpu_check(tmp_path: Path, *args: str, timeout: int = 300, **env: str):
    full = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "GPU_CHECK_RESULTS": str(tmp_path / "results"),
        **env,
    }
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
        cwd=ROOT,
    )


def _plan(tmp_path: Path, left: int, **env: str) -> tuple[dict, dict, str]:
    """``--plan``: per call its stages' budgets (None: skipped unless time is
    left) in priority order, its run invocation; and the whole output."""
    proc = _gpu_check(tmp_path, "--plan", "--budget-left", str(left), **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stages: dict[int, list[tuple[str, int | None]]] = {}
    runs, call = {}, 0
    for line in proc.stdout.splitlines():
        if line.startswith("call "):
            call = int(line.split()[1].rstrip(":"))
            stages[call] = []
        elif line.startswith("  stage "):
            name, rest = line.split()[1], line.split()[2]
            stages[call].append((name, None if rest == "skipped" else int(rest)))
        elif line.startswith("run "):
            runs[int(line.split()[1].rstrip(":"))] = json.loads(line.split(": ", 1)[1])
    return stages, runs, proc.stdout


def test_gpu_check_plan_fits_in_13_minutes(tmp_path: Path) -> None:
    """``--plan``: two calls whose stages' budgets, the machine's start and the
    transfers add up to at most 13 of the 15 minutes, leaving time to rerun a
    stage; call 1 installs and builds, call 2 measures; the run invocations
    are exact (JSON); ringdense has its own budget."""
    stages, runs, text = _plan(tmp_path, 900)
    assert set(stages) == {1, 2} and set(runs) == {1, 2}
    assert [s for s, _ in stages[1]][:3] == ["info", "fa4", "build"]
    assert {"torch", "prev"} <= {s for s, b in stages[1] if b}
    assert {"fa4", "check", "views", "ringdense", "baselines", "big"} <= \
        {s for s, b in stages[2] if b}  # fmt: skip
    total = 0
    for call in (1, 2):
        budget = int(re.search(rf"call {call}: .*command budget (\d+) s", text).group(1))
        assert sum(b for _, b in stages[call] if b) + 10 <= budget  # 10 s: summary, archive
        assert runs[call]["timeout_s"] > budget
        assert runs[call]["command"].startswith("GPU_BUDGET_LEFT_S=")
        assert runs[call]["command"].endswith(f"bash scripts/gpu_check.sh --call {call}")
        total += budget + 20  # the transfers of a call
    assert runs[1]["carry"] == [".fa4/a", ".prev"] and runs[2]["carry"] == [".fa4/b"]
    start = 180
    assert start + total <= 13 * 60
    m = re.search(r"total: .* = (\d+) s .* of 900 s; (\d+) s left for one rerun", text)
    assert m and int(m.group(1)) == start + total and int(m.group(2)) >= 120


def test_gpu_check_plan_skips_by_priority(tmp_path: Path) -> None:
    """With less device time left the budgets shrink, and the stages of lowest
    priority (listed last) are the ones skipped, each with a line."""
    full, _, _ = _plan(tmp_path, 900)
    short, runs, text = _plan(tmp_path, 600)
    assert runs[1]["command"].startswith("GPU_BUDGET_LEFT_S=600 ")
    for call in (1, 2):
        assert sum(b is not None for _, b in short[call]) <= \
            sum(b is not None for _, b in full[call])  # fmt: skip
    skipped = [s for s, b in short[2] if b is None]
    assert "baselines" in skipped and "views" not in skipped and "check" not in skipped
    assert "skipped unless" in text


def test_gpu_check_plan_names_the_earlier_tree(tmp_path: Path) -> None:
    """The plan says which commit .prev holds, and flags one that is not
    c4a8cfc (the old default of the "x old default" target)."""
    for commit, flagged in (("c4a8cfc5d4", False), ("2262bb7abc", True)):
        tree = tmp_path / commit
        tree.mkdir()
        (tree / "setup.py").write_text("")
        (tree / "SOURCE_COMMIT").write_text(commit + "\n")
        _, _, text = _plan(tmp_path, 900, GPU_CHECK_PREV=str(tree))
        assert f".prev is commit {commit}" in text
        assert ("NOT c4a8cfc" in text) == flagged


def test_gpu_check_dry_run_runs_the_whole_plan(tmp_path: Path) -> None:
    """``--dry-run``: both calls on the CPU with stand-ins, every stage ok;
    each call leaves summary.txt and one archive per stage (at most 8 files),
    each archive with a header.json holding the command line and the
    environment; the summary ends with the targets (unrun on a CPU) and the
    dilated blocks' ratio, whose records (checked ok) the ringdense archive
    holds."""
    proc = _gpu_check(tmp_path, "--dry-run", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "dry run: PASS" in proc.stdout and "bash -n: ok" in proc.stdout
    want = {1: ["fa4", "build", "torch", "prev", "tests"],
            2: ["fa4", "check", "views", "ringdense", "baselines", "big", "tests"]}  # fmt: skip
    for call, stages in want.items():
        out = tmp_path / "out" / f"call{call}"
        names = sorted(p.name for p in out.iterdir())
        assert len(names) <= 8
        assert names == sorted(["summary.txt"] + [f"c{call}-{i + 1:02d}-{s}.tar.gz"
                                                  for i, s in enumerate(stages)])  # fmt: skip
        for name in names[:-1]:
            stage = name.split("-", 2)[2].split(".")[0]
            with tarfile.open(out / name) as tar:
                head = json.load(tar.extractfile(f"{stage}/header.json"))
            assert head["argv"][1:] == ["--dry-run"] and "OUT" in head["env"]
            assert head["stage"] == stage and head["call"] == call
        assert "targets:" in (out / "summary.txt").read_text()
    with tarfile.open(tmp_path / "out" / "call2" / "c2-03-views.tar.gz") as tar:
        recs = [json.loads(x) for x in tar.extractfile("views/views.jsonl").read().splitlines()]
    assert recs[0]["kind"] == "run" and "--methods" in recs[0]["argv"]
    points = [r for r in recs if r.get("method") == "default"]
    assert {r["causal"] for r in points} == {False, True}
    assert {r["pass"] for r in points} == {"fwd", "fwdbwd"}
    assert all(r["status"] == "ok" for r in points)
    with tarfile.open(tmp_path / "out" / "call2" / "c2-04-ringdense.tar.gz") as tar:
        text = tar.extractfile("ringdense/ring_dense_rank0.jsonl").read()
    recs = [json.loads(x) for x in text.splitlines()]
    dilated = [r for r in recs if r["stage"] in ("dilated", "dilated_check")]
    assert len(dilated) == 10 and all(r["status"] == "ok" for r in dilated)
    summary = (tmp_path / "out" / "call2" / "summary.txt").read_text()
    assert re.search(r"dilated ring blocks, dense route / our kernels .*: forward [0-9.]+-[0-9.]+x",
                     summary)  # fmt: skip


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


def test_gpu_check_packs_each_stage_as_it_ends(tmp_path: Path) -> None:
    """Stages by hand, without a GPU: each leaves its own archive (its log and
    header) as it ends, the tests stage fails, the fa4 stage finds no wheels,
    and a stage that does not fit in the budget is skipped with a line."""
    proc = _gpu_check(tmp_path, "--stages", "tests,fa4,views", GPU_CHECK_TOTAL_S="80",
                      FA4_PARTS=str(tmp_path / "none"), FA4_DEST=str(tmp_path / "fa4"))  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["01-tests.tar.gz", "02-fa4.tar.gz",
                                                     "summary.txt"]  # fmt: skip
    with tarfile.open(out / "02-fa4.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["fa4", "fa4/fa4.log", "fa4/header.json"]
        assert "part a missing" in tar.extractfile("fa4/fa4.log").read().decode()
    summary = (out / "summary.txt").read_text()
    assert re.search(r"\| tests +\| SKIP/FAIL .*no GPU", summary)
    assert re.search(r"\| fa4 +\| FAIL ", summary)
    assert re.search(r"\| views +\| SKIP .*does not fit: needs 90 s", summary)


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
