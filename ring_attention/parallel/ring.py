"""The ring (docs/design.md §4): the custom operators ``ring_forward`` /
``ring_backward``, taking the tensors and a :mod:`ring_spec` key."""

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.cache import PerBatch
from ..core.call import Call
from ..core.checks import check_qkv, check_sinks_meta, resolve_scale, sinks_meta
from ..core.config import backward_heads, far_bytes
from ..core.dtypes import acc_dtype
from ..core.geometry import head_groups
from ..core.layout import Piece, resolve_layout
from ..core.pattern import Pattern, as_flag
from ..local import engine
from ..local.blocks import Blocks, ring_blocks
from .comm import comm_device, global_ranks
from .exchange import (
    ExchangeEvent,
    Exchanger,
    ExchangeStats,
    last_exchange_stats,
    register_exchange_hook,
)
from .exchange_plan import ExchangePlan, get_plan
from .handshake import reject, ring_handshake, ring_message
from .kv_check import PassCheck, pass_check
from .mesh import check_ring, group_order, report_grid_error, world_info
from .ring_spec import GroupError, get_spec, pattern_of_call, ring_call_spec

__all__ = ["ExchangeEvent", "ExchangeStats", "exchange_plan", "last_exchange_stats",
           "register_exchange_hook", "ring_call", "ring_call_spec"]  # fmt: skip

Tensor = torch.Tensor


def ring_call(q_local: Tensor, k_local: Tensor, v_local: Tensor, spec: str,
              documents: Tensor | None = None, *,
              return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """The ring call registered as ``spec`` (:func:`ring_call_spec`), with the
    global document boundaries ``documents``; one operator each way."""
    needs_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False)
                                                 for t in (q_local, k_local, v_local))  # fmt: skip
    if isinstance(documents, Tensor) and documents.is_meta and not q_local.is_meta:
        # (a meta input would send the operator to its fake kernel: nothing checked)
        raise ValueError("cu_seqlens must hold values: got a tensor on the meta device")
    out, lse = engine.ring(q_local, k_local, v_local, documents, spec, needs_grad)
    # checked after the call: ring_dilated_attention's spec reports a bad flag
    # in the handshake (every rank raises); here every rank has finished the ring
    return (out, lse) if as_flag(return_lse, "return_lse") else out


def exchange_plan(seq_len: int, heads: int, segment_lengths: Sequence[int],
                  dilation_rates: Sequence[int], *, causal: bool = False, head_groups: bool = False,
                  kv_heads: int | None = None, cu_seqlens: Sequence[int] | Tensor | None = None,
                  head_offsets: str = "modulo", window: tuple[int, int] | None = None,
                  group: dist.ProcessGroup | None = None,
                  layout: str = "contiguous") -> ExchangePlan:  # fmt: skip
    """This rank's (cached) exchange plan for a global sequence of ``seq_len``, without running."""
    pattern = Pattern(segment_lengths, dilation_rates, causal=causal, head_groups=head_groups,
                      head_offsets=head_offsets,
                      window=window).with_documents(cu_seqlens)  # fmt: skip
    layout = resolve_layout(layout, pattern)
    world, rank = world_info(group)
    return get_plan(pattern, seq_len, heads, heads if kv_heads is None else kv_heads, world, rank,
                    layout)  # fmt: skip


