"""The local op through PyTorch's fused SDPA, per branch: its forward and its
backward, each where a measurement says it beats our kernel.

Both run SDPA per (branch, head-offset class) on the compacted active rows of
each segment (one call for a branch's full segments, one for a short last
segment), one window of whole longest segments at a time, so that the gathered
rows and the float32 accumulators stay bounded: at least 131072 rows and about
1/16 of the sequence per window (every segment length divides the longest, as
in LongNet).

**Backward** (``RING_ATTENTION_BACKWARD``). Measured on an H100
(benchmarks/RESULTS.md, 2026-11-25 and 2026-11-26 (seventh)): our forward
kernel beats gather + SDPA at head_dim 64, but our backward kernel is the slow
half; PyTorch's flash-attention backward run per branch makes forward+backward
1.5-1.6x faster (n = 131072 and 512K, h 12 d 64 and h 16 d 128, bf16). It is given the FINAL merged
``out`` and ``lse``: its ``P = exp(S - lse)`` is then the multiset softmax's
probability and its ``D = rowsum(dO * out)`` the merged one, so the per-branch
gradients add up exactly (as in ring and flash attention). ``auto`` (default)
takes it on CUDA for fp16/bf16, head_dim a multiple of 8 up to 128.

**Forward** (``RING_ATTENTION_FORWARD``). In the same measurements SDPA's
flash forward beat our forward kernel at head_dim 128 from n = 131072 on (ours
0.85-0.90x on 2026-11-25; 0.92x with the reworked kernel of 2026-11-26; at
32K ours ties flash (and flash-attn-4), cuDNN's forward is 1.14x faster; at
head_dim 64 ours is 1.11-1.62x the best). ``auto`` takes
SDPA's flash forward there (CUDA, fp16/bf16, head_dim 128, n >= 131072): per
branch ``(out_b, lse_b)``, merged into ``out`` and ``lse`` by their
log-sum-exp in float32, rows that reach no key left at ``out = 0``,
``lse = -inf``.

Each variable is ``auto``, ``kernel`` (always ours) or ``sdpa`` (SDPA wherever
it applies, the CPU included: how the tests check it against the float64
oracle). Our kernel runs instead whenever SDPA cannot give the same answer: a
key padding mask, documents, segment lengths that do not nest, non-finite K/V
(checked once per call, a host sync: SDPA multiplies the zero weights of masked
keys by the values, spreading a non-finite key, or a NaN row's ``D`` in the
backward, to rows that do not reach it), and for the backward a gradient
reaching ``lse``. A double backward raises, as the kernel's does. Under
``torch.compile`` the operator runs (one traced op, no host sync); capturing a
CUDA graph needs both variables at ``kernel``.

The price is memory at short lengths: up to 131072 rows one window is the
whole sequence, and its gathered rows (the dilation-1 branch gathers every
row) and float32 accumulators come on top (H100, backward, 32K rows: peak 3.0x
the bytes of q, k, v, out and their gradients, against 1.07x for the kernel
with the local operator's 8 fp32 chunks; its 1 GiB chunks on CUDA since make
that about 1.8x, arithmetic, not measured, and ``RING_ATTENTION_CHUNK_MIB=0``
restores the 8; at 2M rows 1.13x). Windows of 32768 rows halve that at 131072 rows but made
every pass 12-17 % slower (2026-11-26, ``scripts/sdpa_windows.py``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from . import ops
from .cache import LRUCache
from .pattern import Pattern

__all__ = [
    "BACKWARD_ENV",
    "FORWARD_ENV",
    "SDPA_BACKEND_ENV",
    "BranchSDPA",
    "backward_mode",
    "forward_mode",
    "sdpa_backward_applies",
    "sdpa_forward_applies",
]

BACKWARD_ENV = "RING_ATTENTION_BACKWARD"
FORWARD_ENV = "RING_ATTENTION_FORWARD"
MODES = ("auto", "kernel", "sdpa")
#: the CUDA SDPA kernel whose backward runs: flash (default) or efficient. Not
#: cuDNN's: on an H100 (2026-11-25) it was the fastest but disagreed with the
#: float64 oracle on 7 of 10 small ragged cases that flash and efficient passed.
SDPA_BACKEND_ENV = "RING_ATTENTION_SDPA_BACKEND"
SDPA_BACKENDS = ("flash", "efficient")
_CUDA_DTYPES = (torch.float16, torch.bfloat16)
# Rows per window: at least this many (the SDPA calls stay large), at most
# about 1/_WINDOWS of the sequence (the per-window buffers stay small).
_MIN_WINDOW_ROWS = 131072
_WINDOWS = 16
# Where auto takes SDPA's forward on CUDA (H100, benchmarks/RESULTS.md): at
# head_dim 128 from n = 131072 on, flash per branch 1.11-1.18x our kernel
# (2026-11-25) and 1.08x the reworked one (2026-11-26, 131072); at 32768 and
# at head_dim 64 ours is as fast or faster.
_FORWARD_HEAD_DIMS = (128,)
_FORWARD_MIN_ROWS = 131072


def _mode(env: str) -> str:
    mode = os.environ.get(env, "auto")
    if mode not in MODES:
        raise ValueError(f"{env} must be one of {list(MODES)}, got {mode!r}")
    return mode


def backward_mode() -> str:
    """``RING_ATTENTION_BACKWARD``, checked."""
    return _mode(BACKWARD_ENV)


def forward_mode() -> str:
    """``RING_ATTENTION_FORWARD``, checked."""
    return _mode(FORWARD_ENV)


def _sdpa_backend() -> str:
    backend = os.environ.get(SDPA_BACKEND_ENV, "flash")
    if backend not in SDPA_BACKENDS:
        raise ValueError(
            f"{SDPA_BACKEND_ENV} must be one of {list(SDPA_BACKENDS)}, got {backend!r}"
        )
    return backend


def _nested(pattern: Pattern, n: int) -> bool:
    """Windows of whole longest segments hold whole segments of every branch."""
    longest = max(pattern.segment_lengths)
    return n <= longest or all(longest % w == 0 for w in pattern.segment_lengths)


def _sdpa_can_run(q: torch.Tensor, pattern: Pattern, key_padding_mask) -> bool:
    """Whether SDPA per branch gives this call's answer at all (eager mode,
    no mask, no documents, nested segments, CUDA kernels that take it)."""
    if torch.compiler.is_compiling():
        # graphs keep the operator (one traced op, no host sync)
        return False
    if key_padding_mask is not None or pattern.documents is not None or pattern.windowed:
        return False
    if q.numel() == 0 or not _nested(pattern, q.shape[1]):
        return False
    if q.device.type == "cuda":
        d = q.shape[-1]
        return (
            q.dtype in _CUDA_DTYPES
            and d % 8 == 0
            and d <= 128
            and torch.cuda.get_device_capability(q.device) >= (8, 0)
        )
    return q.device.type == "cpu"


def sdpa_backward_applies(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: Pattern,
    key_padding_mask: torch.Tensor | None,
) -> bool:
    """Whether :func:`attend` routes this call's backward through SDPA."""
    mode = backward_mode()
    if mode == "kernel" or not torch.is_grad_enabled():
        return False
    if not (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if not _sdpa_can_run(q, pattern, key_padding_mask):
        return False
    return q.device.type == "cuda" or mode == "sdpa"


def sdpa_forward_applies(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: Pattern,
    key_padding_mask: torch.Tensor | None,
) -> bool:
    """Whether :func:`attend` runs this call's forward through SDPA (K/V
    finite, checked when it runs)."""
    mode = forward_mode()
    if mode == "kernel":
        return False
    if mode == "auto" and not (
        q.device.type == "cuda"
        and q.shape[-1] in _FORWARD_HEAD_DIMS
        and q.shape[1] >= _FORWARD_MIN_ROWS
    ):
        return False
    return _sdpa_can_run(q, pattern, key_padding_mask)


# --------------------------------------------------------------------------- #
# which rows each SDPA call covers
# --------------------------------------------------------------------------- #
def _window_rows(n: int, longest: int) -> int:
    if n <= longest:
        return n
    rows = max(_MIN_WINDOW_ROWS, math.ceil(n / _WINDOWS))
    return min(math.ceil(rows / longest) * longest, math.ceil(n / longest) * longest)


def _build_calls(
    length: int, heads: int, kv_heads: int, pattern: Pattern, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For a window of ``length`` rows: one ``(q_index, kv_index)`` per SDPA
    call, each ``(segments, rows, heads_of_class)`` of flat row indices
    ``pos * heads + h`` (K/V: ``pos * kv_heads + h // group``). Full segments
    of a (branch, offset class) form one call, a short last segment another."""
    group = heads // kv_heads
    calls = []
    for b, (w, r) in enumerate(pattern.branches):
        by_offset: dict[int, list[int]] = {}
        for h in pattern.applies(b, heads):
            by_offset.setdefault(pattern.offset(h, b, heads), []).append(h)
        nfull, rem = divmod(length, w)
        for o, hs in sorted(by_offset.items()):
            h_idx = torch.tensor(hs, dtype=torch.long)
            parts = []
            if nfull:
                parts.append((torch.arange(nfull) * w)[:, None] + torch.arange(o, w, r)[None, :])
            if rem > o:
                parts.append(nfull * w + torch.arange(o, rem, r)[None, :])
            for pos in parts:
                pos = pos[:, :, None]
                calls.append(
                    (
                        (pos * heads + h_idx).to(device),
                        (pos * kv_heads + h_idx // group).to(device),
                    )
                )
    return calls


_CALLS: LRUCache[list[tuple[torch.Tensor, torch.Tensor]]] = LRUCache(
    16,
    max_bytes=1 << 30,
    size_of=lambda calls: sum(a.nbytes + b.nbytes for a, b in calls),
)


def _calls(length, heads, kv_heads, pattern, device):
    key = (length, heads, kv_heads, pattern, str(device))
    return _CALLS.get(key, lambda: _build_calls(length, heads, kv_heads, pattern, device))


def _windows(n: int, heads: int, kv_heads: int, pattern: Pattern, device: torch.device):
    """Per window of whole longest segments: its first position and length,
    the slices of its flat query rows (``pos * heads + h``) and K/V rows, and
    its SDPA calls (indices relative to the window)."""
    rows = _window_rows(n, max(pattern.segment_lengths))
    for a in range(0, n, rows):
        length = min(rows, n - a)
        q_rows = slice(a * heads, (a + length) * heads)
        kv_rows = slice(a * kv_heads, (a + length) * kv_heads)
        yield a, length, q_rows, kv_rows, _calls(length, heads, kv_heads, pattern, device)


def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    """The accumulators' dtype: float64 for float64, else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- #
# one SDPA backward on (B, H, L, D) rows
# --------------------------------------------------------------------------- #
_TEMPLATES: dict[tuple[str, str, torch.dtype, int], tuple[tuple[Any, ...], bool]] = {}


def _template(
    backend: str, device: torch.device, dtype: torch.dtype, d: int
) -> tuple[tuple[Any, ...], bool]:
    """The forward's side outputs (RNG state, sequence offsets) that a CUDA
    backend's backward takes, from one tiny forward per (backend, device,
    dtype, head_dim): with no dropout and no nesting they do not depend on
    the shapes. Also whether its LSE rows are padded (the efficient kernel's)."""
    key = (backend, str(device), dtype, d)
    if key not in _TEMPLATES:
        x = torch.zeros(1, 1, 8, d, dtype=dtype, device=device)
        aten = torch.ops.aten
        if backend == "flash":
            _, lse, cq, ck, _, _, rng, unused, _ = aten._scaled_dot_product_flash_attention(
                x, x, x, 0.0, False, False
            )
            side = (cq, ck, rng, unused)
        else:
            _, lse, seed, off = aten._scaled_dot_product_efficient_attention(
                x, x, x, None, True, 0.0, False
            )
            side = (seed, off)
        _TEMPLATES[key] = (side, lse.shape[-1] != 8)
    return _TEMPLATES[key]


def _lse_buffer(lse: torch.Tensor, padded: bool) -> torch.Tensor:
    """``(B, H, L)`` float32 into the backend's layout (padded to a multiple
    of 32 rows for the efficient kernel)."""
    if padded:
        rows = math.ceil(lse.shape[-1] / 32) * 32
        buf = lse.new_zeros(*lse.shape[:-1], rows)
        buf[..., : lse.shape[-1]] = lse
        lse = buf
    return lse.contiguous()


def _sdpa_forward(q, k, v, causal: bool, scale: float):
    """``out`` and ``lse`` (float32; float64 for float64) of one SDPA call."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    # (out, logsumexp, then what only its backward takes)
    res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _sdpa_backward(do, q, k, v, out, lse, causal: bool, scale: float, backend: str):
    """dq, dk, dv of one SDPA call given its rows' final ``out`` and ``lse``
    (``backend``: the CUDA kernel, :data:`SDPA_BACKENDS`; unused on the CPU)."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale
        )
        return dq, dk, dv
    side, padded = _template(backend, q.device, q.dtype, q.shape[-1])
    lse = _lse_buffer(lse.float(), padded)
    lq, lk = q.shape[2], k.shape[2]
    if backend == "flash":
        cq, ck, rng, unused = side
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, lse, cq, ck, lq, lk, 0.0, causal, rng, unused, scale=scale
        )
    else:
        seed, off = side
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out, lse, seed, off, 0.0, [True, True, True, False], causal,
            scale=scale,
        )  # fmt: skip
    return dq, dk, dv


