"""The CPU kernels' tile paths: what ``select_path()`` (csrc/cpu/tile_path.h)
picks, and every path this machine can run against the float64 oracle.

A path is a GEMM (``Blas``: sgemm/dgemm on the tiles in place, fp16 and bf16
converted to fp32; ``Fp32Avx2``: K/V packed once per key run, the AVX2
kernels; ``Fp32Brgemm``: the same through oneDNN's brgemm fp32 kernels, AVX-512;
``Fp32Split``: S and dP as six bf16 products on AMX; ``Bf16Mkl``: bf16 tiles in
place, MKL's bf16 GEMM; ``Bf16Packed``: bf16 K/V packed in VNNI pairs, brgemm)
and the lanes of the softmax passes (``avx512``, ``avx2``, ``vec``: at::vec).
The knobs: ``RING_ATTENTION_CPU_ISA`` caps the instruction set (a narrower
one runs that ISA's path on a wider machine: this is how CI covers the AVX2
and generic paths on AVX-512 and AMX machines), ``RING_ATTENTION_CPU_FP32_PACK``
(``fp32``: no split; ``0``: sgemm in place) and ``RING_ATTENTION_CPU_BF16_GEMM``
(``mkl``: MKL's GEMM without packing; ``0``: converted to fp32).

The paths are found at collection time: every knob setting is asked
(``ring_attention._C.cpu_tile_path``) which path it selects here, and each
distinct path runs once, named after it (``float32-Fp32Avx2/avx2``). Each is
checked against the float64 oracle, forward and backward (lse gradients,
grouped K/V heads, documents, several key tiles per run, causal tiles that use
part of a packed key tile, NaN V rows; for bf16 also chunked accumulation and
the block operators at offsets). The choice itself is checked against a
re-derivation of the table from /proc/cpuinfo, the switches are checked to
change the path the kernels run (as they count it: ``_C.cpu_tile_path_runs``)
exactly where the machine has the path, and bad knob values to be refused.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import platform

import pytest
import torch
from op_helpers import (
    LSE_TOL,
    OUT_TOL,
    Cfg,
    block_backward,
    block_forward,
    check_results,
    close,
    fresh_acc,
    lse_grad,
    make_inputs,
    run_local,
    run_op,
    run_oracle,
)

import ring_attention as ra
from ring_attention import _C

BF16, F32 = torch.bfloat16, torch.float32
ENV = "RING_ATTENTION_CPU_BF16_GEMM"
FP32_ENV = "RING_ATTENTION_CPU_FP32_PACK"
ISA_ENV = "RING_ATTENTION_CPU_ISA"
KNOBS = (ENV, FP32_ENV, ISA_ENV)
CHUNK_ENV = "RING_ATTENTION_CHUNK_MIB"  # the local op's fp32 chunks (test_local_op.py)
ISAS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
DTYPE_NAMES = {BF16: "bfloat16", F32: "float32", torch.float16: "float16", torch.float64: "float64"}
# Named settings (dtype, knobs set; the others unset).
SETTINGS = {
    "bf16-native": (BF16, {}),
    "bf16-mkl": (BF16, {ENV: "mkl"}),
    "bf16-converted": (BF16, {ENV: "0"}),
    "fp32-split": (F32, {}),
    "fp32-packed": (F32, {FP32_ENV: "fp32"}),
    "fp32-sgemm": (F32, {FP32_ENV: "0"}),
}


def _cpu_flags() -> set[str]:
    if platform.machine() != "x86_64":
        return set()
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


def machine_isa() -> str:
    """The ISA select_path() starts from: the CPU's, as setup.py builds for it
    (AVX-512 code only in builds for AVX-512, which setup.py makes where the
    CPU has these flags)."""
    f = _cpu_flags()
    if not {"avx2", "fma"} <= f:
        return "generic"
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f:
        return "avx2"
    if "avx512_bf16" not in f:
        return "avx512"
    if not {"amx_tile", "amx_bf16"} <= f:
        return "avx512_bf16"
    return "amx"


def native_bf16_expected() -> bool:
    """Whether bf16 tiles are multiplied as bf16 (knobs unset)."""
    return torch.backends.mkl.is_available() and ISAS.index(machine_isa()) >= ISAS.index(
        "avx512_bf16"
    )


def split_fp32_expected() -> bool:
    """Whether fp32 tiles of an even head dim take the split products (knobs unset)."""
    return machine_isa() == "amx"


def expected_path(dtype: torch.dtype, head_dim: int, scale: float, env: dict[str, str]) -> str:
    """The table of csrc/cpu/tile_path.h, re-derived (MKL and a working oneDNN
    brgemm assumed where the ISA has bf16 dot products, oneDNN on)."""
    isa = env.get(ISA_ENV, "auto")
    isa = machine_isa() if isa == "auto" else isa
    level = ISAS.index(isa)
    bf16, fp32 = env.get(ENV, "auto"), env.get(FP32_ENV, "auto")
    lanes = "avx512" if level >= 2 else "avx2" if level == 1 else "vec"
    if dtype == torch.float64:
        return "Blas/vec"
    if dtype == BF16 and level >= 3 and torch.backends.mkl.is_available() and bf16 != "0":
        if bf16 == "auto" and head_dim % 2 == 0 and scale > 0:
            return "Bf16Packed/avx512"
        return "Bf16Mkl/avx512"
    if scale > 0 and fp32 != "0":  # fp32 tiles: fp16, bf16 converted
        if dtype == F32 and isa == "amx" and fp32 == "auto" and head_dim % 2 == 0:
            return "Fp32Split/avx512"
        if level >= 2:
            return "Fp32Brgemm/avx512"
        if level == 1:
            return "Fp32Avx2/avx2"
    return f"Blas/{lanes}"


# The float64 oracle's answers, kept while this module runs: every path of
# one dtype gets the same inputs (make_inputs depends on the configuration,
# the dtype and the seed alone), so one answer serves them all, and inputs
# held to bf16's values (inputs_of) serve the float32 paths too. At
# 2300-2601 rows the oracle, not the kernel, is most of a case's time.
_ORACLE: dict[str, list] = {}


@pytest.fixture(autouse=True, scope="module")
def _forget_oracle_answers():
    yield
    _ORACLE.clear()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    # the oracle sees the values in float64: equal values, whatever the dtype
    return a.shape == b.shape and torch.equal(a.double(), b.double())


def oracle(cfg: Cfg, q, k, v, go, mask, glse=None):
    """op_helpers.run_oracle, computed once per equal problem (the inputs
    compared exactly, not trusted to be equal)."""
    inputs = (q, k, v, go, mask, glse)
    entries = _ORACLE.setdefault(repr(cfg), [])
    for seen, want in entries:
        if all(_same(a, b) for a, b in zip(seen, inputs, strict=True)):
            return want
    want = run_oracle(cfg, q, k, v, go, mask, glse)
    entries.append((tuple(None if x is None else x.clone() for x in inputs), want))
    return want


def inputs_of(cfg: Cfg, dtype: torch.dtype, device: str, seed: int, values: torch.dtype | None):
    """make_inputs in ``dtype``, holding ``values``' values when given."""
    *qkvg, mask = make_inputs(cfg, values or dtype, device, seed)
    return (*(x.to(dtype) for x in qkvg), mask)


