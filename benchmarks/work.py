"""The pattern's work, counted exactly: reached (query, key) pairs (branches
counted with multiplicity, the planner's closed form), the dense pair count
and the FLOPs per pair that every rate in the benchmarks divides by.
"""

from __future__ import annotations

from collections.abc import Sequence


def pattern_pairs(
    n: int,
    heads: int,
    segs: Sequence[int],
    dils: Sequence[int],
    causal: bool,
    head_groups: bool = False,
    batch: int = 1,
    rows: Sequence[tuple[int, int]] | None = None,
) -> int:
    """Exact number of reached (query, key) pairs, branches counted with multiplicity
    (the planner's closed form, ``ring_attention.core.pairs.reached_pairs``).

    Summed over batch and heads; ``rows``: only the queries in these
    ``(start, length)`` runs (a rank's shard), default the whole sequence.
    Pattern FLOPs are ``4 * head_dim`` per pair forward, 2.5x that backward.
    """
    from ring_attention.core.pairs import reached_pairs
    from ring_attention.core.pattern import Pattern

    pattern = Pattern(segs, dils, causal=causal, head_groups=head_groups)
    return batch * reached_pairs(pattern, n, heads, None if rows is None else list(rows))


def flops(pairs: int, head_dim: int, backward: bool) -> float:
    """Pattern FLOPs: 4·d per pair forward; forward + backward is 3.5x that."""
    return 4.0 * head_dim * pairs * (3.5 if backward else 1.0)


def dense_pairs(n: int, heads: int, causal: bool, batch: int = 1) -> int:
    return batch * heads * (n * (n + 1) // 2 if causal else n * n)
