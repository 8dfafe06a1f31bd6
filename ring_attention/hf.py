"""Hugging Face ``transformers`` integration: the ``"ring_dilated"`` attention
implementation, and sequence parallelism for the models built on
transformers' attention interface (Llama, Mistral, Qwen2, ...).

Usage (docs/design.md §2)::

    import ring_attention as ra
    ra.register_transformers()
    config.dilated_attention = {"segment_lengths": [2048, 8192], "dilation_rates": [1, 4]}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated")

What the attention function does with transformers' arguments:

- **Pattern**: ``config.dilated_attention`` of the attention module's config,
  a dict with ``segment_lengths`` and ``dilation_rates`` and optionally
  ``head_groups`` and ``head_offsets`` (``"modulo"`` or ``"grouped"``).
  Without it the attention is dense (one segment longer than any sequence)
  and equals ``"sdpa"``. Causality is the module's (``module.is_causal`` or
  the ``is_causal`` argument). The :class:`~ring_attention.pattern.Pattern`
  is built once per distinct config entry (cached), not per call.
- **Grouped K/V heads**: ``key``/``value`` with ``num_key_value_heads`` reach
  the operators as they are; nothing is repeated.
- **Padding**: transformers' 2-D padding mask becomes the operator's
  ``key_padding_mask``. The registered mask function accepts only masks the
  kernels express exactly (causal or bidirectional, with padding or packed
  documents) and raises ``ValueError`` for the others (sliding windows,
  chunked attention, custom ``and``/``or`` mask functions); a 4-D mask passed
  to the model raises too. With left padding the segments count from the
  first column of the batch, so a dilated pattern sees the real tokens at
  shifted positions (dense attention is unaffected): pad on the right, or
  pack.
- **Packed documents** (batch size 1, as ``DataCollatorWithFlattening``
  produces): ``cu_seq_lens_q``/``cu_seq_lens_k`` when given (the collator's
  ``return_flash_attn_kwargs=True``), otherwise the boundaries where
  ``position_ids`` do not increase by one (when no padding mask is given, as
  transformers' own packed-sequence detection). They become the operator's
  ``cu_seqlens``: every document starts its own segments, and a packed batch
  equals its documents run separately.
- **Not expressible, raising ``ValueError``**: attention dropout > 0, logit
  soft-capping, attention sinks, additive position biases, and decoding with
  a KV cache (query shorter than the keys: ``generate(..., use_cache=False)``
  works, recomputing the whole sequence per token).

**Sequence parallelism.** ``register_transformers(group=g)`` makes every
``"ring_dilated"`` attention call of this process ring attention over ``g``
(:func:`ring_attention.ring.ring_attention`): each rank feeds the model its
shard of the tokens, and the model's logits are this rank's shard of the
single-process logits. :func:`shard_causal_lm_batch` builds a rank's batch
from the full one: shards of ``input_ids``, ``position_ids`` (global
positions, for the rotary embedding) and ``labels``; the labels shifted for
next-token prediction *before* sharding (``shift_labels``, so the last token
of a shard is scored against the first token of the next); the number of
scored tokens of the whole batch (``num_items_in_batch``, so that each rank's
loss is its share of the global mean); and the global document boundaries
(``cu_seq_lens_q``/``cu_seq_lens_k``). The sum of the ranks' losses is the
single-process loss, and the sum of the ranks' parameter gradients (an
``all_reduce`` with ``SUM``, not DDP's average) is the single-process
gradient. Every rank must run the same forward and backward. Padding masks
are not supported in the ring: with causal attention right padding needs no
mask (set the padded labels to -100), or pack the documents instead.

``transformers`` is optional: importing this module does not import it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ._comm import world_info
from .functional import attend
from .layout import check_layout
from .pattern import Pattern, as_flag
from .ring import ring_attention
from .sharding import shard_sequence

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CONFIG_KEY",
    "dilated_attention_forward",
    "dilated_attention_mask",
    "documents_from_position_ids",
    "pattern_from_config",
    "register_transformers",
    "shard_causal_lm_batch",
]

#: The name to pass as ``attn_implementation``.
ATTN_IMPLEMENTATION = "ring_dilated"
#: The config attribute holding the pattern.
CONFIG_KEY = "dilated_attention"
_CONFIG_FIELDS = ("segment_lengths", "dilation_rates", "head_groups", "head_offsets")
# One segment longer than any sequence: dense attention, equal to "sdpa".
_DENSE_SEGMENT = 2**62
_IGNORE_INDEX = -100


class _SequenceParallel:
    """The group and layout of register_transformers(group=...). The group
    is held by a weak reference: a strong one would keep a group that
    destroy_process_group released alive, with its gloo worker threads, into
    the interpreter's shutdown, where a thread still releasing a finished
    collective's tensors needs the GIL and aborts the process."""

    def __init__(self, group: dist.ProcessGroup, layout: str) -> None:
        self._group = weakref.ref(group)
        self.layout = layout

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError(
                "the process group given to register_transformers(group=...) no longer exists "
                "(destroy_process_group released it): register again with a live group, or "
                "with group=None"
            )
        return group


