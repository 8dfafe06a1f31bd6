"""The ``"ring_dilated"`` entries of transformers' attention and mask
interfaces and :func:`register_transformers` (docs/transformers.md)."""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..core.cache import PerBatch
from ..core.call import prepare
from ..core.checks import sinks_meta
from ..core.pattern import Pattern
from ..local import engine
from ..parallel.auto import plan_mesh
from ..parallel.ring import ring_call, ring_call_spec, sharded_ring
from ..parallel.ulysses import sharded_attention
from .config import is_dense, layer_chunk, layer_pattern, layer_window, pattern_from_config
from .decode import decode_attention
from .generation import generation_step, key_reach
from .masks import Keys, batch_keys, chunk_shifts, filled_keys, layer_mask, sdpa_mask_of, shift_keys
from .setting import ATTN_IMPLEMENTATION, sequence_parallel, set_sequence_parallel, spread_of

_NAME = f"attn_implementation={ATTN_IMPLEMENTATION!r}"
_SOFTCAP = f"{_NAME} does not support logit soft-capping (softcap)"


def register_transformers(
    group: dist.ProcessGroup | None = None, *, ulysses_group: dist.ProcessGroup | None = None,
    mesh: Any = None, layout: str = "contiguous",
) -> None:  # fmt: skip
    """Register ``"ring_dilated"`` with transformers' attention and mask
    interfaces, replacing the sequence-parallel setting (docs/transformers.md)."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "ring_attention.register_transformers needs the Hugging Face transformers package: "
            "install the 'hf' extra (pip install 'ring_attention[hf]') or pip install transformers"
        ) from exc
    sp = spread_of(group, ulysses_group, mesh, layout)
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, dilated_attention_forward)
    masks = transformers.masking_utils.AttentionMaskInterface
    masks.register(ATTN_IMPLEMENTATION, dilated_attention_mask)
    set_sequence_parallel(sp)


def dilated_attention_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0, mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None, **kwargs: Any,
) -> torch.Tensor | None:  # fmt: skip
    """transformers' mask-interface entry of ``"ring_dilated"`` (``masks.py``)."""
    config = kwargs.get("config")
    dense, sharded = is_dense(config), sequence_parallel() is not None
    mask = layer_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                      attention_mask, dense, sharded, **kwargs)  # fmt: skip
    if _slices_queries(config) and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        mask = mask[:, None, None]  # the key map as a mask of one query row (_key_map_of)
    return mask


def _slices_queries(config: Any) -> bool:
    """Whether the model slices its layers' masks along the queries (Gemma 4's layers sharing
    earlier layers' keys, in a prefill); a key map holds no query dimension to slice."""
    return bool(getattr(config, "num_kv_shared_layers", 0))


def _key_map_of(config: Any, mask: Any) -> Any:
    """The 2-D key map :func:`dilated_attention_mask` gave such a model as a
    ``(batch, 1, 1, keys)`` mask; any other mask as it is."""
    if _slices_queries(config) and isinstance(mask, torch.Tensor) and mask.dim() == 4 \
            and mask.shape[1:3] == (1, 1) and not mask.is_floating_point():  # fmt: skip
        return mask[:, 0, 0]
    return mask


