"""Reached (query, key) pairs of a pattern, counted in closed form.

A pattern's work is its reached pairs (docs/design.md §7): for every
``(head, branch, segment)`` with ``a`` active rows, ``a**2`` pairs, or
``a (a + 1) / 2`` when causal; per document with ``cu_seqlens``; with a
sliding window, the pairs inside its band (still closed form). Nothing here
visits a position: a segment's active rows for offset ``o`` are
``start + o + r*j``, so counts are arithmetic, full segments are counted by
multiplication and only the (at most two) segments cut by a range's ends and
the short last segment of a document are counted one by one. One billion
tokens take microseconds.

Heads enter only through their offset in each branch (and ``head_groups``):
heads with the same offset have the same pairs, so every count is a sum over
the distinct offsets of a branch weighted by how many heads have them.
Grouped K/V heads do not change the pairs (every query head has its own
scores); they change what travels (:mod:`.traffic`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from functools import lru_cache

import torch

from ..checks import check_int
from ..geometry import MAX_SEQ_LEN, active_before, branch_offsets
from ..pattern import Pattern, as_flag

__all__ = [
    "BWD_FLOPS_PER_PAIR",
    "FWD_FLOPS_PER_PAIR",
    "check_planner_args",
    "pattern_flops",
    "range_pairs",
    "reached_pairs",
]

#: FLOPs per reached pair and unit of head_dim: ``QK^T`` and ``PV`` forward
#: (2 multiply-adds), ``S, dP, dV, dQ, dK`` backward (2.5x the forward).
FWD_FLOPS_PER_PAIR = 4
BWD_FLOPS_PER_PAIR = 10


def _sum_range(x0: int, x1: int) -> int:
    """The sum of the integers in ``[x0, x1)``."""
    return (x0 + x1 - 1) * (x1 - x0) // 2 if x1 > x0 else 0


def _band_pairs(j0: int, j1: int, a: int, left: int | None, right: int | None) -> int:
    """Pairs of the active queries ``j0 <= j < j1`` of a segment with ``a``
    active rows, query ``j`` reaching keys ``max(0, j - left) .. min(a - 1, j
    + right)`` (rows of the offset; ``None``: unbounded)."""
    total = j1 - j0  # every query reaches itself
    if right is None:
        total += (a - 1) * (j1 - j0)
    else:  # min(a - 1, j + right): j + right below j < a - right
        b = min(j1, max(j0, a - right))
        total += _sum_range(j0 + right, b + right) + (a - 1) * (j1 - b)
    if left is not None:  # less max(0, j - left)
        c = max(j0, left)
        total -= _sum_range(c - left, j1 - left)
    return total


def _rows(side: int, r: int) -> int | None:
    """A side of the window in active rows of dilation ``r`` (two active rows
    of one offset lie a multiple of ``r`` apart); ``None``: unbounded."""
    return None if side < 0 else side // r


def _segment_pairs(
    seg_len: int, lo: int, hi: int, r: int, o: int, causal: bool, window: tuple[int, int]
) -> int:  # fmt: skip
    """Pairs of one segment ``[0, seg_len)`` whose query lies in ``[lo, hi)``
    (positions relative to the segment), offset ``o``."""
    keys = active_before(seg_len, o, r)
    j0 = active_before(max(lo, 0), o, r)
    j1 = max(j0, active_before(min(hi, seg_len), o, r))
    right = 0 if causal else _rows(window[1], r)  # causal: the j-th reaches j + 1 keys
    return _band_pairs(j0, j1, keys, _rows(window[0], r), right)


@lru_cache(maxsize=4096)
def _doc_range_pairs(
    length: int, lo: int, hi: int, w: int, r: int, o: int, causal: bool, window: tuple[int, int]
) -> int:  # fmt: skip
    """Pairs of offset ``o`` in branch ``(w, r)`` whose query lies in
    ``[lo, hi)``, in a document of ``length`` positions (relative)."""
    lo, hi = max(lo, 0), min(hi, length)
    if lo >= hi:
        return 0
    n_full = length // w  # segments 0 .. n_full-1 have length w
    first = -(-lo // w)  # the first segment starting at or after lo
    last = min(hi // w, n_full)  # segments [first, last) are full and inside [lo, hi)
    total = max(0, last - first) * _segment_pairs(w, 0, w, r, o, causal, window)
    # The segments cut by lo or hi, or the short last one: at most two.
    for s in {lo // w, (hi - 1) // w}:
        if not first <= s < last:
            start = s * w
            total += _segment_pairs(
                min(w, length - start), lo - start, hi - start, r, o, causal, window
            )
    return total


def range_pairs(
    pattern: Pattern,
    seq_len: int,
    offsets: Sequence[dict[int, int]],
    lo: int,
    hi: int,
) -> int:
    """Reached pairs, summed over heads and branches, whose query lies in
    ``[lo, hi)`` (keys anywhere). ``offsets`` is :func:`branch_offsets`."""
    if lo >= hi:
        return 0
    causal = pattern.causal

    def doc_pairs(length: int, a: int, b: int, times: int = 1) -> int:
        return times * sum(
            heads * _doc_range_pairs(length, a, b, w, r, o, causal, pattern.window)
            for i, (w, r) in enumerate(pattern.branches)
            for o, heads in offsets[i].items()
        )

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


def reached_pairs(
    pattern: Pattern,
    seq_len: int,
    heads: int,
    q_ranges: Sequence[tuple[int, int]] | None = None,
) -> int:
    """Reached (query, key) pairs of one batch row, summed over heads and
    branches (a key reached by two branches counts twice, as in the softmax).

    Args:
        pattern: the pattern (documents included).
        seq_len: global sequence length.
        heads: query heads.
        q_ranges: ``(start, length)`` runs of query positions (a rank's
            pieces); ``None`` for the whole sequence. Keys are not restricted.
    """
    seq_len, heads = check_planner_args(pattern, seq_len, heads)
    if q_ranges is None:
        q_ranges = [(0, seq_len)]
    ranges = []
    try:
        for s, n in q_ranges:
            s = check_int(s, "q_ranges: a start", 0, seq_len)
            ranges.append((s, check_int(n, "q_ranges: a length", 0, seq_len - s)))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"q_ranges must be (start, length) pairs of integers inside [0, seq_len = "
            f"{seq_len}], got {q_ranges!r} ({e})"
        ) from None
    offsets = branch_offsets(pattern, heads)
    return sum(range_pairs(pattern, seq_len, offsets, s, s + n) for s, n in ranges)


#: The planner counts offsets head by head: at most this many heads.
MAX_HEADS = 2**16


def check_planner_args(pattern: Pattern, seq_len: object, heads: object) -> tuple[int, int]:
    """``seq_len`` and ``heads`` checked (``ValueError`` naming them), with
    the pattern and its documents' end."""
    if not isinstance(pattern, Pattern):
        raise ValueError(f"pattern must be a Pattern, got {type(pattern).__name__}")
    n = check_int(seq_len, "seq_len", 0, MAX_SEQ_LEN)
    h = check_int(heads, "heads", 1, MAX_HEADS)
    pattern.check_heads(h)
    pattern.check_length(n)
    return n, h


def pattern_flops(pairs: int, head_dim: int, batch: int = 1, *, backward: bool = False) -> int:
    """FLOPs of ``pairs`` reached pairs: ``4 d`` each forward; with
    ``backward=True`` forward + backward, ``(4 + 10) d``."""
    per_pair = FWD_FLOPS_PER_PAIR + (BWD_FLOPS_PER_PAIR if as_flag(backward, "backward") else 0)
    pairs = check_int(pairs, "pairs", 0, 2**126)
    head_dim = check_int(head_dim, "head_dim", 1, 2**31)
    return per_pair * head_dim * check_int(batch, "batch", 1, 2**31) * pairs
