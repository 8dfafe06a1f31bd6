"""The ring's point-to-point exchange (docs/design.md §4.3, §4.4, §2.4):
:class:`Exchanger` and the :class:`ExchangeEvent` of every posted batch."""

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from ..core.dtypes import acc_dtype

__all__ = ["ExchangeEvent", "ExchangeStats", "Exchanger", "Transfer", "last_exchange_stats",
           "register_exchange_hook"]  # fmt: skip


@dataclass(frozen=True)
class ExchangeEvent:
    """One posted batch of point-to-point operations on this rank: phase,
    distance, peers, (row, head) pairs per batch element and bytes."""

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
    """Events of the last ring call on this rank and the transport's buffer
    bytes per pass (``buffer_bytes``)."""

    events: list[ExchangeEvent] = field(default_factory=list)
    buffer_bytes: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget every event and buffer count."""
        self.events.clear()
        self.buffer_bytes.clear()

    def bytes_sent(self, phase: str | None = None) -> int:
        """Bytes sent, all phases or one."""
        return sum(e.bytes_sent for e in self.events if phase in (None, e.phase))

    def bytes_received(self, phase: str | None = None) -> int:
        """Bytes received, all phases or one."""
        return sum(e.bytes_received for e in self.events if phase in (None, e.phase))


#: Exchange counters of the last call on this rank (mutated in place).
last_exchange_stats = ExchangeStats()

ExchangeHook = Callable[[ExchangeEvent], None]
_hooks: OrderedDict[int, ExchangeHook] = OrderedDict()  # (a handle refers to it weakly)


def register_exchange_hook(hook: ExchangeHook) -> RemovableHandle:
    """Call ``hook(event)`` for every batch of P2P operations this process posts;
    a handle whose ``remove()`` unregisters it (also a context manager)."""
    handle = RemovableHandle(_hooks)
    _hooks[handle.id] = hook
    return handle


def emit(event: ExchangeEvent) -> None:
    """Record ``event`` in :data:`last_exchange_stats`, then call every hook."""
    last_exchange_stats.events.append(event)
    for hook in list(_hooks.values()):
        hook(event)


_PHASE_TAG = {"forward_kv": 0, "backward_kv": 1, "backward_grad": 2}


@dataclass
class Transfer:
    """The posted operations of one step (or of the far group); ``wait()``
    returns the received buffer on the compute device (``None``: nothing)."""

    works: list
    keep: list  # the buffers must outlive the operations
    recv: torch.Tensor | None
    device: torch.device

    def wait(self) -> torch.Tensor | None:
        """Wait for the operations; the received buffer."""
        for w in self.works:
            w.wait()
        self.works, self.keep = [], []
        # (a received buffer on another device: staged through host memory)
        return None if self.recv is None else self.recv.to(self.device)


class _Span(NamedTuple):
    """The needed rows of one sender piece at one step."""

    first: int
    rows: int
    idx: torch.Tensor
    whole: bool


class Exchanger:
    """Packs and posts the rows of one ring call and hands the kernels views of
    the received ones (far group: :attr:`far_steps`, ring steps: :attr:`steps`)."""

    def __init__(self, plan, group: dist.ProcessGroup | None, peers: Sequence[int],
                 device: torch.device, comm_dev: torch.device, dtype: torch.dtype, batch: int,
                 head_dim: int, role: str = "forward", far_bytes: int = 0) -> None:  # fmt: skip
        self.plan, self.role, self.group, self.peers = plan, role, group, tuple(peers)
        self.device, self.comm_dev, self.dtype, self.acc = device, comm_dev, dtype, acc_dtype(dtype)
        self.B, self.H, self.D = batch, plan.kv_heads, head_dim  # K/V width
        self.idx = plan.indices_on(device)
        self.spans = {s.distance: self._spans(s) for s in plan.steps}
        # positions of the row maps: the spans of a step not needed whole
        self._span_rows = max((sum(sp.rows for sp in spans if not sp.whole)
                               for spans in self.spans.values()), default=0)  # fmt: skip
        self.steps, self.far_steps = self._split(plan.steps, far_bytes)
        self._near = {s.distance: s for s in self.steps}
        sends = [s.send_rows for s in self.steps if s.send_rows]
        recvs = [s.recv_rows for s in self.steps if s.recv_rows]
        far_sent = sum(s.send_rows for s in self.far_steps)
        far_received = sum(s.recv_rows for s in self.far_steps)
        # kind -> (capacity in rows, slots, dtype, device): a send buffer is free
        # before the next post (one slot); received K/V and gradients need two
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
        """``(ring steps, far steps)``: transfers of at most ``far_bytes`` go far."""
        row = 2 * self.B * self.D * self.dtype.itemsize
        near, far = [], []
        for s in steps:
            fs = s.send_to is not None and s.send_rows * row <= far_bytes
            fr = s.recv_from is not None and s.recv_rows * row <= far_bytes
            if fs or fr:
                far.append(_only(s, fs, fr))
            if (s.send_to is not None and not fs) or (s.recv_from is not None and not fr):
                near.append(_only(s, not fs, not fr) if fs or fr else s)
        return tuple(near), tuple(far)

    def release(self) -> None:
        """Drop this pass's buffers (posted transfers keep theirs)."""
        self._bufs.clear()

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

    def _keep(self, key: tuple[str, int], buf: torch.Tensor) -> torch.Tensor:
        self._bufs[key] = buf
        counts = last_exchange_stats.buffer_bytes
        counts[self.role] = counts.get(self.role, 0) + buf.numel() * buf.element_size()
        return buf

    def _packed(self, kind: str, slot: int, rows: int) -> torch.Tensor:
        """A view for ``rows`` K and V rows of the ``(kind, slot)`` buffer."""
        capacity, slots, dtype, device = self._kinds[kind]
        key = (kind, slot % slots)
        buf = self._bufs.get(key)
        if buf is None:
            buf = torch.empty(2 * self.B * capacity * self.D, dtype=dtype, device=device)
            buf = self._keep(key, buf)
        return buf[: 2 * self.B * rows * self.D]

    def _piece_views(self, packed: torch.Tensor, step) -> tuple[list, list, list[int]]:
        """Per sender piece of ``step``: its K and V views and first position."""
        spans, recv_idx = self.spans[step.distance], self.idx[step.distance][1]
        chunks = {j: (krows, vrows) for j, _, krows, vrows in self._chunks(packed, recv_idx)}
        ks, vs, starts = [], [], []
        for j, (p, span) in enumerate(zip(step.recv_pieces, spans, strict=True)):
            k, v = chunks.get(j, (None, None))
            if span.whole:
                k, v = (rows.view(self.B, span.rows, self.H, self.D) for rows in (k, v))
            ks, vs, starts = ks + [k], vs + [v], starts + [p.start + span.first]
        return ks, vs, starts

    def _row_maps(self, step) -> list[torch.Tensor | None]:
        """Per sender piece of ``step``, the int32 row map of a partly needed span."""
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

    def _chunks(self, packed: torch.Tensor, idx: Sequence[torch.Tensor]) -> Iterator[tuple]:
        """``(piece, indices, K rows, V rows)`` of every piece with rows."""
        off = 0
        for j, ix in enumerate(idx):
            c = ix.numel()
            if c == 0:
                continue
            n = self.B * c * self.D
            yield (j, ix, packed[off : off + n].view(self.B, c, self.D),
                   packed[off + n : off + 2 * n].view(self.B, c, self.D))  # fmt: skip
            off += 2 * n

    def _move(self, packed: torch.Tensor, idx, ks, vs, add: bool) -> None:
        """Gather the ``idx`` rows of ``ks``/``vs`` into ``packed`` (or ``add`` back)."""
        for j, ix, krows, vrows in self._chunks(packed, idx):
            for rows, t in ((krows, ks[j]), (vrows, vs[j])):
                # (B, L, Hkv, D) as (B, L * Hkv, D): one row per (position, K/V head)
                flat = t.view(self.B, t.shape[1] * self.H, self.D)
                whole = ix.numel() == flat.shape[1]
                if add and whole:
                    flat.add_(rows)
                elif add:
                    flat.index_add_(1, ix, rows)
                elif whole:
                    rows.copy_(flat)
                else:
                    torch.index_select(flat, 1, ix, out=rows)

    def _slices(self, steps: Sequence, packed: torch.Tensor | None,
                attr: str) -> list[torch.Tensor | None]:  # fmt: skip
        """Per step of ``steps``, its slice (``attr``: its rows) of the ``packed`` buffer."""
        out, off = [], 0
        for step in steps:
            n = 2 * self.B * getattr(step, attr) * self.D
            out.append(packed[off : off + n] if n and packed is not None else None)
            off += n
        return out

    def post(self, phase: str, steps: Sequence, slot: int, ks=None, vs=None) -> Transfer | None:
        """Post the transfers of ``steps`` (``(step,)``: one ring step; :attr:`far_steps`: the far
        group, in buffers of its own; ``None`` where empty) as one batch, an event each: K/V rows
        (packed here from ``ks``/``vs``), or the dK/dV of the received rows back (``phase``
        ``"backward_grad"``, from :meth:`grad_views`) while receiving this rank's own."""
        if not steps:
            return None
        far = "far_" if steps is self.far_steps else ""
        kind = "grad" if phase == "backward_grad" else "kv"
        (op, orows), (ip, irows) = ("send_to", "send_rows"), ("recv_from", "recv_rows")
        if kind == "grad":
            (op, orows), (ip, irows) = (ip, irows), (op, orows)
        n_out, n_in = (sum(getattr(s, a) for s in steps) for a in (orows, irows))
        send = self._packed(f"{far}send_{kind}", slot, n_out) if n_out else None
        if ks is not None:
            for step, o in zip(steps, self._slices(steps, send, orows), strict=True):
                if o is not None:
                    self._move(o, self.idx[step.distance][0], ks, vs, add=False)
        send = send.to(self.comm_dev) if send is not None else None
        home = self._packed(f"{far}recv_{kind}", slot, n_in) if n_in else None
        ops, keep = [], []
        outs, ins = self._slices(steps, send, orows), self._slices(steps, home, irows)
        for s, o, i in zip(steps, outs, ins, strict=True):
            tag = 3 * s.distance + _PHASE_TAG[phase]
            to = None if o is None else getattr(s, op)
            frm = None if i is None else getattr(s, ip)
            if to is not None:
                ops.append(dist.P2POp(dist.isend, o, self.peers[to], self.group, tag))
            if frm is not None:
                ops.append(dist.P2POp(dist.irecv, i, self.peers[frm], self.group, tag))
            keep += [o, i]
            sizes = [0 if t is None else t.numel() * t.element_size() for t in (o, i)]
            rows = [0 if p is None else getattr(s, a) for p, a in ((to, orows), (frm, irows))]
            emit(ExchangeEvent(phase, s.distance, to, frm, *rows, *sizes))
        works = dist.batch_isend_irecv(ops) if ops else []
        return Transfer(works or [], keep, home, self.device)

    def unpack_kv(self, packed: torch.Tensor,
                  step) -> tuple[list, list, list[int], list[torch.Tensor | None]]:  # fmt: skip
        """``(K views, V views, first positions, row maps)`` per sender piece of
        the received ``packed`` rows; nothing is copied."""
        return (*self._piece_views(packed, step), self._row_maps(step))

    def grad_views(self, steps: Sequence, slot: int) -> list[tuple]:
        """``(step, dK views, dV views)`` (as :meth:`unpack_kv`'s) of every step of ``steps`` (as
        :meth:`post`'s) that received rows: zeroed fp32 views into the return buffer of ``slot``,
        where the kernels accumulate what goes back."""
        received = sum(s.recv_rows for s in steps)
        if not received:
            return []
        far = "far_" if steps is self.far_steps else ""
        packed = self._packed(f"{far}send_grad", slot, received).zero_()
        slices = zip(steps, self._slices(steps, packed, "recv_rows"), strict=True)
        return [(s, *self._piece_views(p, s)[:2]) for s, p in slices if p is not None]

    def finish(self, transfer: Transfer | None, steps: Sequence, dks, dvs) -> None:
        """Wait for this rank's dK/dV rows returned for ``steps`` (``transfer``: their
        :meth:`post`); add them into ``dks``/``dvs``."""
        packed = None if transfer is None else transfer.wait()
        for step, p in zip(steps, self._slices(steps, packed, "send_rows"), strict=True):
            if p is not None:
                self._move(p, self.idx[step.distance][0], dks, dvs, add=True)

    def far_received(self, packed: torch.Tensor | None) -> list[tuple]:
        """``(step, packed rows)`` of every far step that received rows."""
        slices = self._slices(self.far_steps, packed, "recv_rows")
        return [(s, p) for s, p in zip(self.far_steps, slices, strict=True) if p is not None]


def _only(step, send: bool, recv: bool):
    """``step`` with only its send (``send``) and/or receive (``recv``)."""
    empty = torch.empty(0, dtype=torch.int64)
    return replace(step, send_to=step.send_to if send else None,
                   send_idx=step.send_idx if send else tuple(empty for _ in step.send_idx),
                   recv_from=step.recv_from if recv else None,
                   recv_idx=step.recv_idx if recv else tuple(empty for _ in step.recv_idx),
                   pairs=step.pairs if recv else ())  # fmt: skip
