"""Ring dilated attention: the sequence sharded across the ranks of a process
group, K/V rows exchanged point-to-point along a cached exchange plan
(docs/design.md §4). This module holds the public API
(:func:`ring_dilated_attention`, :func:`ring_attention`,
:func:`exchange_plan`, :func:`ring_call`). A call runs as two custom
operators (:mod:`ring_attention.parallel.ring_ops`: the handshake and the plan) whose
autograd is :class:`ring_attention.local.ops.RingFunction`, around the schedule
(:mod:`ring_attention.parallel.schedule`); the plan is
:mod:`ring_attention.parallel.exchange_plan`, the transport
:mod:`ring_attention.parallel.transport`, its counters
:mod:`ring_attention.parallel.exchange`, the agreement check
:mod:`ring_attention.parallel.handshake`.

Double backward is not supported: it raises ``RuntimeError``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..core.layout import check_layout
from ..core.pattern import Pattern, as_flag
from ..local import engine
from . import ring_ops  # noqa: F401  (registers torch.ops.ring_attention.ring_forward/_backward)
from .comm import world_info
from .exchange import (
    ExchangeEvent,
    ExchangeStats,
    last_exchange_stats,
    register_exchange_hook,
)
from .exchange_plan import ExchangePlan, get_plan
from .ring_spec import ring_call_spec

__all__ = [
    "ExchangeEvent",
    "ExchangeStats",
    "exchange_plan",
    "last_exchange_stats",
    "register_exchange_hook",
    "ring_attention",
    "ring_call",
    "ring_call_spec",
    "ring_dilated_attention",
]

Tensor = torch.Tensor


def ring_call(
    q_local: Tensor,
    k_local: Tensor,
    v_local: Tensor,
    spec: str,
    documents: Tensor | None = None,
    *,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The ring call registered as ``spec`` (:func:`ring_call_spec`), with the
    global document boundaries ``documents`` (a 1-D integer tensor, the same
    on every rank, or ``None``). Compiles with ``fullgraph=True``: the ring is
    one operator forward and one backward."""
    needs_grad = torch.is_grad_enabled() and any(
        getattr(t, "requires_grad", False) for t in (q_local, k_local, v_local)
    )
    if isinstance(documents, Tensor) and documents.is_meta and not q_local.is_meta:
        # (a meta input would send the operator to its fake kernel: nothing checked)
        raise ValueError("cu_seqlens must hold values: got a tensor on the meta device")
    out, lse = engine.ring(q_local, k_local, v_local, documents, spec, needs_grad)
    # checked after the call: ring_dilated_attention's spec reports a bad flag
    # in the handshake (every rank raises); here every rank has finished the ring
    return (out, lse) if as_flag(return_lse, "return_lse") else out


def exchange_plan(
    seq_len: int,
    heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    head_groups: bool = False,
    kv_heads: int | None = None,
    cu_seqlens: Sequence[int] | Tensor | None = None,
    head_offsets: str = "modulo",
    window: tuple[int, int] | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
) -> ExchangePlan:
    """This rank's (cached) exchange plan for a global sequence of ``seq_len``.

    Useful to report the rows/bytes a rank exchanges per layer
    (:meth:`ExchangePlan.bytes_sent`) without running anything. ``kv_heads``
    defaults to ``heads``.
    """
    pattern = Pattern(
        segment_lengths, dilation_rates, causal=causal, head_groups=head_groups,
        head_offsets=head_offsets, window=window,
    ).with_documents(cu_seqlens)  # fmt: skip
    check_layout(layout)
    world, rank = world_info(group)
    return get_plan(pattern, seq_len, heads, heads if kv_heads is None else kv_heads, world, rank,
                    layout)  # fmt: skip


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
        ulysses_group=ulysses_group, mesh=mesh, layout=layout, return_lse=return_lse,
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
        run = _ulysses
        if torch.compiler.is_compiling():
            from .ulysses_eager import ulysses_eagerly as run
        return run(
            q_local, k_local, v_local, build, args, cu_seqlens=cu_seqlens, scale=scale,
            group=group, ulysses_group=ulysses_group, mesh=mesh, layout=layout,
            return_lse=return_lse,
        )  # fmt: skip
    return _ring(
        q_local, k_local, v_local, build, args, cu_seqlens=cu_seqlens, scale=scale, group=group,
        layout=layout, return_lse=return_lse,
    )  # fmt: skip


