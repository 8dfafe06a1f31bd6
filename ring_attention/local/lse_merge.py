"""Log-sum-exp merges of partial attention results, in Python.

A part is ``(out, lse)``: ``out`` ``(B, S, H, D)`` normalised over the keys
the part reached, ``lse`` ``(B, H, S)`` their log-sum-exp (``-inf`` where the
part reached none). The merged ``out`` is the parts' ``out`` weighted by
``exp(lse_i - lse)``, with ``lse`` the log-sum-exp of the parts' ``lse``.
Rows no part reaches get ``out = 0`` and ``lse = -inf`` (zero gradients).
The kernels merge on the device; these are for the Python paths (head
ranges, dense ring blocks, cached decoding).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def merge(parts: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Differentiable merge of ``parts``; ``out`` in ``dtype``, ``lse`` in the
    parts' ``lse`` dtype."""
    lses = torch.stack([lse for _, lse in parts])  # (P, B, H, S)
    top = lses.amax(dim=0).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lses - top)  # 0 for parts that reach nothing
    total = w.sum(dim=0)
    reached = total > 0
    safe = torch.where(reached, total, torch.ones_like(total))
    lse = torch.where(reached, top + torch.log(safe), torch.full_like(total, -math.inf))
    out = sum(o.to(lse.dtype) * (wi / safe).transpose(1, 2).unsqueeze(-1)
              for (o, _), wi in zip(parts, w, strict=True))  # fmt: skip
    return out.to(dtype), lse


def merge_into(out: Tensor, lse: Tensor, o: Tensor, bl: Tensor) -> None:
    """Merge one part ``(o, bl)`` into the accumulators ``out``, ``lse`` in
    place (no autograd; the accumulators start at ``0`` and ``-inf``)."""
    new = torch.logaddexp(lse, bl)
    ref = torch.where(new == -math.inf, 0.0, new)  # rows reached by nothing yet
    keep = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    take = torch.exp(bl - ref).transpose(1, 2).unsqueeze(-1)
    out.mul_(keep).add_(o * take)
    lse.copy_(new)
