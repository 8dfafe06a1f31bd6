"""bench.py's ring: the sweep over a 2-process gloo ring (the ring matches one
process, the measured bytes equal the plan's, the work splits exactly), the
main job ``ring-run`` in one process, its help, and its options refused
before any process starts (what scripts/run_ring.sh relies on)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from bench_helpers import BENCH, ROOT, TINY, bench, records
from oracle import multiplicity


def test_ring_sweep_two_gloo_processes(tmp_path: Path) -> None:
    """bench.py ring launches ring-run under torchrun (2 gloo processes): the ring
    matches one process, the measured bytes equal the plan's, the work splits
    exactly, and the main job's output fits 100 columns."""
    out = bench("ring", "--worlds", "2", "--scaling", "strong", "--seq-len", "600",
                "--heads", "3", "--head-dim", "16", *TINY, "--causal", "--layout", "zigzag",
                "--iters", "1", "--check", "--out-dir", str(tmp_path))  # fmt: skip
    assert "### strong scaling" in out
    rings = [r for r in records(tmp_path / "ring.jsonl") if r["kind"] == "ring"]
    assert [r["p"] for r in rings] == [2]
    m = multiplicity(600, 3, [64, 160], [1, 3], True, False)
    for r in rings:
        assert r["status"] == "ok", r
        assert max(r["check"].values()) < 1e-5, r["check"]
        assert r["pairs_total"] == int(m.sum())
        for rank in r["ranks"]:
            assert rank["sent_all"] == rank["plan_all"] and rank["sent_fwd"] == rank["plan_fwd"]
        assert r["sent_MiB"] > 0
    log = (tmp_path / "logs" / "ring_strong_p2_n600.log").read_text()
    report = log[log.index("ring_dilated_attention:") :].splitlines()
    assert report[0].startswith("ring_dilated_attention: 2 process(es), backend gloo")
    assert all(len(line) <= 100 for line in report), max(report, key=len)
    assert log.count("ring_dilated_attention:") == 1 and "PASS" in log
    assert (tmp_path / "ring.png").read_bytes()[:4] == b"\x89PNG"


def test_ring_run_one_process_in_a_named_backend_group() -> None:
    """With --backend named, one process joins a process group, so the ring's
    handshake runs through it (how gpu_check.sh reaches NCCL on one GPU)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         str(BENCH), "ring-run", "--device", "cpu", "--backend", "gloo", "--seq-len", "300",
         "--heads", "2", "--head-dim", "8", *TINY, "--iters", "1", "--check", "yes", "--backward"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 process(es), backend gloo" in proc.stdout and "PASS" in proc.stdout


def test_ring_run_help_prints_once() -> None:
    out = bench("ring-run", "--help")
    assert out.count("usage:") == 1
    for option in ("--seq-len", "--check", "--layout", "--backward", "--threads"):
        assert option in out


@pytest.mark.parametrize(
    "args,words",
    [
        (["--seq-len", "0"], "--seq-len must be in [1, 2**62), got 0"),
        (["--seq-len", "-3"], "--seq-len must be in [1, 2**62), got -3"),
        (["--seq-len", str(10**13), "--device", "cpu"], "the inputs alone need"),
        (["--heads", "0"], "--heads must be >= 1"),
        (["--head-dim", "0"], "--head-dim must be >= 1"),
        (["--batch", "0"], "--batch must be >= 1"),
        (["--iters", "0"], "--iters must be >= 1"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--threads", "-2"], "--threads must be >= 0"),
        (["--seed", "-1"], "--seed must be in [0, 2**32)"),
        (["--timeout-min", "nan"], "--timeout-min must be > 0"),
        (["--segments", "8", "--dilations", "1", "2"], "must have the same length"),
        (["--segments", "8", "--dilations", "9"], "dilation_rates[0] must be <= segment"),
        (["--segments", "0", "--dilations", "1"], "segment_lengths[0] must be >= 1"),
        (["--segments", "8", "4", "--dilations", "1", "1", "--head-groups", "--heads", "1"],
         "head_groups=True needs at least as many heads"),
    ],
)  # fmt: skip
def test_ring_run_rejects_nonsense_before_any_process_starts(args, words) -> None:
    """scripts/run_ring.sh asks ``--print-nproc`` first; every nonsensical option
    fails there, naming it, so torchrun never starts (``--seq-len 0`` used to
    pass, then rank 0 died in ``max()`` and the others lost their peer). The
    check in this process (the command line's own run: the test below)."""
    from benchmarks.cli import build_parser
    from benchmarks.ring_run import check_ring_args

    a = build_parser().parse_args(["ring-run", *args, "--print-nproc"])
    with pytest.raises(SystemExit) as e:
        check_ring_args(a)
    assert words in str(e.value.code), e.value.code


def test_run_ring_checks_nproc(monkeypatch) -> None:
    """``$NPROC`` (scripts/run_ring.sh's process count) is checked with the options."""
    from benchmarks.cli import build_parser
    from benchmarks.ring_run import check_ring_args

    monkeypatch.setenv("NPROC", "0")
    a = build_parser().parse_args(["ring-run", "--print-nproc", "--device", "cpu"])
    with pytest.raises(SystemExit) as e:
        check_ring_args(a)
    assert "NPROC must be a positive integer, got '0'" in str(e.value.code), e.value.code


def test_ring_run_print_nproc_fails_before_printing() -> None:
    """The command line: a bad option exits non-zero, printing its message once
    on stderr and nothing on stdout (the checks themselves: the tests above)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH), "ring-run", "--seq-len", "0", "--print-nproc"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode != 0 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.count("--seq-len must be in [1, 2**62), got 0") == 1, proc.stderr
