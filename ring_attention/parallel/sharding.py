"""Sequence sharding across the ranks of a group or grid (docs/design.md
§2.3, §3): :func:`shard_sequence` and its inverse :func:`gather_sequence`."""

from collections.abc import Callable, Sequence
from functools import partial

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
from ..core.pattern import DENSE, Pattern, as_flag
from .comm import comm_device
from .handshake import gather_handshake, grid_handshake, topology_of
from .mesh import Topology, check_grid, check_ring, resolve_topology, world_info
from .stretch import Row, to_stretch

__all__ = ["LAYOUTS", "Piece", "gather_sequence", "layout_pieces", "layout_shard_lengths",
           "shard_bounds", "shard_sequence"]  # fmt: skip

Tensor = torch.Tensor


def _check_dim(x: torch.Tensor, dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"dim must be an int, got {dim!r}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension to shard along")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim()}) for {name} of shape "
                         f"{tuple(x.shape)}, got {dim}")  # fmt: skip
    return dim % x.dim()


def _sharding_layout(layout: str, segment_lengths: Sequence[int] | None,
                     dilation_rates: Sequence[int] | None, causal: bool,
                     window: tuple[int, int] | None,
                     cu_seqlens: Sequence[int] | Tensor | None) -> Layout:  # fmt: skip
    """``layout`` checked; ``"balanced"`` resolved for the keywords' pattern."""
    check_layout(layout)
    causal = as_flag(causal, "causal")
    if layout != "balanced":
        given = [name for name, value, default in (
            ("segment_lengths", segment_lengths, None), ("dilation_rates", dilation_rates, None),
            ("causal", causal, False), ("window", window, None), ("cu_seqlens", cu_seqlens, None),
        ) if value is not default]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)}: the pattern places the cuts of "
                             f"layout='balanced' only, got it with layout={layout!r}")  # fmt: skip
        return layout
    if segment_lengths is None:
        if dilation_rates is not None:
            raise ValueError("dilation_rates needs segment_lengths (None: dense attention)")
        segment_lengths, dilation_rates = DENSE.segment_lengths, DENSE.dilation_rates
    pattern = Pattern(segment_lengths, dilation_rates, causal=causal, window=window)
    return resolve_layout(layout, pattern.with_documents(cu_seqlens))


