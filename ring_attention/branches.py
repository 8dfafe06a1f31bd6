"""The local op, through our kernels or through dense attention per branch on
strided views (docs/design.md §5): :func:`local_attention` is the one call
``functional.attend`` makes.

The per-branch path: the view planner (ring_attention/views.py) cuts the
sequence into windows of whole segments and each window into dense calls,
one per (branch, head-offset class, head run, full segments | short last
segment), each a strided view of q, k, v (no gather, no copy). The forward
runs every call of a window on its dense backend (ring_attention/backends.py,
chosen by ring_attention/dispatch.py), each writing its output and LSE into
the window's part buffers, then one merge operator
(``torch.ops.ring_attention.merge_branches``) combines the parts of each
(position, head) by their log-sum-exp in fp32 and writes ``out`` and ``lse``
once. The backward hands every call the merged ``out`` and ``lse`` (its ``P
= exp(S - lse)`` is then the multiset softmax's probability and its ``D =
rowsum(dO * out)`` the merged one, so the branches' gradients add up
exactly), and ``sum_branches`` adds the per-call ``dq``, ``dk``, ``dv``
parts into the gradients. Rows no branch reaches get ``out = 0``,
``lse = -inf`` and zero gradients.

Our kernels run the pass instead where the table says, or where the dense
backends cannot give the same answer (dispatch.py); K/V finiteness is
checked when a dense pass runs (a host sync) and a gradient reaching
``lse`` takes our backward kernel. A double backward raises, as the
kernel's does.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from . import ops
from .backends import backend, kv_finite
from .dispatch import Route, route
from .dtypes import acc_dtype
from .pattern import Pattern
from .views import Call, batched

__all__ = ["DenseBranches", "PhaseTimes", "local_attention", "phase_times"]


class PhaseTimes:
    """Seconds the dense path spends per phase while :func:`phase_times` is
    active: ``calls`` (the dense backends), ``merge`` (the merge operators),
    ``finite`` (the check of K and V for NaN and infinity); CUDA events on
    GPUs (device time: what the host adds between them is the caller's wall
    time less these), a synchronised clock elsewhere."""

    def __init__(self) -> None:
        self._spans: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def span(self, phase: str, device: torch.device):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self._spans.append((phase, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._spans.append((phase, t0, time.perf_counter()))

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


def _groups(*views: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """``(B, S, ...)`` views as groups of ``(B * S, ...)`` views: one group
    where every view merges batch and segments without a copy, else one per
    batch row."""
    merged = [batched(v) for v in views]
    if all(len(m) == 1 for m in merged):
        return [tuple(m[0] for m in merged)]
    return [tuple(v[i] for v in views) for i in range(views[0].shape[0])]


def _parts(buf: torch.Tensor, base: int, call: Call, batch: int, kv: bool) -> torch.Tensor:
    """A call's rows of a part buffer as ``(B, S, heads, rows, ...)``."""
    heads = call.kv_heads if kv else call.q_heads
    count = call.part_rows(batch, kv)
    return buf[base : base + count].view(batch, call.segments, heads, call.rows, *buf.shape[1:])


