"""Ring dilated attention: the sequence sharded across the ranks of a process
group, K/V rows exchanged point-to-point along a cached exchange plan.

Forward (per rank, DESIGN.md §4):

1. A handshake: one small all-gather of int64 metadata (local length, batch,
   heads, head_dim, dtype, pattern hash, causal, head_groups, scale, layout,
   grad mode, and an error flag), so ranks that disagree raise ``ValueError``
   on every rank instead of hanging.
2. ``out`` (fp32) and ``lse`` (-inf, fp32) accumulators; the receives/sends of
   the first ring step are posted, then the local block is computed with
   ``torch.ops.ring_attention.block_forward``.
3. For every active step of the plan: wait for the step's K/V rows, post the
   next active step (double buffers: communication of step ``i+1`` overlaps
   the compute of step ``i``), unpack the rows with ``index_copy_`` into a
   shard-sized buffer and merge the block into the accumulators.
4. Cast ``out`` once.

Backward re-exchanges K/V along the same schedule, computes
``block_backward`` into fp32 ``dK/dV`` buffers for the sender's rows and
returns exactly the rows it received to their owner (reverse direction),
which ``index_add_``'s them. Steps run in the global order
``KV(1), KV(2), G(1), KV(3), G(2), ...`` (every rank posts a subsequence of
that order), so NCCL's in-order streams cannot deadlock.

Transports: NCCL for CUDA tensors, gloo for CPU tensors, and CUDA tensors on a
gloo group are staged through host memory.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from .functional import check_head_groups, check_qkv, normalize_pattern, resolve_scale
from .plan import ExchangePlan, Step, get_plan
from .sharding import (
    LAYOUTS,
    Piece,
    all_gather_ints,
    check_layout,
    comm_device,
    dtype_code,
    dtype_name,
    global_rank,
    layout_shard_lengths,
    world_info,
)

__all__ = [
    "ExchangeEvent",
    "ExchangeStats",
    "RingDilatedAttention",
    "exchange_plan",
    "last_exchange_stats",
    "register_exchange_hook",
    "ring_dilated_attention",
]


# ---------------------------------------------------------------------------
# Exchange accounting: every posted batch of P2P operations is reported to the
# registered hooks; the default hook fills ``last_exchange_stats``.


@dataclass(frozen=True)
class ExchangeEvent:
    """One posted batch of point-to-point operations on this rank.

    Attributes:
        phase: ``"forward_kv"``, ``"backward_kv"`` or ``"backward_grad"``.
        distance: the ring distance ``d`` of the step.
        send_to: group rank sent to (``None`` when nothing is sent).
        recv_from: group rank received from (``None`` when nothing is received).
        rows_sent / rows_received: (row, head) pairs, each one ``head_dim``
            vector of K and one of V (or of dK and dV), per batch element.
        bytes_sent / bytes_received: bytes of the buffers actually handed to
            ``torch.distributed``.
    """

    phase: str
    distance: int
    send_to: int | None
    recv_from: int | None
    rows_sent: int
    rows_received: int
    bytes_sent: int
    bytes_received: int


@dataclass
class ExchangeStats:
    """Events of the last ring call on this rank: reset at every forward, the
    backward's events appended."""

    events: list[ExchangeEvent] = field(default_factory=list)

    def reset(self) -> None:
        """Forget every event."""
        self.events.clear()

    def record(self, event: ExchangeEvent) -> None:
        """Append ``event``."""
        self.events.append(event)

    def _select(self, phase: str | None) -> list[ExchangeEvent]:
        return [e for e in self.events if phase is None or e.phase == phase]

    def bytes_sent(self, phase: str | None = None) -> int:
        """Bytes sent, all phases or one."""
        return sum(e.bytes_sent for e in self._select(phase))

    def bytes_received(self, phase: str | None = None) -> int:
        """Bytes received, all phases or one."""
        return sum(e.bytes_received for e in self._select(phase))

    def rows_sent(self, phase: str | None = None) -> int:
        """(row, head) pairs sent, all phases or one."""
        return sum(e.rows_sent for e in self._select(phase))

    def rows_received(self, phase: str | None = None) -> int:
        """(row, head) pairs received, all phases or one."""
        return sum(e.rows_received for e in self._select(phase))

    def per_step(self, phase: str = "forward_kv") -> list[dict[str, object]]:
        """The events of one phase as dicts (for printing)."""
        return [e.__dict__.copy() for e in self._select(phase)]


