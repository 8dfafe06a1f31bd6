"""Per-rank work of the three layouts: the busiest rank's reached (query,
key) pairs over the mean (1.000 = even), counted in closed form for each
rank's pieces (``ring_attention.core.pairs.ranks_pairs``; nothing runs),
and the time to compute the balanced cuts once.

Two sets: 1,000 random documents in 64K tokens over 4 ranks, causal, with
and without a sliding window; and LongNet-style patterns at 1M over 8 ranks.
``--measure`` runs the ring instead on ``--p`` gloo processes (one thread
each), the three layouts round-robin on packed random documents: the slowest
rank's forward + backward wall time, and each rank's process CPU time (its
own work: a rank waiting for a peer sleeps in gloo).

    python benchmarks/layout_balance.py
    python benchmarks/layout_balance.py --measure --seq-len 16384 --documents 10
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from ring_attention.core.layout import layout_pieces, resolve_layout
from ring_attention.core.pairs import ranks_pairs
from ring_attention.core.pattern import Pattern

DENSE = ([1 << 62], [1])
LONGNET = ([4096, 16384, 65536, 262144, 1048576], [1, 2, 4, 8, 16])


def _documents(n: int, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, n), count - 1))
    return [0, *cuts, n]


def _row(name: str, pattern: Pattern, n: int, world: int, heads: int = 16) -> str:
    cells = []
    for kind in ("contiguous", "zigzag", "balanced"):
        layout = resolve_layout(kind, pattern)
        start = time.perf_counter()
        pieces = [[(p.start, p.length) for p in layout_pieces(n, world, r, layout)]
                  for r in range(world)]  # fmt: skip
        seconds = time.perf_counter() - start
        work = ranks_pairs(pattern, n, heads, pieces)
        cells.append(f"{max(work) / (sum(work) / world):.3f}")
    return f"| {name} | {n} | {world} | " + " | ".join(cells) + f" | {seconds * 1e3:.0f} |"


LAYOUTS = ("contiguous", "zigzag", "balanced")


def _worker(rank: int, world: int, a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    import ring_attention as ra

    docs = _documents(a.seq_len, a.documents, 0)
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(1, a.seq_len, a.heads, a.head_dim, generator=g) for _ in range(4)]
    kw = dict(causal=True, cu_seqlens=docs)
    how = dict(segment_lengths=[a.seq_len], dilation_rates=[1], **kw)  # balanced: the cuts
    local = {lay: [ra.shard_sequence(t, 1, layout=lay, **(how if lay == "balanced" else {}))
                   .contiguous() for t in full] for lay in LAYOUTS}  # fmt: skip
    res: dict = {lay: {"wall": [], "cpu": []} for lay in LAYOUTS}
    for it in range(a.iters + 1):
        for lay in LAYOUTS:
            q, k, v, go = local[lay]
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            out = ra.ring_dilated_attention(*leaves, [a.seq_len], [1], layout=lay, **kw)
            torch.autograd.grad(out, leaves, go)
            if it:  # the first round warms the plans up
                res[lay]["cpu"].append(time.process_time() - cpu)
                dist.barrier()
                res[lay]["wall"].append(time.perf_counter() - wall)
    return res


def measure(a: argparse.Namespace) -> None:
    """The ring's time per layout on ``a.p`` gloo processes."""
    from ring_attention.parallel.testing import run_distributed

    docs = _documents(a.seq_len, a.documents, 0)
    pattern = Pattern(*DENSE, causal=True).with_documents(docs)
    res = run_distributed(_worker, a.p, a, timeout=3600, threads=1)
    print(
        f"dense causal, {a.documents} random documents, n {a.seq_len}, {a.heads}x{a.head_dim} "
        f"fp32, {a.p} gloo processes, fwd+bwd, median of {a.iters} round-robin iterations"
    )
    print("| layout | work max / mean (counted) | slowest rank ms | CPU ms per rank | "
          "CPU max / mean |")  # fmt: skip
    print("|---|---:|---:|---|---:|")
    for lay in LAYOUTS:
        layout = resolve_layout(lay, pattern)
        pieces = [[(p.start, p.length) for p in layout_pieces(a.seq_len, a.p, r, layout)]
                  for r in range(a.p)]  # fmt: skip
        work = ranks_pairs(pattern, a.seq_len, a.heads, pieces)
        wall = statistics.median(max(w) for w in zip(*(r[lay]["wall"] for r in res), strict=True))
        cpu = [statistics.median(r[lay]["cpu"]) for r in res]
        print(f"| {lay} | {max(work) / (sum(work) / a.p):.3f} | {wall * 1e3:.0f} | "
              f"{' / '.join(f'{c * 1e3:.0f}' for c in cpu)} | "
              f"{max(cpu) / statistics.mean(cpu):.3f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", action="store_true", help="run the ring on gloo processes")
    for name, default in (("p", 4), ("seq-len", 16384), ("documents", 10), ("heads", 4),
                          ("head-dim", 64), ("iters", 3)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default, help=f"({default})")
    a = ap.parse_args()
    if a.measure:
        return measure(a)
    print("| pattern | n | ranks | contiguous | zigzag | balanced | balanced cuts ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    n = 65536
    docs = _documents(n, 1000, 0)
    plain = Pattern(*DENSE, causal=True).with_documents(docs)
    windowed = Pattern(*DENSE, causal=True, window=(4095, 0)).with_documents(docs)
    print(_row("dense causal, 1,000 random documents", plain, n, 4))
    print(_row("dense causal, window 4096, 1,000 random documents", windowed, n, 4))
    n = 1 << 20
    docs = _documents(n, 10, 0)
    for name, pattern in (
        ("dense causal", Pattern(*DENSE, causal=True)),
        ("LongNet causal (w 4K-1M, r 1-16)", Pattern(*LONGNET, causal=True)),
        ("LongNet not causal", Pattern(*LONGNET)),
        ("dense causal, window 4096", Pattern(*DENSE, causal=True, window=(4095, 0))),
        ("dense causal, 10 random documents", Pattern(*DENSE, causal=True).with_documents(docs)),
        ("LongNet causal, 10 random documents",
         Pattern(*LONGNET, causal=True).with_documents(docs)),
    ):  # fmt: skip
        print(_row(name, pattern, n, 8))


if __name__ == "__main__":
    main()