def check_against_oracle_once(
    cfg: Cfg, dtype: torch.dtype, device: str, seed: int, values: torch.dtype | None = None
) -> None:
    """op_helpers.check_against_oracle with the oracle's answer shared;
    ``values``: the inputs rounded to that dtype's values first (so that
    paths of several dtypes share one oracle answer)."""
    q, k, v, go, mask = inputs_of(cfg, dtype, device, seed, values)
    got = run_op(cfg, q, k, v, go, mask)
    want = oracle(cfg, q, k, v, go, mask)
    check_results(cfg, dtype, got, want, f"seed={seed} dtype={dtype} device={device} {cfg}")


def _set_knobs(env: dict[str, str], setenv, delenv) -> None:
    for var in KNOBS:
        if var in env:
            setenv(var, env[var])
        else:
            delenv(var)


def tile_path(dtype: torch.dtype, env: dict[str, str], head_dim: int = 64, scale: float = 0.125):
    """The path select_path() picks under env (None: an ISA this machine lacks)."""
    saved = {var: os.environ.get(var) for var in KNOBS}
    try:
        _set_knobs(env, os.environ.__setitem__, lambda var: os.environ.pop(var, None))
        return _C.cpu_tile_path(DTYPE_NAMES[dtype], head_dim, scale)
    except ValueError:
        return None
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _settings_to_try():
    for dtype, isa, fp32, bf16 in itertools.product(
        (BF16, F32), ("auto", *ISAS), ("auto", "fp32", "0"), ("auto", "mkl", "0")
    ):
        if dtype == F32 and bf16 != "auto":
            continue
        env = {ISA_ENV: isa, FP32_ENV: fp32, ENV: bf16}
        yield dtype, {var: value for var, value in env.items() if value != "auto"}


