"""The local op through dense attention per branch on strided views
(ring_attention/local/branches.py), its dispatch table (dispatch.py) and knobs
(config.py), against the float64 oracle.

On the CPU the dense path runs only when asked for (``RING_ATTENTION_FORWARD
=dense``, ``RING_ATTENTION_BACKWARD=dense``), on PyTorch's CPU flash attention
(the stand-in backend): the views, windows, part buffers, the merge and sum
operators and the autograd are the ones CUDA runs, so the GPU has only its
backends' kernels left to check. The CUDA tests at the end run where a GPU is.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
import torch
from op_helpers import OpLog
from oracle import reference_attention

import ring_attention as ra
from ring_attention import info
from ring_attention.core import config
from ring_attention.core.call import Call, prepare
from ring_attention.core.pattern import Pattern
from ring_attention.local import backends, branches, dispatch, engine, ops
from ring_attention.local.blocks import merge_into, ring_blocks

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
ROOT = Path(__file__).resolve().parent.parent

CASES = {  # name: (segments, dilations, Pattern keywords, cu_seqlens or None)
    "longnet": ([8, 16, 32], [1, 2, 4], {}, None),
    "longnet-causal": ([8, 16, 32], [1, 2, 4], {"causal": True}, None),
    "head-groups": ([4, 12], [1, 3], {"head_groups": True}, None),
    "grouped-offsets-causal": ([8, 32], [2, 3], {"head_offsets": "grouped", "causal": True}, None),
    "one-branch-dilated": ([16], [5], {}, None),
    "r-not-dividing-w": ([10, 35], [3, 4], {}, None),
    "gqa-r6": ([12, 48], [1, 6], {"causal": True}, None),
    "documents": ([8, 16], [1, 2], {}, [0, 9, 9, 40, 41]),
    "documents-causal-grouped": (
        [6, 24],
        [2, 3],
        {"causal": True, "head_offsets": "grouped"},
        [0, 17, 30],
    ),
}
HEADS = [(5, 5), (6, 2), (3, 1), (24, 6)]  # (24, 6): 4 query heads per K/V head


@pytest.fixture
def dense(monkeypatch):
    monkeypatch.setenv(config.FORWARD, "dense")
    monkeypatch.setenv(config.BACKWARD, "dense")


@pytest.fixture
def small_windows(monkeypatch):
    """Windows as short as the pattern allows: several at test sizes."""
    monkeypatch.setenv(config.SPAN_ROWS, "1")


def _inputs(batch, n, heads, kv_heads, d, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, heads, d, generator=g, dtype=F64)
    k, v = (torch.randn(batch, n, kv_heads, d, generator=g, dtype=F64) for _ in range(2))
    go = torch.randn(batch, n, heads, d, generator=g, dtype=F64)
    glse = torch.randn(batch, heads, n, generator=g, dtype=F64)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, go)] + [glse]


def _kw(case):
    segs, dils, kw, cu = CASES[case]
    return segs, dils, dict(kw, cu_seqlens=cu)


def _run(q, k, v, go, segs, dils, glse=None, **kw):
    """out, lse, dq, dk, dv of the public function (loss: out . go [+ lse . glse])."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ra.dilated_attention(q, k, v, segs, dils, return_lse=True, **kw)
    loss = (out * go).sum()
    if glse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * glse.to(lse)).sum()
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, (q, k, v)))


def _oracle(q, k, v, go, segs, dils, glse=None, **kw):
    kw = dict(kw)
    kw["grouped_offsets"] = kw.pop("head_offsets", "modulo") == "grouped"
    q, k, v = (t.detach().to("cpu", F64).requires_grad_() for t in (q, k, v))
    return _run_ref(q, k, v, go.to("cpu", F64), segs, dils, glse, **kw)


def _run_ref(q, k, v, go, segs, dils, glse, **kw):
    out, lse = reference_attention(q, k, v, segs, dils, **kw)
    loss = (out * go).sum()
    if glse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * glse).sum()
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, (q, k, v)))


