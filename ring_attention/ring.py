"""Ring dilated attention: the sequence sharded across the ranks of a process
group, K/V rows exchanged point-to-point along a cached exchange plan
(docs/design.md §4). This module holds the schedule and the public API; its
autograd is :class:`ring_attention.ops.RingFunction` (the operator boundary),
the plan :mod:`ring_attention.plan`, the transport
:mod:`ring_attention.transport`, the agreement check
:mod:`ring_attention.handshake`.

Forward, per rank:

1. A handshake: one fixed-size control message per rank (local length,
   batch, heads, K/V heads, head_dim, dtype, the pattern's digest, scale,
   layout, grad mode, and an error flag), so ranks that disagree raise
   ``ValueError`` on every rank instead of hanging.
2. ``out`` (fp32) and ``lse`` (-inf, fp32) accumulators; the exchange of the
   first active step is posted, then the local blocks are computed with
   the block operator (:func:`ring_attention.ops.block_forward`) while it
   travels.
3. For every active step of the plan: wait for the step's K/V rows, post the
   next active step into the other buffers (communication of step ``i+1``
   overlaps the compute of step ``i``), read the rows in place (a sender
   piece's needed rows directly where they are a whole range, e.g. the whole
   piece; else through a row map: ring_attention/transport.py) and merge the
   blocks into the
   accumulators. For plain dense attention each block may instead be one
   dense backend call, and where every segment lies inside one piece each
   piece's block the local op's per-branch path
   (ring_attention/dense_blocks.py), where
   ``RING_ATTENTION_FORWARD``/``RING_ATTENTION_BACKWARD`` and the dispatch
   table say (ring_attention/dispatch.py's ``route_blocks``).
4. Cast ``out`` once; ``lse`` stays fp32 and is differentiable.

Backward re-exchanges K/V along the same schedule, computes
``block_backward`` (the gradient of ``lse`` entering its ``delta``) into the
fp32 dK/dV return buffer of the sender's rows and returns
exactly the rows it received to their owner (reverse direction), which adds
them into its own gradients. Steps run in the global order
``KV(1), KV(2), G(1), KV(3), G(2), ...`` (every rank posts a subsequence of
that order), so NCCL's in-order streams cannot deadlock.

Double backward is not supported: it raises ``RuntimeError``.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._comm import comm_device, global_ranks, world_info
from .checks import check_qkv, resolve_scale
from .config import far_bytes
from .dense_blocks import DenseBlocks
from .dispatch import route_blocks
from .dtypes import acc_dtype
from .exchange import ExchangeEvent, ExchangeStats, last_exchange_stats, register_exchange_hook
from .handshake import ring_handshake, ring_message
from .layout import Piece, check_layout
from .ops import OpArgs, RingFunction, op_args
from .ops import block_backward as _block_backward
from .ops import block_forward as _block_forward
from .pattern import Pattern, as_flag
from .plan import ExchangePlan, get_plan
from .ring_spec import get_spec, ring_call_spec
from .transport import Exchanger

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


# ---------------------------------------------------------------------------
# One ring call: configuration, blocks, schedule.


@dataclass(frozen=True, eq=False)
class _RingCall:
    """One ring call: its plan, group and operator arguments (what the
    schedules :func:`_ring_forward` and :func:`_ring_backward` run with)."""

    plan: ExchangePlan
    group: dist.ProcessGroup | None
    peers: tuple[int, ...]  # global rank of every group rank
    op_args: OpArgs  # the pattern arguments of the block operators
    far_bytes: int = 0  # transfers of at most this many K/V bytes: the far group

    def block_forward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_start: int,
        k_start: int, k_rows: Tensor | None = None,
    ) -> None:  # fmt: skip
        """Merge the block (queries at ``q_start``, keys at ``k_start``; packed
        K/V rows with their row map ``k_rows``) into ``out``/``lse``."""
        _block_forward(q, k, v, out, lse, q_start, k_start, self.op_args, k_rows)

    def block_backward(
        self, go: Tensor, glse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
        lse: Tensor, dq: Tensor, dk: Tensor, dv: Tensor, q_start: int, k_start: int,
        k_rows: Tensor | None = None,
    ) -> None:  # fmt: skip
        """Accumulate the block's gradient into ``dq``/``dk``/``dv``."""
        _block_backward(go, glse, q, k, v, out, lse, dq, dk, dv, q_start, k_start, self.op_args,
                        k_rows)  # fmt: skip

    def dense_blocks(self, pass_: str, q: Tensor, k: Tensor) -> DenseBlocks | None:
        """The dense backend's blocks of ``pass_`` where the route is dense
        (ring_attention/dispatch.py), else ``None`` (our block kernels)."""
        plan = self.plan
        every = [p for pieces in plan.all_pieces for p in pieces]
        rows = math.gcd(*(p.length for p in every))
        bounds = tuple(sorted({b for p in every for b in (p.start, p.start + p.length)}))
        r = route_blocks(pass_, q, k, plan.pattern, plan.seq_len, bounds, rows or 1)
        return DenseBlocks(r, plan.pattern, self.op_args.scale) if r.dense else None

    def exchanger(self, q: Tensor, role: str) -> Exchanger:
        """The transport of one pass (``role``: ``"forward"``/``"backward"``)."""
        return Exchanger(
            self.plan, self.group, self.peers, q.device, q.dtype, q.shape[0], q.shape[3], role,
            self.far_bytes,
        )  # fmt: skip


