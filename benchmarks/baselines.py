"""Baselines for the dilated-attention benchmarks (DESIGN.md §3 and §7).

* :func:`gather_sdpa_dilated` — the "gather + dense kernel" baseline: for every
  branch and every head-offset class ``o = h mod r`` it compacts the active rows
  of each segment, runs PyTorch's fused SDPA kernel on the compacted segments
  (batched as ``(batch * n_segments, heads_of_class, w / r, head_dim)``, the
  ragged last segment as a separate call), scatters the results back and merges
  the branches by their log-sum-exp. It is exact (same multiset semantics as
  ``ra.dilated_attention``) and differentiable: the backward runs SDPA's fused
  backward per chunk with the *final* merged ``out`` and ``lse`` (as ring /
  flash attention do), which gives the exact gradient of the one-softmax
  definition, including the dependence of the branch weights on the scores.
* :func:`dense_sdpa` — plain SDPA over the whole sequence, ``(B, N, H, D)`` in
  and out. It equals dilated attention only for the dense pattern
  ``[(w >= n, 1)]``; for other patterns it is a cost reference only.
* :func:`pattern_pairs` — the exact number of reached (query, key) pairs of a
  pattern, for pattern FLOPs (4·d per pair forward, 2.5x that backward).

Device-agnostic: CPU uses ``aten._scaled_dot_product_flash_attention_for_cpu``
(and its backward); CUDA uses the memory-efficient kernel
(``aten._scaled_dot_product_efficient_attention``) unless ``backend=`` picks
flash or cuDNN (the ``aten`` op, so the LSE comes back); any other device falls back
to a plain (materialising) math implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ring_attention.patterns import head_group_bounds

LONGNET_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
LONGNET_DILATIONS = (1, 2, 4, 6, 12)

__all__ = [
    "LONGNET_DILATIONS",
    "LONGNET_SEGMENTS",
    "SDPA_BACKENDS",
    "dense_sdpa",
    "gather_sdpa_dilated",
    "pattern_pairs",
    "sdpa_with_lse",
]


# --------------------------------------------------------------------------- #
# pattern bookkeeping
# --------------------------------------------------------------------------- #
def _branch_classes(heads: int, segs, dils, head_groups: bool):
    """Yield ``(w, r, o, head_list)`` for every branch and head-offset class."""
    groups = head_group_bounds(heads, len(segs)) if head_groups else None
    for i, (w, r) in enumerate(zip(segs, dils, strict=True)):
        lo, hi = groups[i] if groups is not None else (0, heads)
        for o in range(r):
            hs = [h for h in range(lo, hi) if h % r == o]
            if hs:
                yield w, r, o, hs


def _n_active(length: int, o: int, r: int) -> int:
    """Number of offsets ``j`` in ``[0, length)`` with ``j mod r == o``."""
    return 0 if o >= length else (length - 1 - o) // r + 1


def pattern_pairs(
    n: int,
    heads: int,
    segs: Sequence[int],
    dils: Sequence[int],
    causal: bool,
    head_groups: bool = False,
    batch: int = 1,
) -> int:
    """Exact number of reached (query, key) pairs, counted with multiplicity.

    Sums over batch, heads and branches: for branch ``(w, r)``, head ``h`` and
    segment ``s`` with ``a`` active rows, ``a * a`` pairs (``a (a + 1) / 2``
    when causal). Segments longer than ``n`` are one ragged segment.
    """

    def per_seg(a: int) -> int:
        return a * (a + 1) // 2 if causal else a * a

    total = 0
    for w, r, o, hs in _branch_classes(heads, list(segs), list(dils), head_groups):
        nfull, rem = divmod(n, w)
        p = nfull * per_seg(_n_active(w, o, r)) + per_seg(_n_active(rem, o, r))
        total += len(hs) * p
    return batch * total


def _chunks(n: int, heads: int, segs, dils, head_groups: bool, device):
    """Flat row indices ``pos * heads + h`` of every compacted SDPA call.

    Each chunk is a long tensor of shape ``(n_segments, a, heads_of_class)``:
    the active rows (offset class ``o``) of ``n_segments`` equal-length
    segments. Full segments form one chunk, the ragged last segment another.
    """
    out = []
    for w, r, o, hs in _branch_classes(heads, segs, dils, head_groups):
        h_idx = torch.tensor(hs, dtype=torch.long)
        nfull, rem = divmod(n, w)
        parts = []
        if nfull:
            off = torch.arange(o, w, r)
            parts.append((torch.arange(nfull) * w)[:, None] + off[None, :])
        if rem > o:
            off = torch.arange(o, rem, r)
            parts.append(nfull * w + off[None, :])
        for pos in parts:
            idx = pos[:, :, None] * heads + h_idx[None, None, :]
            out.append(idx.to(device))
    return out


# --------------------------------------------------------------------------- #
# fused SDPA with LSE, per device
# --------------------------------------------------------------------------- #
def _math_fwd(q, k, v, causal, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.float())
    return out.to(q.dtype), lse


def _math_bwd(do, q, k, v, out, lse, causal, scale):
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    delta = (dof * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    return torch.matmul(ds, kf), torch.matmul(ds.transpose(-1, -2), qf), dv


SDPA_BACKENDS = ("flash", "cudnn", "efficient")


def _lse_rows(lse: torch.Tensor, length: int) -> torch.Tensor:
    """Any backend's LSE ((B, H, L), padded (B, H, Lpad) or (B, H, L, 1)) -> (B, H, L)."""
    return lse.reshape(lse.shape[0], lse.shape[1], -1)[..., :length]


