"""Which global positions each rank holds (docs/design.md §3): ``"contiguous"``
(``torch.tensor_split``), ``"zigzag"`` (chunks ``j`` and ``2p - 1 - j`` of ``2p``) and
``"balanced"`` (cuts by the pattern's work, resolved into a :class:`Balanced`); ``fold=U``: a
ring rank holds its Ulysses group's pieces."""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .cache import cached
from .geometry import INT64_SAFE, prefix_pairs, range_pairs
from .pattern import Pattern

#: The sequence layouts ``shard_sequence``/``ring_dilated_attention`` accept.
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag", "balanced")


@dataclass(frozen=True)
class Balanced:
    """``layout="balanced"`` for one pattern (:func:`resolve_layout`)."""

    pattern: Pattern

    def __repr__(self) -> str:
        return f"'balanced' ({self.pattern.describe()}; digest {self.pattern.digest():#x})"


#: A layout as the functions here take it: a name of :data:`LAYOUTS` other
#: than ``"balanced"``, or a :class:`Balanced`.
Layout = str | Balanced


def resolve_layout(layout: Layout, pattern: Pattern) -> Layout:
    """``layout`` checked, ``"balanced"`` resolved for ``pattern``."""
    if isinstance(layout, Balanced) or check_layout(layout) != "balanced":
        return layout
    return Balanced(pattern._replace(head_groups=False, head_offsets="modulo"))


def layout_code(layout: Layout) -> int:
    """The index in :data:`LAYOUTS` of ``layout``'s name (the handshakes)."""
    return LAYOUTS.index("balanced" if isinstance(layout, Balanced) else check_layout(layout))


def layout_digest(layout: Layout) -> int:
    """The digest of a balanced layout's pattern, 0 for the others."""
    return layout.pattern.digest() if isinstance(layout, Balanced) else 0


class Piece(NamedTuple):
    """A run of global positions ``[start, start + length)`` held by one rank, at ``offset`` in
    its local tensor."""

    start: int
    length: int
    offset: int


def check_layout(layout: Layout) -> Layout:
    """``layout`` if it is one of :data:`LAYOUTS` or a :class:`Balanced`, else ``ValueError``."""
    if not isinstance(layout, Balanced) and (not isinstance(layout, str) or layout not in LAYOUTS):
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


