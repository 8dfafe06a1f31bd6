"""Generation over the sequence-parallel group (docs/design.md §2): with
``register_transformers(group=...)`` (or a mesh), ``model.generate()`` runs
on every rank of the group with the same prompt, and every rank returns the
tokens one process would.

Each rank attends, for every query (the prompt's in the prefill, the new
token's in a decode step), only its piece of the keys: piece ``r`` of
``torch.tensor_split`` of the cached positions, at its global positions,
through the one engine (a piece outside a query's window or segments costs
it nothing). The ranks' partial ``(out, lse)`` are merged by log-sum-exp
(one all-gather per layer, inside the Ulysses group then along the ring:
``O(batch * heads * head_dim)`` bytes a decode step), sinks added once
after. The call is told apart from sequence-parallel training by its
missing documents (training passes ``cu_seq_lens_q``,
``shard_causal_lm_batch``) and ``use_cache``; the ranks check that they
hold the same sequence (its length and positions) before anything merges, in
a control round of the library's handshake (a rank in a training step's ring
meanwhile makes every rank raise).

Not yet: a cache that keeps only the rank's piece (every rank caches every
position today, so its memory is one process's); static caches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..core.call import prepare
from ..core.layout import shard_bounds
from ..local import engine
from ..local.blocks import merge_into
from ..parallel.handshake import GENERATION, exchange_message
from ..parallel.mesh import check_grid, check_ring, resolve_topology
from .config import layer_pattern
from .setting import ATTN_IMPLEMENTATION, SequenceParallel

__all__ = ["generation_step", "is_generation"]

_NAME = f"attn_implementation={ATTN_IMPLEMENTATION!r}"


def is_generation(kwargs: Mapping[str, Any], documents: Any) -> bool:
    """Whether a sequence-parallel call is a generation step (the same
    sequence on every rank) rather than a training shard."""
    return documents is None and bool(kwargs.get("use_cache"))


def generation_step(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: Any, scaling: float | None, causal: bool, kwargs: Mapping[str, Any],
    sp: SequenceParallel,
) -> torch.Tensor:  # fmt: skip
    """The attention of one generation step over the group (module
    docstring): ``query`` ``(B, H, L, D)`` the last ``L`` of the cached
    positions, ``key``, ``value`` ``(B, KVH, S, D)`` all of them; returns
    ``(B, L, H, D)``."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    B, L = q.shape[:2]
    S = k.shape[1]
    size, rank, groups = sp._grid()
    position = kwargs.get("position_ids")
    ends = (-1, -1)
    if isinstance(position, torch.Tensor) and position.numel():
        ends = (int(position.min()), int(position.max()))
    _agree(sp, [B, L, S, *ends])
    keys, first, filled, padding = _keys_in_use(attention_mask, B, S)
    pattern = layer_pattern(module, causal, kwargs.get("sliding_window"))
    k, v = k[:, :keys], v[:, :keys]
    call, _ = prepare(q, k, v, pattern, scale=scaling, key_padding_mask=padding,
                      q_start=filled - L, k_start=first)  # fmt: skip
    lo, length = shard_bounds(keys, size)[rank]
    hi = lo + length
    piece = call.with_mask(None if padding is None else padding[:, lo:hi].contiguous())
    # queries at filled - L, this rank's keys at first + lo: rows given per
    # batch row (the operator takes rows at offsets; one start each)
    starts = torch.full((B,), filled - L, dtype=torch.int64)
    piece = piece.with_rows(k_start=first + lo, q_starts=starts)
    with torch.no_grad():
        out, lse = engine.attend(piece, q, k[:, lo:hi], v[:, lo:hi])
        out, lse = _merge_over(out.to(lse.dtype), lse, groups)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        out, lse = engine.fold_sinks(out, lse, sinks)
    return out.to(q.dtype)


def _keys_in_use(attention_mask: Any, batch: int, keys: int) -> tuple[int, int, int, Any]:
    """``(keys in use, position of the first, end of the queries, padding)``
    from the layer's key map (ring_attention/hf/masks.py): ``None`` (every
    key, from position 0) or the bool ``(batch, filled)`` map of positions
    ``[0, filled)``; a layer with more keys uses the first ``filled``, one
    with fewer (a sliding-window cache) holds the last. ``padding``: ``True``
    for a key to ignore, or ``None``."""
    if attention_mask is None:
        return keys, 0, keys, None
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
            and attention_mask.dim() == 2 and attention_mask.shape[0] == batch):  # fmt: skip
        raise ValueError(
            f"{_NAME}: generation over the sequence-parallel group takes a dynamic cache and "
            "a 2-D padding mask (not yet a static cache or a 4-D mask); got an attention_mask "
            f"of {getattr(attention_mask, 'dtype', type(attention_mask).__name__)} "
            f"{tuple(getattr(attention_mask, 'shape', ()))}"
        )
    filled = attention_mask.shape[1]
    first = max(filled - keys, 0)
    used = min(keys, filled)
    keep = attention_mask[:, first:]
    return used, first, filled, None if bool(keep.all()) else ~keep


def _agree(sp: SequenceParallel, payload: list[int]) -> None:
    """The control rounds of a generation step (ring_attention/parallel/
    handshake.py), over the groups the outputs merge over: every rank holds
    the same sequence (``payload``: its sizes and positions; a training
    shard passed without documents would differ), and a rank in another call
    (the ring of a training step) makes every rank raise, not wait. An error
    of the first round is passed on along the ring, as the hybrid does."""
    if sp.ring_only or sp.auto:  # as the ring's and the grid's calls do first
        if sp.size > 1:
            check_ring(sp.group)
    else:
        check_grid(resolve_topology(**sp.spread()))
    error: ValueError | None = None
    for i, (group, size, order) in enumerate(sp._grid()[2]):
        if size <= 1:
            continue
        call = GENERATION if i == 0 else f"{GENERATION} (ring of the grid)"
        try:
            rows = exchange_message(group, call, None if error else payload, error, order)
            if rows is not None and any(r[: len(payload)] != payload for r in rows):
                every = [tuple(r[: len(payload)]) for r in rows]
                raise ValueError(
                    f"{_NAME}: a sequence-parallel call without documents (cu_seq_lens_q) and "
                    "with use_cache is generation over the group, which passes the same "
                    "sequence on every rank; the ranks hold (batch, queries, keys, first and "
                    f"last position) {every}. For training, build each rank's batch with "
                    "ring_attention.hf.shard_causal_lm_batch"
                )
        except ValueError as exc:
            error = error or exc
    if error is not None:
        raise error


def _merge_over(out: torch.Tensor, lse: torch.Tensor, groups: tuple) -> tuple:
    """The ranks' partial ``(out, lse)`` merged by log-sum-exp, the same on
    every rank (an all-gather inside each group, in shard order)."""
    for group, size, order in groups:
        if size <= 1:
            continue
        outs = [torch.empty_like(out) for _ in range(size)]
        lses = [torch.empty_like(lse) for _ in range(size)]
        dist.all_gather(outs, out.contiguous(), group=group)
        dist.all_gather(lses, lse.contiguous(), group=group)
        if order is not None:
            outs, lses = [outs[g] for g in order], [lses[g] for g in order]
        out = torch.zeros_like(out)
        lse = torch.full_like(lse, float("-inf"))
        for o, s in zip(outs, lses, strict=True):
            merge_into(out, lse, o, s)
    return out, lse
