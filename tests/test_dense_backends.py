"""The dense backends' choice (ring_attention/local/dispatch.py's backend
table, as CUDA devices would see it) and the cuDNN backend's calls into ATen
(ring_attention/local/backends.py), on the CPU.

No GPU here: the cuDNN backend runs with ATen's two cuDNN operators replaced
by a float64 emulation that first hands the very same arguments to the real
operators' meta kernels (the schema: argument types, ``None`` where a tensor
may be undefined, keywords) and checks what cuDNN's ATen code reads (no bias,
no cumulative lengths, ``max_q``/``max_k``, no dropout, the logsumexp's form
and layout), then computes the call from the strides it was given. What it
cannot show is cuDNN's own arithmetic on a GPU: that is the GPU run's.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from oracle import reference_attention

import ring_attention as ra
from ring_attention.core import config
from ring_attention.core.pattern import Pattern
from ring_attention.local import backends, dispatch

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
CUDA_DEV = torch.device("cuda")
LONGNET = Pattern([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12])
NO_FA4 = (("fa4", "not installed"),)
NO_CUDNN = (("fa4", "not installed"), ("cudnn", "torch.backends.cudnn.enabled is False"))


# --------------------------------------------------------------------------- #
# the choice, per call, on fake CUDA devices
# --------------------------------------------------------------------------- #
def _decide(pass_="backward", d=128, n=131072, dtype=BF16, cc=(9, 0), missing=NO_FA4, **kw):
    return dispatch.decide(
        pass_, kw.get("mode", "auto"), kw.get("named", "auto"), 131072, CUDA_DEV, cc, dtype, n,
        kw.get("heads", 16), kw.get("kv_heads", 16), d, kw.get("pattern", LONGNET), (0, 0, 0),
        missing,
    )  # fmt: skip


def _calls(r):
    """``[(rows, q_heads, kv_heads, backend)]`` of every call of a dense route."""
    assert r.dense, r.why
    calls = [c for span in r.spans.spans for c in span.calls]
    names = [b for per_span in r.backends for b in per_span]
    return [(c.rows, c.q_heads, c.kv_heads, b) for c, b in zip(calls, names, strict=True)]


@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_without_fa4_rows_multiple_of_128_take_cudnn(pass_) -> None:
    calls = _calls(_decide(pass_))
    for rows, _, _, b in calls:
        assert b == ("cudnn" if rows % 128 == 0 else "flash"), (rows, b)
    # LongNet at 131072: branches 0-2 have 2048-row calls, branches 3-4
    # 2730/2731 (w / r not a multiple of 128)
    assert {rows for rows, *_ in calls if rows % 128 == 0} == {2048}
    assert {b for *_, b in calls} == {"cudnn", "flash"}
    why = [
        dispatch.choose_backend(pass_, "auto", CUDA_DEV, BF16, 128, (9, 0), rows, False, NO_FA4)
        for rows in (2048, 2730)
    ]  # fmt: skip
    assert why == [
        ("cudnn", "fa4: not installed"),
        ("flash", "fa4: not installed; cudnn: call rows 2730 not a multiple of 128"),
    ]


def test_fa4_goes_first_where_it_imports() -> None:
    assert {b for *_, b in _calls(_decide(missing=()))} == {"fa4"}
    # head_dim 80: not flash-attn-4's; cuDNN for the 2048-row calls
    for rows, _, _, b in _calls(_decide(d=80, missing=())):
        assert b == ("cudnn" if rows % 128 == 0 else "flash"), (rows, b)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"missing": NO_CUDNN}, "cudnn: torch.backends.cudnn.enabled is False"),
        ({"cc": (8, 0)}, "cudnn: needs sm_90"),
        ({"kv_heads": 4}, "cudnn: no grouped K/V heads"),
        ({"d": 136}, "cudnn: no head_dim 136"),
        ({"dtype": F16, "d": 64, "named": "flash"}, None),
    ],
)  # fmt: skip
def test_where_cudnn_cannot_run_flash_does_and_says_why(kw, why) -> None:
    calls = _calls(_decide(**kw))
    if "kv_heads" in kw:  # 16 query heads on 4 K/V heads: the grouped calls
        calls = [c for c in calls if c[1] != c[2]]
        assert 2048 in {rows for rows, *_ in calls}
    assert {b for *_, b in calls} == {"flash"}
    if why is not None:
        dtype, d, cc = kw.get("dtype", BF16), kw.get("d", 128), kw.get("cc", (9, 0))
        gqa, missing = "kv_heads" in kw, kw.get("missing", NO_FA4)
        args = ("backward", "auto", CUDA_DEV, dtype, d, cc, 2048, gqa, missing)
        name, reasons = dispatch.choose_backend(*args)
        assert name == "flash" and why in reasons.split("; "), reasons


def test_no_backend_for_fp32_says_each_reason() -> None:
    r = _decide(dtype=F32, mode="dense")
    assert not r.dense
    assert "fa4: no torch.float32; cudnn: no torch.float32; flash: no torch.float32" in r.why


def test_named_cudnn_goes_first_and_the_ring_blocks_take_the_table() -> None:
    for rows, hq, hk, b in _calls(_decide("forward", named="cudnn", kv_heads=4, missing=())):
        # grouped K/V heads or ragged rows: cuDNN cannot, the table's first that can
        assert b == ("cudnn" if rows % 128 == 0 and hq == hk else "fa4"), (rows, hq, hk, b)
    blocks = dispatch.decide_blocks
    args = ("backward", "auto", "auto", CUDA_DEV, (9, 0), BF16, 131072, 16, 16, 128)
    assert blocks(*args, 4096, NO_FA4).backends == (("cudnn",),)
    assert blocks(*args, 4000, NO_FA4).backends == (("flash",),)
    assert blocks(*args, 4096, NO_CUDNN).backends == (("flash",),)


def test_cudnn_missing_reads_torch_backends_cudnn(monkeypatch) -> None:
    cudnn = torch.backends.cudnn
    monkeypatch.setattr(cudnn, "is_available", lambda: False)
    assert "not available" in backends.cudnn_missing()
    monkeypatch.setattr(cudnn, "is_available", lambda: True)
    monkeypatch.setattr(cudnn, "version", lambda: 8907)
    assert backends.cudnn_missing() == "cuDNN 8907 older than 90000"
    monkeypatch.setattr(cudnn, "version", lambda: 91900)
    assert backends.cudnn_missing() is None
    assert dict(dispatch.unavailable()).get("cudnn") is None
    with cudnn.flags(enabled=False):
        assert backends.cudnn_missing() == "torch.backends.cudnn.enabled is False"
        assert dict(dispatch.unavailable())["cudnn"] == backends.cudnn_missing()


# --------------------------------------------------------------------------- #
# the cuDNN backend's calls, against an emulation of ATen's cuDNN operators
# --------------------------------------------------------------------------- #
def _meta(x):
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


def _scores(q, k, causal, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:  # top left, as cuDNN's causal mask (the calls have Lq == Lk)
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), -math.inf)
    return s


class FakeCudnn:
    """ATen's ``_scaled_dot_product_cudnn_attention`` and its backward as the
    cuDNN backend of torch 2.13 sees them, in float64 on the CPU: the real
    operators' meta kernels take the same arguments first. ``lse_rank``:
    the forward's logsumexp ``(B, H, S, 1)`` (4, torch 2.13's meta) or
    ``(B, H, S)`` with the backward unsqueezing it (3, another ATen
    revision): the backend must hand the backward the forward's form."""

    def __init__(self, lse_rank: int) -> None:
        self.lse_rank, self.calls = lse_rank, []

    def _scaled_dot_product_cudnn_attention(self, *args, **kw):
        real = torch.ops.aten._scaled_dot_product_cudnn_attention
        meta = real(*map(_meta, args), **kw)
        q, k, v, bias, want_lse, dropout, causal, debug = args
        assert set(kw) <= {"scale"}  # none: the backward's probe, 1 / sqrt(d)
        assert bias is None and want_lse is True and dropout == 0.0 and debug is False
        assert q.dim() == 4 and q.shape[1] == k.shape[1] == v.shape[1], "no GQA"
        s = _scores(q, k, causal, kw.get("scale") or q.shape[-1] ** -0.5)
        lse = s.logsumexp(-1)
        out = torch.softmax(s, -1) @ v.double()
        out = torch.empty_like(meta[0], device=q.device).copy_(out)
        lse = lse.float() if self.lse_rank == 3 else lse.float().unsqueeze(-1)
        assert self.lse_rank == 3 or lse.shape == meta[1].shape
        seed, offset = (torch.zeros((), dtype=torch.int64) for _ in range(2))
        self.calls.append("forward")
        return out, lse, None, None, q.shape[2], k.shape[2], seed, offset, None

    def _scaled_dot_product_cudnn_attention_backward(self, *args, **kw):
        real = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
        meta = real(*map(_meta, args), **kw)
        do, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, p, causal = args
        assert set(kw) == {"scale"} and kw["scale"] is not None
        # the dense path: no bias, no cumulative lengths (undefined tensors)
        assert bias is None and cum_q is None and cum_k is None and p == 0.0
        # cuDNN's graph takes s_q, s_kv from max_q, max_k
        assert (max_q, max_k) == (q.shape[2], k.shape[2])
        assert seed.dtype == offset.dtype == torch.int64 and seed.dim() == offset.dim() == 0
        assert lse.dtype == torch.float32 and lse.dim() == self.lse_rank, lse.shape
        stats = lse.unsqueeze(-1) if self.lse_rank == 3 else lse
        b, h, sq = q.shape[:3]
        assert stats.shape == (b, h, sq, 1)
        # (B, S, H) in memory: in cuDNN's ragged mode each batch entry starts
        # at cum_seqlen_q * stride(-2), right only for this layout
        assert stats.stride()[:3] == (sq * h, 1, h) or b == h == 1, stats.stride()
        scale = kw["scale"]
        pr = (_scores(q, k, causal, scale) - stats.double()).exp()
        do64, out64 = do.double(), out.double()
        ds = pr * (do64 @ v.double().transpose(-1, -2) - (do64 * out64).sum(-1, keepdim=True))
        grads = (ds @ k.double() * scale, ds.transpose(-1, -2) @ q.double() * scale,
                 pr.transpose(-1, -2) @ do64)  # fmt: skip
        self.calls.append("backward")
        return tuple(g.to(m.dtype) for g, m in zip(grads, meta, strict=True))