def _cuda_sdpa_fwd(backend: str, q, k, v, causal: bool, scale: float):
    """One CUDA SDPA backend's fused op, which (unlike F.sdpa) returns the LSE."""
    aten = torch.ops.aten
    if backend == "flash":
        out, lse, cq, ck, mq, mk, rng, unused, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        extra = (cq, ck, mq, mk, rng, unused)
    elif backend == "cudnn":
        out, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        extra = (cq, ck, mq, mk, seed, off)
    elif backend == "efficient":
        out, lse, seed, off = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        extra = (seed, off)
    else:
        raise ValueError(f"unknown SDPA backend {backend!r}")
    state = (backend, tuple(lse.shape), extra)
    return out, _lse_rows(lse, q.shape[-2]), state


def _cuda_sdpa_bwd(do, q, k, v, out, lse, state, causal: bool, scale: float):
    aten = torch.ops.aten
    backend, lse_shape, extra = state
    buf = torch.zeros(lse_shape, dtype=torch.float32, device=q.device)
    _lse_rows(buf, lse.shape[-1]).copy_(lse)
    if backend == "flash":
        cq, ck, mq, mk, rng, unused = extra
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, buf, cq, ck, mq, mk, 0.0, causal, rng, unused, scale=scale
        )
    elif backend == "cudnn":
        cq, ck, mq, mk, seed, off = extra
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, out, buf, seed, off, None, cq, ck, mq, mk, 0.0, causal, scale=scale
        )
    else:
        seed, off = extra
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out, buf, seed, off, 0.0, [True, True, True, False], causal,
            scale=scale,
        )  # fmt: skip
    return dq, dk, dv


def sdpa_with_lse(q, k, v, causal: bool, scale: float, backend: str | None = None):
    """Fused SDPA on ``(B, H, L, D)`` (any strides) returning ``(out, lse, state)``.

    ``lse`` is float32 ``(B, H, L)``; ``state`` is what :func:`_sdpa_bwd` needs
    besides the tensors (the CUDA kernel's backend, lse padding and RNG state).
    ``backend`` (one of :data:`SDPA_BACKENDS`) picks the CUDA kernel for
    non-float64 CUDA inputs (default ``"efficient"``); it is ignored elsewhere.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse, None
    if q.device.type == "cuda" and q.dtype != torch.float64:
        return _cuda_sdpa_fwd(backend or "efficient", q, k, v, causal, scale)
    out, lse = _math_fwd(q, k, v, causal, scale)
    return out, lse, None


def _sdpa_bwd(do, q, k, v, out, lse, state, causal: bool, scale: float):
    """Gradient of one SDPA call given the FINAL ``out`` / ``lse`` of its rows."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale
        )
    if q.device.type == "cuda" and q.dtype != torch.float64:
        return _cuda_sdpa_bwd(do, q, k, v, out, lse, state, causal, scale)
    return _math_bwd(do, q, k, v, out, lse, causal, scale)


# --------------------------------------------------------------------------- #
# gather + SDPA + LSE merge
# --------------------------------------------------------------------------- #
def _gather(x_flat, idx, bsz):
    """``(B, N*H, D)`` -> ``(B*S, Hc, a, D)`` view of the compacted rows."""
    s, a, hc = idx.shape
    g = x_flat.index_select(1, idx.reshape(-1))
    return g.view(bsz * s, a, hc, x_flat.shape[-1]).transpose(1, 2)


