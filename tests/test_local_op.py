"""The local operator against the float64 oracle, forward and backward.

``ra.dilated_attention`` (the public wrapper) and
``torch.ops.ring_attention.dilated_attention`` called directly (its C++
autograd: grouped K/V heads, documents, grouped offsets, gradients through
lse, the double-backward error) on every device of the ``device`` fixture
(CPU, and CUDA when a GPU is present). Tolerances: tests/op_helpers.py.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from op_helpers import (
    F64,
    OPS,
    OUT_TOL,
    Cfg,
    check_against_oracle,
    check_results,
    close,
    lse_grad,
    make_inputs,
    run_local,
    run_op,
    run_oracle,
    sdpa,
)
from oracle import multiplicity

import ring_attention as ra

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


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_pattern_equals_sdpa(device, causal, dtype) -> None:
    cfg = Cfg(2, 50, 3, 16, [50], [1], causal)
    q, k, v, _, _ = make_inputs(cfg, dtype, device, seed=15)
    tol = OUT_TOL[dtype]
    for w in (50, 64, 1000):  # any w >= n is dense
        out = ra.dilated_attention(q, k, v, [w], [1], causal=causal)
        close(out, sdpa(q.double(), k.double(), v.double(), is_causal=causal), tol, "out", f"w={w}")


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
    close(out, sdpa(q, k, v, attn_mask=mask), 1e-10, "out", "local")


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


CHUNK_ENV = "RING_ATTENTION_CHUNK_MIB"


# Each dtype and each causal mode once, not every pair: both dtypes chunk alike
# (fp32 accumulators), and causality changes which keys a chunk's queries
# reach whatever the dtype.
@pytest.mark.parametrize(
    ("dtype", "causal"),
    [(torch.float16, False), (torch.bfloat16, True)],
    ids=["full-fp16", "causal-bf16"],
)
def test_low_precision_long_sequence_by_chunks(device, dtype, causal, monkeypatch) -> None:
    """Past 1024 rows fp16/bf16 accumulate chunk by chunk (fp32 per chunk of rows;
    no budget: the 8-chunk rule alone); chunk edges cut segments and still match
    the oracle, forward and backward."""
    monkeypatch.setenv(CHUNK_ENV, "0")
    cfg = Cfg(2, 2600, 3, 16, [300, 2048], [1, 4], causal, True, None, True)
    check_against_oracle(cfg, dtype, device, seed=240 + causal)


def block_op_calls(cfg: Cfg, dtype: torch.dtype, device: str, seed: int) -> tuple[int, int]:
    """The local op's block kernel calls, forward and backward (profiler
    events ring_attention::local_forward_block / ..._backward_block: one a
    chunk; the backward two a chunk where chunks cut segments) in a forward
    and backward checked against the oracle."""
    q, k, v, go, mask = make_inputs(cfg, dtype, device, seed)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = run_local(cfg, q, k, v, go, mask)
    check_results(cfg, dtype, got, run_oracle(cfg, q, k, v, go, mask), f"seed={seed} {cfg}")
    calls = {e.key: e.count for e in prof.key_averages()}
    return (
        calls.get("ring_attention::local_forward_block", 0),
        calls.get("ring_attention::local_backward_block", 0),
    )


NO_BUDGET_CALLS = (3, 6)  # 8 chunks of at least 1024 rows: 1024, 1024, 252


@pytest.mark.parametrize(
    ("budget", "calls"),
    [
        ("1024", (1, 1)),  # the default: one chunk, the backward in one pass
        ("0", NO_BUDGET_CALLS),  # no budget: the 8-chunk rule alone
        # forward 512 bytes a row: 2048 rows (a whole longest segment); the
        # backward's 1536 bytes a row: 682 rows, less than the 1024 rows of the
        # 8-chunk rule, so dq by 3 chunks of queries, then dk, dv by 3 of keys
        ("1", (2, 6)),
        (None, None),  # the device's default
    ],
    ids=["1GiB", "no-budget", "1MiB", "default"],
)
def test_chunks_follow_the_accumulator_budget(device, budget, calls, monkeypatch) -> None:
    """fp16/bf16 chunks are as long as RING_ATTENTION_CHUNK_MIB of fp32
    accumulators allows (default 1 GiB on every device), never shorter than
    8 chunks give."""
    if budget is None:
        monkeypatch.delenv(CHUNK_ENV, raising=False)
        calls = (1, 1)
    else:
        monkeypatch.setenv(CHUNK_ENV, budget)
    cfg = Cfg(1, 2300, 2, 64, [300, 2048], [1, 4], True, False, None, True)
    assert block_op_calls(cfg, torch.bfloat16, device, 250) == calls


@pytest.mark.parametrize("value", ["-1", "1.5", "lots", "1099511627777"])
def test_bad_chunk_budget_is_refused(device, value, monkeypatch) -> None:
    monkeypatch.setenv(CHUNK_ENV, value)
    cfg = Cfg(1, 40, 2, 16, [8, 16], [1, 2], False)
    q, k, v, go, mask = make_inputs(cfg, torch.bfloat16, device, 260)
    with pytest.raises(ValueError, match=f"{CHUNK_ENV} must be a whole number of MiB.*'{value}'"):
        run_local(cfg, q, k, v, go, mask)


# ------------------------------------------- grouped K/V heads, documents, grouped offsets


def random_documents(n: int, rng: random.Random) -> list[int]:
    """cu_seqlens [0, ..., n] with empty and length-1 documents among others."""
    bounds = [0]
    while bounds[-1] < n:
        kind = rng.random()
        if kind < 0.1:
            length = 0  # empty document
        elif kind < 0.25:
            length = 1
        elif kind < 0.7:
            length = rng.randint(2, 12)  # shorter than most segments
        else:
            length = rng.randint(13, 80)
        bounds.append(min(n, bounds[-1] + length))
    if rng.random() < 0.3:
        bounds.append(n)  # a trailing empty document
    return bounds


def random_feature_cfg(seed: int) -> Cfg:
    """A random configuration using grouped K/V heads, documents and grouped
    offsets (each with some probability)."""
    rng = random.Random(seed)
    n = rng.randint(1, 160)
    branches = rng.randint(1, 4)
    ws = [rng.randint(1, 48) for _ in range(branches)]
    rs = [rng.randint(1, min(w, 6)) for w in ws]
    heads = rng.choice([1, 2, 3, 4, 6, 8])
    kv_heads = rng.choice([h for h in (1, 2, heads) if heads % h == 0])
    return Cfg(
        batch=rng.randint(1, 2),
        n=n,
        heads=heads,
        head_dim=rng.choice([4, 8, 16]),
        segment_lengths=ws,
        dilation_rates=rs,
        causal=rng.random() < 0.5,
        head_groups=heads >= branches and rng.random() < 0.4,
        scale=None if rng.random() < 0.7 else rng.uniform(0.05, 1.0),
        mask=rng.random() < 0.3,
        kv_heads=kv_heads,
        grouped_offsets=rng.random() < 0.4,
        cu_seqlens=random_documents(n, rng) if rng.random() < 0.7 else None,
    )


def check_local_op(cfg: Cfg, dtype: torch.dtype, device: str, seed: int, with_lse_grad: bool):
    """The local op's out, lse and gradients (through lse too when asked) against the oracle."""
    q, k, v, go, mask = make_inputs(cfg, dtype, device, seed)
    glse = lse_grad(cfg, device, seed + 1) if with_lse_grad else None
    got = run_local(cfg, q, k, v, go, mask, glse)
    want = run_oracle(cfg, q, k, v, go, mask, glse)
    ctx = f"seed={seed} dtype={dtype} device={device} lse_grad={with_lse_grad} {cfg}"
    check_results(cfg, dtype, got, want, ctx)


