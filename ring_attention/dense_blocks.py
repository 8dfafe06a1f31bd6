"""The ring's per-step blocks through the dense backends, for plain dense
attention (one segment covering the sequence, dilation 1, no documents, no
window) and for patterns whose every segment lies inside one rank's piece
(ring_attention/dispatch.py's :func:`~ring_attention.dispatch.route_blocks`
decides).

Pieces holding whole segments: a query then reaches keys of its own piece
only, so the ring's only blocks are the diagonal ones, each the local op on
the piece as a sequence of its own (its start a multiple of every segment
length): the per-branch path of ring_attention/branches.py where
:func:`~ring_attention.dispatch.route` takes it for the piece, its ``out``
and ``lse`` merged as below, its gradients added.

Plain dense attention:

A block is a piece of this rank's queries (global rows ``[q_start, q_start +
Lq)``) against a run of keys (``[k_start, k_start + Lk)``). With dense
attention its geometry alone decides the call:

* non-causal, or causal with every key at or before every query: one full
  (non-causal) dense call;
* causal with no key at or before any query: nothing (no call);
* causal on the diagonal (the same rows): one causal dense call;
* anything else (a causal block cut across the diagonal, which the ring's
  pieces do not produce for dense patterns): our block kernel.

Forward: the call's ``out`` and ``lse`` are merged into the ring's fp32
accumulators by log-sum-exp, the rule of the block operators. Backward: the
call gets the final ``out`` and ``lse`` (its ``P = exp(S - lse)`` is then the
whole row's probability and ``D = rowsum(dO * out)`` the whole row's), so the
blocks' ``dq``, ``dk``, ``dv`` add up exactly. K/V holding a NaN or an
infinity take our kernel (it excludes them; a dense kernel would multiply
their zero weights): each block's K/V are checked when it runs (a host sync).
"""

from __future__ import annotations

import torch

from . import branches
from .backends import backend, kv_finite
from .dispatch import Route, route
from .lse_merge import merge_into
from .pattern import Pattern

__all__ = ["DenseBlocks", "block_kind"]

Tensor = torch.Tensor


def block_kind(causal: bool, q_start: int, lq: int, k_start: int, lk: int) -> str | None:
    """``"full"``, ``"causal"`` or ``"skip"`` for a dense block (see the
    module docstring), ``None`` where one dense call cannot run it."""
    if lq == 0 or lk == 0:
        return "skip"
    if not causal or k_start + lk <= q_start + 1:
        return "full"
    if k_start >= q_start + lq:
        return "skip"
    if k_start == q_start and lk == lq:
        return "causal"
    return None


class DenseBlocks:
    """The blocks of one ring pass by ``route``
    (:func:`~ring_attention.dispatch.route_blocks`, dense): one backend
    call per block, or (no backend named) the local op's per-branch path per
    piece. Each method returns ``False`` where the block must take our kernel
    instead."""

    def __init__(self, route: Route, pattern: Pattern, scale: float) -> None:
        self.backend = backend(route.backends[0][0]) if route.backends else None
        self.pattern = pattern
        self.causal = pattern.causal
        self.scale = scale

    def _local(self, pass_: str, q: Tensor, k: Tensor, v: Tensor, q_start: int,
               k_start: int) -> Route | None:  # fmt: skip
        """The per-branch route of a piece's own block (None: our kernel)."""
        if q_start != k_start or q.shape[1] != k.shape[1] or not kv_finite(k, v):
            return None
        r = route(pass_, q, k, v, self.pattern, None)
        return r if r.dense else None

    def _kind(self, q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int) -> str | None:
        kind = block_kind(self.causal, q_start, q.shape[1], k_start, k.shape[1])
        if kind is not None and kind != "skip" and not kv_finite(k, v):
            return None
        return kind

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_start: int,
        k_start: int,
    ) -> bool:  # fmt: skip
        """Merge the block into the accumulators ``out`` ``(B, Lq, H, D)`` and
        ``lse`` ``(B, H, Lq)`` (the accumulation dtype)."""
        if self.backend is None:
            r = self._local("forward", q, k, v, q_start, k_start)
            if r is None:
                return False
            merge_into(out, lse, *branches.dense_forward(q, k, v, self.pattern, self.scale, r))
            return True
        kind = self._kind(q, k, v, q_start, k_start)
        if kind is None:
            return False
        if kind == "skip":
            return True
        B, lq, H, D = q.shape
        o = torch.empty(B, H, lq, D, dtype=q.dtype, device=q.device)
        bl = torch.empty(B, H, lq, dtype=lse.dtype, device=q.device)
        self.backend.forward(q, k, v, kind == "causal", self.scale, o, bl)
        merge_into(out, lse, o.transpose(1, 2), bl)
        return True

    def backward(
        self, go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        dq: Tensor, dk: Tensor, dv: Tensor, q_start: int, k_start: int,
    ) -> bool:  # fmt: skip
        """Add the block's gradients into ``dq``, ``dk``, ``dv`` (``(B, L, h,
        D)``, the accumulation dtype), given the final ``out`` (q's dtype) and
        ``lse`` of the query rows."""
        if self.backend is None:
            r = self._local("backward", q, k, v, q_start, k_start)
            if r is None:
                return False
            grads = branches.dense_backward(go, q, k, v, out, lse, self.pattern, self.scale, r)
            for acc, g in zip((dq, dk, dv), grads, strict=True):
                acc.add_(g)
            return True
        kind = self._kind(q, k, v, q_start, k_start)
        if kind is None:
            return False
        if kind == "skip":
            return True
        B, lq, H, D = q.shape
        lk, hk = k.shape[1], k.shape[2]
        gq = torch.empty(B, H, lq, D, dtype=q.dtype, device=q.device)
        gk = torch.empty(B, hk, lk, D, dtype=q.dtype, device=q.device)
        gv = torch.empty_like(gk)
        self.backend.backward(go, q, k, v, out, lse, kind == "causal", self.scale, gq, gk, gv)
        dq.add_(gq.transpose(1, 2))
        dk.add_(gk.transpose(1, 2))
        dv.add_(gv.transpose(1, 2))
        return True
