"""PyTorch's fused SDPA as the baselines call it: over the whole sequence
(:func:`dense_sdpa`, the ``dense`` method) and per compacted chunk returning
its log-sum-exp (:func:`sdpa_with_lse`) with the backward from a given final
``out`` and ``lse`` (:func:`sdpa_bwd`), per device: the CPU flash kernel, one
CUDA backend's aten op (:data:`SDPA_BACKENDS`), flash-attn-4 (``fa4``), or a
float32 math reference elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SDPA_BACKENDS = ("flash", "cudnn", "efficient")  # CUDA kernels tried for gather / dense


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


def _lse_rows(lse: torch.Tensor, length: int) -> torch.Tensor:
    """Any backend's LSE ((B, H, L), padded (B, H, Lpad) or (B, H, L, 1)) -> (B, H, L)."""
    return lse.reshape(lse.shape[0], lse.shape[1], -1)[..., :length]


def _cuda_sdpa_fwd(backend: str, q, k, v, causal: bool, scale: float):
    """One CUDA SDPA backend's aten op, which (unlike F.sdpa) returns the LSE."""
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
    return out, _lse_rows(lse, q.shape[-2]), (backend, tuple(lse.shape), extra)


def _cuda_sdpa_bwd(do, q, k, v, out, lse, state, causal: bool, scale: float):
    aten = torch.ops.aten
    backend, lse_shape, extra = state
    buf = torch.zeros(lse_shape, dtype=torch.float32, device=q.device)
    _lse_rows(buf, lse.shape[-1]).copy_(lse)
    if backend == "flash":
        cq, ck, mq, mk, rng, unused = extra
        return aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, buf, cq, ck, mq, mk, 0.0, causal, rng, unused, scale=scale
        )
    if backend == "cudnn":
        cq, ck, mq, mk, seed, off = extra
        return aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, out, buf, seed, off, None, cq, ck, mq, mk, 0.0, causal, scale=scale
        )
    seed, off = extra
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        do, q, k, v, None, out, buf, seed, off, 0.0, [True, True, True, False], causal,
        scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _fa4_fwd(q, k, v, causal: bool, scale: float):
    """flash-attn-4 on ``(B, H, L, D)`` (it takes ``(B, L, H, D)``; the
    compacted chunks are contiguous in that layout): ``(out, lse, state)``."""
    from ring_attention.local import backends  # imported on use: it loads the extension

    out, lse = backends.fa4_interface().flash_attn_func(
        *(t.transpose(1, 2) for t in (q, k, v)), softmax_scale=scale, causal=causal,
        return_lse=True,
    )  # fmt: skip
    return out.transpose(1, 2), lse, ("fa4",)


def _fa4_bwd(do, q, k, v, out, lse, causal: bool, scale: float):
    from ring_attention.local import backends

    dq, dk, dv = backends.fa4_interface()._flash_attn_bwd(
        *(t.transpose(1, 2) for t in (q, k, v, out, do)), lse.float().contiguous(), scale, causal
    )
    return tuple(t.transpose(1, 2) for t in (dq, dk, dv))


def sdpa_with_lse(q, k, v, causal: bool, scale: float, backend: str | None = None):
    """Fused SDPA on ``(B, H, L, D)`` returning ``(out, lse, state)``; ``lse``
    float32 ``(B, H, L)``. ``backend`` picks the CUDA kernel (default efficient),
    or ``"fa4"``: flash-attn-4 (on whatever device its interface runs)."""
    if backend == "fa4":
        return _fa4_fwd(q, k, v, causal, scale)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse, None
    if q.device.type == "cuda" and q.dtype != torch.float64:
        return _cuda_sdpa_fwd(backend or "efficient", q, k, v, causal, scale)
    out, lse = _math_fwd(q, k, v, causal, scale)
    return out, lse, None


def sdpa_bwd(do, q, k, v, out, lse, state, causal: bool, scale: float):
    """Gradient of one SDPA call given the FINAL ``out`` / ``lse`` of its rows."""
    if state is not None and state[0] == "fa4":
        return _fa4_bwd(do, q, k, v, out, lse, causal, scale)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale
        )
    if q.device.type == "cuda" and q.dtype != torch.float64:
        return _cuda_sdpa_bwd(do, q, k, v, out, lse, state, causal, scale)
    return _math_bwd(do, q, k, v, out, lse, causal, scale)


def dense_sdpa(q, k, v, causal: bool = False, backend: str | None = None):
    """``F.scaled_dot_product_attention`` over the whole sequence, ``(B, N, H, D)``
    in and out; ``backend`` pins one CUDA kernel (:data:`SDPA_BACKENDS`)."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if backend is None:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[backend]
    with sdpa_kernel([kernel]):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
