"""A KV cache sharded by sequence over the sequence-parallel group
(docs/transformers.md). Imports transformers."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ..core.layout import shard_bounds
from .generation import Pieces, record_pieces
from .setting import ATTN_IMPLEMENTATION, sequence_parallel

__all__ = ["ShardedCache", "ShardedLayer"]

_NAME = f"attn_implementation={ATTN_IMPLEMENTATION!r}"


class ShardedLayer(DynamicLayer):
    """One layer's keys and values at this rank's positions (module docstring)."""

    is_croppable = True

    def __init__(self, size: int, rank: int, block: int) -> None:
        super().__init__()
        self.size, self.rank, self.block = size, rank, block
        self.filled = 0  # positions cached over the group
        self.prefill = 0
        self.runs: list[tuple[int, int]] = []  # (global start, length), in local order

    def _mine(self, start: int, length: int) -> list[tuple[int, int]]:
        """This rank's runs of the new positions ``[start, start + length)``."""
        if self.filled == 0:
            lo, n = shard_bounds(length, self.size)[self.rank]
            return [(lo, n)] if n else []
        out, t, end = [], start, start + length
        while t < end:
            b = (t - self.prefill) // self.block
            stop = min(end, self.prefill + (b + 1) * self.block)
            if b % self.size == self.rank:
                out.append((t, stop - t))
            t = stop
        return out

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep this rank's share of the new positions; return all it holds."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, length = self.filled, key_states.shape[-2]
        mine = self._mine(start, length)
        if mine:
            take = torch.cat([torch.arange(s - start, s - start + n) for s, n in mine])
            take = take.to(key_states.device)
            self.keys = torch.cat([self.keys, key_states.index_select(-2, take)], dim=-2)
            self.values = torch.cat([self.values, value_states.index_select(-2, take)], dim=-2)
            for s, n in mine:
                if self.runs and sum(self.runs[-1]) == s:
                    self.runs[-1] = (self.runs[-1][0], self.runs[-1][1] + n)
                else:
                    self.runs.append((s, n))
        if self.filled == 0:
            self.prefill = length
        self.filled += length
        if self.keys.numel() == 0:  # no position here yet: an empty piece
            shape = (*key_states.shape[:-2], 0, key_states.shape[-1])
            self.keys = key_states.new_empty(shape)
            self.values = value_states.new_empty((*shape[:-1], value_states.shape[-1]))
        record_pieces(self.keys, Pieces(tuple(self.runs), self.filled))
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """The positions cached over the group."""
        return self.filled

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.filled + query_length, 0

    def reset(self) -> None:
        super().reset()
        self.filled, self.prefill, self.runs = 0, 0, []

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions cached over the group
        (transformers' sign, as ``DynamicLayer.crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"{_NAME}: ShardedCache.crop takes the negative count of the last positions to "
                f"drop (tokens_to_remove <= 0), got {tokens_to_remove}"
            )
        self.filled = end = max(self.filled + tokens_to_remove, 0)
        runs = [(s, min(n, end - s)) for s, n in self.runs if s < end]  # in position order
        kept = sum(n for _, n in runs)
        self.runs, self.prefill = runs, self.prefill if end else 0
        if self.is_initialized:
            self.keys, self.values = self.keys[..., :kept, :], self.values[..., :kept, :]


class ShardedCache(DynamicCache):
    """transformers' ``DynamicCache`` whose full-attention layers keep only
    this rank's positions; ``block``: generated positions a rank takes in turn."""

    def __init__(self, config: Any, block: int = 64) -> None:
        sp = sequence_parallel()
        if sp is None:
            raise ValueError(
                "ShardedCache needs the transformers backend registered for sequence "
                "parallelism: ring_attention.register_transformers(group=...) (or mesh=...)"
            )
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        super().__init__(config=config)
        size, rank = sp.size, sp.rank
        self.layers = [
            ShardedLayer(size, rank, block) if type(layer) is DynamicLayer else layer
            for layer in self.layers
        ]
        self.layer_class_to_replicate = None
