"""Reached (query, key) pairs of a pattern, counted in closed form (docs/design.md §7): full
segments by multiplication, only the segments cut by a range's ends one by one; heads enter
through their offsets only. No position is visited."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import torch

from .checks import check_int
from .geometry import MAX_SEQ_LEN, IntOrTensor, active_before
from .pattern import Pattern, as_flag

__all__ = [
    "BWD_FLOPS_PER_PAIR",
    "FWD_FLOPS_PER_PAIR",
    "balanced_work_below",
    "check_planner_args",
    "pattern_flops",
    "range_pairs",
    "ranks_pairs",
    "reached_pairs",
]

#: FLOPs per reached pair and unit of head_dim: ``QK^T`` and ``PV`` forward
#: (2 multiply-adds), ``S, dP, dV, dQ, dK`` backward (2.5x the forward).
FWD_FLOPS_PER_PAIR = 4
BWD_FLOPS_PER_PAIR = 10


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


def range_pairs(
    pattern: Pattern, seq_len: int, offsets: Sequence[dict[int, int]], lo: int, hi: int,
) -> int:  # fmt: skip
    """Reached pairs, summed over heads and branches, whose query lies in ``[lo, hi)``;
    ``offsets``: :meth:`Pattern.branch_offsets`."""
    if lo >= hi:
        return 0
    causal = pattern.causal

    def doc_pairs(length: int, a: int, b: int, times: int = 1) -> int:
        return times * sum(
            heads
            * (
                _pairs_below(length, b, w, r, o, causal, pattern.window)
                - _pairs_below(length, a, w, r, o, causal, pattern.window)
            )
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
    pattern: Pattern, seq_len: int, heads: int, q_ranges: Sequence[tuple[int, int]] | None = None,
) -> int:  # fmt: skip
    """Reached (query, key) pairs of one batch row, summed over heads and branches (a key reached
    by two branches counts twice); ``q_ranges``: ``(start, length)`` runs of query positions,
    ``None`` for the whole sequence."""
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
    offsets = pattern.branch_offsets(heads)
    return sum(range_pairs(pattern, seq_len, offsets, s, s + n) for s, n in ranges)


def _prefix_pairs(
    pattern: Pattern, seq_len: int, offsets: Sequence[dict[int, int]], x: torch.Tensor
) -> torch.Tensor:
    """Reached pairs whose query lies below each ``x`` (an int64 tensor), elementwise."""

    def below(length: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(y)
        for i, (w, r) in enumerate(pattern.branches):
            w = min(w, max(seq_len, 1))  # the same pairs; a whole segment's count stays small
            for o, heads in offsets[i].items():
                total += heads * _pairs_below(length, y, w, r, o, pattern.causal, pattern.window)
        return total

    cu = pattern.documents_tensor("cpu")
    if cu is None:
        return below(torch.full_like(x, seq_len), x)
    lengths = cu[1:] - cu[:-1]
    if lengths.numel() == 0:
        return torch.zeros_like(x)
    distinct, inverse = torch.unique(lengths, return_inverse=True)
    before = torch.cat(
        [torch.zeros(1, dtype=torch.int64), below(distinct, distinct)[inverse].cumsum(0)]
    )
    k = (torch.searchsorted(cu, x, right=True) - 1).clamp(0, lengths.numel() - 1)
    return before[k] + below(lengths[k], x - cu[k])


_INT64_SAFE = 1 << 62  # ranks_pairs counts in int64 below this bound


def ranks_pairs(
    pattern: Pattern, seq_len: int, heads: int, ranges: Sequence[Sequence[tuple[int, int]]]
) -> list[int]:
    """:func:`reached_pairs` of every rank's ``(start, length)`` runs at once: vectorised in
    int64 where no count can reach ``2**62``, else rank by rank."""
    seq_len, heads = check_planner_args(pattern, seq_len, heads)
    offsets = pattern.branch_offsets(heads)
    reach = sum(
        sum(offsets[i].values()) * (-(-min(w, seq_len) // r) + 1)
        for i, (w, r) in enumerate(pattern.branches)
    )
    if 8 * seq_len * reach >= _INT64_SAFE:
        return [reached_pairs(pattern, seq_len, heads, rs) for rs in ranges]
    most = max([1, *map(len, ranges)])
    pad = [(0, 0)] * most
    ends = torch.tensor(
        [[(s, s + n) for s, n in [*rs, *pad[len(rs) :]]] for rs in ranges], dtype=torch.int64
    ).reshape(len(ranges), most, 2)
    below = _prefix_pairs(pattern, seq_len, offsets, ends.reshape(-1)).view(ends.shape)
    return (below[..., 1] - below[..., 0]).sum(1).tolist()


#: :func:`balanced_work_below` counts at most this many offsets of a branch.
BALANCE_OFFSETS = 64


def balanced_work_below(pattern: Pattern, seq_len: int, xs: Sequence[int]) -> list[int]:
    """The work of the queries below each ``x`` of ``xs``, independent of the heads (what
    ``layout="balanced"`` cuts evenly): per branch the pairs of every offset weighted ``1 /
    r`` (at most :data:`BALANCE_OFFSETS` offsets), in exact integers."""
    xs = [int(x) for x in xs]
    if not xs:
        return []
    most = BALANCE_OFFSETS
    chosen = [
        range(r) if r <= most else [k * r // most for k in range(most)] for _, r in pattern.branches
    ]
    scale = math.lcm(*(len(c) for c in chosen))
    total = [0] * len(xs)
    for (w, r), offs in zip(pattern.branches, chosen, strict=True):
        branch = pattern._replace(segment_lengths=(w,), dilation_rates=(r,))
        weights = [dict.fromkeys(offs, 1)]
        reach = len(offs) * (-(-min(w, seq_len) // r) + 1)
        if 8 * seq_len * reach < _INT64_SAFE:
            ends = torch.tensor(xs, dtype=torch.int64)
            counts = _prefix_pairs(branch, seq_len, weights, ends).tolist()
        else:  # Python integers
            counts = [range_pairs(branch, seq_len, weights, 0, x) for x in xs]
        weight = scale // len(offs)
        total = [t + weight * c for t, c in zip(total, counts, strict=True)]
    return total


#: The planner counts offsets head by head: at most this many heads.
MAX_HEADS = 2**16


def check_planner_args(pattern: Pattern, seq_len: object, heads: object) -> tuple[int, int]:
    """``seq_len`` and ``heads`` checked against the pattern."""
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