def _adds_code(dtype: torch.dtype, name: str) -> bool:
    """Whether a path reached only by capping the ISA below this machine's
    runs code that the machine's own paths do not: not sgemm with AVX2
    lanes above AVX2 (its GEMM runs in Blas/avx512, its lanes in
    Fp32Avx2/avx2), nor bf16 on the AVX2 kernels above AVX2 (their
    conversion runs in bf16's Fp32Brgemm, the kernels in fp32's)."""
    if ISAS.index(machine_isa()) <= ISAS.index("avx2"):
        return True
    return name != "Blas/avx2" and not (dtype == BF16 and name == "Fp32Avx2/avx2")


def _distinct_paths() -> dict[str, tuple[torch.dtype, dict[str, str]]]:
    """name -> (dtype, knobs): the first setting that selects each path here
    (of those reached by a narrower ISA, the ones that run code of their own)."""
    paths = {}
    for dtype, env in _settings_to_try():
        name = tile_path(dtype, env)
        if name is not None and (ISA_ENV not in env or _adds_code(dtype, name)):
            paths.setdefault(f"{DTYPE_NAMES[dtype]}-{name}", (dtype, env))
    return paths


PATHS = _distinct_paths()


def _use_env(dtype: torch.dtype, env: dict[str, str], monkeypatch) -> torch.dtype:
    _set_knobs(env, monkeypatch.setenv, lambda var: monkeypatch.delenv(var, raising=False))
    return dtype


def _use(name: str, monkeypatch: pytest.MonkeyPatch) -> torch.dtype:
    return _use_env(*SETTINGS[name], monkeypatch)


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.dtype:
    """Runs the test on one tile path; returns its dtype."""
    return _use_env(*PATHS[request.param], monkeypatch)