def _flat_rows(x, bsz):
    """``(B*S, Hc, a, D)`` -> ``(B, S*a*Hc, D)``, matching the index order."""
    return x.transpose(1, 2).reshape(bsz, -1, x.shape[-1])


class _GatherSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segs, dils, causal, scale, head_groups, backend):
        bsz, n, heads, d = q.shape
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf, kf, vf = (t.reshape(bsz, n * heads, d) for t in (q, k, v))
        acc_out = torch.zeros(bsz, n * heads, d, dtype=acc_dtype, device=q.device)
        acc_lse = torch.full((bsz, n * heads), float("-inf"), dtype=acc_dtype, device=q.device)
        chunks = _chunks(n, heads, segs, dils, head_groups, q.device)
        states = []
        for idx in chunks:
            flat = idx.reshape(-1)
            o_c, l_c, st = sdpa_with_lse(
                _gather(qf, idx, bsz), _gather(kf, idx, bsz), _gather(vf, idx, bsz),
                causal, scale, backend,
            )  # fmt: skip
            states.append(st)
            o_c = _flat_rows(o_c, bsz).to(acc_dtype)
            l_c = l_c.transpose(1, 2).reshape(bsz, -1).to(acc_dtype)
            cur_lse = acc_lse.index_select(1, flat)
            new_lse = torch.logaddexp(cur_lse, l_c)
            safe = torch.where(torch.isneginf(new_lse), 0.0, new_lse)
            merged = acc_out.index_select(1, flat) * torch.exp(cur_lse - safe)[..., None]
            merged += o_c * torch.exp(l_c - safe)[..., None]
            acc_out.index_copy_(1, flat, merged)
            acc_lse.index_copy_(1, flat, new_lse)
            del o_c, l_c, cur_lse, new_lse, safe, merged
        out = acc_out.to(q.dtype).view(bsz, n, heads, d)
        del acc_out
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.cfg = (segs, dils, causal, scale, head_groups, states)
        lse = acc_lse.view(bsz, n, heads).permute(0, 2, 1).contiguous()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse_flat = ctx.saved_tensors
        segs, dils, causal, scale, head_groups, states = ctx.cfg
        bsz, n, heads, d = q.shape
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        flats = [t.reshape(bsz, n * heads, d) for t in (q, k, v, out)]
        do_f = grad_out.to(q.dtype).contiguous().view(bsz, n * heads, d)
        grads = [torch.zeros(bsz, n * heads, d, dtype=acc_dtype, device=q.device) for _ in range(3)]
        chunks = _chunks(n, heads, segs, dils, head_groups, q.device)
        for idx, st in zip(chunks, states, strict=True):
            flat = idx.reshape(-1)
            s, a, hc = idx.shape
            qc, kc, vc, oc = (_gather(t, idx, bsz) for t in flats)
            doc = _gather(do_f, idx, bsz)
            lc = lse_flat.index_select(1, flat).view(bsz * s, a, hc).transpose(1, 2)
            dq, dk, dv = _sdpa_bwd(doc, qc, kc, vc, oc, lc.to(acc_dtype), st, causal, scale)
            for acc, g in zip(grads, (dq, dk, dv), strict=True):
                acc.index_add_(1, flat, _flat_rows(g, bsz).to(acc_dtype))
        dq, dk, dv = (g.view(bsz, n, heads, d).to(q.dtype) for g in grads)
        return dq, dk, dv, None, None, None, None, None, None


def gather_sdpa_dilated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segs: Sequence[int],
    dils: Sequence[int],
    causal: bool = False,
    scale: float | None = None,
    head_groups: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Dilated attention by gather + fused SDPA per branch, merged by LSE.

    Same semantics and layout as ``ra.dilated_attention`` (``(B, N, H, D)``,
    multiset branches, per-head offsets ``h mod r``); no key padding mask.
    Differentiable w.r.t. ``q, k, v``. ``backend``: the CUDA SDPA kernel
    (:data:`SDPA_BACKENDS`; default ``"efficient"``), see :func:`sdpa_with_lse`.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, lse = _GatherSDPA.apply(
        q, k, v, tuple(int(s) for s in segs), tuple(int(r) for r in dils),
        bool(causal), scale, bool(head_groups), backend,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def dense_sdpa(q, k, v, causal: bool = False, scale: float | None = None):
    """Plain PyTorch SDPA over the whole sequence; ``(B, N, H, D)`` in and out.

    Equals dilated attention only for the dense pattern ``[(w >= n, 1)]``.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale
    )
    return out.transpose(1, 2)
