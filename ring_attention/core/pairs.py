"""Reached (query, key) pairs of a pattern, counted in closed form (docs/design.md §7; the
forms: ring_attention/core/geometry.py): full segments by multiplication, only the segments cut
by a range's ends one by one; heads enter through their offsets only. No position is visited."""

from collections.abc import Sequence

import torch

from .checks import check_int
from .geometry import INT64_SAFE as _INT64_SAFE
from .geometry import MAX_SEQ_LEN, prefix_pairs, range_pairs
from .pattern import Pattern, as_flag

#: FLOPs per reached pair and unit of head_dim: ``QK^T`` and ``PV`` forward
#: (2 multiply-adds), ``S, dP, dV, dQ, dK`` backward (2.5x the forward).
FWD_FLOPS_PER_PAIR = 4
BWD_FLOPS_PER_PAIR = 10


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
    below = prefix_pairs(pattern, seq_len, offsets, ends.reshape(-1)).view(ends.shape)
    return (below[..., 1] - below[..., 0]).sum(1).tolist()


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
