"""Attention over a whole stretch of the sequence for a slice of the heads:
what each rank of a Ulysses group computes after the all-to-all
(docs/design.md §2).

Query heads ``[head_start, head_start + H_local)`` of ``heads`` global heads
attend with their GLOBAL indices: dilation offsets (``h mod r`` or
grouped), head groups and the query -> K/V head map
``h // (heads // kv_heads)`` are those of head ``h`` of the whole tensor;
``k``/``v`` hold the K/V heads from ``kv_head(head_start)`` on.

STAND-IN for the kernels' head-range parameter. The operators do not take a
head range yet, so :func:`attend_head_range` rebuilds the computation from
the public single-branch operators, exactly: per branch, the slice's heads
are placed in a padded head tensor at indices whose offset under the
operator's own rule (``index mod r``) is the head's global offset (unused
indices hold zeros and are discarded; K/V are expanded to one head per query
head), the branch runs with ``return_lse=True``, and the branches' parts are
merged by their log-sum-exp (autograd carries the exact gradients of ``out``
and ``lse`` through it). Where the slice's local indices already give the
global offsets, groups and K/V map, the whole pattern runs in one call. When
the kernels take a head range, this function becomes that one call, and
nothing else changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..core.pattern import Pattern
from ..local.functional import attend
from ..local.lse_merge import merge

__all__ = ["attend_head_range", "kv_head_range"]

Tensor = torch.Tensor

#: ``run(q, k, v, pattern) -> (out, lse)``: the whole-stretch attention of
#: ``q`` with ``k``, ``v`` (``k``/``v`` with ``kv_heads`` dividing ``q``'s
#: heads), ``pattern`` applied with local head indices: one process's op, or
#: the ring over the stretches.
Runner = Callable[[Tensor, Tensor, Tensor, Pattern], tuple[Tensor, Tensor]]


def kv_head_range(head_start: int, count: int, heads: int, kv_heads: int) -> tuple[int, int]:
    """``[begin, end)`` of the K/V heads that query heads ``[head_start,
    head_start + count)`` read (empty for no query head)."""
    if count <= 0:
        return (0, 0)
    group = heads // kv_heads
    return head_start // group, (head_start + count - 1) // group + 1


def local_runner(scale: float) -> Runner:
    """The runner of one process: ``functional.attend`` over the stretch."""

    def run(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern) -> tuple[Tensor, Tensor]:
        return attend(q, k, v, pattern, scale=scale, return_lse=True)  # type: ignore[return-value]

    return run


def _fits_as_is(pattern: Pattern, head_start: int, count: int, heads: int, kv_heads: int,
                local_kv: int) -> bool:  # fmt: skip
    """Whether the local indices give every head its global offsets, branches
    and K/V head, so that the pattern runs unchanged on the slice."""
    if local_kv < 1 or count % local_kv or (pattern.head_groups and count < pattern.n_branches):
        return False
    group, local_group = heads // kv_heads, count // local_kv
    kv0 = head_start // group
    for a in range(count):
        h = head_start + a
        if a // local_group != h // group - kv0:
            return False
        for b in range(pattern.n_branches):
            if (h in pattern.applies(b, heads)) != (a in pattern.applies(b, count)):
                return False
            if pattern.offset(h, b, heads) != pattern.offset(a, b, count):
                return False
    return True


def _placement(offsets: list[int], r: int) -> list[int]:
    """Padded indices, one per head, with ``index mod r`` equal to its offset."""
    taken: set[int] = set()
    out = []
    for o in offsets:
        p = o
        while p in taken:
            p += r
        taken.add(p)
        out.append(p)
    return out


def attend_head_range(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: Pattern,
    head_start: int,
    heads: int,
    kv_heads: int,
    run: Runner,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of query heads ``[head_start, head_start + q.shape[2])``
    of ``heads`` (``kv_heads`` K/V heads in all), attending over the stretch
    ``run`` covers.

    Args:
        q: ``(batch, seq, H_local, head_dim)``, ``H_local >= 1``.
        k, v: ``(batch, seq, KV_local, head_dim)``: K/V heads
            :func:`kv_head_range` ``(head_start, H_local, heads, kv_heads)``.
        pattern: the call's pattern (global head indices).
        run: the whole-stretch attention (:data:`Runner`).

    Returns:
        ``out`` of ``q``'s shape and dtype, ``lse`` ``(batch, H_local, seq)``.
    """
    count, local_kv = q.shape[2], k.shape[2]
    if _fits_as_is(pattern, head_start, count, heads, kv_heads, local_kv):
        return run(q, k, v, pattern)
    B, S, _, D = q.shape
    group = heads // kv_heads
    kv0 = head_start // group
    zero_q = q.new_zeros(B, S, 1, D)
    zero_kv = k.new_zeros(B, S, 1, D)
    q_ext, k_ext, v_ext = (torch.cat([t, z], dim=2) for t, z in
                           ((q, zero_q), (k, zero_kv), (v, zero_kv)))  # fmt: skip
    parts = []
    for b, (w, r) in enumerate(pattern.branches):
        applies = set(pattern.applies(b, heads))
        mine = [a for a in range(count) if head_start + a in applies]
        if not mine:
            continue
        slots = _placement([pattern.offset(head_start + a, b, heads) for a in mine], r)
        width = max(slots) + 1
        src_q = torch.full((width,), count, dtype=torch.long)
        src_kv = torch.full((width,), local_kv, dtype=torch.long)
        for a, p in zip(mine, slots, strict=True):
            src_q[p] = a
            src_kv[p] = (head_start + a) // group - kv0
        src_q, src_kv = src_q.to(q.device), src_kv.to(q.device)
        branch = Pattern((w,), (r,), causal=pattern.causal, window=pattern.window).with_documents(
            pattern.documents
        )
        out_b, lse_b = run(
            q_ext.index_select(2, src_q), k_ext.index_select(2, src_kv),
            v_ext.index_select(2, src_kv), branch,
        )  # fmt: skip
        # back to the slice's heads; heads the branch does not apply to reach nothing
        back = torch.full((count,), width, dtype=torch.long)
        back[torch.tensor(mine)] = torch.tensor(slots)
        back = back.to(q.device)
        out_ext = torch.cat([out_b, out_b.new_zeros(B, S, 1, D)], dim=2)
        lse_ext = torch.cat([lse_b, lse_b.new_full((B, 1, S), -math.inf)], dim=1)
        parts.append((out_ext.index_select(2, back), lse_ext.index_select(1, back)))
    if not parts:  # no branch applies to these heads
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = q * 0
        return out, out.new_full((B, count, S), -math.inf, dtype=lse_dtype)
    return merge(parts, q.dtype)
