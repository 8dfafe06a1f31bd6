"""Reached (query, key) pairs of a pattern, counted in closed form.

A pattern's work is its reached pairs (docs/design.md §7): for every
``(head, branch, segment)`` with ``a`` active rows, ``a**2`` pairs, or
``a (a + 1) / 2`` when causal; per document with ``cu_seqlens``. Nothing here
visits a position: a segment's active rows for offset ``o`` are
``start + o + r*j``, so counts are arithmetic, full segments are counted by
multiplication and only the (at most two) segments cut by a range's ends and
the short last segment of a document are counted one by one. One billion
tokens take microseconds.

Heads enter only through their offset in each branch (and ``head_groups``):
heads with the same offset have the same pairs, so every count is a sum over
the distinct offsets of a branch weighted by how many heads have them.
Grouped K/V heads do not change the pairs (every query head has its own
scores); they change what travels (:mod:`.exchange_model`).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache

import torch

from ..checks import check_int
from ..pattern import Pattern, as_flag
from ..plan import MAX_SEQ_LEN

__all__ = [
    "BWD_FLOPS_PER_PAIR",
    "FWD_FLOPS_PER_PAIR",
    "branch_offsets",
    "check_planner_args",
    "n_before",
    "pattern_flops",
    "range_pairs",
    "reached_pairs",
]

#: FLOPs per reached pair and unit of head_dim: ``QK^T`` and ``PV`` forward
#: (2 multiply-adds), ``S, dP, dV, dQ, dK`` backward (2.5x the forward).
FWD_FLOPS_PER_PAIR = 4
BWD_FLOPS_PER_PAIR = 10


def n_before(z: int, o: int, r: int) -> int:
    """How many of the positions ``o, o + r, o + 2r, ...`` lie below ``z``."""
    return max(0, -(-(z - o) // r))


def branch_offsets(pattern: Pattern, heads: int) -> list[dict[int, int]]:
    """Per branch, ``{offset: number of query heads with that offset}`` over
    the heads the branch applies to (all, or its group with ``head_groups``)."""
    pattern.check_heads(heads)
    return [
        dict(Counter(pattern.offset(h, i, heads) for h in pattern.applies(i, heads)))
        for i in range(pattern.n_branches)
    ]


def _segment_pairs(
    seg_len: int, lo: int, hi: int, r: int, o: int, causal: bool
) -> int:  # fmt: skip
    """Pairs of one segment ``[0, seg_len)`` whose query lies in ``[lo, hi)``
    (positions relative to the segment), offset ``o``."""
    keys = n_before(seg_len, o, r)
    j0 = n_before(max(lo, 0), o, r)
    j1 = max(j0, n_before(min(hi, seg_len), o, r))
    if causal:  # the j-th active query reaches j + 1 keys
        return (j1 * (j1 + 1) - j0 * (j0 + 1)) // 2
    return (j1 - j0) * keys


@lru_cache(maxsize=4096)
def _doc_range_pairs(
    length: int, lo: int, hi: int, w: int, r: int, o: int, causal: bool
) -> int:  # fmt: skip
    """Pairs of offset ``o`` in branch ``(w, r)`` whose query lies in
    ``[lo, hi)``, in a document of ``length`` positions (relative)."""
    lo, hi = max(lo, 0), min(hi, length)
    if lo >= hi:
        return 0
    n_full = length // w  # segments 0 .. n_full-1 have length w
    first = -(-lo // w)  # the first segment starting at or after lo
    last = min(hi // w, n_full)  # segments [first, last) are full and inside [lo, hi)
    keys = n_before(w, o, r)
    total = max(0, last - first) * (keys * (keys + 1) // 2 if causal else keys * keys)
    # The segments cut by lo or hi, or the short last one: at most two.
    for s in {lo // w, (hi - 1) // w}:
        if not first <= s < last:
            start = s * w
            total += _segment_pairs(min(w, length - start), lo - start, hi - start, r, o, causal)
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
            heads * _doc_range_pairs(length, a, b, w, r, o, causal)
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