# Set by register_transformers: None, or the group the sequence is sharded over.
_sequence_parallel: _SequenceParallel | None = None


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "ring_attention.register_transformers needs the Hugging Face transformers package: "
            "install the 'hf' extra (pip install 'ring_attention[hf]') or pip install transformers"
        ) from exc
    return transformers


def register_transformers(
    group: dist.ProcessGroup | None = None, *, layout: str = "contiguous"
) -> None:
    """Register ``"ring_dilated"`` with transformers' attention and
    attention-mask interfaces, so that ``from_config(config,
    attn_implementation="ring_dilated")`` (or ``from_pretrained``) uses
    exact dilated attention with the pattern of ``config.dilated_attention``.

    Idempotent; every call replaces the sequence-parallel setting.

    Args:
        group: ``None`` (default): every process attends over the whole
            sequence it is given. A process group (e.g. ``dist.group.WORLD``):
            sequence parallelism over it; every ``"ring_dilated"`` call of
            this process is then ring attention over ``group``, each rank
            passing its shard of the tokens (see
            :func:`shard_causal_lm_batch`). Held by a weak reference, so
            that ``destroy_process_group`` releases it; a sharded call after
            that raises ``RuntimeError``.
        layout: the sharding layout of the sequence-parallel ranks,
            ``"contiguous"`` (default) or ``"zigzag"`` (docs/design.md §3).

    Raises:
        ImportError: transformers is not installed (the ``hf`` extra).
        ValueError: an unknown ``layout``.
    """
    _import_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    check_layout(layout)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup or None, got {group!r}")
    AttentionInterface.register(ATTN_IMPLEMENTATION, dilated_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, dilated_attention_mask)
    global _sequence_parallel
    _sequence_parallel = None if group is None else _SequenceParallel(group, layout)


# ---------------------------------------------------------------------------
# The pattern of a config.


def pattern_from_config(config: Any, causal: bool) -> Pattern:
    """The :class:`Pattern` of ``config.dilated_attention`` (dense without it).

    Cached by the entry's contents: a model builds it once, not per call.

    Raises:
        ValueError: naming ``config.dilated_attention``, for an entry that is
            not a dict, lacks ``segment_lengths``/``dilation_rates``, has
            unknown keys or an invalid pattern.
    """
    causal = as_flag(causal, "causal")  # before the cache, whose keys take 1 for True
    entry = getattr(config, CONFIG_KEY, None)
    if entry is None:
        return _cached_pattern(None, causal)
    if not isinstance(entry, Mapping):
        raise ValueError(
            f"config.{CONFIG_KEY} must be a dict with keys {list(_CONFIG_FIELDS)}, "
            f"got {type(entry).__name__}"
        )
    unknown = sorted(set(entry) - set(_CONFIG_FIELDS))
    missing = [key for key in _CONFIG_FIELDS[:2] if key not in entry]
    if unknown or missing:
        raise ValueError(
            f"config.{CONFIG_KEY} takes the keys {list(_CONFIG_FIELDS)} (the first two required), "
            f"got unknown {unknown} and missing {missing}"
        )
    if "head_groups" in entry:
        as_flag(entry["head_groups"], f"config.{CONFIG_KEY}['head_groups']")
    frozen = tuple(
        (key, tuple(value) if isinstance(value, (list, tuple)) else value)
        for key, value in sorted(entry.items())
    )
    return _cached_pattern(frozen, causal)


