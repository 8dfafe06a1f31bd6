"""A KV cache sharded by sequence over the sequence-parallel group, dynamic
or preallocated (``max_cache_len``) (docs/transformers.md). Imports transformers."""

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ..core.layout import shard_bounds
from .generation import Pieces, record_pieces
from .setting import ATTN_IMPLEMENTATION, sequence_parallel

_NAME = f"attn_implementation={ATTN_IMPLEMENTATION!r}"


class ShardedLayer(DynamicLayer):
    """One layer's keys and values at this rank's positions (module docstring);
    with ``max_cache_len``, written in place into storage preallocated for
    ``ceil(max_cache_len / size) + block`` positions (enough for any prefill)."""

    is_croppable = True

    def __init__(self, size: int, rank: int, block: int, max_cache_len: int | None = None) -> None:
        super().__init__()
        self.size, self.rank, self.block, self.max_cache_len = size, rank, block, max_cache_len
        self.storage: tuple[torch.Tensor, ...] = ()
        self.filled = self.prefill = 0  # positions cached over the group, of its prefill
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

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty keys and values shaped as the new ones; the storage of a static layer."""
        super().lazy_initialization(key_states, value_states)
        room = 0
        if self.max_cache_len is not None:
            room = min(self.max_cache_len, -(-self.max_cache_len // self.size) + self.block)
        self.storage = tuple(t.new_zeros((*t.shape[:-2], room, t.shape[-1]))
                             for t in (key_states, value_states))  # fmt: skip
        self.keys, self.values = (t[..., :0, :] for t in self.storage)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep this rank's share of the new positions; return all it holds."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, length = self.filled, key_states.shape[-2]
        if self.max_cache_len is not None and start + length > self.max_cache_len:
            raise ValueError(
                f"{_NAME}: ShardedCache(max_cache_len={self.max_cache_len}) caches at most "
                f"{self.max_cache_len} positions; {length} more after {start} need "
                f"max_cache_len >= {start + length}")  # fmt: skip
        mine = self._mine(start, length)
        if mine:
            take = torch.cat([torch.arange(s - start, s - start + n) for s, n in mine])
            take = take.to(key_states.device)
            new = [t.index_select(-2, take) for t in (key_states, value_states)]
            if self.max_cache_len is None:
                self.keys = torch.cat([self.keys, new[0]], dim=-2)
                self.values = torch.cat([self.values, new[1]], dim=-2)
            else:  # in place: the positions a rank holds never pass its storage (class docstring)
                held, end = self.keys.shape[-2], self.keys.shape[-2] + new[0].shape[-2]
                for into, t in zip(self.storage, new, strict=True):
                    into[..., held:end, :].copy_(t)
                self.keys, self.values = (t[..., :end, :] for t in self.storage)
            for s, n in mine:
                if self.runs and sum(self.runs[-1]) == s:
                    self.runs[-1] = (self.runs[-1][0], self.runs[-1][1] + n)
                else:
                    self.runs.append((s, n))
        if self.filled == 0:
            self.prefill = length
        self.filled += length
        record_pieces(self.keys, Pieces(tuple(self.runs), self.filled))
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """The positions cached over the group."""
        return self.filled

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.filled + query_length, 0

    def get_max_length(self) -> int:
        """The positions the group can cache (``max_cache_len``), ``-1``: no limit."""
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self) -> None:
        super().reset()
        self.filled, self.prefill, self.runs, self.storage = 0, 0, [], ()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's reorder of the rows; a static layer's in its storage."""
        super().reorder_cache(beam_idx)
        if self.max_cache_len is not None and self.keys.numel():
            held = self.keys.shape[-2]
            for into, t in zip(self.storage, (self.keys, self.values), strict=True):
                into[..., :held, :].copy_(t)
            self.keys, self.values = (t[..., :held, :] for t in self.storage)

    def _check_crop(self, tokens_to_remove: int) -> int:
        """The positions left by the crop; a static layer's keep the prefill
        or none (its storage is sized for the prefill's split)."""
        end = max(self.filled + tokens_to_remove, 0)
        if self.max_cache_len is not None and 0 < end < self.prefill:
            raise ValueError(
                f"{_NAME}: a ShardedCache with max_cache_len crops generated positions only "
                f"(to at least the prefill's {self.prefill}) or all of them; got "
                f"tokens_to_remove={tokens_to_remove} of {self.filled}")  # fmt: skip
        return end

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions cached over the group
        (transformers' sign, as ``DynamicLayer.crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"{_NAME}: ShardedCache.crop takes the negative count of the last positions to "
                f"drop (tokens_to_remove <= 0), got {tokens_to_remove}"
            )
        self.filled = end = self._check_crop(tokens_to_remove)
        runs = [(s, min(n, end - s)) for s, n in self.runs if s < end]  # in position order
        kept = sum(n for _, n in runs)
        self.runs, self.prefill = runs, self.prefill if end else 0
        if self.is_initialized:
            self.keys, self.values = self.keys[..., :kept, :], self.values[..., :kept, :]


class ShardedCache(DynamicCache):
    """transformers' ``DynamicCache`` whose full-attention layers keep only this rank's positions;
    ``block``: generated positions a rank takes in turn; ``max_cache_len``: the positions cached
    over the group at most, each layer's storage preallocated (``ShardedLayer``), else it grows."""

    def __init__(self, config: Any, block: int = 64, max_cache_len: int | None = None) -> None:
        sp = sequence_parallel()
        if sp is None:
            raise ValueError(
                "ShardedCache needs the transformers backend registered for sequence "
                "parallelism: ring_attention.register_transformers(group=...) (or mesh=...)"
            )
        room = 1 if max_cache_len is None else max_cache_len
        for name, value in (("block", block), ("max_cache_len", room)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        super().__init__(config=config)
        size, rank = sp.size, sp.rank
        self.layers = [
            ShardedLayer(size, rank, block, max_cache_len) if type(layer) is DynamicLayer else layer
            for layer in self.layers
        ]
        self.layer_class_to_replicate = None

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' ``crop``, refused before any layer is cropped."""
        for layer in self.layers:
            if isinstance(layer, ShardedLayer):
                layer._check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)
