"""Sanity tests of the float64 oracle (tests/oracle.py) against hand-built cases.

They check that the oracle really is docs/design.md section 1 (dense pattern =
softmax attention, local pattern = block-diagonal attention, multiset
branches, per-head offsets ``h mod r`` or grouped, head groups, masks, empty
rows, documents = independent sequences, grouped K/V heads = repeated K/V, a
differentiable lse), using torch alone, never the kernels.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from op_helpers import sdpa
from oracle import (
    active,
    head_group_bounds,
    head_offset,
    multiplicity,
    reference_attention,
    segment_starts,
)

F64 = torch.float64


def _qkv(b: int, n: int, h: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, h, d, dtype=F64, generator=g) for _ in range(3))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("w_factor", [1, 3])
def test_dense_pattern_equalssdpa(causal: bool, w_factor: int) -> None:
    b, n, h, d = 2, 13, 3, 8
    q, k, v = _qkv(b, n, h, d)
    out, lse = reference_attention(q, k, v, [n * w_factor], [1], causal=causal)
    ref = sdpa(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)

    s = torch.einsum("bthd,buhd->bhtu", q, k) * d**-0.5
    if causal:
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), rtol=1e-12, atol=1e-12)


def test_dense_pattern_gradients_equalsdpa() -> None:
    b, n, h, d = 1, 9, 2, 4
    q, k, v = (x.requires_grad_() for x in _qkv(b, n, h, d, seed=1))
    go = torch.randn(b, n, h, d, dtype=F64)
    out, _ = reference_attention(q, k, v, [n], [1], causal=True, scale=0.3)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref = sdpa(q, k, v, is_causal=True, scale=0.3)
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
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=mask), rtol=1e-12, atol=1e-12)
    # and block by block
    for s in range(0, n, w):
        blk = slice(s, s + w)
        ref = sdpa(q[:, blk], k[:, blk], v[:, blk])
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
    ref = sdpa(q, k, v, attn_mask=~kpm[:, None, None, :])
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


# ----------------------------------- documents, grouped K/V heads, grouped offsets


def test_segments_restart_at_every_document() -> None:
    # documents [0, 5), [5, 5) (empty), [5, 6), [6, 13); w = 3
    starts = segment_starts(13, 3, [0, 5, 5, 6, 13])
    expected = [0, 0, 0, 3, 3, 5, 6, 6, 6, 9, 9, 9, 12]
    assert starts.tolist() == expected
    assert segment_starts(13, 3).tolist() == [0, 0, 0, 3, 3, 3, 6, 6, 6, 9, 9, 9, 12]
    # active positions count from the segment start: (t - start) mod r == offset
    act = active(13, 3, 2, 1, cu_seqlens=[0, 5, 5, 6, 13])
    assert act.nonzero().flatten().tolist() == [1, 4, 7, 10]


def test_nothing_crosses_a_document() -> None:
    bounds = [0, 4, 4, 5, 11, 16]
    m = multiplicity(16, 3, [8, 16], [1, 2], causal=False, cu_seqlens=bounds)
    doc = torch.zeros(16, dtype=torch.long)
    for j, (a, b) in enumerate(itertools.pairwise(bounds)):
        doc[a:b] = j
    crossing = doc[:, None] != doc[None, :]
    assert (m[:, crossing] == 0).all()
    assert m[0, 4, 4] == 2  # the length-1 document: its token reaches itself in both branches


@pytest.mark.parametrize("causal", [False, True])
def test_documents_equal_independent_sequences(causal: bool) -> None:
    """Out, lse and gradients of a packed call equal those of one call per document."""
    bounds = [0, 7, 7, 8, 20, 33]
    q, k, v = (x.requires_grad_() for x in _qkv(2, 33, 4, 4, seed=30))
    go = torch.randn(2, 33, 4, 4, dtype=F64)
    gl = torch.randn(2, 4, 33, dtype=F64)
    ws, rs = [4, 16], [1, 2]
    out, lse = reference_attention(q, k, v, ws, rs, causal=causal, cu_seqlens=bounds)
    grads = torch.autograd.grad((out, lse), (q, k, v), (go, gl))
    for a, b in itertools.pairwise(bounds):
        if a == b:
            continue
        sl = slice(a, b)
        qs, ks, vs = (x.detach()[:, sl].requires_grad_() for x in (q, k, v))
        o, l = reference_attention(qs, ks, vs, ws, rs, causal=causal)
        gs = torch.autograd.grad((o, l), (qs, ks, vs), (go[:, sl], gl[:, :, sl]))
        torch.testing.assert_close(out[:, sl], o, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:, :, sl], l, rtol=1e-12, atol=1e-12)
        for g, g1 in zip(grads, gs, strict=True):
            torch.testing.assert_close(g[:, sl], g1, rtol=1e-12, atol=1e-12)


def test_one_document_is_the_plain_pattern() -> None:
    q, k, v = _qkv(1, 21, 3, 4, seed=31)
    a = reference_attention(q, k, v, [8, 16], [2, 4], causal=True)
    b = reference_attention(q, k, v, [8, 16], [2, 4], causal=True, cu_seqlens=[0, 21])
    c = reference_attention(q, k, v, [8, 16], [2, 4], causal=True, cu_seqlens=torch.tensor([0, 21]))
    for x, y, z in zip(a, b, c, strict=True):
        assert torch.equal(x, y) and torch.equal(x, z)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_kv_heads_equal_repeated_kv(kv_heads: int) -> None:
    """Grouped K/V heads: the same as K/V repeated per query head, and the K/V
    gradient is the sum over the query heads of a group."""
    heads, g = 6, 6 // kv_heads
    q = torch.randn(2, 17, heads, 4, dtype=F64, requires_grad=True)
    k = torch.randn(2, 17, kv_heads, 4, dtype=F64, requires_grad=True)
    v = torch.randn(2, 17, kv_heads, 4, dtype=F64, requires_grad=True)
    go = torch.randn(2, 17, heads, 4, dtype=F64)
    out, lse = reference_attention(q, k, v, [8, 17], [2, 3], causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    kr = k.detach().repeat_interleave(g, dim=2).requires_grad_()
    vr = v.detach().repeat_interleave(g, dim=2).requires_grad_()
    out_r, lse_r = reference_attention(q, kr, vr, [8, 17], [2, 3], causal=True)
    dq_r, dk_r, dv_r = torch.autograd.grad(out_r, (q, kr, vr), go)
    assert torch.equal(out, out_r) and torch.equal(lse, lse_r) and torch.equal(dq, dq_r)
    torch.testing.assert_close(dk, dk_r.view(2, 17, kv_heads, g, 4).sum(3), rtol=1e-12, atol=0)
    torch.testing.assert_close(dv, dv_r.view(2, 17, kv_heads, g, 4).sum(3), rtol=1e-12, atol=0)
    # query head h reads K/V head h // g: heads 0 and g - 1 share one
    k2 = k.detach().clone()
    k2[:, :, 0] += 1.0
    out2, _ = reference_attention(q, k2, v, [8, 17], [2, 3], causal=True)
    changed = (out2 != out).flatten(3).any(-1).any(0).any(0)  # per query head
    assert changed.tolist() == [h // g == 0 for h in range(heads)]


def test_grouped_offsets_by_hand() -> None:
    # 7 heads, r = 3: ceil(7 / 3) = 3 heads per offset -> 0,0,0,1,1,1,2; h mod 3 otherwise
    assert [head_offset(h, 3, 7, True) for h in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert [head_offset(h, 3, 7) for h in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    # r > heads: one head per offset
    assert [head_offset(h, 8, 3, True) for h in range(3)] == [0, 1, 2]
    m = multiplicity(12, 7, [6], [3], grouped_offsets=True)
    for h in range(7):
        act = active(12, 6, 3, h, 7, grouped_offsets=True)
        assert act.nonzero().flatten().tolist() == [
            t for t in range(12) if (t % 6) % 3 == [0, 0, 0, 1, 1, 1, 2][h]
        ]
        assert torch.equal(m[h].diagonal() > 0, act)


def test_lse_is_differentiable() -> None:
    """The oracle's lse gradient is that of logsumexp (dense pattern), and zero
    through rows that reach nothing."""
    q, k, v = (x.requires_grad_() for x in _qkv(1, 9, 2, 4, seed=32))
    gl = torch.randn(1, 2, 9, dtype=F64)
    _, lse = reference_attention(q, k, v, [9], [1], causal=True)
    grads = torch.autograd.grad(lse, (q, k), gl)
    s = torch.einsum("bthd,buhd->bhtu", q, k) * 4**-0.5
    s = s.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.autograd.grad(torch.logsumexp(s, dim=-1), (q, k), gl)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    # (8, 2), one head: odd positions reach nothing, their lse is -inf
    q1, k1, v1 = (x[:, :, :1].detach().requires_grad_() for x in (q, k, v))
    _, lse1 = reference_attention(q1, k1, v1, [8], [2])
    (dq1,) = torch.autograd.grad(lse1.masked_fill(torch.isinf(lse1), 0).sum(), (q1,))
    assert torch.isneginf(lse1[0, 0, 1::2]).all()
    assert (dq1[0, 1::2] == 0).all() and (dq1[0, 0::2] != 0).any()
