"""Single-process dilated attention: the public function (checked once into a
:class:`~ring_attention.core.call.Call`, then the one engine,
:func:`ring_attention.local.engine.attend`)."""

from collections.abc import Sequence

import torch

from ..core.call import prepare
from ..core.pattern import Pattern
from . import engine


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

    ``q`` is ``(batch, seq, heads, head_dim)``, ``k``/``v`` ``(batch, seq, kv_heads, head_dim)``;
    returns ``out`` of q's shape and dtype, or ``(out, lse)`` with ``return_lse`` (arguments:
    docs/design.md §1-2.1; errors: ``ValueError`` naming the argument, §6). ``sinks`` (``(heads,)``,
    gpt-oss) adds one virtual key of value 0 and score ``sinks[h]`` to every softmax; ``lse``
    includes it and gradients reach it. A query reaching no key gets ``out = 0``, ``lse = -inf``.
    """
    pattern = Pattern(segment_lengths, dilation_rates, causal=causal, head_groups=head_groups,
                      head_offsets=head_offsets, window=window)  # fmt: skip
    return attend(q, k, v, pattern, scale=scale, key_padding_mask=key_padding_mask,
                  cu_seqlens=cu_seqlens, return_lse=return_lse, sinks=sinks)  # fmt: skip
