"""The local operator on part of a problem: a range of the heads (head_start,
total_heads, total_kv_heads) and rows at offsets (q_start, k_start, or one
q_start per batch row), forward and backward, against the float64 oracle on
the whole problem (the part's rows, heads and keys cut out of it)."""

from __future__ import annotations

import random

import pytest
import torch
from oracle import reference_attention

import ring_attention  # noqa: F401  (registers the operators)

F64 = torch.float64
OPS = torch.ops.ring_attention

CASES = [
    # (heads, kv_heads, segs, dils, causal, head_groups, grouped, documents, window)
    (6, 2, [8, 16, 32], [1, 2, 4], True, False, False, None, None),
    (8, 4, [16, 64], [2, 4], False, False, True, None, None),
    (7, 7, [8, 32, 64], [1, 3, 4], True, True, False, None, None),
    (6, 3, [16, 48], [1, 3], True, False, False, [0, 30, 31, 90], (12, 0)),
    (12, 2, [8, 24], [4, 6], False, False, False, None, (5, 7)),
]


def _inputs(seed: int, b: int, n: int, h: int, kv: int, d: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, x, d, generator=g, dtype=F64) for x in (h, kv, kv, h)]


def _args(segs, dils, causal, hg, grouped, docs, window, **heads):
    cu = None if docs is None else torch.tensor(docs)
    left, right = window or (-1, -1)
    return dict(segment_lengths=segs, dilation_rates=dils, causal=causal, scale=0.3,
                head_groups=hg, grouped_offsets=grouped, key_padding_mask=None, cu_seqlens=cu,
                window_left=left, window_right=right, **heads)  # fmt: skip


def _oracle(q, k, v, go, gl, segs, dils, causal, hg, grouped, docs, window, keep=None):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    pad = None if keep is None else ~keep
    out, lse = reference_attention(q, k, v, segs, dils, causal, 0.3, hg, pad, grouped, docs,
                                   window)  # fmt: skip
    ((out * go).sum() + (lse.nan_to_num(0.0, 0.0, 0.0) * gl).sum()).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("case", range(len(CASES)))
