"""The benchmark entry point (benchmarks/bench.py) and scripts/gpu_check.sh run:
tiny sizes, one process and a 2-process gloo ring, the exact work count, the
FlexAttention baseline's block masks, resuming, and the baselines without the
extension. Speed is never asserted."""

from __future__ import annotations

import json
import lzma
import os
import random
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from oracle import multiplicity

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench.py"
TINY = ["--segments", "64", "160", "--dilations", "1", "3"]


def bench_run(*args: str, env: dict | None = None, timeout: float = 180):
    """Run ``bench.py ARGS``; the finished process (it must succeed)."""
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True, text=True, timeout=timeout, env=run_env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def bench(*args: str, env: dict | None = None, timeout: float = 180) -> str:
    """Run ``bench.py ARGS``; its stdout (stderr on failure in the message)."""
    return bench_run(*args, env=env, timeout=timeout).stdout


def prose_width(report: str) -> int:
    """The widest line of a markdown report outside its tables."""
    return max(len(line) for line in report.splitlines() if not line.startswith("|"))


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def methods():
    """benchmarks/methods.py (it imports only torch)."""
    from benchmarks import methods

    return methods


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


class _FA4StandIn:
    """flash-attn-4's calling convention ((B, L, H, D) in and out, lse (B, H, L)
    float32, a backward from a given out / lse) over plain float32 math: what
    the fa4 baseline's own code (layouts, LSE, merge) is checked against on a
    machine where flash-attn-4 cannot run."""

    def __init__(self, sdpa) -> None:
        self.m = sdpa  # benchmarks/sdpa.py: its math reference
        self.calls = 0

    def flash_attn_func(self, q, k, v, *, softmax_scale, causal, return_lse):
        assert return_lse and q.dim() == 4 and q.stride(-1) == 1
        self.calls += 1
        out, lse = self.m._math_fwd(*(t.transpose(1, 2) for t in (q, k, v)), causal, softmax_scale)
        return out.transpose(1, 2), lse

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale, causal):
        assert lse.dtype == torch.float32 and lse.is_contiguous()
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        grads = self.m._math_bwd(
            *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, causal, softmax_scale
        )
        return tuple(g.transpose(1, 2) for g in grads)


@pytest.mark.parametrize("causal", [False, True])
def test_fa4_baseline_layout_and_merge(methods, monkeypatch, causal: bool) -> None:
    """gather + flash-attn-4 computes ra.dilated_attention, forward and
    gradients (with flash-attn-4's calling convention stood in by math: the
    adapter's transposes and LSE shapes are what this checks; a run of the
    real library is the CUDA test below)."""
    import ring_attention as ra
    from benchmarks import sdpa
    from ring_attention import backends  # where the gather baseline looks flash-attn-4 up

    stand_in = _FA4StandIn(sdpa)
    monkeypatch.setattr(backends, "fa4_interface", lambda: stand_in)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    n, h, d, segs, dils = 700, 5, 16, [64, 160, 384], [1, 3, 4]
    q, k, v, g = (torch.randn(2, n, h, d, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = methods.gather_sdpa_dilated(
        *leaves, segs, dils, causal, return_lse=True, backend="fa4"
    )
    grads = torch.autograd.grad(out, leaves, g)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    rout, rlse = ra.dilated_attention(*ref, segs, dils, causal=causal, return_lse=True)
    rgrads = torch.autograd.grad(rout, ref, g.double())
    assert stand_in.calls > len(segs)  # per branch and offset class, full and ragged chunks
    torch.testing.assert_close(out.double(), rout, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), rlse, atol=2e-5, rtol=1e-4)
    for a, b in zip(grads, rgrads, strict=True):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=1e-4)