@functools.lru_cache(maxsize=64)
def _cached_pattern(entry: tuple | None, causal: bool) -> Pattern:
    if entry is None:
        return Pattern((_DENSE_SEGMENT,), (1,), causal=causal)
    try:
        return Pattern(causal=causal, **dict(entry))
    except ValueError as exc:
        raise ValueError(f"config.{CONFIG_KEY}: {exc}") from None


# ---------------------------------------------------------------------------
# Masks.


def _closure(fn: Callable) -> dict[str, Any]:
    cells = fn.__closure__ or ()
    return {
        name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells, strict=True)
    }


def _check_mask_function(fn: Callable | None) -> None:
    """Accept only mask functions whose mask the kernels express exactly:
    causal or bidirectional, possibly made packed-sequence aware by
    transformers (padding arrives separately as the 2-D mask). The mask
    functions are transformers' closures, so this walks their structure and
    fails closed on anything it does not recognise."""
    from transformers import masking_utils as mu

    if fn is None or fn is mu.causal_mask_function or fn is mu.bidirectional_mask_function:
        return
    name = getattr(fn, "__qualname__", "")
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        return  # documents: from position_ids or cu_seq_lens in the attention function
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        return _check_mask_function(_closure(fn).get("mask_function"))
    if name == "and_masks.<locals>.and_mask":  # a custom part fails below
        for part in _closure(fn).get("mask_functions", ()):
            _check_mask_function(part)
        return
    if name.startswith(("sliding_window_overlay.", "sliding_window_bidirectional_overlay.")):
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} cannot apply a sliding window: set "
            "config.sliding_window = None (and use_sliding_window = False where the config has "
            "it); the dilated pattern of config.dilated_attention replaces it"
        )
    raise ValueError(
        f"attn_implementation={ATTN_IMPLEMENTATION!r} expresses causal or bidirectional masks "
        f"with padding or packed documents only; this model builds its mask with "
        f"{name or fn!r} (chunked attention, block masks and custom and/or mask functions "
        "are not supported)"
    )


def dilated_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask-interface entry of ``"ring_dilated"``: ``None``
    (no padding) or the 2-D bool mask ``(batch, kv_length)``, ``True`` =
    attend, as for flash-attention. Raises ``ValueError`` for mask structures
    the kernels cannot express (see the module docstring)."""
    _check_mask_function(mask_function)
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def _key_padding_mask(attention_mask: torch.Tensor | None, kv_length: int) -> torch.Tensor | None:
    """transformers' 2-D keep-mask as the operators' ``key_padding_mask``
    (``True`` = ignore)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.is_floating_point():
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} takes a 2-D bool or integer padding "
            f"mask (batch, seq), 1 = attend; got a {attention_mask.dim()}-D "
            f"{attention_mask.dtype} mask of shape {tuple(attention_mask.shape)} (a prepared "
            "4-D or float mask cannot be expressed by the dilated-attention kernels)"
        )
    if attention_mask.shape[1] != kv_length:
        raise ValueError(
            f"attention_mask must cover the {kv_length} keys, got shape "
            f"{tuple(attention_mask.shape)}"
        )
    return ~attention_mask.bool()


# ---------------------------------------------------------------------------
# Documents.


