"""Which global positions each rank holds (docs/design.md §3).

``layout="contiguous"`` (the normative convention): rank ``j`` of ``p`` holds
piece ``j`` of ``torch.tensor_split(x, p, dim)``: any global length, pieces
differing by at most one, the first ``n % p`` pieces one longer.

``layout="zigzag"`` balances causal attention: the sequence is split by
``torch.tensor_split`` into ``2p`` chunks and rank ``j`` holds chunks ``j`` and
``2p - 1 - j``, concatenated in that order, so every rank owns one early and
one late chunk.

``fold=U`` describes the ring of a ring x Ulysses hybrid (docs/design.md §2):
the sequence is sharded over ``world_size * U`` ranks by ``layout``, and ring
rank ``i`` holds the pieces of the ``U`` ranks ``i * U .. i * U + U - 1`` (its
Ulysses group's stretch), adjacent runs merged, in global order. With
``"zigzag"`` that is chunks ``i * U ..`` and ``(2 * world_size - 1 - i) * U ..``
of ``2 * world_size * U``: zigzag balancing at the ring level.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "LAYOUTS",
    "Piece",
    "check_layout",
    "layout_pieces",
    "layout_shard_lengths",
    "shard_bounds",
]

#: The sequence layouts ``shard_sequence``/``ring_dilated_attention`` accept.
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


class Piece(NamedTuple):
    """A contiguous run of global positions held by one rank.

    Attributes:
        start: first global position.
        length: number of positions (may be 0 when the sequence is shorter
            than the number of pieces).
        offset: where the run starts inside the rank's local tensor.
    """

    start: int
    length: int
    offset: int


def check_layout(layout: str) -> str:
    """Return ``layout`` if it is one of :data:`LAYOUTS`, else raise ``ValueError``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


def shard_bounds(n: int, world_size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each of the ``world_size`` pieces of a length-``n``
    sequence, exactly as ``torch.tensor_split(x, world_size)`` splits it.

    The first ``n % world_size`` pieces have ``n // world_size + 1`` elements,
    the others ``n // world_size``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    base, extra = divmod(n, world_size)
    bounds = []
    start = 0
    for i in range(world_size):
        length = base + (1 if i < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds


def layout_pieces(
    n: int, world_size: int, rank: int, layout: str = "contiguous", fold: int = 1
) -> list[Piece]:
    """The runs of global positions rank ``rank`` holds, in local order.

    One piece for ``"contiguous"``; two (chunks ``rank`` and
    ``2 * world_size - 1 - rank`` of ``2 * world_size``) for ``"zigzag"``.
    With ``fold > 1``: the merged pieces of ranks ``rank * fold ..
    rank * fold + fold - 1`` of ``world_size * fold`` (see the module docstring).
    """
    check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if fold != 1:
        return _folded_pieces(n, world_size, rank, layout, fold)
    if layout == "contiguous":
        start, length = shard_bounds(n, world_size)[rank]
        return [Piece(start, length, 0)]
    chunks = shard_bounds(n, 2 * world_size)
    first = chunks[rank]
    second = chunks[2 * world_size - 1 - rank]
    return [Piece(first[0], first[1], 0), Piece(second[0], second[1], first[1])]


def _folded_pieces(n: int, world_size: int, rank: int, layout: str, fold: int) -> list[Piece]:
    parts = sorted(
        p
        for j in range(fold)
        for p in layout_pieces(n, world_size * fold, rank * fold + j, layout)
        if p.length
    )
    runs: list[list[int]] = []
    for start, length, _ in parts:
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1][1] += length
        else:
            runs.append([start, length])
    if not runs:
        return [Piece(layout_pieces(n, world_size * fold, rank * fold, layout)[0].start, 0, 0)]
    pieces, offset = [], 0
    for start, length in runs:
        pieces.append(Piece(start, length, offset))
        offset += length
    return pieces


def layout_shard_lengths(
    n: int, world_size: int, layout: str = "contiguous", fold: int = 1
) -> list[int]:
    """Local sequence length of every rank for a global length ``n``."""
    return [
        sum(p.length for p in layout_pieces(n, world_size, r, layout, fold))
        for r in range(world_size)
    ]
