"""A ring pass's blocks (docs/design.md §4.3, §4.4, and §5 on the ring's dense blocks): each
block of queries against a run of keys (or packed K/V rows with their row map) merged into the
pass's fp32 accumulators, or its gradients added, by our block kernel or by a dense backend
where the pass's route is dense (``route_blocks``). Non-finite K/V (checked per block, or once
a pass by the ring), a gradient reaching ``lse`` and CUDA pieces a backend would copy take our
kernel."""

from __future__ import annotations

import math

import torch

from ..core.call import Call
from . import ops
from .backends import KvFinite, aligned, backend
from .branches import dense_backward, dense_forward
from .dispatch import route, route_blocks
from .spans import Route

__all__ = ["Blocks", "block_kind", "merge_into", "ring_blocks"]

Tensor = torch.Tensor


def block_kind(causal: bool, q_start: int, lq: int, k_start: int, lk: int) -> str | None:
    """``"full"``, ``"causal"`` or ``"skip"`` for a dense block of plain dense attention,
    ``None`` where one dense call cannot run it (a causal block cut across the diagonal)."""
    if lq == 0 or lk == 0:
        return "skip"
    if not causal or k_start + lk <= q_start + 1:
        return "full"
    if k_start >= q_start + lq:
        return "skip"
    if k_start == q_start and lk == lq:
        return "causal"
    return None


