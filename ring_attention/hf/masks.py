"""What transformers' mask preparation decided, carried to the attention calls.

transformers prepares the mask once per forward (``create_causal_mask``,
``create_sliding_window_causal_mask`` for sliding-window layers): it
decides whether the batch is packed (its packed-sequence detection runs only
without a padding mask and without a cache), where the queries stand among
the keys (``q_offset``, ``kv_offset`` and ``kv_length`` from the cache: a
static cache's keys run past the filled part, a sliding-window cache holds
only the last keys), and which keys are padding. Its mask interface then
calls :func:`dilated_attention_mask`, whose value reaches every layer's
attention call as ``attention_mask``. That value is

- ``None``: no padding, one document per row, and the layer's keys are
  exactly the filled ones from position 0 (the queries are the last
  ``q_length`` of them);
- or a 2-D tensor ``(batch, filled)`` over the positions ``[0, filled)``,
  ``filled = q_offset + q_length`` the end of the keys in use: a layer with
  more keys than that (a static cache) attends only the first ``filled``
  of them (as flash-attention's masks do for static caches), a layer with
  fewer (a sliding-window cache) holds the last ones, positions ``[filled -
  keys, filled)``. Without documents a bool tensor, ``True`` for a key,
  ``False`` for padding (transformers' own 2-D padding mask, so a mask fed
  back to the model, as ``generate`` does with static caches, means the
  same); with packed documents an int32 tensor, ``0`` for a padding key,
  ``d >= 1`` for a key of document ``d`` of its row.

Without a pattern, a static cache's decode step (and, under
``torch.compile``, any queries continuing a cache) gets transformers' own
4-D ``"sdpa"`` mask instead (:func:`_sdpa_masks_it`): built without reading
where the queries stand, it has one shape for every step. With a pattern,
queries continuing a static cache (a decode step, or several: a chunk of
prefill, assisted decoding) get the int64 position map of
:mod:`ring_attention.hf.decode` (the same: one shape for every step of ``L``
queries); an eager layer reads it as the key map of the filled keys
(:func:`filled_keys`).

The window itself is not in the key map: each layer reads it from its config
(:func:`ring_attention.hf.config.layer_window`), and the mask function's
window must be ``config.sliding_window``.

:func:`batch_keys` reads an int32 map once per batch (the first layer) and
hands the same :class:`Keys` to the other layers. Under ``torch.compile``
:func:`dilated_attention_mask` runs eagerly (one graph break per forward),
except for queries continuing a cache (the masks above, and the bool key
map of a cache whose position is an int, built by traced tensor operations);
the layers read nothing from a bool map, so they compile without breaks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.cache import PerBatch
from .config import is_dense
from .decode import position_map
from .setting import ATTN_IMPLEMENTATION, sequence_parallel

__all__ = [
    "Keys",
    "PerBatch",
    "batch_keys",
    "dilated_attention_mask",
    "filled_keys",
    "sdpa_mask_of",
]


def _closure(fn: Callable) -> dict[str, Any]:
    cells = fn.__closure__ or ()
    return {
        name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells, strict=True)
    }


def _packed_sequences(fn: Callable | None, config: Any = None) -> torch.Tensor | None:
    """transformers' packed-sequence decision inside its mask function: the
    ``(batch, n)`` sequence index of every token when it found packed
    sequences, else ``None``.

    Accepts only mask functions whose mask the kernels express exactly:
    causal or bidirectional, possibly made packed-sequence aware, and
    causal with a sliding window of ``config.sliding_window`` (the layers
    read their window from the config: ring_attention/hf/config.py); padding
    arrives separately as the 2-D mask. The mask functions are
    transformers' closures, so this walks their structure and fails closed
    on anything it does not recognise.
    """
    from transformers import masking_utils as mu

    if fn is None or fn is mu.causal_mask_function or fn is mu.bidirectional_mask_function:
        return None
    name = getattr(fn, "__qualname__", "")
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        return _closure(fn)["packed_sequence_mask"]
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        # causality and the window on the positions inside each packed
        # sequence: within a sequence they step by one (transformers cuts
        # sequences where they do not), so it is on the columns
        return _packed_sequences(_closure(fn).get("mask_function"), config)
    if name == "and_masks.<locals>.and_mask":  # a custom part fails below
        parts = _closure(fn).get("mask_functions", ())
        found = [_packed_sequences(part, config) for part in parts]
        found = [f for f in found if f is not None]
        return found[0] if found else None
    if name == "sliding_window_overlay.<locals>.inner_mask":
        width = _closure(fn).get("sliding_window")
        expected = getattr(config, "sliding_window", None)
        if width != expected:
            raise ValueError(
                f"attn_implementation={ATTN_IMPLEMENTATION!r} takes the sliding window of "
                f"config.sliding_window ({expected!r}); this model's mask slides over {width!r}"
            )
        return None
    if name == "chunked_overlay.<locals>.inner_mask":  # Llama 4's chunked layers
        cells = _closure(fn)
        chunk, left = cells.get("chunk_size"), cells.get("left_padding")
        expected = getattr(config, "attention_chunk_size", None)
        if chunk != expected:
            raise ValueError(
                f"attn_implementation={ATTN_IMPLEMENTATION!r} takes the chunks of "
                f"config.attention_chunk_size ({expected!r}); this model's mask has {chunk!r}"
            )
        if isinstance(left, torch.Tensor) and bool((left != 0).any()):
            raise ValueError(
                f"attn_implementation={ATTN_IMPLEMENTATION!r} starts chunks at position 0: "
                "chunked attention with left padding is not supported (pad on the right)"
            )
        return None
    if name.startswith("sliding_window_bidirectional_overlay."):
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} applies a sliding window to causal "
            "attention only (this model's mask is a bidirectional sliding window)"
        )
    raise ValueError(
        f"attn_implementation={ATTN_IMPLEMENTATION!r} expresses causal or bidirectional masks "
        f"with padding or packed documents, and causal sliding windows, only; this model builds "
        f"its mask with {name or fn!r} (chunked attention, block masks and custom and/or mask "
        "functions are not supported)"
    )


def dilated_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask-interface entry of ``"ring_dilated"``: ``None`` or
    the ``(batch, q_offset + q_length)`` key map of the module docstring.
    Raises ``ValueError`` for mask structures the kernels cannot express.

    Two exceptions build no key map, so that queries continuing a static
    cache read no position and have one shape for every step: without a
    pattern transformers' own 4-D ``"sdpa"`` mask (:func:`_sdpa_masks_it`);
    with one, the position map of :mod:`ring_attention.hf.decode` (``generate``
    builds the mask of a static cache's step eagerly and hands it to the
    compiled step, so its shape must not follow the position). Under ``torch.compile`` queries
    continuing a cache whose position is an int (a sliding-window layer)
    get the key map built by traced tensor operations; elsewhere it is
    built eagerly (one graph break per forward)."""
    config = kwargs.get("config")
    if _sdpa_masks_it(q_length, kv_length, q_offset, kv_offset, config):
        from transformers.masking_utils import sdpa_mask

        kwargs["allow_is_causal_skip"] = False  # None would mean every key of the cache
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                         mask_function, attention_mask, **kwargs)  # fmt: skip
    compiling = torch.compiler.is_compiling()
    tensor = isinstance(q_offset, torch.Tensor)
    if tensor and kv_offset == 0:
        if not compiling:  # its closures cannot be traced
            _packed_sequences(mask_function, config)  # raises for what the kernels cannot express
        return position_map(batch_size, q_length, kv_length, q_offset, attention_mask, **kwargs)
    continues = q_offset != 0 or kv_offset != 0 or kv_length != q_length
    if compiling and continues and not tensor:
        # with a cache transformers detects no packed documents; the mask
        # function's closures cannot be traced (the eager prefill checked them)
        filled = _filled(q_offset, q_length, kv_offset, kv_length)
        return _padding(batch_size, filled, attention_mask, kwargs.get("device", "cpu"))
    return _key_map(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                    attention_mask, **kwargs)  # fmt: skip


