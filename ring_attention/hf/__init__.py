"""Hugging Face ``transformers`` integration (docs/transformers.md). Importing
it does not import ``transformers``."""

from typing import Any

from .attention import dilated_attention_forward, dilated_attention_mask, register_transformers
from .config import CONFIG_KEY, pattern_from_config
from .setting import (
    ATTN_IMPLEMENTATION,
    SequenceParallelDataLoader,
    documents_from_position_ids,
    sequence_parallel,
    shard_causal_lm_batch,
)

__all__ = ["ATTN_IMPLEMENTATION", "CONFIG_KEY", "SequenceParallelDataLoader",
           "SequenceParallelMixin", "SequenceParallelTrainer", "ShardedCache",
           "dilated_attention_forward", "dilated_attention_mask", "documents_from_position_ids",
           "pattern_from_config", "register_transformers", "sequence_parallel",
           "shard_causal_lm_batch"]  # fmt: skip


def __getattr__(name: str) -> Any:
    # The Trainer classes and the cache import transformers: only when asked for.
    if name in ("SequenceParallelMixin", "SequenceParallelTrainer"):
        from . import trainer

        return getattr(trainer, name)
    if name == "ShardedCache":
        from . import sharded_cache

        return sharded_cache.ShardedCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