def ring_on_pieces(
    q_local: Tensor,
    k_local: Tensor,
    v_local: Tensor,
    pattern: Pattern | Callable[[], Pattern],
    *,
    scale: float | None,
    group: dist.ProcessGroup | None,
    layout: str,
    return_lse: bool,
    fold: int = 1,
    ranks: tuple[int, ...] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The ring over ``group``, each rank holding its pieces of ``layout``
    (``fold > 1``: the stretch of its Ulysses group, see
    :func:`ring_attention.core.layout.layout_pieces`). ``ranks``: the group's
    global ranks by ring index, from a grid call (which has checked its
    grid: the ring then does not check its group again); ``None``: a ring
    call of its own, by group rank."""
    build, args = _builder(pattern)
    return _ring(
        q_local, k_local, v_local, build, args, cu_seqlens=None, scale=scale, group=group,
        layout=layout, return_lse=return_lse, fold=fold, ranks=ranks,
    )  # fmt: skip


def _ring(
    q_local: Tensor,
    k_local: Tensor,
    v_local: Tensor,
    build: Callable[..., Pattern],
    args: tuple,
    *,
    cu_seqlens: Sequence[int] | Tensor | None,
    scale: float | None,
    group: dist.ProcessGroup | None,
    layout: str,
    return_lse: bool,
    fold: int = 1,
    ranks: tuple[int, ...] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The ring call of :func:`sharded_attention`: one operator forward and
    one backward, the documents as a tensor argument (read once per batch),
    the rest as the spec."""
    documents = cu_seqlens if isinstance(cu_seqlens, Tensor) else None
    spec = ring_call_spec(
        _ring_pattern, return_lse, None if documents is not None else cu_seqlens, build, *args,
        scale=scale, group=group, layout=layout, fold=fold, ranks=ranks,
    )  # fmt: skip
    # (a bad return_lse is reported by the spec: the operator raises on every rank)
    return ring_call(q_local, k_local, v_local, spec, documents, return_lse=bool(return_lse))


def _ulysses(
    q_local: Tensor,
    k_local: Tensor,
    v_local: Tensor,
    build: Callable[..., Pattern],
    args: tuple,
    *,
    cu_seqlens: Sequence[int] | Tensor | None,
    **kwargs,
) -> Tensor | tuple[Tensor, Tensor]:
    """Ulysses or the hybrid of :func:`sharded_attention` (its pattern built
    inside the agreement rounds, so that every rank hears of its errors)."""
    from .ulysses import ulysses_attention  # (ulysses.py calls back into the ring)

    pattern = functools.partial(_pattern_of_call, cu_seqlens, build, *args)
    return ulysses_attention(q_local, k_local, v_local, pattern, **kwargs)


def given_pattern(pattern: Pattern) -> Pattern:
    """The builder of a pattern given built (:func:`sharded_attention`)."""
    return pattern


def _builder(pattern: Pattern | Callable[[], Pattern]) -> tuple[Callable[..., Pattern], tuple]:
    """``pattern`` as a builder and its arguments."""
    if callable(pattern) and not isinstance(pattern, Pattern):
        return pattern, ()
    return given_pattern, (pattern,)


def _pattern_of_call(
    documents: Sequence[int] | Tensor | None, build: Callable[..., Pattern], *args
) -> Pattern:
    """``build(*args)``, a :class:`Pattern`, with ``documents`` (``None``:
    its own)."""
    pattern = build(*args)
    if not isinstance(pattern, Pattern):
        raise ValueError(f"pattern must be a Pattern or a function returning one, got {pattern!r}")
    return pattern if documents is None else pattern.with_documents(documents)


def _ring_pattern(
    return_lse: bool, documents: Sequence[int] | None, build: Callable[..., Pattern], *args
) -> Pattern:
    """The pattern of a ring call (:func:`_pattern_of_call`); a bad
    ``return_lse`` raises here, so that the operator reports it on every
    rank."""
    as_flag(return_lse, "return_lse")
    return _pattern_of_call(documents, build, *args)


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
        layout: ``"contiguous"`` (default) or ``"zigzag"`` (balanced causal
            work, see ``ring_attention.core.layout``; in the hybrid, zigzag at
            the ring level).
        return_lse: also return this rank's ``lse`` ``(batch, heads,
            seq_local)`` (float32; float64 for float64 inputs), differentiable.

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
        layout=layout, return_lse=return_lse,
    )  # fmt: skip


def _pattern_of(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int], causal: bool,
    head_groups: bool, head_offsets: str, window: tuple[int, int] | None,
) -> Pattern:  # fmt: skip
    """The pattern of :func:`ring_dilated_attention`'s arguments."""
    return Pattern(segment_lengths, dilation_rates, causal=causal, head_groups=head_groups,
                   head_offsets=head_offsets, window=window)  # fmt: skip
