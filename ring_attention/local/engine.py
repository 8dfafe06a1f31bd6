"""The one engine: every attention the package computes is a checked
:class:`~ring_attention.core.call.Call` run here (the C++ operator, or the per-branch dense
path where the dispatch table takes it). Nothing is checked here."""

import torch

from ..core.call import Call
from . import ops
from .branches import PerBranch
from .dispatch import route

Tensor = torch.Tensor


def attend(call: Call, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``call`` on ``q`` ``(B, Lq, H, D)``, ``k``, ``v`` ``(B, Lk, KVH, D)``,
    both differentiable, the call's sinks added."""
    out, lse = _attend(call, q, k, v)
    return (out, lse) if call.sinks is None else fold_sinks(out, lse, call.sinks)


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` with one more virtual key of value 0 and score ``sinks[h]`` (docs/design.md
    §1): ``lse' = logaddexp(lse, sinks[h])``, ``out' = out * exp(lse - lse')``; differentiable
    in all three."""
    z = sinks.to(lse.dtype)[None, :, None]
    folded = torch.logaddexp(lse, z)
    keep = torch.exp(torch.where(torch.isneginf(lse), -torch.inf, lse - folded))
    scaled = out.to(lse.dtype) * keep.transpose(1, 2).unsqueeze(-1)
    return scaled.to(out.dtype), folded


def _attend(call: Call, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    args = ops.op_args(call, q.device)
    rows = ops.Rows(call.q_start, call.k_start, call.q_starts)
    if call.documents is not None or not call.one_sequence:
        return ops.local_attention(q, k, v, args, rows)  # the kernels alone take these
    heads = (call.head_start, call.total_heads, call.total_kv_heads)
    fwd = route("forward", q, k, v, call.pattern, call.key_padding_mask, heads)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    bwd = route("backward", q, k, v, call.pattern, call.key_padding_mask, heads) if grad else None
    if fwd.dense or (bwd is not None and bwd.dense):
        return differentiable(PerBranch(call.pattern, call.scale, args, fwd, bwd), q, k, v)
    return ops.local_attention(q, k, v, args)


def differentiable(impl: PerBranch, q: Tensor, k: Tensor, v: Tensor):
    """``impl``'s ``(out, lse)`` under the package's attention autograd (:class:`ops.Attention`)."""
    return ops.Attention.apply(q, k, v, impl)


def ring(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, spec: str, needs_grad: bool
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the ring call registered as ``spec``, under
    :class:`~ring_attention.local.ops.RingFunction`."""
    return ops.RingFunction.apply(q, k, v, documents, spec, needs_grad)
