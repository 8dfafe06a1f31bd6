"""Generation over the sequence-parallel group (docs/transformers.md): each
rank attends its piece of the cached keys, merged by log-sum-exp."""

import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..core.call import prepare
from ..core.dtypes import acc_dtype
from ..core.layout import shard_bounds
from ..local import engine
from ..local.blocks import merge_into
from ..parallel.handshake import GENERATION, exchange_message
from ..parallel.mesh import check_grid, check_ring, resolve_topology
from .masks import chunk_shifts, shift_keys

_NAME = "attn_implementation='ring_dilated'"


def generation_step(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None, kwargs: Mapping[str, Any], sp: Any, pattern_of: Callable[[], Any],
    chunk: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """One generation step over the group: ``query`` ``(B, H, L, D)`` the last ``L`` cached
    positions (``chunk``: a chunked layer's); returns ``(B, L, H, D)``."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    B, L = q.shape[:2]
    size, rank, groups = sp._grid()
    ref, pieces = _pieces.get(id(key), (None, None))
    if ref is None or ref() is not key:  # every rank holds every position: its tensor_split piece
        keys, first, filled, padding = _keys_in_use(attention_mask, B, k.shape[1])
        lo, length = shard_bounds(keys, size)[rank]
        runs = ((first + lo, length),)
        k, v = k[:, lo : lo + length], v[:, lo : lo + length]
    else:  # a ShardedCache: this rank's positions only
        runs, filled = pieces.runs, pieces.filled
        padding = _padding_of(attention_mask, B, filled)
    position = kwargs.get("position_ids")
    ends = (-1, -1)
    if isinstance(position, torch.Tensor) and position.numel():
        ends = (int(position.min()), int(position.max()))
    _agree(sp, [B, L, filled, *ends])
    pattern = pattern_of()
    with torch.no_grad():
        out, lse = _attend_runs(q, k, v, runs, padding, pattern, scaling, filled - L, chunk)
        out, lse = _merge_over(out, lse, groups)  # a rank out of reach adds (0, -inf)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        out, lse = engine.fold_sinks(out, lse, sinks)
    return out.to(q.dtype)


class Pieces(NamedTuple):
    """Where a ``ShardedCache`` layer's keys sit and how many are cached."""

    runs: tuple[tuple[int, int], ...]
    filled: int


_pieces: dict[int, tuple[weakref.ref, Pieces]] = {}


def record_pieces(keys: torch.Tensor, pieces: Pieces) -> None:
    """Remember where the keys a sharded cache layer hands out sit."""
    for dead in [i for i, (ref, _) in _pieces.items() if ref() is None]:
        del _pieces[dead]
    _pieces[id(keys)] = (weakref.ref(keys), pieces)


def _attend_runs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: Any, padding: Any,
    pattern: Any, scaling: float | None, q_start: int, chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out, lse)`` of the queries at ``q_start`` against this rank's keys, run by run (``lse``
    ``-inf`` where nothing is reached); ``chunk``: left-padded rows move on as in one process."""
    B, L, H, D = q.shape
    acc = acc_dtype(q.dtype)
    out = torch.zeros(B, L, H, D, dtype=acc, device=q.device)
    lse = torch.full((B, H, L), float("-inf"), dtype=acc, device=q.device)
    shift, most = torch.zeros(B, dtype=torch.int64), 0
    if chunk is not None and padding is not None:  # padding: every position from 0
        shift, most = chunk_shifts(padding, chunk)
    starts = q_start + shift
    # each row's reach at its own positions (moved back)
    reach = [key_reach(pattern, q_start + s, q_start + s + L - 1) + (s,)
             for s in (set(shift.tolist()) if most else (0,))]  # fmt: skip
    lo, hi = min(a - s for a, _, s in reach), max(b - s for _, b, s in reach)
    offset, call = 0, None
    for start, length in runs:
        offset += length
        if length == 0 or start + length <= lo or start > hi:  # out of reach: no work
            continue
        kr, vr = k[:, offset - length : offset], v[:, offset - length : offset]
        pad = None if padding is None else padding[:, start : start + length].contiguous()
        if most:
            kr, vr, pad = shift_keys(shift, most, kr, vr, pad)
        if call is None:  # checked once; the other runs are the same call at other rows
            call, _ = prepare(q, kr, vr, pattern, scale=scaling, key_padding_mask=pad,
                              k_start=start, q_starts=starts)  # fmt: skip
        else:
            call = call.with_rows(k_start=start, q_starts=starts).with_mask(pad)
        o, s = engine.attend(call, q, kr, vr)
        merge_into(out, lse, o.to(out.dtype), s.to(lse.dtype))
    return out, lse


def key_reach(pattern: Any, q_first: int, q_last: int) -> tuple[int, int]:
    """The first and last key position the queries ``[q_first, q_last]``
    can reach under ``pattern`` (segments, window, causality; dilation aside)."""
    segments = pattern.segment_lengths
    lo = min(q_first // w * w for w in segments)
    hi = max((q_last // w + 1) * w - 1 for w in segments)
    left, right = pattern.window
    if left != -1:
        lo = max(lo, q_first - left)
    if pattern.causal or right != -1:
        hi = min(hi, q_last + (0 if pattern.causal else right))
    return lo, hi


def _padding_of(attention_mask: Any, batch: int, filled: int) -> torch.Tensor | None:
    """A sharded cache's ``(batch, filled)`` padding (``True``: ignore), or ``None``."""
    if attention_mask is None:
        return None
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
            and attention_mask.shape == (batch, filled)):  # fmt: skip
        raise ValueError(
            f"{_NAME}: generation with a ShardedCache takes a 2-D padding mask of the "
            f"{filled} cached positions; got an attention_mask of "
            f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)} "
            f"{tuple(getattr(attention_mask, 'shape', ()))}")  # fmt: skip
    return None if bool(attention_mask.all()) else ~attention_mask


