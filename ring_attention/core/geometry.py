"""The pattern's geometry (docs/design.md §1.1, §1.3) in Python: the rules of ``csrc/pattern.h``
for the code that counts or materialises positions (ints or int64 tensors)."""

from __future__ import annotations

from typing import TypeVar

import torch

__all__ = [
    "MAX_SEQ_LEN",
    "active_before",
    "active_run",
    "document_positions",
    "segment_active_positions",
    "segment_around",
    "window_mask",
]

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)

#: the longest sequence (and the largest position + 1) the package takes
MAX_SEQ_LEN = 2**62 - 1


def active_before(x: IntOrTensor, offset: int, r: int) -> IntOrTensor:
    """How many active positions ``offset, offset + r, ...`` of a segment lie below ``x``."""
    if isinstance(x, torch.Tensor):
        return torch.clamp(torch.div(x - offset + r - 1, r, rounding_mode="floor"), min=0)
    return max(0, -(-(x - offset) // r))


def active_run(
    seg_start: int, seg_end: int, r: int, offset: int, lo: int, hi: int
) -> tuple[int, int]:
    """``(first, count)``: the active positions of the segment ``[seg_start, seg_end)`` that lie
    in ``[lo, hi)``."""
    a, b = max(lo, seg_start), min(hi, seg_end)
    rel = a - seg_start
    first = seg_start + offset + (0 if rel <= offset else -(-(rel - offset) // r) * r)
    return first, (-(-(b - first) // r) if first < b else 0)


def document_positions(
    documents: torch.Tensor | None, seq_len: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(relative, document)``: each position relative to its document's start, and the
    document's index."""
    t = torch.arange(seq_len, device=device)
    if documents is None:
        return t, torch.zeros_like(t)
    cu = documents.to(t.device)
    doc = torch.searchsorted(cu, t, right=True) - 1
    return t - cu[doc], doc


def window_mask(
    window: tuple[int, int], seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Bool ``(seq_len, seq_len)``: ``[t, u]`` lies in the sliding window."""
    t = torch.arange(seq_len, device=device)
    diff = t[None, :] - t[:, None]  # u - t
    left, right = window
    inside = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)
    if left >= 0:
        inside &= diff >= -left
    if right >= 0:
        inside &= diff <= right
    return inside


def segment_around(
    x: torch.Tensor, w: int, bounds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` of the segment of length ``w`` holding each position of ``x``, in
    documents ``bounds``."""
    doc = torch.searchsorted(bounds, x, right=True) - 1
    doc = doc.clamp(0, bounds.numel() - 2)
    ds, de = bounds[doc], bounds[doc + 1]
    start = ds + torch.div(x - ds, w, rounding_mode="floor") * w
    return start, torch.minimum(start + w, de)


def segment_active_positions(n: int, w: int, r: int, offset: int) -> list[torch.Tensor]:
    """The active positions of ``offset`` in the segments of ``(w, r)`` over ``[0, n)``: a tensor
    for the full segments, one for the short last."""
    n_full, rest = divmod(n, w)
    parts = []
    if n_full:
        parts.append((torch.arange(n_full) * w)[:, None] + torch.arange(offset, w, r)[None, :])
    if rest > offset:
        parts.append(n_full * w + torch.arange(offset, rest, r)[None, :])
    return parts