def _check_ids(t: Any, name: str) -> None:
    """Token ids, labels or positions: an integer tensor holding values."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be an integer tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")
    if t.is_meta:
        raise ValueError(f"{name} must hold values: got a tensor on the meta device")


def documents_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document boundaries ``[0, e_1, ..., n]`` (int64) of a packed sequence
    whose ``position_ids`` ``(batch, n)`` restart per document: a document
    starts wherever a position does not follow its predecessor by one
    (transformers' packed-sequence rule). ``None`` for one document per row.

    Raises:
        ValueError: rows with different boundaries (the kernels take one
            ``cu_seqlens`` for the whole batch: flatten the batch to one row,
            as ``DataCollatorWithFlattening`` does).
    """
    _check_ids(position_ids, "position_ids")
    if position_ids.dim() not in (1, 2):
        raise ValueError(
            f"position_ids must be (batch, seq) or (seq,), got shape {tuple(position_ids.shape)}"
        )
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    n = position_ids.shape[-1]
    starts = position_ids[:, 1:] - position_ids[:, :-1] != 1
    if not bool(starts.any()):
        return None
    if not bool((starts == starts[:1]).all()):
        raise ValueError(
            "packed sequences (position_ids restarting inside a row) must have the same document "
            "boundaries in every batch row; flatten the batch into one row "
            "(DataCollatorWithFlattening) or pass cu_seq_lens_q"
        )
    inner = torch.nonzero(starts[0]).flatten() + 1
    zero = inner.new_zeros(1)
    return torch.cat([zero, inner, zero + n]).to(torch.int64)


