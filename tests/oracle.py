"""Float64 reference ("oracle") of dilated attention, docs/design.md section 1.

This module is the executable definition of the semantics and is deliberately
independent of the kernels: it builds an explicit multiplicity matrix
``M[h, t, u]`` = number of branches in which query ``t`` reaches key ``u`` for
head ``h``, and then computes one softmax weighted by ``M``::

    out_t = sum_u M[h, t, u] exp(s_tu) v_u / sum_u M[h, t, u] exp(s_tu)
    lse_t = log sum_u M[h, t, u] exp(s_tu)

with ``s_tu = scale * <q_t, k_u>``. Positions are active per segment, and
segments restart at every document start (``cu_seqlens``), so nothing
crosses a document. Everything is O(n^2) and meant for small
test shapes only. The functions are differentiable with autograd, so
``reference_attention`` also gives the reference gradients.

Note: because the oracle multiplies with dense matrices, a NaN anywhere in
``k`` or ``v`` reaches every output row of that batch/head (``0 * nan``).
Tests that put NaN or garbage into rows that must not be read compare the
kernels against themselves on clean inputs instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def head_group_bounds(heads: int, n_branches: int) -> list[tuple[int, int]]:
    """Contiguous head ranges ``[begin, end)`` of the ``n_branches`` groups.

    Sizes differ by at most one; the first groups take the extra heads.
    """
    base, extra = divmod(heads, n_branches)
    bounds = []
    begin = 0
    for i in range(n_branches):
        size = base + (1 if i < extra else 0)
        bounds.append((begin, begin + size))
        begin += size
    return bounds


def head_offset(h: int, r: int, heads: int, grouped_offsets: bool = False) -> int:
    """Offset of query head ``h`` in a branch of dilation ``r``: ``h mod r``, or
    ``h // ceil(heads / r)`` with grouped offsets (torchscale's LongNet)."""
    return h // -(-heads // r) if grouped_offsets else h % r


def document_starts(n: int, cu_seqlens: Sequence[int] | torch.Tensor | None) -> torch.Tensor:
    """Long ``(n,)``: start of the document holding each position (0 without documents)."""
    if cu_seqlens is None:
        return torch.zeros(n, dtype=torch.long)
    bounds = [int(b) for b in cu_seqlens]
    assert bounds[0] == 0 and bounds[-1] == n, bounds
    assert all(a <= b for a, b in itertools.pairwise(bounds)), bounds
    starts = torch.empty(n, dtype=torch.long)
    for a, b in itertools.pairwise(bounds):
        starts[a:b] = a
    return starts


def segment_starts(
    n: int, w: int, cu_seqlens: Sequence[int] | torch.Tensor | None = None
) -> torch.Tensor:
    """Long ``(n,)``: start of the segment of branch length ``w`` holding each
    position. Every document starts its own segments."""
    doc = document_starts(n, cu_seqlens)
    t = torch.arange(n)
    return doc + (t - doc) // w * w


