"""The point-to-point transport of the ring (DESIGN.md §4).

:class:`Exchanger` moves the rows an :class:`~ring_attention.plan.ExchangePlan`
names between the ranks of one ring call:

* **K/V rows** (input dtype), ``post_kv``: this rank's rows that
  ``step.send_to`` needs go out, the rows this rank needs from
  ``step.recv_from`` come in;
* **dK/dV rows** (fp32), ``post_grad``: the gradients of the rows received at
  a step go back to their owner (the reverse direction), and the gradients of
  this rank's own rows come home.

Rows travel packed: per piece of the sending rank, the selected
``(batch, rows, head_dim)`` K rows, then as many V rows; a row is one
``(position, head)`` pair, the flat index ``position * heads + head`` of the
plan. Each kind has two send and two receive buffers (``slot`` 0 and 1), so the
communication of one step overlaps the compute of the previous one; a ring
schedule alternates the slots. The received rows are unpacked into shard-sized
buffers (``index_copy_`` for K/V, ``index_add_`` for returned gradients).

Transports: NCCL for CUDA tensors, gloo for CPU tensors; CUDA tensors on a
gloo group are staged through host memory (:func:`~ring_attention.sharding.comm_device`).

Every posted batch of operations is reported as an :class:`ExchangeEvent` to
:data:`last_exchange_stats` and to the hooks of :func:`register_exchange_hook`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .plan import ExchangePlan, Step
from .sharding import Piece, comm_device

__all__ = [
    "ExchangeEvent",
    "ExchangeStats",
    "Exchanger",
    "Transfer",
    "acc_dtype",
    "last_exchange_stats",
    "register_exchange_hook",
]


# ---------------------------------------------------------------------------
# Accounting: every posted batch is reported to the hooks; the default hook
# fills ``last_exchange_stats``.


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
    backward's events appended.

    Attributes:
        events: the posted batches, in order.
        buffer_bytes: bytes of the transport buffers (packed send/receive
            double buffers and shard-sized unpack buffers) allocated per pass,
            ``{"forward": ..., "backward": ...}``; each pass frees its own when
            it returns (host staging copies of CUDA tensors on gloo are not
            counted).
    """

    events: list[ExchangeEvent] = field(default_factory=list)
    buffer_bytes: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget every event and buffer count."""
        self.events.clear()
        self.buffer_bytes.clear()

    def record(self, event: ExchangeEvent) -> None:
        """Append ``event``."""
        self.events.append(event)

    def _total(self, attr: str, phase: str | None) -> int:
        return sum(getattr(e, attr) for e in self.events if phase is None or e.phase == phase)

    def bytes_sent(self, phase: str | None = None) -> int:
        """Bytes sent, all phases or one."""
        return self._total("bytes_sent", phase)

    def bytes_received(self, phase: str | None = None) -> int:
        """Bytes received, all phases or one."""
        return self._total("bytes_received", phase)

    def rows_sent(self, phase: str | None = None) -> int:
        """(row, head) pairs sent, all phases or one."""
        return self._total("rows_sent", phase)

    def rows_received(self, phase: str | None = None) -> int:
        """(row, head) pairs received, all phases or one."""
        return self._total("rows_received", phase)


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
# Transport.


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of ``dtype``: float64 stays, everything else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_PHASE_TAG = {"forward_kv": 0, "backward_kv": 1, "backward_grad": 2}


class Transfer:
    """The posted operations of one step; ``wait()`` returns the received
    buffer (on the compute device) or ``None`` when nothing was received."""

    def __init__(self, works: list, keep: list, recv, device: torch.device) -> None:
        self._works = works
        self._keep = keep  # the buffers must outlive the operations
        self._recv = recv
        self._device = device

    def wait(self) -> torch.Tensor | None:
        for w in self._works:
            w.wait()
        self._works, self._keep = [], []
        if self._recv is None or self._recv.device == self._device:
            return self._recv
        return self._recv.to(self._device)  # staged through host memory


class Exchanger:
    """Packs, posts and unpacks the rows of one ring call.

    Args:
        plan: this rank's exchange plan.
        group: the process group (``None``: the default group).
        peers: the global rank of every group rank.
        device, dtype: of the inputs; K/V travel in ``dtype``, gradients in
            :func:`acc_dtype`.
        batch, head_dim: of the inputs.
        role: the pass (``"forward"``/``"backward"``) its buffers are counted
            under in ``last_exchange_stats.buffer_bytes``.
    """

    def __init__(
        self,
        plan: ExchangePlan,
        group: dist.ProcessGroup | None,
        peers: Sequence[int],
        device: torch.device,
        dtype: torch.dtype,
        batch: int,
        head_dim: int,
        role: str = "forward",
    ) -> None:
        self.plan = plan
        self.role = role
        self.group = group
        self.peers = tuple(peers)
        self.device = device
        self.dtype = dtype
        self.acc = acc_dtype(dtype)
        self.B, self.H, self.D = batch, plan.heads, head_dim
        self.comm_dev = comm_device(group, device)
        self.idx = plan.indices_on(device)
        max_send = max((s.send_rows for s in plan.steps), default=0)
        max_recv = max((s.recv_rows for s in plan.steps), default=0)
        # packed buffer kind -> (capacity in rows, dtype, device); the
        # gradients of the received rows go back, those of the sent rows return
        self._kinds = {
            "send_kv": (max_send, self.dtype, device),
            "recv_kv": (max_recv, self.dtype, self.comm_dev),
            "send_grad": (max_recv, self.acc, device),
            "recv_grad": (max_send, self.acc, self.comm_dev),
        }
        self._bufs: dict[tuple[str, int], torch.Tensor] = {}

    # -- buffers -----------------------------------------------------------
    def _keep(self, key: tuple[str, int], buf: torch.Tensor) -> torch.Tensor:
        self._bufs[key] = buf
        counts = last_exchange_stats.buffer_bytes
        counts[self.role] = counts.get(self.role, 0) + buf.numel() * buf.element_size()
        return buf

    def _packed(self, kind: str, slot: int, rows: int) -> torch.Tensor:
        """A packed buffer of ``rows`` K and V rows: a view of the ``(kind,
        slot)`` buffer, allocated once for the largest step."""
        buf = self._bufs.get((kind, slot))
        if buf is None:
            capacity, dtype, device = self._kinds[kind]
            buf = torch.empty(2 * self.B * capacity * self.D, dtype=dtype, device=device)
            buf = self._keep((kind, slot), buf)
        return buf[: 2 * self.B * rows * self.D]

    def _shard_views(self, kind: str, dtype: torch.dtype, pieces: Sequence[Piece]):
        """Contiguous ``(B, length, H, D)`` views, one per piece, of a zeroed
        buffer that holds the longest shard (allocated once per kind)."""
        buf = self._bufs.get((kind, -1))
        if buf is None:
            n = self.B * self.plan.max_local_len * self.H * self.D
            buf = self._keep((kind, -1), torch.zeros(n, dtype=dtype, device=self.device))
        views, off = [], 0
        for p in pieces:
            n = self.B * p.length * self.H * self.D
            views.append(buf[off : off + n].view(self.B, p.length, self.H, self.D))
            off += n
        return views

    # -- packing -----------------------------------------------------------
    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, L, H, D)`` as ``(B, L * H, D)``: one row per (position, head)."""
        return t.view(self.B, t.shape[1] * self.H, self.D)

    def _chunks(
        self, packed: torch.Tensor, idx: Sequence[torch.Tensor]
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(piece, indices, K rows, V rows)`` for every piece with rows; the
        row blocks are ``(B, count, D)`` views of ``packed``."""
        off = 0
        for j, ix in enumerate(idx):
            c = ix.numel()
            if c == 0:
                continue
            n = self.B * c * self.D
            yield (
                j,
                ix,
                packed[off : off + n].view(self.B, c, self.D),
                packed[off + n : off + 2 * n].view(self.B, c, self.D),
            )
            off += 2 * n

    def _pack(self, out, ks, vs, idx) -> None:
        for j, ix, krows, vrows in self._chunks(out, idx):
            torch.index_select(self._rows(ks[j]), 1, ix, out=krows)
            torch.index_select(self._rows(vs[j]), 1, ix, out=vrows)

    # -- posting -----------------------------------------------------------
    def _post(self, phase: str, distance: int, send, recv) -> Transfer:
        """Post ``send = (peer, buffer, rows)`` and ``recv = (peer, buffer,
        rows)`` (either ``None``; empty buffers are skipped) as one batch and
        report the event."""
        tag = 3 * distance + _PHASE_TAG[phase]
        ops = []
        to = frm = send_buf = recv_buf = None
        rows_out = rows_in = 0
        if send is not None and send[1].numel():
            to, send_buf, rows_out = send[0], send[1].to(self.comm_dev), send[2]
            ops.append(dist.P2POp(dist.isend, send_buf, self.peers[to], self.group, tag))
        if recv is not None and recv[1].numel():
            frm, recv_buf, rows_in = recv
            ops.append(dist.P2POp(dist.irecv, recv_buf, self.peers[frm], self.group, tag))
        works = dist.batch_isend_irecv(ops) if ops else []

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        _emit(
            ExchangeEvent(
                phase, distance, to, frm, rows_out, rows_in, nbytes(send_buf), nbytes(recv_buf)
            )
        )
        return Transfer(works or [], [send_buf, recv_buf], recv_buf, self.device)

    def post_kv(self, phase: str, step: Step, slot: int, ks, vs) -> Transfer:
        """Send this rank's K/V rows that ``step.send_to`` needs (``ks``/``vs``:
        this rank's pieces); receive the sender's rows this rank needs."""
        send_idx, _ = self.idx[step.distance]
        send = recv = None
        if step.send_to is not None:
            buf = self._packed("send_kv", slot, step.send_rows)
            self._pack(buf, ks, vs, send_idx)
            send = (step.send_to, buf, step.send_rows)
        if step.recv_from is not None:
            buf = self._packed("recv_kv", slot, step.recv_rows)
            recv = (step.recv_from, buf, step.recv_rows)
        return self._post(phase, step.distance, send, recv)

    def unpack_kv(
        self, packed: torch.Tensor, step: Step
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Scatter received K/V rows into per-piece views of shard buffers
        (rows not received keep stale values; no query reaches them)."""
        _, recv_idx = self.idx[step.distance]
        kp = self._shard_views("k", self.dtype, step.recv_pieces)
        vp = self._shard_views("v", self.dtype, step.recv_pieces)
        for j, ix, krows, vrows in self._chunks(packed, recv_idx):
            self._rows(kp[j]).index_copy_(1, ix, krows)
            self._rows(vp[j]).index_copy_(1, ix, vrows)
        return kp, vp

    def grad_views(self, step: Step) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """fp32 dK/dV views for the sender's pieces, zeroed on the rows that
        will be returned."""
        _, recv_idx = self.idx[step.distance]
        dkp = self._shard_views("dk", self.acc, step.recv_pieces)
        dvp = self._shard_views("dv", self.acc, step.recv_pieces)
        for j, ix in enumerate(recv_idx):
            if ix.numel():
                self._rows(dkp[j]).index_fill_(1, ix, 0)
                self._rows(dvp[j]).index_fill_(1, ix, 0)
        return dkp, dvp

    def post_grad(self, step: Step, slot: int, dkp, dvp) -> Transfer:
        """Return the dK/dV of the rows received at ``step`` to their owner
        (``dkp``/``dvp`` from :meth:`grad_views`, ``None`` when nothing was
        received) and receive this rank's own rows' dK/dV from ``step.send_to``."""
        _, recv_idx = self.idx[step.distance]
        send = recv = None
        if step.recv_from is not None and dkp is not None:
            buf = self._packed("send_grad", slot, step.recv_rows)
            self._pack(buf, dkp, dvp, recv_idx)
            send = (step.recv_from, buf, step.recv_rows)
        if step.send_to is not None:
            buf = self._packed("recv_grad", slot, step.send_rows)
            recv = (step.send_to, buf, step.send_rows)
        return self._post("backward_grad", step.distance, send, recv)

    def finish_grad(self, transfer: Transfer, step: Step, dks, dvs) -> None:
        """Wait for this rank's returned dK/dV rows and add them into ``dks``/``dvs``."""
        packed = transfer.wait()
        if packed is None:
            return
        send_idx, _ = self.idx[step.distance]
        for j, ix, krows, vrows in self._chunks(packed, send_idx):
            self._rows(dks[j]).index_add_(1, ix, krows)
            self._rows(dvs[j]).index_add_(1, ix, vrows)
