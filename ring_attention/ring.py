"""Ring dilated attention: the sequence sharded across the ranks of a process
group, K/V rows exchanged point-to-point along a cached exchange plan
(DESIGN.md §4). This module holds the schedule, the autograd function and the
public API; the plan is :mod:`ring_attention.plan`, the transport
:mod:`ring_attention.exchange`, the agreement check
:mod:`ring_attention.handshake`.

Forward, per rank:

1. A handshake: one small all-gather of int64 metadata (local length, batch,
   heads, head_dim, dtype, pattern hash, causal, head_groups, scale, layout,
   grad mode, and an error flag), so ranks that disagree raise ``ValueError``
   on every rank instead of hanging.
2. ``out`` (fp32) and ``lse`` (-inf, fp32) accumulators; the exchange of the
   first active step is posted, then the local blocks are computed with
   ``torch.ops.ring_attention.block_forward`` while it travels.
3. For every active step of the plan: wait for the step's K/V rows, post the
   next active step into the other buffers (communication of step ``i+1``
   overlaps the compute of step ``i``), unpack the rows (used in place when
   a sender piece's needed rows are a whole range, e.g. the whole piece;
   else into a buffer spanning them) and merge the blocks into the
   accumulators.
4. Cast ``out`` once.

Backward re-exchanges K/V along the same schedule, computes
``block_backward`` into fp32 dK/dV buffers for the sender's rows and returns
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
from torch import nn
from torch.autograd.function import once_differentiable

from .exchange import (
    ExchangeEvent,
    Exchanger,
    ExchangeStats,
    acc_dtype,
    last_exchange_stats,
    register_exchange_hook,
)
from .functional import check_head_groups, check_qkv, normalize_pattern, resolve_scale
from .handshake import handshake, ring_metadata
from .plan import ExchangePlan, get_plan
from .sharding import Piece, check_layout, comm_device, global_rank, world_info

__all__ = [
    "ExchangeEvent",
    "ExchangeStats",
    "RingDilatedAttention",
    "exchange_plan",
    "last_exchange_stats",
    "register_exchange_hook",
    "ring_dilated_attention",
]

Tensor = torch.Tensor


# ---------------------------------------------------------------------------
# One ring call: configuration, blocks, schedule.


@dataclass(frozen=True, eq=False)
class _RingConfig:
    plan: ExchangePlan
    group: dist.ProcessGroup | None
    segs: list[int]
    dils: list[int]
    causal: bool
    scale: float
    head_groups: bool
    peers: tuple[int, ...]  # global rank of every group rank

    def block_forward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_start: int,
        k_start: int,
    ) -> None:  # fmt: skip
        """Merge the block (queries at ``q_start``, keys at ``k_start``) into ``out``/``lse``."""
        torch.ops.ring_attention.block_forward(
            q, k, v, out, lse, int(q_start), int(k_start), self.segs, self.dils,
            self.causal, self.scale, self.head_groups, False, None, None,
        )  # fmt: skip

    def block_backward(
        self, go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        dq: Tensor, dk: Tensor, dv: Tensor, q_start: int, k_start: int,
    ) -> None:  # fmt: skip
        """Accumulate the block's gradient into ``dq``/``dk``/``dv``."""
        torch.ops.ring_attention.block_backward(
            go, None, q, k, v, out, lse, dq, dk, dv, int(q_start), int(k_start), self.segs,
            self.dils, self.causal, self.scale, self.head_groups, False, None, None,
        )  # fmt: skip

    def exchanger(self, q: Tensor, role: str) -> Exchanger:
        """The transport of one pass (``role``: ``"forward"``/``"backward"``)."""
        return Exchanger(
            self.plan, self.group, self.peers, q.device, q.dtype, q.shape[0], q.shape[3], role
        )


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


