"""The benchmark entry point (benchmarks/bench.py) and scripts/gpu_check.sh run:
tiny sizes, one process and a 2-process gloo ring, the exact work count, the
FlexAttention baseline's block masks, resuming, and the baselines without the
extension. Speed is never asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from oracle import multiplicity

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench.py"
TINY = ["--segments", "64", "160", "--dilations", "1", "3"]


def bench(*args: str, env: dict | None = None, timeout: float = 180) -> str:
    """Run ``bench.py ARGS``; its stdout (stderr on failure in the message)."""
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True, text=True, timeout=timeout, env=run_env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def methods():
    """benchmarks/methods.py, loaded from its file (it imports only torch)."""
    spec = importlib.util.spec_from_file_location("bench_methods", ROOT / "benchmarks/methods.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pattern_pairs_equal_the_oracle(methods) -> None:
    """The exact pattern work (FLOP counts) equals the oracle's multiplicity
    matrix summed, whole sequence and any rows (a rank's pieces)."""
    rng = random.Random(7)
    for _ in range(40):
        n, heads = rng.randint(1, 200), rng.randint(1, 6)
        segs = [rng.randint(1, 260) for _ in range(rng.randint(1, 3))]
        dils = [rng.randint(1, min(w, 7)) for w in segs]
        causal = rng.random() < 0.5
        groups = heads >= len(segs) and rng.random() < 0.3
        m = multiplicity(n, heads, segs, dils, causal, groups)
        assert methods.pattern_pairs(n, heads, segs, dils, causal, groups, batch=3) == (
            3 * int(m.sum())
        )
        a, b = sorted(rng.sample(range(n + 1), 2)) if n > 1 else (0, n)
        rows = [(0, a), (b, n - b)]
        expect = int(m[:, :a].sum() + m[:, b:].sum())
        assert methods.pattern_pairs(n, heads, segs, dils, causal, groups, rows=rows) == expect


def test_flex_block_masks_cover_the_pattern(methods) -> None:
    """The analytic FlexAttention block masks never skip a reached block and
    never call a block full that is not (ragged n and segments included)."""
    for n, segs, dils in [(300, [64, 160], [1, 3]), (1000, [128, 384], [1, 6]),
                          (640, [640], [1]), (513, [100, 2048], [2, 12])]:  # fmt: skip
        for causal in (False, True):
            ours = methods.flex_block_state(n, segs, dils, causal, "cpu")
            ref = methods.reference_block_state(n, 12, segs, dils, causal, "cpu")
            assert ((ref > 0) <= (ours > 0)).all()
            assert ((ours == 2) <= (ref == 2)).all()
            assert (ref > 0).any()


def test_check_subcommand_passes_for_every_method() -> None:
    """ours, gather+SDPA, FlexAttention (eager: the CPU has no compiled LSE) and
    dense SDPA (a dense pattern) against gather+SDPA in float64."""
    out = bench("check", "--n", "300", "--configs", "3x16", *TINY, "--flex-eager")
    assert "check: PASS" in out, out
    for name in ("ours", "gather", "flex"):
        assert f" {name}: " in out
    out = bench("check", "--n", "200", "--configs", "2x8", "--segments", "256",
                "--dilations", "1", "--methods", "ours", "dense")  # fmt: skip
    assert " dense: " in out and "check: PASS" in out, out


def test_local_sweep_records_resumes_and_plots(tmp_path: Path) -> None:
    args = ["local", "--seq-lens", "200", "320", "--configs", "2x16", *TINY, "--methods",
            "ours", "gather", "dense", "--iters", "1", "--threads", "1", "--out-dir",
            str(tmp_path)]  # fmt: skip
    out = bench(*args)
    assert "12 points: 0 already" in out
    recs = records(tmp_path / "local.jsonl")
    runs = [r for r in recs if r["kind"] == "run"]
    points = [r for r in recs if r["kind"] == "local"]
    assert len(runs) == 1 and runs[0]["hardware_flop_rate"] > 0
    assert len(points) == 12 and len({r["key"] for r in points}) == 12
    for r in points:
        assert r["status"] == "ok", r
        assert r["ms"] > 0 and r["runs"] == 1 and r["peak_bytes"] >= r["input_bytes"]
        m = multiplicity(r["n"], 2, [64, 160], [1, 3], False, False)
        assert r["pairs"] == int(m.sum())
        if r["method"] == "dense":
            assert not r["same_function"] and r["own_pairs"] == 2 * r["n"] ** 2
        else:
            assert r["pattern_flop_rate"] > 0
        if r["method"] == "ours":  # the CPU default: our kernels both ways
            backward = "kernel" if r["pass"] == "fwdbwd" else None
            assert r["paths"] == {"forward": "kernel", "backward": backward}
        else:
            assert "paths" not in r
    assert (tmp_path / "local.md").read_text().count("| ours |") == 4
    assert (tmp_path / "local.png").read_bytes()[:4] == b"\x89PNG"
    # a second run finds every point done and measures nothing
    out = bench(*args)
    assert "12 points: 12 already" in out and "0 to run" in out
    assert len(records(tmp_path / "local.jsonl")) == len(recs)


def test_local_dry_run_plans_the_gpu_sweep_without_a_gpu() -> None:
    out = bench("local", "--dry-run", "--device", "cuda")
    assert "56 points" in out and "1048576" in out and "bfloat16" in out


def test_baselines_run_when_the_extension_does_not_import(tmp_path: Path) -> None:
    """A broken build (ring_attention raises on import) fails 'ours' only."""
    fake = tmp_path / "shadow" / "ring_attention"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('extension not built')\n")
    env = {"PYTHONPATH": str(fake.parent)}
    bench("local", "--seq-lens", "200", "--configs", "2x16", *TINY, "--methods", "ours",
          "gather", "--passes", "fwd", "--iters", "1", "--out-dir", str(tmp_path / "out"),
          env=env)  # fmt: skip
    by = {r["method"]: r for r in records(tmp_path / "out" / "local.jsonl") if "method" in r}
    assert by["ours"]["status"] == "error" and "not importable" in by["ours"]["reason"]
    assert by["gather"]["status"] == "ok"


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


def test_ring_run_help_and_bad_arguments_print_once() -> None:
    out = bench("ring-run", "--help")
    assert out.count("usage:") == 1
    for option in ("--seq-len", "--check", "--layout", "--backward", "--threads"):
        assert option in out
    proc = subprocess.run(
        [sys.executable, str(BENCH), "ring-run", "--segments", "8", "--dilations", "1", "2",
         "--print-nproc"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "same length" in proc.stderr + proc.stdout


def test_gpu_check_dry_run_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "bash -n: ok" in out and "bench.py local" in out and "ring-run" in out
    assert "56 points" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: CUDA sweep not run")
def test_local_sweep_on_cuda(tmp_path: Path) -> None:
    bench("local", "--device", "cuda", "--seq-lens", "4096", "--configs", "4x64", *TINY,
          "--iters", "1", "--search-step", "0", "--out-dir", str(tmp_path))  # fmt: skip
    recs = [r for r in records(tmp_path / "local.jsonl") if r["kind"] == "local"]
    assert {r["status"] for r in recs if r["method"] in ("ours", "gather")} == {"ok"}
    # bf16 on CUDA: SDPA's backward per branch; the forward ours below 131072 rows
    for r in recs:
        if r["method"] == "ours":
            backward = "sdpa" if r["pass"] == "fwdbwd" else None
            assert r["paths"] == {"forward": "kernel", "backward": backward}, r


def test_llm_subcommand_measures_gqa_bytes_and_packed_documents(tmp_path: Path) -> None:
    out = bench(
        "llm", "--seq-lens", "4096", "--worlds", "4", "--segments", "512", "2048",
        "--dilations", "1", "2", "--cpu-seq-lens", "512", "--doc-seq-len", "1024",
        "--documents", "40", "--iters", "1", "--threads", "1", "--out-dir", str(tmp_path),
    )  # fmt: skip
    text = (tmp_path / "llm.md").read_text()
    assert text.strip() == out.strip()
    # 32 query heads on 8 K/V heads: a dense branch (r = 1) alone would send a
    # quarter; with dilation the union over a group's heads sends at most that
    row = next(line for line in text.splitlines() if line.startswith("| 4096 | 4 |"))
    rep, gqa, grouped = (float(x) for x in row.split("|")[3:6])
    assert 0 < grouped <= gqa < rep <= 4 * grouped
    assert "| packed |" in text and "| unpacked |" in text


def test_tiles_microbenchmark_runs() -> None:
    """``bench.py tiles`` builds its one-thread C++ micro-benchmark (with the
    kernels' softmax passes compiled in) and prints every product it times."""
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    if not {"amx_bf16", "avx512f"} <= flags:
        pytest.skip("bench.py tiles times oneDNN's bf16 brgemm on AMX: no amx_bf16 here")
    out = bench("tiles", "--iters", "3", "--rounds", "1", timeout=900)
    for product in (
        "bf16 S brgemm packed",
        "bf16 PV mkl",
        "fp32 S brgemm K^T",
        "fp32 PV sgemm in place",
        "bwd fp32 dV^T brgemm",
        "bwd fp32 dQ brgemm",
        "pass: fp32 softmax",
        "pass: fp32 lazy exp",
        "fp32 torch.mm 2048^3",
    ):
        assert product in out, out
