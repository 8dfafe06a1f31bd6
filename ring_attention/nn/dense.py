"""Exact attention with materialised scores: ``MultiheadDilatedAttention``'s
path for what needs the weights or what the kernels do not take."""

import math

import torch
import torch.nn.functional as F

from ..core.multiplicity import log_multiplicity
from ..core.pattern import Pattern


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_heads: int,
    compute_dtype: torch.dtype, key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None, causal: bool, dropout_p: float, need_weights: bool,
    bias_k: torch.Tensor | None = None, bias_v: torch.Tensor | None = None,
    add_zero_attn: bool = False, pattern: Pattern | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Attention of projected ``(batch, seq, embed)`` q/k/v as ``nn.MultiheadAttention`` computes
    it, a ``pattern`` as the ``log(multiplicity)`` bias; rows that reach nothing give zeros. Returns
    ``(out, weights (batch, heads, L, S) or None)``."""
    cdt = compute_dtype
    B, L, E = q.shape
    H, D = num_heads, E // num_heads
    kpm, am = key_padding_mask, attn_mask
    extra = int(bias_k is not None) + int(add_zero_attn)  # keys every query reaches
    if extra:
        am = None if am is None else F.pad(am, (0, extra))
        kpm = None if kpm is None else F.pad(kpm, (0, extra))
    if bias_k is not None:
        k = torch.cat([k, bias_k.expand(B, 1, E).to(k.dtype)], dim=1)
        v = torch.cat([v, bias_v.expand(B, 1, E).to(v.dtype)], dim=1)
    q, k, v = (t.reshape(B, t.shape[1], H, D).transpose(1, 2).to(cdt) for t in (q, k, v))
    if add_zero_attn:
        k, v = (torch.cat([t, q.new_zeros(B, H, 1, D)], dim=2) for t in (k, v))
    S = k.shape[2]

    bias = None
    if am is not None:
        bias = am.view(1, 1, L, S) if am.dim() == 2 else am.view(B, H, L, S)
    if kpm is not None:
        kb = kpm.view(B, 1, 1, S)
        bias = kb if bias is None else bias + kb
    if pattern is not None:
        logm = log_multiplicity(pattern, L, H, device=q.device, dtype=cdt)
        if S > L:  # add_bias_kv / add_zero_attn keys: reached once by every query
            logm = F.pad(logm, (0, S - L))
        logm = logm.unsqueeze(0)
        bias = logm if bias is None else bias + logm
        causal = False  # inside the multiplicity
    bias = None if bias is None else bias.to(cdt)
    empty = None if bias is None else torch.isneginf(bias).all(dim=-1, keepdim=True)

    if need_weights:
        scores = torch.matmul(q * math.sqrt(1.0 / D), k.transpose(-2, -1))
        if bias is not None:
            scores = scores + bias
        if empty is not None:  # rows reaching nothing: zero weights, finite gradients
            scores = scores.masked_fill(empty, 0.0)
        weights = torch.softmax(scores, dim=-1)
        if empty is not None:
            weights = weights.masked_fill(empty, 0.0)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.matmul(weights, v)
    else:
        weights = None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=causal
        )
        if empty is not None:
            out = out.masked_fill(empty, 0.0)
    out = out.transpose(1, 2).reshape(B, L, E)
    return out, weights
