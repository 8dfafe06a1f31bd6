"""Sequence sharding across the ranks of a process group.

A rank holds the piece of the sequence that ``torch.tensor_split(x, world_size,
dim)`` gives it (DESIGN.md §2): any global length, pieces differing by at most
one, the first ``n % world_size`` pieces one longer. That is
``layout="contiguous"``, the normative convention.

``layout="zigzag"`` balances causal attention: the sequence is split by
``torch.tensor_split`` into ``2 * world_size`` chunks and rank ``j`` holds
chunks ``j`` and ``2 * world_size - 1 - j``, concatenated in that order, so
every rank owns one early and one late chunk.

``group=None`` means the default process group; with no initialised process
group (or a group of one) every function here is the identity.

This module also holds the small transport helpers the ring uses: which device
a tensor travels on for a group's backend (NCCL: CUDA; gloo: CPU, CUDA tensors
staged through host memory) and the dtype codes of the handshake.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "LAYOUTS",
    "Piece",
    "check_layout",
    "gather_sequence",
    "layout_pieces",
    "layout_shard_lengths",
    "shard_bounds",
    "shard_sequence",
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


def layout_pieces(n: int, world_size: int, rank: int, layout: str = "contiguous") -> list[Piece]:
    """The runs of global positions rank ``rank`` holds, in local order.

    One piece for ``"contiguous"``; two (chunks ``rank`` and
    ``2 * world_size - 1 - rank`` of ``2 * world_size``) for ``"zigzag"``.
    """
    check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if layout == "contiguous":
        start, length = shard_bounds(n, world_size)[rank]
        return [Piece(start, length, 0)]
    chunks = shard_bounds(n, 2 * world_size)
    first = chunks[rank]
    second = chunks[2 * world_size - 1 - rank]
    return [Piece(first[0], first[1], 0), Piece(second[0], second[1], first[1])]


def layout_shard_lengths(n: int, world_size: int, layout: str = "contiguous") -> list[int]:
    """Local sequence length of every rank for a global length ``n``."""
    return [
        sum(p.length for p in layout_pieces(n, world_size, r, layout)) for r in range(world_size)
    ]


# ---------------------------------------------------------------------------
# Process-group helpers (shared with the ring: exchange.py, handshake.py).


def world_info(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group``; ``(1, 0)`` when torch.distributed is
    unavailable or not initialised and ``group`` is None."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError(
                "group was given but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group first (or pass group=None)"
            )
        return 1, 0
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return world, rank


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (identity for the default group)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def backend_name(group: dist.ProcessGroup | None) -> str:
    """The backend string of ``group``, lower case (e.g. ``"gloo"``, ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``)."""
    return str(dist.get_backend(group)).lower()


def comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """The device a tensor living on ``device`` is sent from/received into.

    NCCL moves CUDA tensors directly. A CUDA tensor on a group without NCCL
    (gloo) is staged through host memory. A CPU tensor needs a backend that
    handles CPU tensors (gloo, mpi); an NCCL-only group raises ``ValueError``.
    """
    backend = backend_name(group)
    if device.type == "cuda":
        return device if "nccl" in backend else torch.device("cpu")
    if device.type == "cpu":
        if "nccl" in backend and "gloo" not in backend and "mpi" not in backend:
            raise ValueError(
                f"CPU tensors cannot travel over a {backend!r} process group; "
                "use a gloo group (or move the tensors to the GPU)"
            )
        return device
    raise ValueError(f"tensors on {device.type!r} are not supported by the ring transport")


def control_device(group: dist.ProcessGroup | None) -> torch.device:
    """Device of the small int64 control tensors (handshakes, length exchange)."""
    backend = backend_name(group)
    if "gloo" in backend or "mpi" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
    torch.complex64: 11,
    torch.complex128: 12,
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """A small int naming ``dtype`` in handshakes (0 for dtypes not listed)."""
    return _DTYPE_CODES.get(dtype, 0)


def dtype_name(code: int) -> str:
    """Inverse of :func:`dtype_code`, for messages."""
    dtype = _CODE_DTYPES.get(int(code))
    return str(dtype) if dtype is not None else f"<dtype code {int(code)}>"


def all_gather_ints(values: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    """All-gather a fixed-length list of int64 from every rank (one small collective)."""
    device = control_device(group)
    world = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [t.cpu().tolist() for t in out]


# ---------------------------------------------------------------------------
# Public API.


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


def shard_sequence(
    x: torch.Tensor,
    dim: int = 1,
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "contiguous",
) -> torch.Tensor:
    """This rank's piece of the full tensor ``x`` along ``dim``.

    ``layout="contiguous"`` returns ``torch.tensor_split(x, world_size, dim)[rank]``
    (a view, like ``tensor_split``); ``layout="zigzag"`` returns the
    concatenation of chunks ``rank`` and ``2 * world_size - 1 - rank`` of
    ``torch.tensor_split(x, 2 * world_size, dim)`` (a new tensor).
    Differentiable. Every rank must pass the same full ``x``; nothing is
    communicated.

    Args:
        x: the full tensor, e.g. ``(batch, seq, heads, head_dim)``.
        dim: the sequence dimension (default 1).
        group: process group, default the default group; with no initialised
            process group the world size is 1 and ``x`` is returned unchanged.
        layout: ``"contiguous"`` (default) or ``"zigzag"``.
    """
    dim = _check_dim(x, dim, "x")
    check_layout(layout)
    world, rank = world_info(group)
    if world == 1:
        return x
    pieces = layout_pieces(x.shape[dim], world, rank, layout)
    if len(pieces) == 1:
        return x.narrow(dim, pieces[0].start, pieces[0].length)
    return torch.cat([x.narrow(dim, p.start, p.length) for p in pieces], dim=dim)


def _gather_varlen(
    x_local: torch.Tensor, dim: int, group: dist.ProcessGroup | None, layout: str
) -> tuple[torch.Tensor, list[Piece]]:
    """All-gather variable-length pieces and reassemble the full tensor.

    Returns the full tensor and this rank's pieces (for the backward)."""
    world, rank = world_info(group)
    if world == 1:
        n = x_local.shape[dim]
        return x_local, layout_pieces(n, 1, 0, layout)

    # Handshake: shapes and dtypes, so a mismatch raises on every rank.
    max_dims = 8
    if x_local.dim() > max_dims:
        raise ValueError(f"gather_sequence supports tensors of at most {max_dims} dims")
    shape = list(x_local.shape) + [-1] * (max_dims - x_local.dim())
    meta = all_gather_ints([x_local.dim(), dim, dtype_code(x_local.dtype), *shape], group)
    ndims = {m[0] for m in meta}
    if len(ndims) != 1 or len({m[1] for m in meta}) != 1:
        raise ValueError(
            f"gather_sequence: ranks disagree on the number of dimensions / dim: "
            f"{[(m[0], m[1]) for m in meta]}"
        )
    if len({m[2] for m in meta}) != 1:
        raise ValueError(
            f"gather_sequence: ranks disagree on the dtype: {[dtype_name(m[2]) for m in meta]}"
        )
    shapes = [m[3 : 3 + x_local.dim()] for m in meta]
    others = {tuple(s[:dim] + s[dim + 1 :]) for s in shapes}
    if len(others) != 1:
        raise ValueError(
            f"gather_sequence: ranks disagree on the shape outside dim {dim}: {shapes}"
        )
    lengths = [s[dim] for s in shapes]
    n = sum(lengths)
    expected = layout_shard_lengths(n, world, layout)
    if lengths != expected:
        raise ValueError(
            f"gather_sequence: local lengths along dim {dim} are {lengths} (global length "
            f"{n}), but layout={layout!r} expects {expected} (torch.tensor_split convention)"
        )

    device = comm_device(group, x_local.device)
    max_len = max(lengths)
    send = x_local.to(device)
    if send.shape[dim] < max_len:
        pad_shape = list(send.shape)
        pad_shape[dim] = max_len - send.shape[dim]
        send = torch.cat([send, send.new_zeros(pad_shape)], dim=dim)
    send = send.contiguous()
    recv = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(recv, send, group=group)

    parts: list[tuple[int, torch.Tensor]] = []
    for r in range(world):
        for p in layout_pieces(n, world, r, layout):
            if p.length:
                parts.append((p.start, recv[r].narrow(dim, p.offset, p.length)))
    parts.sort(key=lambda item: item[0])
    if parts:
        full = torch.cat([t for _, t in parts], dim=dim)
    else:
        full = send.narrow(dim, 0, 0)
    return full.to(x_local.device), layout_pieces(n, world, rank, layout)


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim``; the backward returns this rank's slice of the
    gradient (every rank is assumed to compute the same loss of the full
    tensor, as in sequence-parallel training)."""

    @staticmethod
    def forward(ctx, x_local: torch.Tensor, dim: int, group, layout: str) -> torch.Tensor:  # type: ignore[override]
        full, pieces = _gather_varlen(x_local, dim, group, layout)
        ctx.dim = dim
        ctx.pieces = pieces
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        parts = [grad.narrow(ctx.dim, p.start, p.length) for p in ctx.pieces]
        g = parts[0] if len(parts) == 1 else torch.cat(parts, dim=ctx.dim)
        return g, None, None, None


def gather_sequence(
    x_local: torch.Tensor,
    dim: int = 1,
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "contiguous",
) -> torch.Tensor:
    """The full tensor from every rank's piece along ``dim`` (inverse of
    :func:`shard_sequence`).

    Pieces may differ in length (they follow the ``torch.tensor_split``
    convention of ``layout``); they are padded to the longest, all-gathered and
    trimmed. Ranks whose shapes, dtypes or lengths disagree raise
    ``ValueError`` on every rank. Differentiable: the gradient of ``x_local``
    is this rank's slice of the gradient of the full tensor (the loss is
    assumed identical on every rank). CUDA tensors on a gloo group travel
    through host memory.

    Args:
        x_local: this rank's piece.
        dim: the sequence dimension (default 1).
        group: process group, default the default group; with no initialised
            process group ``x_local`` is returned unchanged.
        layout: ``"contiguous"`` (default) or ``"zigzag"``.
    """
    dim = _check_dim(x_local, dim, "x_local")
    check_layout(layout)
    world, _ = world_info(group)
    if world == 1:
        return x_local
    return _GatherSequence.apply(x_local, dim, group, layout)