def _sdpa_masks_it(
    q_length: int, kv_length: int, q_offset: int | torch.Tensor, kv_offset: int, config: Any
) -> bool:
    """Whether a layer without a pattern (``config``) gets transformers' own
    ``"sdpa"`` mask ``(batch, 1, q_length, kv_length)``: where the queries
    stand among their keys would have to be read otherwise.

    - A static cache gives the position as a tensor: its decode step (one
      query) gets one mask shape for every step, so a compiled decode step
      does not recompile per position (the layers apply its one row as key
      padding with the kernels: ring_attention/hf/attention.py).
    - Under ``torch.compile`` queries continuing a cache get it too, so the
      forward compiles without a graph break (several queries: the layers
      hand that mask to ``"sdpa"``; one: the kernels, as above).
    """
    if not is_dense(config):
        return False
    tensor = isinstance(q_offset, torch.Tensor)
    if torch.compiler.is_compiling():
        return tensor or q_offset != 0 or kv_offset != 0 or kv_length != q_length
    return tensor and q_length == 1


def _filled(q_offset: int, q_length: int, kv_offset: int, kv_length: int) -> int:
    """Where the queries end (the end of the keys in use), checked against the cache."""
    filled = q_offset + q_length
    if filled > kv_offset + kv_length:
        raise ValueError(
            f"the queries end at {filled}, past the {kv_length} keys of the cache from "
            f"{kv_offset} (q_offset={q_offset}, q_length={q_length})"
        )
    return filled


