"""Queries at an offset among their keys: a decode step (or a chunk of
queries continuing a cached prefix) attends its queries at their global
positions to the cached keys at theirs (a sliding-window cache holds only
the last keys), without recomputing the prefix.

One block of the block operators (:func:`ring_attention.ops.block_forward`
/ :func:`~ring_attention.ops.block_backward`, docs/design.md §2.5): queries at ``q_start``, keys at
``k_start``, the pattern (documents, padding) in its arguments."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .. import ops
from ..dtypes import acc_dtype

__all__ = ["offset_attention", "offset_attention_lse"]


def _block_ops(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int,
    op_args: ops.OpArgs, grad_out: torch.Tensor | None = None, out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None, grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The block operators: ``(out, lse)`` of the block, or with
    ``grad_out`` (and ``grad_lse``, the forward's ``out``, ``lse``) its
    ``(dq, dk, dv)``."""
    acc = acc_dtype(q.dtype)
    if grad_out is None:
        B, L, H, D = q.shape
        out = torch.zeros(B, L, H, D, dtype=acc, device=q.device)
        lse = torch.full((B, H, L), float("-inf"), dtype=acc, device=q.device)
        ops.block_forward(q, k, v, out, lse, q_start, k_start, op_args)
        return out.to(q.dtype), lse
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    ops.block_backward(
        grad_out.contiguous(), grad_lse, q, k, v, out, lse, dq, dk, dv, q_start, k_start, op_args
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _OffsetAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_start: int, k_start: int, op_args: ops.OpArgs):  # type: ignore[override]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _block_ops(q, k, v, q_start, k_start, op_args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.starts, ctx.op_args = (q_start, k_start), op_args
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        if grad_lse is not None:
            grad_lse = grad_lse.contiguous()
        dq, dk, dv = _block_ops(q, k, v, *ctx.starts, ctx.op_args, grad_out, out, lse, grad_lse)
        return dq, dk, dv, None, None, None


def offset_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, op_args: ops.OpArgs,
    k_start: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Attention of ``q`` ``(B, Lq, H, d)`` at positions ``[q_start, q_start +
    Lq)`` to ``k``, ``v`` ``(B, Lk, H_kv, d)`` at ``[k_start, k_start + Lk)``,
    with the pattern arguments ``op_args`` (:func:`ring_attention.ops.op_args`;
    its ``key_padding_mask`` is ``(B, Lk)``); differentiable (once)."""
    return offset_attention_lse(q, k, v, q_start, op_args, k_start)[0]


def offset_attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, op_args: ops.OpArgs,
    k_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`offset_attention` and its ``lse`` ``(B, H, Lq)`` (accumulation
    dtype), both differentiable (once)."""
    return _OffsetAttention.apply(q, k, v, int(q_start), int(k_start), op_args)
