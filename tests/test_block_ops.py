"""The block operators (``torch.ops.ring_attention.block_forward`` /
``block_backward``) against the float64 oracle and against themselves: a call
split into query and key blocks at offsets (what a ring rank does) equals the
whole call, with grouped K/V heads, documents whose boundaries share nothing
with the blocks, grouped offsets and gradients of lse; rows no query of a
block reaches are never read. Tolerances: tests/op_helpers.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from op_helpers import (
    F64,
    GRAD_TOL,
    LSE_TOL,
    OUT_TOL,
    UNREACHED_CASES,
    Cfg,
    acc_dtype,
    block_backward,
    block_forward,
    close,
    close_grads,
    fresh_acc,
    kslice,
    lse_grad,
    make_inputs,
    reached_rows,
    run_oracle,
    splits,
)

# ----------------------------------------------------------------- block operators

BLOCK_CASES = {
    "longnet": ([8, 16, 32], [1, 2, 4], False),
    "dilated_groups": ([6, 12, 24], [2, 3, 8], True),
    "dense": ([64], [1], False),
    "local_r": ([10], [5], False),
}


def _block_setup(device: str, case: str, causal: bool, dtype: torch.dtype, mask: bool, seed: int):
    ws, rs, hg = BLOCK_CASES[case]
    cfg = Cfg(2, 53, 5, 8, ws, rs, causal, hg, 0.4, mask)
    q, k, v, go, kpm = make_inputs(cfg, dtype, device, seed)
    return cfg, q, k, v, go, kpm


BLOCK_DTYPES = [pytest.param(F64, id="f64"), pytest.param(torch.float32, id="f32")]


def _over_split_cases(test):
    """Parametrizes a split-equals-whole test over every block case, full and
    causal, without and with a key padding mask, in float64 and float32."""
    test = pytest.mark.parametrize("case", list(BLOCK_CASES))(test)
    test = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])(test)
    test = pytest.mark.parametrize("mask", [False, True], ids=["nomask", "mask"])(test)
    return pytest.mark.parametrize("dtype", BLOCK_DTYPES)(test)


def _split_setup(device: str, case: str, causal: bool, mask: bool, dtype: torch.dtype, base: int):
    """``_block_setup`` (seeded from ``base`` and the case) plus the split's
    random source and the failure context."""
    seed = base + len(case) + 2 * causal + mask
    cfg, q, k, v, go, kpm = _block_setup(device, case, causal, dtype, mask, seed)
    ctx = f"{case} causal={causal} mask={mask} {dtype}"
    return cfg, q, k, v, go, kpm, random.Random(seed), ctx


@_over_split_cases
def test_block_forward_split_equals_whole(device, case, causal, mask, dtype) -> None:
    cfg, q, k, v, go, kpm, rng, ctx = _split_setup(device, case, causal, mask, dtype, 100)
    n = cfg.n
    tol = OUT_TOL[dtype]

    whole_out, whole_lse = fresh_acc(q)
    block_forward(cfg, q, k, v, whole_out, whole_lse, 0, 0, kpm)
    r_out, r_lse, *_ = run_oracle(cfg, q, k, v, go, kpm)
    close(whole_out, r_out, tol, "whole out", ctx)
    close(whole_lse, r_lse, tol, "whole lse", ctx)

    for parts in (2, 3, 4):
        # keys split into blocks, merged in a random order
        out, lse = fresh_acc(q)
        blocks = splits(n, parts, rng)
        rng.shuffle(blocks)
        for a, b in blocks:
            block_forward(
                cfg,
                q,
                k[:, a:b].contiguous(),
                v[:, a:b].contiguous(),
                out,
                lse,
                0,
                a,
                kslice(kpm, a, b),
            )
        close(out, whole_out, tol, "key-split out", f"{ctx} blocks={blocks}")
        close(lse, whole_lse, tol, "key-split lse", f"{ctx} blocks={blocks}")

        # queries split into blocks
        qblocks = splits(n, parts, rng)
        for a, b in qblocks:
            out, lse = fresh_acc(q, b - a)
            block_forward(cfg, q[:, a:b].contiguous(), k, v, out, lse, a, 0, kpm)
            close(out, whole_out[:, a:b], tol, "query-split out", f"{ctx} q=[{a},{b})")
            close(lse, whole_lse[:, :, a:b], tol, "query-split lse", f"{ctx} q=[{a},{b})")

        # both (what a ring rank does)
        for qa, qb in qblocks:
            out, lse = fresh_acc(q, qb - qa)
            for a, b in blocks:
                block_forward(
                    cfg,
                    q[:, qa:qb].contiguous(),
                    k[:, a:b].contiguous(),
                    v[:, a:b].contiguous(),
                    out,
                    lse,
                    qa,
                    a,
                    kslice(kpm, a, b),
                )
            close(out, whole_out[:, qa:qb], tol, "2-D split out", f"{ctx} q=[{qa},{qb}) k={blocks}")
            close(
                lse, whole_lse[:, :, qa:qb], tol, "2-D split lse", f"{ctx} q=[{qa},{qb}) k={blocks}"
            )


@_over_split_cases
def test_block_backward_split_equals_whole(device, case, causal, mask, dtype) -> None:
    cfg, q, k, v, go, kpm, rng, ctx = _split_setup(device, case, causal, mask, dtype, 200)
    n = cfg.n
    tol = GRAD_TOL[dtype]
    acc = acc_dtype(dtype)

    out_acc, lse = fresh_acc(q)
    block_forward(cfg, q, k, v, out_acc, lse, 0, 0, kpm)
    out = out_acc.to(dtype)

    def zeros(length: int) -> torch.Tensor:
        return torch.zeros(cfg.batch, length, cfg.heads, cfg.head_dim, dtype=acc, device=device)

    dq, dk, dv = zeros(n), zeros(n), zeros(n)
    block_backward(cfg, go, q, k, v, out, lse, dq, dk, dv, 0, 0, kpm)
    _, _, r_dq, r_dk, r_dv = run_oracle(cfg, q, k, v, go, kpm)
    close_grads((dq, dk, dv), (r_dq, r_dk, r_dv), dtype, ctx, "whole ")

    for parts in (2, 3, 4):
        blocks = splits(n, parts, rng)
        qblocks = splits(n, parts, rng)
        # key blocks: dq accumulates over blocks, dk/dv per block
        sdq = zeros(n)
        for a, b in blocks:
            bdk, bdv = zeros(b - a), zeros(b - a)
            kb, vb = k[:, a:b].contiguous(), v[:, a:b].contiguous()
            block_backward(cfg, go, q, kb, vb, out, lse, sdq, bdk, bdv, 0, a, kslice(kpm, a, b))
            close(bdk, dk[:, a:b], tol, "key-split dk", f"{ctx} k=[{a},{b})")
            close(bdv, dv[:, a:b], tol, "key-split dv", f"{ctx} k=[{a},{b})")
        close(sdq, dq, tol, "key-split dq", f"{ctx} blocks={blocks}")

        # query blocks: dk/dv accumulate over blocks, dq per block
        sdk, sdv = zeros(n), zeros(n)
        for a, b in qblocks:
            bdq = zeros(b - a)
            sl = slice(a, b)
            go_b, q_b, out_b = (t[:, sl].contiguous() for t in (go, q, out))
            lse_b = lse[:, :, sl].contiguous()
            block_backward(cfg, go_b, q_b, k, v, out_b, lse_b, bdq, sdk, sdv, a, 0, kpm)
            close(bdq, dq[:, sl], tol, "query-split dq", f"{ctx} q=[{a},{b})")
        close(sdk, dk, tol, "query-split dk", f"{ctx} q={qblocks}")
        close(sdv, dv, tol, "query-split dv", f"{ctx} q={qblocks}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_block_backward_computes_only_the_gradients_asked_for(device, case, causal) -> None:
    """dq alone, or dk with dv alone, equal those of a call that asks for all three."""
    cfg, q, k, v, go, kpm = _block_setup(device, case, causal, F64, True, seed=230 + causal)
    out_acc, lse = fresh_acc(q)
    block_forward(cfg, q, k, v, out_acc, lse, 0, 0, kpm)
    grads = [torch.zeros(q.shape, dtype=F64, device=device) for _ in range(3)]
    block_backward(cfg, go, q, k, v, out_acc, lse, *grads, 0, 0, kpm)
    dq = torch.zeros_like(grads[0])
    block_backward(cfg, go, q, k, v, out_acc, lse, dq, None, None, 0, 0, kpm)
    dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
    block_backward(cfg, go, q, k, v, out_acc, lse, None, dk, dv, 0, 0, kpm)
    for name, got, want in zip("q k v".split(), (dq, dk, dv), grads, strict=True):
        close(got, want, 0.0, f"d{name}", f"{case} causal={causal}")
    assert grads[0].abs().sum() > 0 and grads[1].abs().sum() > 0


def test_block_forward_empty_key_block_is_noop(device) -> None:
    cfg = Cfg(1, 12, 2, 8, [4, 8], [1, 2], True)
    q, k, v, _, _ = make_inputs(cfg, torch.float32, device, seed=23)
    out, lse = fresh_acc(q)
    block_forward(cfg, q, k, v, out, lse, 0, 0, None)
    out0, lse0 = out.clone(), lse.clone()
    block_forward(cfg, q, k[:, :0], v[:, :0], out, lse, 0, 12, None)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


# Query block, key block and pattern of the "never reads unreached rows" tests:
# queries [qa, qb), keys [ka, kb) with qa >= kb (an earlier rank's keys) or
# overlapping, so only some key rows of the block are reached.


@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
@pytest.mark.parametrize("case", range(len(UNREACHED_CASES)))
def test_block_ops_never_read_unreached_rows(device, case, dtype) -> None:
    ws, rs, causal, hg, (qa, qb), (ka, kb) = UNREACHED_CASES[case]
    cfg = Cfg(2, 48, 5, 8, ws, rs, causal, hg, 0.3)
    q, k, v, go, _ = make_inputs(cfg, dtype, device, seed=300 + case)
    reached = reached_rows(cfg, (qa, qb), (ka, kb)).to(device)
    assert reached.any() and not reached.all(), "test case should reach some rows only"
    ctx = f"case={case} {dtype} q=[{qa},{qb}) k=[{ka},{kb})"

    qb_ = q[:, qa:qb].contiguous()
    kc, vc = k[:, ka:kb].contiguous(), v[:, ka:kb].contiguous()
    kn, vn = kc.clone(), vc.clone()
    kn[:, ~reached] = float("nan")
    vn[:, ~reached] = float("nan")

    # forward: the poisoned block gives exactly what the clean block gives
    res = []
    for kk, vv in ((kc, vc), (kn, vn)):
        out, lse = fresh_acc(q, qb - qa)
        block_forward(cfg, qb_, kk, vv, out, lse, qa, ka, None)
        res.append((out, lse))
    (out_c, lse_c), (out_n, lse_n) = res
    assert torch.isfinite(out_n).all(), f"NaN read from an unreached row: {ctx}"
    assert not torch.isnan(lse_n).any(), f"NaN read from an unreached row: {ctx}"
    close(out_n, out_c, 0.0, "out", ctx)
    close(lse_n, lse_c, 0.0, "lse", ctx)

    # backward (a ring backward reuses the same receive buffers): dq and the
    # gradient of every reached row are unaffected by garbage in the others.
    # Use the final out/lse of the whole sequence, as a ring does.
    whole_out, whole_lse = fresh_acc(q)
    block_forward(cfg, q, k, v, whole_out, whole_lse, 0, 0, None)
    out_f = whole_out[:, qa:qb].to(dtype).contiguous()
    lse_f = whole_lse[:, :, qa:qb].contiguous()
    go_b = go[:, qa:qb].contiguous()
    grads = []
    for kk, vv in ((kc, vc), (kn, vn)):
        acc = acc_dtype(dtype)
        dq = torch.zeros(qb_.shape, dtype=acc, device=device)
        dk = torch.zeros(kk.shape, dtype=acc, device=device)
        dv = torch.zeros(kk.shape, dtype=acc, device=device)
        block_backward(cfg, go_b, qb_, kk, vv, out_f, lse_f, dq, dk, dv, qa, ka, None)
        grads.append((dq, dk, dv))
    (dq_c, dk_c, dv_c), (dq_n, dk_n, dv_n) = grads
    assert torch.isfinite(dq_n).all(), f"backward read NaN from an unreached row: {ctx}"
    close(dq_n, dq_c, 0.0, "dq", ctx)
    close(dk_n[:, reached], dk_c[:, reached], 0.0, "dk (reached rows)", ctx)
    close(dv_n[:, reached], dv_c[:, reached], 0.0, "dv (reached rows)", ctx)


# ------------------------------------------- grouped K/V heads, documents, grouped offsets


def feature_cfg(seed: int, causal: bool) -> Cfg:
    """Grouped K/V heads, random documents (empty, length-1, shorter than a
    segment) and grouped offsets, on a ragged length."""
    rng = random.Random(seed)
    n = rng.randint(40, 110)
    bounds = [0]
    while bounds[-1] < n:
        bounds.append(min(n, bounds[-1] + rng.choice([0, 1, 3, 7, 20, 45])))
    heads = rng.choice([4, 6])
    return Cfg(
        batch=2,
        n=n,
        heads=heads,
        head_dim=8,
        segment_lengths=[6, 16, 32],
        dilation_rates=[1, 2, rng.choice([3, 4])],
        causal=causal,
        head_groups=rng.random() < 0.3,
        scale=0.4,
        mask=rng.random() < 0.5,
        kv_heads=rng.choice([1, 2, heads]),
        grouped_offsets=rng.random() < 0.5,
        cu_seqlens=bounds,
    )


@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seed", range(6))
def test_blocks_with_features_match_oracle(device, seed, causal, dtype) -> None:
    """Query blocks x key blocks at offsets that share nothing with the
    documents, merged in random order, forward and backward (with an lse
    gradient), against the oracle."""
    seed = 700 + 10 * seed + causal
    cfg = feature_cfg(seed, causal)
    rng = random.Random(seed)
    q, k, v, go, kpm = make_inputs(cfg, dtype, device, seed)
    glse = lse_grad(cfg, device, seed + 1)
    r_out, r_lse, r_dq, r_dk, r_dv = run_oracle(cfg, q, k, v, go, kpm, glse)
    q_blocks, k_blocks = splits(cfg.n, 3, rng), splits(cfg.n, 4, rng)
    ctx = f"{cfg} q={q_blocks} k={k_blocks} {dtype}"

    out, lse = fresh_acc(q)
    for qa, qb in q_blocks:
        o, l = fresh_acc(q, qb - qa)
        for ka, kb in rng.sample(k_blocks, len(k_blocks)):
            kk, vv = k[:, ka:kb].contiguous(), v[:, ka:kb].contiguous()
            block_forward(cfg, q[:, qa:qb].contiguous(), kk, vv, o, l, qa, ka, kslice(kpm, ka, kb))
        out[:, qa:qb], lse[:, :, qa:qb] = o, l
    close(out, r_out, OUT_TOL[dtype], "out", ctx)
    close(lse, r_lse, LSE_TOL[dtype], "lse", ctx)

    acc = acc_dtype(dtype)
    final = out.to(dtype)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=device) for x in (q, k, v))
    for qa, qb in q_blocks:
        for ka, kb in k_blocks:
            sq, sk = slice(qa, qb), slice(ka, kb)
            parts = [g[:, s].clone() for g, s in ((dq, sq), (dk, sk), (dv, sk))]
            args = (go[:, sq], q[:, sq], k[:, sk], v[:, sk], final[:, sq], lse[:, :, sq])
            args = tuple(t.contiguous() for t in args)
            glse_b = glse[:, :, sq].contiguous().to(acc)
            block_backward(cfg, *args, *parts, qa, ka, kslice(kpm, ka, kb), glse=glse_b)
            dq[:, sq], dk[:, sk], dv[:, sk] = parts
    close_grads((dq, dk, dv), (r_dq, r_dk, r_dv), dtype, ctx)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse_gradient_enters_delta(device, causal) -> None:
    """grad_lse alone (grad_out = 0) gives the gradient of sum(grad_lse * lse)."""
    cfg = Cfg(1, 40, 4, 8, [8, 40], [2, 4], causal, False, None, True, 2, False, [0, 13, 40])
    q, k, v, go, kpm = make_inputs(cfg, F64, device, seed=760 + causal)
    go = torch.zeros_like(go)
    glse = lse_grad(cfg, device, seed=761).to(F64)
    _, _, r_dq, r_dk, r_dv = run_oracle(cfg, q, k, v, go, kpm, glse)
    out, lse = fresh_acc(q)
    block_forward(cfg, q, k, v, out, lse, 0, 0, kpm)
    grads = [torch.zeros(x.shape, dtype=F64, device=device) for x in (q, k, v)]
    block_backward(cfg, go, q, k, v, out, lse, *grads, 0, 0, kpm, glse=glse)
    for name, g, r in zip(("dq", "dk", "dv"), grads, (r_dq, r_dk, r_dv), strict=True):
        close(g, r, 1e-10, name, f"causal={causal}")
    assert grads[0].abs().sum() > 0 and grads[1].abs().sum() > 0
    assert grads[2].abs().sum() == 0  # lse does not depend on v


@pytest.mark.parametrize("case", range(len(UNREACHED_CASES)))
def test_unreached_rows_with_documents_and_kv_heads(device, case) -> None:
    """Grouped K/V heads and documents: NaN in the key rows no query of the
    block reaches (for any query head of the K/V head) changes nothing."""
    ws, rs, causal, hg, (qa, qb), (ka, kb) = UNREACHED_CASES[case]
    cfg = Cfg(2, 48, 6, 8, ws, rs, causal, hg, 0.3, False, 2, case % 2 == 1)
    cfg.cu_seqlens = [0, 5, 5, 19, 20, 33, 48]
    q, k, v, go, _ = make_inputs(cfg, F64, device, seed=780 + case)
    reached = reached_rows(cfg, (qa, qb), (ka, kb)).to(device)
    assert reached.any() and not reached.all(), "test case should reach some rows only"
    ctx = f"case={case} q=[{qa},{qb}) k=[{ka},{kb})"
    qb_, go_b = q[:, qa:qb].contiguous(), go[:, qa:qb].contiguous()
    kc, vc = k[:, ka:kb].contiguous(), v[:, ka:kb].contiguous()
    kn, vn = kc.clone(), vc.clone()
    kn[:, ~reached] = float("nan")
    vn[:, ~reached] = float("nan")
    whole_out, whole_lse = fresh_acc(q)
    block_forward(cfg, q, k, v, whole_out, whole_lse, 0, 0, None)
    out_f = whole_out[:, qa:qb].contiguous()
    lse_f = whole_lse[:, :, qa:qb].contiguous()
    res = []
    for kk, vv in ((kc, vc), (kn, vn)):
        out, lse = fresh_acc(q, qb - qa)
        block_forward(cfg, qb_, kk, vv, out, lse, qa, ka, None)
        grads = [torch.zeros(x.shape, dtype=F64, device=device) for x in (qb_, kk, vv)]
        block_backward(cfg, go_b, qb_, kk, vv, out_f, lse_f, *grads, qa, ka, None)
        res.append((out, lse, *grads))
    (out_c, lse_c, dq_c, dk_c, dv_c), (out_n, lse_n, dq_n, dk_n, dv_n) = res
    assert torch.isfinite(out_n).all() and torch.isfinite(dq_n).all(), ctx
    close(out_n, out_c, 0.0, "out", ctx)
    close(lse_n, lse_c, 0.0, "lse", ctx)
    close(dq_n, dq_c, 0.0, "dq", ctx)
    close(dk_n[:, reached], dk_c[:, reached], 0.0, "dk", ctx)
    close(dv_n[:, reached], dv_c[:, reached], 0.0, "dv", ctx)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [20, 64, 80, 128, 160, 256])
def test_every_head_dim_tier_matches_oracle(device, head_dim, dtype, causal) -> None:
    """fp16 / bf16 at every head-dim tier of the kernels (on CUDA: the
    tensor-core forward's padded 64, 96, 128, 192 and 256, unaligned rows at
    20, the backward's tensor-core and SIMT kernels), with several 128-row
    tiles, a padding mask and an odd head count, forward and backward
    against the oracle."""
    cfg = Cfg(1, 300, 3, head_dim, [64, 300], [1, 2], causal, False, None, True)
    q, k, v, go, kpm = make_inputs(cfg, dtype, device, seed=900 + head_dim + causal)
    r_out, r_lse, r_dq, r_dk, r_dv = run_oracle(cfg, q, k, v, go, kpm)
    out, lse = fresh_acc(q)
    block_forward(cfg, q, k, v, out, lse, 0, 0, kpm)
    ctx = f"d={head_dim} {dtype} causal={causal}"
    close(out, r_out, OUT_TOL[dtype], "out", ctx)
    close(lse, r_lse, LSE_TOL[dtype], "lse", ctx)
    grads = [torch.zeros(x.shape, dtype=acc_dtype(dtype), device=device) for x in (q, k, v)]
    block_backward(cfg, go, q, k, v, out.to(dtype), lse, *grads, 0, 0, kpm)
    for name, g, r in zip(("dq", "dk", "dv"), grads, (r_dq, r_dk, r_dv), strict=True):
        close(g, r, GRAD_TOL[dtype], name, ctx)