@pytest.fixture(params=[4, 3])
def fake_cudnn(request, monkeypatch):
    fake = FakeCudnn(request.param)
    monkeypatch.setattr(backends, "aten", SimpleNamespace(
        _scaled_dot_product_cudnn_attention=fake._scaled_dot_product_cudnn_attention,
        _scaled_dot_product_cudnn_attention_backward=(
            fake._scaled_dot_product_cudnn_attention_backward),
    ))  # fmt: skip
    backends._cudnn_side.cache_clear()
    yield fake
    backends._cudnn_side.cache_clear()


def _plain(q, k, v, causal, scale):
    """Float64 out ``(N, L, h, d)`` and lse ``(N, h, L)`` of one dense call."""
    s = _scores(q.transpose(1, 2), k.transpose(1, 2), causal, scale)
    lse = s.logsumexp(-1)
    return (torch.softmax(s, -1) @ v.transpose(1, 2)).transpose(1, 2), lse


@pytest.mark.parametrize(("lq", "lk", "causal"), [(128, 128, True), (128, 256, False)])
def test_cudnn_backend_calls_match_float64(fake_cudnn, lq, lk, causal) -> None:
    """One call on strided views (every other row of a longer sequence, heads
    1-3 of 5), a ring block's Lq != Lk too: out, lse, dq, dk, dv against
    float64 autograd, and the buffers' layouts the part buffers have."""
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(2, 2 * n, 5, 16, generator=g, dtype=F64) for n in (lq, lk, lk, lq)]
    q, k, v, do = (t[:, ::2, 1:4] for t in full)
    scale = 0.3
    cudnn = backends.backend("cudnn")
    out = torch.empty(2, 3, lq, 16, dtype=F64)
    lse = torch.empty(2, 3, lq, dtype=F64)
    cudnn.forward(q, k, v, causal, scale, out, lse)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want_out, want_lse = _plain(qr, kr, vr, causal, scale)
    torch.testing.assert_close(out.transpose(1, 2), want_out.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.detach(), rtol=1e-6, atol=0)  # cuDNN's is fp32
    dq = torch.empty(2, 3, lq, 16, dtype=F64)
    dk, dv = (torch.empty(2, 3, lk, 16, dtype=F64) for _ in range(2))
    cudnn.backward(do, q, k, v, out.transpose(1, 2), lse, causal, scale, dq, dk, dv)
    want = torch.autograd.grad((want_out * do).sum(), (qr, kr, vr))
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want, strict=True):
        err = ((got.transpose(1, 2) - w).norm() / w.norm()).item()
        assert err < 1e-6, f"{name}: relative error {err:.1e}"
    assert fake_cudnn.calls == ["forward", "forward", "backward"]  # the probe's forward once


