"""Sanity tests of the float64 oracle (tests/oracle.py) against hand-built cases.

These need only torch: they check that the oracle really is DESIGN.md section 1
(dense pattern = softmax attention, local pattern = block-diagonal attention,
multiset branches, per-head offsets ``h mod r``, head groups, masks, empty rows).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from oracle import active, head_group_bounds, multiplicity, reference_attention

F64 = torch.float64


def _qkv(b: int, n: int, h: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, h, d, dtype=F64, generator=g) for _ in range(3))


def _sdpa(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """torch SDPA in the (B, N, H, D) layout."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("w_factor", [1, 3])
def test_dense_pattern_equals_sdpa(causal: bool, w_factor: int) -> None:
    b, n, h, d = 2, 13, 3, 8
    q, k, v = _qkv(b, n, h, d)
    out, lse = reference_attention(q, k, v, [n * w_factor], [1], causal=causal)
    ref = _sdpa(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)

    s = torch.einsum("bthd,buhd->bhtu", q, k) * d**-0.5
    if causal:
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), rtol=1e-12, atol=1e-12)


def test_dense_pattern_gradients_equal_sdpa() -> None:
    b, n, h, d = 1, 9, 2, 4
    q, k, v = (x.requires_grad_() for x in _qkv(b, n, h, d, seed=1))
    go = torch.randn(b, n, h, d, dtype=F64)
    out, _ = reference_attention(q, k, v, [n], [1], causal=True, scale=0.3)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref = _sdpa(q, k, v, is_causal=True, scale=0.3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [12, 14])  # 14: ragged last segment
def test_local_pattern_equals_block_diagonal(n: int) -> None:
    w = 4
    q, k, v = _qkv(1, n, 2, 8, seed=2)
    out, _ = reference_attention(q, k, v, [w], [1])
    seg = torch.arange(n) // w
    mask = seg[:, None] == seg[None, :]
    torch.testing.assert_close(out, _sdpa(q, k, v, attn_mask=mask), rtol=1e-12, atol=1e-12)
    # and block by block
    for s in range(0, n, w):
        blk = slice(s, s + w)
        ref = _sdpa(q[:, blk], k[:, blk], v[:, blk])
        torch.testing.assert_close(out[:, blk], ref, rtol=1e-12, atol=1e-12)


def test_multiplicity_two_branches_key_counts_twice() -> None:
    # Branches (4, 1) and (2, 1) on n = 4: keys in the same 2-block are reached
    # by both branches (count 2), the others by the dense branch only.
    m = multiplicity(4, 1, [4, 2], [1, 1])
    expected = torch.tensor(
        [
            [2, 2, 1, 1],
            [2, 2, 1, 1],
            [1, 1, 2, 2],
            [1, 1, 2, 2],
        ],
        dtype=F64,
    )
    torch.testing.assert_close(m[0], expected, rtol=0, atol=0)
    assert m.dtype == F64 and m.shape == (1, 4, 4)

    mc = multiplicity(4, 1, [4, 2], [1, 1], causal=True)
    torch.testing.assert_close(mc[0], expected.tril(), rtol=0, atol=0)


def test_two_branch_output_by_hand() -> None:
    # n = 2, one head, D = 1, pattern [(2, 1), (1, 1)]: M = [[2, 1], [1, 2]].
    q = torch.tensor([0.5, -1.0], dtype=F64).view(1, 2, 1, 1)
    k = torch.tensor([2.0, 0.25], dtype=F64).view(1, 2, 1, 1)
    v = torch.tensor([3.0, -7.0], dtype=F64).view(1, 2, 1, 1)
    out, lse = reference_attention(q, k, v, [2, 1], [1, 1], scale=1.0)
    for t in range(2):
        s = [q.flatten()[t] * k.flatten()[u] for u in range(2)]
        mult = [2.0 if u == t else 1.0 for u in range(2)]
        den = sum(m_ * math.exp(s_) for m_, s_ in zip(mult, s, strict=True))
        num = sum(
            m_ * math.exp(s_) * v.flatten()[u]
            for u, (m_, s_) in enumerate(zip(mult, s, strict=True))
        )
        assert out[0, t, 0, 0].item() == pytest.approx(float(num / den), rel=1e-13)
        assert lse[0, 0, t].item() == pytest.approx(math.log(den), rel=1e-13)


def test_dilated_multiplicity_by_hand() -> None:
    # One branch (4, 2), n = 6, 2 heads. Segments [0..3], [4, 5].
    # head 0 active at (t mod 4) mod 2 == 0: 0, 2, 4; head 1: 1, 3, 5.
    m = multiplicity(6, 2, [4], [2])
    e0 = torch.zeros(6, 6, dtype=F64)
    for t, u in [(0, 0), (0, 2), (2, 0), (2, 2), (4, 4)]:
        e0[t, u] = 1
    e1 = torch.zeros(6, 6, dtype=F64)
    for t, u in [(1, 1), (1, 3), (3, 1), (3, 3), (5, 5)]:
        e1[t, u] = 1
    torch.testing.assert_close(m[0], e0, rtol=0, atol=0)
    torch.testing.assert_close(m[1], e1, rtol=0, atol=0)