def _cu_seqlens_argument(kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and not torch.equal(cu_q.cpu(), cu_k.cpu()):
        raise ValueError(
            "cu_seq_lens_q and cu_seq_lens_k must be equal (self-attention over packed documents)"
        )
    return cu_q if cu_q is not None else cu_k


# ---------------------------------------------------------------------------
# The attention function.

_UNSUPPORTED_ARGUMENTS = {
    "softcap": "logit soft-capping (softcap)",
    "s_aux": "attention sinks (s_aux)",
    "position_bias": "an additive position bias (position_bias)",
}


def dilated_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface entry of ``"ring_dilated"``.

    Args:
        module: the attention module; its ``config`` holds the pattern.
        query: ``(batch, heads, seq, head_dim)``.
        key, value: ``(batch, kv_heads, seq, head_dim)``, passed to the
            operators without repeating heads.
        attention_mask: ``None`` or the 2-D keep-mask of
            :func:`dilated_attention_mask`.
        dropout: must be 0 (attention dropout cannot be applied exactly).
        scaling: score scale, default ``head_dim ** -0.5``.
        is_causal: overrides ``module.is_causal``.
        **kwargs: ``position_ids``, ``cu_seq_lens_q``/``cu_seq_lens_k`` are
            read (documents); the other transformers kwargs are ignored,
            except those the kernels cannot express, which raise.

    Returns:
        ``(out (batch, seq, heads, head_dim), None)``: no attention weights.
    """
    for name, what in _UNSUPPORTED_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation={ATTN_IMPLEMENTATION!r} does not support {what}")
    if dropout:
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} cannot apply attention dropout "
            f"(got dropout={dropout}): set config.attention_dropout = 0.0"
        )
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} attends a whole sequence to itself; "
            f"got {query.shape[2]} queries and {key.shape[2]} keys (decoding with a KV cache or "
            "cross-attention): generate with use_cache=False"
        )
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} reads the pattern from the attention "
            f"module's config.{CONFIG_KEY}, but {type(module).__name__} has no config"
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    pattern = pattern_from_config(config, causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    cu_seqlens = _cu_seqlens_argument(kwargs)

    sp = _sequence_parallel
    if sp is None:
        if cu_seqlens is None and attention_mask is None and kwargs.get("position_ids") is not None:
            cu_seqlens = documents_from_position_ids(kwargs["position_ids"])
        out = attend(
            q,
            k,
            v,
            pattern.with_documents(cu_seqlens),
            scale=scaling,
            key_padding_mask=_key_padding_mask(attention_mask, k.shape[1]),
        )
        return out, None

    if attention_mask is not None:
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} with sequence parallelism takes no "
            "padding mask: with causal attention right padding needs none (drop attention_mask "
            "and set the padded labels to -100), or pack the documents (cu_seq_lens_q)"
        )
    if cu_seqlens is None:
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} with sequence parallelism needs the "
            "global document boundaries cu_seq_lens_q (a rank cannot see them in its shard of "
            "position_ids): build each rank's batch with "
            "ring_attention.hf.shard_causal_lm_batch"
        )

    def sharded_pattern() -> Pattern:  # its errors reach every rank through the handshake
        return pattern.with_documents(cu_seqlens)

    out = ring_attention(q, k, v, sharded_pattern, scale=scaling, group=sp.group, layout=sp.layout)
    return out, None


# ---------------------------------------------------------------------------
# Sequence-parallel batches.


def shard_causal_lm_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    ignore_index: int = _IGNORE_INDEX,
) -> dict[str, Any]:
    """This rank's causal-LM batch (``model(**batch)``) from the full one.

    Every rank passes the same full tensors; nothing is communicated. The
    group and layout are those of :func:`register_transformers`; without a
    group the batch is the whole sequence, in the same format (so one
    training loop serves both).

    Args:
        input_ids: ``(batch, seq)`` token ids.
        labels: ``(batch, seq)`` or ``None``; as transformers' causal-LM
            labels (unshifted, ``ignore_index`` = not scored).
        position_ids: ``(batch, seq)`` or ``(1, seq)``; default
            ``0 .. seq-1``. Positions restarting per document mark packed
            documents (batch size 1 or the same boundaries in every row).
        ignore_index: the label of unscored tokens (-100).

    Returns:
        A dict with this rank's ``input_ids`` and ``position_ids`` (global
        positions), ``cu_seq_lens_q`` = ``cu_seq_lens_k`` (global document
        boundaries, int32) and, with ``labels``: ``labels`` (this rank's
        shard), ``shift_labels`` (this rank's shard of the labels shifted by
        one over the WHOLE sequence: the model's loss uses them instead of
        shifting inside the shard) and ``num_items_in_batch`` (scored tokens
        of the whole batch, so that the ranks' losses sum to the global mean).
    """
    _check_ids(input_ids, "input_ids")
    if input_ids.dim() != 2 or input_ids.shape[0] < 1:
        raise ValueError(
            f"input_ids must be a 2-D tensor (batch >= 1, seq), got {tuple(input_ids.shape)}"
        )
    for name, t in (("labels", labels), ("position_ids", position_ids)):
        if t is not None:
            _check_ids(t, name)
    batch, n = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(n, device=input_ids.device)[None]
    if (
        position_ids.dim() != 2
        or position_ids.shape[1] != n
        or position_ids.shape[0]
        not in (
            1,
            batch,
        )
    ):
        raise ValueError(
            f"position_ids must have shape (batch, seq) = {(batch, n)} or (1, seq), got "
            f"{tuple(position_ids.shape)}"
        )
    cu = documents_from_position_ids(position_ids)
    if cu is None:
        cu = torch.tensor([0, n])
    cu = cu.to(device=input_ids.device, dtype=torch.int32)

    sp = _sequence_parallel
    group, layout = (None, "contiguous") if sp is None else (sp.group, sp.layout)
    world, _ = world_info(group)

    def shard(x: torch.Tensor) -> torch.Tensor:  # contiguous: the loss views it flat
        return x if world == 1 else shard_sequence(x, 1, group, layout=layout).contiguous()

    out: dict[str, Any] = {
        "input_ids": shard(input_ids),
        "position_ids": shard(position_ids),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
    }
    if labels is not None:
        if tuple(labels.shape) != (batch, n):
            raise ValueError(
                f"labels must have input_ids' shape {(batch, n)}, got {tuple(labels.shape)}"
            )
        shifted = torch.cat([labels[:, 1:], labels.new_full((batch, 1), ignore_index)], dim=1)
        out["labels"] = shard(labels)
        out["shift_labels"] = shard(shifted)
        out["num_items_in_batch"] = int((shifted != ignore_index).sum())
    return out
