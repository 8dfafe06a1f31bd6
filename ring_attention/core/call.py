"""One checked attention call (:class:`Call`): a public entry checks its arguments once with
:func:`prepare` and passes the call down; head slices and row offsets are copies
(:meth:`Call.with_heads`, :meth:`Call.with_rows`), never checked again."""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .checks import Shape, check_key_padding_mask, check_qkv, check_sinks, resolve_scale
from .pattern import Pattern, as_flag, check_documents_tensor

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class Call:
    """What one attention call attends with, besides ``q``, ``k``, ``v``: the pattern, scale, key
    padding mask, a traced ``cu_seqlens`` (``documents``), its head range (``total_heads`` 0:
    every head), its rows' global positions, ``return_lse`` and sinks."""

    pattern: Pattern
    scale: float
    key_padding_mask: Tensor | None = None
    documents: Tensor | None = None
    head_start: int = 0
    total_heads: int = 0
    total_kv_heads: int = 0
    q_start: int = 0
    k_start: int = 0
    q_starts: Tensor | None = None
    return_lse: bool = False
    sinks: Tensor | None = None

    @property
    def every_head(self) -> bool:
        """The call holds every head."""
        return self.total_heads == 0

    @property
    def one_sequence(self) -> bool:
        """Queries and keys are one sequence from position 0."""
        return self.q_start == 0 and self.k_start == 0 and self.q_starts is None

    def with_heads(self, head_start: int, total_heads: int, total_kv_heads: int) -> "Call":
        """The same call on query heads ``[head_start, ...)`` of ``total_heads``."""
        return dataclasses.replace(
            self, head_start=head_start, total_heads=total_heads, total_kv_heads=total_kv_heads
        )

    def with_rows(
        self, q_start: int = 0, k_start: int = 0, q_starts: Tensor | None = None
    ) -> "Call":
        """The same call on queries at ``q_start`` (or ``q_starts``), keys at ``k_start``."""
        return dataclasses.replace(self, q_start=q_start, k_start=k_start, q_starts=q_starts)

    def with_pattern(self, pattern: Pattern) -> "Call":
        return dataclasses.replace(self, pattern=pattern)

    def with_mask(self, key_padding_mask: Tensor | None) -> "Call":
        return dataclasses.replace(self, key_padding_mask=key_padding_mask)


def prepare(
    q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, *, scale: float | None = None,
    key_padding_mask: Tensor | None = None, cu_seqlens: Tensor | Sequence[int] | None = None,
    return_lse: bool = False, q_start: int = 0, k_start: int = 0, q_starts: Tensor | None = None,
    head_range: tuple[int, int, int] | None = None, sinks: Tensor | None = None,
) -> tuple[Call, Shape]:  # fmt: skip
    """Check one call's arguments (docs/design.md §6) into a :class:`Call` and the checked
    :class:`Shape`; ``ValueError`` naming the argument."""
    one_sequence = q_start == 0 and k_start == 0 and q_starts is None
    if q_starts is not None:
        q_start = 0
    shape = check_qkv(q, k, v, same_length=one_sequence, head_range=head_range)
    documents = None  # a traced cu_seqlens tensor, passed to the operator as it is
    if isinstance(cu_seqlens, torch.Tensor) and torch.compiler.is_compiling():
        check_documents_tensor(cu_seqlens)
        pattern, documents = pattern.with_documents(None), cu_seqlens.to(q.device)
    elif cu_seqlens is not None:
        pattern = pattern.with_documents(cu_seqlens)
    pattern.check_heads(shape.heads if head_range is None else head_range[1])
    last = q_start if q_starts is None or not q_starts.numel() else int(q_starts.max())
    end = max(last + shape.seq_q, k_start + shape.seq_k)
    if documents is None and one_sequence:
        pattern.check_length(end)
    elif documents is None and pattern.documents is not None and pattern.documents[-1] < end:
        raise ValueError(
            f"cu_seqlens must end at or after the last position {end}, got "
            f"cu_seqlens[-1] = {pattern.documents[-1]}"
        )
    check_key_padding_mask(key_padding_mask, shape.batch, shape.seq_k, q.device)
    check_sinks(sinks, shape.heads, q.device)
    return Call(pattern, resolve_scale(scale, shape.head_dim), key_padding_mask, documents,
                *(head_range or (0, 0, 0)), q_start, k_start, q_starts,
                as_flag(return_lse, "return_lse"), sinks), shape  # fmt: skip