def shard_bounds(n: int, world_size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each of the ``world_size`` pieces, as ``torch.tensor_split`` splits
    a length-``n`` sequence."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    base, extra = divmod(n, world_size)
    return [(i * base + min(i, extra), base + (1 if i < extra else 0)) for i in range(world_size)]


def layout_pieces(
    n: int, world_size: int, rank: int, layout: Layout = "contiguous", fold: int = 1
) -> list[Piece]:
    """The runs of global positions rank ``rank`` holds, in local order (with ``fold > 1``: the
    merged pieces of ranks ``rank * fold ..`` of ``world_size * fold``)."""
    check_layout(layout)
    if layout == "balanced":
        raise ValueError(
            "layout='balanced' places its cuts by the attention pattern: resolve it with the "
            "pattern first (ring_attention.core.layout.resolve_layout; shard_sequence and "
            "gather_sequence take the pattern's keywords)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if fold != 1:
        return _folded_pieces(n, world_size, rank, layout, fold)
    if isinstance(layout, Balanced):
        cuts = balanced_cuts(layout, n, world_size)
        return [Piece(cuts[rank], cuts[rank + 1] - cuts[rank], 0)]
    if layout == "contiguous":
        start, length = shard_bounds(n, world_size)[rank]
        return [Piece(start, length, 0)]
    chunks = shard_bounds(n, 2 * world_size)
    (first, first_len), (second, second_len) = chunks[rank], chunks[2 * world_size - 1 - rank]
    return [Piece(first, first_len, 0), Piece(second, second_len, first_len)]


#: :func:`balanced_work_below` counts at most this many offsets of a branch.
BALANCE_OFFSETS = 64


def balanced_work_below(pattern: Pattern, seq_len: int, xs: Sequence[int]) -> list[int]:
    """The work of the queries below each ``x`` of ``xs``, independent of the heads (what
    ``layout="balanced"`` cuts evenly): per branch the pairs of every offset weighted ``1 /
    r`` (at most :data:`BALANCE_OFFSETS` offsets), in exact integers."""
    xs = [int(x) for x in xs]
    if not xs:
        return []
    most = BALANCE_OFFSETS
    chosen = [
        range(r) if r <= most else [k * r // most for k in range(most)] for _, r in pattern.branches
    ]
    scale = math.lcm(*(len(c) for c in chosen))
    total = [0] * len(xs)
    for (w, r), offs in zip(pattern.branches, chosen, strict=True):
        branch = pattern._replace(segment_lengths=(w,), dilation_rates=(r,))
        weights = [dict.fromkeys(offs, 1)]
        reach = len(offs) * (-(-min(w, seq_len) // r) + 1)
        if 8 * seq_len * reach < INT64_SAFE:
            ends = torch.tensor(xs, dtype=torch.int64)
            counts = prefix_pairs(branch, seq_len, weights, ends).tolist()
        else:  # Python integers
            counts = [range_pairs(branch, seq_len, weights, 0, x) for x in xs]
        weight = scale // len(offs)
        total = [t + weight * c for t, c in zip(total, counts, strict=True)]
    return total


@cached("balanced layout cuts", 64)
def balanced_cuts(layout: Balanced, n: int, shards: int) -> tuple[int, ...]:
    """``shards + 1`` boundaries, each where the work below it is nearest ``j / shards`` of the
    total (a vectorised bisection)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    layout.pattern.check_length(n)
    total = balanced_work_below(layout.pattern, n, [n])[0]
    targets = [(total * j + shards // 2) // shards for j in range(1, shards)]
    lo, hi = [0] * len(targets), [n] * len(targets)
    while any(a < b for a, b in zip(lo, hi, strict=True)):
        mid = [(a + b) // 2 for a, b in zip(lo, hi, strict=True)]
        work = balanced_work_below(layout.pattern, n, mid)
        for i, (m, w) in enumerate(zip(mid, work, strict=True)):
            if lo[i] < hi[i]:
                if w >= targets[i]:
                    hi[i] = m
                else:
                    lo[i] = m + 1
    # lo[i]: the first position whose work below reaches the target; the one
    # before it may be nearer.
    before = balanced_work_below(layout.pattern, n, [max(x - 1, 0) for x in lo])
    at = balanced_work_below(layout.pattern, n, lo)
    cuts = [0]
    for x, t, b, a in zip(lo, targets, before, at, strict=True):
        x = x - 1 if x > 0 and t - b < a - t else x
        cuts.append(max(x, cuts[-1]))
    return (*cuts, n)


def _folded_pieces(n: int, world_size: int, rank: int, layout: Layout, fold: int) -> list[Piece]:
    ranks = range(rank * fold, (rank + 1) * fold)
    parts = sorted(
        p for r in ranks for p in layout_pieces(n, world_size * fold, r, layout) if p.length
    )
    pieces: list[Piece] = []  # adjacent parts merged
    for start, length, _ in parts:
        if pieces and sum(pieces[-1][:2]) == start:
            pieces[-1] = pieces[-1]._replace(length=pieces[-1].length + length)
        else:
            pieces.append(Piece(start, length, sum(p.length for p in pieces)))
    if not pieces:
        return [Piece(layout_pieces(n, world_size * fold, rank * fold, layout)[0].start, 0, 0)]
    return pieces


def layout_shard_lengths(
    n: int, world_size: int, layout: Layout = "contiguous", fold: int = 1
) -> list[int]:
    """Local sequence length of every rank for a global length ``n``."""
    return [
        sum(p.length for p in layout_pieces(n, world_size, r, layout, fold))
        for r in range(world_size)
    ]
