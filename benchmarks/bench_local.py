"""CPU benchmark of the local operator ``ra.dilated_attention`` (DESIGN.md §7).

Compares, in one run and on the same inputs,

* ``ours``   — ``ra.dilated_attention``;
* ``gather`` — gather + PyTorch's fused CPU SDPA per branch and head-offset
  class, scattered back and merged by LSE (``baselines.gather_sdpa_dilated``,
  exact, same semantics);
* ``dense``  — plain SDPA over the whole sequence. For a dilated pattern it is
  NOT the same function (it computes all n² pairs): a *dense attention cost
  reference* only.

For each sequence length it reports the median time of the forward and of
forward + backward, the time ratio ``baseline / ours`` (> 1: ours is faster),
the effective GFLOP/s (pattern FLOPs / time; 4·d per reached (query, key) pair
forward, 2.5x that backward; counted exactly by ``pattern_pairs``) and the
peak memory of one call, measured in a fresh subprocess (see ``--help`` of
``--no-memory`` and ``_measure_memory``).

Default pattern: LongNet, segments 2048 4096 8192 16384 32768 with dilations
1 2 4 6 12. Segments longer than n are kept: such a segment is one ragged
segment covering the whole sequence.

Examples::

    python benchmarks/bench_local.py --check
    python benchmarks/bench_local.py --backward --out /tmp/fp32.md
    python benchmarks/bench_local.py --backward --causal --seq-lens 4096 16384
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from baselines import (
    LONGNET_DILATIONS,
    LONGNET_SEGMENTS,
    dense_sdpa,
    gather_sdpa_dilated,
    pattern_pairs,
)

import ring_attention as ra

__all__ = ["pattern_pairs"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
METHODS = ("ours", "gather", "dense")
GB = 1024**3


# --------------------------------------------------------------------------- #
# the calls being measured
# --------------------------------------------------------------------------- #
def _call(method, q, k, v, segs, dils, causal):
    if method == "ours":
        return ra.dilated_attention(q, k, v, segs, dils, causal=causal)
    if method == "gather":
        return gather_sdpa_dilated(q, k, v, segs, dils, causal=causal)
    if method == "dense":
        return dense_sdpa(q, k, v, causal=causal)
    raise ValueError(f"unknown method {method!r}")


def _run(method, q, k, v, g, segs, dils, causal, backward):
    """One forward (``g is None``) or forward + backward."""
    if not backward:
        with torch.no_grad():
            return _call(method, q, k, v, segs, dils, causal)
    out = _call(method, q, k, v, segs, dils, causal)
    return torch.autograd.grad(out, (q, k, v), g)


def _inputs(batch, n, heads, dim, dtype, backward, seed=0):
    """q, k, v (and grad_out) drawn in place, so no temporaries are allocated."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, n, heads, dim)
    count = 4 if backward else 3
    ts = [torch.empty(shape, dtype=dtype).normal_(generator=gen) for _ in range(count)]
    for t in ts[:3]:
        t.requires_grad_(backward)
    return ts[0], ts[1], ts[2], (ts[3] if backward else None)


def dense_bytes_estimate(batch, n, heads, dim, dtype, backward) -> int:
    """Bytes dense SDPA needs: its fused CPU kernel is O(n) (q, k, v, out, a
    few per-thread tiles; backward adds grad_out, dq, dk, dv and fp32
    accumulators); the math fallback (other dtypes) materialises n² scores."""
    elt = torch.empty((), dtype=dtype).element_size()
    qkvo = 4 * batch * n * heads * dim * elt
    if dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return qkvo * (3 if backward else 1)
    return qkvo + batch * heads * n * n * 4 * (3 if backward else 1)


# --------------------------------------------------------------------------- #
# peak memory, in a fresh subprocess
# --------------------------------------------------------------------------- #
def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _memory_worker(spec: dict) -> dict:
    """Peak RSS growth of ONE call beyond its inputs (runs in a fresh process).

    Warm up on a tiny problem (thread pool, lazy init), allocate the inputs,
    reset the kernel's peak-RSS counter (``/proc/self/clear_refs`` ← 5), read
    VmRSS, run the call once, read VmHWM. ``extra = VmHWM - VmRSS`` is every
    byte the call touched beyond the inputs: its outputs, saved tensors,
    gradients and workspaces (page granular; freed memory is returned to the
    OS because the parent sets a fixed ``MALLOC_MMAP_THRESHOLD_``).
    """
    torch.set_num_threads(spec["threads"])
    dtype = DTYPES[spec["dtype"]]
    args = (spec["segs"], spec["dils"], spec["causal"], spec["backward"])
    small = _inputs(spec["batch"], 300, spec["heads"], spec["dim"], dtype, spec["backward"])
    _run(spec["method"], *small, *args)
    del small
    gc.collect()
    q, k, v, g = _inputs(
        spec["batch"], spec["n"], spec["heads"], spec["dim"], dtype, spec["backward"]
    )
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = _proc_status_kb("VmRSS")
    res = _run(spec["method"], q, k, v, g, *args)
    hwm = _proc_status_kb("VmHWM")
    del res
    return {"extra_bytes": (hwm - rss0) * 1024}


