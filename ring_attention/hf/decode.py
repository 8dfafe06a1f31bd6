"""Queries continuing a static cache with a pattern, in fixed shapes."""

import torch

from ..core.call import Call
from ..local import engine


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, call: Call
) -> torch.Tensor:
    """``L`` consecutive queries a row, the last at the position the map
    ``positions`` gives, attending the cache ``k``, ``v``: ``(B, L, H, d)``."""
    last = positions.amax(dim=1) - 1  # (B,); -1: a map allowing nothing
    starts = (last - (q.shape[1] - 1)).clamp(min=0)
    call = call.with_mask(positions == 0).with_rows(q_starts=starts)
    return engine.attend(call, q, k, v)[0]
