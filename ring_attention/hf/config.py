"""The pattern of a layer, read from its model config (``config.dilated_attention``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ..pattern import Pattern, as_flag

__all__ = ["CONFIG_KEY", "is_dense", "layer_pattern", "pattern_from_config"]

#: The config attribute holding the pattern.
CONFIG_KEY = "dilated_attention"
_FIELDS = ("segment_lengths", "dilation_rates", "head_groups", "head_offsets")
# One segment longer than any sequence: dense attention, equal to "sdpa".
_DENSE_SEGMENT = 2**62


def is_dense(config: Any) -> bool:
    """Whether ``config`` has no pattern (dense attention, equal to ``"sdpa"``)."""
    return getattr(config, CONFIG_KEY, None) is None


def layer_pattern(module: torch.nn.Module, causal: bool) -> Pattern:
    """The pattern of one attention layer: the one place a layer's attention
    pattern is decided (a per-layer attribute such as a sliding window joins
    it here).

    Raises:
        ValueError: the module has no config, or a bad config entry.
    """
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(
            f"attn_implementation='ring_dilated' reads the pattern from the attention "
            f"module's config.{CONFIG_KEY}, but {type(module).__name__} has no config"
        )
    return pattern_from_config(config, causal)


def pattern_from_config(config: Any, causal: bool) -> Pattern:
    """The :class:`Pattern` of ``config.dilated_attention`` (dense without it).

    The entry is a dict with ``segment_lengths`` and ``dilation_rates`` and
    optionally ``head_groups`` and ``head_offsets``; values may be Python or
    NumPy integers, lists, tuples, NumPy arrays or 1-D tensors. Cached by the
    entry's contents: a model builds it once, not per call.

    Raises:
        ValueError: naming ``config.dilated_attention``, for an entry that is
            not a dict, lacks ``segment_lengths``/``dilation_rates``, has
            unknown keys, values that are not integers (nested lists
            included) or an invalid pattern.
    """
    causal = as_flag(causal, "causal")  # before the cache, whose keys take 1 for True
    entry = getattr(config, CONFIG_KEY, None)
    if entry is None:
        return _pattern(None, causal)
    if not isinstance(entry, Mapping):
        raise ValueError(
            f"config.{CONFIG_KEY} must be a dict with keys {list(_FIELDS)}, "
            f"got {type(entry).__name__}"
        )
    unknown = sorted(str(key) for key in set(entry) - set(_FIELDS))
    missing = [key for key in _FIELDS[:2] if key not in entry]
    if unknown or missing:
        raise ValueError(
            f"config.{CONFIG_KEY} takes the keys {list(_FIELDS)} (the first two required), "
            f"got unknown {unknown} and missing {missing}"
        )
    if "head_groups" in entry:
        as_flag(entry["head_groups"], f"config.{CONFIG_KEY}['head_groups']")
    frozen = tuple((key, _freeze(entry[key], key)) for key in _FIELDS if key in entry)
    return _pattern(frozen, causal)


def _freeze(value: Any, key: str) -> Any:
    """``value`` as a hashable cache key: NumPy arrays, NumPy scalars and
    tensors as Python values, lists as tuples (nested ones too: the pattern
    then rejects them with a message naming the entry)."""
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


def _pattern(entry: tuple | None, causal: bool) -> Pattern:
    # torch.compile traces the construction (once; it ignores an LRU cache, and warns)
    build = _cached_pattern.__wrapped__ if torch.compiler.is_compiling() else _cached_pattern
    return build(entry, causal)


@functools.lru_cache(maxsize=64)
def _cached_pattern(entry: tuple | None, causal: bool) -> Pattern:
    if entry is None:
        return Pattern((_DENSE_SEGMENT,), (1,), causal=causal)
    try:
        return Pattern(causal=causal, **dict(entry))
    except ValueError as exc:
        raise ValueError(f"config.{CONFIG_KEY}: {exc}") from None