@pytest.fixture(params=[name for name in PATHS if PATHS[name][0] == BF16])
def bf16_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test on one of the bf16 paths."""
    _use_env(*PATHS[request.param], monkeypatch)
    return request.param


def test_every_path_of_this_machine_runs() -> None:
    """The ISA's own paths and every narrower one's are among those tested
    here: the AVX2 kernels wherever the CPU has AVX2 (forced on wider
    machines), the generic path everywhere."""
    level = ISAS.index(machine_isa())
    want = {"Blas/vec"}
    if level >= 1:
        want |= {"Fp32Avx2/avx2"} | ({"Blas/avx2"} if level == 1 else set())
    if level >= 2:
        want |= {"Fp32Brgemm/avx512", "Blas/avx512"}
    if level >= 3 and torch.backends.mkl.is_available():
        want |= {"Bf16Packed/avx512", "Bf16Mkl/avx512"}
    if level >= 4:
        want |= {"Fp32Split/avx512"}
    assert want <= {name.split("-", 1)[1] for name in PATHS}, PATHS


@pytest.mark.parametrize("dtype", [F32, BF16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("head_dim,scale", [(64, 0.125), (33, 0.2), (64, -0.5)])
def test_select_path_follows_the_table(dtype, head_dim: int, scale: float) -> None:
    """select_path() against the table re-derived from the CPU flags, for every
    ISA cap and knob value this machine accepts; wider ISAs are refused."""
    for isa, fp32, bf16 in itertools.product(
        ("auto", *ISAS), ("auto", "fp32", "0"), ("auto", "mkl", "0")
    ):
        env = {ISA_ENV: isa, FP32_ENV: fp32, ENV: bf16}
        got = tile_path(dtype, env, head_dim, scale)
        if isa != "auto" and ISAS.index(isa) > ISAS.index(machine_isa()):
            assert got is None, env
        else:
            assert got == expected_path(dtype, head_dim, scale, env), env


ACCEPTED = {
    ENV: "['auto', 'mkl', '0']",
    FP32_ENV: "['auto', 'fp32', '0']",
    ISA_ENV: "['auto', 'generic', 'avx2', 'avx512', 'avx512_bf16', 'amx']",
}


@pytest.mark.parametrize("var", KNOBS)
@pytest.mark.parametrize("dtype", [F32, BF16, torch.float64], ids=str)
@pytest.mark.parametrize("value", ["garbage", "1", "0 ", "AVX2", "Auto"])
def test_bad_knob_values_are_refused(var: str, dtype, value: str, monkeypatch) -> None:
    """A value outside the accepted ones raises ValueError naming the variable,
    the accepted values and the value, whatever the dtype (every knob is read at
    every call) and before the kernel writes anything; the bad value is not
    kept: the default afterwards runs."""
    cfg = Cfg(1, 40, 2, 16, [16, 40], [1, 2], True)
    q, k, v, _, _ = make_inputs(cfg, dtype, "cpu", 7700)
    out, lse = fresh_acc(q)
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as info:
        block_forward(cfg, q, k, v, out, lse, 0, 0, None)
    assert str(info.value).startswith(f"{var} must be one of {ACCEPTED[var]}, got '{value}'")
    assert not out.any() and bool((lse == float("-inf")).all())
    monkeypatch.delenv(var)
    block_forward(cfg, q, k, v, out, lse, 0, 0, None)
    assert bool(torch.isfinite(lse).all())


@pytest.mark.parametrize("isa", ISAS)
def test_isa_wider_than_the_machine_is_refused(isa: str, monkeypatch) -> None:
    """RING_ATTENTION_CPU_ISA may name this machine's ISA or a narrower one (and
    the call runs), not a wider one: ValueError naming the variable and the
    values accepted here, in the forward and the backward."""
    level, have = ISAS.index(isa), ISAS.index(machine_isa())
    accepted = ", ".join(f"'{name}'" for name in ("auto", *ISAS[: have + 1]))
    cfg = Cfg(1, 40, 2, 16, [16, 40], [1, 2], True)
    q, k, v, go, _ = make_inputs(cfg, F32, "cpu", 7710)
    monkeypatch.setenv(ISA_ENV, isa)
    if level <= have:
        got = run_local(cfg, q, k, v, go, None)
        check_results(cfg, F32, got, oracle(cfg, q, k, v, go, None), isa)
        return
    message = f"^{ISA_ENV}='{isa}' is wider than this machine and build run: it must be one of "
    message += f"\\[{accepted}\\]"
    with pytest.raises(ValueError, match=message):
        ra.dilated_attention(q, k, v, cfg.segment_lengths, cfg.dilation_rates)
    monkeypatch.delenv(ISA_ENV)
    out, lse = fresh_acc(q)
    block_forward(cfg, q, k, v, out, lse, 0, 0, None)
    dq, dk, dv = (torch.zeros(t.shape) for t in (q, k, v))
    monkeypatch.setenv(ISA_ENV, isa)
    with pytest.raises(ValueError, match=message):
        block_backward(cfg, go, q, k, v, out, lse, dq, dk, dv, 0, 0, None)
    assert not (dq.any() or dk.any() or dv.any())


@pytest.mark.parametrize("head_dim", [64, 33])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_oracle(path, causal, head_dim) -> None:
    cfg = Cfg(2, 150, 3, head_dim, [16, 64, 128], [1, 2, 4], causal, False, None, True)
    check_against_oracle_once(cfg, path, "cpu", seed=7100 + causal)


@pytest.mark.parametrize("threads", [1, 3])
def test_tasks_of_unequal_cost_on_threads(path, threads: int) -> None:
    """Eight heads over r = 6 stack heads 0 and 6, 1 and 7 and run the others
    alone: tasks of unequal cost, each taken once by whichever thread is free."""
    cfg = Cfg(2, 130, 8, 16, [24, 96], [1, 6], False, False, None, True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_against_oracle_once(cfg, path, "cpu", seed=7150 + threads)
    finally:
        torch.set_num_threads(before)


def test_features_with_lse_gradient(path) -> None:
    """Grouped K/V heads, documents, grouped offsets, head groups, a key padding
    mask and a gradient through lse."""
    cfg = Cfg(2, 140, 8, 32, [16, 64], [2, 4], True, True, None, True, 2, True)
    cfg.cu_seqlens = [0, 1, 40, 40, 97, 140]
    q, k, v, go, mask = make_inputs(cfg, path, "cpu", 7200)
    glse = lse_grad(cfg, "cpu", 7201)
    got = run_local(cfg, q, k, v, go, mask, glse)
    want = oracle(cfg, q, k, v, go, mask, glse)
    check_results(cfg, path, got, want, f"{path} {cfg}")


def test_long_sequence_by_chunks(bf16_path, monkeypatch) -> None:
    """Past 1024 rows bf16 accumulates chunk by chunk (the 8-chunk rule alone)."""
    monkeypatch.setenv(CHUNK_ENV, "0")
    cfg = Cfg(1, 2300, 2, 64, [300, 2048], [1, 4], True, True, None, True)
    check_against_oracle_once(cfg, BF16, "cpu", seed=7300)


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
    want = oracle(cfg, q, k, v, go, mask, glse)
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
        check_against_oracle_once(cfg, path, "cpu", seed=7350 + causal, values=BF16)
    # A NaN in the V row of key u: causal, in the second key tile of the run
    # of odd positions (dilation 2), where it reaches the later queries only;
    # and masked, in the fifth key tile of a dense run, which at head dim 128
    # is past the tiles a thread keeps and is packed again for every query
    # tile: it reaches no row.
    u = 2201
    for r, causal in ((2, True), (1, False)):
        cfg = Cfg(1, 2601, 2, head_dim, [2601], [r], causal, False, None, False)
        q, k, v, go, _ = inputs_of(cfg, path, "cpu", 7351, BF16)
        mask = None
        if not causal:
            mask = torch.zeros(1, cfg.n, dtype=torch.bool)
            mask[:, u] = True
        v_bad = v.clone()
        v_bad[:, u] = float("nan")
        got = run_local(cfg, q, k, v_bad, go, mask, None)
        want = oracle(cfg, q, k, v, None, mask)  # the output alone is compared
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
    want_out, want_lse, *_ = oracle(cfg, q, k, v, go, None)
    # Scores of a few hundred: fp32's rounding of S alone moves out by ~1e-4.
    close(out, want_out, max(OUT_TOL[path], 1e-3), "out", causal)
    close(lse, want_lse, LSE_TOL[path], "lse", causal)


@pytest.mark.parametrize("bad", [None, "inf", "nan"], ids=["finite", "inf", "nan"])
def test_later_key_tiles_with_the_pass_in_the_product(path, bad: str | None) -> None:
    """Rows past their first key tile, none of it masked: on the AVX2 path
    their softmax pass runs in the epilogue of S = Q K^T. Key runs of 1300
    keys (tiles of 512, 512 and 276 keys, the last ending in a 4-lane tail),
    head dim 264 (a reduction longer than the AVX2 kernel's slice of 256),
    against the oracle; with an infinite or NaN entry in key 900 (the second
    tile: +inf scores pass the cap, NaN ones pass nothing), against sgemm on
    the tiles in place (NaN where that is NaN)."""
    cfg = Cfg(1, 1300, 2, 264, [1300], [1])
    if bad is None:
        check_against_oracle_once(cfg, path, "cpu", seed=7660)
        return
    q, k, v, go, _ = make_inputs(cfg, path, "cpu", 7661)
    k = k.clone()
    k[:, 900, 1, 5] = float(bad)
    got = run_local(cfg, q, k, v, go, None)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FP32_ENV, "0")
        want = run_local(cfg, q, k, v, go, None)
    tol = 1e-4 if path == F32 else 1e-2
    for a, b in zip(got, want, strict=True):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, equal_nan=True)
    assert torch.isnan(got[0][:, :, 1]).any()


def test_avx2_exponential_against_float64() -> None:
    """The AVX2 softmax passes' exponential (csrc/cpu/avx2_exp.h, which S's
    epilogue shares) against float64, on its arguments as the passes make
    them (a score times the scale minus the shift, so at most 0 but for
    rounding): 2^t within 1.5e-7 relative wherever it is a normal number
    (t in [-126, 0]: a grid, random points, the neighbourhood of 0 and of the
    integers where the rounding of t flips), exactly 1 at 0; within 2^-126
    below that, exactly 0 at -inf and from -127 on; NaN kept; the pass's sum."""
    if ISAS.index(machine_isa()) < ISAS.index("avx2"):
        with pytest.raises(RuntimeError, match="AVX2"):
            _C.cpu_avx2_exp_row(torch.zeros(8).numpy(), 1.0, 0.0)
        return
    g = torch.Generator().manual_seed(7700)
    ints = torch.arange(-126.0, 1.0).repeat_interleave(4)
    t = torch.cat(
        [
            torch.linspace(-126, 0, 1 << 18),
            -126 * torch.rand(1 << 18, generator=g),
            torch.logspace(-30, 0, 4001) * torch.tensor([-1.0, 1.0]).repeat(2001)[:4001],
            ints + torch.tensor([-0.5, 0.5, -0.49999997, 0.49999997]).repeat(127),
        ]
    ).float()
    t = t[(t >= -126) & (t <= 0)]
    special = torch.tensor([0.0, -0.0, -126.75, -127.0, -150.0, -1e30, -float("inf"), float("nan")])
    x = torch.cat([t, special])
    y = x.clone()
    # scale ln 2: the pass's base-2 scale (scale * log2 e) is 1, so 2^x exactly.
    total = _C.cpu_avx2_exp_row(y.numpy(), math.log(2.0), 0.0)
    want = torch.exp2(x.double())
    rel = ((y[: len(t)].double() - want[: len(t)]) / want[: len(t)]).abs().max().item()
    assert rel <= 1.5e-7, rel
    got = y[len(t) :].tolist()
    assert got[:2] == [1.0, 1.0]
    assert abs(got[2] - 2.0**-126.75) <= 2.0**-126
    assert got[3:7] == [0.0, 0.0, 0.0, 0.0]
    assert math.isnan(got[7])
    # The sum of the finite ones (NaN's sum is NaN).
    assert math.isnan(total)
    z = x[: len(t)].clone()
    total = _C.cpu_avx2_exp_row(z.numpy(), math.log(2.0), 0.0)
    assert math.isclose(total, want[: len(t)].sum().item(), rel_tol=1e-5)


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
    want_out, want_lse, *_ = oracle(cfg, q, k, v, go, pad)
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
    _, _, want_dq, want_dk, want_dv = oracle(cfg, q, k, v, go_rows, pad)
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


