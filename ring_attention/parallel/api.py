"""The sharded attention's public entry: the ring, Ulysses and their hybrid
composed in one place (docs/design.md §2), as yunchang's LongContextAttention
composes Ulysses around a ring. The entries check nothing themselves: the
ring's operators and Ulysses' agreement rounds check each call on every
rank, so that every rank raises for one rank's bad input."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..core.pattern import Pattern
from .ring import _builder, _ring, ring_on_pieces
from .ulysses import ulysses_call

__all__ = ["ring_attention", "ring_dilated_attention"]

Tensor = torch.Tensor


def ring_attention(
    q_local: Tensor,
    k_local: Tensor,
    v_local: Tensor,
    pattern: Pattern | Callable[[], Pattern],
    *,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    ulysses_group: dist.ProcessGroup | None = None,
    mesh=None,
    layout: str = "contiguous",
    return_lse: bool = False,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`ring_dilated_attention` with a :class:`Pattern` (or a function
    building one: its errors, like every other check here, are reported
    through the handshake so that every rank raises). Under ``torch.compile``
    the ring's pattern is a constant of the graph: a function must be a
    module-level one (or a ``functools.partial`` of one with constant
    arguments), not a closure."""
    build, args = _builder(pattern)
    return sharded_attention(
        q_local, k_local, v_local, build, args, cu_seqlens=None, scale=scale, group=group,
        ulysses_group=ulysses_group, mesh=mesh, layout=layout, return_lse=return_lse, sinks=sinks,
    )  # fmt: skip