def test_head_offset_is_h_mod_r() -> None:
    n, w, r, heads = 11, 6, 3, 7
    m = multiplicity(n, heads, [w], [r])
    for h in range(heads):
        # heads h and h mod r see exactly the same pattern
        torch.testing.assert_close(m[h], m[h % r], rtol=0, atol=0)
        act = torch.tensor([(t % w) % r == h % r for t in range(n)])
        assert torch.equal(act, active(n, w, r, h))
        # diagonal = active positions; inactive rows and columns are empty
        assert torch.equal(m[h].diagonal() > 0, act)
        assert not m[h][~act].any() and not m[h][:, ~act].any()
    # the heads 0..r-1 together cover every position
    cover = torch.stack([m[h].diagonal() > 0 for h in range(r)]).sum(0)
    assert torch.equal(cover, torch.ones(n, dtype=cover.dtype))


def test_head_group_bounds() -> None:
    assert head_group_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert head_group_bounds(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert head_group_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert head_group_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert head_group_bounds(8, 1) == [(0, 8)]


def test_head_groups_apply_one_branch_per_group() -> None:
    n, heads = 10, 5
    ws, rs = [2, 4, 8], [1, 2, 4]
    m = multiplicity(n, heads, ws, rs, causal=True, head_groups=True)
    groups = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}  # 5 heads / 3 branches -> 2, 2, 1
    for h, i in groups.items():
        single = multiplicity(n, heads, [ws[i]], [rs[i]], causal=True)
        torch.testing.assert_close(m[h], single[h], rtol=0, atol=0)
    assert m.max() == 1  # one branch per head: no key counted twice


def test_duplicated_branch_is_a_multiset() -> None:
    q, k, v = _qkv(1, 9, 3, 4, seed=3)
    out1, lse1 = reference_attention(q, k, v, [4], [2])
    out2, lse2 = reference_attention(q, k, v, [4, 4], [2, 2])
    torch.testing.assert_close(out2, out1, rtol=1e-12, atol=1e-12)
    fin = torch.isfinite(lse1)
    torch.testing.assert_close(lse2[fin], lse1[fin] + math.log(2), rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isinf(lse1), torch.isinf(lse2))


def test_key_padding_mask_matches_sdpa_mask() -> None:
    b, n, h, d = 2, 8, 2, 4
    q, k, v = _qkv(b, n, h, d, seed=4)
    kpm = torch.zeros(b, n, dtype=torch.bool)
    kpm[0, [1, 5]] = True
    kpm[1, 0] = True
    out, _ = reference_attention(q, k, v, [n], [1], key_padding_mask=kpm)
    ref = _sdpa(q, k, v, attn_mask=~kpm[:, None, None, :])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_empty_rows_are_zero_with_zero_gradients() -> None:
    # Pattern (8, 2) with one head: odd positions are never active. Also mask
    # every key of the second segment of batch 1, and some query rows of it.
    b, n, h, d = 2, 12, 1, 4
    q, k, v = (x.requires_grad_() for x in _qkv(b, n, h, d, seed=5))
    kpm = torch.zeros(b, n, dtype=torch.bool)
    kpm[1, 8:] = True
    out, lse = reference_attention(q, k, v, [8], [2], causal=True, key_padding_mask=kpm)
    empty = torch.zeros(b, n, dtype=torch.bool)
    empty[:, 1::2] = True
    empty[1, 8:] = True
    assert torch.isfinite(out).all()
    assert (out[empty] == 0).all()
    assert torch.isneginf(lse[:, 0][empty]).all()
    assert torch.isfinite(lse[:, 0][~empty]).all()

    (out * torch.randn_like(out)).sum().backward()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()
    assert (q.grad[empty] == 0).all()
    # keys nobody reaches (odd positions, and masked keys) get zero gradient
    assert (k.grad[empty] == 0).all() and (v.grad[empty] == 0).all()
    assert (k.grad[~empty] != 0).any()


def test_large_logits_are_finite() -> None:
    b, n, h, d = 1, 16, 2, 16
    q, k, v = _qkv(b, n, h, d, seed=6)
    q, k = q * 100, k * 100  # |s| ~ 1e4
    out, lse = reference_attention(q, k, v, [8, 16], [2, 4], causal=True)
    assert torch.isfinite(out).all()
    assert lse.abs().max() > 1e3
    # softmax degenerates to a (multiplicity weighted) argmax
    out_half, _ = reference_attention(q, k, v, [8, 16], [2, 4], causal=True, scale=0.5 * d**-0.5)
    assert torch.isfinite(out_half).all()


def test_nan_propagates() -> None:
    q, k, v = _qkv(1, 6, 1, 4, seed=7)
    q[0, 2, 0, 0] = float("nan")
    out, lse = reference_attention(q, k, v, [3], [1])
    assert torch.isnan(out[0, 2]).all() and torch.isnan(lse[0, 0, 2])
    assert torch.isfinite(out[0, 3:]).all()


def test_lower_precision_inputs_are_upcast() -> None:
    q, k, v = _qkv(1, 8, 2, 8, seed=8)
    out16, lse16 = reference_attention(q.half(), k.half(), v.half(), [4], [2])
    out64, _ = reference_attention(
        q.half().double(), k.half().double(), v.half().double(), [4], [2]
    )
    assert out16.dtype == F64 and lse16.dtype == F64
    torch.testing.assert_close(out16, out64, rtol=0, atol=0)
