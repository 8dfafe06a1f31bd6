"""The sharded attention's public entries: the ring, Ulysses and their hybrid, composed
in one place (:func:`~ring_attention.parallel.ulysses.sharded_attention`, docs/design.md §2);
the operators and rounds check calls."""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..core.pattern import Pattern
from .ring import sharded_ring
from .ring_spec import given_pattern
from .ulysses import sharded_attention

__all__ = ["ring_attention", "ring_dilated_attention"]

Tensor = torch.Tensor


def ring_attention(q_local: Tensor, k_local: Tensor, v_local: Tensor,
                   pattern: Pattern | Callable[[], Pattern], *, scale: float | None = None,
                   group: dist.ProcessGroup | None = None,
                   ulysses_group: dist.ProcessGroup | None = None, mesh=None,
                   layout: str = "contiguous", return_lse: bool = False,
                   sinks: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`ring_dilated_attention` with a :class:`Pattern` (or a module-level
    function building one, whose errors every rank hears of)."""
    built = isinstance(pattern, Pattern) or not callable(pattern)
    build, args = (given_pattern, (pattern,)) if built else (pattern, ())
    return sharded_attention(q_local, k_local, v_local, build, args, cu_seqlens=None, scale=scale,
                             group=group, ulysses_group=ulysses_group, mesh=mesh, layout=layout,
                             return_lse=return_lse, sinks=sinks, ring=sharded_ring)  # fmt: skip


def ring_dilated_attention(q_local: Tensor, k_local: Tensor, v_local: Tensor,
                           segment_lengths: Sequence[int], dilation_rates: Sequence[int], *,
                           causal: bool = False, scale: float | None = None,
                           head_groups: bool = False,
                           cu_seqlens: Sequence[int] | Tensor | None = None,
                           head_offsets: str = "modulo", window: tuple[int, int] | None = None,
                           group: dist.ProcessGroup | None = None,
                           ulysses_group: dist.ProcessGroup | None = None, mesh=None,
                           layout: str = "contiguous", return_lse: bool = False,
                           sinks: Tensor | None = None,
                           ) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """Dilated attention over a sequence sharded across the ranks of ``group``
    (or ``ulysses_group``, ``mesh``): this rank's output shard (docs/parallel.md)."""
    return sharded_attention(q_local, k_local, v_local, Pattern,
                             (segment_lengths, dilation_rates, causal, head_groups, head_offsets,
                              None, window),
                             cu_seqlens=cu_seqlens, scale=scale, group=group,
                             ulysses_group=ulysses_group, mesh=mesh, layout=layout,
                             return_lse=return_lse, sinks=sinks, ring=sharded_ring)  # fmt: skip