def sharded_attention(
    q_local: Tensor,
    k_local: Tensor,
    v_local: Tensor,
    build: Callable[..., Pattern],
    args: tuple,
    *,
    cu_seqlens: Sequence[int] | Tensor | None,
    scale: float | None,
    group: dist.ProcessGroup | None,
    ulysses_group: dist.ProcessGroup | None,
    mesh,
    layout: str,
    return_lse: bool,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The ring, Ulysses or the hybrid (by the groups, as
    :func:`ring_dilated_attention`) with the pattern ``build(*args)`` and the
    documents ``cu_seqlens`` (``None``: the pattern's own). Every entry of the
    package calls this: ``build`` a module-level function and ``args``
    values ``torch.compile`` holds as constants (:func:`ring_call_spec`; a
    module or a :class:`Pattern` as an argument of its own, not inside a
    ``functools.partial``); a tensor ``cu_seqlens`` is an input of the
    operator, read once per batch.

    Ulysses and the hybrid run eagerly under ``torch.compile``
    (:mod:`ring_attention.parallel.ulysses_eager`): their all-to-alls cannot be
    traced."""
    if ulysses_group is not None or mesh is not None:
        call = (q_local, k_local, v_local, build, args)
        kwargs = dict(cu_seqlens=cu_seqlens, scale=scale, group=group, ulysses_group=ulysses_group,
                      mesh=mesh, layout=layout, return_lse=return_lse, sinks=sinks,
                      ring=ring_on_pieces)  # fmt: skip
        if torch.compiler.is_compiling():
            from .ulysses_eager import ulysses_eagerly

            return ulysses_eagerly(ulysses_call, *call, **kwargs)
        return ulysses_call(*call, **kwargs)
    return _ring(
        q_local, k_local, v_local, build, args, cu_seqlens=cu_seqlens, scale=scale, group=group,
        layout=layout, return_lse=return_lse, sinks=sinks,
    )  # fmt: skip


def ring_dilated_attention(
    q_local: Tensor,
    k_local: Tensor,
    v_local: Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    scale: float | None = None,
    head_groups: bool = False,
    cu_seqlens: Sequence[int] | Tensor | None = None,
    head_offsets: str = "modulo",
    window: tuple[int, int] | None = None,
    group: dist.ProcessGroup | None = None,
    ulysses_group: dist.ProcessGroup | None = None,
    mesh=None,
    layout: str = "contiguous",
    return_lse: bool = False,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Dilated attention over a sequence sharded across the ranks of ``group``.

    Equal, forward and backward, to ``ring_attention.dilated_attention`` on the
    whole sequence, for every world size and global length.

    Args:
        q_local: ``(batch, seq_local, heads, head_dim)``, this rank's shard
            (``ring_attention.shard_sequence``): with ``layout="contiguous"``
            piece ``rank`` of ``torch.tensor_split(x, world_size, dim=1)``.
        k_local, v_local: ``(batch, seq_local, kv_heads, head_dim)``;
            ``kv_heads`` divides ``heads`` (grouped K/V heads: query head
            ``h`` reads K/V head ``h // (heads // kv_heads)``; K/V travel
            between ranks at K/V-head width).
        segment_lengths, dilation_rates: the pattern (docs/design.md §1).
        causal: keys only at or before the query (global positions).
        scale: score scale, default ``head_dim ** -0.5``.
        head_groups: branch ``i`` applies only to head group ``i``.
        cu_seqlens: document boundaries of a packed sequence, GLOBAL positions
            ``[0, e_1, ..., seq]`` (the same on every rank; documents may span
            ranks); every document starts its own segments.
        head_offsets: ``"modulo"`` (default) or ``"grouped"`` (torchscale).
        window: ``(left, right)``, the sliding window (global positions in
            the document; ``-1``: unbounded): only the K/V rows inside the
            band travel, so a window smaller than a shard exchanges with the
            neighbouring ranks only.
        group: the process group, default the default group. With no
            initialised process group (or a group of one) this is the
            single-process computation. With ``ulysses_group``: the ring
            between the ranks that hold the same heads, ``None`` = no ring.
        ulysses_group: head parallelism (Ulysses) inside this group of ``U``
            ranks: an all-to-all trades sequence for heads, each rank
            attends over its group's whole stretch for its share of the
            heads (``torch.tensor_split`` of the heads; K/V heads go only
            to the ranks that read them), and a second all-to-all trades
            back. With ``group`` as well: the ring x Ulysses hybrid, the
            rank with ring index ``i`` and Ulysses index ``j`` holding shard
            ``i * U + j`` (``shard_sequence`` with the same arguments).
        mesh: instead of the groups, a ``DeviceMesh``: 1-D = a ring over it,
            2-D with ``mesh_dim_names=("ring", "ulysses")`` = the hybrid.
        layout: ``"contiguous"`` (default), ``"zigzag"`` (balanced causal
            work, see ``ring_attention.core.layout``; in the hybrid, zigzag at
            the ring level) or ``"balanced"``: one run per rank, cut so that
            every rank's work under this pattern (window, causality and
            ``cu_seqlens`` included) is nearly equal; shard with
            ``shard_sequence(..., layout="balanced")`` and the same pattern
            keywords.
        return_lse: also return this rank's ``lse`` ``(batch, heads,
            seq_local)`` (float32; float64 for float64 inputs), differentiable.
        sinks: attention sinks ``(heads,)``, the same on every rank (as
            ``dilated_attention``): added once to every query; this rank's
            ``sinks.grad`` holds its own queries' share (summed over the
            ranks, as data-parallel reduction does, it is one process's).

    Returns:
        This rank's output shard, shape and dtype of ``q_local`` (and ``lse``).

    Raises:
        ValueError: bad arguments (before anything is communicated: a rank
            with bad inputs reports it in the handshake, so every rank
            raises), or ranks that disagree on the pattern (window included), the global length
            (shard lengths not following the convention), the dtype, the
            shapes, ``scale`` or ``layout``, or whose groups or meshes do not
            form one grid — on every rank; ``mesh`` together with
            ``group``/``ulysses_group``.

    Every rank must call it with matching arguments, and, when gradients are
    needed, every rank must run the backward.
    """

    return sharded_attention(
        q_local, k_local, v_local, _pattern_of,
        (segment_lengths, dilation_rates, causal, head_groups, head_offsets, window),
        cu_seqlens=cu_seqlens, scale=scale, group=group, ulysses_group=ulysses_group, mesh=mesh,
        layout=layout, return_lse=return_lse, sinks=sinks,
    )  # fmt: skip


def _pattern_of(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int], causal: bool,
    head_groups: bool, head_offsets: str, window: tuple[int, int] | None,
) -> Pattern:  # fmt: skip
    """The pattern of :func:`ring_dilated_attention`'s arguments."""
    return Pattern(segment_lengths, dilation_rates, causal=causal, head_groups=head_groups,
                   head_offsets=head_offsets, window=window)  # fmt: skip