def dilated_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    is_causal: bool | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention-interface entry of ``"ring_dilated"``
    (docs/transformers.md): ``(out (batch, q_len, heads, head_dim), None)``."""
    if kwargs.get("output_attentions"):
        from transformers.utils import logging

        logging.get_logger(__name__).warning_once(
            f"{_NAME} does not return attention weights (output_attentions=True), as 'sdpa' "
            "does not: set attn_implementation='eager' to get them"
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    config = getattr(module, "config", None)
    attention_mask = _key_map_of(config, attention_mask)
    sp = sequence_parallel()
    if sp is not None:
        return _sharded(module, query, key, value, attention_mask, dropout, scaling, causal,
                        kwargs, sp), None  # fmt: skip
    if kwargs.get("softcap") is not None:
        raise ValueError(_SOFTCAP)
    sinks = kwargs.get("s_aux")
    if _one_query_row(attention_mask, query, key) and is_dense(config) and not dropout:
        return _one_query(query, key, value, attention_mask, scaling, config, sinks), None
    reason = _sdpa_only(attention_mask, dropout, kwargs)
    if reason is not None and sinks is not None:
        raise ValueError(f"{_NAME} with attention sinks (s_aux) cannot apply {reason}")
    if reason is not None:
        if not is_dense(config):
            raise ValueError(
                f"{_NAME} with a dilated pattern (config.dilated_attention) cannot apply {reason}"
            )
        # a 4-D or float mask the caller prepared: sdpa applies it as it is
        prepared = isinstance(attention_mask, torch.Tensor) and (
            attention_mask.dim() != 2 or attention_mask.is_floating_point()
        )
        if config is not None and not prepared and layer_window(module, causal, kwargs.get(
                "sliding_window")) is not None:  # fmt: skip
            raise ValueError(
                f"{_NAME} with a sliding window (config.sliding_window) cannot apply {reason}"
            )
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        kwargs.pop("output_attentions", None)
        reached = None
        if isinstance(attention_mask, torch.Tensor) and not prepared:  # our key map
            attention_mask, reached = sdpa_mask_of(attention_mask, query.shape[2], key.shape[2],
                                                   causal)  # fmt: skip
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask,
                                              dropout=dropout, scaling=scaling,
                                              is_causal=is_causal, **kwargs)  # fmt: skip
        if reached is not None:  # (batch, q_len, heads, head_dim)
            out = out * reached[:, :, None, None].to(out.dtype)
        return out, weights
    pattern = layer_pattern(module, causal, kwargs.get("sliding_window"))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.int64 \
            and attention_mask.shape == (query.shape[0], key.shape[2]):  # fmt: skip
        # the position map: eagerly the filled keys with the pattern (what a dynamic cache
        # takes: cheaper than gathering); compiled, fixed shapes
        filled = None if torch.compiler.is_compiling() else filled_keys(attention_mask)
        if filled is None:
            call, _ = prepare(q, k, v, pattern, scale=scaling, q_start=k.shape[1] - q.shape[1],
                              sinks=sinks)  # fmt: skip
            return decode_attention(q, k, v, attention_mask, call), None
        attention_mask = filled
    return _local(q, k, v, pattern, attention_mask, scaling, kwargs, layer_chunk(module)), None


def _one_query_row(attention_mask: Any, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether ``attention_mask`` is a 4-D bool mask of one query a row."""
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 4
        and attention_mask.dtype == torch.bool
        and attention_mask.shape[0] in (1, query.shape[0])
        and attention_mask.shape[1:] == (1, 1, key.shape[2])
        and query.shape[2] == 1)  # fmt: skip


