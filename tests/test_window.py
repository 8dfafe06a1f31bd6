"""Sliding windows (``window=(left, right)``, docs/design.md §1.3): query ``t``
reaches key ``u`` only if also ``t - left <= u <= t + right`` (``-1``:
unbounded on that side), with every pattern, causal, documents, grouped K/V
heads, head groups, key padding and the gradient of ``lse``.

Against the float64 oracle (``tests/oracle.py`` takes the window): the local
op (CPU kernels, low precision by chunks), the block operators at offsets,
the exchange planner (only rows inside the band travel; a window smaller than
a shard talks to one neighbour, bytes flat in ``n``), the public API's checks
(§6). The CUDA kernels are checked in test_cuda_emulated.py, the ring in
test_ring.py.
"""

from __future__ import annotations

import random

import op_helpers as oh
import pytest
import torch
from oracle import multiplicity

import ring_attention as ra
from ring_attention.core.pattern import Pattern
from ring_attention.parallel.exchange_plan import build_plan, exchange_rows

# name -> (n, heads, kv_heads, segments, dilations, window, head_groups, documents)
# Windows smaller than, equal to and larger than the segments; one-sided.
CASES = {
    "dense-small": (61, 3, 3, [61], [1], (5, 5), False, None),
    "dense-left-only": (61, 2, 1, [64], [1], (7, -1), False, None),
    "dense-right-only": (61, 2, 2, [61], [1], (-1, 4), False, None),
    "longnet-equal-segment": (67, 4, 2, [8, 16, 32], [1, 2, 4], (16, 16), False, None),
    "longnet-small": (67, 5, 5, [8, 16, 32], [1, 2, 4], (3, 2), True, None),
    "longnet-larger": (67, 4, 4, [8, 16], [1, 2], (40, 100), False, None),
    "zero-window": (23, 2, 2, [23], [1], (0, 0), False, None),
    "documents": (70, 4, 2, [12, 40], [1, 3], (9, 3), False, [0, 5, 5, 30, 31, 70]),
    "documents-dilated-left": (70, 3, 1, [70], [2], (11, -1), False, [0, 20, 70]),
}


def _cfg(name: str, causal: bool, mask: bool = False, batch: int = 2, head_dim: int = 8) -> oh.Cfg:
    n, heads, kv_heads, segs, dils, window, hg, docs = CASES[name]
    cfg = oh.Cfg(
        batch, n, heads, head_dim, segs, dils, causal, hg, None, mask, kv_heads, False, docs
    )
    cfg.window = window
    return cfg


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(CASES))
def test_local_op_matches_oracle(name, causal) -> None:
    """ra.dilated_attention with a window, forward and backward (lse too)."""
    cfg = _cfg(name, causal, mask=name.startswith("longnet"))
    seed = 4000 + 2 * list(CASES).index(name) + causal
    q, k, v, go, kpm = oh.make_inputs(cfg, oh.F64, "cpu", seed)
    glse = oh.lse_grad(cfg, "cpu", seed + 1)
    got = oh.run_local(cfg, q, k, v, go, kpm, glse)
    want = oh.run_oracle(cfg, q, k, v, go, kpm, glse)
    oh.check_results(cfg, oh.F64, got, want, f"{name} causal={causal}")
    plain = oh.Cfg(**{**cfg.__dict__, "window": None})
    if _window_matters(cfg):  # then the result differs from the one without it
        assert not torch.allclose(got[0], oh.run_oracle(plain, q, k, v, go, kpm)[0])


def _window_matters(cfg: oh.Cfg) -> bool:
    def m(window):
        return multiplicity(
            cfg.n, cfg.heads, cfg.segment_lengths, cfg.dilation_rates, cfg.causal,
            cfg.head_groups, cfg.grouped_offsets, cfg.cu_seqlens, window,
        )  # fmt: skip

    return not torch.equal(m(cfg.window), m(None))


def test_cases_cover_windows_that_matter_and_that_do_not() -> None:
    matters = {name: _window_matters(_cfg(name, False)) for name in CASES}
    assert not matters["longnet-larger"] and sum(matters.values()) == len(CASES) - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["longnet-equal-segment", "documents", "dense-left-only"])
def test_public_function_matches_oracle(name, dtype) -> None:
    cfg = _cfg(name, True)
    q, k, v, go, kpm = oh.make_inputs(cfg, dtype, "cpu", 4100)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = ra.dilated_attention(
        qq, kk, vv, cfg.segment_lengths, cfg.dilation_rates, causal=True,
        cu_seqlens=cfg.cu_seqlens, window=cfg.window, return_lse=True,
    )  # fmt: skip
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), go)
    oh.check_results(cfg, dtype, (out, lse, dq, dk, dv), oh.run_oracle(cfg, q, k, v, go, kpm), name)