@pytest.mark.parametrize("seed", range(40))
def test_random_features_float64(device, seed) -> None:
    """Random patterns with kv_heads, documents (empty, length 1, shorter than a
    segment), grouped offsets, head groups, masks, gradients through lse."""
    cfg = random_feature_cfg(5000 + seed)
    check_local_op(cfg, F64, device, 5000 + seed, with_lse_grad=seed % 2 == 0)


@pytest.mark.parametrize("head_groups", [False, True], ids=["shared", "groups"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [1, 2, 6], ids=["mqa", "gqa", "mha"])
def test_grouped_kv_heads(device, kv_heads, causal, head_groups) -> None:
    cfg = Cfg(2, 70, 6, 8, [8, 16, 64], [1, 2, 4], causal, head_groups, None, True, kv_heads)
    check_local_op(cfg, F64, device, 5100 + kv_heads + 10 * causal, with_lse_grad=True)


@pytest.mark.parametrize("grouped", [False, True], ids=["h_mod_r", "grouped"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_offsets(device, causal, grouped) -> None:
    # 7 heads, r = 3: grouped offsets 0,0,0,1,1,1,2 (ceil(7/3) = 3) against h mod 3.
    cfg = Cfg(1, 50, 7, 8, [12, 24], [3, 2], causal, False, None, False, 7, grouped)
    check_local_op(cfg, F64, device, 5200 + causal, with_lse_grad=False)


def test_grouped_offsets_change_the_result(device) -> None:
    """The flag is not ignored: grouped and h mod r offsets differ for heads = 4, r = 2."""
    cfg = Cfg(1, 24, 4, 8, [8], [2])
    q, k, v, _, _ = make_inputs(cfg, F64, device, seed=5210)
    a, _ = OPS.dilated_attention(q, k, v, *cfg.pattern(None, device))
    cfg.grouped_offsets = True
    b, _ = OPS.dilated_attention(q, k, v, *cfg.pattern(None, device))
    assert torch.equal(a[:, :, 0], b[:, :, 0])  # head 0: offset 0 both ways
    assert not torch.equal(a[:, :, 1], b[:, :, 1])  # head 1: offset 1 vs 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_documents_are_independent_calls(device, causal) -> None:
    """A packed call equals one call per document, concatenated (forward and backward)."""
    bounds = [0, 5, 5, 6, 40, 41, 75, 75]
    cfg = Cfg(2, 75, 4, 8, [8, 32], [1, 2], causal, False, None, False, 2, False, bounds)
    q, k, v, go, _ = make_inputs(cfg, F64, device, seed=5300 + causal)
    glse = lse_grad(cfg, device, seed=5301)
    packed = run_local(cfg, q, k, v, go, None, glse)
    single = Cfg(**{**cfg.__dict__, "cu_seqlens": None})
    for a, b in itertools.pairwise(bounds):
        if a == b:
            continue
        part = Cfg(**{**single.__dict__, "n": b - a})
        sl = slice(a, b)
        parts = run_local(part, q[:, sl], k[:, sl], v[:, sl], go[:, sl], None, glse[:, :, sl])
        ctx = f"document [{a}, {b})"
        for name, x, y in zip(
            ("out", "dq", "dk", "dv"), packed[:1] + packed[2:], parts[:1] + parts[2:], strict=True
        ):
            close(x[:, sl], y, 1e-12, name, ctx)
        close(packed[1][:, :, sl], parts[1], 1e-12, "lse", ctx)


def test_one_document_equals_plain(device) -> None:
    """cu_seqlens = [0, n] gives bitwise the plain op's results; int64 bounds as int32."""
    cfg = Cfg(2, 57, 4, 8, [8, 16, 32], [1, 2, 4], True, False, None, True, 2)
    q, k, v, go, mask = make_inputs(cfg, torch.float32, device, seed=5400)
    glse = lse_grad(cfg, device, seed=5401)
    plain = run_local(cfg, q, k, v, go, mask, glse)
    cfg.cu_seqlens = [0, 57]
    packed = run_local(cfg, q, k, v, go, mask, glse)
    for a, b in zip(plain, packed, strict=True):
        assert torch.equal(a, b)
    cu64 = torch.tensor([0, 20, 20, 57], dtype=torch.int64, device=device)
    cfg.cu_seqlens = [0, 20, 20, 57]
    pattern = list(cfg.pattern(mask, device))
    a = OPS.dilated_attention(q, k, v, *pattern)
    pattern[7] = cu64  # cu_seqlens
    b = OPS.dilated_attention(q, k, v, *pattern)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_many_documents(device) -> None:
    """300 documents of 1..12 tokens in one call."""
    rng = random.Random(5500)
    bounds = [0]
    while bounds[-1] < 1500:
        bounds.append(min(1500, bounds[-1] + rng.randint(1, 12)))
    assert len(bounds) > 200
    cfg = Cfg(1, 1500, 2, 8, [4, 8, 16], [1, 2, 4], True, False, None, False, 1, False, bounds)
    check_local_op(cfg, F64, device, 5501, with_lse_grad=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_features_low_precision(device, dtype) -> None:
    """fp16/bf16 with grouped K/V heads, documents, grouped offsets and an lse gradient."""
    cfg = Cfg(2, 90, 6, 32, [16, 64], [2, 4], True, False, None, True, 2, True)
    cfg.cu_seqlens = [0, 1, 30, 30, 77, 90]
    check_local_op(cfg, dtype, device, 5600, with_lse_grad=True)


def test_low_precision_chunks_with_features(device, monkeypatch) -> None:
    """Past 1024 rows fp16 accumulates chunk by chunk (the 8-chunk rule alone);
    chunk edges cut documents."""
    monkeypatch.setenv(CHUNK_ENV, "0")
    rng = random.Random(5700)
    cfg = Cfg(1, 2300, 4, 16, [300, 2048], [1, 4], True, True, None, True, 2)
    cfg.cu_seqlens = random_documents(2300, rng)
    check_local_op(cfg, torch.float16, device, 5701, with_lse_grad=True)


THREAD_CFGS = {
    # many (batch, head set, segment) tasks: causal LongNet, GQA, documents, lse
    "longnet-gqa-documents": Cfg(
        2,
        150,
        6,
        32,
        [16, 48, 150],
        [1, 2, 3],
        causal=True,
        kv_heads=2,
        cu_seqlens=[0, 40, 41, 97, 150],
    ),
    # head groups, a key padding mask, a sliding window
    "groups-mask-window": Cfg(
        2, 130, 5, 16, [32, 130], [1, 2], head_groups=True, mask=True, window=(20, 9)
    ),
}


@pytest.mark.parametrize("cfg", list(THREAD_CFGS))
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16], ids=str)
def test_results_do_not_depend_on_the_thread_count(dtype, cfg) -> None:
    """The suite runs on one intra-op thread (tests/conftest.py); the CPU
    kernels split their tasks (each owning the rows it writes) over threads:
    2 and 3 threads give bitwise the one-thread results, which match the oracle."""
    c = THREAD_CFGS[cfg]
    q, k, v, go, mask = make_inputs(c, dtype, "cpu", seed=5900)
    glse = lse_grad(c, "cpu", seed=5901)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(run_local(c, q, k, v, go, mask, glse))
    finally:
        torch.set_num_threads(threads)
    check_results(c, dtype, results[0], run_oracle(c, q, k, v, go, mask, glse), f"{cfg} {dtype}")
    for n, other in zip((2, 3), results[1:], strict=True):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[0], other, strict=True):
            assert torch.equal(a, b), f"{cfg} {dtype}: {name} differs on {n} threads"


# ------------------------------------------------------------------- double backward


def test_double_backward_raises(device) -> None:
    cfg = Cfg(1, 12, 2, 4, [4, 8], [1, 2], True)
    q, k, v, _, _ = make_inputs(cfg, F64, device, seed=5800)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = OPS.dilated_attention(q, k, v, *cfg.pattern(None, device))
    (g,) = torch.autograd.grad(out.sum() + lse.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(g.sum(), k)


def test_create_graph_without_second_backward_works(device) -> None:
    """create_graph=True alone gives the plain gradients."""
    cfg = Cfg(1, 12, 2, 4, [4, 8], [1, 2], True)
    q, k, v, go, _ = make_inputs(cfg, F64, device, seed=5801)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, _ = OPS.dilated_attention(q, k, v, *cfg.pattern(None, device))
    with_graph = torch.autograd.grad(out, (q, k, v), go, create_graph=True)
    out, _ = OPS.dilated_attention(q, k, v, *cfg.pattern(None, device))
    plain = torch.autograd.grad(out, (q, k, v), go)
    for a, b in zip(with_graph, plain, strict=True):
        assert torch.equal(a.detach(), b)