def test_head_ranges_equal_the_whole_problem(case):
    heads, kv, segs, dils, causal, hg, grouped, docs, window = CASES[case]
    n = 90 if docs else 101
    q, k, v, go = _inputs(case, 2, n, heads, kv, 8)
    gl = torch.randn(2, heads, n, dtype=F64)
    group = heads // kv
    rng = random.Random(case)
    ranges = [(0, heads), (0, 1), (heads - 1, heads)]
    ranges += [tuple(sorted(rng.sample(range(heads + 1), 2))) for _ in range(4)]
    for h0, h1 in ranges:
        if h0 == h1:
            continue
        kv0, kv1 = h0 // group, (h1 - 1) // group + 1
        # the whole problem with the gradient reaching heads [h0, h1) only
        go_r, gl_r = torch.zeros_like(go), torch.zeros_like(gl)
        go_r[:, :, h0:h1], gl_r[:, h0:h1] = go[:, :, h0:h1], gl[:, h0:h1]
        ref = _oracle(q, k, v, go_r, gl_r, segs, dils, causal, hg, grouped, docs, window)
        args = _args(segs, dils, causal, hg, grouped, docs, window, head_start=h0,
                     total_heads=heads, total_kv_heads=kv)  # fmt: skip
        qs, ks, vs = (t[:, :, a:b].contiguous().requires_grad_()
                      for t, a, b in ((q, h0, h1), (k, kv0, kv1), (v, kv0, kv1)))  # fmt: skip
        out, lse = OPS.dilated_attention(qs, ks, vs, **args)
        (
            (out * go[:, :, h0:h1]).sum() + (lse.nan_to_num(0.0, 0.0, 0.0) * gl[:, h0:h1]).sum()
        ).backward()
        what = f"heads [{h0}, {h1})"
        torch.testing.assert_close(out, ref[0][:, :, h0:h1], atol=1e-10, rtol=1e-10, msg=what)
        torch.testing.assert_close(lse, ref[1][:, h0:h1], atol=1e-10, rtol=1e-10, msg=what)
        torch.testing.assert_close(qs.grad, ref[2][:, :, h0:h1], atol=1e-10, rtol=1e-10, msg=what)
        torch.testing.assert_close(ks.grad, ref[3][:, :, kv0:kv1], atol=1e-10, rtol=1e-10,
                                   msg=what)  # fmt: skip
        torch.testing.assert_close(vs.grad, ref[4][:, :, kv0:kv1], atol=1e-10, rtol=1e-10,
                                   msg=what)  # fmt: skip


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_rows_at_offsets_equal_the_whole_sequence(case, dtype):
    heads, kv, segs, dils, causal, hg, grouped, docs, window = CASES[case]
    n = 90 if docs else 101
    q, k, v, go = _inputs(case + 10, 2, n, heads, kv, 8)
    q, k, v = (t.to(dtype).to(F64) for t in (q, k, v))  # the same values in every dtype
    gl = torch.randn(2, heads, n, dtype=F64)
    tol = {F64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    rng = random.Random(case)
    for _ in range(4):
        q0, q1 = sorted(rng.sample(range(n + 1), 2))
        k0, k1 = sorted(rng.sample(range(n + 1), 2))
        if q0 == q1 or k0 == k1:
            continue
        starts = None
        if rng.random() < 0.5:  # one start per batch row
            starts = [q0, rng.randrange(0, n - (q1 - q0) + 1)]
        # the whole sequence: the part's keys kept, the gradient at its queries only
        keep = torch.zeros(2, n, dtype=torch.bool)
        keep[:, k0:k1] = True
        go_r, gl_r = torch.zeros_like(go), torch.zeros_like(gl)
        rows = [(q0, q1), (q0, q1)] if starts is None else [(s, s + q1 - q0) for s in starts]
        for b, (a, e) in enumerate(rows):
            go_r[b, a:e], gl_r[b, :, a:e] = go[b, a:e], gl[b, :, a:e]
        ref = _oracle(q, k, v, go_r, gl_r, segs, dils, causal, hg, grouped, docs, window, keep)
        qs = torch.stack([q[b, a:e] for b, (a, e) in enumerate(rows)]).to(dtype).requires_grad_()
        ks, vs = (t[:, k0:k1].to(dtype).requires_grad_() for t in (k, v))
        gos = torch.stack([go[b, a:e] for b, (a, e) in enumerate(rows)]).to(dtype)
        gls = torch.stack([gl[b, :, a:e] for b, (a, e) in enumerate(rows)])
        row_args = dict(q_start=q0, k_start=k0) if starts is None else dict(
            k_start=k0, q_starts=torch.tensor(starts))  # fmt: skip
        out, lse = OPS.dilated_attention(qs, ks, vs, **_args(segs, dils, causal, hg, grouped, docs,
                                                             window), **row_args)  # fmt: skip
        (
            (out.to(F64) * gos.to(F64)).sum()
            + (lse.nan_to_num(0.0, 0.0, 0.0).to(F64) * gls.to(F64)).sum()
        ).backward()
        what = f"queries {rows}, keys [{k0}, {k1})"
        want = [torch.stack([t[b, a:e] for b, (a, e) in enumerate(rows)]) for t in (ref[0], ref[2])]
        want_lse = torch.stack([ref[1][b, :, a:e] for b, (a, e) in enumerate(rows)])
        gtol = tol * 5
        torch.testing.assert_close(out.to(F64), want[0], atol=tol, rtol=tol, msg=what)
        torch.testing.assert_close(lse.to(F64), want_lse, atol=tol, rtol=tol, msg=what)
        torch.testing.assert_close(qs.grad.to(F64), want[1], atol=gtol, rtol=gtol, msg=what)
        torch.testing.assert_close(
            ks.grad.to(F64), ref[3][:, k0:k1], atol=gtol, rtol=gtol, msg=what
        )
        torch.testing.assert_close(
            vs.grad.to(F64), ref[4][:, k0:k1], atol=gtol, rtol=gtol, msg=what
        )


def test_head_range_arguments_are_checked():
    q = torch.randn(1, 10, 2, 4)
    k = torch.randn(1, 10, 1, 4)
    base = _args([4], [2], False, False, False, None, None)
    with pytest.raises(RuntimeError, match="head_start and total_kv_heads need total_heads"):
        OPS.dilated_attention(q, k, k, **base, head_start=1)
    with pytest.raises(RuntimeError, match="total_kv_heads must divide total_heads"):
        OPS.dilated_attention(q, k, k, **base, head_start=0, total_heads=6, total_kv_heads=4)
    with pytest.raises(RuntimeError, match=r"heads \[head_start, head_start \+ heads\)"):
        OPS.dilated_attention(q, k, k, **base, head_start=5, total_heads=6, total_kv_heads=3)
    with pytest.raises(RuntimeError, match="K/V heads that query heads"):
        OPS.dilated_attention(q, k, k, **base, head_start=1, total_heads=6, total_kv_heads=3)
    with pytest.raises(RuntimeError, match="q_starts must be int64 of shape"):
        OPS.dilated_attention(q, k, k, **base, q_starts=torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="q_starts must be in"):
        OPS.dilated_attention(q, k, k, **base, q_starts=torch.tensor([-1]))
