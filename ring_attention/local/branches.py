"""The local op, through our kernels or through dense attention per branch on strided views
(docs/design.md §5): the forward runs every dense call of a span into its part buffers and
``merge_branches`` combines them by log-sum-exp; the backward hands every call the merged
``out`` and ``lse`` and ``sum_branches`` adds the calls' gradients."""

import contextlib
import time
from collections import defaultdict
from typing import Any, NamedTuple

import torch

from ..core.cache import LRUCache
from ..core.dtypes import acc_dtype
from ..core.pattern import Pattern
from . import ops
from .backends import KvFinite, aligned, backend
from .spans import Call, Geometry, Route, batch_groups


class PhaseTimes:
    """Seconds the dense path spends per phase (``calls``, ``merge``, ``finite``) while
    :func:`phase_times` is active: CUDA events on GPUs, a clock elsewhere."""

    def __init__(self) -> None:
        self._spans: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def span(self, phase: str, device: torch.device):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._spans.append((phase, start, end))

    def totals(self) -> dict[str, float]:
        """Seconds per phase so far (synchronises CUDA)."""
        out: dict[str, float] = defaultdict(float)
        for phase, a, b in self._spans:
            if isinstance(a, float):
                out[phase] += b - a  # type: ignore[operator]
            else:
                b.synchronize()  # type: ignore[attr-defined]
                out[phase] += a.elapsed_time(b) / 1000  # type: ignore[attr-defined]
        return dict(out)


_TIMES: list[PhaseTimes] = []


@contextlib.contextmanager
def phase_times():
    """Collect :class:`PhaseTimes` of the dense passes run inside the block."""
    times = PhaseTimes()
    _TIMES.append(times)
    try:
        yield times
    finally:
        _TIMES.remove(times)


def _span(phase: str, device: torch.device):
    return _TIMES[-1].span(phase, device) if _TIMES else contextlib.nullcontext()


class Program(NamedTuple):
    """The dense calls of one pass as plain geometry: per span its part rows (of the outputs,
    their LSE and the K/V side), whether branch 0 writes into ``out`` and its launches
    ``(backend, geometry of each argument)``; the most rows a span's buffers need."""

    q_rows: int
    lse_rows: int
    kv_rows: int
    spans: tuple[tuple[int, int, int, bool, tuple[tuple[Any, ...], ...]], ...]


def _program(pass_: str, r: Route, *tensors: torch.Tensor) -> Program:
    """The :class:`Program` of ``pass_`` of route ``r`` on these tensors, cached per route, pass
    and tensor layout."""
    key = (pass_, r.spans, r.backends, layout_key(tensors))
    return _PROGRAMS.get(key, lambda: _build(pass_, r, tensors))