def _split(t: Tensor, pieces: Sequence[Piece], dim: int = 1) -> list[Tensor]:
    """Contiguous per-piece tensors along ``dim`` (no copy for one piece of a
    contiguous tensor)."""
    if len(pieces) == 1 and pieces[0].length == t.shape[dim]:
        return [t.contiguous()]
    return [t.narrow(dim, p.offset, p.length).contiguous() for p in pieces]


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _zeros(like: Tensor, pieces: Sequence[Piece], dtype: torch.dtype) -> list[Tensor]:
    B, _, H, D = like.shape
    return [torch.zeros(B, p.length, H, D, dtype=dtype, device=like.device) for p in pieces]


def _ring_forward(call: _RingCall, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    plan, pieces = call.plan, call.plan.pieces
    qs, ks, vs = _split(q, pieces), _split(k, pieces), _split(v, pieces)
    B, _, H, _ = q.shape
    acc = acc_dtype(q.dtype)
    outs = _zeros(q, pieces, acc)
    lses = [torch.full((B, H, p.length), -math.inf, dtype=acc, device=q.device) for p in pieces]

    dense = call.dense_blocks("forward", q, k)

    def attend(qi: int, k_j: Tensor, v_j: Tensor, k_start: int, rows: Tensor | None = None) -> None:
        args = (qs[qi], k_j, v_j, outs[qi], lses[qi], pieces[qi].start, k_start)
        if rows is not None or dense is None or not dense.forward(*args):
            call.block_forward(*args, rows)

    ex = call.exchanger(q, "forward") if plan.steps else None
    steps = ex.steps if ex is not None else ()
    far = ex.post_far_kv("forward_kv", ks, vs) if ex is not None else None  # posted first
    pending = ex.post_kv("forward_kv", steps[0], 0, ks, vs) if steps else None
    for qi, ki in plan.local_pairs:  # overlaps the first exchange
        attend(qi, ks[ki], vs[ki], pieces[ki].start)
    if far is not None:  # the far group's blocks, while the first ring step travels
        for step, packed in ex.far_received(far.wait()):
            kp, vp, starts, maps = ex.unpack_kv(packed, step)
            for qi, kj in step.pairs:
                attend(qi, kp[kj], vp[kj], starts[kj], maps[kj])

    for i, step in enumerate(steps):
        packed = pending.wait()
        if i + 1 < len(steps):  # prefetch the next active step into the other buffers
            pending = ex.post_kv("forward_kv", steps[i + 1], (i + 1) % 2, ks, vs)
        if packed is None:
            continue
        kp, vp, starts, maps = ex.unpack_kv(packed, step)
        for qi, kj in step.pairs:
            attend(qi, kp[kj], vp[kj], starts[kj], maps[kj])

    return _cat([o.to(q.dtype) for o in outs], dim=1), _cat(lses, dim=2)


def _ring_backward(
    call: _RingCall,
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    plan, pieces = call.plan, call.plan.pieces
    qs, ks, vs, outs, gos = (_split(t, pieces) for t in (q, k, v, out, grad_out.to(q.dtype)))
    lses = _split(lse, pieces, dim=2)
    glses = [None] * len(pieces) if grad_lse is None else _split(grad_lse.to(lse.dtype), pieces, 2)
    acc = acc_dtype(q.dtype)
    dqs, dks, dvs = _zeros(q, pieces, acc), _zeros(k, pieces, acc), _zeros(k, pieces, acc)

    # a gradient reaching lse takes our kernels (the dense backwards have no input for it)
    dense = call.dense_blocks("backward", q, k) if grad_lse is None else None

    def attend(
        qi: int, k_j: Tensor, v_j: Tensor, dk_j: Tensor, dv_j: Tensor, k_start: int,
        rows: Tensor | None = None,
    ) -> None:  # fmt: skip
        if rows is None and dense is not None and dense.backward(
            gos[qi], qs[qi], k_j, v_j, outs[qi], lses[qi], dqs[qi], dk_j, dv_j,
            pieces[qi].start, k_start,
        ):  # fmt: skip
            return
        call.block_backward(
            gos[qi], glses[qi], qs[qi], k_j, v_j, outs[qi], lses[qi], dqs[qi], dk_j, dv_j,
            pieces[qi].start, k_start, rows,
        )  # fmt: skip

    ex = call.exchanger(q, "backward") if plan.steps else None
    steps = ex.steps if ex is not None else ()
    far = ex.post_far_kv("backward_kv", ks, vs) if ex is not None else None  # posted first
    first = ex.step_for(1) if ex is not None else None
    kv_pending = ex.post_kv("backward_kv", first, 1, ks, vs) if first is not None else None
    for qi, ki in plan.local_pairs:  # overlaps the first exchange
        attend(qi, ks[ki], vs[ki], dks[ki], dvs[ki], pieces[ki].start)
    far_grad = None
    if far is not None:  # the far group's blocks; their dK/dV go back as one batch
        packed = far.wait()
        views = {s.distance: (dkp, dvp) for s, dkp, dvp in ex.far_grad_views()}
        for step, rows in ex.far_received(packed):
            kp, vp, starts, maps = ex.unpack_kv(rows, step)
            dkp, dvp = views[step.distance]
            for qi, kj in step.pairs:
                attend(qi, kp[kj], vp[kj], dkp[kj], dvp[kj], starts[kj], maps[kj])
        far_grad = ex.post_far_grad()

    # Global order of posts: F, KV(1), FG, KV(2), G(1), KV(3), G(2), ... (F, FG:
    # the far group's K/V and gradients); each rank posts the subsequence it
    # takes part in. Buffers alternate by distance.
    g_prev = None  # (transfer, step) of the previous gradient return
    for d in range(1, plan.world_size if steps else 1):
        step = ex.step_for(d)
        packed = kv_pending.wait() if step is not None else None
        nxt = ex.step_for(d + 1)
        kv_pending = (
            ex.post_kv("backward_kv", nxt, (d + 1) % 2, ks, vs) if nxt is not None else None
        )
        g_now = None
        if step is not None:
            dkp = dvp = None
            if packed is not None:
                kp, vp, starts, maps = ex.unpack_kv(packed, step)
                dkp, dvp = ex.grad_views(step, d % 2)
                for qi, kj in step.pairs:
                    attend(qi, kp[kj], vp[kj], dkp[kj], dvp[kj], starts[kj], maps[kj])
            g_now = (ex.post_grad(step, d % 2, dkp, dvp), step)
        if g_prev is not None:
            ex.finish_grad(*g_prev, dks, dvs)
        g_prev = g_now
    if g_prev is not None:
        ex.finish_grad(*g_prev, dks, dvs)
    if far_grad is not None:
        ex.finish_far_grad(far_grad, dks, dvs)

    return tuple(_cat([t.to(q.dtype) for t in g], dim=1) for g in (dqs, dks, dvs))


# ---------------------------------------------------------------------------
# The operator boundary: forward and backward as custom operators (opaque to
# torch.compile), the call's configuration named by a RingSpec key
# (ring_attention/ring_spec.py).


class _Documents:
    """The pattern with the documents of the last ``documents`` tensor seen,
    per spec: the layers of a model pass the same tensor, so its boundaries
    are read (device -> host) once per batch, not once per layer and pass."""

    def __init__(self) -> None:
        self._source: Any = None
        self._patterns: dict[str, Pattern] = {}

    def pattern(self, key: str, base: Pattern, documents: Tensor | None) -> Pattern:
        if documents is None:
            return base
        source = (weakref.ref(documents), documents._version)
        if (
            self._source is None
            or self._source[0]() is not documents
            or self._source[1] != (documents._version)
        ):
            self._source, self._patterns = source, {}
        if key not in self._patterns:
            self._patterns[key] = base.with_documents(documents)
        return self._patterns[key]


_documents = _Documents()


def _call_of(
    key: str, q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, needs_grad: bool,
    n: int | None = None,
) -> _RingCall:  # fmt: skip
    """The checked call. Forward (``n`` is None): the ranks agree through the
    handshake on everything, the global length included, and a rank whose
    call fails makes every rank raise. Backward: the forward's ``n``."""
    spec = get_spec(key)
    group = spec.group
    world, rank = world_info(group)
    message, pattern, error, far = None, None, spec.error, 0
    if error is None:
        try:
            pattern = _documents.pattern(key, spec.pattern, documents)
            check_layout(spec.layout)
            shape = check_qkv(q, k, v)
            far = far_bytes(q.device.type)
            pattern.check_heads(shape.heads)
            scale = resolve_scale(spec.scale, shape.head_dim)
            if n is None:
                if world > 1:
                    comm_device(group, q.device)  # raises for unsupported transports
                message = ring_message(q, shape.kv_heads, pattern, scale=scale,
                                       layout=spec.layout, needs_grad=needs_grad,
                                       far_bytes=far)  # fmt: skip
        except Exception as exc:  # every rank must hear of it: reported in the handshake
            error = exc
    if n is None:
        if world > 1:
            n = ring_handshake(group, world, message, pattern, spec.layout, spec.fold)
        else:
            n = q.shape[1] if error is None else -1
    if error is not None:
        raise error
    pattern.check_length(n)
    plan = get_plan(pattern, n, shape.heads, shape.kv_heads, world, rank, spec.layout, spec.fold)
    return _RingCall(
        plan=plan,
        group=group,
        peers=global_ranks(group, world),
        op_args=op_args(pattern, scale, None, q.device),
        far_bytes=far,
    )


@torch.library.custom_op("ring_attention::ring_forward", mutates_args=())
def _ring_forward_op(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, spec: str, needs_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's ``(out, lse, global length)`` of the ring call ``spec``."""
    call = _call_of(spec, q, k, v, documents, needs_grad)
    last_exchange_stats.reset()
    out, lse = _ring_forward(call, q, k, v)
    return out, lse, torch.tensor(call.plan.seq_len, dtype=torch.int64)


@_ring_forward_op.register_fake
def _(q, k, v, documents, spec, needs_grad):
    B, L, H, _ = q.shape
    lse = q.new_empty((B, H, L), dtype=acc_dtype(q.dtype))
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        lse,
        q.new_empty((), dtype=torch.int64, device="cpu"),
    )


@torch.library.custom_op("ring_attention::ring_backward", mutates_args=())
def _ring_backward_op(
    grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, documents: Tensor | None, seq_len: Tensor, spec: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """This rank's ``(dq, dk, dv)`` of the ring call ``spec`` (its plan is
    the forward's, from the plan cache)."""
    if not isinstance(seq_len, Tensor) or seq_len.dim() != 0 or seq_len.is_floating_point():
        raise ValueError(f"seq_len must be a 0-d integer tensor (the forward's), got {seq_len!r}")
    call = _call_of(spec, q, k, v, documents, True, int(seq_len))
    B, L, H, _ = q.shape
    for name, t, shape in (("grad_out", grad_out, q.shape), ("out", out, q.shape),
                           ("lse", lse, (B, H, L)), ("grad_lse", grad_lse, (B, H, L))):  # fmt: skip
        if (t is not None or name != "grad_lse") and (
            not isinstance(t, Tensor) or tuple(t.shape) != tuple(shape)
        ):
            got = tuple(t.shape) if isinstance(t, Tensor) else t
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {got!r}")
    return _ring_backward(call, grad_out, grad_lse, q, k, v, out, lse)


@_ring_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, documents, seq_len, spec):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


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
    out, lse = RingFunction.apply(q_local, k_local, v_local, documents, spec, needs_grad)
    # checked after the call: ring_dilated_attention's spec reports a bad flag
    # in the handshake (every rank raises); here every rank has finished the ring
    return (out, lse) if as_flag(return_lse, "return_lse") else out


# ---------------------------------------------------------------------------
# Public API.


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


def _built(pattern: Pattern | Callable[[], Pattern], return_lse: bool) -> Pattern:
    as_flag(return_lse, "return_lse")
    if callable(pattern) and not isinstance(pattern, Pattern):
        pattern = pattern()
    if not isinstance(pattern, Pattern):
        raise ValueError(f"pattern must be a Pattern or a function returning one, got {pattern!r}")
    return pattern


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
    through the handshake so that every rank raises)."""
    if ulysses_group is not None or mesh is not None:
        from .ulysses import ulysses_attention  # (ulysses.py calls back into the ring)

        return ulysses_attention(
            q_local, k_local, v_local, pattern, scale=scale, group=group,
            ulysses_group=ulysses_group, mesh=mesh, layout=layout, return_lse=return_lse,
        )  # fmt: skip
    return ring_on_pieces(
        q_local, k_local, v_local, pattern, scale=scale, group=group, layout=layout,
        return_lse=return_lse,
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
) -> Tensor | tuple[Tensor, Tensor]:
    """The ring over ``group``, each rank holding its pieces of ``layout``
    (``fold > 1``: the stretch of its Ulysses group, see
    :func:`ring_attention.layout.layout_pieces`)."""
    spec = ring_call_spec(_built, pattern, return_lse, scale=scale, group=group, layout=layout,
                          fold=fold)  # fmt: skip
    return ring_call(q_local, k_local, v_local, spec, return_lse=bool(return_lse))


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
            work, see ``ring_attention.layout``; in the hybrid, zigzag at
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

    if ulysses_group is not None or mesh is not None:
        pattern = functools.partial(
            _pattern_of, segment_lengths, dilation_rates, causal, head_groups, head_offsets,
            window, cu_seqlens, False,
        )  # fmt: skip
        return ring_attention(
            q_local, k_local, v_local, pattern, scale=scale, group=group,
            ulysses_group=ulysses_group, mesh=mesh, layout=layout, return_lse=return_lse,
        )  # fmt: skip
    # The documents travel as a tensor (read once per batch), the rest as the spec.
    documents = cu_seqlens if isinstance(cu_seqlens, Tensor) else None
    spec = ring_call_spec(
        _pattern_of, segment_lengths, dilation_rates, causal, head_groups, head_offsets, window,
        None if documents is not None else cu_seqlens, return_lse, scale=scale, group=group,
        layout=layout,
    )  # fmt: skip
    return ring_call(q_local, k_local, v_local, spec, documents, return_lse=return_lse)


def _pattern_of(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int], causal: bool,
    head_groups: bool, head_offsets: str, window: tuple[int, int] | None,
    cu_seqlens: Sequence[int] | Tensor | None, return_lse: bool,
) -> Pattern:  # fmt: skip
    as_flag(return_lse, "return_lse")
    return Pattern(segment_lengths, dilation_rates, causal=causal, head_groups=head_groups,
                   head_offsets=head_offsets, window=window).with_documents(cu_seqlens)  # fmt: skip
