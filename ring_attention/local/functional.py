"""Single-process dilated attention: the public function (checked once into a
:class:`~ring_attention.core.call.Call`, then the one engine,
:func:`ring_attention.local.engine.attend`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.call import prepare
from ..core.pattern import Pattern
from . import engine

__all__ = ["attend", "dilated_attention"]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern, *,
    scale: float | None = None, key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None, return_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`dilated_attention` with an already-built :class:`Pattern`
    (the modules hold one); ``cu_seqlens``, when given, replaces its documents."""
    call, _ = prepare(q, k, v, pattern, scale=scale, key_padding_mask=key_padding_mask,
                      cu_seqlens=cu_seqlens, return_lse=return_lse, sinks=sinks)  # fmt: skip
    out, lse = engine.attend(call, q, k, v)
    return (out, lse) if call.return_lse else out


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int] | int,
    dilation_rates: Sequence[int] | int,
    *,
    causal: bool = False,
    scale: float | None = None,
    head_groups: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    head_offsets: str = "modulo",
    window: tuple[int, int] | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact LongNet-style dilated attention (docs/design.md §1) on one process.

    Args:
        q: ``(batch, seq, heads, head_dim)``, float32, float64, float16 or
            bfloat16.
        k, v: ``(batch, seq, kv_heads, head_dim)``, q's dtype and device;
            ``kv_heads`` divides ``heads`` (grouped K/V heads, GQA/MQA: query
            head ``h`` reads K/V head ``h // (heads // kv_heads)``; K/V are
            never repeated in memory).
        segment_lengths, dilation_rates: the pattern, one ``(w, r)`` per branch
            with ``1 <= r <= w``. Any sequence length works: the last segment
            of a branch may be short.
        causal: keys only at or before the query.
        scale: score scale, default ``head_dim ** -0.5``.
        head_groups: split heads into ``len(pattern)`` contiguous groups, branch
            ``i`` applying only to group ``i``.
        key_padding_mask: bool ``(batch, seq)``, ``True`` = ignore that key.
        cu_seqlens: document boundaries of a packed sequence, a 1-D integer
            tensor ``[0, e_1, ..., seq]`` (non-decreasing, the same for every
            batch row): every document starts its own segments and offsets, no
            query reaches another document.
        head_offsets: ``"modulo"`` (head ``h`` starts at ``h mod r``, default)
            or ``"grouped"`` (``h // ceil(heads / r)``, torchscale's LongNet).
        window: ``(left, right)``, a sliding window on top of the pattern:
            query ``t`` reaches key ``u`` only if also ``t - left <= u <= t +
            right`` (positions in the document; ``-1``: unbounded on that
            side; ``None``: no window). Dense attention with a window is
            sliding-window attention; a transformers layer with
            ``sliding_window = W`` is ``(W - 1, 0)``. Its cost is O(n * W).
        return_lse: also return the log-sum-exp ``(batch, heads, seq)``
            (float32; float64 for float64 inputs). It is differentiable.
        sinks: attention sinks, a floating tensor ``(heads,)`` on q's device
            (gpt-oss's ``sinks``): one virtual key of value 0 and score
            ``sinks[h]`` in every query's softmax, once; ``lse`` includes
            it and gradients reach ``sinks``.

    Returns:
        ``out`` of q's shape and dtype, or ``(out, lse)``. A query that reaches
        no key gets ``out = 0`` and ``lse = -inf`` (``sinks[h]`` with sinks).

    Raises:
        ValueError: naming the argument, for bad shapes, dtypes, devices,
            patterns, masks, ``cu_seqlens`` or flags (docs/design.md §6).
    """
    pattern = Pattern(segment_lengths, dilation_rates, causal=causal, head_groups=head_groups,
                      head_offsets=head_offsets, window=window)  # fmt: skip
    return attend(q, k, v, pattern, scale=scale, key_padding_mask=key_padding_mask,
                  cu_seqlens=cu_seqlens, return_lse=return_lse, sinks=sinks)  # fmt: skip
