"""The local operator and the block operators against the float64 oracle.

Covers ``ra.dilated_attention`` (forward, ``return_lse``, backward) and the C++
operators ``torch.ops.ring_attention.{dilated_attention,
dilated_attention_backward, block_forward, block_backward}`` on every device
of the ``device`` fixture (CPU, and CUDA when a GPU is present).

Tolerances (inputs are unit-variance ``randn``; ``out`` is compared absolutely
and relatively, ``atol = rtol``):

==========  ========  =========================  ==========
dtype       out       dq, dk, dv                 lse (fp32)
==========  ========  =========================  ==========
float64     1e-10     1e-10                      1e-10 [1]_
float32     1e-5      1e-4                       1e-5
float16     2e-3      1e-2                       1e-3
bfloat16    2e-2      5e-2                       1e-3
==========  ========  =========================  ==========

.. [1] float64 inputs accumulate in float64 (the accumulators and ``lse`` are
   float64); every other dtype accumulates in float32 and returns a float32
   ``lse`` (DESIGN.md section 2).

Block accumulators: float64 for float64 inputs, float32 otherwise (the dtype
``csrc/checks.h:acc_dtype`` requires).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from oracle import multiplicity, reference_attention

import ring_attention as ra

OPS = torch.ops.ring_attention
F64 = torch.float64

OUT_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
LSE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}


# --------------------------------------------------------------------------- helpers


@dataclass
class Cfg:
    """One test configuration of the local operator."""

    batch: int
    n: int
    heads: int
    head_dim: int
    segment_lengths: list[int]
    dilation_rates: list[int]
    causal: bool = False
    head_groups: bool = False
    scale: float | None = None
    mask: bool = False

    def kwargs(self) -> dict:
        return {
            "causal": self.causal,
            "scale": self.scale,
            "head_groups": self.head_groups,
        }

    def resolved_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return F64 if dtype == F64 else torch.float32


def make_inputs(
    cfg: Cfg, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q, k, v, grad_out (unit variance) and an optional key_padding_mask."""
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.batch, cfg.n, cfg.heads, cfg.head_dim)
    q, k, v, go = (torch.randn(shape, generator=g, dtype=F64) for _ in range(4))
    mask = None
    if cfg.mask:
        mask = torch.rand(cfg.batch, cfg.n, generator=g) < 0.25
        if cfg.n >= 8:  # a masked run of keys, possibly a whole segment
            a = int(torch.randint(0, cfg.n - 4, (1,), generator=g))
            mask[-1, a : a + min(cfg.n // 3, 32)] = True
        mask = mask.to(device)
    return (*(x.to(device=device, dtype=dtype) for x in (q, k, v, go)), mask)


def run_op(cfg: Cfg, q, k, v, go, mask):
    """ra.dilated_attention forward + backward: out, lse, dq, dk, dv."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = ra.dilated_attention(
        q,
        k,
        v,
        cfg.segment_lengths,
        cfg.dilation_rates,
        key_padding_mask=mask,
        return_lse=True,
        **cfg.kwargs(),
    )
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    return out, lse, dq, dk, dv


def run_oracle(cfg: Cfg, q, k, v, go, mask):
    """The oracle on the same (upcast) inputs: out, lse, dq, dk, dv in float64."""
    q, k, v = (x.detach().to(F64).requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(
        q,
        k,
        v,
        cfg.segment_lengths,
        cfg.dilation_rates,
        key_padding_mask=mask,
        **cfg.kwargs(),
    )
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go.to(F64))
    return out, lse, dq, dk, dv


def close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: float,
    what: str,
    ctx: object,
    rtol: float | None = None,
) -> None:
    """assert_close in float64 on CPU (atol = tol, rtol = tol unless given)."""
    a = actual.detach().to(device="cpu", dtype=F64)
    e = expected.detach().to(device="cpu", dtype=F64)
    torch.testing.assert_close(
        a,
        e,
        rtol=tol if rtol is None else rtol,
        atol=tol,
        msg=lambda m: f"{what} mismatch [{ctx}]\n{m}",
    )


def check_against_oracle(cfg: Cfg, dtype: torch.dtype, device: str, seed: int) -> None:
    q, k, v, go, mask = make_inputs(cfg, dtype, device, seed)
    out, lse, dq, dk, dv = run_op(cfg, q, k, v, go, mask)
    r_out, r_lse, r_dq, r_dk, r_dv = run_oracle(cfg, q, k, v, go, mask)
    ctx = f"seed={seed} dtype={dtype} device={device} {cfg}"
    assert out.dtype == dtype and out.shape == q.shape, ctx
    assert lse.shape == (cfg.batch, cfg.heads, cfg.n), ctx
    if dtype != F64:
        assert lse.dtype == torch.float32, ctx
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert g.dtype == dtype and g.shape == x.shape, ctx
    close(out, r_out, OUT_TOL[dtype], "out", ctx)
    close(lse, r_lse, LSE_TOL[dtype], "lse", ctx)
    close(dq, r_dq, GRAD_TOL[dtype], "dq", ctx)
    close(dk, r_dk, GRAD_TOL[dtype], "dk", ctx)
    close(dv, r_dv, GRAD_TOL[dtype], "dv", ctx)


# --------------------------------------------------------------- dilated_attention

PATTERNS = {
    "dense": ([64], [1]),
    "local": ([16], [1]),
    "dilated_r8": ([8], [8]),
    "r_eq_w": ([5], [5]),
    "longnet3": ([8, 16, 32], [1, 2, 4]),
    "five": ([4, 8, 16, 32, 64], [1, 2, 4, 8, 8]),
    "duplicate": ([12, 12], [3, 3]),
}


@pytest.mark.parametrize("mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("head_groups", [False, True], ids=["shared", "groups"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_dilated_attention_matches_oracle(device, pattern, causal, head_groups, mask) -> None:
    ws, rs = PATTERNS[pattern]
    # ragged: 45 is not a multiple of any w; heads 5 / 7 not multiples of r
    heads = 7 if len(ws) > 3 else 5
    cfg = Cfg(2, 45, heads, 16, ws, rs, causal, head_groups, None, mask)
    seed = 10 * list(PATTERNS).index(pattern) + 4 * causal + 2 * head_groups + mask
    check_against_oracle(cfg, F64, device, seed=seed)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dilated_attention_float32(device, causal) -> None:
    cfg = Cfg(2, 77, 3, 32, [8, 16, 32], [1, 2, 4], causal, False, 0.3, True)
    check_against_oracle(cfg, torch.float32, device, seed=11)


@pytest.mark.parametrize("scale", [None, 0.05, 1.0, 2.5])
def test_custom_scale(device, scale) -> None:
    cfg = Cfg(1, 30, 3, 8, [6, 30], [2, 3], True, False, scale, False)
    check_against_oracle(cfg, F64, device, seed=12)


def test_default_scale_is_head_dim_rsqrt(device) -> None:
    cfg = Cfg(1, 20, 2, 32, [8], [2])
    q, k, v, _, _ = make_inputs(cfg, F64, device, seed=13)
    a = ra.dilated_attention(q, k, v, [8], [2])
    b = ra.dilated_attention(q, k, v, [8], [2], scale=32**-0.5)
    close(a, b, 0.0, "out", "default scale")


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_tiny_sequences(device, n) -> None:
    cfg = Cfg(1, n, 3, 8, [4, 2], [2, 1], True, False, None, False)
    check_against_oracle(cfg, F64, device, seed=14)


def _random_cfg(seed: int) -> Cfg:
    rng = random.Random(seed)
    n = rng.randint(1, 200)
    branches = rng.randint(1, 5)
    ws = [rng.randint(1, 64) for _ in range(branches)]
    rs = [rng.randint(1, min(w, 8)) for w in ws]
    heads = rng.randint(1, 7)
    return Cfg(
        batch=rng.randint(1, 2),
        n=n,
        heads=heads,
        head_dim=rng.choice([8, 16, 32]),
        segment_lengths=ws,
        dilation_rates=rs,
        causal=rng.random() < 0.5,
        head_groups=heads >= branches and rng.random() < 0.5,
        scale=None if rng.random() < 0.7 else rng.uniform(0.05, 1.0),
        mask=rng.random() < 0.4,
    )


@pytest.mark.parametrize("seed", range(40))
def test_random_sweep_float64(device, seed) -> None:
    """Random patterns, lengths, heads; float64 forward and backward to 1e-10."""
    cfg = _random_cfg(1000 + seed)
    check_against_oracle(cfg, F64, device, seed=1000 + seed)


# ------------------------------------------------------- reference implementations


def _sdpa(q, k, v, *, attn_mask=None, is_causal=False):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        is_causal=is_causal,
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_pattern_equals_sdpa(device, causal, dtype) -> None:
    cfg = Cfg(2, 50, 3, 16, [50], [1], causal)
    q, k, v, _, _ = make_inputs(cfg, dtype, device, seed=15)
    tol = OUT_TOL[dtype]
    for w in (50, 64, 1000):  # any w >= n is dense
        out = ra.dilated_attention(q, k, v, [w], [1], causal=causal)
        close(
            out, _sdpa(q.double(), k.double(), v.double(), is_causal=causal), tol, "out", f"w={w}"
        )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_local_pattern_equals_block_diagonal(device, causal) -> None:
    n, w = 45, 8
    cfg = Cfg(2, n, 3, 16, [w], [1], causal)
    q, k, v, _, _ = make_inputs(cfg, F64, device, seed=16)
    seg = torch.arange(n, device=device) // w
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask = mask & torch.ones(n, n, dtype=torch.bool, device=device).tril()
    out = ra.dilated_attention(q, k, v, [w], [1], causal=causal)
    close(out, _sdpa(q, k, v, attn_mask=mask), 1e-10, "out", "local")


def test_non_contiguous_inputs(device) -> None:
    cfg = Cfg(2, 33, 3, 8, [8, 16], [1, 2], True)
    q, k, v, _, _ = make_inputs(cfg, F64, device, seed=17)
    # (B, H, N, D) storage viewed as (B, N, H, D)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qt.is_contiguous()
    a = ra.dilated_attention(q, k, v, [8, 16], [1, 2], causal=True)
    b = ra.dilated_attention(qt, kt, vt, [8, 16], [1, 2], causal=True)
    close(b, a, 1e-12, "out", "non-contiguous")


def test_meta_device_shapes() -> None:
    q = torch.empty(2, 37, 5, 16, device="meta", dtype=torch.float32)
    out, lse = ra.dilated_attention(q, q, q, [8, 16], [2, 4], return_lse=True)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 5, 37) and lse.dtype == torch.float32


# ------------------------------------------------------------------ low precision


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_matches_oracle(device, dtype, causal) -> None:
    cfg = Cfg(2, 70, 3, 32, [16, 64], [2, 4], causal, False, None, True)
    check_against_oracle(cfg, dtype, device, seed=18)


# ---------------------------------------------------------------- edge numerics


def test_rows_reaching_nothing(device) -> None:
    # heads=3, (8, 2): heads 0, 2 active at even positions, head 1 at odd ones,
    # so every row is empty for some head. Batch 1 masks every key of segment 1
    # and one of segment 0; (4, 4) adds a branch whose last segment is empty
    # for heads 1..3.
    cfg = Cfg(2, 21, 3, 8, [8, 4], [2, 4], True, False, None, False)
    q, k, v, go, _ = make_inputs(cfg, F64, device, seed=19)
    mask = torch.zeros(2, 21, dtype=torch.bool, device=device)
    mask[1, 8:16] = True
    mask[1, 0] = True
    out, lse, dq, dk, dv = run_op(cfg, q, k, v, go, mask)
    r_out, r_lse, r_dq, r_dk, r_dv = run_oracle(cfg, q, k, v, go, mask)

    empty = torch.isneginf(r_lse).transpose(1, 2)  # (B, N, H)
    assert empty.any()
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any()
    assert torch.isneginf(lse).transpose(1, 2).cpu().equal(empty.cpu())
    assert (out[empty] == 0).all()
    assert (dq[empty] == 0).all()
    # keys nobody reaches: zero gradient
    m = multiplicity(21, 3, cfg.segment_lengths, cfg.dilation_rates, True).to(device)
    m = m[None] * (~mask)[:, None, None, :].to(F64)
    unreached = (m.sum(dim=2) == 0).transpose(1, 2)  # (B, N, H)
    assert (dk[unreached] == 0).all() and (dv[unreached] == 0).all()
    for a, e, what in zip(
        (out, lse, dq, dk, dv),
        (r_out, r_lse, r_dq, r_dk, r_dv),
        "out lse dq dk dv".split(),
        strict=True,
    ):
        close(a, e, 1e-10, what, "empty rows")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fully_masked_batch(device, causal) -> None:
    cfg = Cfg(2, 16, 2, 8, [8, 16], [1, 2], causal)
    q, k, v, go, _ = make_inputs(cfg, torch.float32, device, seed=20)
    mask = torch.zeros(2, 16, dtype=torch.bool, device=device)
    mask[0] = True
    out, lse, dq, dk, dv = run_op(cfg, q, k, v, go, mask)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_large_logits(device, dtype) -> None:
    cfg = Cfg(1, 40, 3, 16, [8, 32], [2, 4], True)
    q, k, v, go, _ = make_inputs(cfg, F64, device, seed=21)
    q, k = q * 100, k * 100  # |s| ~ 1e4
    q, k, v, go = (x.to(dtype) for x in (q, k, v, go))
    out, lse, dq, dk, dv = run_op(cfg, q, k, v, go, None)
    r_out, r_lse, *_ = run_oracle(cfg, q, k, v, go, None)
    assert r_lse.abs().max() > 1e3
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    assert torch.equal(torch.isfinite(lse).cpu(), torch.isfinite(r_lse).cpu())  # -inf: empty rows
    # fp32: an O(1e-7) relative error in s ~ 1e4 moves the weights by ~1e-3
    tol = 1e-9 if dtype == F64 else 1e-2
    close(out, r_out, tol, "out", f"large logits {dtype}")
    # lse ~ 1e4: fp32 rounding alone is ~6e-4
    lse_tol = 1e-9 if dtype == F64 else 1e-2
    close(lse, r_lse, lse_tol, "lse", f"large logits {dtype}", rtol=1e-12 if dtype == F64 else 1e-6)


@pytest.mark.parametrize("where", ["q", "k", "v_inf", "v"])
def test_nan_in_reached_input_propagates(device, where) -> None:
    n, heads = 24, 3
    ws, rs = [8, 24], [2, 3]
    cfg = Cfg(1, n, heads, 8, ws, rs, True)
    q, k, v, _, _ = make_inputs(cfg, F64, device, seed=22)
    row, head = 10, 1
    bad = float("inf") if where == "v_inf" else float("nan")
    {"q": q, "k": k, "v_inf": v, "v": v}[where][0, row, head, 0] = bad
    out = ra.dilated_attention(q, k, v, ws, rs, causal=True)
    nonfinite = ~torch.isfinite(out[0]).all(dim=-1)  # (N, H)
    m = multiplicity(n, heads, ws, rs, causal=True)
    expected = torch.zeros(n, heads, dtype=torch.bool)
    if where == "q":
        expected[row, head] = bool(m[head, row].any())
    else:  # queries that reach key `row` in head `head`
        expected[:, head] = m[head, :, row] > 0
    assert expected.any()
    nonfinite = nonfinite.cpu()
    # Every row that reaches the bad value is non-finite (nothing is hidden).
    assert not (expected & ~nonfinite).any(), f"{where}: a reached non-finite value was hidden"
    if where == "q":
        assert torch.equal(nonfinite, expected), f"{where}: non-finite rows differ"
    else:
        # A bad value row may also spill onto earlier queries of its own causal
        # tile (0 * inf in the P @ V product, as in dense SDPA), never onto
        # other heads.
        others = torch.ones(heads, dtype=torch.bool)
        others[head] = False
        assert not nonfinite[:, others].any(), f"{where}: spilled onto another head"


# ----------------------------------------------------------------- block operators

BLOCK_CASES = {
    "longnet": ([8, 16, 32], [1, 2, 4], False),
    "dilated_groups": ([6, 12, 24], [2, 3, 8], True),
    "dense": ([64], [1], False),
    "local_r": ([10], [5], False),
}


def _splits(n: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    """``parts`` contiguous non-empty ranges covering [0, n)."""
    cuts = sorted(rng.sample(range(1, n), parts - 1))
    edges = [0, *cuts, n]
    return list(itertools.pairwise(edges))


def _block_setup(device: str, case: str, causal: bool, dtype: torch.dtype, mask: bool, seed: int):
    ws, rs, hg = BLOCK_CASES[case]
    cfg = Cfg(2, 53, 5, 8, ws, rs, causal, hg, 0.4, mask)
    q, k, v, go, kpm = make_inputs(cfg, dtype, device, seed)
    return cfg, q, k, v, go, kpm


def _fresh_acc(q: torch.Tensor, lq: int | None = None):
    b, n, h, d = q.shape
    lq = n if lq is None else lq
    acc = acc_dtype(q.dtype)
    out = torch.zeros(b, lq, h, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, lq), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def _bf(cfg: Cfg, q, k, v, out, lse, q_start, k_start, kpm, ops=OPS) -> None:
    ops.block_forward(
        q,
        k,
        v,
        out,
        lse,
        q_start,
        k_start,
        cfg.segment_lengths,
        cfg.dilation_rates,
        cfg.causal,
        cfg.resolved_scale(),
        cfg.head_groups,
        kpm,
    )


def _bb(cfg: Cfg, go, q, k, v, out, lse, dq, dk, dv, q_start, k_start, kpm, ops=OPS) -> None:
    ops.block_backward(
        go,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
        q_start,
        k_start,
        cfg.segment_lengths,
        cfg.dilation_rates,
        cfg.causal,
        cfg.resolved_scale(),
        cfg.head_groups,
        kpm,
    )


def _kslice(kpm, a, b):
    return None if kpm is None else kpm[:, a:b].contiguous()


BLOCK_DTYPES = [pytest.param(F64, id="f64"), pytest.param(torch.float32, id="f32")]


@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
@pytest.mark.parametrize("mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_block_forward_split_equals_whole(device, case, causal, mask, dtype) -> None:
    seed = 100 + len(case) + 2 * causal + mask
    cfg, q, k, v, go, kpm = _block_setup(device, case, causal, dtype, mask, seed)
    rng = random.Random(seed)
    n = cfg.n
    tol = OUT_TOL[dtype]
    ctx = f"{case} causal={causal} mask={mask} {dtype}"

    whole_out, whole_lse = _fresh_acc(q)
    _bf(cfg, q, k, v, whole_out, whole_lse, 0, 0, kpm)
    r_out, r_lse, *_ = run_oracle(cfg, q, k, v, go, kpm)
    close(whole_out, r_out, tol, "whole out", ctx)
    close(whole_lse, r_lse, tol, "whole lse", ctx)

    for parts in (2, 3, 4):
        # keys split into blocks, merged in a random order
        out, lse = _fresh_acc(q)
        blocks = _splits(n, parts, rng)
        rng.shuffle(blocks)
        for a, b in blocks:
            _bf(
                cfg,
                q,
                k[:, a:b].contiguous(),
                v[:, a:b].contiguous(),
                out,
                lse,
                0,
                a,
                _kslice(kpm, a, b),
            )
        close(out, whole_out, tol, "key-split out", f"{ctx} blocks={blocks}")
        close(lse, whole_lse, tol, "key-split lse", f"{ctx} blocks={blocks}")

        # queries split into blocks
        qblocks = _splits(n, parts, rng)
        for a, b in qblocks:
            out, lse = _fresh_acc(q, b - a)
            _bf(cfg, q[:, a:b].contiguous(), k, v, out, lse, a, 0, kpm)
            close(out, whole_out[:, a:b], tol, "query-split out", f"{ctx} q=[{a},{b})")
            close(lse, whole_lse[:, :, a:b], tol, "query-split lse", f"{ctx} q=[{a},{b})")

        # both (what a ring rank does)
        for qa, qb in qblocks:
            out, lse = _fresh_acc(q, qb - qa)
            for a, b in blocks:
                _bf(
                    cfg,
                    q[:, qa:qb].contiguous(),
                    k[:, a:b].contiguous(),
                    v[:, a:b].contiguous(),
                    out,
                    lse,
                    qa,
                    a,
                    _kslice(kpm, a, b),
                )
            close(out, whole_out[:, qa:qb], tol, "2-D split out", f"{ctx} q=[{qa},{qb}) k={blocks}")
            close(
                lse, whole_lse[:, :, qa:qb], tol, "2-D split lse", f"{ctx} q=[{qa},{qb}) k={blocks}"
            )


@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
@pytest.mark.parametrize("mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_block_backward_split_equals_whole(device, case, causal, mask, dtype) -> None:
    seed = 200 + len(case) + 2 * causal + mask
    cfg, q, k, v, go, kpm = _block_setup(device, case, causal, dtype, mask, seed)
    rng = random.Random(seed)
    n = cfg.n
    tol = GRAD_TOL[dtype]
    ctx = f"{case} causal={causal} mask={mask} {dtype}"
    acc = acc_dtype(dtype)

    out_acc, lse = _fresh_acc(q)
    _bf(cfg, q, k, v, out_acc, lse, 0, 0, kpm)
    out = out_acc.to(dtype)

    def zeros(length: int) -> torch.Tensor:
        return torch.zeros(cfg.batch, length, cfg.heads, cfg.head_dim, dtype=acc, device=device)

    dq, dk, dv = zeros(n), zeros(n), zeros(n)
    _bb(cfg, go, q, k, v, out, lse, dq, dk, dv, 0, 0, kpm)
    _, _, r_dq, r_dk, r_dv = run_oracle(cfg, q, k, v, go, kpm)
    close(dq, r_dq, tol, "whole dq", ctx)
    close(dk, r_dk, tol, "whole dk", ctx)
    close(dv, r_dv, tol, "whole dv", ctx)

    for parts in (2, 3, 4):
        blocks = _splits(n, parts, rng)
        qblocks = _splits(n, parts, rng)
        # key blocks: dq accumulates over blocks, dk/dv per block
        sdq = zeros(n)
        for a, b in blocks:
            bdk, bdv = zeros(b - a), zeros(b - a)
            kb, vb = k[:, a:b].contiguous(), v[:, a:b].contiguous()
            _bb(cfg, go, q, kb, vb, out, lse, sdq, bdk, bdv, 0, a, _kslice(kpm, a, b))
            close(bdk, dk[:, a:b], tol, "key-split dk", f"{ctx} k=[{a},{b})")
            close(bdv, dv[:, a:b], tol, "key-split dv", f"{ctx} k=[{a},{b})")
        close(sdq, dq, tol, "key-split dq", f"{ctx} blocks={blocks}")

        # query blocks: dk/dv accumulate over blocks, dq per block
        sdk, sdv = zeros(n), zeros(n)
        for a, b in qblocks:
            bdq = zeros(b - a)
            sl = slice(a, b)
            _bb(
                cfg,
                go[:, sl].contiguous(),
                q[:, sl].contiguous(),
                k,
                v,
                out[:, sl].contiguous(),
                lse[:, :, sl].contiguous(),
                bdq,
                sdk,
                sdv,
                a,
                0,
                kpm,
            )
            close(bdq, dq[:, sl], tol, "query-split dq", f"{ctx} q=[{a},{b})")
        close(sdk, dk, tol, "query-split dk", f"{ctx} q={qblocks}")
        close(sdv, dv, tol, "query-split dv", f"{ctx} q={qblocks}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_block_backward_computes_only_the_gradients_asked_for(device, case, causal) -> None:
    """dq alone, or dk with dv alone, equal those of a call that asks for all three."""
    cfg, q, k, v, go, kpm = _block_setup(device, case, causal, F64, True, seed=230 + causal)
    out_acc, lse = _fresh_acc(q)
    _bf(cfg, q, k, v, out_acc, lse, 0, 0, kpm)
    grads = [torch.zeros(q.shape, dtype=F64, device=device) for _ in range(3)]
    _bb(cfg, go, q, k, v, out_acc, lse, *grads, 0, 0, kpm)
    dq = torch.zeros_like(grads[0])
    _bb(cfg, go, q, k, v, out_acc, lse, dq, None, None, 0, 0, kpm)
    dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
    _bb(cfg, go, q, k, v, out_acc, lse, None, dk, dv, 0, 0, kpm)
    for name, got, want in zip("q k v".split(), (dq, dk, dv), grads, strict=True):
        close(got, want, 0.0, f"d{name}", f"{case} causal={causal}")
    assert grads[0].abs().sum() > 0 and grads[1].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_low_precision_long_sequence_by_chunks(device, dtype, causal) -> None:
    """Past 1024 rows fp16/bf16 accumulate chunk by chunk (fp32 per chunk of rows);
    chunk edges cut segments and still match the oracle, forward and backward."""
    cfg = Cfg(2, 2600, 3, 16, [300, 2048], [1, 4], causal, True, None, True)
    check_against_oracle(cfg, dtype, device, seed=240 + causal)


def test_block_forward_empty_key_block_is_noop(device) -> None:
    cfg = Cfg(1, 12, 2, 8, [4, 8], [1, 2], True)
    q, k, v, _, _ = make_inputs(cfg, torch.float32, device, seed=23)
    out, lse = _fresh_acc(q)
    _bf(cfg, q, k, v, out, lse, 0, 0, None)
    out0, lse0 = out.clone(), lse.clone()
    _bf(cfg, q, k[:, :0], v[:, :0], out, lse, 0, 12, None)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


# Query block, key block and pattern of the "never reads unreached rows" tests:
# queries [qa, qb), keys [ka, kb) with qa >= kb (an earlier rank's keys) or
# overlapping, so only some key rows of the block are reached.
UNREACHED_CASES = [
    # (segment_lengths, dilation_rates, causal, head_groups, (qa, qb), (ka, kb))
    ([16, 32, 64], [2, 4, 8], False, False, (24, 40), (0, 24)),
    ([16, 32, 64], [2, 4, 8], True, False, (24, 40), (8, 30)),
    ([12, 40], [3, 5], True, True, (20, 37), (10, 32)),
    ([64], [4], True, False, (30, 44), (0, 30)),
    ([10, 20], [1, 2], False, False, (0, 15), (15, 45)),
]


def _reached_rows(cfg: Cfg, qr: tuple[int, int], kr: tuple[int, int]) -> torch.Tensor:
    """Bool (Lk, H): key row u (relative) is reached by some query of qr for head h."""
    m = multiplicity(
        cfg.n, cfg.heads, cfg.segment_lengths, cfg.dilation_rates, cfg.causal, cfg.head_groups
    )
    return (m[:, qr[0] : qr[1], kr[0] : kr[1]] > 0).any(dim=1).T


@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
@pytest.mark.parametrize("case", range(len(UNREACHED_CASES)))
def test_block_ops_never_read_unreached_rows(device, case, dtype) -> None:
    ws, rs, causal, hg, (qa, qb), (ka, kb) = UNREACHED_CASES[case]
    cfg = Cfg(2, 48, 5, 8, ws, rs, causal, hg, 0.3)
    q, k, v, go, _ = make_inputs(cfg, dtype, device, seed=300 + case)
    reached = _reached_rows(cfg, (qa, qb), (ka, kb)).to(device)
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
        out, lse = _fresh_acc(q, qb - qa)
        _bf(cfg, qb_, kk, vv, out, lse, qa, ka, None)
        res.append((out, lse))
    (out_c, lse_c), (out_n, lse_n) = res
    assert torch.isfinite(out_n).all(), f"NaN read from an unreached row: {ctx}"
    assert not torch.isnan(lse_n).any(), f"NaN read from an unreached row: {ctx}"
    close(out_n, out_c, 0.0, "out", ctx)
    close(lse_n, lse_c, 0.0, "lse", ctx)

    # backward (a ring backward reuses the same receive buffers): dq and the
    # gradient of every reached row are unaffected by garbage in the others.
    # Use the final out/lse of the whole sequence, as a ring does.
    whole_out, whole_lse = _fresh_acc(q)
    _bf(cfg, q, k, v, whole_out, whole_lse, 0, 0, None)
    out_f = whole_out[:, qa:qb].to(dtype).contiguous()
    lse_f = whole_lse[:, :, qa:qb].contiguous()
    go_b = go[:, qa:qb].contiguous()
    grads = []
    for kk, vv in ((kc, vc), (kn, vn)):
        acc = acc_dtype(dtype)
        dq = torch.zeros(qb_.shape, dtype=acc, device=device)
        dk = torch.zeros(kk.shape, dtype=acc, device=device)
        dv = torch.zeros(kk.shape, dtype=acc, device=device)
        _bb(cfg, go_b, qb_, kk, vv, out_f, lse_f, dq, dk, dv, qa, ka, None)
        grads.append((dq, dk, dv))
    (dq_c, dk_c, dv_c), (dq_n, dk_n, dv_n) = grads
    assert torch.isfinite(dq_n).all(), f"backward read NaN from an unreached row: {ctx}"
    close(dq_n, dq_c, 0.0, "dq", ctx)
    close(dk_n[:, reached], dk_c[:, reached], 0.0, "dk (reached rows)", ctx)
    close(dv_n[:, reached], dv_c[:, reached], 0.0, "dv (reached rows)", ctx)


# ---------------------------------------------------------- opcheck and gradcheck


def _op_args(dtype: torch.dtype, mask: bool, device: str, requires_grad: bool):
    cfg = Cfg(2, 11, 3, 4, [4, 8], [2, 2], True, False, 0.5, mask)
    q, k, v, go, kpm = make_inputs(cfg, dtype, device, seed=24)
    if mask:  # make sure some rows of the mask are set
        kpm = kpm.clone()
        kpm[0, 3] = True
    if requires_grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    pattern = (cfg.segment_lengths, cfg.dilation_rates, cfg.causal, 0.5, cfg.head_groups, kpm)
    return cfg, q, k, v, go, pattern


OPCHECK_PARAMS = [
    pytest.param(F64, False, id="f64"),
    pytest.param(torch.float32, False, id="f32"),
    pytest.param(F64, True, id="f64-mask"),
    pytest.param(torch.float32, True, id="f32-mask"),
]


@pytest.mark.parametrize(("dtype", "mask"), OPCHECK_PARAMS)
def test_opcheck_dilated_attention(device, dtype, mask) -> None:
    _, q, k, v, _, pattern = _op_args(dtype, mask, device, requires_grad=True)
    torch.library.opcheck(OPS.dilated_attention.default, (q, k, v, *pattern))


@pytest.mark.parametrize(("dtype", "mask"), OPCHECK_PARAMS)
def test_opcheck_dilated_attention_backward(device, dtype, mask) -> None:
    _, q, k, v, go, pattern = _op_args(dtype, mask, device, requires_grad=False)
    out, lse = OPS.dilated_attention(q, k, v, *pattern)
    torch.library.opcheck(OPS.dilated_attention_backward.default, (go, q, k, v, out, lse, *pattern))


@pytest.mark.parametrize(("dtype", "mask"), OPCHECK_PARAMS)
def test_opcheck_block_forward(device, dtype, mask) -> None:
    _, q, k, v, _, pattern = _op_args(dtype, mask, device, requires_grad=False)
    out, lse = _fresh_acc(q, 5)
    segs, dils, causal, scale, hg, kpm = pattern
    kpm = _kslice(kpm, 2, 9)
    args = (q[:, 4:9].contiguous(), k[:, 2:9].contiguous(), v[:, 2:9].contiguous(), out, lse, 4, 2)
    torch.library.opcheck(OPS.block_forward.default, (*args, segs, dils, causal, scale, hg, kpm))


@pytest.mark.parametrize(("dtype", "mask"), OPCHECK_PARAMS)
def test_opcheck_block_backward(device, dtype, mask) -> None:
    _, q, k, v, go, pattern = _op_args(dtype, mask, device, requires_grad=False)
    out, lse = OPS.dilated_attention(q, k, v, *pattern)
    segs, dils, causal, scale, hg, kpm = pattern
    acc = acc_dtype(dtype)
    dq = torch.zeros(2, 5, 3, 4, dtype=acc, device=device)
    dk = torch.zeros(2, 7, 3, 4, dtype=acc, device=device)
    dv = torch.zeros(2, 7, 3, 4, dtype=acc, device=device)
    args = (
        go[:, 4:9].contiguous(),
        q[:, 4:9].contiguous(),
        k[:, 2:9].contiguous(),
        v[:, 2:9].contiguous(),
        out[:, 4:9].contiguous(),
        lse[:, :, 4:9].contiguous(),
        dq,
        dk,
        dv,
        4,
        2,
    )
    torch.library.opcheck(
        OPS.block_backward.default, (*args, segs, dils, causal, scale, hg, _kslice(kpm, 2, 9))
    )


@pytest.mark.parametrize(
    ("causal", "mask", "head_groups"),
    [(False, False, False), (True, False, False), (True, True, False), (False, True, True)],
    ids=["full", "causal", "causal-mask", "mask-groups"],
)
def test_gradcheck(device, causal, mask, head_groups) -> None:
    cfg = Cfg(2, 10, 3, 4, [4, 8, 3], [2, 2, 3], causal, head_groups, None, mask)
    q, k, v, _, kpm = make_inputs(cfg, F64, device, seed=25)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def fn(q, k, v):
        return ra.dilated_attention(
            q, k, v, cfg.segment_lengths, cfg.dilation_rates, key_padding_mask=kpm, **cfg.kwargs()
        )

    assert torch.autograd.gradcheck(fn, (q, k, v))
