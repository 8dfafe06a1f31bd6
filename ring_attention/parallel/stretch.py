"""A Ulysses group's stretch of the sequence: its members' pieces in global
order (:class:`Row`) and the moves between local rows and the stretch."""

from dataclasses import dataclass

import torch

from ..core.layout import Piece

Tensor = torch.Tensor


@dataclass(frozen=True)
class Row:
    """The sequence and the heads of one Ulysses group."""

    pieces: tuple[tuple[Piece, ...], ...]  # every member's pieces, local order
    heads: tuple[tuple[int, int], ...] = ()  # every member's query heads (start, count)
    kv: tuple[tuple[int, int], ...] = ()  # every member's K/V heads [begin, end)

    def lengths(self) -> list[int]:
        return [sum(p.length for p in ps) for ps in self.pieces]

    def order(self) -> list[tuple[int, int, int]]:
        """``(member, offset in its local tensor, length)`` of every non-empty
        piece, in global order: the stretch, concatenated."""
        runs = [(p.start, m, p.offset, p.length)
                for m, ps in enumerate(self.pieces) for p in ps if p.length]  # fmt: skip
        return [(m, off, ln) for _, m, off, ln in sorted(runs)]


def to_stretch(blocks: list[Tensor], row: Row, dim: int) -> Tensor:
    """Received per-member blocks (each a member's local rows) -> the stretch."""
    parts = [blocks[m].narrow(dim, off, ln) for m, off, ln in row.order()]
    if not parts:
        return blocks[0].narrow(dim, 0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def from_stretch(x: Tensor, row: Row, dim: int) -> list[Tensor]:
    """The stretch -> each member's local rows (inverse of :func:`to_stretch`)."""
    where: dict[tuple[int, int], int] = {}
    at = 0
    for m, off, ln in row.order():
        where[(m, off)] = at
        at += ln
    out = []
    for m, ps in enumerate(row.pieces):
        parts = [x.narrow(dim, where[(m, p.offset)], p.length) for p in ps if p.length]
        out.append(torch.cat(parts, dim=dim) if parts else x.narrow(dim, 0, 0))
    return out