@pytest.mark.parametrize(
    ("segs", "dils", "kw"),
    [([8, 16, 32], [1, 2, 4], {}), ([8, 32], [2, 3], {"causal": True}), ([16], [5], {})],
)
def test_dense_path_on_the_cudnn_backend_matches_oracle(fake_cudnn, monkeypatch, segs, dils,
                                                        kw) -> None:  # fmt: skip
    """The whole per-branch path (views, part buffers, merge, the merged out
    and lse handed to every call's backward) with the cuDNN backend in the
    CPU stand-in's place, against the float64 oracle."""
    monkeypatch.setenv(config.FORWARD, "dense")
    monkeypatch.setenv(config.BACKWARD, "dense")
    monkeypatch.setenv(config.SPAN_ROWS, "1")
    monkeypatch.setitem(backends.BACKENDS, "cpu", backends.AtenCudnn())
    seed = random.randrange(2**31)
    n = random.Random(seed).randrange(40, 100)
    g = torch.Generator().manual_seed(seed)
    q, k, v, go = (torch.randn(2, n, 5, 8, generator=g, dtype=F64) for _ in range(4))
    got = _grads(ra.dilated_attention, q, k, v, go, segs, dils, **kw)
    want = _grads(reference_attention, q, k, v, go, segs, dils, **kw)
    assert "forward" in fake_cudnn.calls and "backward" in fake_cudnn.calls
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        keep = torch.isfinite(b)
        err = ((a[keep] - b[keep]).norm() / b[keep].norm()).item()
        assert err < 1e-6, f"{name}: relative error {err:.1e} (seed {seed})"


def _grads(fn, q, k, v, go, segs, dils, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if fn is ra.dilated_attention:
        out, lse = fn(q, k, v, segs, dils, return_lse=True, **kw)
    else:
        out, lse = fn(q, k, v, segs, dils, **kw)
    return (out.detach(), lse.detach(), *torch.autograd.grad((out * go).sum(), (q, k, v)))