def ran(fn) -> tuple[object, set[str]]:
    """``fn()`` and the tile paths the CPU kernels ran during it, by pass
    ({"forward Bf16Packed/avx512", "backward Bf16Packed/avx512"}): what the
    kernels counted (``_C.cpu_tile_path_runs``), not what their outputs
    suggest. (Paths whose outputs are equal bit for bit exist: on AMX, MKL's
    bf16 GEMM and brgemm's packed one at a power-of-two scale.)"""
    before = _C.cpu_tile_path_runs()
    result = fn()
    after = _C.cpu_tile_path_runs()
    return result, {name for name, n in after.items() if n > before.get(name, 0)}


def both_passes(path: str) -> set[str]:
    return {f"forward {path}", f"backward {path}"}


def _forward_backward(q, k, v, go):
    """A closure: ``dilated_attention`` of q, k, v and its gradients for ``go``."""

    def run():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = ra.dilated_attention(qq, kk, vv, [128, 512], [1, 2])
        return (out, *torch.autograd.grad(out, (qq, kk, vv), go))

    return run


def test_path_runs_are_counted_by_pass() -> None:
    """What the kernels count is what select_path() picks, forward and
    backward separately: a forward alone counts no backward."""
    q = torch.randn(1, 40, 2, 16)
    _, forward_only = ran(lambda: ra.dilated_attention(q, q, q, [16, 40], [1, 2]))
    assert forward_only == {f"forward {expected_path(F32, 16, 0.25, {})}"}
    go = torch.randn(1, 40, 2, 16)
    want = both_passes(expected_path(torch.float64, 16, 0.25, {}))
    assert ran(_forward_backward(q.double(), q.double(), q.double(), go.double()))[1] == want