def _padding(
    batch_size: int, filled: int, attention_mask: torch.Tensor | None, device: Any
) -> torch.Tensor:
    """The bool ``(batch, filled)`` map of the keys not padded (``True``); keys
    past the 2-D mask are padding, as transformers pads it."""
    if attention_mask is None:
        return torch.ones(batch_size, filled, dtype=torch.bool, device=device)
    keep = attention_mask[:, :filled].to(torch.bool)
    if keep.shape[1] < filled:
        keep = torch.nn.functional.pad(keep, (0, filled - keep.shape[1]), value=False)
    return keep


@torch.compiler.disable  # reads mask functions' closures and values: eager, one graph break
def _key_map(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor,
    kv_offset: int,
    mask_function: Callable | None,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The key map of the module docstring (eager)."""
    documents = _packed_sequences(mask_function, kwargs.get("config"))
    # q_offset is a 0-d tensor for static caches
    filled = _filled(int(q_offset), q_length, kv_offset, kv_length)
    device = attention_mask.device if attention_mask is not None else kwargs.get("device", "cpu")
    keep = None if attention_mask is None else _padding(batch_size, filled, attention_mask, device)
    if keep is not None and bool(keep.all()):
        keep = None
    if sequence_parallel() is not None:
        documents = None  # a shard's positions cannot show them: cu_seq_lens_q holds them
    elif documents is not None and bool((documents == documents[:, :1]).all()):
        # one document per row: what transformers decides unless it is being
        # compiled (it cannot look then; this function runs eagerly, once per
        # forward, and the layers, given no mask, compile without a break)
        documents = None
    if keep is None and documents is None and filled == kv_length and not kv_offset:
        return None
    if documents is None:  # padding only: the layers need not read it
        return _padding(batch_size, filled, None, device) if keep is None else keep
    ids = (documents + 1).to(device=device, dtype=torch.int32)
    return ids if keep is None else ids * keep


# ---------------------------------------------------------------------------
# The attention side: the key map read once per batch.


@dataclass(frozen=True)
class Keys:
    """The keys of one batch as the kernels take them.

    ``length``: the keys in use (the first ``length`` of a layer's keys; the
    queries are the last of them). ``padding``: ``key_padding_mask`` ``(batch,
    length)``, ``True`` = ignore, or ``None``. ``rows``: per group of batch
    rows with the same documents, ``(row indices or None for all rows,
    document boundaries or None for one document)``.
    """

    length: int
    padding: torch.Tensor | None = None
    rows: tuple[tuple[torch.Tensor | None, tuple[int, ...] | None], ...] = ((None, None),)
    # Patterns with these documents, per base pattern (built once per batch).
    patterns: dict = field(default_factory=dict, compare=False, repr=False)


_masks = PerBatch("transformers masks")


@torch.compiler.disable  # reads the map's values (and a per-batch cache): eager
def batch_keys(mask: torch.Tensor) -> Keys:
    """:class:`Keys` of the 2-D key map (computed once per batch)."""
    return _masks.get(mask, "keys", lambda: _read(mask))


@torch.compiler.disable  # reads the position (and a per-batch cache): eager
def filled_keys(positions: torch.Tensor) -> torch.Tensor | None:
    """The bool key map ``(batch, p + 1)`` of the position map of queries
    ending at ``p`` (ring_attention/hf/decode.py), computed once per batch;
    ``None`` when it allows no key (then ``p`` is unknown)."""

    def read() -> torch.Tensor | None:
        filled = int(positions.amax())
        return positions[:, :filled] > 0 if filled else None

    return _masks.get(positions, "filled", read)


def _read(mask: torch.Tensor) -> Keys:
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} takes a 2-D bool or integer mask "
            f"(batch, keys), nonzero = attend; got a {mask.dtype} mask of shape "
            f"{tuple(mask.shape)}"
        )
    batch, length = mask.shape
    ids = mask.to(torch.int64)
    if bool((ids < 0).any()):
        raise ValueError(f"the key map of attn_implementation={ATTN_IMPLEMENTATION!r} is >= 0")
    pad = ids == 0
    if bool(pad.any()):
        if bool((ids > 1).any()):
            raise ValueError(
                f"attn_implementation={ATTN_IMPLEMENTATION!r} takes padding or packed documents "
                "in one mask, not both"
            )
        return Keys(length, pad)
    starts = torch.nonzero(ids[:, 1:] != ids[:, :-1])
    if starts.numel() == 0:
        return Keys(length)
    inner: list[list[int]] = [[] for _ in range(batch)]
    for row, col in starts.tolist():
        inner[row].append(col + 1)
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, cuts in enumerate(inner):
        groups.setdefault((0, *cuts, length), []).append(row)
    if len(groups) == 1:
        return Keys(length, None, ((None, next(iter(groups))),))
    rows = tuple(
        (torch.tensor(members, device=mask.device), docs) for docs, members in groups.items()
    )
    return Keys(length, None, rows)


def sdpa_mask_of(
    key_map: torch.Tensor, q_len: int, k_len: int, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-D bool mask ``(batch, 1, q_len, k_len)`` sdpa takes for a key
    map of :func:`dilated_attention_mask` (bool or int32 documents) and a
    layer of ``q_len`` queries and ``k_len`` keys placed as the module
    docstring says, with ``(batch, q_len)``: whether each query row reaches
    a key. A row that reaches none attends every key in the mask (sdpa
    gives NaN for a row with none) and its output must be zeroed, as the
    kernels' is."""
    batch, filled = key_map.shape
    dev = key_map.device
    q_pos = torch.arange(filled - q_len, filled, device=dev)
    k_pos = torch.arange(filled - k_len, filled, device=dev) if k_len < filled else (
        torch.arange(k_len, device=dev))  # fmt: skip
    in_map = k_pos < filled  # a static cache: the slots past the filled keys
    at = k_pos.clamp(max=filled - 1)
    keys = key_map[:, at]
    if key_map.dtype == torch.bool:
        allowed = keys[:, None, :].expand(batch, q_len, k_len)
    else:  # documents: the query's own, never padding (0)
        allowed = (keys[:, None, :] == key_map[:, q_pos][:, :, None]) & (keys[:, None, :] != 0)
    allowed = allowed & in_map
    if causal:
        allowed = allowed & (k_pos[None, :] <= q_pos[:, None])
    reached = allowed.any(dim=-1)
    allowed = allowed | ~reached[..., None]
    return allowed[:, None], reached