def _keys_in_use(m: Any, batch: int, keys: int) -> tuple[int, int, int, Any]:
    """``(keys in use, position of the first, end of the queries, padding)`` from the layer's
    key map, or a static cache's int64 position map or (no pattern) sdpa's one-row 4-D mask."""
    if isinstance(m, torch.Tensor) and m.shape[-1] == keys:  # a static cache: the kept keys
        if m.dtype == torch.int64 and m.shape == (batch, keys):
            m = m[:, : int(m.amax())] > 0
        elif m.dtype == torch.bool and m.dim() == 4 and m.shape[1:3] == (1, 1):
            m = m[:, 0, 0].expand(batch, keys)  # the query's own slot is the last kept
            m = m[:, : int(m.any(0).nonzero().max()) + 1]
    if m is None:
        return keys, 0, keys, None
    if not (isinstance(m, torch.Tensor) and m.dtype == torch.bool and m.dim() == 2
            and m.shape[0] == batch):  # fmt: skip
        raise ValueError(
            f"{_NAME}: generation over the sequence-parallel group takes a 2-D padding mask "
            "(a dynamic or static cache's; not a 4-D mask of the caller's); got an attention_mask "
            f"of {getattr(m, 'dtype', type(m).__name__)} "
            f"{tuple(getattr(m, 'shape', ()))}")  # fmt: skip
    filled = m.shape[1]  # padded anywhere: a chunked layer moves left-padded rows on (_attend_runs)
    return min(keys, filled), max(filled - keys, 0), filled, None if bool(m.all()) else ~m


def _agree(sp: Any, payload: list[int]) -> None:
    """The control rounds of a generation step: every rank holds the same
    sequence (``payload``), else every rank raises."""
    if not sp.ring_only:  # as the grid's and the ring's calls do first
        check_grid(resolve_topology(**sp.spread()))
    elif sp.size > 1:
        check_ring(sp.group)
    error: ValueError | None = None
    for i, (group, size, order) in enumerate(sp._grid()[2]):
        if size <= 1:
            continue
        call = GENERATION if i == 0 else f"{GENERATION} (ring of the grid)"
        try:
            rows = exchange_message(group, call, None if error else payload, error, order)
            if rows is not None and any(r[: len(payload)] != payload for r in rows):
                every = [tuple(r[: len(payload)]) for r in rows]
                raise ValueError(
                    f"{_NAME}: a sequence-parallel call without documents (cu_seq_lens_q) and "
                    "with use_cache is generation over the group, which passes the same "
                    "sequence on every rank; the ranks hold (batch, queries, keys, first and "
                    f"last position) {every}. For training, build each rank's batch with "
                    "ring_attention.hf.shard_causal_lm_batch")  # fmt: skip
        except ValueError as exc:
            error = error or exc
    if error is not None:
        raise error


def _merge_over(out: torch.Tensor, lse: torch.Tensor, groups: tuple) -> tuple:
    """The ranks' partial ``(out, lse)`` merged by log-sum-exp, on every rank."""
    for group, size, order in groups:
        if size <= 1:
            continue
        outs = [torch.empty_like(out) for _ in range(size)]
        lses = [torch.empty_like(lse) for _ in range(size)]
        dist.all_gather(outs, out.contiguous(), group=group)
        dist.all_gather(lses, lse.contiguous(), group=group)
        if order is not None:
            outs, lses = [outs[g] for g in order], [lses[g] for g in order]
        out, lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
        for o, s in zip(outs, lses, strict=True):
            merge_into(out, lse, o, s)
    return out, lse
