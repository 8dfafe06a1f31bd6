"""What transformers' mask preparation decided, carried to the layers as
``attention_mask`` (docs/transformers.md): ``None``, a 2-D key map, the
``"sdpa"`` 4-D mask or a position map; read once per batch."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.cache import PerBatch

_NAME = "attn_implementation='ring_dilated'"


def _closure(fn: Callable) -> dict[str, Any]:
    cells = zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True)
    return {name: cell.cell_contents for name, cell in cells}


def _packed_sequences(
    fn: Callable | None, config: Any = None, shifts: bool = False
) -> torch.Tensor | None:
    """The packed-sequence index inside transformers' mask function, or ``None``; fails closed
    on any mask function the kernels do not express (``shifts``: left-padded chunks are the
    layer's to shift, ``chunk_shifts``, or to refuse on every rank through the handshake)."""
    from transformers import masking_utils as mu

    if fn is None or fn is mu.causal_mask_function or fn is mu.bidirectional_mask_function:
        return None
    name = getattr(fn, "__qualname__", "")
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        return _closure(fn)["packed_sequence_mask"]
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        # positions step by one inside a packed sequence: causality is on the columns
        return _packed_sequences(_closure(fn).get("mask_function"), config, shifts)
    if name == "and_masks.<locals>.and_mask":  # a custom part fails below
        parts = _closure(fn).get("mask_functions", ())
        found = [f for f in (_packed_sequences(p, config, shifts) for p in parts) if f is not None]
        return found[0] if found else None
    if name == "sliding_window_overlay.<locals>.inner_mask":
        width = _closure(fn).get("sliding_window")
        expected = getattr(config, "sliding_window", None)
        if width != expected:
            raise ValueError(
                f"{_NAME} takes the sliding window of config.sliding_window ({expected!r}); "
                f"this model's mask slides over {width!r}")  # fmt: skip
        return None
    if name == "chunked_overlay.<locals>.inner_mask":  # Llama 4's chunked layers
        cells = _closure(fn)
        chunk, left = cells.get("chunk_size"), cells.get("left_padding")
        expected = getattr(config, "attention_chunk_size", None)
        if chunk != expected:
            raise ValueError(
                f"{_NAME} takes the chunks of config.attention_chunk_size ({expected!r}); this "
                f"model's mask has {chunk!r}")  # fmt: skip
        if not shifts and isinstance(left, torch.Tensor) and bool((left != 0).any()):
            raise ValueError(
                f"{_NAME} shifts the chunks of left-padded rows in one process; chunked "
                "attention with left padding is not supported over a static cache of full "
                "layers (pad on the right)"
            )
        return None
    if name.startswith("sliding_window_bidirectional_overlay."):
        raise ValueError(
            f"{_NAME} applies a sliding window to causal attention only (this model's mask is a "
            "bidirectional sliding window)")  # fmt: skip
    raise ValueError(
        f"{_NAME} expresses causal or bidirectional masks "
        f"with padding or packed documents, and causal sliding windows, only; this model builds "
        f"its mask with {name or fn!r} (chunked attention, block masks and custom and/or mask "
        "functions are not supported)")  # fmt: skip


def layer_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor, kv_offset: int,
    mask_function: Callable | None, attention_mask: torch.Tensor | None, dense: bool,
    sharded: bool, **kwargs: Any,
) -> torch.Tensor | None:  # fmt: skip
    """What the layers get for transformers' mask arguments (``dense``: no
    pattern, ``sharded``: sequence parallelism)."""
    compiling = torch.compiler.is_compiling()
    tensor = isinstance(q_offset, torch.Tensor)  # a static cache's
    continues = not tensor and (q_offset != 0 or kv_offset != 0 or kv_length != q_length)
    if dense and ((tensor or continues) if compiling else (tensor and q_length == 1)):
        from transformers.masking_utils import sdpa_mask  # a model without a pattern: "sdpa"'s

        kwargs["allow_is_causal_skip"] = False  # None would mean every key of the cache
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                         mask_function, attention_mask, **kwargs)  # fmt: skip
    if tensor and kv_offset == 0:
        if not compiling:  # its closures cannot be traced; raises for what the kernels cannot do
            _packed_sequences(mask_function, kwargs.get("config"))
        return position_map(batch_size, q_length, kv_length, q_offset, attention_mask, **kwargs)
    if compiling and continues:
        # with a cache no packed documents; the eager prefill checked the mask function
        filled = _filled(q_offset, q_length, kv_offset, kv_length)
        return _padding(batch_size, filled, attention_mask, kwargs.get("device", "cpu"))
    return _key_map(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                    attention_mask, sharded, **kwargs)  # fmt: skip