#: Exchange counters of the last call on this rank (mutated in place).
last_exchange_stats = ExchangeStats()

ExchangeHook = Callable[[ExchangeEvent], None]
_hooks: dict[int, ExchangeHook] = {}
_next_hook_id = 0


class _HookHandle:
    """Returned by :func:`register_exchange_hook`; ``remove()`` unregisters."""

    def __init__(self, hook_id: int) -> None:
        self.id = hook_id

    def remove(self) -> None:
        _hooks.pop(self.id, None)

    def __enter__(self) -> _HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register_exchange_hook(hook: ExchangeHook) -> _HookHandle:
    """Call ``hook(event)`` for every batch of P2P operations this process posts.

    Returns a handle whose ``remove()`` unregisters the hook (also usable as a
    context manager). Hooks observe real communication; they must not
    communicate themselves.
    """
    global _next_hook_id
    _next_hook_id += 1
    _hooks[_next_hook_id] = hook
    return _HookHandle(_next_hook_id)


def _emit(event: ExchangeEvent) -> None:
    last_exchange_stats.record(event)
    for hook in list(_hooks.values()):
        hook(event)


# ---------------------------------------------------------------------------
# Configuration shared by the forward and the backward.


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


def _split(t: torch.Tensor, pieces: Sequence[Piece], dim: int = 1) -> list[torch.Tensor]:
    """Contiguous per-piece tensors along ``dim`` (no copy for one piece of a
    contiguous tensor)."""
    if len(pieces) == 1 and pieces[0].length == t.shape[dim]:
        return [t.contiguous()]
    return [t.narrow(dim, p.offset, p.length).contiguous() for p in pieces]


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_PHASE_TAG = {"forward_kv": 0, "backward_kv": 1, "backward_grad": 2}


class _Pending:
    """Posted P2P operations of one step; ``wait()`` returns the received
    buffer (on the compute device) or ``None``."""

    def __init__(
        self, works: list, keep: list[torch.Tensor], recv: torch.Tensor | None, device: torch.device
    ) -> None:
        self.works = works
        self.keep = keep
        self.recv = recv
        self.device = device

    def wait(self) -> torch.Tensor | None:
        for w in self.works:
            w.wait()
        self.works = []
        self.keep = []
        if self.recv is None:
            return None
        if self.recv.device != self.device:  # staged through host memory
            return self.recv.to(self.device)
        return self.recv