# --------------------------------------------------------------------------- #
# the whole backward
# --------------------------------------------------------------------------- #
def _gather(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``(B, rows, D)`` and ``(S, a, c)`` indices -> ``(B*S, c, a, D)``."""
    s, a, c = idx.shape
    g = flat.index_select(1, idx.reshape(-1))
    return g.view(flat.shape[0] * s, a, c, flat.shape[-1]).transpose(1, 2)


def _scatter_rows(x: torch.Tensor, bsz: int) -> torch.Tensor:
    """``(B*S, c, a, D)`` -> ``(B, S*a*c, D)`` in the order of its indices."""
    return x.transpose(1, 2).reshape(bsz, -1, x.shape[-1])


def sdpa_dilated_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pattern: Pattern,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of ``dilated_attention`` (no mask, no documents, nested
    segments) by SDPA's backward per branch and offset class, one window of
    whole longest segments at a time."""
    bsz, n, heads, d = q.shape
    kv_heads = k.shape[2]
    acc = _acc_dtype(q)
    q_f, o_f, do_f = (t.reshape(bsz, n * heads, d) for t in (q, out, grad_out))
    k_f, v_f = (t.reshape(bsz, n * kv_heads, d) for t in (k, v))
    lse_f = lse.transpose(1, 2).reshape(bsz, n * heads)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backend = _sdpa_backend() if q.device.type == "cuda" else "cpu"
    for a, length, q_rows, kv_rows, calls in _windows(n, heads, kv_heads, pattern, q.device):
        g_q = torch.zeros(bsz, length * heads, d, dtype=acc, device=q.device)
        g_k = torch.zeros(bsz, length * kv_heads, d, dtype=acc, device=q.device)
        g_v = torch.zeros_like(g_k)
        # views of this window's rows: the cached indices are window-relative
        win = [t[:, q_rows] for t in (q_f, o_f, do_f)]
        kv = [t[:, kv_rows] for t in (k_f, v_f)]
        lse_w = lse_f[:, q_rows]
        for qi, ki in calls:
            qc, oc, doc = (_gather(t, qi) for t in win)
            kc, vc = (_gather(t, ki) for t in kv)
            s, rws, c = qi.shape
            lc = lse_w.index_select(1, qi.reshape(-1)).view(bsz * s, rws, c).transpose(1, 2)
            gq, gk, gv = _sdpa_backward(doc, qc, kc, vc, oc, lc, pattern.causal, scale, backend)
            g_q.index_add_(1, qi.reshape(-1), _scatter_rows(gq, bsz).to(acc))
            g_k.index_add_(1, ki.reshape(-1), _scatter_rows(gk, bsz).to(acc))
            g_v.index_add_(1, ki.reshape(-1), _scatter_rows(gv, bsz).to(acc))
        dq[:, a : a + length] = g_q.view(bsz, length, heads, d)
        dk[:, a : a + length] = g_k.view(bsz, length, kv_heads, d)
        dv[:, a : a + length] = g_v.view(bsz, length, kv_heads, d)
    return dq, dk, dv


def sdpa_dilated_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and ``lse`` of ``dilated_attention`` (no mask, no documents,
    nested segments, finite K/V) by SDPA's forward per branch and offset
    class, merged by log-sum-exp, one window of whole longest segments at a
    time."""
    bsz, n, heads, d = q.shape
    kv_heads = k.shape[2]
    acc = _acc_dtype(q)
    q_f = q.reshape(bsz, n * heads, d)
    k_f, v_f = (t.reshape(bsz, n * kv_heads, d) for t in (k, v))
    out = torch.empty_like(q)
    lse = torch.empty(bsz, heads, n, dtype=acc, device=q.device)
    for a, length, q_rows, kv_rows, calls in _windows(n, heads, kv_heads, pattern, q.device):
        # the window's rows as merged so far: a row no branch reaches keeps
        # out = 0, lse = -inf
        o_w = torch.zeros(bsz, length * heads, d, dtype=acc, device=q.device)
        l_w = torch.full((bsz, length * heads), -math.inf, dtype=acc, device=q.device)
        q_w = q_f[:, q_rows]
        kv = [t[:, kv_rows] for t in (k_f, v_f)]
        for qi, ki in calls:
            kc, vc = (_gather(t, ki) for t in kv)
            oc, lc = _sdpa_forward(_gather(q_w, qi), kc, vc, pattern.causal, scale)
            # every row of a call reaches a key (its own), and a call holds
            # a row once: merge by gathering its rows and writing them back
            idx = qi.reshape(-1)
            lc = lc.transpose(1, 2).reshape(bsz, -1).to(acc)
            l_old = l_w.index_select(1, idx)
            l_new = torch.logaddexp(l_old, lc)
            o_new = o_w.index_select(1, idx) * (l_old - l_new).exp_().unsqueeze(-1)
            o_new += _scatter_rows(oc, bsz).to(acc) * (lc - l_new).exp_().unsqueeze(-1)
            o_w.index_copy_(1, idx, o_new)
            l_w.index_copy_(1, idx, l_new)
        out[:, a : a + length] = o_w.view(bsz, length, heads, d)
        lse[:, :, a : a + length] = l_w.view(bsz, length, heads).transpose(1, 2)
    return out, lse


def _finite(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether K and V hold no NaN and no infinity (a host sync)."""
    return bool(torch.isfinite(k).all() & torch.isfinite(v).all())


class BranchSDPA(torch.autograd.Function):
    """The local op with its forward and / or its backward by SDPA per branch
    (``sdpa_forward``, ``sdpa_backward``): :func:`sdpa_dilated_forward` and
    :func:`sdpa_dilated_backward` where K/V are finite, our kernels otherwise,
    and our backward kernel too when a gradient reaches ``lse`` (SDPA's
    backward has no input for it)."""

    @staticmethod
    def forward(
        ctx, q, k, v, pattern: Pattern, scale: float, sdpa_forward: bool, sdpa_backward: bool
    ):
        finite = _finite(k, v) if sdpa_forward else None
        if finite:
            out, lse = sdpa_dilated_forward(q, k, v, pattern, scale)
        else:
            out, lse = ops.local_attention(q, k, v, ops.op_args(pattern, scale, None, q.device))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pattern, ctx.scale = pattern, scale
        ctx.sdpa_backward, ctx.finite = sdpa_backward, finite
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if torch.is_grad_enabled():
            raise RuntimeError(ops.DOUBLE_BACKWARD_ERROR)
        q, k, v, out, lse = ctx.saved_tensors
        pattern, scale = ctx.pattern, ctx.scale
        if grad_out is None and grad_lse is None:
            return (None,) * 7
        use_sdpa = ctx.sdpa_backward and grad_lse is None
        if use_sdpa:
            if ctx.finite is None:  # the forward was ours: not checked yet
                ctx.finite = _finite(k, v)
            use_sdpa = ctx.finite
        if use_sdpa:
            dq, dk, dv = sdpa_dilated_backward(grad_out, q, k, v, out, lse, pattern, scale)
        else:
            if grad_out is None:
                grad_out = torch.zeros_like(out)
            dq, dk, dv = ops.local_attention_backward(
                grad_out, grad_lse, q, k, v, out, lse, ops.op_args(pattern, scale, None, q.device)
            )
        return dq, dk, dv, None, None, None, None
