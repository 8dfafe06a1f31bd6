"""Sequence sharding across the ranks of a process group (user API).

A rank holds the piece of the sequence that ``torch.tensor_split(x,
world_size, dim)`` gives it (docs/design.md §3): any global length, pieces
differing by at most one. ``layout="zigzag"`` (balanced causal work) and
``layout="balanced"`` (balanced work of any pattern, given by the keywords
``segment_lengths``, ``dilation_rates``, ``causal``, ``window`` and
``cu_seqlens``) are described in :mod:`ring_attention.core.layout`.

``group=None`` means the default process group; with no initialised process
group (or a group of one) both functions are the identity. With
``ulysses_group`` (``group`` then the ring, ``None`` = no ring) or ``mesh``,
the rank with ring index ``i`` and Ulysses index ``j`` of ``U`` holds piece
``i * U + j`` (docs/design.md §2, :mod:`ring_attention.parallel.mesh`); from a mesh,
``i`` and ``j`` are the rank's coordinates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..core.dtypes import dtype_code
from ..core.layout import (
    LAYOUTS,
    Layout,
    Piece,
    check_layout,
    layout_code,
    layout_digest,
    layout_pieces,
    layout_shard_lengths,
    resolve_layout,
    shard_bounds,
)
from ..core.pattern import Pattern, as_flag
from .comm import comm_device
from .handshake import gather_handshake, grid_handshake
from .mesh import Topology, check_grid, check_ring, resolve_topology, world_info
from .stretch import Row, to_stretch
from .ulysses import topology_of

__all__ = [
    "LAYOUTS",
    "Piece",
    "gather_sequence",
    "layout_pieces",
    "layout_shard_lengths",
    "shard_bounds",
    "shard_sequence",
]

Tensor = torch.Tensor


def _check_dim(x: torch.Tensor, dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"dim must be an int, got {dim!r}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension to shard along")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"dim must be in [{-x.dim()}, {x.dim()}) for {name} of shape "
            f"{tuple(x.shape)}, got {dim}"
        )
    return dim % x.dim()


def _grid(group, ulysses_group, mesh) -> tuple[int, int]:
    """``(shards, this rank's shard)``."""
    if ulysses_group is None and mesh is None:
        return world_info(group)
    topo = resolve_topology(group, ulysses_group, mesh)
    return topo.world_size, topo.shard_index


#: The pattern of ``segment_lengths=None``: dense attention.
_DENSE = ((2**62,), (1,))


def _sharding_layout(
    layout: str,
    segment_lengths: Sequence[int] | None,
    dilation_rates: Sequence[int] | None,
    causal: bool,
    window: tuple[int, int] | None,
    cu_seqlens: Sequence[int] | Tensor | None,
) -> Layout:
    """``layout`` checked; ``"balanced"`` resolved for the pattern of the
    keywords (checked as ``ring_dilated_attention`` checks them;
    ``segment_lengths=None``: dense). The keywords serve ``"balanced"`` only."""
    check_layout(layout)
    causal = as_flag(causal, "causal")
    if layout != "balanced":
        given = [name for name, value, default in (
            ("segment_lengths", segment_lengths, None), ("dilation_rates", dilation_rates, None),
            ("causal", causal, False), ("window", window, None), ("cu_seqlens", cu_seqlens, None),
        ) if value is not default]  # fmt: skip
        if given:
            raise ValueError(
                f"{', '.join(given)}: the pattern places the cuts of layout='balanced' only, "
                f"got it with layout={layout!r}"
            )
        return layout
    if segment_lengths is None:
        if dilation_rates is not None:
            raise ValueError("dilation_rates needs segment_lengths (None: dense attention)")
        segment_lengths, dilation_rates = _DENSE
    pattern = Pattern(segment_lengths, dilation_rates, causal=causal, window=window)
    return resolve_layout(layout, pattern.with_documents(cu_seqlens))


def shard_sequence(
    x: torch.Tensor,
    dim: int = 1,
    group: dist.ProcessGroup | None = None,
    *,
    ulysses_group: dist.ProcessGroup | None = None,
    mesh=None,
    layout: str = "contiguous",
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    cu_seqlens: Sequence[int] | Tensor | None = None,
) -> torch.Tensor:
    """This rank's piece of the full tensor ``x`` along ``dim``.

    ``layout="contiguous"`` returns ``torch.tensor_split(x, world_size, dim)[rank]``
    (a view, like ``tensor_split``); ``layout="zigzag"`` returns the
    concatenation of chunks ``rank`` and ``2 * world_size - 1 - rank`` of
    ``torch.tensor_split(x, 2 * world_size, dim)`` (a new tensor);
    ``layout="balanced"`` the rank's run of the cuts that balance the work of
    the pattern the keywords give (a view).
    Differentiable. Every rank must pass the same full ``x``; nothing is
    communicated.

    Args:
        x: the full tensor, e.g. ``(batch, seq, heads, head_dim)``.
        dim: the sequence dimension (default 1).
        group: process group, default the default group; with no initialised
            process group the world size is 1 and ``x`` is returned unchanged.
            With ``ulysses_group``: the ring (``None``: no ring).
        ulysses_group: the Ulysses group: piece ``i * U + j`` for ring index
            ``i`` and Ulysses index ``j`` (``ring_dilated_attention``).
        mesh: instead of the groups, a 1-D or 2-D ``("ring", "ulysses")``
            ``DeviceMesh``.
        layout: ``"contiguous"`` (default), ``"zigzag"`` or ``"balanced"``.
        segment_lengths, dilation_rates, causal, window, cu_seqlens: with
            ``layout="balanced"`` only, the pattern whose work the cuts
            balance, as given to ``ring_dilated_attention``
            (``segment_lengths=None``: dense attention).

    Raises:
        ValueError: a bad ``dim`` or ``layout``, a bad pattern, pattern
            keywords with a layout other than ``"balanced"``, or
            ``cu_seqlens`` not ending at the length of ``x`` along ``dim``.
    """
    dim = _check_dim(x, dim, "x")
    layout = _sharding_layout(layout, segment_lengths, dilation_rates, causal, window, cu_seqlens)
    if not isinstance(layout, str):
        layout.pattern.check_length(x.shape[dim])
    world, rank = _grid(group, ulysses_group, mesh)
    if world == 1:
        return x
    pieces = layout_pieces(x.shape[dim], world, rank, layout)
    if len(pieces) == 1:
        return x.narrow(dim, pieces[0].start, pieces[0].length)
    return torch.cat([x.narrow(dim, p.start, p.length) for p in pieces], dim=dim)


def _gather_varlen(
    x_local: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup | None,
    layout: Layout,
    order: tuple[int, ...] | None,
) -> tuple[torch.Tensor, list[Piece]]:
    """All-gather variable-length pieces (``order``: the group rank holding
    each piece, ``None``: piece r on group rank r); the full tensor and this
    rank's pieces (for the backward)."""
    world, rank = world_info(group)
    if order is not None:
        rank = order.index(rank)
    lengths = gather_handshake(group, world, x_local, dim, layout, order)
    n = sum(lengths)
    recv = _all_gather_padded(x_local, dim, lengths, group, order)
    parts = sorted(
        (p.start, r, p.offset, p.length)
        for r in range(world) for p in layout_pieces(n, world, r, layout) if p.length
    )  # fmt: skip
    pieces = [recv[r].narrow(dim, off, ln) for _, r, off, ln in parts]
    full = torch.cat(pieces, dim=dim) if pieces else x_local.narrow(dim, 0, 0)
    return full, layout_pieces(n, world, rank, layout)


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim``; the backward returns this rank's slice of the
    gradient (every rank is assumed to compute the same loss of the full
    tensor, as in sequence-parallel training)."""

    @staticmethod
    def forward(ctx, x_local: torch.Tensor, dim: int, group, layout: Layout, order) -> torch.Tensor:  # type: ignore[override]
        full, pieces = _gather_varlen(x_local, dim, group, layout, order)
        ctx.dim = dim
        ctx.pieces = pieces
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        parts = [grad.narrow(ctx.dim, p.start, p.length) for p in ctx.pieces]
        g = parts[0] if len(parts) == 1 else torch.cat(parts, dim=ctx.dim)
        return g, None, None, None, None


def gather_sequence(
    x_local: torch.Tensor,
    dim: int = 1,
    group: dist.ProcessGroup | None = None,
    *,
    ulysses_group: dist.ProcessGroup | None = None,
    mesh=None,
    layout: str = "contiguous",
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    cu_seqlens: Sequence[int] | Tensor | None = None,
) -> torch.Tensor:
    """The full tensor from every rank's piece along ``dim`` (inverse of
    :func:`shard_sequence`).

    Pieces may differ in length (they follow the convention of ``layout``);
    they are padded to the longest, all-gathered and
    trimmed. Ranks whose shapes, dtypes or lengths disagree raise
    ``ValueError`` on every rank. Differentiable: the gradient of ``x_local``
    is this rank's slice of the gradient of the full tensor (the loss is
    assumed identical on every rank). CUDA tensors on a gloo group travel
    through host memory.

    Args:
        x_local: this rank's piece.
        dim: the sequence dimension (default 1).
        group: process group, default the default group; with no initialised
            process group ``x_local`` is returned unchanged. With
            ``ulysses_group``: the ring (``None``: no ring).
        ulysses_group, mesh: as for :func:`shard_sequence`.
        layout, segment_lengths, dilation_rates, causal, window, cu_seqlens:
            as for :func:`shard_sequence`; ranks whose balanced patterns
            differ raise on every rank.
    """
    dim = _check_dim(x_local, dim, "x_local")
    layout = _sharding_layout(layout, segment_lengths, dilation_rates, causal, window, cu_seqlens)
    if ulysses_group is not None or mesh is not None:
        topo = topology_of(group, ulysses_group, mesh, "gather_sequence")
        check_grid(topo)
        if topo.ulysses_size > 1:
            return gather_grid(x_local, dim, topo, layout)
        if topo.ring_size == 1:
            return x_local
        return _GatherSequence.apply(x_local, dim, topo.ring_group, layout, topo.ring_order)
    world, _ = world_info(group)
    if world == 1:
        return x_local
    check_ring(group)  # (once per group: a rank in another call)
    return _GatherSequence.apply(x_local, dim, group, layout, None)


# ---------------------------------------------------------------------------
# gather_sequence over a grid.

_GATHER_DIMS = 5
_GATHER_FIELDS = ("seq_len_local", "ndim", "dim", "dtype", "layout",
                  *(f"size{k}" for k in range(_GATHER_DIMS)), "layout_digest")  # fmt: skip


def _all_gather_padded(
    x: Tensor, dim: int, lengths: list[int], group, order: tuple[int, ...] | None
) -> list[Tensor]:
    """Every rank's ``x`` (lengths along ``dim`` given, by index), through
    one all-gather; ``order``: the group rank of each index (``None``: the
    index)."""
    device = comm_device(group, x.device)
    longest = max(lengths)
    send = x.to(device)
    if send.shape[dim] < longest:
        pad = list(send.shape)
        pad[dim] = longest - send.shape[dim]
        send = torch.cat([send, send.new_zeros(pad)], dim=dim)
    send = send.contiguous()
    recv = [torch.empty_like(send) for _ in lengths]
    dist.all_gather(recv, send, group=group)
    if order is not None:
        recv = [recv[g] for g in order]
    return [t.narrow(dim, 0, ln).to(x.device) for t, ln in zip(recv, lengths, strict=True)]


class _GatherGrid(torch.autograd.Function):
    """All-gather along ``dim`` over the grid (rows, then the ring); the
    backward returns this rank's slice of the gradient (the loss is assumed
    the same on every rank, as in sequence-parallel training)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, topo: Topology, layout: Layout) -> Tensor:  # type: ignore[override]
        sizes = [s if k != dim else -1 for k, s in enumerate(x.shape)]
        message = [x.shape[dim], x.dim(), dim, dtype_code(x.dtype), layout_code(layout),
                   *sizes, *([-1] * (_GATHER_DIMS - x.dim())), layout_digest(layout)]  # fmt: skip
        n, row_lengths = grid_handshake(topo, "gather_sequence", _GATHER_FIELDS, message, layout)
        U, R, W = topo.ulysses_size, topo.ring_size, topo.world_size
        row = Row(
            pieces=tuple(tuple(layout_pieces(n, W, topo.ring_index * U + m, layout))
                         for m in range(U)),
            heads=(), kv=(),
        )  # fmt: skip
        stretch = to_stretch(
            _all_gather_padded(x, dim, row_lengths, topo.ulysses_group, topo.ulysses_order), row,
            dim,
        )  # fmt: skip
        if R > 1:
            stretches = _all_gather_padded(
                stretch, dim, layout_shard_lengths(n, R, layout, U), topo.ring_group,
                topo.ring_order,
            )  # fmt: skip
            runs = sorted(
                (p.start, i, p.offset, p.length)
                for i in range(R) for p in layout_pieces(n, R, i, layout, U) if p.length
            )  # fmt: skip
            parts = [stretches[i].narrow(dim, off, ln) for _, i, off, ln in runs]
            stretch = torch.cat(parts, dim=dim) if parts else stretch
        ctx.dim, ctx.pieces = dim, layout_pieces(n, W, topo.shard_index, layout)
        return stretch

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        parts = [grad.narrow(ctx.dim, p.start, p.length) for p in ctx.pieces]
        return torch.cat(parts, dim=ctx.dim), None, None, None


def gather_grid(x_local: Tensor, dim: int, topo: Topology, layout: Layout) -> Tensor:
    """``gather_sequence`` over a grid with ``U > 1`` (``dim`` checked,
    non-negative). Tensors of more than 5 dimensions are refused on every
    rank."""
    if x_local.dim() > _GATHER_DIMS:
        error = ValueError(
            f"gather_sequence with ulysses_group or mesh supports tensors of at most "
            f"{_GATHER_DIMS} dimensions, got {x_local.dim()}"
        )
        grid_handshake(topo, "gather_sequence", _GATHER_FIELDS, None, layout, error=error)
        raise error
    return _GatherGrid.apply(x_local, dim, topo, layout)
