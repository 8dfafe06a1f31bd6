"""A sweep that finds its points already measured says plainly that it
measured nothing, where the results came from and how to measure again; it
leaves result files that git tracks as they are unless ``--write-tracked``
asks otherwise, and refuses to measure into them without it
(benchmarks/outputs.py)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from bench_helpers import BENCH, ROOT, TINY, bench, records

RESULT_FILES = ("local.jsonl", "local.md", "local.png")


def _published_local_command() -> list[str]:
    """The command behind benchmarks/RESULTS.md's first CPU table (``bench.py
    local``, its files in a published result folder), as arguments of
    bench.py, with that folder as ``--out-dir``."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    found = re.search(
        r"`python benchmarks/bench\.py (local [^`]*)` \(files: `(results/[^`]+?)/?`", text
    )
    assert found, "benchmarks/RESULTS.md no longer has a bench.py local command with its files"
    return [*shlex.split(found.group(1)), "--out-dir", f"benchmarks/{found.group(2)}"]


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300,
        cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_the_published_command_says_it_measured_nothing_and_leaves_the_published_files() -> None:
    args = _published_local_command()
    folder = ROOT / args[args.index("--out-dir") + 1]
    before = {name: (folder / name).read_bytes() for name in RESULT_FILES}
    res = _run(*args, "--device", "cpu")  # the CPU table, on any machine
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    said = " ".join(res.stdout.split())
    assert said.startswith("nothing measured: all 16 points are already in"), said[:400]
    assert "measured earlier (2026-11-25 on CPU" in said and "--redo --out-dir" in said
    assert "as they are (tracked by git; --write-tracked rewrites them)" in said
    assert "| 65536 |" in res.stdout  # the table of the reused results is printed
    for name in RESULT_FILES:
        assert (folder / name).read_bytes() == before[name], f"{name} was rewritten"


def test_the_published_ring_sweep_is_reused_and_left_alone() -> None:
    folder = ROOT / "benchmarks" / "results"
    before = {name: (folder / name).read_bytes() for name in ("ring.jsonl", "ring.md")}
    res = _run("ring", "--out-dir", str(folder))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert " ".join(res.stdout.split()).startswith("nothing measured: all 8 ring runs")
    for name, data in before.items():
        assert (folder / name).read_bytes() == data, f"{name} was rewritten"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)  # fmt: skip


def test_tracked_results_are_written_only_when_asked(tmp_path: Path) -> None:
    repo, out = tmp_path, tmp_path / "results"
    _git(repo, "init", "-q")
    sweep = ["local", "--seq-lens", "200", "--configs", "2x16", *TINY, "--methods", "ours",
             "--iters", "1", "--threads", "1", "--device", "cpu",
             "--out-dir", str(out)]  # fmt: skip
    first = bench(*sweep)  # an untracked folder: measured and written as before
    assert first.startswith(f"2 points to measure, into {out / 'local.jsonl'}")
    assert "wrote" in first
    measured = len(records(out / "local.jsonl"))
    _git(repo, "add", "results")
    _git(repo, "commit", "-q", "-m", "published")
    report = (out / "local.md").read_text()
    (out / "local.md").write_text(report + "\n")  # changed since: rewriting it would show

    again = bench(*sweep)  # nothing to measure: says so, writes nothing
    assert " ".join(again.split()).startswith("nothing measured: all 2 points are already in")
    assert "left local.jsonl, local.md, local.png in" in " ".join(again.split())
    assert (out / "local.md").read_text() == report + "\n"

    refused = _run(*sweep, "--redo", cwd=repo)  # measuring into tracked files: refused first
    assert refused.returncode != 0 and "tracked by git" in refused.stderr, refused.stderr
    assert "--write-tracked" in refused.stderr
    assert len(records(out / "local.jsonl")) == measured  # nothing measured, nothing appended

    asked = bench(*sweep, "--redo", "--write-tracked")  # asked: measured and written
    assert asked.startswith("2 points to measure") and "wrote" in asked
    assert len(records(out / "local.jsonl")) == measured + 3  # a run record and 2 points
    assert (out / "local.md").read_text() != report + "\n"