def active(
    n: int,
    w: int,
    r: int,
    h: int,
    heads: int | None = None,
    grouped_offsets: bool = False,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``(n,)``: position ``t`` is active for query head ``h`` in branch ``(w, r)``
    (``heads``, the number of query heads, is needed for grouped offsets only)."""
    assert heads is not None or not grouped_offsets
    offset = head_offset(h, r, heads or 1, grouped_offsets)
    t = torch.arange(n)
    return (t - segment_starts(n, w, cu_seqlens)) % r == offset


def multiplicity(
    n: int,
    heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    causal: bool = False,
    head_groups: bool = False,
    grouped_offsets: bool = False,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Float64 ``(heads, n, n)``: ``M[h, t, u]`` = branches in which ``t`` reaches ``u``.

    ``window = (left, right)`` (``-1``: unbounded on that side) keeps only
    ``t - left <= u <= t + right``."""
    segment_lengths = list(segment_lengths)
    dilation_rates = list(dilation_rates)
    assert len(segment_lengths) == len(dilation_rates) >= 1
    n_branches = len(segment_lengths)
    groups = head_group_bounds(heads, n_branches)

    pos = torch.arange(n)
    t = pos[:, None]  # query positions, rows
    u = pos[None, :]  # key positions, columns

    m = torch.zeros(heads, n, n, dtype=torch.float64)
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates, strict=True)):
        assert 1 <= r <= w
        seg = segment_starts(n, w, cu_seqlens)
        same_segment = seg[:, None] == seg[None, :]  # implies the same document
        for h in range(heads):
            if head_groups and not (groups[i][0] <= h < groups[i][1]):
                continue
            act = active(n, w, r, h, heads, grouped_offsets, cu_seqlens)
            reach = act[:, None] & act[None, :] & same_segment
            if causal:
                reach = reach & (u <= t)
            if window is not None:
                left, right = window
                if left >= 0:
                    reach = reach & (u >= t - left)
                if right >= 0:
                    reach = reach & (u <= t + right)
            m[h] += reach.to(torch.float64)
    return m


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    causal: bool = False,
    scale: float | None = None,
    head_groups: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    grouped_offsets: bool = False,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention in float64. Returns ``(out (B,N,H,D), lse (B,H,N))``.

    ``k`` and ``v`` may have ``kv_heads`` heads (a divisor of ``heads``): query
    head ``h`` reads K/V head ``h // (heads // kv_heads)``. ``key_padding_mask``
    is bool ``(B, N)``, ``True`` = ignore that key. ``cu_seqlens`` holds the
    document boundaries ``[0, ..., N]``; ``window = (left, right)`` the
    sliding window (``-1``: unbounded). ``sinks`` ``(H,)``: one virtual key
    of value 0 and score ``sinks[h]`` in every row's softmax, once. Rows that
    reach no key get ``out = 0`` and ``lse = -inf`` (``sinks[h]`` with
    sinks) and zero gradients. Both outputs are differentiable (``sinks``
    too).
    """
    batch, n, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    assert k.shape == (batch, n, kv_heads, head_dim) and v.shape == k.shape
    assert heads % kv_heads == 0
    if scale is None:
        scale = head_dim**-0.5

    q64 = q.to(torch.float64)
    # Every query head gets its K/V head's rows (the gradient sums over them).
    k64 = k.to(torch.float64).repeat_interleave(heads // kv_heads, dim=2)
    v64 = v.to(torch.float64).repeat_interleave(heads // kv_heads, dim=2)

    # (B, H, N, N) multiplicities, padded keys removed from every branch.
    mult = multiplicity(
        n,
        heads,
        segment_lengths,
        dilation_rates,
        causal,
        head_groups,
        grouped_offsets,
        cu_seqlens,
        window,
    )
    mult = mult.to(q.device).expand(batch, heads, n, n)
    if key_padding_mask is not None:
        assert key_padding_mask.shape == (batch, n)
        keep = (~key_padding_mask.to(q.device)).to(torch.float64)
        mult = mult * keep[:, None, None, :]
    reached = mult > 0
    nonempty = reached.any(dim=-1)  # (B, H, N)

    s = scale * torch.einsum("bthd,buhd->bhtu", q64, k64)

    # Numerically stable weights M * exp(s - rowmax), rowmax over reached keys
    # only. The max only shifts the exponent (the result does not depend on
    # it), so it is detached. Inner where: no exp overflow (and so no inf*0 =
    # nan in the backward) for keys that are not reached.
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=q.device)
    rowmax = torch.where(reached, s, neg_inf).amax(dim=-1, keepdim=True)
    rowmax = torch.where(nonempty[..., None], rowmax, torch.zeros_like(rowmax)).detach()
    if sinks is not None:  # the virtual key's score takes part in the max
        z = sinks.to(device=q.device, dtype=torch.float64).view(1, heads, 1, 1)
        z = z.expand(batch, heads, n, 1)
        rowmax = torch.where(nonempty[..., None], torch.maximum(rowmax, z), z).detach()
    shifted = torch.where(reached, s - rowmax, torch.zeros_like(s))
    weights = torch.where(reached, mult * torch.exp(shifted), torch.zeros_like(s))

    denom = weights.sum(dim=-1)  # (B, H, N); >= 1 on non-empty rows
    numer = torch.einsum("bhtu,buhd->bhtd", weights, v64)
    if sinks is not None:  # value 0: the denominator only
        denom = denom + torch.exp(z - rowmax).squeeze(-1)
        return (numer / denom[..., None]).permute(0, 2, 1, 3), torch.log(denom) + rowmax.squeeze(-1)
    safe_denom = torch.where(nonempty, denom, torch.ones_like(denom))

    out = torch.where(nonempty[..., None], numer / safe_denom[..., None], torch.zeros_like(numer))
    lse = torch.where(
        nonempty,
        torch.log(safe_denom) + rowmax.squeeze(-1),
        torch.full_like(denom, float("-inf")),
    )
    return out.permute(0, 2, 1, 3), lse