def dense_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern, scale: float, r: Route
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and ``lse`` of the local op by the dense calls of ``r``."""
    batch, n, heads, d = q.shape
    acc = acc_dtype(q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, n, dtype=acc, device=q.device)
    for i, (window, names) in enumerate(zip(r.plan.windows, r.backends, strict=True)):
        q_index, q_rows, _, _ = r.plan.index(i, batch, q.device)
        parts = torch.empty(q_rows, d, dtype=q.dtype, device=q.device)
        part_lse = torch.empty(q_rows, dtype=acc, device=q.device)
        with _span("calls", q.device):
            base = 0
            for call, name in zip(window.calls, names, strict=True):
                o = _parts(parts, base, call, batch, False)
                lo = _parts(part_lse, base, call, batch, False)
                views = (call.view(q), call.view(k, True), call.view(v, True), o, lo)
                for qv, kv, vv, ov, lv in _groups(*views):
                    backend(name).forward(qv, kv, vv, pattern.causal, scale, ov, lv)
                base += call.part_rows(batch)
        a, length = window.start, window.length
        with _span("merge", q.device):
            ops.merge_branches(
                parts, part_lse, q_index, out[:, a : a + length],
                lse[:, :, a : a + length].transpose(1, 2),
            )  # fmt: skip
    return out, lse


def dense_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pattern: Pattern,
    scale: float,
    r: Route,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq``, ``dk``, ``dv`` of the local op by the dense calls of ``r``,
    given the merged ``out`` and ``lse``."""
    batch, _, _, d = q.shape
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for i, (window, names) in enumerate(zip(r.plan.windows, r.backends, strict=True)):
        q_index, q_rows, kv_index, kv_rows = r.plan.index(i, batch, q.device)
        gq = torch.empty(q_rows, d, dtype=q.dtype, device=q.device)
        gk = torch.empty(kv_rows, d, dtype=q.dtype, device=q.device)
        gv = torch.empty_like(gk)
        with _span("calls", q.device):
            q_base = kv_base = 0
            for call, name in zip(window.calls, names, strict=True):
                views = (
                    call.view(grad_out), call.view(q), call.view(k, True), call.view(v, True),
                    call.view(out), call.lse_view(lse).contiguous(),  # 4 bytes a row
                    _parts(gq, q_base, call, batch, False),
                    _parts(gk, kv_base, call, batch, True), _parts(gv, kv_base, call, batch, True),
                )  # fmt: skip
                for do_, qv, kv, vv, ov, lv, gqv, gkv, gvv in _groups(*views):
                    backend(name).backward(
                        do_, qv, kv, vv, ov, lv, pattern.causal, scale, gqv, gkv, gvv
                    )
                q_base += call.part_rows(batch)
                kv_base += call.part_rows(batch, True)
        a, length = window.start, window.length
        with _span("merge", q.device):
            ops.sum_branches(gq, q_index, dq[:, a : a + length])
            ops.sum_branches(gk, kv_index, dk[:, a : a + length])
            ops.sum_branches(gv, kv_index, dv[:, a : a + length])
    return dq, dk, dv


class DenseBranches(torch.autograd.Function):
    """The local op with its forward and / or its backward by the dense
    per-branch path (``fwd.dense``, ``bwd.dense``): :func:`dense_forward` and
    :func:`dense_backward` where K/V are finite, our kernels otherwise, and
    our backward kernel too when a gradient reaches ``lse``."""

    @staticmethod
    def forward(ctx, q, k, v, pattern: Pattern, scale: float, fwd: Route, bwd: Route | None):
        if fwd.dense:
            with _span("finite", q.device):
                finite = kv_finite(k, v)
        else:
            finite = None
        if finite:
            out, lse = dense_forward(q, k, v, pattern, scale, fwd)
        else:
            out, lse = ops.local_attention(q, k, v, ops.op_args(pattern, scale, None, q.device))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pattern, ctx.scale, ctx.bwd, ctx.finite = pattern, scale, bwd, finite
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if torch.is_grad_enabled():
            raise RuntimeError(ops.DOUBLE_BACKWARD_ERROR)
        if grad_out is None and grad_lse is None:
            return (None,) * 7
        q, k, v, out, lse = ctx.saved_tensors
        pattern, scale, bwd = ctx.pattern, ctx.scale, ctx.bwd
        dense = bwd is not None and bwd.dense and grad_lse is None
        if dense:
            if ctx.finite is None:  # the forward was ours: not checked yet
                with _span("finite", q.device):
                    ctx.finite = kv_finite(k, v)
            dense = ctx.finite
        if dense:
            dq, dk, dv = dense_backward(grad_out, q, k, v, out, lse, pattern, scale, bwd)
        else:
            if grad_out is None:
                grad_out = torch.zeros_like(out)
            dq, dk, dv = ops.local_attention_backward(
                grad_out, grad_lse, q, k, v, out, lse, ops.op_args(pattern, scale, None, q.device)
            )
        return dq, dk, dv, None, None, None, None


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: Pattern,
    scale: float,
    key_padding_mask: torch.Tensor | None,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and ``lse`` of the local op on checked inputs: our operator, or
    the dense per-branch path for the passes whose route is dense.
    ``documents``: a traced ``cu_seqlens`` tensor replacing the pattern's
    (:func:`ring_attention.ops.op_args`), which our operator takes."""
    args = ops.op_args(pattern, scale, key_padding_mask, q.device, documents)
    if documents is not None:  # traced: the graph keeps the operator
        return ops.local_attention(q, k, v, args)
    fwd = route("forward", q, k, v, pattern, key_padding_mask)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    bwd = route("backward", q, k, v, pattern, key_padding_mask) if grad else None
    if fwd.dense or (bwd is not None and bwd.dense):
        return DenseBranches.apply(q, k, v, pattern, scale, fwd, bwd)
    return ops.local_attention(q, k, v, args)
