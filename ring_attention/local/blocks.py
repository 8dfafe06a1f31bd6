"""A ring pass's blocks merged into its fp32 accumulators (or their gradients added) by our block
kernel or, where the pass's route is dense, by a dense backend: which blocks take which, and
why, in docs/design.md §5 (the ring's per-step blocks) and §4.3-4.4."""

import math
from collections.abc import Callable
from functools import partial

import torch

from ..core.call import Call
from . import ops
from .backends import KvFinite, aligned, backend
from .block_calls import BlockCall, block_calls
from .branches import dense_backward, dense_forward
from .dispatch import route, route_blocks
from .spans import Call as SpanCall
from .spans import Route, batch_groups

Tensor = torch.Tensor


class Blocks:
    """The blocks of one ring pass of ``call``: by the dense route ``dense`` where a block allows
    it, else by the block kernel (``args``); ``each_block``: each dense block checks its K/V."""

    def __init__(self, call: Call, args: ops.OpArgs, dense: Route | None) -> None:
        self.args, self.dense, self.each_block = args, dense, True
        self.backend = backend(dense.backends[0][0]) if dense and dense.backends else None
        self.pattern, self.scale = call.pattern, call.scale

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_start: int,
        k_start: int, k_rows: Tensor | None = None,
    ) -> None:  # fmt: skip
        """Merge the block into the accumulators ``out`` ``(B, Lq, H, D)`` and
        ``lse`` ``(B, H, Lq)`` (the accumulation dtype)."""
        args = (q, k, v, out, lse, q_start, k_start)
        if self.dense is None or not self._dense_forward(*args, k_rows):
            ops.block_forward(*args, self.args, k_rows)

    def backward(
        self, go: Tensor, glse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
        lse: Tensor, dq: Tensor, dk: Tensor, dv: Tensor, q_start: int, k_start: int,
        k_rows: Tensor | None = None,
    ) -> None:  # fmt: skip
        """Add the block's gradients into ``dq``, ``dk``, ``dv`` (the accumulation dtype), given
        the final ``out`` and ``lse``."""
        args = (q, k, v, out, lse, dq, dk, dv, q_start, k_start)
        if glse is not None or self.dense is None or not self._dense_backward(go, *args, k_rows):
            ops.block_backward(go, glse, *args, self.args, k_rows)

    def _local(self, pass_: str, q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int,
               k_rows: Tensor | None) -> Route | None:  # fmt: skip
        """The per-branch route of a piece's own block (None: our kernel)."""
        if k_rows is not None or q_start != k_start or q.shape[1] != k.shape[1]:
            return None
        r = route(pass_, q, k, v, self.pattern, None)
        return r if r.dense else None

    def _views(self, q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int,
               k_rows: Tensor | None, *q_side: Tensor) -> list[tuple] | None:  # fmt: skip
        """Each dense call of the block, its packed rows and its views of ``q``, ``k``, ``v``,
        ``q_side``; ``None``: our kernel's (a causal diagonal cut across, or views to copy)."""
        lk = k.shape[1] if k_rows is None else k_rows.shape[0]
        kv_heads = k.shape[2] if k_rows is None else k_rows.shape[1]
        calls = block_calls(self.pattern, q.shape[2], kv_heads, q_start, q.shape[1], k_start, lk)
        if calls is None:
            return None
        work = []
        for c in calls:
            if k_rows is None:
                rows, kv = None, [c.k.view(t, kv=True) for t in (k, v)]
            else:  # the rows the call reads, (segments, rows, K/V heads) flat, gathered
                rows = c.k.view(k_rows[None, :, :, None], kv=True).reshape(-1).long()
                shape = (q.shape[0], c.k.segments, c.k.rows, c.k.kv_heads, q.shape[3])
                kv = [t.index_select(1, rows).view(shape) for t in (k, v)]
            work.append((c, rows, c.q.view(q), *kv, *(c.q.view(t) for t in q_side)))
        if q.device.type == "cuda" and not all(aligned(t) for w in work for t in w[2:]):
            return None
        return work

    def _dense_forward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_start: int,
        k_start: int, k_rows: Tensor | None = None,
    ) -> bool:  # fmt: skip
        """:meth:`forward` by the dense route; ``False``: the block kernel's (nothing merged)."""
        if self.backend is None:
            r = self._local("forward", q, k, v, q_start, k_start, k_rows)
            run = partial(dense_forward, q, k, v, self.pattern, self.scale)
            return r is not None and self._run(k, v, [(r,)], run, partial(merge_into, out, lse))

        def part(c: BlockCall, _rows, qv: Tensor, kv: Tensor, vv: Tensor) -> tuple:
            o, bl = _part(c.q, q, q.shape[3], q.dtype), _part(c.q, q, None, lse.dtype)
            for qg, kg, vg, og, lg in _groups(qv, kv, vv, o, bl):
                self.backend.forward(qg, kg, vg, c.causal, self.scale, og, lg)
            return c, o, bl

        work = self._views(q, k, v, q_start, k_start, k_rows)
        return work is not None and self._run(k, v, work, part, partial(_merge_part, out, lse))

    def _dense_backward(
        self, go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        dq: Tensor, dk: Tensor, dv: Tensor, q_start: int, k_start: int,
        k_rows: Tensor | None = None,
    ) -> bool:  # fmt: skip
        """:meth:`backward` by the dense route; ``False``: the block kernel's (nothing added)."""
        if self.backend is None:
            r = self._local("backward", q, k, v, q_start, k_start, k_rows)
            run = partial(dense_backward, go, q, k, v, out, lse, self.pattern, self.scale)
            return r is not None and self._run(k, v, [(r,)], run, partial(_add, (dq, dk, dv)))
        D = q.shape[3]

        def part(c: BlockCall, r, qv: Tensor, kv: Tensor, vv: Tensor, gov: Tensor,
                 ov: Tensor) -> tuple:  # fmt: skip
            lv = _final_lse(c, lse, q)
            gq = _part(c.q, q, D, q.dtype)
            gk, gv = _part(c.k, q, D, q.dtype, True), _part(c.k, q, D, q.dtype, True)
            for gog, qg, kg, vg, og, lg, gqg, gkg, gvg in _groups(gov, qv, kv, vv, ov, lv, gq,
                                                                  gk, gv):  # fmt: skip
                self.backend.backward(gog, qg, kg, vg, og, lg, c.causal, self.scale, gqg, gkg,
                                      gvg)  # fmt: skip
            return c, r, gq, gk, gv

        work = self._views(q, k, v, q_start, k_start, k_rows, go, out)
        return work is not None and self._run(k, v, work, part, partial(_add_part, dq, dk, dv))

    def _run(self, k: Tensor, v: Tensor, work: list[tuple], compute: Callable,
             apply: Callable) -> bool:  # fmt: skip
        """``compute`` each item of ``work`` and ``apply`` its part: at once where the pass's check
        covers the block, else once the block's own K/V check reads finite (``False``: not)."""
        finite = KvFinite(k, v) if self.each_block and work else True
        parts = []
        for item in work:
            parts.append(compute(*item))
            if finite is True:
                apply(*parts.pop())
        if not finite:  # read with the dense calls queued: dropped, the kernel's instead
            return False
        for part in parts:
            apply(*part)
        return True