def _measure_memory(spec: dict) -> int | None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    cmd = [sys.executable, os.path.abspath(__file__), "--_memory-worker", json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"memory worker failed: {proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["extra_bytes"]


# --------------------------------------------------------------------------- #
# correctness of the baseline
# --------------------------------------------------------------------------- #
def run_check() -> None:
    """gather + SDPA must equal ra.dilated_attention (out, lse, grads) and
    pattern_pairs must equal the multiplicity matrix of the oracle."""
    torch.manual_seed(0)
    cases = [
        (300, LONGNET_SEGMENTS, LONGNET_DILATIONS, False),
        (300, (64, 128, 1000), (1, 3, 6), False),
        (300, (64, 128, 1000), (1, 3, 6), True),
        (257, (16, 40), (1, 5), False),
        (200, (512,), (1,), False),
    ]
    oracle = None
    try:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from oracle import multiplicity as oracle  # type: ignore[no-redef]
    except ImportError:
        print("tests/oracle.py not found: pattern_pairs not cross-checked")
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        for n, segs, dils, hg in cases:
            for causal in (False, True):
                b, h, d = 2, 8, 32
                q, k, v = (
                    torch.randn(b, n, h, d, dtype=dtype, requires_grad=True) for _ in range(3)
                )
                o1, l1 = ra.dilated_attention(
                    q, k, v, segs, dils, causal=causal, head_groups=hg, return_lse=True
                )
                o2, l2 = gather_sdpa_dilated(
                    q, k, v, segs, dils, causal=causal, head_groups=hg, return_lse=True
                )
                g = torch.randn_like(o1)
                g1 = torch.autograd.grad(o1, (q, k, v), g)
                g2 = torch.autograd.grad(o2, (q, k, v), g)
                torch.testing.assert_close(o2, o1, atol=tol, rtol=tol)
                torch.testing.assert_close(l2, l1, atol=tol, rtol=tol)
                for a, c in zip(g2, g1, strict=True):
                    torch.testing.assert_close(a, c, atol=tol, rtol=tol)
                pairs = pattern_pairs(n, h, segs, dils, causal, hg, batch=b)
                if oracle is not None:
                    ref = int(oracle(n, h, segs, dils, causal, hg).sum().item()) * b
                    assert pairs == ref, (pairs, ref)
                print(
                    f"ok {dtype!s:14s} n={n} segs={segs} dils={dils} causal={causal} "
                    f"head_groups={hg} pairs={pairs}"
                )
        if dtype == torch.float32:
            # dense pattern: dense SDPA is the same function
            q, k, v = (torch.randn(1, 300, 4, 32) for _ in range(3))
            for causal in (False, True):
                torch.testing.assert_close(
                    dense_sdpa(q, k, v, causal),
                    ra.dilated_attention(q, k, v, [300], [1], causal=causal),
                    atol=2e-5,
                    rtol=2e-5,
                )
    print("check passed: gather+SDPA == ra.dilated_attention (fwd, lse, grads); pairs exact")


# --------------------------------------------------------------------------- #
# benchmark
# --------------------------------------------------------------------------- #
def _fmt_ms(t):
    return "—" if t is None else f"{t * 1e3:.1f}"


def bench(args) -> list[str]:
    dtype = DTYPES[args.dtype]
    segs, dils = list(args.segments), list(args.dilations)
    elt = torch.empty((), dtype=dtype).element_size()
    header = (
        "| n | pass | method | median ms | time / ours | pattern GFLOP/s "
        "| peak MiB | peak / qkvo | runs |\n|---:|---|---|---:|---:|---:|---:|---:|---:|"
    )
    lines = [header]
    print(header, flush=True)
    passes = [False, True] if args.backward else [False]
    if args.backward_only:
        passes = [True]
    for n in args.seq_lens:
        qkvo = 4 * args.batch * n * args.heads * args.head_dim * elt
        pairs = pattern_pairs(n, args.heads, segs, dils, args.causal, batch=args.batch)
        dense_pairs = args.batch * args.heads * (n * (n + 1) // 2 if args.causal else n * n)
        for backward in passes:
            methods = [m for m in args.methods if m != "dense"]
            if "dense" in args.methods:
                est = dense_bytes_estimate(
                    args.batch, n, args.heads, args.head_dim, dtype, backward
                )
                if est <= args.dense_max_bytes and n <= args.dense_max_n:
                    methods.append("dense")
            q, k, v, g = _inputs(args.batch, n, args.heads, args.head_dim, dtype, backward)
            times = {m: [] for m in methods}
            # Round-robin over methods so that load changes on the shared
            # machine hit every method alike; the first `warmup` rounds are
            # dropped, unless the first round is slower than --slow-round-s:
            # then it counts and at most --slow-repeats rounds are run.
            warmup, rounds, rep = args.warmup, args.warmup + args.repeats, 0
            while rep < rounds:
                t_round = time.perf_counter()
                for m in methods:
                    gc.collect()
                    t0 = time.perf_counter()
                    res = _run(m, q, k, v, g, segs, dils, args.causal, backward)
                    dt = time.perf_counter() - t0
                    del res
                    times[m].append(dt)
                if rep == 0 and time.perf_counter() - t_round > args.slow_round_s:
                    warmup, rounds = 0, min(rounds, args.slow_repeats)
                rep += 1
            times = {m: ts[warmup:] for m, ts in times.items()}
            del q, k, v, g
            gc.collect()
            med = {m: statistics.median(ts) for m, ts in times.items()}
            flop_mult = 4 * args.head_dim * (3.5 if backward else 1.0)
            for m in methods:
                mem = None
                if not args.no_memory:
                    spec = {
                        "method": m, "n": n, "batch": args.batch, "heads": args.heads,
                        "dim": args.head_dim, "dtype": args.dtype, "segs": segs,
                        "dils": dils, "causal": args.causal, "backward": backward,
                        "threads": args.threads,
                    }  # fmt: skip
                    extra = _measure_memory(spec)
                    if extra is not None:
                        inputs = (4 if backward else 3) * qkvo // 4
                        mem = inputs + extra
                useful = dense_pairs if m == "dense" else pairs
                gflops = useful * flop_mult / med[m] / 1e9
                label = {
                    "ours": "ours",
                    "gather": "gather+SDPA",
                    "dense": "dense SDPA (cost ref., n² pairs)",
                }[m]
                ratio = "1.00" if m == "ours" else f"{med[m] / med['ours']:.2f}"
                row = (
                    f"| {n} | {'fwd+bwd' if backward else 'fwd'} | {label} | {_fmt_ms(med[m])} "
                    f"| {ratio} | {gflops:.1f} | "
                    f"{'—' if mem is None else f'{mem / 2**20:.0f}'} | "
                    f"{'—' if mem is None else f'{mem / qkvo:.2f}'} | {len(times[m])} |"
                )
                lines.append(row)
                print(row, flush=True)
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--segments", type=int, nargs="+", default=list(LONGNET_SEGMENTS))
    p.add_argument("--dilations", type=int, nargs="+", default=list(LONGNET_DILATIONS))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="also time forward + backward")
    p.add_argument("--backward-only", action="store_true", help="only forward + backward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument(
        "--slow-round-s", type=float, default=60.0,
        help="if the first round (all methods) takes longer, it is not a warm-up but a "
        "measurement, and at most --slow-repeats rounds are run",
    )  # fmt: skip
    p.add_argument("--slow-repeats", type=int, default=2)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument(
        "--dense-max-n", type=int, default=16384,
        help="skip the dense cost reference above this n (its n² work dominates the run)",
    )  # fmt: skip
    p.add_argument("--dense-max-bytes", type=float, default=8 * GB)
    p.add_argument(
        "--no-memory", action="store_true",
        help="skip peak memory (otherwise: one fresh subprocess per case; peak = inputs + "
        "VmHWM growth during one call after resetting it)",
    )  # fmt: skip
    p.add_argument("--check", action="store_true", help="verify the baseline, then exit")
    p.add_argument("--out", help="also write the markdown table to this file")
    p.add_argument("--_memory-worker", dest="memory_worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.memory_worker:
        print(json.dumps(_memory_worker(json.loads(args.memory_worker))))
        return
    torch.set_num_threads(args.threads)
    if args.check:
        run_check()
        return
    if len(args.segments) != len(args.dilations):
        p.error("--segments and --dilations need the same length")
    if "ours" not in args.methods:
        args.methods.insert(0, "ours")
    so = ra._C.__file__ if hasattr(ra, "_C") else "?"
    print(
        f"# torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {args.dtype}, "
        f"B={args.batch} H={args.heads} D={args.head_dim}, causal={args.causal}, "
        f"segments={args.segments}, dilations={args.dilations}, extension {so}",
        flush=True,
    )
    lines = bench(args)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