def test_low_precision_chunks_with_a_window(monkeypatch) -> None:
    """bf16 by chunks of rows (the local op's fp32 accumulators), a window
    that crosses the chunks."""
    monkeypatch.setenv("RING_ATTENTION_CHUNK_MIB", "0")
    cfg = oh.Cfg(1, 2300, 2, 16, [2300, 512], [1, 2], True, False, None, True, 1)
    cfg.window = (300, 0)
    q, k, v, go, kpm = oh.make_inputs(cfg, torch.bfloat16, "cpu", 4200)
    got, want = oh.run_local(cfg, q, k, v, go, kpm), oh.run_oracle(cfg, q, k, v, go, kpm)
    oh.check_results(cfg, torch.bfloat16, got, want, "chunks")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_windows_across_many_tiles(causal) -> None:
    """Sequences of several key tiles (512 forward, 256 backward) and query
    tiles: the tiles outside each band are skipped, the others masked."""
    cfg = oh.Cfg(1, 1300, 3, 16, [1300, 600], [1, 3], causal, False, None, True, 1)
    cfg.window = (200, 90)
    q, k, v, go, kpm = oh.make_inputs(cfg, oh.F64, "cpu", 4250 + causal)
    glse = oh.lse_grad(cfg, "cpu", 4260)
    got = oh.run_local(cfg, q, k, v, go, kpm, glse)
    want = oh.run_oracle(cfg, q, k, v, go, kpm, glse)
    oh.check_results(cfg, oh.F64, got, want, f"causal={causal}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["longnet-small", "documents", "dense-right-only"])
def test_blocks_at_offsets_match_oracle(name, causal) -> None:
    """Query and key blocks at offsets (what a ring rank computes), merged in
    any order, and their gradients, against the oracle."""
    cfg = _cfg(name, causal)
    seed = 4300 + list(CASES).index(name) * 2 + causal
    rng = random.Random(seed)
    q, k, v, go, kpm = oh.make_inputs(cfg, oh.F64, "cpu", seed)
    glse = oh.lse_grad(cfg, "cpu", seed + 1)
    r_out, r_lse, r_dq, r_dk, r_dv = oh.run_oracle(cfg, q, k, v, go, kpm, glse)
    q_blocks, k_blocks = oh.splits(cfg.n, 3, rng), oh.splits(cfg.n, 4, rng)
    out, lse = oh.fresh_acc(q)
    for qa, qb in q_blocks:
        acc = oh.fresh_acc(q[:, qa:qb])
        for ka, kb in rng.sample(k_blocks, len(k_blocks)):
            oh.block_forward(cfg, q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], *acc, qa, ka, None)
        out[:, qa:qb], lse[:, :, qa:qb] = acc
    ctx = f"{name} causal={causal} q={q_blocks} k={k_blocks}"
    oh.close(out, r_out, oh.OUT_TOL[oh.F64], "out", ctx)
    oh.close(lse, r_lse, oh.LSE_TOL[oh.F64], "lse", ctx)
    dq, dk, dv = (torch.zeros_like(x) for x in (q, k, v))
    for qa, qb in q_blocks:
        for ka, kb in k_blocks:
            parts = [g.clone() for g in (dq[:, qa:qb], dk[:, ka:kb], dv[:, ka:kb])]
            oh.block_backward(
                cfg, go[:, qa:qb].contiguous(), q[:, qa:qb].contiguous(), k[:, ka:kb].contiguous(),
                v[:, ka:kb].contiguous(), out[:, qa:qb].contiguous(),
                lse[:, :, qa:qb].contiguous(), *parts, qa, ka, None,
                glse=glse[:, :, qa:qb].contiguous(),
            )  # fmt: skip
            dq[:, qa:qb], dk[:, ka:kb], dv[:, ka:kb] = parts
    oh.close_grads((dq, dk, dv), (r_dq, r_dk, r_dv), oh.F64, ctx)


def test_gradcheck_out_and_lse() -> None:
    cfg = oh.Cfg(1, 20, 3, 4, [4, 8], [1, 2], True, kv_heads=1)
    q, k, v, _, _ = oh.make_inputs(cfg, oh.F64, "cpu", 4400)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def fn(q, k, v):
        return ra.dilated_attention(q, k, v, [4, 8], [1, 2], causal=True, window=(3, 2),
                                    return_lse=True)  # fmt: skip

    assert torch.isfinite(fn(q, k, v)[1]).all()  # every row reaches itself (r = 1 branch)
    assert torch.autograd.gradcheck(fn, (q, k, v))


