"""The pattern's geometry (docs/design.md §1.1, §1.3) in Python: the rules of ``csrc/pattern.h``
for the code that counts or materialises positions (ints or int64 tensors), and the reached
pairs in closed form (§7) under ring_attention/core/pairs.py and the balanced layout."""

import bisect
import functools
import itertools
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)

#: the longest sequence (and the largest position + 1) the package takes
MAX_SEQ_LEN = 2**62 - 1
#: pair counts stay in int64 below this bound (:func:`prefix_pairs`; else Python integers)
INT64_SAFE = 1 << 62


def active_before(x: IntOrTensor, offset: int, r: int) -> IntOrTensor:
    """How many active positions ``offset, offset + r, ...`` of a segment lie below ``x``."""
    if isinstance(x, torch.Tensor):
        return torch.clamp(torch.div(x - offset + r - 1, r, rounding_mode="floor"), min=0)
    return max(0, -(-(x - offset) // r))


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


# Reached pairs in closed form; ``pattern``: a :class:`~ring_attention.core.pattern.Pattern`
# (typed Any: this module sits below pattern.py, so that layout.py needs no pairs.py).


def _min(x: IntOrTensor, y: int | IntOrTensor) -> IntOrTensor:
    if isinstance(x, torch.Tensor):
        return torch.minimum(x, y) if isinstance(y, torch.Tensor) else x.clamp(max=y)
    return y.clamp(max=x) if isinstance(y, torch.Tensor) else min(x, y)


def _nonneg(x: IntOrTensor) -> IntOrTensor:
    return x.clamp(min=0) if isinstance(x, torch.Tensor) else max(x, 0)


def _band_below(j: IntOrTensor, a: IntOrTensor, left: int | None, right: int | None) -> IntOrTensor:
    """Pairs of the active queries ``0 <= i < j`` of a segment with ``a`` active rows, query
    ``i`` reaching keys ``i - left .. i + right`` clipped to the segment (``None``:
    unbounded); elementwise for tensors."""
    total = j  # every query reaches itself
    if right is None:
        total = total + (a - 1) * j
    else:  # i + right while i < a - right, then a - 1
        right = _min(a, right)
        b = _min(j, a - right)
        total = total + (2 * right + b - 1) * b // 2 + (a - 1) * (j - b)
    if left is not None:  # less i - left for left <= i < j
        m = _nonneg(j - _min(a, left))
        total = total - (m - 1) * m // 2
    return total


def _pairs_below(
    length: IntOrTensor, x: IntOrTensor, w: int, r: int, o: int, causal: bool,
    window: tuple[int, int],
) -> IntOrTensor:  # fmt: skip
    """Pairs of offset ``o`` in branch ``(w, r)`` whose query lies below ``x``, in a document of
    ``length`` positions (elementwise for tensors)."""
    x = _nonneg(_min(x, length))
    # A side of the window in active rows (two active rows of one offset lie
    # a multiple of r apart); causal: the i-th query reaches i + 1 keys.
    left = None if window[0] < 0 else window[0] // r
    right = 0 if causal else None if window[1] < 0 else window[1] // r
    whole = active_before(w, o, r)
    s = x // w
    start = s * w
    seg_len = _min(_nonneg(length - start), w)
    j = active_before(_min(x - start, seg_len), o, r)
    cut = _band_below(j, active_before(seg_len, o, r), left, right)
    return s * _band_below(whole, whole, left, right) + cut  # x <= length: s full segments


def _below(
    pattern: Any, offsets: Sequence[dict[int, int]], cap: int, length: IntOrTensor, x: IntOrTensor
) -> IntOrTensor:
    """Reached pairs whose query lies below ``x`` in a document of ``length`` positions, summed
    over heads and branches; segments cut to ``cap`` (the same pairs, smaller counts)."""
    return sum(
        heads * _pairs_below(length, x, min(w, cap), r, o, pattern.causal, pattern.window)
        for i, (w, r) in enumerate(pattern.branches)
        for o, heads in offsets[i].items()
    )


def range_pairs(
    pattern: Any, seq_len: int, offsets: Sequence[dict[int, int]], lo: int, hi: int,
) -> int:  # fmt: skip
    """Reached pairs, summed over heads and branches, whose query lies in ``[lo, hi)``;
    ``offsets``: :meth:`Pattern.branch_offsets`."""
    if lo >= hi:
        return 0
    below = functools.partial(_below, pattern, offsets, max(seq_len, 1))

    def doc_pairs(length: int, a: int, b: int, times: int = 1) -> int:
        return times * (below(length, b) - below(length, a))

    if pattern.documents is None:
        return doc_pairs(seq_len, lo, hi)
    docs = pattern.documents
    ja = bisect.bisect_left(docs, lo)  # first boundary >= lo
    jb = bisect.bisect_right(docs, hi) - 1  # last boundary <= hi
    total = 0
    # Documents cut by lo or hi (at most two; one if the range lies inside it).
    for j in sorted({ja - 1, jb}):
        if 0 <= j < len(docs) - 1 and docs[j] < hi and docs[j + 1] > lo:
            if not (lo <= docs[j] and docs[j + 1] <= hi):
                total += doc_pairs(docs[j + 1] - docs[j], lo - docs[j], hi - docs[j])
    # Documents wholly inside [lo, hi): once per distinct length.
    if jb > ja:
        cu = pattern.documents_tensor("cpu")
        lengths, counts = torch.unique(cu[ja + 1 : jb + 1] - cu[ja:jb], return_counts=True)
        for length, count in zip(lengths.tolist(), counts.tolist(), strict=True):
            if length > 0:
                total += doc_pairs(length, 0, length, count)
    return total


def prefix_pairs(
    pattern: Any, seq_len: int, offsets: Sequence[dict[int, int]], x: torch.Tensor
) -> torch.Tensor:
    """Reached pairs whose query lies below each ``x`` (an int64 tensor), elementwise."""
    below = functools.partial(_below, pattern, offsets, max(seq_len, 1))
    cu = pattern.documents_tensor("cpu")
    if cu is None:
        return below(torch.full_like(x, seq_len), x)
    lengths = cu[1:] - cu[:-1]
    if lengths.numel() == 0:
        return torch.zeros_like(x)
    distinct, inverse = torch.unique(lengths, return_inverse=True)
    before = torch.nn.functional.pad(below(distinct, distinct)[inverse].cumsum(0), (1, 0))
    k = (torch.searchsorted(cu, x, right=True) - 1).clamp(0, lengths.numel() - 1)
    return before[k] + below(lengths[k], x - cu[k])


def head_groups(heads: int, kv_group: int, per: int, head_start: int = 0) -> list[tuple]:
    """``(h0, h1, g0, g1)``: the local query heads ``[h0, h1)`` and K/V heads ``[g0, g1)`` of
    each group of ``per`` heads (``per`` a multiple of ``kv_group``; 0: one group) of ``heads``
    local heads from global head ``head_start``, cut at global multiples of ``per``."""
    s, per = head_start, per or heads + head_start
    cuts = [max(a, s) - s for a in range(s // per * per, s + heads, per)] + [heads]
    first = s // kv_group
    return [
        (a, b, (s + a) // kv_group - first, (s + b - 1) // kv_group - first + 1)
        for a, b in itertools.pairwise(cuts)
    ]
