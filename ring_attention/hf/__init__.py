"""Hugging Face ``transformers`` integration: the ``"ring_dilated"`` attention
implementation, and sequence parallelism for the models built on
transformers' attention interface (Llama, Mistral, Qwen2, ...).

Usage (docs/design.md §2)::

    import ring_attention as ra
    ra.register_transformers()
    config.dilated_attention = {"segment_lengths": [2048, 8192], "dilation_rates": [1, 4]}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated")

What the backend does with transformers' arguments:

- **Pattern** (:mod:`.config`): ``config.dilated_attention`` of the
  attention module's config, a dict with ``segment_lengths`` and
  ``dilation_rates`` and optionally ``head_groups`` and ``head_offsets``.
  Without it the attention is dense (one segment longer than any sequence)
  and equals ``"sdpa"``. Causality is the module's.
- **Masks, documents and caches** (:mod:`.masks`): transformers' own mask
  preparation decides; its decision (padding keys, packed sequences from
  ``position_ids`` when it detects them, where the queries stand among a
  cache's keys) reaches every layer as a 2-D key map, read once per batch.
  ``cu_seq_lens_q``/``cu_seq_lens_k`` (``DataCollatorWithFlattening(
  return_flash_attn_kwargs=True)``) are documents too, as for
  flash-attention. Rows with different documents run as separate calls.
- **Sliding windows** (:func:`.config.layer_window`): ``config.sliding_window
  = W`` is ``window=(W - 1, 0)`` on the layers transformers gives a
  sliding-window mask (every layer without ``config.layer_types``, else its
  ``"sliding_attention"`` layers), with or without a pattern.
- **KV caches** (:mod:`.masks`, :mod:`.decode`): a decode step attends its queries at
  their global positions to the cached keys, at theirs, that the pattern
  reaches (dynamic and static caches, sliding-window caches holding the last
  keys; a static cache's unfilled keys are never attended).
- **Fallback**: without a pattern, what the kernels cannot express (a 4-D
  or float mask, attention dropout, a position bias) is computed by
  transformers' ``"sdpa"``; with a pattern it raises ``ValueError``, as do
  dropout and a position bias on a sliding layer, soft-capping,
  bidirectional sliding windows and custom mask functions. Attention sinks
  (``s_aux``) are added once to every query, in every mode.
  ``output_attentions=True`` warns and returns no weights, as ``"sdpa"``.

**Sequence parallelism** (``register_transformers(group=g)``): every
``"ring_dilated"`` call of this process is ring attention over ``g``
(:func:`ring_attention.parallel.ring.ring_call`: one operator forward and one
backward, compiled with ``fullgraph=True`` too); with ``ulysses_group=`` or
``mesh=`` it is Ulysses or the ring x Ulysses hybrid
(:func:`ring_attention.ring_dilated_attention`'s arguments): each rank feeds the model
its shard of the tokens, and the model's logits are this rank's shard of the
single-process logits. :func:`shard_causal_lm_batch` builds a rank's batch
from the full one: shards of ``input_ids``, ``position_ids`` (global
positions, for the rotary embedding) and ``labels``; the labels shifted for
next-token prediction *before* sharding (``shift_labels``); the scored
tokens of the whole batch over the ranks sharing it
(``num_items_in_batch``), so that the gradients DDP or FSDP average over the
ranks are the single-process gradients; and the global document boundaries
(``cu_seq_lens_q``/``cu_seq_lens_k``). Every rank must run the same forward
and backward; a call one rank refuses (a padding mask, dropout, a bad config
entry, missing ``cu_seq_lens_q``) raises ``ValueError`` on every rank
through the ring's handshake. A call without documents and with
``use_cache`` is generation over the group (:mod:`.generation`; the cache
sharded by sequence with :class:`ShardedCache`).

**Training** over a data x sequence mesh: :class:`SequenceParallelDataLoader`
turns a data-parallel loader into sequence-parallel steps (the ranks that
share a sequence exchange their micro-batches and train on each in turn, a
piece each); ``SequenceParallelTrainer`` (and ``SequenceParallelMixin`` for
subclasses of ``Trainer``) puts the Trainer's loaders behind it, and the
Trainer's DDP or FSDP2 over all ranks, token counting and activation
checkpointing do the rest.

``transformers`` is optional: importing this package does not import it.
"""

from __future__ import annotations

from typing import Any

from .attention import dilated_attention_forward
from .batch import documents_from_position_ids, shard_causal_lm_batch
from .config import CONFIG_KEY, pattern_from_config
from .loader import SequenceParallelDataLoader
from .masks import dilated_attention_mask
from .register import register_transformers
from .setting import ATTN_IMPLEMENTATION, sequence_parallel

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CONFIG_KEY",
    "SequenceParallelDataLoader",
    "SequenceParallelMixin",
    "SequenceParallelTrainer",
    "ShardedCache",
    "dilated_attention_forward",
    "dilated_attention_mask",
    "documents_from_position_ids",
    "pattern_from_config",
    "register_transformers",
    "sequence_parallel",
    "shard_causal_lm_batch",
]


def __getattr__(name: str) -> Any:
    # The Trainer classes import transformers: only when asked for.
    if name in ("SequenceParallelMixin", "SequenceParallelTrainer"):
        from . import trainer

        return getattr(trainer, name)
    if name == "ShardedCache":
        from . import sharded_cache

        return sharded_cache.ShardedCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