def _check(got, want, tol, ctx):
    names = ("out", "lse", "dq", "dk", "dv")
    for name, a, b in zip(names, got, want, strict=True):
        a = a.to("cpu", F64)
        if name == "lse":
            unreached = torch.isneginf(b)
            assert torch.equal(torch.isneginf(a), unreached), f"{ctx}: rows reaching no key"
            a, b = a[~unreached], b[~unreached]
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e} ({ctx})"


def _routes(q, k, v, segs, dils, kw):
    pattern = Pattern(segs, dils, **{x: y for x, y in kw.items() if x != "cu_seqlens"})
    pattern = pattern.with_documents(kw.get("cu_seqlens"))
    return [dispatch.route(p, q, k, v, pattern, None) for p in ("forward", "backward")]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_dense_path_matches_oracle_f64(case, heads, kv_heads, dense, small_windows) -> None:
    segs, dils, kw = _kw(case)
    seed = random.randrange(2**31)
    n = kw["cu_seqlens"][-1] if kw["cu_seqlens"] else random.Random(seed).randrange(33, 140)
    q, k, v, go, _ = _inputs(2, n, heads, kv_heads, 8, F64, "cpu", seed)
    assert all(r.dense for r in _routes(q, k, v, segs, dils, kw))
    got = _run(q, k, v, go, segs, dils, **kw)
    _check(got, _oracle(q, k, v, go, segs, dils, **kw), 1e-10, f"{case} seed {seed}")


@pytest.mark.parametrize("dtype,tol", [(F32, 2e-5), (BF16, 2e-2), (F16, 5e-3)])
@pytest.mark.parametrize("case", ["longnet-causal", "gqa-r6", "documents"])
def test_dense_path_low_precision(dtype, tol, case, dense, small_windows) -> None:
    segs, dils, kw = _kw(case)
    seed = random.randrange(2**31)
    n = kw["cu_seqlens"][-1] if kw["cu_seqlens"] else random.Random(seed).randrange(33, 140)
    q, k, v, go, _ = _inputs(3, n, 24, 6, 16, dtype, "cpu", seed)
    got = _run(q, k, v, go, segs, dils, **kw)
    assert got[0].dtype == dtype and got[1].dtype == F32 and got[2].dtype == dtype
    _check(got, _oracle(q, k, v, go, segs, dils, **kw), 2 * tol, f"{case} {dtype} seed {seed}")


