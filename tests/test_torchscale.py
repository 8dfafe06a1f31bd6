"""Migrating from torchscale's LongNet: with ``head_offsets="grouped"`` the
forward equals torchscale's DilatedAttention algorithm (docs/design.md §1.5).

torchscale computes each branch separately on a sparsified copy of the
segment (``dense_to_sparse``: heads padded to a multiple of r, rearranged as
``b (l r1) (r2 h) d -> b l h d r1 r2`` and the diagonal r1 == r2 kept, so head
``j`` of the padded heads takes positions ``p`` with ``p mod r == j //
(padded_heads / r)``), runs an ordinary softmax attention per sparse head,
scatters the outputs back (``sparse_to_dense``) and combines the branches with
weights ``softmax_i(lse_i)`` computed under ``no_grad``. The reimplementation
below follows those steps with plain tensor ops (torchscale itself needs
fairscale, timm and apex and is not installed). Lengths are multiples of every
segment and segments multiples of their dilation, so torchscale's zero padding
of the sequence (a quirk we do not reproduce) never occurs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ring_attention as ra
from ring_attention.core.pattern import head_offset


def _dense_to_sparse(x: torch.Tensor, r: int) -> torch.Tensor:
    """``(B', L, H, D) -> (B', L/r, H, D)``, torchscale's head/position pick."""
    B, L, H, D = x.shape
    hp = -(-H // r) * r
    x = F.pad(x, (0, 0, 0, hp - H))
    x = x.view(B, L // r, r, r, hp // r, D)  # b l r1 (r2 h) d
    x = torch.diagonal(x, dim1=2, dim2=3)  # b l h d r  (r1 == r2)
    x = x.permute(0, 1, 4, 2, 3).reshape(B, L // r, hp, D)  # b l (r h) d
    return x[:, :, :H]


def _sparse_to_dense(
    out: torch.Tensor, lse: torch.Tensor, r: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_dense_to_sparse` for outputs (zeros elsewhere) and
    lse (``-inf`` where a head has no row)."""
    B, Lr, H, D = out.shape
    hp = -(-H // r) * r
    per = hp // r
    dense = out.new_zeros(B, Lr * r, H, D)
    dlse = lse.new_full((B, Lr * r, H), float("-inf"))
    for h in range(H):
        off = h // per
        dense[:, off::r, h] = out[:, :, h]
        dlse[:, off::r, h] = lse[:, :, h]
    return dense, dlse


def _attention(q, k, v, causal: bool):
    """Softmax attention per head, ``(B, L, H, D)``; returns out and lse."""
    s = torch.einsum("blhd,bmhd->bhlm", q, k) * q.shape[-1] ** -0.5
    if causal:
        L = q.shape[1]
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, L)
    out = torch.einsum("bhlm,bmhd->blhd", torch.softmax(s, dim=-1), v)
    return out, lse.transpose(1, 2)  # lse as (B, L, H)


def torchscale_forward(q, k, v, segs, dils, causal: bool) -> torch.Tensor:
    B, n, H, D = q.shape
    outs, lses = [], []
    for w, r in zip(segs, dils, strict=True):
        qs, ks, vs = (x.reshape(B * n // w, w, H, D) for x in (q, k, v))  # b (n g) -> (b n) g
        qs, ks, vs = (_dense_to_sparse(x, r) for x in (qs, ks, vs))
        o, lse = _attention(qs, ks, vs, causal)
        o, lse = _sparse_to_dense(o, lse, r)
        outs.append(o.reshape(B, n, H, D))
        lses.append(lse.reshape(B, n, H))
    lse = torch.stack(lses)  # (branches, B, n, H)
    with torch.no_grad():  # torchscale detaches the branch weights
        weights = torch.softmax(lse - lse.amax(0).clamp_min(-1e30), dim=0)
        weights = torch.nan_to_num(weights, nan=0.0)  # a row active in no branch
    return sum(weights[i][..., None] * outs[i] for i in range(len(outs)))


@pytest.mark.parametrize("heads", [4, 6, 8, 12])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("segs,dils", [([16, 32], [2, 4]), ([8, 16, 64], [1, 2, 4]), ([32], [8])])
def test_grouped_offsets_give_torchscales_forward(heads, causal, segs, dils) -> None:
    g = torch.Generator().manual_seed(heads * 7 + len(segs))
    q, k, v = (torch.randn(2, 64, heads, 8, generator=g, dtype=torch.float64) for _ in range(3))
    want = torchscale_forward(q, k, v, segs, dils, causal)
    got = ra.dilated_attention(q, k, v, segs, dils, causal=causal, head_offsets="grouped")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    default = ra.dilated_attention(q, k, v, segs, dils, causal=causal)
    differ = any(head_offset(h, r, heads, "grouped") != h % r for r in dils for h in range(heads))
    if differ:  # the default offsets h mod r are another model
        assert (default - want).abs().max() > 1e-3
    else:
        torch.testing.assert_close(default, want, atol=1e-12, rtol=1e-10)
