"""benchmarks/views_check.py (``bench.py views``), the prepared GPU check of the dense per-branch
path: its per-head float64 oracle equals tests/oracle.py's, and its dry run
(every stage on the CPU at toy sizes, the earlier tree's subprocess included)
records what the GPU run will."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from oracle import reference_attention

ROOT = Path(__file__).resolve().parent.parent


def _script():
    from benchmarks import views_check

    return views_check


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"causal": True, "grouped": True},
        {"head_groups": True, "cu": [0, 7, 7, 30, 45]},
    ],
    ids=["plain", "causal-grouped", "groups-documents"],
)
def test_per_head_oracle_equals_the_oracle(kw) -> None:
    vc = _script()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 45, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 45, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    go = torch.randn(2, 45, 6, 8, generator=g, dtype=torch.float64)
    segs, dils = [8, 16, 64], [1, 3, 2]
    got = vc.oracle_by_head(q, k, v, go, segs, dils, **kw)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = reference_attention(
        qr, kr, vr, segs, dils, causal=kw.get("causal", False),
        head_groups=kw.get("head_groups", False), grouped_offsets=kw.get("grouped", False),
        cu_seqlens=kw.get("cu"),
    )  # fmt: skip
    want = (out, lse, *torch.autograd.grad(out, (qr, kr, vr), go))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12, msg=name)


def test_dry_run_runs_every_stage(tmp_path: Path) -> None:
    vc = _script()
    # the earlier tree: this checkout itself, through the same subprocess
    rc = vc.main(
        [
            "--dry-run",
            "--out",
            str(tmp_path),
            "--budget-s",
            "600",
            "--prev",
            str(ROOT),
            "--methods",
            "dense,default,gather,flex,prev,torch",
            "--n",
            "256",
        ]
    )
    assert rc == 0
    head, *recs = [json.loads(x) for x in (tmp_path / "views.jsonl").read_text().splitlines()]
    # the header: when, where, which commit (benchmarks/report.py reads it)
    assert head["kind"] == "run" and head["sweep"] == "views"
    assert head["date"] and head["commit"] and head["device_name"].startswith("CPU")
    assert head["flash_attn_4"]  # a version, or why it does not import
    assert head["argv"] and "env" in head  # the command line and the environment
    assert all("kind" not in r for r in recs)  # the earlier tree's header stays in prev.jsonl
    checks = [r for r in recs if r["stage"] == "check"]
    assert len(checks) == 10 and {r["status"] for r in checks} == {"ok"}
    assert {(r["path"], r["backend"]) for r in checks} == {("dense", "cpu"), ("kernel", None)}
    assert all("dense" in r["routes"][0] for r in checks if r["path"] == "dense")
    bench = [r for r in recs if r["stage"] == "bench" and "method" in r]
    assert {r["method"] for r in bench} == {"dense", "default", "gather", "flex", "prev", "torch"}
    # flex has no backward on the CPU: recorded as skipped, with why
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in bench
               if not (r["method"] == "flex" and r["pass"] == "fwdbwd"))  # fmt: skip
    # causal and not, each point's share of the matmul rate measured in the stage
    assert {r["causal"] for r in bench} == {False, True} and all(
        "of_mm" in r for r in bench if r["status"] == "ok"
    )
    # the dense path's phases: the median of 3 calls, each call's kept
    dense = [r for r in bench if r["method"] == "dense"]
    assert all(set(r["phases_ms"]) == {"calls", "merge", "finite", "other"} for r in dense)
    assert all(len(r["phases_samples"]) == 3 for r in dense)
    for r in dense:
        for p, ms in r["phases_ms"].items():
            assert ms == pytest.approx(sorted(s[p] for s in r["phases_samples"])[1], abs=0.01)
    assert len([r for r in bench if r["method"] == "prev"]) == 4
    # the torch method's subprocess ran with flash-attn-4 hidden, said in its header
    torch_head = json.loads((tmp_path / "torch.jsonl").read_text().splitlines()[0])
    assert "hidden" in torch_head["flash_attn_4"]
    dense = [r for r in recs if r["stage"] == "dense" and "backend" in r]
    assert {r["status"] for r in dense if r["backend"] == "flash"} == {"ok"}
    assert all(r["status"].startswith("skipped") for r in dense if r["backend"] == "fa4")
    (big,) = [r for r in recs if r["stage"] == "big"]
    assert big["status"] == "ok"
    summary = (tmp_path / "summary.md").read_text()
    assert "against the float64 oracle" in summary
    assert "| 256 | 2x16 | yes | fwdbwd | prev |" in summary


def test_host_overhead_runs_a_tree_against_another(tmp_path: Path) -> None:
    """benchmarks/host_overhead.py (``bench.py host``): the dense path with its
    backends, merge and finiteness check stubbed on meta tensors, two trees
    (this checkout twice) in round-robin subprocesses, a row a point and pass."""
    from benchmarks import host_overhead

    point = "8192x4x16"
    argv = ["--points", point, "--rounds", "2", "--reps", "1", "--prev", str(ROOT),
            "--out", str(tmp_path)]  # fmt: skip
    assert host_overhead.main(argv) == 0
    recs = [json.loads(x) for x in (tmp_path / "host.jsonl").read_text().splitlines()]
    assert {(r["tree"], r["round"], r["pass"]) for r in recs} == {
        (t, i, p) for t in ("this", "prev") for i in (0, 1) for p in ("fwd", "fwdbwd")
    }
    # 8192 rows, 4 heads, LongNet: one window, every segment length cut to n
    fwd = {r["calls"] for r in recs if r["pass"] == "fwd"}
    assert fwd == {len(host_overhead_plan(point).spans[0].calls)}
    assert all(r["calls"] == 2 * next(iter(fwd)) for r in recs if r["pass"] == "fwdbwd")
    assert all(t >= 0 for r in recs for t in r["pass_ms"])
    table = (tmp_path / "summary.md").read_text()
    assert f"| {point} | fwdbwd |" in table and "prev/this" in table


def host_overhead_plan(point: str):
    from benchmarks import host_overhead
    from ring_attention.core import config
    from ring_attention.core.pattern import Pattern
    from ring_attention.local.spans import plan_spans

    n, heads, _ = (int(x) for x in point.split("x"))
    pattern = Pattern(host_overhead.SEGS, host_overhead.DILS)
    return plan_spans(pattern, n, heads, heads, config.span_rows())
