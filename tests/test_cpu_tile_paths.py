"""The CPU kernels' GEMM paths (csrc/cpu/tile_math.h ``bf16_tiles``,
csrc/cpu/packed_tiles.h ``packed_tiles``, ``packed_tiles_fp32``,
csrc/cpu/split_products.h ``split_tiles_fp32``).

bf16: where the BLAS has a bf16 GEMM (MKL's) and the CPU has bf16 dot
products (avx512_bf16), the kernels multiply bf16 tiles as they are: Q, K, V
and dO read in place, P and dS rounded to bf16 for their products, fp32
accumulation; K/V tiles are packed once for oneDNN's brgemm (even head dims;
on AMX or on avx512_bf16's dot products) unless
``RING_ATTENTION_CPU_BF16_GEMM=mkl`` or oneDNN is off (``torch.backends.mkldnn``).
Elsewhere, or with ``RING_ATTENTION_CPU_BF16_GEMM=0``, every tile is
converted to fp32 first. fp32: on CPUs with AVX-512 K/V tiles are copied once
(K transposed) for brgemm's fp32 kernels unless
``RING_ATTENTION_CPU_FP32_PACK=0`` (sgemm on the tiles in place); where the
CPU also has AMX (and the head dim is even) the score products (S, and dP in
the backward) take each fp32 operand as three bf16 parts, unless
``RING_ATTENTION_CPU_FP32_PACK=fp32``.

Each path is checked against the float64 oracle, forward and backward (lse
gradients, grouped K/V heads, documents, several key tiles per run, causal
tiles that use part of a packed key tile, NaN V rows; for bf16 also chunked
accumulation and the block operators at offsets), and the bf16 switch is
checked to take effect exactly where the machine has the native path.
"""

from __future__ import annotations

import platform

import pytest
import torch
from op_helpers import (
    LSE_TOL,
    OUT_TOL,
    Cfg,
    block_backward,
    block_forward,
    check_against_oracle,
    check_results,
    close,
    fresh_acc,
    lse_grad,
    make_inputs,
    run_local,
    run_oracle,
)

import ring_attention as ra

BF16, F32 = torch.bfloat16, torch.float32
ENV = "RING_ATTENTION_CPU_BF16_GEMM"
FP32_ENV = "RING_ATTENTION_CPU_FP32_PACK"
CHUNK_ENV = "RING_ATTENTION_CHUNK_MIB"  # the local op's fp32 chunks (test_local_op.py)
PATHS = {  # name: (dtype, environment; None: unset)
    "bf16-native": (BF16, {ENV: None}),
    "bf16-mkl": (BF16, {ENV: "mkl"}),
    "bf16-converted": (BF16, {ENV: "0"}),
    "fp32-split": (F32, {FP32_ENV: None}),
    "fp32-packed": (F32, {FP32_ENV: "fp32"}),
    "fp32-sgemm": (F32, {FP32_ENV: "0"}),
}


def _cpu_flags() -> list[str]:
    if platform.machine() != "x86_64":
        return []
    with open("/proc/cpuinfo") as f:
        return next((line for line in f if line.startswith("flags")), "").split()


def native_bf16_expected() -> bool:
    """What bf16_tiles() decides on this machine (env unset)."""
    return torch.backends.mkl.is_available() and "avx512_bf16" in _cpu_flags()


def split_fp32_expected() -> bool:
    """What split_tiles_fp32() decides on this machine (env unset, even head dim)."""
    return {"amx_bf16", "amx_tile", "avx512f"} <= set(_cpu_flags())


def _use(name: str, monkeypatch: pytest.MonkeyPatch) -> torch.dtype:
    dtype, env = PATHS[name]
    for var, value in env.items():
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    return dtype


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.dtype:
    """Runs the test on one GEMM path; returns its dtype."""
    return _use(request.param, monkeypatch)