def _ring_forward(cfg: _RingConfig, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    plan, pieces = cfg.plan, cfg.plan.pieces
    qs, ks, vs = _split(q, pieces), _split(k, pieces), _split(v, pieces)
    B, _, H, _ = q.shape
    acc = acc_dtype(q.dtype)
    outs = _zeros(q, pieces, acc)
    lses = [torch.full((B, H, p.length), -math.inf, dtype=acc, device=q.device) for p in pieces]

    def attend(qi: int, k_j: Tensor, v_j: Tensor, k_start: int) -> None:
        cfg.block_forward(qs[qi], k_j, v_j, outs[qi], lses[qi], pieces[qi].start, k_start)

    steps = plan.steps
    ex = cfg.exchanger(q, "forward") if steps else None
    pending = ex.post_kv("forward_kv", steps[0], 0, ks, vs) if steps else None
    for qi, ki in plan.local_pairs:  # overlaps the first exchange
        attend(qi, ks[ki], vs[ki], pieces[ki].start)

    for i, step in enumerate(steps):
        packed = pending.wait()
        if i + 1 < len(steps):  # prefetch the next active step into the other buffers
            pending = ex.post_kv("forward_kv", steps[i + 1], (i + 1) % 2, ks, vs)
        if packed is None:
            continue
        kp, vp, starts = ex.unpack_kv(packed, step)
        for qi, kj in step.pairs:
            attend(qi, kp[kj], vp[kj], starts[kj])

    return _cat([o.to(q.dtype) for o in outs], dim=1), _cat(lses, dim=2)


def _ring_backward(
    cfg: _RingConfig, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    plan, pieces = cfg.plan, cfg.plan.pieces
    qs, ks, vs, outs, gos = (_split(t, pieces) for t in (q, k, v, out, grad_out.to(q.dtype)))
    lses = _split(lse, pieces, dim=2)
    acc = acc_dtype(q.dtype)
    dqs, dks, dvs = _zeros(q, pieces, acc), _zeros(q, pieces, acc), _zeros(q, pieces, acc)

    def attend(qi: int, k_j: Tensor, v_j: Tensor, dk_j: Tensor, dv_j: Tensor, k_start: int) -> None:
        cfg.block_backward(
            gos[qi], qs[qi], k_j, v_j, outs[qi], lses[qi], dqs[qi], dk_j, dv_j, pieces[qi].start,
            k_start,
        )  # fmt: skip

    steps = plan.steps
    ex = cfg.exchanger(q, "backward") if steps else None
    first = plan.step_for(1)
    kv_pending = ex.post_kv("backward_kv", first, 1, ks, vs) if first is not None else None
    for qi, ki in plan.local_pairs:  # overlaps the first exchange
        attend(qi, ks[ki], vs[ki], dks[ki], dvs[ki], pieces[ki].start)

    # Global order of posts: KV(1), KV(2), G(1), KV(3), G(2), ... ; each rank
    # posts the subsequence it takes part in. Buffers alternate by distance.
    g_prev = None  # (transfer, step) of the previous gradient return
    for d in range(1, plan.world_size if steps else 1):
        step = plan.step_for(d)
        packed = kv_pending.wait() if step is not None else None
        nxt = plan.step_for(d + 1)
        kv_pending = (
            ex.post_kv("backward_kv", nxt, (d + 1) % 2, ks, vs) if nxt is not None else None
        )
        g_now = None
        if step is not None:
            dkp = dvp = None
            if packed is not None:
                kp, vp, starts = ex.unpack_kv(packed, step)
                dkp, dvp = ex.grad_views(step, d % 2)
                for qi, kj in step.pairs:
                    attend(qi, kp[kj], vp[kj], dkp[kj], dvp[kj], starts[kj])
            g_now = (ex.post_grad(step, d % 2, dkp, dvp), step)
        if g_prev is not None:
            ex.finish_grad(*g_prev, dks, dvs)
        g_prev = g_now
    if g_prev is not None:
        ex.finish_grad(*g_prev, dks, dvs)

    return tuple(_cat([t.to(q.dtype) for t in g], dim=1) for g in (dqs, dks, dvs))


class _RingDilatedAttentionFn(torch.autograd.Function):
    """Autograd wrapper: forward and backward each run the ring once."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cfg: _RingConfig) -> Tensor:  # type: ignore[override]
        out, lse = _ring_forward(cfg, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        dq, dk, dv = _ring_backward(ctx.cfg, grad_out, *ctx.saved_tensors)
        return dq, dk, dv, None


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
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
) -> ExchangePlan:
    """This rank's (cached) exchange plan for a global sequence of ``seq_len``.

    Useful to report the rows/bytes a rank exchanges per layer
    (:meth:`ExchangePlan.bytes_sent`) without running anything.
    """
    segs, dils = normalize_pattern(segment_lengths, dilation_rates)
    check_layout(layout)
    world, rank = world_info(group)
    return get_plan(world, rank, seq_len, heads, segs, dils, causal, head_groups, layout)


def ring_dilated_attention(
    q_local: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    scale: float | None = None,
    head_groups: bool = False,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
) -> torch.Tensor:
    """Dilated attention over a sequence sharded across the ranks of ``group``.

    Equal, forward and backward, to ``ring_attention.dilated_attention`` on the
    whole sequence, for every world size and global length.

    Args:
        q_local, k_local, v_local: ``(batch, seq_local, heads, head_dim)``, this
            rank's shard (``ring_attention.shard_sequence``): with
            ``layout="contiguous"`` piece ``rank`` of
            ``torch.tensor_split(x, world_size, dim=1)``.
        segment_lengths, dilation_rates: the pattern (DESIGN.md §1).
        causal: keys only at or before the query (global positions).
        scale: score scale, default ``head_dim ** -0.5``.
        head_groups: branch ``i`` applies only to head group ``i``.
        group: the process group, default the default group. With no
            initialised process group (or a group of one) this is the
            single-process computation.
        layout: ``"contiguous"`` (default) or ``"zigzag"`` (balanced causal
            work, see ``ring_attention.sharding``).

    Returns:
        This rank's output shard, shape and dtype of ``q_local``.

    Raises:
        ValueError: bad arguments (before anything is communicated on this
            rank's side: a rank with bad inputs reports it in the handshake,
            so every rank raises), or ranks that disagree on the pattern, the
            global length (shard lengths not following the convention), the
            dtype, the shape, ``causal``, ``head_groups``, ``scale`` or
            ``layout`` — on every rank.

    Every rank must call it with matching arguments, and, when gradients are
    needed, every rank must run the backward.
    """
    world, rank = world_info(group)
    values: dict[str, int] | None = None
    error: Exception | None = None
    segs = dils = ()
    try:
        check_layout(layout)
        check_qkv(q_local, k_local, v_local)
        segs, dils = normalize_pattern(segment_lengths, dilation_rates)
        H, D = q_local.shape[2:]
        check_head_groups(H, len(segs), head_groups)
        scale = resolve_scale(scale, D)
        if world > 1:
            comm_device(group, q_local.device)  # raises for unsupported transports
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (q_local, k_local, v_local)
        )
        values = ring_metadata(
            q_local, segs, dils, causal=causal, head_groups=head_groups, scale=scale,
            layout=layout, needs_grad=needs_grad,
        )  # fmt: skip
    except (ValueError, TypeError) as exc:
        error = exc

    if world > 1:
        n = handshake(group, world, values, layout if error is None else "contiguous", (segs, dils))
    else:
        n = q_local.shape[1] if error is None else -1
    if error is not None:
        raise error

    plan = get_plan(world, rank, n, H, segs, dils, bool(causal), bool(head_groups), layout)
    last_exchange_stats.reset()
    cfg = _RingConfig(
        plan=plan,
        group=group,
        segs=list(segs),
        dils=list(dils),
        causal=bool(causal),
        scale=float(scale),
        head_groups=bool(head_groups),
        peers=tuple(global_rank(group, r) for r in range(world)) if world > 1 else (0,),
    )
    return _RingDilatedAttentionFn.apply(q_local, k_local, v_local, cfg)


class RingDilatedAttention(nn.Module):
    """``nn.Module`` wrapper of :func:`ring_dilated_attention`.

    ``forward(q, k, v)`` takes and returns this rank's
    ``(batch, seq_local, heads, head_dim)`` shards.

    Args:
        segment_lengths, dilation_rates: the pattern.
        causal: causal masking on global positions.
        scale: score scale, default ``head_dim ** -0.5``.
        head_groups: branch ``i`` applies only to head group ``i``.
        group: process group, default the default group.
        layout: ``"contiguous"`` (default) or ``"zigzag"``.
    """

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        causal: bool = False,
        scale: float | None = None,
        head_groups: bool = False,
        group: dist.ProcessGroup | None = None,
        layout: str = "contiguous",
    ) -> None:
        super().__init__()
        segs, dils = normalize_pattern(segment_lengths, dilation_rates)
        check_layout(layout)
        if scale is not None:
            resolve_scale(scale, 1)
        self.segment_lengths = list(segs)
        self.dilation_rates = list(dils)
        self.causal = bool(causal)
        self.scale = scale
        self.head_groups = bool(head_groups)
        self.group = group
        self.layout = layout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend this rank's query shard to the whole (sharded) sequence."""
        return ring_dilated_attention(
            q,
            k,
            v,
            self.segment_lengths,
            self.dilation_rates,
            causal=self.causal,
            scale=self.scale,
            head_groups=self.head_groups,
            group=self.group,
            layout=self.layout,
        )

    def extra_repr(self) -> str:
        return (
            f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, "
            f"causal={self.causal}, scale={self.scale}, head_groups={self.head_groups}, "
            f"layout={self.layout!r}"
        )