def shard_sequence(x: torch.Tensor, dim: int = 1, group: dist.ProcessGroup | None = None, *,
                   ulysses_group: dist.ProcessGroup | None = None, mesh=None,
                   layout: str = "contiguous", segment_lengths: Sequence[int] | None = None,
                   dilation_rates: Sequence[int] | None = None, causal: bool = False,
                   window: tuple[int, int] | None = None,
                   cu_seqlens: Sequence[int] | Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """This rank's piece of the full tensor ``x`` along ``dim`` for ``layout``
    (docs/parallel.md); nothing is communicated; differentiable."""
    dim = _check_dim(x, dim, "x")
    layout = _sharding_layout(layout, segment_lengths, dilation_rates, causal, window, cu_seqlens)
    if not isinstance(layout, str):
        layout.pattern.check_length(x.shape[dim])
    if ulysses_group is None and mesh is None:
        world, rank = world_info(group)
    else:
        topo = resolve_topology(group, ulysses_group, mesh)
        world, rank = topo.world_size, topo.shard_index
    if world == 1:
        return x
    pieces = layout_pieces(x.shape[dim], world, rank, layout)
    if len(pieces) == 1:
        return x.narrow(dim, pieces[0].start, pieces[0].length)
    return torch.cat([x.narrow(dim, p.start, p.length) for p in pieces], dim=dim)


def _gather_varlen(x_local: torch.Tensor, dim: int, group: dist.ProcessGroup | None, layout: Layout,
                   order: tuple[int, ...] | None) -> tuple[torch.Tensor, list[Piece]]:  # fmt: skip
    """All-gather variable-length pieces: the full tensor, this rank's pieces."""
    world, rank = world_info(group)
    if order is not None:
        rank = order.index(rank)
    n = sum(gather_handshake(group, world, x_local, dim, layout, order))
    full = _gather_ring(x_local, dim, n, world, layout, 1, group, order)
    return full, layout_pieces(n, world, rank, layout)


def _gather_ring(x: Tensor, dim: int, n: int, world: int, layout: Layout, fold: int, group,
                 order: tuple[int, ...] | None) -> Tensor:  # fmt: skip
    """Every ring member's piece of the ``n`` positions, gathered: the full tensor."""
    recv = _all_gather_padded(x, dim, layout_shard_lengths(n, world, layout, fold), group, order)
    pieces = Row(tuple(tuple(layout_pieces(n, world, r, layout, fold)) for r in range(world)))
    return to_stretch(recv, pieces, dim)


class _Gather(torch.autograd.Function):
    """``gather(x)`` whose backward returns this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, gather: Callable) -> Tensor:  # type: ignore[override]
        full, ctx.pieces = gather(x)
        ctx.dim = dim
        return full.clone() if full._is_view() else full  # (a view could not be modified)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        parts = [grad.narrow(ctx.dim, p.start, p.length) for p in ctx.pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=ctx.dim), None, None


def gather_sequence(x_local: torch.Tensor, dim: int = 1, group: dist.ProcessGroup | None = None, *,
                    ulysses_group: dist.ProcessGroup | None = None, mesh=None,
                    layout: str = "contiguous", segment_lengths: Sequence[int] | None = None,
                    dilation_rates: Sequence[int] | None = None, causal: bool = False,
                    window: tuple[int, int] | None = None,
                    cu_seqlens: Sequence[int] | Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The full tensor from every rank's piece along ``dim`` (the inverse of
    :func:`shard_sequence`); differentiable."""
    dim = _check_dim(x_local, dim, "x_local")
    layout = _sharding_layout(layout, segment_lengths, dilation_rates, causal, window, cu_seqlens)
    order = None
    if ulysses_group is not None or mesh is not None:
        topo = topology_of(group, ulysses_group, mesh, "gather_sequence")
        check_grid(topo)
        if topo.ulysses_size > 1 and x_local.dim() > _GATHER_DIMS:  # refused on every rank
            error = ValueError(f"gather_sequence with ulysses_group or mesh supports tensors of at "
                               f"most {_GATHER_DIMS} dimensions, got {x_local.dim()}")  # fmt: skip
            grid_handshake(topo, "gather_sequence", _GATHER_FIELDS, None, layout, error=error)
            raise error
        if topo.ulysses_size > 1:
            gather = partial(_gather_grid, dim=dim, topo=topo, layout=layout)
            return _Gather.apply(x_local, dim, gather)
        group, order = topo.ring_group, topo.ring_order
        if topo.ring_size == 1:
            return x_local
    elif world_info(group)[0] == 1:
        return x_local
    else:
        check_ring(group)  # (once per group: a rank in another call)
    gather = partial(_gather_varlen, dim=dim, group=group, layout=layout, order=order)
    return _Gather.apply(x_local, dim, gather)


_GATHER_DIMS = 5
_GATHER_FIELDS = ("seq_len_local", "ndim", "dim", "dtype", "layout",
                  *(f"size{k}" for k in range(_GATHER_DIMS)), "layout_digest")  # fmt: skip


def _all_gather_padded(x: Tensor, dim: int, lengths: list[int], group,
                       order: tuple[int, ...] | None) -> list[Tensor]:  # fmt: skip
    """Every rank's ``x`` (their lengths along ``dim`` given) in one all-gather."""
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


def _gather_grid(x: Tensor, dim: int, topo: Topology, layout: Layout) -> tuple[Tensor, list]:
    """The grid's all-gather along ``dim`` (rows, then the ring)."""
    sizes = [s if k != dim else -1 for k, s in enumerate(x.shape)]
    message = [x.shape[dim], x.dim(), dim, dtype_code(x.dtype), layout_code(layout), *sizes,
               *([-1] * (_GATHER_DIMS - x.dim())), layout_digest(layout)]  # fmt: skip
    n, row_lengths = grid_handshake(topo, "gather_sequence", _GATHER_FIELDS, message, layout)
    U, R, W = topo.ulysses_size, topo.ring_size, topo.world_size
    row = Row(tuple(tuple(layout_pieces(n, W, topo.ring_index * U + m, layout)) for m in range(U)))
    rows = _all_gather_padded(x, dim, row_lengths, topo.ulysses_group, topo.ulysses_order)
    stretch = to_stretch(rows, row, dim)
    if R > 1:
        stretch = _gather_ring(stretch, dim, n, R, layout, U, topo.ring_group, topo.ring_order)
    return stretch, layout_pieces(n, W, topo.shard_index, layout)
