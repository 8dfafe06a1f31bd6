"""Queries continuing a static cache with a pattern, in fixed shapes.

A static cache gives the queries' position as a tensor (``torch.compile``
reads no value of it) and its keys as every slot of the cache, written or
not. Its queries are consecutive: ``L`` queries (a decode step: ``L = 1``; a
chunk of prefill or the candidates of assisted decoding: more) at positions
``P - L + 1 .. P``. The mask interface hands the layers a **position map**
instead of the key map (:func:`position_map`): int64 ``(batch, slots)``,
``P + 1`` at the slots the last query may attend (transformers' causal
padding row of that query), ``0`` at the others:
nonzero means attend, as transformers reads a 2-D mask fed back to the
model (``generate`` does with static caches). Slot ``s`` holds position
``s``. The window is the layers' own (from the config), not the map's.

An eager layer reads ``P`` and attends the filled keys with the pattern, as
with a dynamic cache (:func:`ring_attention.hf.masks.filled_keys`). From ``P``
as a tensor a compiled layer selects, per query ``p`` and branch ``(w, r)``,
the at most ``K = (min(w, left + 1, slots) - 1) // r + 1`` keys the branch can
reach (``left`` the window's left side): positions ``p - r j``, ``j < K``,
kept where they lie in ``p``'s segment, in the window and the map allows them
(docs/design.md §1.1: keys active with ``p`` in its segment are exactly
those). Those keys are gathered (``(batch, L, K, kv_heads, head_dim)``),
attended by the block kernel with each query a row of its own (dense, the
kept ones as key padding), and the branch's ``lse`` is dropped for the heads
``p`` is not active for (``(p mod w) mod r`` against each head's offset) or
that the branch does not apply to (``head_groups``). The branches merge by
log-sum-exp: a key reached by two branches counts twice (§1.2). Every shape
depends on ``L``, the pattern and the number of slots only, so a compiled
step is one graph for every position, and its cost is ``L * sum K``, not the
cache's length.
"""

from __future__ import annotations

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
    q_length: int,
    kv_length: int,
    q_offset: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> torch.Tensor:
    """The position map (module docstring) of ``q_length`` queries from
    position ``q_offset`` (a 0-d tensor) over ``kv_length`` slots from
    position 0: transformers' causal ``"sdpa"`` row of the last query, which
    applies the 2-D padding ``attention_mask`` without reading the position.
    The layers apply causality and the window for every query themselves."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    kwargs["allow_is_causal_skip"] = False  # None would mean every slot of the cache
    last = q_offset + (q_length - 1)
    row = sdpa_mask(batch_size, 1, kv_length, last, 0, causal_mask_function, attention_mask,
                    **kwargs)  # fmt: skip
    row = row[:, 0, 0, :].expand(batch_size, kv_length)
    return torch.where(row, last.to(device=row.device, dtype=torch.int64) + 1, 0)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    pattern: Pattern,
    scale: float,
) -> torch.Tensor:
    """``L`` consecutive queries per row, ``q`` ``(B, L, H, d)``, the last at
    the position ``positions`` gives, attending the cache ``k``, ``v`` ``(B,
    slots, H_kv, d)`` as ``pattern`` reaches from each query's position
    (module docstring); ``positions``: the ``(B, slots)`` position map.
    Returns ``(B, L, H, d)``; differentiable."""
    batch, length, heads, dim = q.shape
    slots, device = k.shape[1], q.device
    allowed = positions > 0
    last = positions.amax(dim=1, keepdim=True) - 1  # (B, 1); -1: a map allowing nothing
    p = (last - (length - 1) + torch.arange(length, device=device)).clamp(min=0)  # (B, L)
    rows = torch.arange(batch, device=device)[:, None, None]
    dense = ops.op_args(pattern_from_config(None, False), scale, None, device)
    one = q.reshape(batch * length, 1, heads, dim)  # each query a row of its own
    left = pattern.window[0]
    outs, lses = [], []
    for i, (w, r) in enumerate(pattern.branches):
        span = min(w, slots) if left < 0 else min(w, slots, left + 1)
        at = p[..., None] - r * torch.arange((span - 1) // r + 1, device=device)  # (B, L, K)
        keep = at >= (p - p % w)[..., None]  # in p's segment (so at >= 0)
        if left >= 0:
            keep &= at >= (p - left)[..., None]
        at = at.clamp(min=0)
        keep &= allowed.gather(1, at.flatten(1)).view(at.shape)
        args = dense._replace(key_padding_mask=~keep.flatten(0, 1))
        gathered = (t[rows, at].flatten(0, 1) for t in (k, v))  # (B L, K, H_kv, d)
        out, lse = offset_attention_lse(one, *gathered, 0, args)
        offsets = torch.tensor([pattern.offset(h, i, heads) for h in range(heads)], device=device)
        active = offsets == ((p % w) % r).flatten()[:, None]  # (B L, H): p active for these heads
        if pattern.head_groups:
            applies = torch.zeros(heads, dtype=torch.bool, device=device)
            applies[pattern.applies(i, heads)] = True
            active &= applies
        outs.append(out)
        lses.append(lse.masked_fill(~active[:, :, None], float("-inf")))
    out = merge(list(zip(outs, lses, strict=True)), q.dtype)[0]
    return out.view(batch, length, heads, dim)
