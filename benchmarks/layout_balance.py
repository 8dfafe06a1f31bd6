"""Per-rank work of the three layouts: the busiest rank's reached (query,
key) pairs over the mean (1.000 = even), counted in closed form for each
rank's pieces (``ring_attention.core.pairs.ranks_pairs``; nothing runs),
and the time to compute the balanced cuts once.

Two sets: 1,000 random documents in 64K tokens over 4 ranks, causal, with
and without a sliding window; and LongNet-style patterns at 1M over 8 ranks.

    python benchmarks/layout_balance.py
"""

from __future__ import annotations

import random
import time

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


def main() -> None:
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
