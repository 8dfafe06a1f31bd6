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
with a dynamic cache (:func:`ring_attention.hf.masks.filled_keys`). A
compiled layer passes ``P`` as a tensor to the one engine: each batch row's
queries start at ``P - L + 1`` (the operator's ``q_starts``, read when it
runs: a wait on a GPU), its keys are every slot from position 0 with the
map's zeros as key padding. The operator is one node of the graph, its
shapes depend on ``L`` and the number of slots only, so a compiled step is
one graph for every position; the kernels walk only the segments that hold
the queries, so its cost is ``L * sum K`` (``K`` the keys a branch reaches),
not the cache's length.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.call import Call
from ..local import engine

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
    call: Call,
) -> torch.Tensor:
    """``L`` consecutive queries per row, ``q`` ``(B, L, H, d)``, the last at
    the position ``positions`` gives, attending the cache ``k``, ``v`` ``(B,
    slots, H_kv, d)`` as ``call``'s pattern reaches from each query's
    position (module docstring); ``positions``: the ``(B, slots)`` position
    map. Returns ``(B, L, H, d)``; differentiable."""
    last = positions.amax(dim=1) - 1  # (B,); -1: a map allowing nothing
    starts = (last - (q.shape[1] - 1)).clamp(min=0)
    call = call.with_mask(positions == 0).with_rows(q_starts=starts)
    return engine.attend(call, q, k, v)[0]