def _add(accs: tuple[Tensor, ...], *grads: Tensor) -> None:
    """Add each of ``grads`` into its accumulator."""
    for acc, g in zip(accs, grads, strict=True):
        acc.add_(g)


def _merge_part(out: Tensor, lse: Tensor, c: BlockCall, o: Tensor, bl: Tensor) -> None:
    """Merge a call's part ``o``, ``bl`` (:func:`_part`) into the block's accumulators."""
    for og, lg, po, pl in _groups(c.q.view(out), c.q.lse_view(lse), o, bl):
        merge_into(og, lg, po.transpose(1, 2), pl)


def _add_part(dq: Tensor, dk: Tensor, dv: Tensor, c: BlockCall, rows: Tensor | None, gq: Tensor,
              gk: Tensor, gv: Tensor) -> None:  # fmt: skip
    """Add a call's gradient parts into the block's accumulators (packed K/V: through the rows
    it read, ``rows``)."""
    c.q.view(dq).add_(gq.transpose(2, 3))
    for acc, g in ((dk, gk), (dv, gv)):
        g = g.transpose(2, 3)  # (B, segments, rows, K/V heads, D)
        if rows is None:
            c.k.view(acc, kv=True).add_(g)
        else:
            acc.index_add_(1, rows, g.reshape(g.shape[0], -1, g.shape[-1]).to(acc.dtype))


def _part(c: SpanCall, q: Tensor, width: int | None, dtype: torch.dtype,
          kv: bool = False) -> Tensor:  # fmt: skip
    """A fresh ``(B, segments, heads, rows[, width])`` part of the call's rows on ``q``'s device,
    rows padded so that every view a backend gets is aligned (``part_geometry``)."""
    rows = c.part_rows(q.shape[0], kv)
    buf = torch.empty(rows if width is None else (rows, width), dtype=dtype, device=q.device)
    return buf.as_strided(*c.part_geometry(0, q.shape[0], kv, width))


def _final_lse(c: BlockCall, lse: Tensor, q: Tensor) -> Tensor:
    """The final ``lse`` of the call's query rows, copied into a fresh part (:func:`_part`)."""
    part = _part(c.q, q, None, lse.dtype)
    return part.copy_(c.q.lse_view(lse))


def _groups(*views: Tensor) -> list[tuple[Tensor, ...]]:
    """``(B, segments, ...)`` views as ``(B * segments, ...)`` ones, one tuple where batch and
    segments merge in all of them, else one a batch row (:func:`~.spans.batch_groups`)."""
    gs = [(tuple(t.shape), t.stride(), t.storage_offset()) for t in views]
    return [tuple(t.as_strided(*g) for t, g in zip(views, grp, strict=True))
            for grp in batch_groups(gs)]  # fmt: skip


def merge_into(out: Tensor, lse: Tensor, o: Tensor, bl: Tensor) -> None:
    """Merge one part ``(o, bl)`` into the accumulators ``out``, ``lse`` in place (they start at
    ``0`` and ``-inf``)."""
    new = torch.logaddexp(lse, bl)
    ref = torch.where(new == -math.inf, 0.0, new)  # rows reached by nothing yet
    keep = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    take = torch.exp(bl - ref).transpose(1, 2).unsqueeze(-1)
    out.mul_(keep).add_(o * take)
    lse.copy_(new)


def ring_blocks(
    call: Call, pass_: str, q: Tensor, k: Tensor, n: int, bounds: tuple[int, ...], rows: int
) -> Blocks:
    """The blocks of one ring pass of ``call`` on this rank's shard: ``n`` the global length,
    ``bounds`` where every rank's pieces start and end, ``rows`` a divisor of every piece."""
    r = route_blocks(pass_, q, k, call.pattern, n, bounds, rows) if call.every_head else None
    dense = r if r is not None and r.dense else None
    return Blocks(call, ops.op_args(call, q.device), dense)