def test_fa4_is_reported_where_it_cannot_run(methods) -> None:
    cpu = torch.device("cpu")
    assert "fa4" not in methods.default_methods(cpu)
    assert "fa4" in methods.default_methods(torch.device("cuda"))
    meth = methods.Methods([64], [1], False, cpu)
    assert "CUDA" in meth.unsupported("fa4", False)
    assert meth.backends("fa4", methods.SDPA_BACKENDS) == ["fa4"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: flash-attn-4 not run")
def test_fa4_baseline_on_cuda_matches_the_oracle(methods) -> None:
    missing = methods.fa4_missing()
    if missing:
        pytest.skip(f"flash-attn-4 does not import here: {missing}")
    import ring_attention as ra

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    n, h, d, segs, dils = 5000, 4, 128, [512, 1024, 2048], [1, 2, 4]
    q, k, v, g = (torch.randn(1, n, h, d, generator=gen) for _ in range(4))
    for causal in (False, True):
        x = [t.cuda().bfloat16().requires_grad_() for t in (q, k, v)]
        out = methods.gather_sdpa_dilated(*x, segs, dils, causal, backend="fa4")
        grads = torch.autograd.grad(out, x, g.cuda().bfloat16())
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        rout = ra.dilated_attention(*ref, segs, dils, causal=causal)
        rgrads = torch.autograd.grad(rout, ref, g.double())
        for a, b in zip((out, *grads), (rout, *rgrads), strict=True):
            err = (a.double().cpu() - b).norm() / b.norm()
            assert err < 2e-2, (causal, err.item())


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
    proc = bench_run(*args)
    out = proc.stdout
    assert "12 points: 0 already" in out
    assert "| 12/12 [" in proc.stderr and "/6 [" not in proc.stderr  # points, not 6 groups
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
    report = (tmp_path / "local.md").read_text()
    assert report.count("| ours |") == 4
    # the summary has a column for each method that ran, and none for the others
    assert "| gather+SDPA ms | dense SDPA† ms |" in report
    assert "FlexAttention ms" not in report and "gather+FA4 ms" not in report
    # header and notes fit 100 columns; dense SDPA's note is there as dense ran
    assert prose_width(report) <= 100 and "dense SDPA computes all n²" in " ".join(report.split())
    assert (tmp_path / "local.png").read_bytes()[:4] == b"\x89PNG"
    # a second run finds every point done and measures nothing
    out = bench(*args)
    assert "12 points: 12 already" in out and "0 to run" in out
    assert len(records(tmp_path / "local.jsonl")) == len(recs)


def test_local_dry_run_plans_the_gpu_sweep_without_a_gpu() -> None:
    out = bench("local", "--dry-run", "--device", "cuda")
    assert "72 points" in out and "1048576" in out and "bfloat16" in out


def test_baselines_run_when_the_extension_does_not_import(tmp_path: Path) -> None:
    """A broken build (the extension ring_attention._C does not import) fails
    'ours' only; the exact work count needs no extension."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text(
        "import sys\nsys.modules['ring_attention._C'] = None  # as if not built\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}
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


def test_compare_times_this_checkout_against_an_exported_tree(tmp_path: Path, capsys) -> None:
    """bench.py local with PYTHONPATH naming an exported tree times that
    tree's ring_attention and records its commit; bench.py compare pairs the
    two runs point by point (here the tree is this checkout's package under
    another name, with a made-up commit). The command line once; its other
    cases in this process (the same ``main``)."""
    from benchmarks.cli import main

    tree = tmp_path / "prev"
    tree.mkdir()
    (tree / "ring_attention").symlink_to(ROOT / "ring_attention")
    (tree / "SOURCE_COMMIT").write_text("abcdef0123456789\n")
    args = ["local", "--seq-lens", "200", "--configs", "2x16", *TINY, "--methods", "ours",
            "--iters", "1", "--threads", "1"]  # fmt: skip
    bench(*args, "--out-dir", str(tmp_path / "new"))
    bench(*args, "--out-dir", str(tmp_path / "old"), env={"PYTHONPATH": str(tree)})
    runs = {name: [r for r in records(tmp_path / name / "local.jsonl") if r["kind"] == "run"]
            for name in ("new", "old")}  # fmt: skip
    report = (tmp_path / "new" / "local.md").read_text()  # ours alone: no note on dense SDPA
    assert prose_width(report) <= 100 and "dense SDPA" not in report
    assert runs["old"][0]["commit"] == "abcdef0 (exported)"
    assert "exported" not in runs["new"][0]["commit"]
    # the old run's times set to twice the new one's: every ratio reads 2.00
    new_ms = {r["key"]: r["ms"] for r in records(tmp_path / "new" / "local.jsonl") if "ms" in r}
    old = tmp_path / "old" / "local.jsonl"
    recs = records(old)
    for r in recs:
        if r["kind"] == "local":
            r["ms"] = 2 * new_ms[r["key"]]
    old.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = bench("compare", str(tmp_path / "new"), str(tmp_path / "old"),
                "--out", str(tmp_path / "compare.md"))  # fmt: skip
    table = [line for line in out.splitlines() if line.startswith("| 200 ")]
    assert len(table) == 2 and all("| 2.00 |" in line for line in table), out
    assert "old: commit abcdef0 (exported)" in out
    assert "fwd: old / new 2.00-2.00, geometric mean 2.00 over 1 points" in out
    assert (tmp_path / "compare.md").read_text().strip() == out.split("wrote")[0].strip()
    # a point of the new run that the old one lacks (another method, say) is left out
    fwd = next(r for r in recs if r["kind"] == "local" and r["pass"] == "fwd")
    old.write_text("".join(json.dumps(r) + "\n" for r in recs if r is not fwd))
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "new"), str(tmp_path / "old")]) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("| 200 ")]) == 1, out
    assert "1 points of the new run are not in the old one (left out)" in out
    # folders without a common point, or without results, are an error
    assert main(["compare", str(tmp_path / "new"), str(tmp_path)]) == 1
    assert "no local.jsonl" in capsys.readouterr().out


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: CUDA sweep not run")
@pytest.mark.parametrize(
    ("segments", "backward"),
    [(["64", "192"], "dense"), (["64", "160"], "dense")],
    ids=["nested", "not-nested"],
)
def test_local_sweep_on_cuda(tmp_path: Path, segments: list[str], backward: str) -> None:
    # bf16 on CUDA: the dense backward per branch (windows of whole segments
    # of both branches, nested or not); the forward ours below 131072 rows
    bench("local", "--device", "cuda", "--seq-lens", "4096", "--configs", "4x64",
          "--segments", *segments, "--dilations", "1", "3",
          "--iters", "1", "--search-step", "0", "--out-dir", str(tmp_path))  # fmt: skip
    recs = [r for r in records(tmp_path / "local.jsonl") if r["kind"] == "local"]
    assert {r["status"] for r in recs if r["method"] in ("ours", "gather")} == {"ok"}
    ours = [r for r in recs if r["method"] == "ours"]
    assert {r["pass"] for r in ours} == {"fwd", "fwdbwd"}
    for r in ours:
        expected = backward if r["pass"] == "fwdbwd" else None
        assert r["paths"] == {"forward": "kernel", "backward": expected}, r


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
    kernels' GEMMs and softmax passes compiled in) and prints every product it
    times on this machine: sgemm in place and the at::vec pass everywhere, the
    AVX2 kernels and lanes where the CPU has AVX2, brgemm's fp32 kernels and
    the AVX-512 lanes where it has AVX-512, the bf16 products where it has
    bf16 dot products."""
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    out = bench("tiles", "--iters", "3", "--rounds", "1", timeout=900)
    products = ["fp32 S sgemm in place", "fp32 PV sgemm in place", "fp32 torch.mm 2048^3"]
    products += ["pass: fp32 softmax vec", "pass: fp32 lazy exp vec"]
    if {"avx2", "fma"} <= flags:
        products += ["fp32 S avx2 K^T", "fp32 PV avx2", "bwd fp32 dV^T avx2", "bwd fp32 dQ avx2"]
        products += ["pass: fp32 softmax avx2", "pass: fp32 lazy exp avx2"]
        products += ["fp32 S + lazy pass avx2, the pass apart", "in S's epilogue"]
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        products += ["fp32 S brgemm K^T", "bwd fp32 dV^T brgemm", "pass: fp32 lazy exp avx512"]
        if "avx512_bf16" in flags:
            products += ["bf16 S brgemm packed", "bf16 PV mkl"]
    for product in products:
        assert product in out, out


def test_efficiency_subcommand_counts_pattern_flops(tmp_path: Path) -> None:
    """``bench.py efficiency`` times ours and a square sgemm in CPU time, round-
    robin, and records the pattern FLOPs as ``local`` counts them, the rates
    and their ratio (one per round, the median shown)."""
    from benchmarks import methods as m

    out = tmp_path / "eff.jsonl"
    args = ["--seq-lens", "1000", "--configs", "3x16", "--segments", "256", "512"]
    args += ["--dilations", "1", "2", "--rounds", "2", "--sgemm-size", "128", "--out", str(out)]
    text = bench("efficiency", *args)
    recs = records(out)
    assert [r["pass"] for r in recs] == ["fwd", "fwdbwd"]
    for r in recs:
        pairs = m.pattern_pairs(1000, 3, [256, 512], [1, 2], False)
        assert r["pairs"] == pairs
        assert r["flops"] == m.flops(pairs, 16, r["pass"] == "fwdbwd")
        assert len(r["ratios"]) == 2 and r["ours_cpu_s"] > 0 and r["sgemm_rate"] > 0
        assert r["of_sgemm"] == pytest.approx(
            sorted(r["ratios"])[0] / 2 + sorted(r["ratios"])[1] / 2
        )
        assert f"| 1000 | 3x16 | {r['pass']} |" in text