def position_map(
    batch_size: int, q_length: int, kv_length: int, q_offset: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs: Any,
) -> torch.Tensor:  # fmt: skip
    """The int64 ``(batch, slots)`` position map: ``P + 1`` (``P`` the last
    query's position) where its causal ``"sdpa"`` row attends, else ``0``."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    kwargs["allow_is_causal_skip"] = False  # None would mean every slot of the cache
    last = q_offset + (q_length - 1)
    row = sdpa_mask(batch_size, 1, kv_length, last, 0, causal_mask_function, attention_mask,
                    **kwargs)  # fmt: skip
    row = row[:, 0, 0, :].expand(batch_size, kv_length)
    return torch.where(row, last.to(device=row.device, dtype=torch.int64) + 1, 0)


def _filled(q_offset: int, q_length: int, kv_offset: int, kv_length: int) -> int:
    """Where the queries end (the end of the keys in use), checked against the cache."""
    filled = q_offset + q_length
    if filled > kv_offset + kv_length:
        raise ValueError(
            f"the queries end at {filled}, past the {kv_length} keys of the cache from "
            f"{kv_offset} (q_offset={q_offset}, q_length={q_length})")  # fmt: skip
    return filled


def _padding(
    batch_size: int, filled: int, attention_mask: torch.Tensor | None, device: Any
) -> torch.Tensor:
    """The bool ``(batch, filled)`` map of the keys not padded (``True``)."""
    if attention_mask is None:
        return torch.ones(batch_size, filled, dtype=torch.bool, device=device)
    keep = attention_mask[:, :filled].to(torch.bool)
    if keep.shape[1] < filled:
        keep = torch.nn.functional.pad(keep, (0, filled - keep.shape[1]), value=False)
    return keep


@torch.compiler.disable  # reads mask functions' closures and values: eager, one graph break
def _key_map(
    batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor, kv_offset: int,
    mask_function: Callable | None, attention_mask: torch.Tensor | None, sharded: bool,
    **kwargs: Any,
) -> torch.Tensor | None:  # fmt: skip
    """The key map of the module docstring (eager)."""
    documents = _packed_sequences(mask_function, kwargs.get("config"), True)
    # q_offset is a 0-d tensor for static caches
    filled = _filled(int(q_offset), q_length, kv_offset, kv_length)
    device = attention_mask.device if attention_mask is not None else kwargs.get("device", "cpu")
    keep = None if attention_mask is None else _padding(batch_size, filled, attention_mask, device)
    if keep is not None and bool(keep.all()):
        keep = None
    # none: a shard's positions cannot show them (cu_seq_lens_q holds them); one a row
    if sharded or (documents is not None and bool((documents == documents[:, :1]).all())):
        documents = None
    if keep is None and documents is None and filled == kv_length and not kv_offset:
        return None
    if documents is None:  # padding only: the layers need not read it
        return _padding(batch_size, filled, None, device) if keep is None else keep
    ids = (documents + 1).to(device=device, dtype=torch.int32)
    return ids if keep is None else ids * keep


@dataclass(frozen=True)
class Keys:
    """The keys of one batch as the kernels take them: ``length``,
    ``padding`` and ``rows`` (row indices, boundaries) per documents group."""

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
    """The bool key map of a position map (``None``: no key), once per batch."""

    def read() -> torch.Tensor | None:
        filled = int(positions.amax())
        return positions[:, :filled] > 0 if filled else None

    return _masks.get(positions, "filled", read)


def _read(mask: torch.Tensor) -> Keys:
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(
            f"{_NAME} takes a 2-D bool or integer mask "
            f"(batch, keys), nonzero = attend; got a {mask.dtype} mask of shape "
            f"{tuple(mask.shape)}")  # fmt: skip
    batch, length = mask.shape
    ids = mask.to(torch.int64)
    if bool((ids < 0).any()):
        raise ValueError(f"the key map of {_NAME} is >= 0")
    pad = ids == 0
    if bool(pad.any()):
        if bool((ids > 1).any()):
            raise ValueError(f"{_NAME} takes padding or packed documents in one mask, not both")
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
    """The 4-D bool mask sdpa takes for a key map, and ``(batch, q_len)``:
    whether each query reaches a key (else its output must be zeroed)."""
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


def chunk_shifts(pads: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    """transformers' chunks start after a row's ``lp`` left-padded keys
    (``pads`` ``(batch, keys from position 0)``, ``True``: padded): each row's
    positions move on by ``s = -lp mod chunk``, as the kernels' chunks start
    at 0. ``(s per row (int64), the slots the rows need: 0 when none moves)``."""
    lead = pads.cumsum(1) == torch.arange(1, pads.shape[1] + 1, device=pads.device)
    shift = ((-lead.sum(1)) % chunk).to(torch.int64)
    # compiled: as many slots as any row needs (no read)
    return shift, chunk - 1 if torch.compiler.is_compiling() else int(shift.max())


def shift_keys(shift: torch.Tensor, most: int, k: Any, v: Any, padding: Any) -> tuple:
    """Each row's ``(batch, n, ...)`` keys behind its ``shift`` padded slots,
    in ``n + most`` slots (their queries start ``shift`` later): ``(k, v, padding)``."""
    B, n = padding.shape
    at = torch.arange(n, device=k.device)[None] + shift[:, None].to(k.device)
    rows = at[:, :, None, None].expand_as(k)
    k, v = (t.new_zeros(B, n + most, *t.shape[2:]).scatter_(1, rows, t) for t in (k, v))
    return k, v, padding.new_ones(B, n + most).scatter_(1, at, padding)