def test_windows_give_the_same_results(dense, monkeypatch) -> None:
    segs, dils, kw = _kw("longnet-causal")
    q, k, v, go, _ = _inputs(2, 150, 4, 2, 8, F64, "cpu", seed=11)
    whole = _run(q, k, v, go, segs, dils, **kw)
    monkeypatch.setenv(config.SPAN_ROWS, "1")
    route = _routes(q, k, v, segs, dils, kw)[0]
    assert [w.length for w in route.spans.spans] == [32, 32, 32, 32, 22]
    windowed = _run(q, k, v, go, segs, dils, **kw)
    for a, b in zip(windowed, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_batch_rows_that_do_not_merge_with_segments(dense) -> None:
    """n = 70 with segments of 16: the batch stride is no multiple of the
    segment stride, so the full-segment calls run once per batch row."""
    q, k, v, go, _ = _inputs(3, 70, 4, 2, 8, F64, "cpu", seed=3)
    got = _run(q, k, v, go, [16, 32], [1, 2])
    _check(got, _oracle(q, k, v, go, [16, 32], [1, 2]), 1e-10, "n = 70")


def test_non_contiguous_inputs(dense) -> None:
    """(B, H, n, d) tensors transposed to (B, n, H, d): the views take any
    strides with a contiguous head dim."""
    q, k, v, go, _ = _inputs(2, 50, 4, 4, 8, F64, "cpu", seed=5)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    got = _run(qt, kt, vt, go, [8, 16], [1, 2], causal=True)
    _check(got, _oracle(q, k, v, go, [8, 16], [1, 2], causal=True), 1e-10, "transposed")


def _placed(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` ``(B, n, h, d)`` copied into a layout: ``contiguous``,
    ``offset`` (the same strides, 3 elements into its storage), ``transposed``
    (a ``(B, h, n, d)`` tensor transposed) or ``packed`` (one of two
    tensors interleaved along a dimension after the heads)."""
    if layout == "contiguous":
        return t.clone().contiguous()
    if layout == "offset":
        return torch.zeros(t.numel() + 3, dtype=t.dtype)[3:].view(t.shape).copy_(t)
    if layout == "transposed":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return torch.stack([torch.zeros_like(t), t], dim=3)[:, :, :, 1]


def test_views_are_built_again_for_every_layout(dense, small_windows) -> None:
    """The cached views of a pass are keyed by every tensor's shape, strides,
    storage offset, dtype and device and by the route (pattern, plan): one
    process runs the same shapes in layout after layout, pattern after
    pattern, each checked against the oracle, each a new entry."""
    segs, dils = [8, 16, 32], [1, 2, 4]
    q0, k0, v0, go0, _ = _inputs(2, 70, 6, 2, 8, F64, "cpu", seed=13)
    runs = [  # (q, k, v, grad_out layouts), Pattern keywords, dtype, new entries
        (("contiguous",) * 4, {}, F64, 2),  # forward, backward
        (("contiguous", "packed", "packed", "contiguous"), {}, F64, 2),  # K/V strides
        (("offset", "contiguous", "offset", "contiguous"), {}, F64, 2),  # storage offsets
        (("contiguous", "contiguous", "contiguous", "transposed"), {}, F64, 1),  # grad_out's
        (("transposed", "offset", "packed", "packed"), {}, F64, 2),
        (("contiguous",) * 4, {"causal": True}, F64, 2),  # the pattern
        (("contiguous",) * 4, {"head_offsets": "grouped"}, F64, 2),
        (("contiguous",) * 4, {}, F32, 2),  # the dtype alone
        (("contiguous",) * 4, {}, F32, 0),  # the same again: no new entry
    ]
    branches._PROGRAMS.clear()
    for layouts, kw, dtype, new in runs:
        misses = branches._PROGRAMS.misses
        q, k, v, go = (
            _placed(t.to(dtype), x) for t, x in zip((q0, k0, v0, go0), layouts, strict=True)
        )
        for t in (q, k, v):
            t.requires_grad_()
        out, lse = ra.dilated_attention(q, k, v, segs, dils, return_lse=True, **kw)
        got = (out.detach(), lse.detach(), *torch.autograd.grad(out, (q, k, v), go))
        want = _oracle(q0, k0, v0, go0, segs, dils, **kw)
        _check(got, want, 1e-10 if dtype == F64 else 2e-5, f"{layouts} {kw} {dtype}")
        assert branches._PROGRAMS.misses == misses + new, (layouts, kw, dtype)
    x = q0.clone()
    keys = [branches.layout_key((t,)) for t in (x, x.float(), x.to("meta"), _placed(x, "offset"))]
    assert len(set(keys)) == 4


def test_gradcheck_dense_path(dense, small_windows) -> None:
    q, k, v, _, _ = _inputs(1, 30, 3, 3, 4, F64, "cpu", seed=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        return ra.dilated_attention(q, k, v, [8, 16], [1, 2], causal=True)

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("forward", ["dense", "kernel"])
def test_lse_gradient_takes_the_kernel(forward, dense, monkeypatch) -> None:
    """A gradient reaching lse: our backward kernel, still exact (after the
    dense forward or ours)."""
    monkeypatch.setenv(config.FORWARD, forward)
    segs, dils, kw = _kw("gqa-r6")
    q, k, v, go, glse = _inputs(2, 60, 24, 6, 8, F64, "cpu", seed=4)
    got = _run(q, k, v, go, segs, dils, glse, **kw)
    _check(got, _oracle(q, k, v, go, segs, dils, glse, **kw), 1e-10, "lse gradient")


def test_masks_take_the_kernel(dense) -> None:
    q, k, v, _, _ = _inputs(2, 50, 4, 4, 8, F64, "cpu", seed=4)
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[:, 3] = True
    pattern = Pattern([8, 16], [1, 2])
    r = dispatch.route("forward", q, k, v, pattern, mask)
    assert not r.dense and "key padding mask" in r.why


@pytest.mark.parametrize("dtype", [torch.bfloat16, F32, F64])
def test_kv_finite(dtype) -> None:
    """One NaN or infinity anywhere in K or V is seen (both signs, and +inf
    with -inf, whose sum is NaN); large finite values are finite."""
    g = torch.Generator().manual_seed(3)
    k, v = (1e4 * torch.randn(2, 37, 3, 8, generator=g).to(dtype) for _ in range(2))
    assert backends.KvFinite(k, v)
    for bads in ([float("nan")], [float("inf")], [-float("inf")], [float("inf"), -float("inf")]):
        for t in ("k", "v"):
            kb, vb = k.clone(), v.clone()
            for i, bad in enumerate(bads):
                (kb if t == "k" else vb)[1, 5 + 7 * i, 2, 3] = bad
            assert not backends.KvFinite(kb, vb), (t, bads)
    # finite values whose fp32 sum overflows read as non-finite: our kernels
    # then run, which is exact anyway
    if dtype != F64:
        assert not backends.KvFinite(torch.full((4, 8), 3e38, dtype=F32).to(dtype), v)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("causal", [False, True])
def test_non_finite_keys_take_the_kernel(bad, where, causal, dense, monkeypatch) -> None:
    """A non-finite key or value row: exactly our kernel's answer, forward and
    backward (a dense kernel spreads it through the zero weights of masked
    keys)."""
    segs, dils = [8, 16, 32], [1, 2, 4]
    q, k, v, go, _ = _inputs(2, 45, 3, 3, 8, F64, "cpu", seed=5)
    (k if where == "k" else v)[:, 20] = bad
    got = _run(q, k, v, go, segs, dils, causal=causal)
    monkeypatch.setenv(config.FORWARD, "kernel")
    monkeypatch.setenv(config.BACKWARD, "kernel")
    want = _run(q, k, v, go, segs, dils, causal=causal)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_compiled_calls_keep_the_operator(dense, monkeypatch) -> None:
    """Under torch.compile the graph holds the operator (its autograd, its
    Meta kernel): out and gradients are the kernel's, bit for bit."""
    q, k, v, go, _ = _inputs(1, 64, 2, 2, 8, F32, "cpu", seed=8)
    qc = q.clone().requires_grad_()
    f = torch.compile(lambda q: ra.dilated_attention(q, k, v, [16, 32], [1, 2]), fullgraph=True)
    out = f(qc)
    (got,) = torch.autograd.grad(out, qc, go)
    monkeypatch.setenv(config.FORWARD, "kernel")
    monkeypatch.setenv(config.BACKWARD, "kernel")
    qe = q.clone().requires_grad_()
    out_e = ra.dilated_attention(qe, k, v, [16, 32], [1, 2])
    (want,) = torch.autograd.grad(out_e, qe, go)
    torch.testing.assert_close(out, out_e, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_double_backward_raises(dense) -> None:
    q, k, v, _, _ = _inputs(1, 24, 2, 2, 4, F64, "cpu", seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        return ra.dilated_attention(q, k, v, [8], [2])

    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.gradgradcheck(fn, (q, k, v))


@pytest.mark.parametrize("shape", [(0, 40, 4, 8), (2, 0, 4, 8)])
def test_empty_inputs_take_the_kernel(shape, dense) -> None:
    b, n, h, d = shape
    q = torch.randn(b, n, h, d, dtype=F64, requires_grad=True)
    k, v = (torch.randn(b, n, 2, d, dtype=F64, requires_grad=True) for _ in range(2))
    assert not dispatch.route("forward", q, k, v, Pattern([8, 16], [1, 2]), None).dense
    out, lse = ra.dilated_attention(q, k, v, [8, 16], [1, 2], return_lse=True)
    assert out.shape == q.shape and lse.shape == (b, h, n)
    (out.sum() + lse.clamp_min(0).sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_cpu_default_is_the_kernel_and_modes_are_checked(monkeypatch) -> None:
    q, k, v, _, _ = _inputs(1, 24, 2, 2, 4, F32, "cpu", seed=7)
    q.requires_grad_()
    pattern = Pattern([8], [2])
    for env in (config.FORWARD, config.BACKWARD, config.DENSE_BACKEND, config.SPAN_ROWS):
        monkeypatch.delenv(env, raising=False)
    for p in ("forward", "backward"):
        r = dispatch.route(p, q, k, v, pattern, None)
        assert not r.dense and "no row of the path table" in r.why
    monkeypatch.setenv(config.BACKWARD, "dense")
    assert dispatch.route("backward", q, k, v, pattern, None).dense
    for env, bad in (
        (config.FORWARD, "sdpa"),
        (config.BACKWARD, "fast"),
        (config.DENSE_BACKEND, "efficient"),
        (config.SPAN_ROWS, "0"),
        (config.SPAN_ROWS, "1e5"),
    ):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=f"{env} must be"):
            ra.dilated_attention(q, k, v, [8], [2])
        monkeypatch.delenv(env)


def test_phase_times(dense) -> None:
    q, k, v, go, _ = _inputs(1, 64, 2, 2, 8, F32, "cpu", seed=9)
    with branches.phase_times() as t:
        _run(q, k, v, go, [16, 32], [1, 2])
    totals = t.totals()
    assert set(totals) == {"calls", "merge", "finite"} and all(x > 0 for x in totals.values())


# --------------------------------------------------------------------------- #
# the tables, as CUDA would see them (no GPU needed: decide() takes the values)
# --------------------------------------------------------------------------- #
LONGNET = Pattern([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12])
CUDA_DEV = torch.device("cuda")


def _decide(pass_, d=128, n=131072, dtype=BF16, mode="auto", named="auto", cc=(9, 0), **kw):
    heads, kv_heads = kw.get("heads", 16), kw.get("kv_heads", 16)
    pattern = kw.get("pattern", LONGNET)
    return dispatch.decide(
        pass_, mode, named, 131072, CUDA_DEV, cc, dtype, n, heads, kv_heads, d, pattern
    )


def test_the_path_table() -> None:
    # forward: dense at head_dim 128 at any length, at head_dim 64 from 131072
    # rows, our kernel elsewhere (H200, 2026-11-27)
    assert _decide("forward").dense
    assert _decide("forward", n=32768).dense
    assert _decide("forward", d=64).dense
    assert not _decide("forward", d=64, n=131071).dense
    assert not _decide("forward", d=96).dense
    # backward: dense for fp16 / bf16 wherever a backend runs it
    assert _decide("backward", d=64, n=32768).dense
    assert _decide("backward", dtype=F16, n=1000, d=96).dense
    r = _decide("backward", dtype=F32)
    assert not r.dense and "no row of the path table" in r.why
    # fp32 forced dense on CUDA: no backend takes it
    r = _decide("backward", dtype=F32, mode="dense")
    assert not r.dense and "no dense backend" in r.why
    # before sm_80: no backend
    assert not _decide("backward", cc=(7, 5)).dense


def test_the_backend_table() -> None:
    fa4 = dispatch.fa4_missing() is None
    r = _decide("backward", kv_heads=4)
    assert r.dense and {b for w in r.backends for b in w} == {"fa4" if fa4 else "flash"}
    # cuDNN (rows a multiple of 128, no GQA): tests/test_dense_backends.py
    # head_dim 80: not flash-attn-4's, FlashAttention-2's
    r = _decide("backward", d=80)
    assert {b for w in r.backends for b in w} == {"flash"}
    # head_dim 136 (> 128, not FA2's multiple of 8 rule... it is: 136 % 8 == 0)
    assert _decide("backward", d=136).dense
    assert not _decide("backward", d=130).dense
    # too many calls (documents): our kernel
    docs = Pattern([64], [2]).with_documents(list(range(0, 8192 * 10 + 1, 10)))
    r = _decide("backward", n=81920, pattern=docs)
    assert not r.dense and "dense calls a pass" in r.why


def test_knobs_are_read_only_by_config_and_listed_in_the_design() -> None:
    reads = re.compile(r"(environ\.get|environ\[|getenv)\(?\s*[\"']RING_ATTENTION_")
    offenders = []
    for path in [*ROOT.glob("ring_attention/**/*.py"), *ROOT.glob("benchmarks/*.py")]:
        if path.name != "config.py" and reads.search(path.read_text()):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == [], "RING_ATTENTION_* read outside ring_attention/core/config.py"
    design = (ROOT / "docs" / "design.md").read_text()
    table = design[design.index("| Python knob |") :]
    table = table[: table.index("\n\n")]
    listed = re.findall(r"^\| `(RING_ATTENTION_\w+)` \| (.+?) \| `?(.+?)`? \|", table, re.M)
    assert [(name, values) for name, values, _ in listed] == [
        (k.name, k.values) for k in config.KNOBS
    ]


def test_info_prints_the_route(capsys, monkeypatch) -> None:
    for env in (config.FORWARD, config.BACKWARD, config.DENSE_BACKEND):
        monkeypatch.delenv(env, raising=False)
    info.main(["--seq-len", "131072", "--device", "cuda", "--capability", "9.0"])
    text = capsys.readouterr().out
    assert "forward: dense per branch" in text and "backward: dense per branch" in text
    assert "19 dense calls a pass" in text and "branch 4 (w 32768, r 12): 6 calls" in text
    # no options: the LongNet pattern at 131072 tokens, 16 x 128, bf16 on CUDA
    # (sm_90 where there is none), the defaults said, and per branch the
    # backend each call takes and why the ones before it in the table cannot
    assert info.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("defaults: --seq-len 131072, --heads 16,"), lines[0]
    assert lines[1].startswith("local op, n = 131072, 16 query / 16 K/V heads, head_dim 128, "
                               "bfloat16 on cuda (sm_")  # fmt: skip
    if dispatch.fa4_missing() is None:
        assert "  backward: fa4 x 1 (fa4: chosen)" in lines, lines
    elif not torch.cuda.is_available():  # cuDNN assumed, and said
        assert "cuDNN assumed present" in lines[0]
        assert "  backward: cudnn x 1 (fa4: not installed; cudnn: chosen)" in lines, lines
        assert ("  forward: flash x 2 (fa4: not installed; cudnn: call rows 2730 not a multiple "
                "of 128; flash: chosen)") in lines, lines  # fmt: skip
    info.main(["--seq-len", "4096", "--device", "cpu", "--dtype", "float32", "--head-dim", "64"])
    text = capsys.readouterr().out
    assert "forward: our kernel: auto: no row" in text


# --------------------------------------------------------------------------- #
# CUDA
# --------------------------------------------------------------------------- #
@CUDA
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_dense_path_on_cuda_matches_oracle(case, dtype, dense, small_windows) -> None:
    segs, dils, kw = _kw(case)
    seed = random.randrange(2**31)
    n = kw["cu_seqlens"][-1] if kw["cu_seqlens"] else random.Random(seed).randrange(70, 300)
    q, k, v, go, _ = _inputs(2, n, 24, 6, 64, dtype, "cuda", seed)
    assert all(r.dense for r in _routes(q, k, v, segs, dils, kw))
    got = _run(q, k, v, go, segs, dils, **kw)
    _check(got, _oracle(q, k, v, go, segs, dils, **kw), 2e-2, f"{case} {dtype} seed {seed}")


@pytest.mark.parametrize("case", ["longnet", "documents-causal-grouped", "head-groups"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "h0", "h1"), [(6, 2, 1, 4), (24, 6, 5, 18), (5, 5, 2, 5)]
)
def test_head_ranges_take_the_dense_path_and_match_the_oracle(
    dense, small_windows, case, heads, kv_heads, h0, h1
):
    """A call holding query heads ``[h0, h1)`` of all (a Ulysses rank's)
    runs the per-branch dense path with the global heads' offsets, groups
    and K/V heads, forward and backward, equal to the oracle's rows."""
    segs, dils, kw, cu = CASES[case]
    q, k, v, go, _ = _inputs(2, cu[-1] if cu else 41, heads, kv_heads, 8, F64, "cpu", 7)
    group = heads // kv_heads
    kv0, kv1 = h0 // group, (h1 - 1) // group + 1
    go_r = torch.zeros_like(go)
    go_r[:, :, h0:h1] = go[:, :, h0:h1]
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    want, want_lse = reference_attention(
        q2, k2, v2, segs, dils, causal=kw.get("causal", False),
        head_groups=kw.get("head_groups", False),
        grouped_offsets=kw.get("head_offsets") == "grouped", cu_seqlens=cu,
    )  # fmt: skip
    (want * go_r).sum().backward()
    qs, ks, vs = (t[:, :, a:b].contiguous().requires_grad_()
                  for t, a, b in ((q, h0, h1), (k, kv0, kv1), (v, kv0, kv1)))  # fmt: skip
    call, _ = prepare(qs, ks, vs, Pattern(segs, dils, **kw), cu_seqlens=cu,
                      head_range=(h0, heads, kv_heads))  # fmt: skip
    route = dispatch.route("forward", qs, ks, vs, call.pattern, None, (h0, heads, kv_heads))
    assert route.dense, route.why
    out, lse = engine.attend(call, qs, ks, vs)
    (out * go[:, :, h0:h1]).sum().backward()
    for got, ref in ((out, want[:, :, h0:h1]), (lse, want_lse[:, h0:h1]),
                     (qs.grad, q2.grad[:, :, h0:h1]), (ks.grad, k2.grad[:, :, kv0:kv1]),
                     (vs.grad, v2.grad[:, :, kv0:kv1])):  # fmt: skip
        torch.testing.assert_close(got.detach(), ref.detach(), atol=1e-10, rtol=1e-10)


DENSE_CALL = "_scaled_dot_product_flash_attention_for_cpu"
READ = "_local_scalar_dense"  # a host read of a tensor's value (.item(), bool())


def test_finiteness_read_once_a_call_after_the_dense_work(dense) -> None:
    """The K/V check is read once a call (forward and backward together), and
    only once the forward's dense calls and merges are queued: the host never
    waits for the device before it has queued the pass (on CUDA the read
    waits for the check alone). Before, the read came first, a sync ahead of
    every dense call."""
    q, k, v, go, _ = _inputs(2, 64, 4, 2, 8, F32, "cpu", seed=9)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with OpLog() as log:
        out = ra.dilated_attention(q, k, v, [8, 16, 32], [1, 2, 4])
        forward = len(log.ops)
        out.backward(go)
    reads = [i for i, op in enumerate(log.ops) if op == READ]
    assert len(reads) == 1, reads
    work = (DENSE_CALL, "merge_branches")
    last_work = max(i for i, op in enumerate(log.ops[:forward]) if op in work)
    assert last_work < reads[0] < forward
    assert log.ops.count(DENSE_CALL) > 3  # the forward's branches, then the backward's


@pytest.mark.parametrize("pattern", [([64], [1]), ([16, 32], [1, 2])], ids=["dense", "local"])
@pytest.mark.parametrize("bad", [False, True])
def test_ring_block_reads_its_check_after_its_dense_call(pattern, bad, dense) -> None:
    """A ring block's K/V check is read once, after the block's dense calls
    are queued (never before: no sync ahead of them); with a NaN in V the
    dense result is dropped and the block kernel's merged instead, bit for
    bit what the kernel alone gives."""
    call = Call(Pattern(*pattern, causal=True), 8**-0.5)
    q, k, v, go, _ = _inputs(1, 32, 2, 2, 8, F32, "cpu", seed=10)
    go = go.to(F32)
    if bad:
        v[0, 5, 1, 2] = float("nan")
    blk = ring_blocks(call, "forward", q, k, 64, (0, 32, 64), 32)
    assert blk.dense is not None
    out = torch.zeros(1, 32, 2, 8)
    lse = torch.full((1, 2, 32), -math.inf)
    with OpLog() as log:
        blk.forward(q, k, v, out, lse, 32, 32)
    reads = [i for i, op in enumerate(log.ops) if op == READ]
    calls = [i for i, op in enumerate(log.ops) if op == DENSE_CALL]
    assert len(reads) == 1 and calls and max(calls) < reads[0], log.ops
    want_out, want_lse = torch.zeros(1, 32, 2, 8), torch.full((1, 2, 32), -math.inf)
    if bad:
        ops.block_forward(q, k, v, want_out, want_lse, 32, 32, blk.args, None)
    else:
        merge_into(want_out, want_lse, *_dense_block(blk, q, k, v))
    torch.testing.assert_close(out, want_out, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0, equal_nan=True)
    # the backward: the same order, the kernel's gradients where V is bad
    blk = ring_blocks(call, "backward", q, k, 64, (0, 32, 64), 32)
    o = out.to(q.dtype)
    grads = [torch.zeros(1, 32, 2, 8) for _ in range(3)]
    with OpLog() as log:
        blk.backward(go, None, q, k, v, o, lse, *grads, 32, 32)
    reads = [i for i, op in enumerate(log.ops) if op == READ]
    calls = [i for i, op in enumerate(log.ops) if op == DENSE_CALL + "_backward"]
    assert len(reads) == 1 and calls and max(calls) < reads[0], log.ops
    if bad:
        want = [torch.zeros(1, 32, 2, 8) for _ in range(3)]
        ops.block_backward(go, None, q, k, v, o, lse, *want, 32, 32, blk.args, None)
        for a, b in zip(grads, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _dense_block(blk, q, k, v):
    """The dense result of a diagonal block as the tree before the lazy check
    computed it (no check: K/V finite)."""
    if blk.backend is None:
        r = dispatch.route("forward", q, k, v, blk.pattern, None)
        return branches.dense_forward(q, k, v, blk.pattern, blk.scale, r)
    o = torch.empty(1, 2, 32, 8)
    bl = torch.empty(1, 2, 32)
    blk.backend.forward(q, k, v, True, blk.scale, o, bl)
    return o.transpose(1, 2), bl


class _Targets:
    """The CPU stand-in backend, recording the storage each forward call
    writes its output into, and the branches' call count."""

    name = "cpu"

    def __init__(self, inner) -> None:
        self.inner = inner
        self.storages: list[int] = []

    def forward(self, q, k, v, causal, scale, out, lse) -> None:
        self.storages.append(out.untyped_storage().data_ptr())
        self.inner.forward(q, k, v, causal, scale, out, lse)

    def backward(self, *args) -> None:
        self.inner.backward(*args)


@pytest.mark.parametrize("batch,span_rows", [(1, "1"), (2, "100000"), (2, "1")])
def test_branch_zero_writes_into_out(batch, span_rows, dense, monkeypatch) -> None:
    """The forward's branch-0 calls write straight into ``out``; the part
    buffer holds the other branches' rows only, branch 0's LSE after
    theirs. Out and lse match the oracle (bit-identity with the tree
    before: a test-only comparison, see the commit)."""
    in_place = True
    monkeypatch.setenv(config.SPAN_ROWS, span_rows)
    pattern = Pattern([8, 16, 32], [1, 2, 4])
    q, k, v, _, _ = _inputs(batch, 96, 4, 2, 8, F64, "cpu", seed=12)
    r = dispatch.route("forward", q, k, v, pattern, None)
    assert r.dense and (len(r.spans.spans) > 1) == (span_rows == "1")
    prog = branches._program("forward", r, q, k, v, torch.empty_like(q))
    for (rows, lse_rows, _, into, launches), span in zip(prog.spans, r.spans.spans, strict=True):
        others = sum(c.part_rows(batch) for c in span.calls if c.branch)
        assert into == in_place
        assert rows == (others if in_place else lse_rows)
        assert lse_rows == sum(c.part_rows(batch) for c in span.calls)
        assert any(t for (_, t), *_ in launches) == in_place
    targets = _Targets(backends.BACKENDS["cpu"])
    monkeypatch.setitem(backends.BACKENDS, "cpu", targets)
    out, lse = branches.dense_forward(q, k, v, pattern, 8**-0.5, r)
    into_out = targets.storages.count(out.untyped_storage().data_ptr())
    first = sum(1 for (_, t), *_ in (x for s in prog.spans for x in s[4]) if t)
    assert into_out == first and (first > 0) == in_place
    want_out, want_lse = reference_attention(q, k, v, [8, 16, 32], [1, 2, 4])
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-10)
