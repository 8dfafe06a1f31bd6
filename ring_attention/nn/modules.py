"""``nn.Module`` front ends: :class:`DilatedAttention` (one process) and
:class:`RingDilatedAttention` (sharded), each holding a checked ``Pattern``."""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..core.checks import resolve_scale
from ..core.layout import check_layout
from ..core.pattern import Pattern
from ..local.functional import attend
from ..parallel.ring import sharded_ring
from ..parallel.ring_spec import given_pattern
from ..parallel.ulysses import sharded_attention


class _PatternModule(nn.Module):
    """Holds the pattern and the score scale of an attention module."""

    def __init__(
        self, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
        causal: bool = False, scale: float | None = None, head_groups: bool = False,
        head_offsets: str = "modulo", *, window: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.pattern = Pattern(
            segment_lengths, dilation_rates, causal=causal, head_groups=head_groups,
            head_offsets=head_offsets, window=window)  # fmt: skip
        self.scale = None if scale is None else resolve_scale(scale, 1)

    segment_lengths = property(lambda self: self.pattern.segment_lengths)
    dilation_rates = property(lambda self: self.pattern.dilation_rates)
    causal = property(lambda self: self.pattern.causal)
    head_groups = property(lambda self: self.pattern.head_groups)

    def extra_repr(self) -> str:
        p = self.pattern
        s = (
            f"segment_lengths={list(p.segment_lengths)}, dilation_rates={list(p.dilation_rates)}, "
            f"causal={p.causal}, scale={self.scale}, head_groups={p.head_groups}"
        )
        if p.head_offsets != "modulo":
            s += f", head_offsets={p.head_offsets!r}"
        return s + (f", window={p.window}" if p.windowed else "")


class DilatedAttention(_PatternModule):
    """:func:`ring_attention.dilated_attention` as an ``nn.Module`` over
    ``(batch, seq, heads, head_dim)`` tensors (docs/modules.md)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``out`` of ``q``'s shape and dtype (``k``, ``v`` may have fewer heads)."""
        return attend(
            q, k, v, self.pattern, scale=self.scale, key_padding_mask=key_padding_mask,
            cu_seqlens=cu_seqlens, sinks=sinks)  # fmt: skip


class RingDilatedAttention(_PatternModule):
    """:func:`ring_attention.ring_dilated_attention` as an ``nn.Module``: ``forward`` takes and
    returns this rank's ``(batch, seq_local, heads, head_dim)`` shards (docs/modules.md)."""

    def __init__(
        self, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
        causal: bool = False, scale: float | None = None, head_groups: bool = False,
        group: dist.ProcessGroup | None = None, layout: str = "contiguous",
        head_offsets: str = "modulo", *, ulysses_group: dist.ProcessGroup | None = None,
        mesh=None, window: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(
            segment_lengths, dilation_rates, causal, scale, head_groups, head_offsets, window=window
        )
        self.group, self.ulysses_group, self.mesh = group, ulysses_group, mesh
        self.layout = check_layout(layout)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """This rank's query shard against the whole sequence (``cu_seqlens``
        GLOBAL, the same on every rank)."""
        return sharded_attention(
            q, k, v, given_pattern, (self.pattern,), cu_seqlens=cu_seqlens, scale=self.scale,
            group=self.group, ulysses_group=self.ulysses_group, mesh=self.mesh,
            layout=self.layout, return_lse=False, sinks=sinks, ring=sharded_ring)  # fmt: skip

    def extra_repr(self) -> str:
        return super().extra_repr() + f", layout={self.layout!r}"