def test_switch_takes_effect_where_the_machine_has_it(monkeypatch) -> None:
    """RING_ATTENTION_CPU_BF16_GEMM=0 runs bf16 on the fp32 tiles, forward and
    backward, where the machine multiplies bf16 tiles (avx512_bf16, AMX), and
    the outputs differ; elsewhere both settings run the fp32 path (the same
    outputs and gradients)."""
    g = torch.Generator().manual_seed(7600)
    q, k, v, go = (torch.randn(1, 512, 4, 64, generator=g).to(BF16) for _ in range(4))
    run = _forward_backward(q, k, v, go)
    monkeypatch.delenv(ENV, raising=False)
    default, default_ran = ran(run)
    monkeypatch.setenv(ENV, "0")
    converted, converted_ran = ran(run)
    assert default_ran == both_passes(expected_path(BF16, 64, 0.125, {}))
    assert converted_ran == both_passes(expected_path(BF16, 64, 0.125, {ENV: "0"}))
    assert converted_ran.isdisjoint(default_ran) == native_bf16_expected()
    # bf16 tiles round P to bf16 before P @ V (2^-9 relative): some of the
    # 131072 bf16 outputs round the other way. One path: the same bits.
    assert torch.equal(default[0], converted[0]) == (default_ran == converted_ran)
    if default_ran == converted_ran:
        for a, b in zip(default[1:], converted[1:], strict=True):
            assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # mkldnn.flags
