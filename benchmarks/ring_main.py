"""Ring dilated attention across processes: time, memory, traffic, accuracy.

Launch with torchrun (one process per GPU on CUDA machines, NCCL; gloo on CPU):

    torchrun --nproc-per-node=4 benchmarks/ring_main.py
    torchrun --nproc-per-node=2 benchmarks/ring_main.py --seq-len 65536 --backward --causal \\
        --layout zigzag --dtype bfloat16

(``python benchmarks/ring_main.py`` runs it as a single process.)

Every rank builds the same random global q/k/v from ``--seed`` (block-wise, so
a rank only materialises the rows it holds), runs ``ring_dilated_attention`` on
its shard ``--iters`` times after ``--warmup`` runs, and rank 0 prints a table:

* time per rank (median of iters, ms) for the forward and, with
  ``--backward``, forward+backward;
* the rank's work: reached (query, key) pairs of the pattern, counted exactly,
  and the effective GFLOP/s (4*d FLOPs per pair forward, 2.5x that backward);
* peak memory: CUDA ``torch.cuda.max_memory_allocated``; CPU the bytes of
  the tensors the benchmark holds (shards, output, grads) and the growth of
  the process's peak RSS (``ru_maxrss``) during the ring calls;
* bytes sent per rank per layer, from the exchange plan and as measured
  (``ring_attention.exchange.last_exchange_stats``);
* max abs error of the gathered output (and grads) against single-process
  ``ring_attention.dilated_attention`` on rank 0 (``--check auto``: when
  ``seq_len <= 16384``).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ring_attention as ra
from ring_attention.exchange import last_exchange_stats
from ring_attention.ring import exchange_plan, ring_dilated_attention
from ring_attention.sharding import gather_sequence, layout_pieces

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
ROW_BLOCK = 1024  # rows generated per seeded block


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq-len", type=int, default=8192, help="global sequence length")
    p.add_argument("--segments", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--dilations", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--head-groups", action="store_true")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="auto: ring_attention.select_dtype(device)",
    )
    p.add_argument("--iters", type=int, default=3, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backward", action="store_true", help="also time forward+backward")
    p.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag"])
    p.add_argument("--check", default="auto", choices=["auto", "yes", "no"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU intra-op threads per process (0: cores / local processes)",
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------------
# Setup.


def setup(args: argparse.Namespace) -> tuple[torch.device, int, int]:
    """Initialise the process group (if launched by torchrun) and the device."""
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_env)))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
    torch.set_num_threads(threads)
    if "RANK" in os.environ and world_env > 1:
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(minutes=10),
            **({"device_id": device} if use_cuda else {}),
        )
        return device, dist.get_rank(), dist.get_world_size()
    return device, 0, 1


def make_rows(which: int, start: int, length: int, args: argparse.Namespace) -> torch.Tensor:
    """Rows ``[start, start + length)`` of global tensor ``which`` (0=q, 1=k,
    2=v, 3=grad_out), float32 on the CPU; identical on every rank."""
    B, H, D = args.batch, args.heads, args.head_dim
    out = torch.empty(B, length, H, D)
    first, last = start // ROW_BLOCK, (start + length - 1) // ROW_BLOCK if length else -1
    for blk in range(first, last + 1):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + which * 10_007 + blk)
        rows = torch.randn(B, ROW_BLOCK, H, D, generator=g)
        b0 = blk * ROW_BLOCK
        lo, hi = max(start, b0), min(start + length, b0 + ROW_BLOCK)
        out[:, lo - start : hi - start] = rows[:, lo - b0 : hi - b0]
    return out


def make_local(which: int, args: argparse.Namespace, world: int, rank: int) -> torch.Tensor:
    pieces = layout_pieces(args.seq_len, world, rank, args.layout)
    parts = [make_rows(which, p.start, p.length, args) for p in pieces]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def reached_pairs(args: argparse.Namespace, world: int, rank: int) -> int:
    """Exact number of reached (query, key, head) triples of this rank's
    queries, branches counted with multiplicity (the pattern's work)."""
    n, H = args.seq_len, args.heads
    nb = len(args.segments)
    base, extra = divmod(H, nb)
    total = 0
    for piece in layout_pieces(n, world, rank, args.layout):
        if piece.length == 0:
            continue
        t = torch.arange(piece.start, piece.start + piece.length, dtype=torch.int64)
        for i, (w, r) in enumerate(zip(args.segments, args.dilations, strict=True)):
            heads = range(H)
            if args.head_groups:
                begin = i * base + min(i, extra)
                heads = range(begin, begin + base + (1 if i < extra else 0))
            seg0 = t - t % w
            seg_len = torch.clamp(n - seg0, max=w)
            for h in heads:
                off = h % r
                active = (t % w) % r == off
                if args.causal:
                    cnt = (t - seg0 - off) // r + 1
                else:
                    cnt = torch.where(seg_len > off, (seg_len - off + r - 1) // r, 0)
                total += int(torch.where(active, cnt, 0).sum())
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# ---------------------------------------------------------------------------
# Main.


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device, rank, world = setup(args)
    dtype = ra.select_dtype(device) if args.dtype == "auto" else DTYPES[args.dtype]
    segs, dils = args.segments, args.dilations
    kw = dict(causal=args.causal, head_groups=args.head_groups, layout=args.layout)

    q, k, v, go = (
        make_local(i, args, world, rank).to(device=device, dtype=dtype) for i in range(4)
    )
    needs_grad = args.backward
    if needs_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    sync(device)
    barrier(world)

    rss0 = maxrss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def run(backward: bool) -> tuple[torch.Tensor, float]:
        barrier(world)
        sync(device)
        t0 = time.perf_counter()
        out = ring_dilated_attention(q, k, v, segs, dils, **kw)
        if backward:
            out.backward(go)
        sync(device)
        return out, (time.perf_counter() - t0) * 1e3

    fwd_ms, both_ms = [], []
    with torch.set_grad_enabled(False):
        for i in range(args.warmup + args.iters):
            _, ms = run(False)
            if i >= args.warmup:
                fwd_ms.append(ms)
    fwd_events = list(last_exchange_stats.events)
    out = None
    if args.backward:
        for i in range(args.warmup + args.iters):
            for t in (q, k, v):
                t.grad = None
            out, ms = run(True)
            if i >= args.warmup:
                both_ms.append(ms)
    all_events = list(last_exchange_stats.events) if args.backward else fwd_events
    if out is None:
        with torch.no_grad():
            out = ring_dilated_attention(q, k, v, segs, dils, **kw)
    sync(device)

    held = [q, k, v, go, out] + ([q.grad, k.grad, v.grad] if args.backward else [])
    held_bytes = sum(t.numel() * t.element_size() for t in held if t is not None)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        mem = {"cuda_peak_MiB": peak / 2**20}
    else:
        mem = {"held_MiB": held_bytes / 2**20, "rss_growth_MiB": (maxrss_bytes() - rss0) / 2**20}

    plan = exchange_plan(
        args.seq_len, args.heads, segs, dils, causal=args.causal,
        head_groups=args.head_groups, group=None, layout=args.layout,
    )  # fmt: skip
    itemsize = torch.empty(0, dtype=dtype).element_size()
    pairs = reached_pairs(args, world, rank)
    fwd_flops = 4 * args.head_dim * pairs * args.batch
    row = {
        "rank": rank,
        "local_len": q.shape[1],
        "fwd_ms": statistics.median(fwd_ms) if fwd_ms else float("nan"),
        "fwdbwd_ms": statistics.median(both_ms) if both_ms else float("nan"),
        "pairs": pairs,
        "fwd_gflops": fwd_flops / (statistics.median(fwd_ms) * 1e6) if fwd_ms else float("nan"),
        "fwdbwd_gflops": 3.5 * fwd_flops / (statistics.median(both_ms) * 1e6)
        if both_ms
        else float("nan"),
        "plan_fwd_MiB": plan.bytes_sent(args.batch, args.head_dim, itemsize) / 2**20,
        "plan_fwdbwd_MiB": plan.bytes_sent(args.batch, args.head_dim, itemsize, backward=True)
        / 2**20,
        "measured_fwd_MiB": sum(e.bytes_sent for e in fwd_events if e.phase == "forward_kv")
        / 2**20,
        "measured_all_MiB": sum(e.bytes_sent for e in all_events) / 2**20,
        "steps": len(plan.steps),
        **mem,
    }

    # accuracy against one process
    check = args.check == "yes" or (args.check == "auto" and args.seq_len <= 16384)
    errors: dict[str, float] = {}
    ref_ms = float("nan")
    if check:
        full_out = gather_sequence(out.detach(), 1, layout=args.layout)
        grads = (
            [gather_sequence(t.grad, 1, layout=args.layout) for t in (q, k, v)]
            if args.backward
            else []
        )
        if rank == 0:
            fq, fk, fv, fgo = (
                make_rows(i, 0, args.seq_len, args).to(device=device, dtype=dtype) for i in range(4)
            )
            if args.backward:
                fq, fk, fv = (t.requires_grad_() for t in (fq, fk, fv))
            sync(device)
            t0 = time.perf_counter()
            ref = ra.dilated_attention(
                fq, fk, fv, segs, dils, causal=args.causal, head_groups=args.head_groups
            )
            if args.backward:
                ref.backward(fgo)
            sync(device)
            ref_ms = (time.perf_counter() - t0) * 1e3
            errors["out"] = (full_out.float() - ref.detach().float()).abs().max().item()
            for name, g, t in zip(("dq", "dk", "dv"), grads, (fq, fk, fv), strict=False):
                errors[name] = (g.float() - t.grad.float()).abs().max().item()
        barrier(world)

    rows = [None] * world
    if world > 1:
        dist.all_gather_object(rows, row)
    else:
        rows = [row]

    if rank == 0:
        print_report(args, world, device, dtype, rows, errors, ref_ms, check)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def print_report(args, world, device, dtype, rows, errors, ref_ms, check) -> None:
    """Rank 0's table."""
    backend = ("nccl" if device.type == "cuda" else "gloo") if world > 1 else "none"
    print(
        f"ring_dilated_attention: world={world} backend={backend} device={device.type} "
        f"dtype={str(dtype).replace('torch.', '')} threads/proc={torch.get_num_threads()}"
    )
    print(
        f"  n={args.seq_len} batch={args.batch} heads={args.heads} head_dim={args.head_dim} "
        f"segments={args.segments} dilations={args.dilations} causal={args.causal} "
        f"head_groups={args.head_groups} layout={args.layout} iters={args.iters} "
        f"warmup={args.warmup}"
    )
    mem_cols = ["cuda_peak_MiB"] if device.type == "cuda" else ["held_MiB", "rss_growth_MiB"]
    cols = [
        ("rank", "{:>4}"),
        ("local_len", "{:>9}"),
        ("fwd_ms", "{:>9.2f}"),
        ("fwdbwd_ms", "{:>9.2f}"),
        ("pairs", "{:>12}"),
        ("fwd_gflops", "{:>10.2f}"),
        ("fwdbwd_gflops", "{:>13.2f}"),
        *[(m, "{:>14.2f}") for m in mem_cols],
        ("steps", "{:>5}"),
        ("plan_fwd_MiB", "{:>12.3f}"),
        ("measured_fwd_MiB", "{:>16.3f}"),
        ("plan_fwdbwd_MiB", "{:>15.3f}"),
        ("measured_all_MiB", "{:>16.3f}"),
    ]

    def cell(fmt: str, value) -> str:
        # Columns of a pass that was not run (e.g. fwdbwd without --backward) show "-".
        if isinstance(value, float) and math.isnan(value):
            return "-".rjust(len(fmt.format(0)))
        return fmt.format(value)

    print(" ".join(name.rjust(len(fmt.format(0))) for name, fmt in cols))
    for r in rows:
        print(" ".join(cell(fmt, r.get(name, float("nan"))) for name, fmt in cols))
    if device.type != "cuda":
        print(
            "  held_MiB: bytes of the shards, output and grads this rank holds; "
            "rss_growth_MiB: growth of the process's peak RSS (ru_maxrss) during the ring "
            "calls (0 = stayed below the earlier peak)"
        )
    print(
        "  plan_*_MiB: bytes a rank sends per layer from the exchange plan "
        "(fwd: K/V rows; fwdbwd: K/V twice + fp32 dK/dV returned); measured_*: bytes handed "
        "to torch.distributed in the last forward / forward+backward"
    )
    fwd = [r["fwd_ms"] for r in rows]
    pairs = [r["pairs"] for r in rows]
    if world > 1 and max(pairs) > 0:
        print(
            f"  load balance: pairs max/mean = {max(pairs) / (sum(pairs) / world):.3f}, "
            f"fwd_ms max/min = {max(fwd) / max(min(fwd), 1e-9):.2f}"
        )
    if check:
        errs = ", ".join(f"{k}={v:.3e}" for k, v in errors.items())
        print(
            f"  max abs error vs single-process dilated_attention: {errs} "
            f"(single process on rank 0: {ref_ms:.1f} ms {'fwd+bwd' if args.backward else 'fwd'}, "
            f"one run)"
        )
    else:
        print("  accuracy check skipped (--check auto: only for seq_len <= 16384)")
    if not math.isfinite(rows[0]["fwd_ms"]):
        print("  (no timed iterations)")


if __name__ == "__main__":
    main()