@pytest.fixture(params=[name for name in PATHS if name.startswith("bf16")])
def bf16_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test on one of the bf16 paths."""
    _use(request.param, monkeypatch)
    return request.param


@pytest.mark.parametrize("head_dim", [64, 33])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_oracle(path, causal, head_dim) -> None:
    cfg = Cfg(2, 150, 3, head_dim, [16, 64, 128], [1, 2, 4], causal, False, None, True)
    check_against_oracle(cfg, path, "cpu", seed=7100 + causal)


def test_features_with_lse_gradient(path) -> None:
    """Grouped K/V heads, documents, grouped offsets, head groups, a key padding
    mask and a gradient through lse."""
    cfg = Cfg(2, 140, 8, 32, [16, 64], [2, 4], True, True, None, True, 2, True)
    cfg.cu_seqlens = [0, 1, 40, 40, 97, 140]
    q, k, v, go, mask = make_inputs(cfg, path, "cpu", 7200)
    glse = lse_grad(cfg, "cpu", 7201)
    got = run_local(cfg, q, k, v, go, mask, glse)
    want = run_oracle(cfg, q, k, v, go, mask, glse)
    check_results(cfg, path, got, want, f"{path} {cfg}")


def test_long_sequence_by_chunks(bf16_path, monkeypatch) -> None:
    """Past 1024 rows bf16 accumulates chunk by chunk (the 8-chunk rule alone)."""
    monkeypatch.setenv(CHUNK_ENV, "0")
    cfg = Cfg(1, 2300, 2, 64, [300, 2048], [1, 4], True, True, None, True)
    check_against_oracle(cfg, BF16, "cpu", seed=7300)


@pytest.mark.parametrize("documents", [False, True], ids=["closed", "documents"])
def test_chunks_of_whole_segments(bf16_path, documents: bool, monkeypatch) -> None:
    """Chunks of 1024 rows (the 8-chunk rule alone) hold whole segments of both
    branches: without documents the backward computes dq, dk and dv in one
    pass a chunk; with documents (whose segments start at their own
    boundaries) in two. A key padding mask, head groups, causal rows and a
    gradient through lse."""
    monkeypatch.setenv(CHUNK_ENV, "0")
    cfg = Cfg(1, 2300, 3, 64, [256, 1024], [1, 2], True, True, None, True)
    if documents:
        cfg.cu_seqlens = [0, 700, 1900, 2300]
    q, k, v, go, mask = make_inputs(cfg, BF16, "cpu", 7350 + documents)
    glse = lse_grad(cfg, "cpu", 7360 + documents)
    got = run_local(cfg, q, k, v, go, mask, glse)
    want = run_oracle(cfg, q, k, v, go, mask, glse)
    check_results(cfg, BF16, got, want, f"{bf16_path} {cfg}")


@pytest.mark.parametrize("head_dim", [128, 40])
def test_long_key_runs_in_several_tiles(path, head_dim: int, monkeypatch) -> None:
    """Key runs of 2601 and 1300-1301 keys: several key tiles and chunks of them, odd last tiles
    (packed in row pairs with a zero pad), causal query tiles that reach part
    of a tile, more key tiles than a thread keeps packed (4 at head dim 128),
    and a NaN in a V row that only later queries reach, or, masked, none (in
    a tile packed again for each query tile at head dim 128; head dim 40
    packs too; only odd head dims take MKL's GEMM)."""
    # The backward's chunks of 4 key tiles (bf16, the 8-chunk rule alone:
    # 1024, 1024, 553 keys), with 3 query heads stacked on one K/V head (dQ
    # summed over a chunk in a buffer) and with one head per tile (dQ in place).
    monkeypatch.setenv(CHUNK_ENV, "0")
    for causal, kv_heads in ((True, 1), (False, None)):
        cfg = Cfg(1, 2601, 3, head_dim, [2601], [1], causal, False, None, False, kv_heads)
        check_against_oracle(cfg, path, "cpu", seed=7350 + causal)
    # A NaN in the V row of key u: causal, in the second key tile of the run
    # of odd positions (dilation 2), where it reaches the later queries only;
    # and masked, in the fifth key tile of a dense run, which at head dim 128
    # is past the tiles a thread keeps and is packed again for every query
    # tile: it reaches no row.
    u = 2201
    for r, causal in ((2, True), (1, False)):
        cfg = Cfg(1, 2601, 2, head_dim, [2601], [r], causal, False, None, False)
        q, k, v, go, _ = make_inputs(cfg, path, "cpu", 7351)
        mask = None
        if not causal:
            mask = torch.zeros(1, cfg.n, dtype=torch.bool)
            mask[:, u] = True
        v_bad = v.clone()
        v_bad[:, u] = float("nan")
        got = run_local(cfg, q, k, v_bad, go, mask, None)
        want = run_oracle(cfg, q, k, v, go, mask)
        early = slice(0, u) if causal else slice(None)  # rows that never reach key u
        tol = 2e-2 if path == BF16 else 1e-4
        torch.testing.assert_close(
            got[0][:, early].double(), want[0][:, early].double(), atol=tol, rtol=tol
        )
        if causal:
            assert torch.isnan(got[0][:, u:]).any()


@pytest.mark.parametrize("rise", [700, 300], ids=["second-tile", "first-tile"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_scores_rising_past_the_running_shift(path, causal: bool, rise: int) -> None:
    """A row keeps its shift over key tiles until a tile's scores pass it by
    the cap (e^8): keys from `rise` on score far above those before, either
    mid-way through the second key tile or through the first (whose shift
    comes from its first 64 keys), and five keys 200 on (a 64-lane block of
    the same tile) and the last five (the last tile's 16-lane tail) past e^88
    above the shift before them, so the shift rises inside a tile's pass and
    in its tail (the forward's softmax; the backward shifts by the final lse)."""
    cfg = Cfg(1, 1100, 2, 64, [1100], [1], causal, False, None, False)
    q, k, v, go, _ = make_inputs(cfg, path, "cpu", 7380 + causal + 2 * (rise == 300))
    k = k.clone()
    k[:, rise:] *= 4
    k[:, rise + 200 : rise + 205] *= 30
    k[:, 1095:] *= 30
    out, lse = ra.dilated_attention(q, k, v, [1100], [1], causal=causal, return_lse=True)
    want_out, want_lse, *_ = run_oracle(cfg, q, k, v, go, None)
    # Scores of a few hundred: fp32's rounding of S alone moves out by ~1e-4.
    close(out, want_out, max(OUT_TOL[path], 1e-3), "out", causal)
    close(lse, want_lse, LSE_TOL[path], "lse", causal)


def test_block_ops_at_offsets(bf16_path) -> None:
    """The block operators (what the ring calls) on a query block and a key
    block that start mid-sequence, against the oracle rows of the whole call."""
    n, q0, q1, k0, k1 = 200, 64, 170, 30, 200
    cfg = Cfg(1, n, 4, 64, [32, 128], [1, 2], True, False, None, False, 2)
    q, k, v, go, _ = make_inputs(cfg, BF16, "cpu", 7400)
    qb, kb, vb, gb = q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], go[:, q0:q1]
    out, lse = fresh_acc(qb)
    block_forward(cfg, qb, kb, vb, out, lse, q0, k0, None)
    # The oracle of q[q0:q1] against k[k0:k1] alone: zero the other keys' reach
    # by running the oracle on the whole sequence with those keys padded.
    pad = torch.ones(1, n, dtype=torch.bool)
    pad[:, k0:k1] = False
    want_out, want_lse, *_ = run_oracle(cfg, q, k, v, go, pad)
    rows = slice(q0, q1)
    reached = torch.isfinite(want_lse[:, :, rows])
    torch.testing.assert_close(
        lse[reached], want_lse[:, :, rows][reached].float(), atol=1e-3, rtol=1e-3
    )
    torch.testing.assert_close(
        out.double(), want_out[:, rows].double().nan_to_num(0), atol=2e-2, rtol=2e-2
    )
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32) for t in (qb, kb, vb))
    # The backward of these rows alone: the oracle's gradients with grad_out
    # zero outside them.
    go_rows = torch.zeros_like(go)
    go_rows[:, rows] = gb
    _, _, want_dq, want_dk, want_dv = run_oracle(cfg, q, k, v, go_rows, pad)
    block_backward(cfg, gb, qb, kb, vb, out.to(BF16), lse, dq, dk, dv, q0, k0, None)
    torch.testing.assert_close(dq.double(), want_dq[:, rows].double(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(dk.double(), want_dk[:, k0:k1].double(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(dv.double(), want_dv[:, k0:k1].double(), atol=5e-2, rtol=5e-2)


def test_non_finite_unreached_values_stay_out(bf16_path) -> None:
    """A NaN in the V row of a padded key: no row sees it (0 * NaN kept out of
    the bf16 P @ V and dS @ K products)."""
    g = torch.Generator().manual_seed(7500)
    q, k, v, go = (torch.randn(1, 96, 2, 64, generator=g).to(BF16) for _ in range(4))
    mask = torch.zeros(1, 96, dtype=torch.bool)
    mask[:, 40] = True
    v_bad, k_bad = v.clone(), k.clone()
    v_bad[:, 40] = float("nan")
    k_bad[:, 40] = float("inf")

    def run(k_, v_):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k_, v_))
        out = ra.dilated_attention(qq, kk, vv, [32, 96], [1, 2], key_padding_mask=mask)
        out.backward(go)
        return out, qq.grad, kk.grad, vv.grad

    for got, want in zip(run(k_bad, v_bad), run(k, v), strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def test_switch_takes_effect_where_the_machine_has_it(monkeypatch) -> None:
    """With the native path, P is rounded to bf16 before P @ V, so the outputs
    differ from the fp32-converted path's; without it the two are one path."""
    g = torch.Generator().manual_seed(7600)
    q, k, v = (torch.randn(1, 512, 4, 64, generator=g).to(BF16) for _ in range(3))

    def run():
        return ra.dilated_attention(q, k, v, [128, 512], [1, 2])

    monkeypatch.delenv(ENV, raising=False)
    default = run()
    monkeypatch.setenv(ENV, "0")
    converted = run()
    assert torch.equal(default, converted) != native_bf16_expected()


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # mkldnn.flags
def test_packed_switch_takes_effect_where_the_machine_has_it(monkeypatch) -> None:
    """brgemm's packed path applies the softmax scale in the softmax pass, MKL's
    GEMM in the product: the outputs and gradients differ wherever the native
    path packs (every machine with avx512_bf16), and turning oneDNN off
    selects MKL's GEMM exactly."""
    g = torch.Generator().manual_seed(7620)
    q, k, v, go = (torch.randn(1, 512, 4, 64, generator=g).to(BF16) for _ in range(4))

    def run():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = ra.dilated_attention(qq, kk, vv, [128, 512], [1, 2])
        return (out, *torch.autograd.grad(out, (qq, kk, vv), go))

    monkeypatch.delenv(ENV, raising=False)
    packed = run()
    with torch.backends.mkldnn.flags(enabled=False):
        onednn_off = run()
    monkeypatch.setenv(ENV, "mkl")
    mkl = run()
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), packed, mkl, onednn_off, strict=True):
        assert torch.equal(a, b) != native_bf16_expected(), name
        assert torch.equal(b, c), name


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # mkldnn.flags
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_onednn_off_matches_oracle(dtype, monkeypatch) -> None:
    """With oneDNN turned off (after calls with it on) the kernels leave
    brgemm's VNNI products, which libtorch then refuses, and still match the
    oracle."""
    for var in (ENV, FP32_ENV):
        monkeypatch.delenv(var, raising=False)
    cfg = Cfg(2, 150, 3, 64, [16, 64, 128], [1, 2, 4], True, False, None, True)
    check_against_oracle(cfg, dtype, "cpu", seed=7630)
    with torch.backends.mkldnn.flags(enabled=False):
        check_against_oracle(cfg, dtype, "cpu", seed=7631)


def test_fp32_switch_takes_effect_where_the_machine_has_it(monkeypatch) -> None:
    """The split score products round differently from brgemm's fp32 kernel,
    so the outputs differ where the machine has AMX, and so does dq when
    the forward's output is the same (the backward's S and dP split too);
    elsewhere, or at an odd head dim, the two settings are one path."""
    g = torch.Generator().manual_seed(7610)
    for d, splits in ((64, split_fp32_expected()), (33, False)):
        q, k, v, go = (torch.randn(1, 512, 4, d, generator=g) for _ in range(4))

        def run(q=q, k=k, v=v):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            return ra.dilated_attention(qq, kk, vv, [128, 512], [1, 2]), qq

        monkeypatch.delenv(FP32_ENV, raising=False)
        out, _ = run()
        monkeypatch.setenv(FP32_ENV, "fp32")
        out_packed, qq_packed = run()
        assert torch.equal(out, out_packed) != splits, d
        # The backward of each setting from the same forward results.
        (dq_packed,) = torch.autograd.grad(out_packed, qq_packed, go)
        out_again, qq_again = run()
        monkeypatch.delenv(FP32_ENV, raising=False)
        (dq,) = torch.autograd.grad(out_again, qq_again, go)
        assert torch.equal(dq, dq_packed) != splits, d


def _errors(cfg: Cfg, seed: int) -> list[float]:
    """Largest absolute errors of out, dq, dk, dv against the oracle, with q
    and k scaled by 3 (scores of up to a few hundred)."""
    q, k, v, go, _ = make_inputs(cfg, F32, "cpu", seed)
    q, k = q * 3, k * 3
    got = list(run_local(cfg, q, k, v, go, None))
    want = list(run_oracle(cfg, q, k, v, go, None))
    del got[1], want[1]  # lse: out's error shows it
    return [(a.double() - b).abs().max().item() for a, b in zip(got, want, strict=True)]


def test_split_products_are_as_accurate_as_fp32(monkeypatch) -> None:
    """The six bf16 part products of the split path (S, dP) lose no more than
    brgemm's fp32 kernel against the float64 oracle: forward and backward, on
    scores large enough that a dropped part product (2^-16 of |q| |k|) would
    show. Where the machine has no AMX both runs take the
    fp32 kernel."""
    cfg = Cfg(1, 1100, 4, 64, [512, 1100], [1, 2], True, False, None, False)
    errors = {}
    for name in ("fp32-split", "fp32-packed"):
        _use(name, monkeypatch)
        errors[name] = _errors(cfg, 7620)
    for split, packed in zip(errors["fp32-split"], errors["fp32-packed"], strict=True):
        assert split <= 1.5 * packed + 1e-7, errors


@pytest.mark.parametrize("which", ["query", "key", "value", "grad"])
def test_non_finite_rows_of_the_score_products(path, which: str) -> None:
    """An infinite entry in one query, key, value or output-gradient row
    (which the split products take as zeros, then score in fp32): rows that
    do not reach it stay exactly as without it, and what reaches it matches
    sgemm on the tiles in place (NaN where that is NaN)."""
    cfg = Cfg(1, 600, 2, 64, [600], [1], True, False, None, False)
    q, k, v, go, _ = make_inputs(cfg, path, "cpu", 7630)
    t = 300
    bad = {"query": q, "key": k, "value": v, "grad": go}[which].clone()
    bad[:, t, 1, 5] = float("inf")
    args = {"query": q, "key": k, "value": v, "grad": go}
    args[which] = bad
    got = run_local(cfg, args["query"], args["key"], args["value"], args["grad"], None)
    clean = run_local(cfg, q, k, v, go, None)
    # Causal: rows before t reach neither key t nor are row t.
    for a, b in zip(got[:1] + got[2:3], clean[:1] + clean[2:3], strict=True):
        torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FP32_ENV, "0")
        want = run_local(cfg, args["query"], args["key"], args["value"], args["grad"], None)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, equal_nan=True)