def _one_query(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
    scaling: float | None, config: Any, sinks: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """One query per row attending the keys its 4-D mask keeps (dense, with
    that key padding; the keys' order does not matter)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    pattern = pattern_from_config(config, False)  # dense: the mask decides the keys
    padding = ~attention_mask[:, 0, 0, :].expand(q.shape[0], -1)
    call, _ = prepare(q, k, v, pattern, scale=scaling, key_padding_mask=padding,
                      q_start=k.shape[1] - 1, sinks=sinks)  # fmt: skip
    return engine.attend(call, q, k, v)[0]


def _sdpa_only(attention_mask: Any, dropout: float, kwargs: Mapping[str, Any]) -> str | None:
    """What sdpa applies and the kernels cannot express, or ``None``."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
        return f"a prepared {attention_mask.dim()}-D attention mask"
    if isinstance(attention_mask, torch.Tensor) and attention_mask.is_floating_point():
        return "a float attention mask"
    if dropout:
        return f"attention dropout (dropout={dropout}; set config.attention_dropout = 0.0)"
    if kwargs.get("position_bias") is not None:
        return "an additive position bias (position_bias)"
    return None


_cu_batches = PerBatch("transformers documents")


@torch.compiler.disable  # reads the boundaries (and a per-batch cache): eager
def _cu_documents(kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """``(the tensor, its boundaries)`` of ``cu_seq_lens_q``/``_k``, or ``None``."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    cu = cu_q if cu_q is not None else cu_k
    if cu is None:
        return None

    def read() -> tuple[int, ...]:
        if cu_q is not None and cu_k is not None and not torch.equal(cu_q.cpu(), cu_k.cpu()):
            raise ValueError(
                "cu_seq_lens_q and cu_seq_lens_k must be equal (self-attention over packed "
                "documents)")  # fmt: skip
        return Pattern((1,), (1,)).with_documents(cu).documents  # checked once

    return cu, _cu_batches.get(cu, "documents", read)


def _with_documents(memo: dict, pattern: Pattern, documents: tuple[int, ...] | None) -> Pattern:
    """``pattern`` with ``documents``, built once per batch."""
    if documents is None:  # one document: nothing to build (what torch.compile traces)
        return pattern
    key = (pattern, documents)
    if key not in memo:
        memo[key] = pattern.with_documents(documents)
    return memo[key]


def _local(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern,
    attention_mask: torch.Tensor | None, scaling: float | None, kwargs: Mapping[str, Any],
    chunk: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """One process: the key map's rows (grouped by documents) through the engine;
    ``chunk``: a chunked layer's, whose chunks start after each row's left padding."""
    if attention_mask is None:
        keys = Keys(k.shape[1])
    elif attention_mask.dtype == torch.bool:  # padding only: nothing to read (compiles)
        keys = Keys(attention_mask.shape[1], ~attention_mask)
    else:
        keys = batch_keys(attention_mask)
    q_len = q.shape[1]
    if not q_len <= min(keys.length, k.shape[1]):
        raise ValueError(
            f"{_NAME}: the mask covers {keys.length} keys, but the layer has {q_len} queries "
            f"and {k.shape[1]} keys")  # fmt: skip
    if keys.length < k.shape[1]:  # a static cache: the keys past the filled ones
        k, v = k[:, : keys.length], v[:, : keys.length]
    q_start = keys.length - q_len
    k_start = keys.length - k.shape[1]  # a sliding-window cache: the last keys
    padding = keys.padding
    if k_start:
        _check_reach(pattern, q_start, k_start)
        padding = None if padding is None else padding[:, k_start:]
    rows, memo = keys.rows, keys.patterns
    given = any(kwargs.get(f"cu_seq_lens_{s}") is not None for s in "qk")
    cu = _cu_documents(kwargs) if given else None
    if cu is not None:
        if q_start:
            raise ValueError(
                f"{_NAME} takes packed documents (cu_seq_lens_q) only when the queries are the "
                f"whole sequence, got {q_len} queries after {q_start} cached keys")  # fmt: skip
        rows, memo = ((None, cu[1]),), _cu_batches.get(cu[0], "patterns", dict)
    starts = None
    if chunk is not None and padding is not None:
        shift, most = chunk_shifts(keys.padding, chunk)
        if most:
            k, v, padding = shift_keys(shift, most, k, v, padding)
            starts = q_start + shift
    call, _ = prepare(q, k, v, pattern, scale=scaling, key_padding_mask=padding, q_start=q_start,
                      k_start=k_start, q_starts=starts, sinks=kwargs.get("s_aux"))  # fmt: skip
    outs, order = [], []
    for members, documents in rows:
        p = _with_documents(memo, pattern, documents)
        p.check_length(keys.length)
        qr, kr, vr, pr = (
            t if t is None or members is None else t.index_select(0, members)
            for t in (q, k, v, padding)
        )
        part = call.with_pattern(p).with_mask(pr)
        outs.append(engine.attend(part, qr, kr, vr)[0])
        order.append(members)
    if len(outs) == 1:
        return outs[0]
    inverse = torch.argsort(torch.cat(order))
    return torch.cat(outs).index_select(0, inverse)


def _check_reach(pattern: Pattern, q_start: int, k_start: int) -> None:
    """A layer whose keys start at ``k_start > 0`` must not reach before them."""
    earliest = key_reach(pattern, q_start, q_start)[0]
    if earliest < k_start:
        reach = "every earlier key" if earliest == 0 else f"keys from position {earliest}"
        raise ValueError(
            f"{_NAME}: the layer's cache holds the keys from position {k_start} on, but its "
            f"queries from position {q_start} reach {reach} (a cache that drops keys needs a "
            "sliding window or chunks no wider than it keeps)")  # fmt: skip


def _sharded(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: Any, dropout: float, scaling: float | None, causal: bool,
    kwargs: Mapping[str, Any], sp: Any,
) -> torch.Tensor:  # fmt: skip
    """Ring attention over the sequence-parallel ranks, Ulysses, the hybrid or
    a generation step; a refusal is reported on every rank (handshake)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    documents = cu_q if cu_q is not None else cu_k
    if documents is None and kwargs.get("use_cache"):  # generation: the same sequence everywhere
        pattern_of = functools.partial(layer_pattern, module, causal, kwargs.get("sliding_window"))
        return generation_step(query, key, value, attention_mask, scaling, kwargs, sp, pattern_of,
                               layer_chunk(module))  # fmt: skip
    refusal = _sharded_refusal(query, key, attention_mask, dropout, kwargs, documents is None)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    sinks = kwargs.get("s_aux")
    spread = sp.spread()
    if sp.auto and documents is not None:  # the planner's grid for this layer (once per shape)
        spread = _auto_spread(sp, module, causal, kwargs, q, k, documents)
    if spread["ulysses_group"] is not None or spread["mesh"] is not None:
        # Ulysses or the hybrid: the refusal is reported in its rounds
        pattern = functools.partial(_grid_pattern, module, causal, refusal, kwargs)
        return sharded_attention(q, k, v, pattern, (), cu_seqlens=None, scale=scaling,
                                 layout=sp.layout, return_lse=False, sinks=sinks, ring=sharded_ring,
                                 **spread)  # fmt: skip
    spec = ring_call_spec(_sharded_pattern, module, causal, refusal, kwargs.get("sliding_window"),
                          scale=scaling, group=spread["group"], layout=sp.layout,
                          sinks=sinks_meta(sinks))  # fmt: skip
    if sinks is None:
        return ring_call(q, k, v, spec, documents)
    out, lse = ring_call(q, k, v, spec, documents, return_lse=True)
    return engine.fold_sinks(out, lse, sinks)[0]


def _auto_spread(
    sp: Any, module: torch.nn.Module, causal: bool, kwargs: Mapping[str, Any],
    q: torch.Tensor, k: torch.Tensor, documents: torch.Tensor,
) -> dict[str, Any]:  # fmt: skip
    """``mesh="auto"``: the planner's grid for this layer."""
    try:
        pattern = layer_pattern(module, causal, kwargs.get("sliding_window"))
    except ValueError:  # reported by the ring's handshake, as without "auto"
        return sp.spread()
    n = int(documents[-1])
    key = (pattern, n, q.shape[2], k.shape[2], q.shape[3], q.dtype, q.device.type)
    plan = functools.partial(plan_mesh, n, q.shape[2], k.shape[2], q.shape[3], pattern,
                             group=sp.group, device_type=q.device.type, dtype=q.dtype,
                             batch=q.shape[0])  # fmt: skip
    return sp.layer_spread(key, plan)


def _sharded_refusal(
    query: torch.Tensor, key: torch.Tensor, attention_mask: Any, dropout: float,
    kwargs: Mapping[str, Any], no_documents: bool,
) -> str | None:  # fmt: skip
    """Why this rank's sharded call cannot run, or ``None``."""
    if kwargs.get("softcap") is not None:
        return _SOFTCAP
    reason = _sdpa_only(attention_mask, dropout, kwargs)
    if reason is not None:
        return f"{_NAME} with sequence parallelism cannot apply {reason}"
    if query.shape[2] != key.shape[2]:
        return (
            f"{_NAME} with sequence parallelism attends a sequence to itself; got "
            f"{query.shape[2]} queries and {key.shape[2]} keys (decoding with a KV cache)"
        )
    if attention_mask is not None:
        return (
            f"{_NAME} with sequence parallelism takes no padding mask: with causal attention "
            "right padding needs none (drop attention_mask and set the padded labels to "
            "-100), or pack the documents (cu_seq_lens_q)")  # fmt: skip
    if no_documents:
        return (
            f"{_NAME} with sequence parallelism needs the global document boundaries "
            "cu_seq_lens_q (a rank cannot see them in its shard of position_ids): build "
            "each rank's batch with ring_attention.hf.shard_causal_lm_batch")  # fmt: skip
    return None


def _sharded_pattern(
    module: torch.nn.Module, causal: bool, refusal: str | None, sliding_window: int | None
) -> Pattern:
    """The layer's pattern (its documents come with the call), or the refusal."""
    if refusal is not None:
        raise ValueError(refusal)
    return layer_pattern(module, causal, sliding_window)


def _grid_pattern(
    module: torch.nn.Module, causal: bool, refusal: str | None, kwargs: Mapping[str, Any]
) -> Pattern:
    """Ulysses and the hybrid: the pattern with the batch's documents."""
    pattern = _sharded_pattern(module, causal, refusal, kwargs.get("sliding_window"))
    tensor, documents = _cu_documents(kwargs)  # given: else refused
    return _with_documents(_cu_batches.get(tensor, "patterns", dict), pattern, documents)
