"""The ring's schedule (docs/design.md §4.3, §4.4): one ring call's forward
and backward on this rank, given its plan (:mod:`ring_attention.parallel.exchange_plan`), its
transport (:mod:`ring_attention.parallel.transport`) and the block operators
(:mod:`ring_attention.local.ops`). The operators that run it are
:mod:`ring_attention.parallel.ring_ops`; the public API :mod:`ring_attention.parallel.ring`.

Forward, per rank (after the handshake of :mod:`ring_attention.parallel.ring_ops`):

1. ``out`` (fp32) and ``lse`` (-inf, fp32) accumulators; the exchange of the
   first active step is posted, then the local blocks are computed with
   the block operator (:func:`ring_attention.local.ops.block_forward`) while it
   travels.
2. For every active step of the plan: wait for the step's K/V rows, post the
   next active step into the other buffers (communication of step ``i+1``
   overlaps the compute of step ``i``), read the rows in place (a sender
   piece's needed rows directly where they are a whole range, e.g. the whole
   piece; else through a row map: ring_attention/parallel/transport.py) and merge the
   blocks into the
   accumulators. For plain dense attention each block may instead be one
   dense backend call, and where every segment lies inside one piece each
   piece's block the local op's per-branch path
   (ring_attention/local/blocks.py), where
   ``RING_ATTENTION_FORWARD``/``RING_ATTENTION_BACKWARD`` and the dispatch
   table say (ring_attention/local/dispatch.py's ``route_blocks``).
3. Cast ``out`` once; ``lse`` stays fp32 and is differentiable.

Backward re-exchanges K/V along the same schedule, computes
``block_backward`` (the gradient of ``lse`` entering its ``delta``) into the
fp32 dK/dV return buffer of the sender's rows and returns
exactly the rows it received to their owner (reverse direction), which adds
them into its own gradients. Steps run in the global order
``KV(1), KV(2), G(1), KV(3), G(2), ...`` (every rank posts a subsequence of
that order), so NCCL's in-order streams cannot deadlock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.call import Call
from ..core.dtypes import acc_dtype
from ..core.layout import Piece
from ..local import engine
from ..local.blocks import Blocks
from .exchange_plan import ExchangePlan
from .transport import Exchanger

__all__ = ["RingCall", "schedule_backward", "schedule_forward"]

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class RingCall:
    """One ring call: its plan, group and checked attention call (what the
    schedules :func:`schedule_forward` and :func:`schedule_backward` run with)."""

    plan: ExchangePlan
    group: dist.ProcessGroup | None
    peers: tuple[int, ...]  # global rank of every group rank
    call: Call  # what every block attends with (the one engine's call)
    far_bytes: int = 0  # transfers of at most this many K/V bytes: the far group

    def blocks(self, pass_: str, q: Tensor, k: Tensor) -> Blocks:
        """The blocks of ``pass_`` (``"forward"``/``"backward"``): the block
        kernel, or a dense backend where the dispatch's route is dense."""
        plan = self.plan
        every = [p for pieces in plan.all_pieces for p in pieces]
        rows = math.gcd(*(p.length for p in every))
        bounds = tuple(sorted({b for p in every for b in (p.start, p.start + p.length)}))
        return engine.blocks(self.call, pass_, q, k, plan.seq_len, bounds, rows or 1)

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


def schedule_forward(call: RingCall, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    plan, pieces = call.plan, call.plan.pieces
    qs, ks, vs = _split(q, pieces), _split(k, pieces), _split(v, pieces)
    B, _, H, _ = q.shape
    acc = acc_dtype(q.dtype)
    outs = _zeros(q, pieces, acc)
    lses = [torch.full((B, H, p.length), -math.inf, dtype=acc, device=q.device) for p in pieces]

    blocks = call.blocks("forward", q, k)

    def attend(qi: int, k_j: Tensor, v_j: Tensor, k_start: int, rows: Tensor | None = None) -> None:
        blocks.forward(qs[qi], k_j, v_j, outs[qi], lses[qi], pieces[qi].start, k_start, rows)

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


def schedule_backward(
    call: RingCall,
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

    blocks = call.blocks("backward", q, k)

    def attend(
        qi: int, k_j: Tensor, v_j: Tensor, dk_j: Tensor, dv_j: Tensor, k_start: int,
        rows: Tensor | None = None,
    ) -> None:  # fmt: skip
        blocks.backward(
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