def test_packed_switch_takes_effect_where_the_machine_has_it(monkeypatch) -> None:
    """Where the machine multiplies bf16 tiles, the default packs K/V for
    brgemm (Bf16Packed), and both RING_ATTENTION_CPU_BF16_GEMM=mkl and
    turning oneDNN off run MKL's bf16 GEMM on the tiles in place (Bf16Mkl),
    forward and backward, with outputs and gradients equal bit for bit;
    elsewhere all three run one path (the fp32 tiles), the switch changing
    no bit. The kernels' own count says which path ran: the outputs cannot,
    since at head dim 64 (scale 1/8, a power of two) MKL's GEMM and brgemm
    give the same bits on AMX."""
    g = torch.Generator().manual_seed(7620)
    q, k, v, go = (torch.randn(1, 512, 4, 64, generator=g).to(BF16) for _ in range(4))
    run = _forward_backward(q, k, v, go)
    monkeypatch.delenv(ENV, raising=False)
    packed, packed_ran = ran(run)
    with torch.backends.mkldnn.flags(enabled=False):
        onednn_off, onednn_off_ran = ran(run)
    monkeypatch.setenv(ENV, "mkl")
    mkl, mkl_ran = ran(run)
    unpacked = expected_path(BF16, 64, 0.125, {ENV: "mkl"})
    assert packed_ran == both_passes(expected_path(BF16, 64, 0.125, {}))
    assert mkl_ran == onednn_off_ran == both_passes(unpacked)
    assert (unpacked == "Bf16Mkl/avx512") == native_bf16_expected()
    assert (packed_ran != mkl_ran) == native_bf16_expected()
    # One GEMM, the same bits: MKL's (where it runs, oneDNN plays no part),
    # else the one path the switch leaves (oneDNN on in both). Turning oneDNN
    # off there changes libtorch's brgemm inside Fp32Brgemm (its fallback GEMM
    # on AVX-512): another order of sums, not compared.
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), packed, mkl, onednn_off, strict=True):
        if native_bf16_expected():
            assert torch.equal(b, c), name
        else:
            assert torch.equal(a, b), name


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # mkldnn.flags
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_onednn_off_matches_oracle(dtype, monkeypatch) -> None:
    """With oneDNN turned off (after calls with it on) the kernels leave
    brgemm's VNNI products, which libtorch then refuses, and still match the
    oracle."""
    for var in (ENV, FP32_ENV):
        monkeypatch.delenv(var, raising=False)
    cfg = Cfg(2, 150, 3, 64, [16, 64, 128], [1, 2, 4], True, False, None, True)
    check_against_oracle_once(cfg, dtype, "cpu", seed=7630)
    with torch.backends.mkldnn.flags(enabled=False):
        check_against_oracle_once(cfg, dtype, "cpu", seed=7631)


