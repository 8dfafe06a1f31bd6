"""The pattern of a layer, read from its model config (``config.dilated_attention``)."""

from collections.abc import Mapping
from typing import Any

import torch

from ..core.cache import cached
from ..core.pattern import DENSE, Pattern, as_flag

#: The config attribute holding the pattern.
CONFIG_KEY = "dilated_attention"
_FIELDS = ("segment_lengths", "dilation_rates", "head_groups", "head_offsets")


def is_dense(config: Any) -> bool:
    """Whether ``config`` has no pattern (dense attention, equal to ``"sdpa"``)."""
    return getattr(config, CONFIG_KEY, None) is None


def layer_pattern(
    module: torch.nn.Module, causal: bool, sliding_window: int | None = None
) -> Pattern:
    """The pattern of one attention layer, the one place it is decided:
    ``config.dilated_attention``, the layer's chunk or sliding window."""
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(
            f"attn_implementation='ring_dilated' reads the pattern from the attention "
            f"module's config.{CONFIG_KEY}, but {type(module).__name__} has no config")  # fmt: skip
    chunk = layer_chunk(module)
    if chunk is not None:
        return _pattern((("segment_lengths", (chunk,)), ("dilation_rates", (1,))), causal, None)
    return pattern_from_config(config, causal, layer_window(module, causal, sliding_window))


def layer_chunk(module: torch.nn.Module) -> int | None:
    """The chunk of a chunked-attention layer (Llama 4's), or ``None``."""
    config = module.config
    types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if types is None or not isinstance(index, int) or not 0 <= index < len(types):
        return None
    if types[index] != "chunked_attention":
        return None
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"config.attention_chunk_size must be an integer >= 1, got {chunk!r}")
    if not is_dense(config):
        raise ValueError(
            f"attn_implementation='ring_dilated': layer {index} is chunked attention "
            f"(config.attention_chunk_size = {chunk}), which does not combine with "
            f"config.{CONFIG_KEY}")  # fmt: skip
    return chunk


def layer_window(
    module: torch.nn.Module, causal: bool, sliding_window: int | None = None
) -> tuple[int, int] | None:
    """The sliding window of one layer as the kernels take it (``W`` is
    ``(W - 1, 0)`` on the layers transformers slides), or ``None``."""
    config = module.config
    width = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if width is not None and types is not None:
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or not 0 <= index < len(types):
            raise ValueError(
                f"config.layer_types decides which layers slide, but {type(module).__name__} "
                f"has no layer_idx in [0, {len(types)}), got {index!r}")  # fmt: skip
        width = width if types[index] == "sliding_attention" else None
    if sliding_window is not None and sliding_window != width:
        raise ValueError(
            f"attn_implementation='ring_dilated': the layer passes sliding_window="
            f"{sliding_window!r}, but its mask is {'full' if width is None else width} "
            "(config.sliding_window and config.layer_types decide it, as for 'sdpa')")  # fmt: skip
    if width is None:
        return None
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"config.sliding_window must be an integer >= 1 or None, got {width!r}")
    if not causal:
        raise ValueError(
            f"attn_implementation='ring_dilated' applies a sliding window (config."
            f"sliding_window = {width}) to causal attention only")  # fmt: skip
    return (width - 1, 0)


def pattern_from_config(
    config: Any, causal: bool, window: tuple[int, int] | None = None
) -> Pattern:
    """The :class:`Pattern` of ``config.dilated_attention`` (dense without it)
    with the sliding ``window``, cached by the entry's contents."""
    causal = as_flag(causal, "causal")  # before the cache, whose keys take 1 for True
    entry = getattr(config, CONFIG_KEY, None)
    if entry is None:
        return _pattern(None, causal, window)
    if not isinstance(entry, Mapping):
        raise ValueError(
            f"config.{CONFIG_KEY} must be a dict with keys {list(_FIELDS)}, "
            f"got {type(entry).__name__}")  # fmt: skip
    unknown = sorted(str(key) for key in set(entry) - set(_FIELDS))
    missing = [key for key in _FIELDS[:2] if key not in entry]
    if unknown or missing:
        raise ValueError(
            f"config.{CONFIG_KEY} takes the keys {list(_FIELDS)} (the first two required), "
            f"got unknown {unknown} and missing {missing}")  # fmt: skip
    if "head_groups" in entry:
        as_flag(entry["head_groups"], f"config.{CONFIG_KEY}['head_groups']")
    frozen = tuple((key, _freeze(entry[key], key)) for key in _FIELDS if key in entry)
    return _pattern(frozen, causal, window)


def _freeze(value: Any, key: str) -> Any:
    """``value`` as a hashable cache key (arrays and tensors as Python values)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # NumPy arrays and scalars, tensors
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v, key) for v in value)
    try:
        hash(value)
    except TypeError:
        raise ValueError(
            f"config.{CONFIG_KEY}[{key!r}] must hold integers (or a bool / a string for "
            f"head_groups / head_offsets), got {value!r}"
        ) from None
    return value


def _pattern(entry: tuple | None, causal: bool, window: tuple[int, int] | None) -> Pattern:
    # torch.compile traces the construction (once; it ignores an LRU cache, and warns)
    build = _cached_pattern.__wrapped__ if torch.compiler.is_compiling() else _cached_pattern
    return build(entry, causal, window)


@cached("transformers layer patterns", 64)
def _cached_pattern(entry: tuple | None, causal: bool, window: tuple[int, int] | None) -> Pattern:
    if entry is None:
        return Pattern(DENSE.segment_lengths, DENSE.dilation_rates, causal=causal, window=window)
    try:
        return Pattern(causal=causal, window=window, **dict(entry))
    except ValueError as exc:
        raise ValueError(f"config.{CONFIG_KEY}: {exc}") from None
