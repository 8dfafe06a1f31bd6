"""Ring dilated attention: the sequence sharded across the ranks of a process
group, K/V rows exchanged point-to-point along a cached exchange plan
(docs/design.md §4). This module holds the ring alone
(:func:`ring_on_pieces`, :func:`ring_call`, :func:`exchange_plan`); the
public entry that composes it with Ulysses is
ring_attention/parallel/api.py. A call runs as two custom
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

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..core.checks import sinks_meta
from ..core.layout import resolve_layout
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
    "ring_call",
    "ring_call_spec",
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
    layout = resolve_layout(layout, pattern)
    world, rank = world_info(group)
    return get_plan(pattern, seq_len, heads, heads if kv_heads is None else kv_heads, world, rank,
                    layout)  # fmt: skip


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
    head_range: tuple[int, int, int] = (0, 0, 0),
    sinks: Tensor | None = None,
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
        layout=layout, return_lse=return_lse, fold=fold, ranks=ranks, head_range=head_range,
        sinks=sinks,
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
    head_range: tuple[int, int, int] = (0, 0, 0),
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The ring call of :func:`sharded_attention`: one operator forward and
    one backward, the documents as a tensor argument (read once per batch),
    the rest as the spec. ``sinks``: added once to every query of this rank,
    after the ring (checked on every rank by the operator)."""
    documents = cu_seqlens if isinstance(cu_seqlens, Tensor) else None
    spec = ring_call_spec(
        _ring_pattern, return_lse, None if documents is not None else cu_seqlens, build, *args,
        scale=scale, group=group, layout=layout, fold=fold, ranks=ranks, head_range=head_range,
        sinks=sinks_meta(sinks),
    )  # fmt: skip
    # (a bad return_lse or sinks is reported by the spec: the operator raises on every rank)
    if sinks is None:
        return ring_call(q_local, k_local, v_local, spec, documents, return_lse=bool(return_lse))
    out, lse = ring_call(q_local, k_local, v_local, spec, documents, return_lse=True)
    out, lse = engine.fold_sinks(out, lse, sinks)
    return (out, lse) if bool(return_lse) else out


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