def test_fp32_switch_takes_effect_where_the_machine_has_it(monkeypatch) -> None:
    """RING_ATTENTION_CPU_FP32_PACK=fp32 turns the split score products off
    (the forward's, and the backward's S and dP, each read at its own call)
    where the machine has AMX and the head dim is even, and the outputs and
    dq differ (the backward of each setting from the other's forward
    results); elsewhere, or at an odd head dim, the two settings run one
    path (the same outputs)."""
    g = torch.Generator().manual_seed(7610)
    for d in (64, 33):
        scale = d**-0.5
        q, k, v, go = (torch.randn(1, 512, 4, d, generator=g) for _ in range(4))

        def forward(q=q, k=k, v=v):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            return ra.dilated_attention(qq, kk, vv, [128, 512], [1, 2]), qq

        split = expected_path(F32, d, scale, {})
        unsplit = expected_path(F32, d, scale, {FP32_ENV: "fp32"})
        assert (split == "Fp32Split/avx512") == (split_fp32_expected() and d % 2 == 0), d
        monkeypatch.delenv(FP32_ENV, raising=False)
        (out, _), split_ran = ran(forward)
        monkeypatch.setenv(FP32_ENV, "fp32")
        (out_packed, qq_packed), unsplit_ran = ran(forward)
        assert (split_ran, unsplit_ran) == ({f"forward {split}"}, {f"forward {unsplit}"}), d
        # The backward of each setting from the other's forward results.
        grad = torch.autograd.grad
        ((dq_packed,), backward_ran) = ran(functools.partial(grad, out_packed, qq_packed, go))
        assert backward_ran == {f"backward {unsplit}"}, d
        (out_again, qq_again), _ = ran(forward)
        monkeypatch.delenv(FP32_ENV, raising=False)
        ((dq,), backward_ran) = ran(functools.partial(grad, out_again, qq_again, go))
        assert backward_ran == {f"backward {split}"}, d
        # Where the products split, they take effect in both passes: they drop
        # the three smallest part products (about 2^-24 of |q| |k| each) of
        # full-mantissa fp32 values, so S and dP move in their last bits for
        # nearly every score, and out and dq (fp32) with them.
        assert torch.equal(out, out_packed) == (split == unsplit), d
        assert torch.equal(dq, dq_packed) == (split == unsplit), d


def _errors(cfg: Cfg, seed: int) -> list[float]:
    """Largest absolute errors of out, dq, dk, dv against the oracle, with q
    and k scaled by 3 (scores of up to a few hundred)."""
    q, k, v, go, _ = make_inputs(cfg, F32, "cpu", seed)
    q, k = q * 3, k * 3
    got = list(run_local(cfg, q, k, v, go, None))
    want = list(oracle(cfg, q, k, v, go, None))
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
    sgemm on the tiles in place (NaN where that is NaN; bf16 results to their
    rounding, which the packed paths reach by another order of sums)."""
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
    tol = 1e-4 if path == F32 else 1e-2
    for a, b in zip(got, want, strict=True):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, equal_nan=True)
