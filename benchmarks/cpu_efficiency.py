"""``bench.py efficiency``: the CPU kernels' rate as a share of sgemm's, in CPU time.

On a shared machine the wall-clock rates of ``bench.py local`` move by tens of
percent with the other jobs' load, and so does its "of sgemm" column. Here
both sides are timed in this process's CPU time (``time.process_time``: every
thread of the process, none of the others'), round-robin in one process: a
call of ``ring_attention.dilated_attention`` (forward under ``no_grad``, or
forward + backward), then a square fp32 ``torch.mm`` (2048³ by default) for
as long (at most ``--sgemm-s``), at the same thread count; each round gives one ratio and
the table shows their median. The rate counts pattern FLOPs as ``bench.py
local`` does (4·d per reached (query, key) pair forward, 3.5x that for
forward + backward; ``methods.flops``). A loaded machine still slows both
sides through the shared caches and cores, but by about as much; the ratio is
the kernel-efficiency figure ("of sgemm") of benchmarks/RESULTS.md.

    python benchmarks/bench.py efficiency --seq-lens 8192 16384 --threads 1 --rounds 3

One markdown table on stdout; ``--out FILE`` also appends one JSON line per
point.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from . import measure, methods
from .common import parse_config


def add_parser(sub) -> None:
    p = sub.add_parser(
        "efficiency",
        help="the CPU kernels' rate as a share of sgemm's, both in CPU time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384], help="n (8192 16384)")
    p.add_argument("--configs", type=parse_config, nargs="+", default=[(8, 64)], help="8x64")
    p.add_argument(
        "--segments", type=int, nargs="+", default=list(methods.LONGNET_SEGMENTS), help="w_i"
    )
    p.add_argument(
        "--dilations", type=int, nargs="+", default=list(methods.LONGNET_DILATIONS), help="r_i"
    )
    p.add_argument("--causal", action="store_true", help="keys only at or before the query")
    p.add_argument(
        "--passes", nargs="+", choices=["fwd", "fwdbwd"], default=["fwd", "fwdbwd"], help="both"
    )
    p.add_argument("--threads", type=int, default=1, help="intra-op threads, both sides (1)")
    p.add_argument("--rounds", type=int, default=3, help="ratios per point; median shown (3)")
    p.add_argument("--sgemm-size", type=int, default=2048, help="square fp32 torch.mm (2048)")
    p.add_argument(
        "--sgemm-s", type=float, default=3.0, help="sgemm's CPU seconds a round, at most (3)"
    )
    p.add_argument("--out", help="append one JSON line per point to this file")
    p.set_defaults(func=cmd_efficiency)


def cpu_seconds(fn) -> float:
    """CPU time of the process (all its threads) spent in one call of ``fn``."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def cmd_efficiency(a: argparse.Namespace) -> int:
    torch.set_num_threads(a.threads)
    meth = methods.Methods(a.segments, a.dilations, a.causal, torch.device("cpu"))
    if meth.ra is None:
        raise SystemExit(f"ring_attention not importable: {meth.ra_error}")
    size = a.sgemm_size
    x = torch.randn(size, size)
    sgemm_flops = 2.0 * size**3
    sgemm = lambda: torch.mm(x, x)  # noqa: E731
    for _ in range(2):
        sgemm()
    env = measure.environment(torch.device("cpu"))
    print(f"# {measure.describe(env)}")
    print("| n | config | pass | ours CPU s | ours GFLOP/s | sgemm GFLOP/s | of sgemm | load |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for h, d in a.configs:
        for n in a.seq_lens:
            for name in a.passes:
                rec = measure_point(a, meth, n, h, d, name == "fwdbwd", sgemm, sgemm_flops)
                rec.update(n=n, heads=h, head_dim=d, threads=a.threads, env=env)
                print(
                    f"| {n} | {h}x{d} | {name} | {rec['ours_cpu_s']:.2f} | "
                    f"{rec['ours_rate'] / 1e9:.1f} | {rec['sgemm_rate'] / 1e9:.1f} | "
                    f"{100 * rec['of_sgemm']:.0f} % | {rec['load_avg']:.1f} |",
                    flush=True,
                )
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps(rec) + "\n")
    return 0


def measure_point(a, meth, n, h, d, backward, sgemm, sgemm_flops) -> dict[str, Any]:
    """Round-robin: one call of ours, then sgemm as long (at most --sgemm-s); per round
    the ratio of the two FLOP rates, both in CPU time."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(1, n, h, d, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(backward)
    pairs = methods.pattern_pairs(n, h, a.segments, a.dilations, a.causal)
    flops = methods.flops(pairs, d, backward)

    def ours() -> None:
        if backward:
            out = meth.call("ours", None, q, k, v)
            torch.autograd.grad(out, (q, k, v), g)
        else:
            with torch.no_grad():
                meth.call("ours", None, q, k, v)

    ours()  # warm-up
    ours_s, sgemm_rates, ratios = [], [], []
    for _ in range(a.rounds):
        t = cpu_seconds(ours)
        calls, spent = 0, 0.0
        while spent < min(t, a.sgemm_s) or calls < 3:
            spent += cpu_seconds(sgemm)
            calls += 1
        rate = sgemm_flops * calls / spent
        ours_s.append(t)
        sgemm_rates.append(rate)
        ratios.append(flops / t / rate)
    return {
        "pass": "fwdbwd" if backward else "fwd",
        "pairs": pairs,
        "flops": flops,
        "ours_cpu_s": statistics.median(ours_s),
        "ours_rate": flops / statistics.median(ours_s),
        "sgemm_rate": statistics.median(sgemm_rates),
        "of_sgemm": statistics.median(ratios),
        "ratios": ratios,
        "load_avg": os.getloadavg()[0],
    }
