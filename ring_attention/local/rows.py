"""The key rows a set of query ranges reaches: what the ring's exchange
planner (ring_attention/parallel/exchange_plan.py) sends, asked of the
operators, which define reaching (csrc/pattern.h)."""

from collections.abc import Sequence

import torch

from ..core.call import Call
from ..core.pattern import Pattern
from . import ops


def reached_rows(
    q_starts: Sequence[int], q_lens: Sequence[int], k_start: int, k_len: int, heads: int,
    kv_heads: int, pattern: Pattern, head_range: tuple[int, int, int] = (0, 0, 0),
) -> torch.Tensor:  # fmt: skip
    """Sorted flat indices ``row * kv_heads + g`` of the key rows of ``[k_start, k_start +
    k_len)`` that some query of the ranges reaches (``head_range``: the call's ``(head_start,
    total_heads, total_kv_heads)``)."""
    call = Call(pattern, 1.0).with_heads(*head_range)
    args = ops.op_args(call, "cpu")
    return ops.exchange_rows(q_starts, q_lens, k_start, k_len, heads, kv_heads, args)