# ------------------------------------------------------------------ exchange


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["longnet-small", "documents", "dense-left-only"])
def test_exchange_rows_are_the_rows_reached(name, causal) -> None:
    """exchange_rows sends exactly the key rows some query of the range
    reaches inside its window (the oracle's multiplicity)."""
    cfg = _cfg(name, causal)
    pattern = Pattern(
        cfg.segment_lengths, cfg.dilation_rates, causal=causal, head_groups=cfg.head_groups,
        window=cfg.window,
    ).with_documents(cfg.cu_seqlens)  # fmt: skip
    rng = random.Random(4500 + causal)
    for _ in range(6):
        qr = sorted(rng.sample(range(cfg.n + 1), 2))
        kr = sorted(rng.sample(range(cfg.n + 1), 2))
        idx = exchange_rows([(qr[0], qr[1] - qr[0])], kr[0], kr[1] - kr[0], cfg.heads,
                            cfg.resolved_kv_heads(), pattern)  # fmt: skip
        want = torch.nonzero(oh.reached_rows(cfg, tuple(qr), tuple(kr)).flatten()).flatten()
        assert torch.equal(idx, want), (qr, kr)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_window_smaller_than_a_shard_talks_to_one_neighbour(causal) -> None:
    """Dense sliding window of 64 over 4 shards longer than it: every rank
    exchanges with its neighbours only (causal: receives from the one before
    it), and the bytes a rank sends do not grow with n."""
    sent = {}
    for n in (1024, 4096, 16384):
        pattern = Pattern([n], [1], causal=causal, window=(64, 0 if causal else 64))
        for rank in range(4):
            plan = build_plan(pattern, n, 4, 2, 4, rank)
            for step in plan.steps:
                assert step.distance in (1, 3), (n, rank, step.distance)  # neighbours only
            recv = {s.recv_from for s in plan.steps} - {None}
            assert recv == ({rank - 1} if causal else {rank - 1, rank + 1}) & set(range(4))
            assert plan.rows_received == 2 * 64 * len(recv)  # 64 rows of each K/V head
            sent[n, rank] = plan.bytes_sent(1, 64, 2)
    for rank in range(3):
        assert sent[1024, rank] == sent[4096, rank] == sent[16384, rank] > 0
    # without the window the last rank receives every earlier shard
    assert len(build_plan(Pattern([4096], [1], causal=True), 4096, 4, 2, 4, 3).steps) == 3


# ------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "window, match",
    [
        ((True, 3), r"window\[0\] must be an integer"),
        ((3, False), r"window\[1\] must be an integer"),
        ((2.0, 3), r"window\[0\] must be an integer"),
        ((-2, 3), r"window\[0\] must be >= -1"),
        ((3, -5), r"window\[1\] must be >= -1"),
        ((1, 2, 3), r"window must be \(left, right\)"),
        (5, r"window must be \(left, right\)"),
        ("ab", r"window must be \(left, right\)"),
        ((2**63, 0), r"window\[0\] must be at most 2\*\*63 - 1"),
    ],
)
def test_bad_windows_raise_naming_window(window, match) -> None:
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=match):
        ra.dilated_attention(q, q, q, [4], [1], window=window)
    with pytest.raises(ValueError, match=match):
        ra.DilatedAttention([4], [1], window=window)
    with pytest.raises(ValueError, match=match):
        ra.MultiheadDilatedAttention(8, 2, window=window)


def test_window_values_of_every_integer_kind() -> None:
    import numpy as np

    q = torch.randn(1, 12, 2, 4)
    want = ra.dilated_attention(q, q, q, [12], [1], window=(3, 0))
    for window in ([3, 0], (np.int64(3), 0), (torch.tensor(3), torch.tensor(0)), (3, -0)):
        torch.testing.assert_close(ra.dilated_attention(q, q, q, [12], [1], window=window), want)
    assert Pattern([4], [1], window=None) == Pattern([4], [1], window=(-1, -1))
    assert Pattern([4], [1], window=(2, 1)).digest() != Pattern([4], [1]).digest()


def test_operators_check_the_window() -> None:
    q = torch.randn(1, 8, 2, 4)
    pattern = ([4], [1], False, 0.5, False, False, None, None)
    with pytest.raises(RuntimeError, match="window must be"):
        torch.ops.ring_attention.dilated_attention(q, q, q, *pattern, -2, 0)
    with pytest.raises(RuntimeError, match="window must be"):
        torch.ops.ring_attention.exchange_rows(
            [0], [4], 0, 4, 2, 2, [4], [1], False, False, False, None, 0, -3
        )


def test_multihead_window_kernels_equal_the_dense_path() -> None:
    """MultiheadDilatedAttention with a window and no pattern: sliding-window
    attention, the same through the kernels (need_weights=False) and the
    dense path (weights: zero outside the band)."""
    torch.manual_seed(0)
    m = ra.MultiheadDilatedAttention(16, 4, batch_first=True, window=(3, 1))
    x = torch.randn(2, 19, 16)
    a, none = m(x, x, x, need_weights=False)
    b, w = m(x, x, x, need_weights=True)
    assert none is None
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    t, u = torch.arange(19)[:, None], torch.arange(19)[None, :]
    inside = (u >= t - 3) & (u <= t + 1)
    assert (w[:, ~inside] == 0).all() and (w[:, inside] > 0).all()
    dilated = ra.MultiheadDilatedAttention(
        16, 4, batch_first=True, segment_lengths=[8], dilation_rates=[2], window=(3, 1)
    )
    assert "window=(3,1)" in repr(dilated)