class Blocks:
    """The blocks of one ring pass of ``call``: by the dense route ``dense`` where a block allows
    it, else by the block kernel with the operators' ``args``; ``each_block``: each dense block
    checks its K/V (else the pass's K/V are known to be finite)."""

    def __init__(self, call: Call, args: ops.OpArgs, dense: Route | None) -> None:
        self.args = args
        self.each_block = True
        self.dense = dense
        self.backend = backend(dense.backends[0][0]) if dense and dense.backends else None
        self.pattern = call.pattern
        self.causal = call.pattern.causal
        self.scale = call.scale

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_start: int,
        k_start: int, k_rows: Tensor | None = None,
    ) -> None:  # fmt: skip
        """Merge the block into the accumulators ``out`` ``(B, Lq, H, D)`` and
        ``lse`` ``(B, H, Lq)`` (the accumulation dtype)."""
        args = (q, k, v, out, lse, q_start, k_start)
        if k_rows is None and self.dense is not None and self._dense_forward(*args):
            return
        ops.block_forward(*args, self.args, k_rows)

    def backward(
        self, go: Tensor, glse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
        lse: Tensor, dq: Tensor, dk: Tensor, dv: Tensor, q_start: int, k_start: int,
        k_rows: Tensor | None = None,
    ) -> None:  # fmt: skip
        """Add the block's gradients into ``dq``, ``dk``, ``dv`` (the accumulation dtype), given
        the final ``out`` and ``lse``."""
        if k_rows is None and glse is None and self.dense is not None and self._dense_backward(
            go, q, k, v, out, lse, dq, dk, dv, q_start, k_start
        ):  # fmt: skip
            return
        ops.block_backward(go, glse, q, k, v, out, lse, dq, dk, dv, q_start, k_start, self.args,
                           k_rows)  # fmt: skip

    def _local(self, pass_: str, q: Tensor, k: Tensor, v: Tensor, q_start: int,
               k_start: int) -> Route | None:  # fmt: skip
        """The per-branch route of a piece's own block (None: our kernel)."""
        if q_start != k_start or q.shape[1] != k.shape[1]:
            return None
        r = route(pass_, q, k, v, self.pattern, None)
        return r if r.dense else None

    def _dense_forward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_start: int,
        k_start: int,
    ) -> bool:  # fmt: skip
        """:meth:`forward` by the dense route; ``False``: the block kernel's (nothing merged)."""
        if self.backend is None:
            r = self._local("forward", q, k, v, q_start, k_start)
            if r is None:
                return False
            finite = self._finite(k, v)
            res = dense_forward(q, k, v, self.pattern, self.scale, r)
        else:
            kind = block_kind(self.causal, q_start, q.shape[1], k_start, k.shape[1])
            if kind is None or kind == "skip":
                return kind == "skip"
            if not _aligned(q, k, v):
                return False
            finite = self._finite(k, v)
            B, lq, H, D = q.shape
            o = torch.empty(B, H, lq, D, dtype=q.dtype, device=q.device)
            bl = torch.empty(B, H, lq, dtype=lse.dtype, device=q.device)
            self.backend.forward(q, k, v, kind == "causal", self.scale, o, bl)
            res = o.transpose(1, 2), bl
        if not finite:  # read with the dense call queued: dropped, the kernel's instead
            return False
        merge_into(out, lse, *res)
        return True

    def _dense_backward(
        self, go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        dq: Tensor, dk: Tensor, dv: Tensor, q_start: int, k_start: int,
    ) -> bool:  # fmt: skip
        """:meth:`backward` by the dense route; ``False``: the block kernel's (nothing added)."""
        if self.backend is None:
            r = self._local("backward", q, k, v, q_start, k_start)
            if r is None:
                return False
            finite = self._finite(k, v)
            grads = dense_backward(go, q, k, v, out, lse, self.pattern, self.scale, r)
        else:
            kind = block_kind(self.causal, q_start, q.shape[1], k_start, k.shape[1])
            if kind is None or kind == "skip":
                return kind == "skip"
            if not _aligned(go, q, k, v, out):
                return False
            finite = self._finite(k, v)
            B, lq, H, D = q.shape
            lk, hk = k.shape[1], k.shape[2]
            gq = torch.empty(B, H, lq, D, dtype=q.dtype, device=q.device)
            gk = torch.empty(B, hk, lk, D, dtype=q.dtype, device=q.device)
            gv = torch.empty_like(gk)
            self.backend.backward(go, q, k, v, out, lse, kind == "causal", self.scale, gq, gk, gv)
            grads = gq.transpose(1, 2), gk.transpose(1, 2), gv.transpose(1, 2)
        if not finite:  # read with the dense call queued: dropped, the kernel's instead
            return False
        for acc, g in zip((dq, dk, dv), grads, strict=True):
            acc.add_(g)
        return True

    def _finite(self, k: Tensor, v: Tensor) -> KvFinite | bool:
        """This block's K/V check (``True``: the pass's one check covers it)."""
        return KvFinite(k, v) if self.each_block else True


def _aligned(*tensors: Tensor) -> bool:
    """Whether a block's tensors go to a CUDA backend without a copy."""
    return tensors[0].device.type != "cuda" or all(aligned(t) for t in tensors)


def merge_into(out: Tensor, lse: Tensor, o: Tensor, bl: Tensor) -> None:
    """Merge one part ``(o, bl)`` into the accumulators ``out``, ``lse`` in place (they start at
    ``0`` and ``-inf``)."""
    new = torch.logaddexp(lse, bl)
    ref = torch.where(new == -math.inf, 0.0, new)  # rows reached by nothing yet
    keep = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    take = torch.exp(bl - ref).transpose(1, 2).unsqueeze(-1)
    out.mul_(keep).add_(o * take)
    lse.copy_(new)


def ring_blocks(
    call: Call, pass_: str, q: Tensor, k: Tensor, n: int, bounds: tuple[int, ...], rows: int
) -> Blocks:
    """The blocks of one ring pass of ``call`` on this rank's shard: ``n`` the global length,
    ``bounds`` where every rank's pieces start and end, ``rows`` a length every piece is a
    multiple of."""
    r = route_blocks(pass_, q, k, call.pattern, n, bounds, rows) if call.every_head else None
    dense = r if r is not None and r.dense else None
    return Blocks(call, ops.op_args(call, q.device), dense)
