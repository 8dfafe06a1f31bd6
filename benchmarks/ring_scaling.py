"""Ring dilated attention on the CPU: per-rank memory, bytes and time vs p and n.

    python benchmarks/ring_scaling.py                      # everything, ~10 min on 2 cores
    python benchmarks/ring_scaling.py --seq-len 8192 --iters 2 --configs longnet

Part 1 (processes). For every configuration and p in ``--worlds`` (default 1,
2, 4) and each mode (``fwd``: forward under ``no_grad``; ``fwdbwd``: forward +
backward), p fresh processes are spawned and joined by a gloo process group
(``tests/dist_utils.run_distributed``, one intra-op thread per process). Each
rank builds its shard of the same global float32 q/k/v (batch 1), runs one
warm-up call, one measured call and ``--iters`` timed calls, and reports:

* **memory**: the peak resident memory the measured call adds, read from
  ``/proc/self/status``: ``VmHWM`` after the call minus ``VmRSS`` before it,
  with the high-water mark reset just before (``echo 5 > /proc/self/clear_refs``).
  The parent sets ``MALLOC_MMAP_THRESHOLD_=65536`` for the workers so glibc
  serves every tensor with ``mmap`` and returns it on free (no heap reuse
  hiding allocations). ``inputs`` is the bytes of the shards the rank holds
  before the call (q, k, v, and grad_out for ``fwdbwd``); ``peak = inputs +
  call``. The process's fixed baseline (interpreter, torch, gloo: ~250 MiB)
  is not counted. ``buffers`` is what the ring's transport allocated in its
  larger pass (``last_exchange_stats.buffer_bytes``: packed send/receive
  double buffers and the shard-sized unpack buffers; the forward's are freed
  before the backward allocates its own), part of ``call``.
* **bytes sent** per rank per layer, measured (``last_exchange_stats``).
* **time**: median over ``--iters`` of the main thread's CPU time
  (``time.thread_time``: the compute, packing and unpacking, not the time
  spent waiting for peers or descheduled) and of the wall time. With more
  processes than cores (p = 4 on 2 cores) wall time includes time-slicing;
  only the CPU time is comparable across p. CPU time still varies with what
  shares the cores (caches, memory bandwidth, SMT): ~20% between runs on a
  shared 2-core machine.
* **work**: the rank's reached (query, key, head) triples, counted exactly.

Part 2 (plans only, no processes): bytes a rank sends per layer vs n at a fixed
p, and vs n at a fixed shard size (p = n / shard), for the fixed LongNet
pattern, LongNet grown to n (one more branch per 4x, ``longnet_to``) and a
causal dense ring; max over ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE, os.path.join(ROOT, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402

MiB = 2**20
LONGNET = ([512, 2048, 8192], [1, 4, 16])


def configs(n: int) -> dict[str, dict]:
    """name -> pattern, causal, layout (dense: one segment of the whole sequence)."""
    return {
        "longnet": dict(pattern=LONGNET, causal=False, layout="contiguous"),
        "dense_causal_contiguous": dict(pattern=([n], [1]), causal=True, layout="contiguous"),
        "dense_causal_zigzag": dict(pattern=([n], [1]), causal=True, layout="zigzag"),
    }


# ---------------------------------------------------------------------------
# Worker (one rank).


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _worker(rank: int, world: int, spec: dict) -> dict:
    import gc

    import torch.distributed as dist
    from ring_main import make_local, reached_pairs

    from ring_attention.exchange import last_exchange_stats
    from ring_attention.ring import exchange_plan, ring_dilated_attention

    segs, dils = spec["pattern"]
    args = types.SimpleNamespace(
        seq_len=spec["n"], batch=1, heads=spec["heads"], head_dim=spec["head_dim"], seed=0,
        layout=spec["layout"], segments=segs, dilations=dils, causal=spec["causal"],
        head_groups=False,
    )  # fmt: skip
    kw = dict(causal=spec["causal"], layout=spec["layout"])
    backward = spec["mode"] == "fwdbwd"
    q, k, v, go = (make_local(i, args, world, rank) for i in range(4))
    held = [q, k, v] + ([go] if backward else [])
    if backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    else:
        del go
    plan = exchange_plan(spec["n"], spec["heads"], segs, dils, **kw)  # build the cached plan

    def drop_grads() -> None:
        for t in (q, k, v):
            t.grad = None

    def call() -> None:
        if backward:
            drop_grads()
            ring_dilated_attention(q, k, v, segs, dils, **kw).backward(go)
        else:
            with torch.no_grad():
                ring_dilated_attention(q, k, v, segs, dils, **kw)

    call()  # warm-up
    drop_grads()  # the measured call's grads count in its peak
    gc.collect()
    dist.barrier()
    base = _status_mib("VmRSS")
    _reset_hwm()
    call()
    call_mib = _status_mib("VmHWM") - base
    buffers = dict(last_exchange_stats.buffer_bytes)
    sent = last_exchange_stats.bytes_sent()
    sent_fwd = last_exchange_stats.bytes_sent("forward_kv")

    cpu, wall = [], []
    for _ in range(spec["iters"]):
        gc.collect()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        call()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return {
        "rank": rank,
        "local_len": q.shape[1],
        "pairs": reached_pairs(args, world, rank),
        "inputs_mib": sum(t.numel() * t.element_size() for t in held) / MiB,
        "call_mib": call_mib,
        "buffers_mib": max(buffers.values(), default=0) / MiB,
        "buffers": buffers,
        "sent_mib": sent / MiB,
        "sent_fwd_mib": sent_fwd / MiB,
        "plan_sent_mib": plan.bytes_sent(1, spec["head_dim"], 4, backward=backward) / MiB,
        "cpu_ms": 1e3 * statistics.median(cpu),
        "wall_ms": 1e3 * statistics.median(wall),
        "threads": torch.get_num_threads(),
    }


def run_processes(args: argparse.Namespace) -> dict[tuple[str, str, int], list[dict]]:
    from dist_utils import run_distributed

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned workers
    results = {}
    for name, cfg in configs(args.seq_len).items():
        if name not in args.configs:
            continue
        for mode in args.modes:
            for world in args.worlds:
                if cfg["layout"] == "zigzag" and world == 1:
                    continue  # the same computation as contiguous
                spec = dict(
                    cfg, n=args.seq_len, heads=args.heads, head_dim=args.head_dim, mode=mode,
                    iters=args.iters,
                )  # fmt: skip
                t0 = time.perf_counter()
                rows = run_distributed(_worker, world, spec, timeout=3600, pg_timeout=1800)
                print(
                    f"  ran {name} {mode} p={world} in {time.perf_counter() - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                results[(name, mode, world)] = rows
    return results


# ---------------------------------------------------------------------------
# Plans only.


def longnet_to(n: int, w0: int = 512) -> tuple[list[int], list[int]]:
    """LongNet grown to ``n``: segments ``w0 * 4**i < n`` and ``n``, dilations
    ``segment / w0`` (every branch reaches ``w0`` keys per query)."""
    segs = [w0 * 4**i for i in range(32) if w0 * 4**i < n] + [n]
    return segs, [max(1, w // w0) for w in segs]


def max_bytes_sent(n: int, world: int, heads: int, head_dim: int, segs, dils, causal: bool):
    """Max over ranks of the bytes sent per layer (fwd, fwd+bwd), float32, batch 1."""
    from ring_attention.plan import build_plan

    fwd = bwd = 0
    for r in range(world):
        plan = build_plan(world, r, n, heads, segs, dils, causal, False)
        fwd = max(fwd, plan.bytes_sent(1, head_dim, 4))
        bwd = max(bwd, plan.bytes_sent(1, head_dim, 4, backward=True))
    return fwd, bwd


# ---------------------------------------------------------------------------
# Tables.


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(x: object) -> str:
        return f"{x:.1f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def memory_table(results, args) -> str:
    rows = []
    for (name, mode, world), ranks in results.items():
        ones = results.get((name.replace("zigzag", "contiguous"), mode, 1))
        worst = max(ranks, key=lambda r: r["inputs_mib"] + r["call_mib"])
        peak = worst["inputs_mib"] + worst["call_mib"]
        buf = max(r["buffers_mib"] for r in ranks)
        if ones:
            peak1 = ones[0]["inputs_mib"] + ones[0]["call_mib"]
            goal = 1.2 * peak1 / world + buf
            ratio = f"{peak / peak1:.3f}"
            excess = f"{(peak - buf) / (peak1 / world):.2f}"
            verdict = "yes" if peak <= goal else "**no**"
        else:
            goal, ratio, excess, verdict = float("nan"), "-", "-", "-"
        rows.append(
            [name, mode, world, worst["local_len"], worst["inputs_mib"], worst["call_mib"],
             peak, buf, ratio, excess, goal, verdict]
        )  # fmt: skip
    return _table(
        ["config", "mode", "p", "shard", "inputs MiB", "call MiB", "peak MiB", "buffers MiB",
         "peak / peak(p=1)", "(peak - buffers) / (peak(1)/p)", "goal MiB", "peak <= goal"],
        rows,
    )  # fmt: skip


def rank_table(results) -> str:
    rows = []
    for (name, mode, world), ranks in results.items():
        for r in ranks:
            rows.append(
                [name, mode, world, r["rank"], r["local_len"], f"{r['pairs'] / 1e6:.1f}",
                 f"{r['sent_mib']:.2f}", f"{r['plan_sent_mib']:.2f}", r["cpu_ms"], r["wall_ms"]]
            )  # fmt: skip
    return _table(
        ["config", "mode", "p", "rank", "shard", "work (M pairs)", "sent MiB (measured)",
         "sent MiB (plan)", "CPU ms (thread)", "wall ms"],
        rows,
    )  # fmt: skip


def time_table(results) -> str:
    rows = []
    for (name, mode, world), ranks in results.items():
        one = results.get((name.replace("zigzag", "contiguous"), mode, 1))
        cpu = [r["cpu_ms"] for r in ranks]
        pairs = [r["pairs"] for r in ranks]
        speed = f"{one[0]['cpu_ms'] / max(cpu):.2f}" if one else "-"
        rows.append(
            [name, mode, world, max(cpu), min(cpu), f"{max(cpu) / min(cpu):.2f}",
             f"{max(pairs) / (sum(pairs) / world):.2f}", speed, max(r["wall_ms"] for r in ranks)]
        )  # fmt: skip
    return _table(
        ["config", "mode", "p", "max CPU ms", "min CPU ms", "CPU max/min", "work max/mean",
         "CPU(p=1) / max CPU(p)", "max wall ms"],
        rows,
    )  # fmt: skip


def bytes_tables(args) -> tuple[str, str]:
    H, D = args.heads, args.head_dim
    segs, dils = LONGNET
    bound = 2 * H * sum(w // r for w, r in zip(segs, dils, strict=True)) * D * 4 / MiB
    rows = []
    for n in (4096, 8192, 16384, 32768):
        ln = max_bytes_sent(n, args.fixed_p, H, D, segs, dils, False)
        lc = max_bytes_sent(n, args.fixed_p, H, D, segs, dils, True)
        lg = max_bytes_sent(n, args.fixed_p, H, D, *longnet_to(n), False)
        dc = max_bytes_sent(n, args.fixed_p, H, D, [n], [1], True)
        rows.append(
            [n, n // args.fixed_p, str(longnet_to(n))]
            + [f"{x / MiB:.2f}" for x in (*ln, *lc, *lg, *dc)]
        )
    hdr = ["n", "shard", "LongNet grown to n (segs, dils)", "LongNet fwd", "LongNet fwd+bwd",
           "LongNet causal fwd", "LongNet causal fwd+bwd", "grown fwd", "grown fwd+bwd",
           "dense causal fwd", "dense causal fwd+bwd"]  # fmt: skip
    at_p = _table(hdr, rows)
    rows = []
    s = args.fixed_shard
    for world in (2, 4, 8, 16, 32):
        n = s * world
        ln = max_bytes_sent(n, world, H, D, segs, dils, False)
        lg = max_bytes_sent(n, world, H, D, *longnet_to(n), False)
        dc = max_bytes_sent(n, world, H, D, [n], [1], True)
        rows.append([n, world] + [f"{x / MiB:.2f}" for x in (*ln, *lg, *dc)])
    hdr = ["n", "p", "LongNet fwd", "LongNet fwd+bwd", "grown to n fwd", "grown to n fwd+bwd",
           "dense causal fwd", "dense causal fwd+bwd"]  # fmt: skip
    at_shard = _table(hdr, rows)
    note = (
        f"LongNet = segments {segs} dilations {dils}; its bound 2 * heads * sum(w/r) * d * 4 B "
        f"= {bound:.2f} MiB per layer forward. Grown to n: w/r = 512 for every branch, so "
        f"{2 * H * 512 * D * 4 / MiB:.0f} MiB per spanning branch."
    )
    return at_p + "\n\n" + note, at_shard


def machine() -> str:
    model = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line
        )
    except Exception:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except Exception:
        commit = "?"
    return (
        f"{datetime.date.today()} | CPU {model}, {os.cpu_count()} cores | torch {torch.__version__}"
        f" | commit {commit} | load avg {os.getloadavg()[0]:.1f}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--configs", nargs="+", default=list(configs(1)), choices=list(configs(1)))
    p.add_argument("--iters", type=int, default=3, help="timed calls per rank (median)")
    p.add_argument("--fixed-p", type=int, default=4, help="p of the bytes-vs-n table")
    p.add_argument("--fixed-shard", type=int, default=4096, help="shard of the flat-bytes table")
    p.add_argument("--no-processes", action="store_true", help="only the plan tables")
    p.add_argument("--json", default=None, help="also write the per-rank results here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"# ring_scaling: {machine()}")
    print(
        f"n={args.seq_len} heads={args.heads} head_dim={args.head_dim} float32 batch=1, "
        f"LongNet segments={LONGNET[0]} dilations={LONGNET[1]}, iters={args.iters}, "
        "1 intra-op thread per process, gloo\n"
    )
    if not args.no_processes:
        results = run_processes(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([{"config": c, "mode": m, "p": w, "ranks": r}
                           for (c, m, w), r in results.items()], f, indent=1)  # fmt: skip
        print("## Peak memory per rank (worst rank)\n")
        print(memory_table(results, args) + "\n")
        print("## Time per rank vs p (thread CPU time; wall time is load-sensitive)\n")
        print(time_table(results) + "\n")
        print("## Per rank: work, bytes sent per layer, time\n")
        print(rank_table(results) + "\n")
    at_p, at_shard = bytes_tables(args)
    print(f"## Bytes sent per rank per layer vs n at p = {args.fixed_p} (plan, MiB, max rank)\n")
    print(at_p + "\n")
    print(f"## Bytes sent per rank per layer vs n at shard = {args.fixed_shard} (plan, MiB)\n")
    print(at_shard)


if __name__ == "__main__":
    main()
