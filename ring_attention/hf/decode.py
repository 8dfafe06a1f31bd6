"""A decode step over a static cache with a pattern, in fixed shapes.

A static cache gives the query's position as a tensor (``torch.compile``
reads no value of it) and its keys as every slot of the cache, written or
not. The mask interface hands the layers a **position map** instead of the
key map (:func:`position_map`): int64 ``(batch, slots)``, ``p + 1`` (``p``
the query's position) at the slots its row of transformers' mask allows
(causality, window, padding), ``0`` at the others: nonzero means attend, as
transformers reads a 2-D mask fed back to the model (``generate`` does with
static caches). Slot ``s`` holds position ``s``.

An eager layer reads ``p`` and attends the filled keys with the pattern, as
with a dynamic cache (:func:`ring_attention.hf.masks.filled_keys`). From ``p``
as a tensor a compiled layer selects, per branch ``(w, r)``, the at most ``K = (min(w,
left + 1, slots) - 1) // r + 1`` keys the branch can reach (``left`` the
window's left side): positions ``p - r j``, ``j < K``, kept where they lie in
``p``'s segment, in the window and the map allows them (docs/design.md §1.1:
keys active with ``p`` in its segment are exactly those). Those keys are
gathered (``(batch, K, kv_heads, head_dim)``), attended by the block kernel
(dense, the kept ones as key padding), and the branch's ``lse`` is dropped
for the heads ``p`` is not active for (``(p mod w) mod r`` against each
head's offset) or that the branch does not apply to (``head_groups``). The
branches merge by log-sum-exp: a key reached by two branches counts twice
(§1.2). Every shape depends on the pattern and the number of slots only, so
a compiled decode step is one graph for every position, and its cost is
``sum K``, not the cache's length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import ops
from ..lse_merge import merge
from ..pattern import Pattern
from .config import pattern_from_config
from .offset import offset_attention_lse

__all__ = ["decode_attention", "position_map"]


def position_map(
    batch_size: int,
    kv_length: int,
    q_offset: torch.Tensor,
    mask_function: Callable | None,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> torch.Tensor:
    """The position map (module docstring) of one query at position
    ``q_offset`` (a 0-d tensor) over ``kv_length`` slots from position 0:
    transformers' own ``"sdpa"`` row of that query, which evaluates
    ``mask_function`` (and the 2-D padding ``attention_mask``) without
    reading the position."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    kwargs["allow_is_causal_skip"] = False  # None would mean every slot of the cache
    row = sdpa_mask(batch_size, 1, kv_length, q_offset, 0, mask_function or causal_mask_function,
                    attention_mask, **kwargs)  # fmt: skip
    row = row[:, 0, 0, :].expand(batch_size, kv_length)
    return torch.where(row, q_offset.to(device=row.device, dtype=torch.int64) + 1, 0)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    pattern: Pattern,
    scale: float,
) -> torch.Tensor:
    """One query per row, ``q`` ``(B, 1, H, d)``, attending the cache ``k``,
    ``v`` ``(B, slots, H_kv, d)`` as ``pattern`` reaches from the query's
    position (module docstring); ``positions``: the ``(B, slots)`` position
    map. Returns ``(B, 1, H, d)``; differentiable."""
    batch, slots, heads = q.shape[0], k.shape[1], q.shape[2]
    allowed = positions > 0
    # the query's position (-1: its row allows no key, then none is kept)
    p = (positions.amax(dim=1) - 1).clamp(min=0)[:, None]
    rows = torch.arange(batch, device=q.device)[:, None]
    dense = ops.op_args(pattern_from_config(None, False), scale, None, q.device)
    left = pattern.window[0]
    outs, lses = [], []
    for i, (w, r) in enumerate(pattern.branches):
        span = min(w, slots) if left < 0 else min(w, slots, left + 1)
        at = p - r * torch.arange((span - 1) // r + 1, device=q.device)  # (B, K)
        keep = at >= p - p % w  # in p's segment (so at >= 0)
        if left >= 0:
            keep &= at >= p - left
        at = at.clamp(min=0)
        keep &= allowed.gather(1, at)
        args = dense._replace(key_padding_mask=~keep)
        out, lse = offset_attention_lse(q, k[rows, at], v[rows, at], 0, args)
        offsets = torch.tensor([pattern.offset(h, i, heads) for h in range(heads)], device=q.device)
        active = offsets == (p % w) % r  # (B, H): p is active for these heads
        if pattern.head_groups:
            applies = torch.zeros(heads, dtype=torch.bool, device=q.device)
            applies[pattern.applies(i, heads)] = True
            active &= applies
        outs.append(out)
        lses.append(lse.masked_fill(~active[:, :, None], float("-inf")))
    return merge(list(zip(outs, lses, strict=True)), q.dtype)[0]
