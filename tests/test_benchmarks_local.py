"""bench.py's one-process subcommands at tiny sizes: check, the local sweep
(records, resuming, plots, the dry run of the GPU sweep, the baselines
without the extension), compare, llm, tiles and efficiency. Speed is never
asserted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from bench_helpers import ROOT, TINY, bench, bench_run, prose_width, records
from oracle import multiplicity


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
    assert out.startswith(f"12 points to measure, into {tmp_path / 'local.jsonl'}")
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
    # a second run finds every point done, measures nothing and says so
    out = " ".join(bench(*args).split())
    assert out.startswith("nothing measured: all 12 points are already in") and "--redo" in out
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