class _Exchanger:
    """Packs, posts and unpacks the rows of one ring call, with two send and
    two receive buffers per kind (K/V in the input dtype, dK/dV in fp32)."""

    def __init__(
        self, cfg: _RingConfig, device: torch.device, dtype: torch.dtype, batch: int, head_dim: int
    ) -> None:
        self.cfg = cfg
        self.plan = cfg.plan
        self.device = device
        self.dtype = dtype
        self.acc = _acc_dtype(dtype)
        self.B = batch
        self.D = head_dim
        self.H = cfg.plan.heads
        self.comm_dev = comm_device(cfg.group, device)
        self.idx = cfg.plan.indices_on(device)
        self.slot_of = {s.distance: i for i, s in enumerate(cfg.plan.steps)}
        max_send = max((s.send_rows for s in cfg.plan.steps), default=0)
        max_recv = max((s.recv_rows for s in cfg.plan.steps), default=0)
        self.max_send = 2 * batch * head_dim * max_send
        self.max_recv = 2 * batch * head_dim * max_recv
        self._bufs: dict[tuple[str, int], torch.Tensor] = {}

    # -- buffers -----------------------------------------------------------
    def _buf(
        self, kind: str, slot: int, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        key = (kind, slot)
        buf = self._bufs.get(key)
        if buf is None:
            size = self.max_send if kind.startswith("send") else self.max_recv
            if kind.endswith("grad"):  # grads flow in the reverse direction
                size = self.max_recv if kind.startswith("send") else self.max_send
            buf = torch.empty(size, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:numel]

    def shard_buffer(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """A zero-initialised flat buffer holding one (the longest) shard."""
        key = (kind, -1)
        buf = self._bufs.get(key)
        if buf is None:
            n = self.B * self.plan.max_local_len * self.H * self.D
            buf = torch.zeros(n, dtype=dtype, device=self.device)
            self._bufs[key] = buf
        return buf

    def piece_views(self, flat: torch.Tensor, pieces: Sequence[Piece]) -> list[torch.Tensor]:
        """Contiguous ``(B, length, H, D)`` views of ``flat``, one per piece."""
        views, off = [], 0
        for p in pieces:
            n = self.B * p.length * self.H * self.D
            views.append(flat[off : off + n].view(self.B, p.length, self.H, self.D))
            off += n
        return views

    # -- packing -----------------------------------------------------------
    def _pack(
        self,
        out: torch.Tensor,
        sources: Sequence[tuple[torch.Tensor, torch.Tensor]],
        idx: Sequence[torch.Tensor],
    ) -> None:
        """Layout per piece: K rows ``(B, c, D)`` then V rows ``(B, c, D)``."""
        B, H, D = self.B, self.H, self.D
        off = 0
        for (kt, vt), ix in zip(sources, idx, strict=True):
            c = ix.numel()
            if c == 0:
                continue
            n = B * c * D
            L = kt.shape[1]
            torch.index_select(kt.view(B, L * H, D), 1, ix, out=out[off : off + n].view(B, c, D))
            off += n
            torch.index_select(vt.view(B, L * H, D), 1, ix, out=out[off : off + n].view(B, c, D))
            off += n

    def _unpack(
        self,
        packed: torch.Tensor,
        targets: Sequence[tuple[torch.Tensor, torch.Tensor]],
        idx: Sequence[torch.Tensor],
        add: bool,
    ) -> None:
        B, H, D = self.B, self.H, self.D
        off = 0
        for (kt, vt), ix in zip(targets, idx, strict=True):
            c = ix.numel()
            if c == 0:
                continue
            n = B * c * D
            L = kt.shape[1]
            krows = packed[off : off + n].view(B, c, D)
            vrows = packed[off + n : off + 2 * n].view(B, c, D)
            off += 2 * n
            if add:
                kt.view(B, L * H, D).index_add_(1, ix, krows.to(kt.dtype))
                vt.view(B, L * H, D).index_add_(1, ix, vrows.to(vt.dtype))
            else:
                kt.view(B, L * H, D).index_copy_(1, ix, krows)
                vt.view(B, L * H, D).index_copy_(1, ix, vrows)

    # -- posting -----------------------------------------------------------
    def _post(
        self,
        phase: str,
        step: Step,
        send_to: int | None,
        send: torch.Tensor | None,
        recv_from: int | None,
        recv: torch.Tensor | None,
        rows_sent: int,
        rows_recv: int,
    ) -> _Pending:
        group = self.cfg.group
        tag = 3 * step.distance + _PHASE_TAG[phase]
        ops, keep = [], []
        if send is not None and send.numel() > 0:
            if send.device != self.comm_dev:
                send = send.to(self.comm_dev)
            keep.append(send)
            ops.append(dist.P2POp(dist.isend, send, self.cfg.peers[send_to], group, tag))
        else:
            send = None
        if recv is not None and recv.numel() > 0:
            keep.append(recv)
            ops.append(dist.P2POp(dist.irecv, recv, self.cfg.peers[recv_from], group, tag))
        else:
            recv = None
        works = dist.batch_isend_irecv(ops) if ops else []
        _emit(
            ExchangeEvent(
                phase=phase,
                distance=step.distance,
                send_to=send_to if send is not None else None,
                recv_from=recv_from if recv is not None else None,
                rows_sent=rows_sent if send is not None else 0,
                rows_received=rows_recv if recv is not None else 0,
                bytes_sent=send.numel() * send.element_size() if send is not None else 0,
                bytes_received=recv.numel() * recv.element_size() if recv is not None else 0,
            )
        )
        return _Pending(works or [], keep, recv, self.device)

    def post_kv(
        self,
        phase: str,
        step: Step,
        slot: int,
        ks: Sequence[torch.Tensor],
        vs: Sequence[torch.Tensor],
    ) -> _Pending:
        """Send this rank's K/V rows ``step.send_to`` needs; receive the
        sender's rows this rank needs."""
        send_idx, _ = self.idx[self.slot_of[step.distance]]
        send = recv = None
        if step.send_to is not None:
            send = self._buf(
                "send_kv", slot, 2 * self.B * self.D * step.send_rows, self.dtype, self.device
            )
            self._pack(send, list(zip(ks, vs, strict=True)), send_idx)
        if step.recv_from is not None:
            recv = self._buf(
                "recv_kv", slot, 2 * self.B * self.D * step.recv_rows, self.dtype, self.comm_dev
            )
        return self._post(
            phase, step, step.send_to, send, step.recv_from, recv, step.send_rows, step.recv_rows
        )

    def unpack_kv(
        self, packed: torch.Tensor, step: Step
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Scatter received K/V rows into per-piece views of shard buffers."""
        _, recv_idx = self.idx[self.slot_of[step.distance]]
        kp = self.piece_views(self.shard_buffer("k", self.dtype), step.recv_pieces)
        vp = self.piece_views(self.shard_buffer("v", self.dtype), step.recv_pieces)
        self._unpack(packed, list(zip(kp, vp, strict=True)), recv_idx, add=False)
        return kp, vp

    def grad_views(self, step: Step) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """fp32 dK/dV views for the sender's pieces, zeroed on the rows that
        will be packed."""
        _, recv_idx = self.idx[self.slot_of[step.distance]]
        dkp = self.piece_views(self.shard_buffer("dk", self.acc), step.recv_pieces)
        dvp = self.piece_views(self.shard_buffer("dv", self.acc), step.recv_pieces)
        B, H, D = self.B, self.H, self.D
        for dk, dv, ix in zip(dkp, dvp, recv_idx, strict=True):
            if ix.numel():
                L = dk.shape[1]
                dk.view(B, L * H, D).index_fill_(1, ix, 0)
                dv.view(B, L * H, D).index_fill_(1, ix, 0)
        return dkp, dvp

    def post_grad(
        self, step: Step, slot: int, dkp: list[torch.Tensor] | None, dvp: list[torch.Tensor] | None
    ) -> _Pending:
        """Return the dK/dV of the rows received at ``step`` to their owner and
        receive this rank's own rows' dK/dV from the rank it sent them to."""
        _, recv_idx = self.idx[self.slot_of[step.distance]]
        send = recv = None
        if step.recv_from is not None and dkp is not None:
            send = self._buf(
                "send_grad", slot, 2 * self.B * self.D * step.recv_rows, self.acc, self.device
            )
            self._pack(send, list(zip(dkp, dvp, strict=True)), recv_idx)
        if step.send_to is not None:
            recv = self._buf(
                "recv_grad", slot, 2 * self.B * self.D * step.send_rows, self.acc, self.comm_dev
            )
        return self._post(
            "backward_grad",
            step,
            step.recv_from,
            send,
            step.send_to,
            recv,
            step.recv_rows,
            step.send_rows,
        )

    def finish_grad(
        self, pending: _Pending, step: Step, dks: list[torch.Tensor], dvs: list[torch.Tensor]
    ) -> None:
        """Wait for returned dK/dV rows and add them into this rank's grads."""
        packed = pending.wait()
        if packed is None:
            return
        send_idx, _ = self.idx[self.slot_of[step.distance]]
        self._unpack(packed, list(zip(dks, dvs, strict=True)), send_idx, add=True)


# ---------------------------------------------------------------------------
# Forward and backward.


Tensor = torch.Tensor


def _block_forward(
    cfg: _RingConfig, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    q_start: int, k_start: int,
) -> None:  # fmt: skip
    """Merge the block (queries at ``q_start``, keys at ``k_start``) into ``out``/``lse``."""
    torch.ops.ring_attention.block_forward(
        q, k, v, out, lse, int(q_start), int(k_start), cfg.segs, cfg.dils,
        cfg.causal, cfg.scale, cfg.head_groups, None,
    )  # fmt: skip


def _block_backward(
    cfg: _RingConfig, go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    dq: Tensor, dk: Tensor, dv: Tensor, q_start: int, k_start: int,
) -> None:  # fmt: skip
    """Accumulate the block's gradient into ``dq``/``dk``/``dv``."""
    torch.ops.ring_attention.block_backward(
        go, q, k, v, out, lse, dq, dk, dv, int(q_start), int(k_start), cfg.segs, cfg.dils,
        cfg.causal, cfg.scale, cfg.head_groups, None,
    )  # fmt: skip


def _ring_forward(
    cfg: _RingConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    plan = cfg.plan
    B, _, H, D = q.shape
    acc = _acc_dtype(q.dtype)
    pieces = plan.pieces
    qs, ks, vs = _split(q, pieces), _split(k, pieces), _split(v, pieces)
    outs = [torch.zeros(B, p.length, H, D, dtype=acc, device=q.device) for p in pieces]
    lses = [torch.full((B, H, p.length), -math.inf, dtype=acc, device=q.device) for p in pieces]

    steps = plan.steps
    ex = _Exchanger(cfg, q.device, q.dtype, B, D) if steps else None
    pending = ex.post_kv("forward_kv", steps[0], 0, ks, vs) if steps else None

    for qi, ki in plan.local_pairs:  # overlaps the first exchange
        _block_forward(
            cfg, qs[qi], ks[ki], vs[ki], outs[qi], lses[qi], pieces[qi].start, pieces[ki].start
        )

    for i, step in enumerate(steps):
        packed = pending.wait()
        if i + 1 < len(steps):  # prefetch the next active step into the other buffer
            pending = ex.post_kv("forward_kv", steps[i + 1], (i + 1) % 2, ks, vs)
        if packed is None:
            continue
        kp, vp = ex.unpack_kv(packed, step)
        for qi, kj in step.pairs:
            _block_forward(
                cfg,
                qs[qi],
                kp[kj],
                vp[kj],
                outs[qi],
                lses[qi],
                pieces[qi].start,
                step.recv_pieces[kj].start,
            )

    out = _cat([o.to(q.dtype) for o in outs], dim=1)
    lse = _cat(lses, dim=2)
    return out, lse


def _ring_backward(
    cfg: _RingConfig,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = cfg.plan
    B, _, H, D = q.shape
    acc = _acc_dtype(q.dtype)
    pieces = plan.pieces
    go = grad_out.to(q.dtype)
    gos, outs = _split(go, pieces), _split(out, pieces)
    lses = _split(lse, pieces, dim=2)
    qs, ks, vs = _split(q, pieces), _split(k, pieces), _split(v, pieces)
    dqs = [torch.zeros(B, p.length, H, D, dtype=acc, device=q.device) for p in pieces]
    dks = [torch.zeros_like(t) for t in dqs]
    dvs = [torch.zeros_like(t) for t in dqs]

    steps = plan.steps
    by_distance = {s.distance: s for s in steps}
    ex = _Exchanger(cfg, q.device, q.dtype, B, D) if steps else None
    first = by_distance.get(1)
    kv_pending = ex.post_kv("backward_kv", first, 1, ks, vs) if first is not None else None

    for qi, ki in plan.local_pairs:  # overlaps the first exchange
        _block_backward(
            cfg, gos[qi], qs[qi], ks[ki], vs[ki], outs[qi], lses[qi], dqs[qi], dks[ki], dvs[ki],
            pieces[qi].start, pieces[ki].start,
        )  # fmt: skip

    # Global order of posts: KV(1), KV(2), G(1), KV(3), G(2), ... ; each rank
    # posts the subsequence it takes part in.
    g_prev: tuple[_Pending, Step] | None = None
    for d in range(1, plan.world_size if steps else 1):
        step = by_distance.get(d)
        packed = kv_pending.wait() if step is not None else None
        nxt = by_distance.get(d + 1)
        kv_pending = (
            ex.post_kv("backward_kv", nxt, (d + 1) % 2, ks, vs) if nxt is not None else None
        )
        g_now = None
        if step is not None:
            dkp = dvp = None
            if packed is not None:
                kp, vp = ex.unpack_kv(packed, step)
                dkp, dvp = ex.grad_views(step)
                for qi, kj in step.pairs:
                    _block_backward(
                        cfg, gos[qi], qs[qi], kp[kj], vp[kj], outs[qi], lses[qi], dqs[qi],
                        dkp[kj], dvp[kj], pieces[qi].start, step.recv_pieces[kj].start,
                    )  # fmt: skip
            g_now = (ex.post_grad(step, d % 2, dkp, dvp), step)
        if g_prev is not None:
            ex.finish_grad(g_prev[0], g_prev[1], dks, dvs)
        g_prev = g_now
    if g_prev is not None:
        ex.finish_grad(g_prev[0], g_prev[1], dks, dvs)

    dq = _cat([t.to(q.dtype) for t in dqs], dim=1)
    dk = _cat([t.to(k.dtype) for t in dks], dim=1)
    dv = _cat([t.to(v.dtype) for t in dvs], dim=1)
    return dq, dk, dv


class _RingDilatedAttentionFn(torch.autograd.Function):
    """Autograd wrapper: forward and backward each run the ring once."""

    @staticmethod
    def forward(
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: _RingConfig
    ) -> torch.Tensor:  # type: ignore[override]
        out, lse = _ring_forward(cfg, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.cfg, grad_out, q, k, v, out, lse)
        return dq, dk, dv, None


# ---------------------------------------------------------------------------
# Handshake.

_MAGIC = 0x52494E47  # "RING"
_FIELDS = (
    "magic", "error", "seq_len_local", "batch", "heads", "head_dim", "dtype",
    "pattern_hash", "n_branches", "causal", "head_groups", "scale", "layout",
    "requires_grad",
)  # fmt: skip


def _pattern_hash(segs: Sequence[int], dils: Sequence[int]) -> int:
    return zlib.crc32(repr((tuple(segs), tuple(dils))).encode())


def _scale_bits(scale: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def _bits_scale(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _handshake(
    group: dist.ProcessGroup | None, world: int, values: dict[str, int] | None, layout: str, pattern
) -> int:
    """All-gather the metadata of every rank and check it agrees.

    ``values`` is ``None`` when this rank's own inputs failed validation (it
    then raises its own error after the handshake). Returns the global length.
    Raises ``ValueError`` on every rank when ranks disagree.
    """
    if values is None:
        row = [_MAGIC, 1] + [-1] * (len(_FIELDS) - 2)
    else:
        row = [values.get(f, 0) for f in _FIELDS]
        row[0], row[1] = _MAGIC, 0
    rows = all_gather_ints(row, group)
    table = {f: [r[i] for r in rows] for i, f in enumerate(_FIELDS)}
    if any(m != _MAGIC for m in table["magic"]):
        raise ValueError(
            "ring_dilated_attention: ranks are out of step (a rank is running a different "
            "collective than the ring handshake)"
        )
    bad = [r for r, e in enumerate(table["error"]) if e]
    if bad:
        if values is None:
            return -1  # the caller raises its own error
        raise ValueError(
            f"ring_dilated_attention: rank(s) {bad} rejected their inputs (see the error "
            "raised there); the ring was not run"
        )

    def differ(name: str) -> bool:
        return len(set(table[name])) > 1

    prefix = "ring_dilated_attention: ranks disagree on "
    if differ("pattern_hash") or differ("n_branches"):
        try:
            patterns = [None] * world
            dist.all_gather_object(patterns, pattern, group=group)
            detail = ", ".join(
                f"rank {r}: segment_lengths={list(p[0])} dilation_rates={list(p[1])}"
                for r, p in enumerate(patterns)
            )
        except Exception:  # pragma: no cover - the message is a courtesy
            detail = f"pattern hashes {table['pattern_hash']}"
        raise ValueError(prefix + f"the pattern (segment_lengths/dilation_rates): {detail}")
    if differ("dtype"):
        raise ValueError(
            prefix + f"the dtype: {[dtype_name(c) for c in table['dtype']]} (rank order)"
        )
    for name, what in (
        ("heads", "the number of heads (q.shape[2])"),
        ("head_dim", "head_dim (q.shape[3])"),
        ("batch", "the batch size (q.shape[0])"),
        ("causal", "causal"),
        ("head_groups", "head_groups"),
        ("layout", "layout"),
        ("requires_grad", "whether a gradient is needed (every rank must run the backward)"),
    ):
        if differ(name):
            vals = table[name]
            if name in ("causal", "head_groups", "requires_grad"):
                vals = [bool(x) for x in vals]
            if name == "layout":
                vals = [LAYOUTS[x] if 0 <= x < len(LAYOUTS) else x for x in vals]
            raise ValueError(prefix + f"{what}: {vals} (rank order)")
    if differ("scale"):
        raise ValueError(prefix + f"scale: {[_bits_scale(b) for b in table['scale']]} (rank order)")
    lengths = table["seq_len_local"]
    n = sum(lengths)
    expected = layout_shard_lengths(n, world, layout)
    if lengths != expected:
        raise ValueError(
            f"ring_dilated_attention: the local sequence lengths {lengths} (rank order, global "
            f"length {n}) do not follow the layout={layout!r} sharding convention, which expects "
            f"{expected} (torch.tensor_split); shard inputs with ring_attention.shard_sequence"
        )
    return n


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
        B, L, H, D = q_local.shape
        check_head_groups(H, len(segs), head_groups)
        scale = resolve_scale(scale, D)
        if world > 1:
            comm_device(group, q_local.device)  # raises for unsupported transports
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (q_local, k_local, v_local)
        )
        values = {
            "seq_len_local": L,
            "batch": B,
            "heads": H,
            "head_dim": D,
            "dtype": dtype_code(q_local.dtype),
            "pattern_hash": _pattern_hash(segs, dils),
            "n_branches": len(segs),
            "causal": int(bool(causal)),
            "head_groups": int(bool(head_groups)),
            "scale": _scale_bits(scale),
            "layout": LAYOUTS.index(layout),
            "requires_grad": int(needs_grad),
        }
    except (ValueError, TypeError) as exc:
        error = exc

    if world > 1:
        n = _handshake(
            group, world, values, layout if error is None else "contiguous", (segs, dils)
        )
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
