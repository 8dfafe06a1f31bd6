"""The pattern's geometry (docs/design.md §1.1, §1.3), in Python.

Which positions are active for a head and which segment holds a position:
the rules of ``csrc/pattern.h`` (the one
definition the kernels and the exchange planner run) for the Python code that
counts or materialises them: :mod:`ring_attention.core.multiplicity` (dense
matrices), :mod:`ring_attention.planner` (closed-form pairs and traffic) and
the benchmarks' baselines. ``tests/oracle.py`` stays independent of both on
purpose: it is the check of this module too.

Positions are global; documents (``cu_seqlens``) restart segments. The
functions take Python ints or int64 tensors alike where noted, with no
extension needed.
"""

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
    """How many of the active positions ``offset, offset + r, ...`` of a
    segment (relative to its start) lie below ``x`` (elementwise for a
    tensor)."""
    if isinstance(x, torch.Tensor):
        return torch.clamp(torch.div(x - offset + r - 1, r, rounding_mode="floor"), min=0)
    return max(0, -(-(x - offset) // r))


def active_run(
    seg_start: int, seg_end: int, r: int, offset: int, lo: int, hi: int
) -> tuple[int, int]:
    """``(first, count)``: the active positions ``first + r*m`` (``m <
    count``) of the segment ``[seg_start, seg_end)`` that lie in ``[lo, hi)``
    (``active_run`` in ``csrc/pattern.h``)."""
    a, b = max(lo, seg_start), min(hi, seg_end)
    rel = a - seg_start
    first = seg_start + offset + (0 if rel <= offset else -(-(rel - offset) // r) * r)
    return first, (-(-(b - first) // r) if first < b else 0)


def document_positions(
    documents: torch.Tensor | None, seq_len: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(relative, document)``, long ``(seq_len,)``: each position relative to
    the start of its document, and its document's index (0 without documents).
    ``documents``: the boundaries ``[0, ..., seq_len]`` as a tensor."""
    t = torch.arange(seq_len, device=device)
    if documents is None:
        return t, torch.zeros_like(t)
    cu = documents.to(t.device)
    doc = torch.searchsorted(cu, t, right=True) - 1
    return t - cu[doc], doc


def window_mask(
    window: tuple[int, int], seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Bool ``(seq_len, seq_len)``: ``[t, u]`` lies in the sliding window,
    ``t - left <= u <= t + right`` (``-1``: unbounded on that side)."""
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
    """``(start, end)`` of the segment of length ``w`` holding each position of
    ``x``, in documents ``bounds`` (``[0, ..., n]``; segments restart at every
    document, the last one of a document may be short)."""
    doc = torch.searchsorted(bounds, x, right=True) - 1
    doc = doc.clamp(0, bounds.numel() - 2)
    ds, de = bounds[doc], bounds[doc + 1]
    start = ds + torch.div(x - ds, w, rounding_mode="floor") * w
    return start, torch.minimum(start + w, de)


def segment_active_positions(n: int, w: int, r: int, offset: int) -> list[torch.Tensor]:
    """The active positions of offset ``offset`` in the segments of ``(w, r)``
    over ``[0, n)`` (no documents): ``(segments, rows)`` tensors, one for the
    full segments and one (a single row) for the short last segment, when
    they have any."""
    n_full, rest = divmod(n, w)
    parts = []
    if n_full:
        parts.append((torch.arange(n_full) * w)[:, None] + torch.arange(offset, w, r)[None, :])
    if rest > offset:
        parts.append(n_full * w + torch.arange(offset, rest, r)[None, :])
    return parts
