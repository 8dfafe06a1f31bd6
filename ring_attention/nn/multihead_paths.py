"""The attention paths of :class:`~ring_attention.nn.multihead.MultiheadDilatedAttention`
on one checked call (``multihead_call.py``), both exact, and its outputs.

- :func:`kernel_attention`: the C++ operators, O(n) memory for a dilated
  pattern (``ring_attention.attend`` on one process, the ring when sharded);
- :func:`dense_path`: the materialised ``(batch, heads, L, S)`` scores of
  ``ring_attention.dense_attention``, for what the kernels do not take;
- :func:`outputs`: the output projection and the return values, in
  ``nn.MultiheadAttention``'s memory layout.
"""

from __future__ import annotations

import torch
from torch import nn

from ..local.functional import attend
from ..parallel.api import sharded_attention
from .dense import dense_attention
from .multihead_call import Call
from .multihead_options import call_pattern, compute_dtype, module_pattern

__all__ = ["dense_path", "kernel_attention", "outputs"]


def kernel_attention(m: nn.MultiheadAttention, call: Call, cu_seqlens) -> torch.Tensor:
    """The C++ operators on the ``(batch, seq, embed)`` projections: one
    process, or the ring when sharded."""
    B, L, E = call.q.shape
    cdt = compute_dtype(m, call.q)
    # Contiguous: the projections are (L, N, E)-major views, and the
    # operators' Meta kernels (torch.compile) give their outputs the
    # inputs' strides while the CPU/CUDA kernels return contiguous ones.
    q, k, v = (
        t.reshape(B, L, m.num_heads, m.head_dim).to(cdt).contiguous()
        for t in (call.q, call.k, call.v)
    )
    if m._sharded:  # pattern errors are reported on every rank
        # (query and key have one length here: _check_group_call)
        out = sharded_attention(
            q, k, v, module_pattern, (m, call.causal), cu_seqlens=cu_seqlens, scale=None,
            group=m.group, ulysses_group=m.ulysses_group, mesh=m.mesh, layout="contiguous",
            return_lse=False,
        )  # fmt: skip
    else:
        out = attend(q, k, v, call_pattern(m, call, cu_seqlens), key_padding_mask=call.bool_kpm)
    return out.reshape(B, L, E)


def dense_path(m: nn.MultiheadAttention, call: Call, need_weights: bool, cu_seqlens):
    """``ring_attention.dense_attention`` on the projections: weights, masks,
    dropout, the extra keys; ``(out, weights)``."""
    pattern = m.pattern
    if pattern is not None or cu_seqlens is not None:
        pattern = call_pattern(m, call, cu_seqlens)
    return dense_attention(
        call.q,
        call.k,
        call.v,
        num_heads=m.num_heads,
        compute_dtype=compute_dtype(m, call.q),
        key_padding_mask=call.kpm,
        attn_mask=call.attn_mask,
        causal=call.causal,
        dropout_p=m.dropout if m.training else 0.0,
        need_weights=need_weights,
        bias_k=m.bias_k,
        bias_v=m.bias_v,
        add_zero_attn=m.add_zero_attn,
        pattern=pattern,
    )


def outputs(m: nn.MultiheadAttention, out, weights, call: Call, average_attn_weights: bool):
    """The output projection and the return values, in the memory layout
    ``nn.MultiheadAttention`` gives them: a contiguous ``(N, L, E)`` where
    it runs its fused kernel, else projected as ``(L, N, E)`` (a transposed
    view of that with ``batch_first``)."""
    B, L, E = out.shape
    out = out.to(call.q.dtype)
    if call.batch_major:
        y = m.out_proj(out)
    else:
        y = m.out_proj(out.transpose(0, 1).reshape(L * B, E)).view(L, B, E)
        if not call.batched:
            y = y.squeeze(1)
        elif m.batch_first:
            y = y.transpose(0, 1)
    if call.lengths is not None:
        y = torch.nested.as_nested_tensor(
            [y[i, :n] for i, n in enumerate(call.lengths)], layout=torch.strided
        )
    if weights is not None:
        weights = weights.to(call.q.dtype)
        if call.lengths is not None:  # padding queries: no weights, as the fused path
            weights = weights.masked_fill(call.bool_kpm[:, None, :, None], 0.0)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if not call.batched:
            weights = weights.squeeze(0)
    return y, weights