def sharded_ring(q_local: Tensor, k_local: Tensor, v_local: Tensor,
                 build: Callable[..., Pattern], args: tuple, *,
                 cu_seqlens: Sequence[int] | Tensor | None, scale: float | None,
                 group: dist.ProcessGroup | None, layout: str, return_lse: bool, fold: int = 1,
                 ranks: tuple[int, ...] | None = None,
                 head_range: tuple[int, int, int] = (0, 0, 0),
                 sinks: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """The ring call of ``sharded_attention`` (or of a checked grid's ring)."""
    documents = cu_seqlens if isinstance(cu_seqlens, Tensor) else None
    spec = ring_call_spec(_ring_pattern, return_lse, None if documents is not None else cu_seqlens,
                          build, *args, scale=scale, group=group, layout=layout, fold=fold,
                          ranks=ranks, head_range=head_range, sinks=sinks_meta(sinks))  # fmt: skip
    # (a bad return_lse or sinks is reported by the spec: the operator raises on every rank)
    if sinks is None:
        return ring_call(q_local, k_local, v_local, spec, documents, return_lse=bool(return_lse))
    out, lse = ring_call(q_local, k_local, v_local, spec, documents, return_lse=True)
    out, lse = engine.fold_sinks(out, lse, sinks)
    return (out, lse) if bool(return_lse) else out


def _ring_pattern(return_lse: bool, documents: Sequence[int] | None, build: Callable[..., Pattern],
                  *args) -> Pattern:  # fmt: skip
    """The pattern of a ring call; a bad ``return_lse`` raises here."""
    as_flag(return_lse, "return_lse")
    return pattern_of_call(documents, build, *args)


@dataclass(frozen=True, eq=False)
class RingCall:
    """One ring call: its plan, group, peers and checked attention call."""

    plan: ExchangePlan
    group: dist.ProcessGroup | None
    peers: tuple[int, ...]  # global rank of every group rank
    call: Call  # what every block attends with (the one engine's call)
    far_bytes: int = 0  # transfers of at most this many K/V bytes: the far group
    group_heads: int = 0  # query heads per group of the backward (0: every head at once)

    def blocks(self, pass_: str, q: Tensor, ks: list[Tensor], vs: list[Tensor],
               each_block: bool = False) -> tuple[Blocks, PassCheck | None]:  # fmt: skip
        """The blocks of ``pass_`` and the pass's one K/V check (``None``: each dense block checks
        its own, as where ``each_block``); ``ks``, ``vs``: this rank's pieces."""
        every = [p for pieces in self.plan.all_pieces for p in pieces]
        rows = math.gcd(*(p.length for p in every))
        bounds = tuple(sorted({b for p in every for b in (p.start, p.start + p.length)}))
        blocks = ring_blocks(self.call, pass_, q, ks[0], self.plan.seq_len, bounds, rows or 1)
        check = None if each_block else pass_check(self, pass_, blocks, q, ks, vs, bounds)
        blocks.each_block = check is None
        return blocks, check

    def exchanger(self, q: Tensor, role: str) -> Exchanger:
        """The transport of one pass (``role``: ``"forward"``/``"backward"``)."""
        return Exchanger(self.plan, self.group, self.peers, q.device,
                         comm_device(self.group, q.device), q.dtype, q.shape[0], q.shape[3], role,
                         self.far_bytes)  # fmt: skip


def _split(t: Tensor, pieces: Sequence[Piece], dim: int = 1) -> list[Tensor]:
    """Contiguous per-piece tensors along ``dim``."""
    return [t.narrow(dim, p.offset, p.length).contiguous() for p in pieces]


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _zeros(like: Tensor, pieces: Sequence[Piece], dtype: torch.dtype) -> list[Tensor]:
    B, _, H, D = like.shape
    return [torch.zeros(B, p.length, H, D, dtype=dtype, device=like.device) for p in pieces]


def schedule_forward(call: RingCall, q: Tensor, k: Tensor, v: Tensor,
                     each_block: bool = False) -> tuple[Tensor, Tensor]:  # fmt: skip
    plan, pieces = call.plan, call.plan.pieces
    qs, ks, vs = _split(q, pieces), _split(k, pieces), _split(v, pieces)
    B, _, H, _ = q.shape
    acc = acc_dtype(q.dtype)
    outs = _zeros(q, pieces, acc)
    lses = [torch.full((B, H, p.length), -math.inf, dtype=acc, device=q.device) for p in pieces]

    blocks, check = call.blocks("forward", q, ks, vs, each_block)

    def attend(pairs, kp: list[Tensor], vp: list[Tensor], starts, maps=None) -> None:
        """The blocks ``(query piece, key index)`` of ``pairs``, keys at ``starts`` (or packed)."""
        for qi, kj in pairs:
            rows = None if maps is None else maps[kj]
            blocks.forward(
                qs[qi], kp[kj], vp[kj], outs[qi], lses[qi], pieces[qi].start, starts[kj], rows
            )

    ex = call.exchanger(q, "forward") if plan.steps else None
    steps = ex.steps if ex is not None else ()
    far = ex.post("forward_kv", ex.far_steps, 0, ks, vs) if ex is not None else None  # first
    pending = ex.post("forward_kv", (steps[0],), 0, ks, vs) if steps else None
    attend(plan.local_pairs, ks, vs, [p.start for p in pieces])  # overlaps the first exchange
    if far is not None:  # the far group's blocks, while the first ring step travels
        for step, packed in ex.far_received(far.wait()):
            attend(step.pairs, *ex.unpack_kv(packed, step))

    for i, step in enumerate(steps):
        packed = pending.wait()
        if i + 1 < len(steps):  # prefetch the next active step into the other buffers
            pending = ex.post("forward_kv", (steps[i + 1],), (i + 1) % 2, ks, vs)
        if packed is not None:
            attend(step.pairs, *ex.unpack_kv(packed, step))

    if check is not None and not check.finite():  # a non-finite K/V: each block checks its own
        return schedule_forward(call, q, k, v, each_block=True)
    return _cat([o.to(q.dtype) for o in outs], dim=1), _cat(lses, dim=2)


def schedule_backward(call: RingCall, grad_out: Tensor, grad_lse: Tensor | None, q: Tensor,
                      k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      after_local: Callable[[], None] | None = None, defer: bool = False,
                      each_block: bool = False):  # fmt: skip
    """``(dq, dk, dv)``; ``after_local`` runs once the local blocks are computed; ``defer``: while
    the far dK/dV return travels, a function that finishes it and gives them instead (a head
    group's); ``each_block``: each dense block checks its own K/V (the pass's rerun)."""
    plan, pieces = call.plan, call.plan.pieces
    qs, ks, vs, outs, gos = (_split(t, pieces) for t in (q, k, v, out, grad_out.to(q.dtype)))
    lses = _split(lse, pieces, dim=2)
    glses = [None] * len(pieces) if grad_lse is None else _split(grad_lse.to(lse.dtype), pieces, 2)
    acc = acc_dtype(q.dtype)
    dqs, dks, dvs = _zeros(q, pieces, acc), _zeros(k, pieces, acc), _zeros(k, pieces, acc)

    blocks, check = call.blocks("backward", q, ks, vs, each_block)

    def attend(pairs, dkp: list[Tensor], dvp: list[Tensor], kp: list[Tensor], vp: list[Tensor],
               starts, maps=None) -> None:  # fmt: skip
        """The blocks of ``pairs``, as the forward's, adding dK/dV into ``dkp``, ``dvp``."""
        for qi, kj in pairs:
            rows = None if maps is None else maps[kj]
            blocks.backward(gos[qi], glses[qi], qs[qi], kp[kj], vp[kj], outs[qi], lses[qi], dqs[qi],
                            dkp[kj], dvp[kj], pieces[qi].start, starts[kj], rows)  # fmt: skip

    ex = call.exchanger(q, "backward") if plan.steps else None
    steps = ex.steps if ex is not None else ()
    far = ex.post("backward_kv", ex.far_steps, 0, ks, vs) if ex is not None else None  # first
    first = ex.step_for(1) if ex is not None else None
    kv_pending = ex.post("backward_kv", (first,), 1, ks, vs) if first is not None else None
    # the local blocks overlap the first exchange
    attend(plan.local_pairs, dks, dvs, ks, vs, [p.start for p in pieces])
    if after_local is not None:
        after_local()
    far_grad = None
    if far is not None:  # the far group's blocks; their dK/dV go back as one batch
        packed = far.wait()
        views = {s.distance: (dkp, dvp) for s, dkp, dvp in ex.grad_views(ex.far_steps, 0)}
        for step, rows in ex.far_received(packed):
            attend(step.pairs, *views[step.distance], *ex.unpack_kv(rows, step))
        far_grad = ex.post("backward_grad", ex.far_steps, 0)

    # Global order of posts: F, KV(1), FG, KV(2), G(1), KV(3), G(2), ... (F, FG: the
    # far group's); each rank posts its subsequence. Buffers alternate by distance.
    g_prev = None  # (transfer, (step,)) of the previous gradient return
    for d in range(1, plan.world_size if steps else 1):
        step = ex.step_for(d)
        packed = kv_pending.wait() if step is not None else None
        nxt = ex.step_for(d + 1)
        kv_pending = ex.post("backward_kv", (nxt,), (d + 1) % 2, ks, vs) if nxt else None
        g_now = None
        if step is not None:
            if packed is not None:
                kv = ex.unpack_kv(packed, step)
                ((_, dkp, dvp),) = ex.grad_views((step,), d % 2)
                attend(step.pairs, dkp, dvp, *kv)
            g_now = (ex.post("backward_grad", (step,), d % 2), (step,))
        if g_prev is not None:
            ex.finish(*g_prev, dks, dvs)
        g_prev = g_now
    if g_prev is not None:
        ex.finish(*g_prev, dks, dvs)
    if check is not None and not check.finite():  # a non-finite K/V: each block checks its own
        if far_grad is not None:  # (the far return completes first, on every rank)
            ex.finish(far_grad, ex.far_steps, dks, dvs)
        return schedule_backward(call, grad_out, grad_lse, q, k, v, out, lse, None, defer, True)

    def finish() -> tuple[Tensor, Tensor, Tensor]:
        if far_grad is not None:
            ex.finish(far_grad, ex.far_steps, dks, dvs)
        return tuple(_cat([t.to(q.dtype) for t in g], dim=1) for g in (dqs, dks, dvs))

    if defer and far_grad is not None:
        ex.release()  # (the far return's transfer holds its own buffers)
        return finish
    return finish()


def backward_by_groups(call: RingCall, *tensors: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`schedule_backward` (``tensors``: its) one group of :attr:`RingCall.group_heads`
    heads at a time, bit-equal to one group (docs/design.md §4.4, by head groups)."""
    plan, per = call.plan, call.group_heads
    if not per:
        return schedule_backward(call, *tensors)
    grad_out, grad_lse, q, k, v, out, lse = tensors
    s, total, total_kv = plan.head_range if plan.head_range[1] else (0, plan.heads, plan.kv_heads)
    grads = [torch.empty(t.shape, dtype=q.dtype, device=q.device) for t in (q, k, v)]
    pending = []  # the previous group's (gradients or their finish, head slices)

    def write() -> None:
        """Finish the previous group and write its gradients."""
        if pending:
            parts, slices = pending.pop()
            for grad, part, sl in zip(grads, parts() if callable(parts) else parts, slices,
                                      strict=True):  # fmt: skip
                grad[:, :, sl] = part

    for h0, h1, g0, g1 in head_groups(plan.heads, total // total_kv, per, s):
        hs, gs, heads = slice(h0, h1), slice(g0, g1), (s + h0, total, total_kv)
        args = (h1 - h0, g1 - g0, plan.world_size, plan.rank, plan.layout, plan.fold, heads)
        far = call.far_bytes * (g1 - g0) // plan.kv_heads  # its share: the same steps go far
        sub = dataclasses.replace(
            call,
            plan=get_plan(plan.pattern, plan.seq_len, *args),
            call=call.call.with_heads(*heads),
            far_bytes=far,
        )
        go, gl = grad_out[:, :, hs], None if grad_lse is None else grad_lse[:, hs]
        qkv = q[:, :, hs], k[:, :, gs], v[:, :, gs]
        parts = schedule_backward(sub, go, gl, *qkv, out[:, :, hs], lse[:, hs], write, True)
        pending.append((parts, (hs, gs, gs)))
        if not callable(parts):  # no far return in flight: written now
            write()
        del parts  # nothing of a group outlives the next one's local blocks
    write()
    return tuple(grads)


_documents = PerBatch("ring documents")  # the spec's pattern with a batch's documents


def _call_of(key: str, q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, needs_grad: bool,
             n: int | None = None) -> RingCall:  # fmt: skip
    """The checked call (``n`` None: the forward, agreeing through the handshake)."""
    spec = get_spec(key)
    group = spec.group
    world, rank = world_info(group)
    order = None
    if spec.ranks is not None and world > 1:  # ring indices: a mesh's coordinates
        order = group_order(group or dist.group.WORLD, spec.ranks)
        rank = spec.ranks.index(dist.get_rank())
    message, pattern, error, far, layout, per = None, None, spec.error, 0, spec.layout, 0
    if error is None:
        try:
            pattern = base = spec.pattern
            if documents is not None:
                pattern = _documents.get(documents, key, lambda: base.with_documents(documents))
            layout = resolve_layout(spec.layout, pattern)
            heads = spec.head_range if spec.head_range[1] else None
            shape = check_qkv(q, k, v, head_range=heads)
            far = far_bytes(q.device.type)
            kv_group = heads[1] // heads[2] if heads else shape.heads // shape.kv_heads
            per = backward_heads(shape.heads, kv_group, q.element_size())
            pattern.check_heads(shape.heads if heads is None else heads[1])
            check_sinks_meta(spec.sinks, shape.heads, q.device)
            scale = resolve_scale(spec.scale, shape.head_dim)
            if n is None:
                if world > 1:
                    comm_device(group, q.device)  # raises for unsupported transports
                message = ring_message(q, shape.kv_heads, pattern, scale=scale, layout=layout,
                                       needs_grad=needs_grad, far_bytes=far,
                                       backward_heads=per)  # fmt: skip
        except Exception as exc:  # every rank must hear of it: reported in the handshake
            error = exc
    if n is None and world > 1:
        if isinstance(error, GroupError):  # which ring? the peers must hear of it
            topo = report_grid_error("not a group", None, None, error, "ring")
            if topo is not None:
                reject(topo.ring_group, "ring_dilated_attention", error, topo.ring_order)
            raise error
        if spec.ranks is None:  # (ranks: a call of the grid's, which checked it)
            check_ring(group)
        n = ring_handshake(group, world, message, pattern, layout, spec.fold, error, order)
    if error is not None:
        raise error
    n = q.shape[1] if n is None else n  # (one process: its own length)
    pattern.check_length(n)
    plan = get_plan(pattern, n, shape.heads, shape.kv_heads, world, rank, layout, spec.fold,
                    spec.head_range)  # fmt: skip
    return RingCall(plan=plan, group=group,
                    peers=spec.ranks if order is not None else global_ranks(group, world),
                    call=Call(pattern, scale).with_heads(*spec.head_range),
                    far_bytes=far, group_heads=per)  # fmt: skip


@torch.library.custom_op("ring_attention::ring_forward", mutates_args=())
def _ring_forward_op(q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, spec: str,
                     needs_grad: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """This rank's ``(out, lse, global length)`` of the ring call ``spec``."""
    call = _call_of(spec, q, k, v, documents, needs_grad)
    last_exchange_stats.reset()
    out, lse = schedule_forward(call, q, k, v)
    return out, lse, torch.tensor(call.plan.seq_len, dtype=torch.int64)


@_ring_forward_op.register_fake
def _(q, k, v, documents, spec, needs_grad):
    B, L, H, _ = q.shape
    lse = q.new_empty((B, H, L), dtype=acc_dtype(q.dtype))
    return (torch.empty_like(q, memory_format=torch.contiguous_format), lse,
            q.new_empty((), dtype=torch.int64, device="cpu"))  # fmt: skip


@torch.library.custom_op("ring_attention::ring_backward", mutates_args=())
def _ring_backward_op(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                      out: Tensor, lse: Tensor, documents: Tensor | None, seq_len: Tensor,
                      spec: str) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """This rank's ``(dq, dk, dv)`` of the ring call ``spec``."""
    if not isinstance(seq_len, Tensor) or seq_len.dim() != 0 or seq_len.is_floating_point():
        raise ValueError(f"seq_len must be a 0-d integer tensor (the forward's), got {seq_len!r}")
    call = _call_of(spec, q, k, v, documents, True, int(seq_len))
    B, L, H, _ = q.shape
    for name, t, shape in (("grad_out", grad_out, q.shape), ("out", out, q.shape),
                           ("lse", lse, (B, H, L)), ("grad_lse", grad_lse, (B, H, L))):  # fmt: skip
        wrong = not isinstance(t, Tensor) or tuple(t.shape) != tuple(shape)
        if wrong and (t is not None or name != "grad_lse"):
            got = tuple(t.shape) if isinstance(t, Tensor) else t
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {got!r}")
    return backward_by_groups(call, grad_out, grad_lse, q, k, v, out, lse)


@_ring_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, documents, seq_len, spec):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
