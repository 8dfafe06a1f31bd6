"""Float64 reference ("oracle") of dilated attention, DESIGN.md section 1.

This module is the executable definition of the semantics and is deliberately
independent of the kernels: it builds an explicit multiplicity matrix
``M[h, t, u]`` = number of branches in which query ``t`` reaches key ``u`` for
head ``h``, and then computes one softmax weighted by ``M``::

    out_t = sum_u M[h, t, u] exp(s_tu) v_u / sum_u M[h, t, u] exp(s_tu)
    lse_t = log sum_u M[h, t, u] exp(s_tu)

with ``s_tu = scale * <q_t, k_u>``. Everything is O(n^2) and meant for small
test shapes only. The functions are differentiable with autograd, so
``reference_attention`` also gives the reference gradients.

Note: because the oracle multiplies with dense matrices, a NaN anywhere in
``k`` or ``v`` reaches every output row of that batch/head (``0 * nan``).
Tests that put NaN or garbage into rows that must not be read compare the
kernels against themselves on clean inputs instead.
"""

from __future__ import annotations

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


def active(n: int, w: int, r: int, h: int) -> torch.Tensor:
    """Bool ``(n,)``: position ``t`` is active for head ``h`` in branch ``(w, r)``."""
    t = torch.arange(n)
    return (t % w) % r == h % r


def multiplicity(
    n: int,
    heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    causal: bool = False,
    head_groups: bool = False,
) -> torch.Tensor:
    """Float64 ``(heads, n, n)``: ``M[h, t, u]`` = branches in which ``t`` reaches ``u``."""
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
        same_segment = (t // w) == (u // w)
        for h in range(heads):
            if head_groups and not (groups[i][0] <= h < groups[i][1]):
                continue
            act = active(n, w, r, h)
            reach = act[:, None] & act[None, :] & same_segment
            if causal:
                reach = reach & (u <= t)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention in float64. Returns ``(out (B,N,H,D), lse (B,H,N))``.

    ``key_padding_mask`` is bool ``(B, N)``, ``True`` = ignore that key.
    Rows that reach no key get ``out = 0``, ``lse = -inf`` and zero gradients.
    """
    batch, n, heads, head_dim = q.shape
    assert k.shape == q.shape and v.shape == q.shape
    if scale is None:
        scale = head_dim**-0.5

    q64 = q.to(torch.float64)
    k64 = k.to(torch.float64)
    v64 = v.to(torch.float64)

    # (B, H, N, N) multiplicities, padded keys removed from every branch.
    mult = multiplicity(n, heads, segment_lengths, dilation_rates, causal, head_groups)
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
    shifted = torch.where(reached, s - rowmax, torch.zeros_like(s))
    weights = torch.where(reached, mult * torch.exp(shifted), torch.zeros_like(s))

    denom = weights.sum(dim=-1)  # (B, H, N); >= 1 on non-empty rows
    safe_denom = torch.where(nonempty, denom, torch.ones_like(denom))
    numer = torch.einsum("bhtu,buhd->bhtd", weights, v64)

    out = torch.where(nonempty[..., None], numer / safe_denom[..., None], torch.zeros_like(numer))
    lse = torch.where(
        nonempty,
        torch.log(safe_denom) + rowmax.squeeze(-1),
        torch.full_like(denom, float("-inf")),
    )
    return out.permute(0, 2, 1, 3), lse
