"""The ring's point-to-point exchange (docs/design.md §4.3, §4.4) and its
counters (§2.4).

:class:`Exchanger` moves the rows an exchange plan names between the ranks
of one ring call: K/V rows (input dtype) to the ranks that need them, and
their dK/dV (fp32) back to their owner. Rows travel packed, per sender
piece: its ``(batch, rows, head_dim)`` K rows, then as many V rows, a row
being one ``(position, K/V head)`` pair (flat index ``position * kv_heads +
g``). Received rows are read in place: a span needed whole as the ``(B,
rows, H, D)`` range itself, other pieces through a row map (an int32
``(rows, H)`` tensor giving each pair its packed row; ``csrc/params.h``'s
``k_rows``). Receive buffers have two slots so that one step's transfer
overlaps the previous step's compute.

Every posted batch is reported as an :class:`ExchangeEvent` to
:data:`last_exchange_stats` (reset at every ring forward, the backward's
events appended) and to the hooks of :func:`register_exchange_hook`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..core.dtypes import acc_dtype

__all__ = [
    "ExchangeEvent",
    "ExchangeStats",
    "Exchanger",
    "Transfer",
    "last_exchange_stats",
    "register_exchange_hook",
]


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
            buffers and the row maps of partly needed pieces) allocated per pass,
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


def emit(event: ExchangeEvent) -> None:
    """Report ``event``: record it in :data:`last_exchange_stats`, then call every hook."""
    last_exchange_stats.record(event)
    for hook in list(_hooks.values()):
        hook(event)


# ---------------------------------------------------------------------------
# The transport.

_PHASE_TAG = {"forward_kv": 0, "backward_kv": 1, "backward_grad": 2}


class Transfer:
    """The posted operations of one step (or of the far group); ``wait()``
    returns the received buffer (on the compute device) or ``None`` when
    nothing was received."""

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


class _Span(NamedTuple):
    """The needed rows of one sender piece at one step: positions ``first``
    to ``first + rows - 1`` of the piece, ``idx`` their flat indices relative
    to ``first``. ``whole``: every (row, head) pair of that range is needed
    (a dense ring: the whole piece), so the packed rows are the ``(B, rows,
    H, D)`` range itself and are used in place."""

    first: int
    rows: int
    idx: torch.Tensor
    whole: bool


class Exchanger:
    """Packs and posts the rows of one ring call (``plan``: this rank's
    exchange plan; ``peers``: the global rank of every group rank; K/V
    travel in ``dtype``, gradients in :func:`acc_dtype`, through
    ``comm_dev``; ``role``: the pass its buffers are counted under in
    ``last_exchange_stats.buffer_bytes``), and hands the kernels views of the
    received ones. Transfers of at most ``far_bytes`` K/V bytes travel in
    the far group (:attr:`far_steps`, :meth:`post_far_kv`), the others in
    their ring steps (:attr:`steps`)."""

    def __init__(
        self,
        plan,
        group: dist.ProcessGroup | None,
        peers: Sequence[int],
        device: torch.device,
        comm_dev: torch.device,
        dtype: torch.dtype,
        batch: int,
        head_dim: int,
        role: str = "forward",
        far_bytes: int = 0,
    ) -> None:
        self.plan = plan
        self.role = role
        self.group = group
        self.peers = tuple(peers)
        self.device = device
        self.dtype = dtype
        self.acc = acc_dtype(dtype)
        self.B, self.H, self.D = batch, plan.kv_heads, head_dim  # K/V width
        self.comm_dev = comm_dev
        self.idx = plan.indices_on(device)
        self.spans = {s.distance: self._spans(s) for s in plan.steps}
        # positions of the row maps: the spans of a step not needed whole
        self._span_rows = max(
            (sum(sp.rows for sp in spans if not sp.whole) for spans in self.spans.values()),
            default=0,
        )
        self.steps, self.far_steps = self._split(plan.steps, far_bytes)
        self._near = {s.distance: s for s in self.steps}
        sends = [s.send_rows for s in self.steps if s.send_rows]
        recvs = [s.recv_rows for s in self.steps if s.recv_rows]
        far_sent = sum(s.send_rows for s in self.far_steps)
        far_received = sum(s.recv_rows for s in self.far_steps)
        # packed buffer kind -> (capacity in rows, slots, dtype, device). A send
        # buffer is free once its step is waited for, before the next post: one
        # slot. Received K/V (read while the next step arrives) and gradients
        # (a step's return travels while the next one is computed) need two
        # when two steps use them. The gradients of the received rows go back,
        # those of the sent rows return.
        self._kinds = {
            "send_kv": (max(sends, default=0), 1, self.dtype, device),
            "recv_kv": (max(recvs, default=0), min(2, len(recvs)), self.dtype, self.comm_dev),
            "send_grad": (max(recvs, default=0), min(2, len(recvs)), self.acc, device),
            "recv_grad": (max(sends, default=0), min(2, len(sends)), self.acc, self.comm_dev),
            # the far group: every far row at once, one slot
            "far_send_kv": (far_sent, 1, self.dtype, device),
            "far_recv_kv": (far_received, 1, self.dtype, self.comm_dev),
            "far_send_grad": (far_received, 1, self.acc, device),
            "far_recv_grad": (far_sent, 1, self.acc, self.comm_dev),
        }
        self._bufs: dict[tuple[str, int], torch.Tensor] = {}

    def _split(self, steps: Sequence, far_bytes: int) -> tuple[tuple, tuple]:
        """``(ring steps, far steps)``: every transfer of at most
        ``far_bytes`` K/V bytes goes to the far group, a step keeping the
        direction that does not."""
        row = 2 * self.B * self.D * self.dtype.itemsize
        near, far = [], []
        for s in steps:
            fs = s.send_to is not None and s.send_rows * row <= far_bytes
            fr = s.recv_from is not None and s.recv_rows * row <= far_bytes
            if fs or fr:
                far.append(_only(s, fs, fr))
            if not (fs or fr):
                near.append(s)
            elif (s.send_to is not None and not fs) or (s.recv_from is not None and not fr):
                near.append(_only(s, not fs, not fr))
        return tuple(near), tuple(far)

    def step_for(self, distance: int):
        """The ring step at ``distance`` (``None``: none, or all of it far)."""
        return self._near.get(distance)

    def _spans(self, step) -> list[_Span]:
        """The :class:`_Span` of every sender piece of ``step``."""
        out = []
        for ix, dev_ix in zip(step.recv_idx, self.idx[step.distance][1], strict=True):
            if ix.numel() == 0:
                out.append(_Span(0, 0, dev_ix, False))
                continue
            lo, hi = int(ix[0]) // self.H, int(ix[-1]) // self.H + 1  # sorted, unique
            rel = dev_ix - lo * self.H if lo else dev_ix
            out.append(_Span(lo, hi - lo, rel, ix.numel() == (hi - lo) * self.H))
        return out

    # -- buffers -----------------------------------------------------------
    def _keep(self, key: tuple[str, int], buf: torch.Tensor) -> torch.Tensor:
        self._bufs[key] = buf
        counts = last_exchange_stats.buffer_bytes
        counts[self.role] = counts.get(self.role, 0) + buf.numel() * buf.element_size()
        return buf

    def _packed(self, kind: str, slot: int, rows: int) -> torch.Tensor:
        """A packed buffer of ``rows`` K and V rows: a view of the ``(kind,
        slot)`` buffer, allocated once for the largest step."""
        capacity, slots, dtype, device = self._kinds[kind]
        key = (kind, slot % slots)
        buf = self._bufs.get(key)
        if buf is None:
            buf = torch.empty(2 * self.B * capacity * self.D, dtype=dtype, device=device)
            buf = self._keep(key, buf)
        return buf[: 2 * self.B * rows * self.D]

    def _piece_views(
        self, packed: torch.Tensor, step
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], list[int]]:
        """Per sender piece of ``step``, the K and V (or dK and dV) views of
        ``packed`` the kernels read (or accumulate into) and the global
        position of the first row of the piece's span: ``(B, rows, H, D)``
        where the span is needed whole, else the piece's ``(B, count, D)``
        rows, addressed through its row map (``None`` for a piece without
        rows)."""
        spans, recv_idx = self.spans[step.distance], self.idx[step.distance][1]
        chunks = {j: (krows, vrows) for j, _, krows, vrows in self._chunks(packed, recv_idx)}
        ks, vs, starts = [], [], []
        for j, (p, span) in enumerate(zip(step.recv_pieces, spans, strict=True)):
            k, v = chunks.get(j, (None, None))
            if span.whole:
                k, v = (rows.view(self.B, span.rows, self.H, self.D) for rows in (k, v))
            ks.append(k)
            vs.append(v)
            starts.append(p.start + span.first)
        return ks, vs, starts

    def _row_maps(self, step) -> list[torch.Tensor | None]:
        """Per sender piece of ``step``, the ``(rows, H)`` int32 row map of
        a partly needed span (``None`` for a span needed whole or empty):
        entry ``idx[i]`` is ``i``; entries not needed hold a neighbouring
        needed row (valid, never read). One buffer, for the widest step."""
        spans = self.spans[step.distance]
        if all(sp.whole or not sp.rows for sp in spans):
            return [None] * len(spans)
        buf = self._bufs.get(("map", -1))
        if buf is None:
            n = self._span_rows * self.H
            buf = self._keep(("map", -1), torch.empty(n, dtype=torch.int32, device=self.device))
        maps, off = [], 0
        for span in spans:
            if span.whole or not span.rows:
                maps.append(None)
                continue
            m = buf[off : off + span.rows * self.H]
            off += m.numel()
            m.zero_().index_fill_(0, span.idx, 1).cumsum_(0).sub_(1).clamp_(min=0)
            maps.append(m.view(span.rows, self.H))
        return maps

    # -- packing -----------------------------------------------------------
    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, L, Hkv, D)`` as ``(B, L * Hkv, D)``: one row per (position, K/V head)."""
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
        """Gather the ``idx`` rows of ``ks``/``vs`` into ``out`` (every row of
        a piece: a plain copy)."""
        for j, ix, krows, vrows in self._chunks(out, idx):
            for rows, t in ((krows, ks[j]), (vrows, vs[j])):
                if ix.numel() == t.shape[1] * self.H:
                    rows.copy_(self._rows(t))
                else:
                    torch.index_select(self._rows(t), 1, ix, out=rows)

    # -- posting -----------------------------------------------------------
    def _post(self, phase: str, distance: int, send, recv) -> Transfer:
        """Post ``send = (peer, buffer, rows)`` and ``recv = (peer, buffer,
        rows)`` (either ``None``; empty buffers are skipped) as one batch and
        report the event."""
        if send is not None and send[1].numel():
            send = (send[0], send[1].to(self.comm_dev), send[2])
        recv_buf = recv[1] if recv is not None and recv[1].numel() else None
        works, keep = self._batch(phase, [(distance, send, recv)])
        return Transfer(works, keep, recv_buf, self.device)

    def _batch(self, phase: str, transfers) -> tuple[list, list]:
        """Post the ``(distance, send, recv)`` transfers (buffers on the
        transport's device) as one batch; report an event per transfer.
        Returns the works and the buffers to keep alive."""
        ops, keep = [], []

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        for distance, send, recv in transfers:
            tag = 3 * distance + _PHASE_TAG[phase]
            to = frm = send_buf = recv_buf = None
            rows_out = rows_in = 0
            if send is not None and send[1].numel():
                to, send_buf, rows_out = send
                ops.append(dist.P2POp(dist.isend, send_buf, self.peers[to], self.group, tag))
            if recv is not None and recv[1].numel():
                frm, recv_buf, rows_in = recv
                ops.append(dist.P2POp(dist.irecv, recv_buf, self.peers[frm], self.group, tag))
            keep += [send_buf, recv_buf]
            emit(
                ExchangeEvent(
                    phase, distance, to, frm, rows_out, rows_in, nbytes(send_buf), nbytes(recv_buf)
                )
            )
        works = dist.batch_isend_irecv(ops) if ops else []
        return works or [], keep

    def post_kv(self, phase: str, step, slot: int, ks, vs) -> Transfer:
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
        self, packed: torch.Tensor, step
    ) -> tuple[list, list, list[int], list[torch.Tensor | None]]:
        """``(K views, V views, first positions, row maps)`` per sender piece
        of the received ``packed`` rows (:meth:`_piece_views`,
        :meth:`_row_maps`): nothing is copied."""
        kp, vp, starts = self._piece_views(packed, step)
        return kp, vp, starts, self._row_maps(step)

    def grad_views(self, step, slot: int) -> tuple[list, list]:
        """fp32 dK/dV views for the sender's pieces (as :meth:`unpack_kv`'s
        K/V views) into the packed return buffer of ``slot``, zeroed: the
        kernels accumulate the gradients of the received rows straight into
        what goes back."""
        packed = self._packed("send_grad", slot, step.recv_rows).zero_()
        dkp, dvp, _ = self._piece_views(packed, step)
        return dkp, dvp

    def post_grad(self, step, slot: int, dkp, dvp) -> Transfer:
        """Return the dK/dV of the rows received at ``step`` to their owner
        (the packed buffer of ``slot`` that :meth:`grad_views` handed out;
        ``dkp``/``dvp`` ``None`` when nothing was received) and receive this
        rank's own rows' dK/dV from ``step.send_to``."""
        send = recv = None
        if step.recv_from is not None and dkp is not None:
            buf = self._packed("send_grad", slot, step.recv_rows)
            send = (step.recv_from, buf, step.recv_rows)
        if step.send_to is not None:
            buf = self._packed("recv_grad", slot, step.send_rows)
            recv = (step.send_to, buf, step.send_rows)
        return self._post("backward_grad", step.distance, send, recv)

    def finish_grad(self, transfer: Transfer, step, dks, dvs) -> None:
        """Wait for this rank's returned dK/dV rows and add them into ``dks``/``dvs``
        (every row of a piece: a plain add)."""
        packed = transfer.wait()
        if packed is not None:
            self._add_home(packed, step, dks, dvs)

    def _add_home(self, packed: torch.Tensor, step, dks, dvs) -> None:
        """Add the returned dK/dV rows of ``step`` (``packed``) into ``dks``/``dvs``."""
        send_idx, _ = self.idx[step.distance]
        for j, ix, krows, vrows in self._chunks(packed, send_idx):
            for rows, t in ((krows, dks[j]), (vrows, dvs[j])):
                if ix.numel() == t.shape[1] * self.H:
                    self._rows(t).add_(rows)
                else:
                    self._rows(t).index_add_(1, ix, rows)

    # -- the far group ---------------------------------------------------
    def _far_transfers(self, out_buf, in_buf, back: bool) -> list:
        """The far group's ``(distance, (peer, out slice, rows) | None,
        (peer, in slice, rows) | None)`` for :meth:`_batch`: K/V out to each
        step's ``send_to`` and in from its ``recv_from``, or, ``back``, the
        received rows' dK/dV out to ``recv_from`` and this rank's in from
        ``send_to``."""
        out_peer, out_rows, in_peer, in_rows = (
            ("recv_from", "recv_rows", "send_to", "send_rows")
            if back
            else ("send_to", "send_rows", "recv_from", "recv_rows")
        )
        return [
            (
                step.distance,
                None if o is None else (getattr(step, out_peer), o, getattr(step, out_rows)),
                None if i is None else (getattr(step, in_peer), i, getattr(step, in_rows)),
            )
            for step, o, i in zip(
                self.far_steps,
                self._far_slices(out_buf, out_rows),
                self._far_slices(in_buf, in_rows),
                strict=True,
            )
        ]

    def _far_slices(self, packed: torch.Tensor | None, attr: str) -> list[torch.Tensor | None]:
        """Per far step, its slice of the far group's ``packed`` buffer
        (``attr``: ``"send_rows"`` or ``"recv_rows"``; ``None`` for a step
        without rows of that direction)."""
        out, off = [], 0
        for step in self.far_steps:
            n = 2 * self.B * getattr(step, attr) * self.D
            out.append(packed[off : off + n] if n and packed is not None else None)
            off += n
        return out

    def post_far_kv(self, phase: str, ks, vs) -> Transfer | None:
        """Post every far transfer of K/V rows as one batch (``None`` when
        there is none): this rank's rows the far peers need go out, the rows
        it needs from them come in."""
        if not self.far_steps:
            return None
        sent = sum(s.send_rows for s in self.far_steps)
        received = sum(s.recv_rows for s in self.far_steps)
        send_buf = self._packed("far_send_kv", 0, sent) if sent else None
        for step, out in zip(self.far_steps, self._far_slices(send_buf, "send_rows"), strict=True):
            if out is not None:
                self._pack(out, ks, vs, self.idx[step.distance][0])
        if send_buf is not None:
            send_buf = send_buf.to(self.comm_dev)
        recv_buf = self._packed("far_recv_kv", 0, received) if received else None
        transfers = self._far_transfers(send_buf, recv_buf, back=False)
        works, keep = self._batch(phase, transfers)
        return Transfer(works, keep, recv_buf, self.device)

    def far_received(self, packed: torch.Tensor | None) -> list[tuple]:
        """``(step, packed rows)`` of every far step that received rows (the
        far group's waited buffer ``packed``): :meth:`unpack_kv` reads them."""
        slices = self._far_slices(packed, "recv_rows")
        return [(s, p) for s, p in zip(self.far_steps, slices, strict=True) if p is not None]

    def far_grad_views(self) -> list[tuple]:
        """``(step, dK views, dV views)`` of every far step that received
        rows, into the far group's zeroed return buffer (as :meth:`grad_views`)."""
        received = sum(s.recv_rows for s in self.far_steps)
        if not received:
            return []
        packed = self._packed("far_send_grad", 0, received).zero_()
        out = []
        for step, p in zip(self.far_steps, self._far_slices(packed, "recv_rows"), strict=True):
            if p is not None:
                dkp, dvp, _ = self._piece_views(p, step)
                out.append((step, dkp, dvp))
        return out

    def post_far_grad(self) -> Transfer | None:
        """Return the dK/dV of every far step's received rows to their
        owners (the buffer :meth:`far_grad_views` handed out) and receive
        this rank's own rows' dK/dV, as one batch (``None``: no far step)."""
        if not self.far_steps:
            return None
        sent = sum(s.send_rows for s in self.far_steps)
        received = sum(s.recv_rows for s in self.far_steps)
        back = self._packed("far_send_grad", 0, received) if received else None
        if back is not None:
            back = back.to(self.comm_dev)
        home = self._packed("far_recv_grad", 0, sent) if sent else None
        transfers = self._far_transfers(back, home, back=True)
        works, keep = self._batch("backward_grad", transfers)
        return Transfer(works, keep, home, self.device)

    def finish_far_grad(self, transfer: Transfer | None, dks, dvs) -> None:
        """Wait for the far group's returned dK/dV of this rank's rows and
        add them into ``dks``/``dvs``."""
        packed = None if transfer is None else transfer.wait()
        for step, p in zip(self.far_steps, self._far_slices(packed, "send_rows"), strict=True):
            if p is not None:
                self._add_home(p, step, dks, dvs)


def _only(step, send: bool, recv: bool):
    """``step`` with only its send (``send``) and/or receive (``recv``)."""
    empty = torch.empty(0, dtype=torch.int64)
    return replace(
        step,
        send_to=step.send_to if send else None,
        send_idx=step.send_idx if send else tuple(empty for _ in step.send_idx),
        recv_from=step.recv_from if recv else None,
        recv_idx=step.recv_idx if recv else tuple(empty for _ in step.recv_idx),
        pairs=step.pairs if recv else (),
    )
