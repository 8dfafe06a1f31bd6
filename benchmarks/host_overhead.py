"""The host (Python) time of the dense per-branch path (ring_attention/local/branches.py),
measurable on any machine: the dense backends, the merge operators and the
K/V finiteness check are replaced by no-ops and q, k, v live on the ``meta``
device (shapes and strides, no memory, no kernel), so what is timed is the
path's own work between the calls a GPU would run: the route lookups, the
views of every call, the part buffers, the window loop, autograd.

Points: the GPU shapes of ``bench.py views`` (1M and 131072 rows, 16 x 128
and 12 x 64, bf16, LongNet segments 2048 ... 32768, dilations 1 2 4 6 12,
not causal), forward and forward + backward, after one warm-up pass (the
caches of plans, routes and views filled, as in training). Each pass is timed
in process CPU time (``time.process_time``: the machine may be loaded), and
reported per pass and per dense call (the calls a pass makes on a GPU;
trees that plan fewer calls compare by the pass).

With ``--prev DIR`` (``scripts/prev_tree.sh``; its ``ring_attention`` needs
the built extension, e.g. copied from this checkout when ``csrc/`` is the
same) the earlier tree is timed too, in rounds: each round runs one
subprocess per tree (``PYTHONPATH=tree``), round-robin, and the medians over
rounds are compared::

    python benchmarks/bench.py host --prev .prev --rounds 5
    python benchmarks/bench.py host --points 131072x16x128 --rounds 1   # quick

Writes ``OUT/host.jsonl`` (one record a tree, point and round) and prints a
table of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench.py"
ROOT = Path(__file__).resolve().parent.parent
SEGS, DILS = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12]
POINTS = ("131072x16x128", "131072x12x64", "1048576x16x128", "1048576x12x64")


class _NoOpBackend:
    """A dense backend that launches nothing."""

    def __init__(self, name: str) -> None:
        self.name = name

    @staticmethod
    def forward(*_args) -> None:
        pass

    @staticmethod
    def backward(*_args) -> None:
        pass


def stub() -> None:
    """Replace the dense backends and the merge operators by no-ops (before
    any route is built: routes and their views take the backends then), and
    the read of the K/V finiteness check by "finite": the check's own
    operators still run on the meta tensors, in this tree and in trees
    before its lazy read (``kv_finite``, whose read was a sync)."""
    import torch

    from ring_attention.local import backends, branches, ops

    for name in list(backends.BACKENDS):
        backends.BACKENDS[name] = _NoOpBackend(name)
    ops.merge_branches = lambda *_a: None
    ops.sum_branches = lambda *_a: None
    if hasattr(backends, "KvFinite"):
        backends.KvFinite.__bool__ = lambda _self: True
    else:  # an earlier tree: its check's operators, not its read

        def kv_finite(k, v) -> bool:
            acc = torch.float64 if k.dtype == torch.float64 else torch.float32
            torch.isfinite(torch.stack([k.sum(dtype=acc), v.sum(dtype=acc)])).all()
            return True

        branches.kv_finite = kv_finite


def measure(point: str, reps: int, backward: bool) -> dict:
    """Process CPU seconds of ``reps`` passes of one point (after a warm-up)."""
    import torch

    from ring_attention.core import config
    from ring_attention.core.call import Call
    from ring_attention.core.pattern import Pattern
    from ring_attention.local import dispatch, engine, ops
    from ring_attention.local.branches import PerBranch

    n, heads, d = (int(x) for x in point.split("x"))
    dtype, meta, cpu = torch.bfloat16, torch.device("meta"), torch.device("cpu")
    pattern = Pattern(SEGS, DILS)
    q, k, v = (torch.empty(1, n, heads, d, dtype=dtype, device=meta) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(backward)
    go = torch.empty_like(q)
    rows = config.span_rows()
    # the routes a GPU takes with both passes dense, decided for the CPU
    # stand-in (its device has a backend row); route() is timed too (its
    # cache lookup, on the meta tensors), but its answer there is unused
    fwd, bwd = (
        dispatch.decide(p, "dense", "cpu", rows, cpu, (0, 0), dtype, n, heads, heads, d, pattern)
        for p in ("forward", "backward")
    )
    assert fwd.dense and bwd.dense, (fwd.why, bwd.why)
    op_args = getattr(ops, "op_args", None) or engine.op_args  # earlier trees: engine's
    args = op_args(Call(pattern, d**-0.5), meta)

    def one() -> None:
        dispatch.route("forward", q, k, v, pattern, None)
        if backward:
            dispatch.route("backward", q, k, v, pattern, None)
        impl = PerBranch(pattern, d**-0.5, args, fwd, bwd if backward else None)
        out, _ = engine.differentiable(impl, q, k, v)
        if backward:
            out.backward(go)
            for t in (q, k, v):
                t.grad = None

    one()  # warm-up: plans, routes, index maps and views cached
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        one()
        times.append(time.process_time() - t0)
    calls = fwd.spans.calls * (2 if backward else 1)
    return {"point": point, "pass": "fwdbwd" if backward else "fwd", "calls": calls,
            "pass_ms": [round(t * 1e3, 3) for t in times]}  # fmt: skip


def worker(points: list[str], reps: int) -> None:
    """One tree's measurements, one JSON line a point and pass, on stdout."""
    import torch

    torch.set_num_threads(1)
    stub()
    for point in points:
        for backward in (False, True):
            print(json.dumps(measure(point, reps, backward)), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench.py host", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--points", nargs="+", default=list(POINTS), help="NxHEADSxHEAD_DIM")
    ap.add_argument("--rounds", type=int, default=5, help="subprocesses per tree, round-robin")
    ap.add_argument("--reps", type=int, default=5, help="timed passes a point in a subprocess")
    ap.add_argument("--prev", default=None, help="an earlier tree to time beside this one")
    ap.add_argument("--out", default="build/host_overhead")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.points, a.reps)
        return 0
    trees = {"this": str(ROOT)} | ({"prev": str(Path(a.prev).resolve())} if a.prev else {})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "host.jsonl"
    jsonl.write_text("")
    per: dict[tuple[str, str, str], list[float]] = {}
    calls: dict[tuple[str, str, str], int] = {}
    for rnd in range(a.rounds):
        for tree, path in trees.items():
            paths = [path, os.environ.get("PYTHONPATH", "")]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
            cmd = [sys.executable, str(BENCH), "host", "--worker", "--reps", str(a.reps),
                   "--points", *a.points]  # fmt: skip
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if res.returncode:
                sys.stderr.write(res.stderr[-4000:])
                raise SystemExit(f"host_overhead: the {tree} tree's worker failed")
            for line in res.stdout.splitlines():
                rec = dict(json.loads(line), tree=tree, round=rnd)
                with jsonl.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                key = (tree, rec["point"], rec["pass"])
                per.setdefault(key, []).append(statistics.median(rec["pass_ms"]))
                calls[key] = rec["calls"]
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    cols = list(trees)
    head = " | ".join(f"{t} calls | {t} ms/pass | {t} us/call" for t in cols)
    lines = [f"| point | pass | {head} |" + (" prev/this a pass |" if a.prev else ""),
             "|---|---|" + "---:|" * (3 * len(cols) + (1 if a.prev else 0))]  # fmt: skip
    for point in a.points:
        for pass_ in ("fwd", "fwdbwd"):
            cells, ms = [], {}
            for t in cols:
                c = calls[(t, point, pass_)]
                ms[t] = statistics.median(per[(t, point, pass_)])
                cells += [str(c), f"{ms[t]:.1f}", f"{ms[t] * 1e3 / c:.0f}"]
            ratio = [f"{ms['prev'] / ms['this']:.2f}x"] if a.prev else []
            lines.append("| " + " | ".join([point, pass_, *cells, *ratio]) + " |")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0