def layout_key(tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """What a :class:`Program` depends on in its tensors."""
    return tuple((t.shape, t.stride(), t.storage_offset(), t.dtype, t.device) for t in tensors)


def _build(pass_: str, r: Route, tensors: tuple[torch.Tensor, ...]) -> Program:
    assert r.spans is not None
    backward = pass_ == "backward"
    batch, d = tensors[0].shape[0], tensors[0].shape[3]
    # the inputs read (K/V-shaped or not): (grad_out, q, k, v, out) or (q, k, v)
    sides = (False, False, True, True, False) if backward else (False, True, True)

    def view(call: Call, t: torch.Tensor, kv: bool = False) -> Geometry:
        size, stride, offset = call.geometry(t.shape, t.stride(), kv)
        return size, stride, offset + t.storage_offset()

    spans = []
    for span, names in zip(r.spans.spans, r.backends, strict=True):
        calls = [(span.calls[j], names[j]) for j in span.part_order()]
        in_place = not backward and any(c.branch == 0 for c, _ in calls)
        launches, q_base, kv_base, parts_rows = [], 0, 0, 0
        for call, name in calls:
            geoms = [view(call, t, kv) for t, kv in zip(tensors, sides, strict=False)]
            lse_part = call.part_geometry(q_base, batch, False, None)
            if backward:
                geoms += [lse_part, call.part_geometry(q_base, batch, False, d)]
                geoms += [call.part_geometry(kv_base, batch, True, d)] * 2
            else:
                into_out = in_place and call.branch == 0
                if into_out:  # out's rows of the call, laid out as its parts
                    (b, s, rows, h, dd), (sb, ss, sr, sh, sd), offset = view(call, tensors[3])
                    og = (b, s, h, rows, dd), (sb, ss, sh, sr, sd), offset
                else:
                    og = call.part_geometry(q_base, batch, False, d)
                    parts_rows = q_base + call.part_rows(batch)
                geoms += [og, lse_part]
                name = (name, into_out)
            launches += [(name, *g) for g in batch_groups(geoms)]
            q_base += call.part_rows(batch)
            kv_base += call.part_rows(batch, True)
        parts_rows = parts_rows if in_place else q_base
        spans.append((parts_rows, q_base, kv_base, in_place, tuple(launches)))
    return Program(*(max((s[i] for s in spans), default=0) for i in range(3)), tuple(spans))


_PROGRAMS: LRUCache[Program] = LRUCache(64, name="dense programs")


def dense_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern, scale: float, r: Route
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and ``lse`` of the local op by the dense calls of ``r``."""
    batch, n, heads, d = q.shape
    device, causal = q.device, pattern.causal
    acc = acc_dtype(q.dtype)
    out = torch.empty_like(q)
    prog = _program("forward", r, q, k, v, out)
    fns = {name: backend(name).forward for names in r.backends for name in set(names)}
    lse = torch.empty(batch, heads, n, dtype=acc, device=device)
    # one pair of part buffers for every span (the stream orders each
    # span's merge before the next span's calls write)
    parts = torch.empty(prog.q_rows, d, dtype=q.dtype, device=device)
    part_lse = torch.empty(prog.lse_rows, dtype=acc, device=device)
    for i, (span, (rows, lse_rows, _, in_place, launches)) in enumerate(
        zip(r.spans.spans, prog.spans, strict=True)
    ):
        with _span("calls", device):
            for (name, into_out), *geoms in launches:
                bufs = (q, k, v, out if into_out else parts, part_lse)
                views = [t.as_strided(*g) for t, g in zip(bufs, geoms, strict=True)]
                fns[name](*views[:3], causal, scale, *views[3:])
        q_index = r.spans.index(i, batch, device)[0]
        a, length = span.start, span.length
        with _span("merge", device):
            ops.merge_branches(
                parts[:rows], part_lse[:lse_rows], q_index, out[:, a : a + length],
                lse[:, :, a : a + length].transpose(1, 2), in_place,
            )  # fmt: skip
    return out, lse


def dense_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, pattern: Pattern, scale: float, r: Route,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``dq``, ``dk``, ``dv`` of the local op by the dense calls of ``r``, given the merged
    ``out`` and ``lse``."""
    batch, _, _, d = q.shape
    device, causal = q.device, pattern.causal
    if grad_out.stride(-1) != 1 or (device.type == "cuda" and not aligned(grad_out)):
        # one copy here rather than one in every dense call that reads it
        grad_out = grad_out.clone(memory_format=torch.contiguous_format)
    prog = _program("backward", r, grad_out, q, k, v, out)
    fns = {name: backend(name).backward for names in r.backends for name in set(names)}
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    gq = torch.empty(prog.q_rows, d, dtype=q.dtype, device=device)
    gk = torch.empty(prog.kv_rows, d, dtype=q.dtype, device=device)
    gv = torch.empty_like(gk)
    for i, (span, (q_rows, _, kv_rows, _, launches)) in enumerate(
        zip(r.spans.spans, prog.spans, strict=True)
    ):
        with _span("calls", device):
            # the merged lse of every part row, in the parts' order: one
            # gather a span (4 bytes a row), each call's rows contiguous
            part_lse = torch.take(lse, r.spans.lse_index(i, batch, device))
            bufs = (grad_out, q, k, v, out, part_lse, gq, gk, gv)
            for name, *geoms in launches:
                views = [t.as_strided(*g) for t, g in zip(bufs, geoms, strict=True)]
                fns[name](*views[:6], causal, scale, *views[6:])
        q_index, _, kv_index, _ = r.spans.index(i, batch, device)
        a, length = span.start, span.length
        with _span("merge", device):
            ops.sum_branches(gq[:q_rows], q_index, dq[:, a : a + length])
            ops.sum_branches(gk[:kv_rows], kv_index, dk[:, a : a + length])
            ops.sum_branches(gv[:kv_rows], kv_index, dv[:, a : a + length])
    return dq, dk, dv


class PerBranch:
    """The local op by the dense per-branch path where its route is dense, our kernels where K/V
    are not finite (checked once a call without stalling the device,
    :class:`~.backends.KvFinite`) or a gradient reaches ``lse``."""

    def __init__(self, pattern: Pattern, scale: float, args: ops.OpArgs, fwd: Route,
                 bwd: Route | None) -> None:  # fmt: skip
        self.pattern, self.scale, self.args = pattern, scale, args
        self.fwd, self.bwd = fwd, bwd
        self.finite: KvFinite | None = None  # K/V check: not queued yet

    def _finite(self, k: torch.Tensor, v: torch.Tensor) -> KvFinite:
        if self.finite is None:
            with _span("finite", k.device):
                self.finite = KvFinite(k, v)
        return self.finite

    def forward(self, q, k, v):
        if self.fwd.dense:
            finite = self._finite(k, v)
            res = dense_forward(q, k, v, self.pattern, self.scale, self.fwd)
            if finite:
                return res
        return ops.local_attention(q, k, v, self.args)

    def backward(self, grad_out, grad_lse, q, k, v, out, lse):
        bwd = self.bwd
        if bwd is not None and bwd.dense and grad_lse is None:
            finite = self._finite(k, v)
            if finite.known is not False:  # unread (the forward was ours) or finite
                res = dense_backward(grad_out, q, k, v, out, lse, self.pattern, self.scale, bwd)
                if finite:
                    return res
        return ops.local_attention_backward(grad_out, grad_lse, q, k, v, out, lse, self.args)
