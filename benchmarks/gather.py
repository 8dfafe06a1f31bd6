"""The ``gather`` and ``fa4`` baselines: for every branch and head-offset
class the active rows of each segment are compacted, fused attention
(``sdpa.py``: SDPA, or flash-attn-4) runs on the compacted segments, and the
results are scattered back and merged by their log-sum-exp. Exact and
differentiable: the backward runs the fused backward per chunk with the
*final* merged ``out`` and ``lse``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sdpa import sdpa_bwd, sdpa_with_lse


def branch_classes(heads: int, segs, dils, head_groups: bool = False):
    """Yield ``(w, r, o, heads_of_class)`` for every branch and head-offset class
    (``Pattern.offset_classes``)."""
    from ring_attention.core.pattern import Pattern

    pattern = Pattern(segs, dils, head_groups=head_groups)
    for (w, r), classes in zip(pattern.branches, pattern.offset_classes(heads), strict=True):
        for o, hs in sorted(classes.items()):
            yield w, r, o, hs


def _chunks(n: int, heads: int, segs, dils, head_groups: bool, device):
    """Flat row indices ``pos * heads + h`` of every compacted SDPA call:
    ``(n_segments, a, heads_of_class)`` per chunk; full segments form one
    chunk, the ragged last segment another."""
    from ring_attention.core.geometry import segment_active_positions

    out = []
    for w, r, o, hs in branch_classes(heads, segs, dils, head_groups):
        h_idx = torch.tensor(hs, dtype=torch.long)
        for pos in segment_active_positions(n, w, r, o):
            out.append((pos[:, :, None] * heads + h_idx[None, None, :]).to(device))
    return out


def _gather(x_flat, idx, bsz):
    """``(B, N*H, D)`` -> ``(B*S, Hc, a, D)`` of the compacted rows."""
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
        states = []
        for idx in _chunks(n, heads, segs, dils, head_groups, q.device):
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
            dq, dk, dv = sdpa_bwd(doc, qc, kc, vc, oc, lc.to(acc_dtype), st, causal, scale)
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
    """Dilated attention by gather + fused SDPA per branch and offset class,
    merged by LSE: ``(B, N, H, D)`` in and out, the semantics of
    ``ra.dilated_attention`` (no key padding mask). ``backend``: the CUDA SDPA
    kernel (:data:`SDPA_BACKENDS`, default efficient; ignored elsewhere), or
    ``"fa4"`` for flash-attn-4."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, lse = _GatherSDPA.apply(
        q, k, v, tuple(int(s) for s in segs), tuple(int(r) for r in dils),
        bool(causal), scale, bool(head_groups), backend,
    )  # fmt: skip
    return (out, lse) if return_lse else out
