"""The local op's backward through PyTorch's fused SDPA backward
(ring_attention/sdpa_backward.py), against the float64 oracle.

On the CPU the path runs only when asked for (``RING_ATTENTION_BACKWARD=sdpa``,
with PyTorch's CPU flash-attention backward); on CUDA it is the default for
fp16/bf16, and every CUDA SDPA backend is checked.
"""

from __future__ import annotations

import random

import pytest
import torch
from oracle import reference_attention

import ring_attention as ra
from ring_attention import sdpa_backward

F64 = torch.float64
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")

CASES = {  # name: (segments, dilations, keyword arguments)
    "longnet": ([8, 16, 32], [1, 2, 4], {}),
    "longnet-causal": ([8, 16, 32], [1, 2, 4], {"causal": True}),
    "head-groups": ([4, 12], [1, 3], {"head_groups": True}),
    "grouped-offsets-causal": ([8, 32], [2, 3], {"head_offsets": "grouped", "causal": True}),
    "one-branch-dilated": ([16], [5], {}),
}


@pytest.fixture
def sdpa_mode(monkeypatch):
    monkeypatch.setenv(sdpa_backward.BACKWARD_ENV, "sdpa")


@pytest.fixture
def small_windows(monkeypatch):
    """Windows of one longest segment: several windows at test sizes."""
    monkeypatch.setattr(sdpa_backward, "_MIN_WINDOW_ROWS", 1)
    monkeypatch.setattr(sdpa_backward, "_WINDOWS", 10**9)


def _inputs(n, heads, kv_heads, d, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n, heads, d, generator=g, dtype=F64)
    k, v = (torch.randn(2, n, kv_heads, d, generator=g, dtype=F64) for _ in range(2))
    go = torch.randn(2, n, heads, d, generator=g, dtype=F64)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, go)]


def _grads(q, k, v, go, segs, dils, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ra.dilated_attention(q, k, v, segs, dils, **kw)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), go))


def _oracle(q, k, v, go, segs, dils, **kw):
    kw = dict(kw)
    kw["grouped_offsets"] = kw.pop("head_offsets", "modulo") == "grouped"
    q, k, v = (t.detach().to("cpu", F64).requires_grad_() for t in (q, k, v))
    out, _ = reference_attention(q, k, v, segs, dils, **kw)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), go.to("cpu", F64)))


def _check(got, want, tol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        a = a.to("cpu", F64)
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(5, 5), (6, 2), (3, 1)])
def test_sdpa_backward_matches_oracle_f64(case, heads, kv_heads, sdpa_mode, small_windows):
    segs, dils, kw = CASES[case]
    seed = random.randrange(2**31)
    n = random.Random(seed).randrange(33, 140)  # ragged: several windows, a short last one
    q, k, v, go = _inputs(n, heads, kv_heads, 16, F64, "cpu", seed)
    assert sdpa_backward.sdpa_backward_applies(
        q.requires_grad_(), k, v, ra.Pattern(segs, dils), None
    )
    _check(_grads(q, k, v, go, segs, dils, **kw), _oracle(q, k, v, go, segs, dils, **kw), 1e-10)


def test_windows_give_the_same_gradients(sdpa_mode, monkeypatch) -> None:
    segs, dils, kw = CASES["longnet-causal"]
    q, k, v, go = _inputs(150, 4, 2, 8, F64, "cpu", seed=11)
    whole = _grads(q, k, v, go, segs, dils, **kw)
    monkeypatch.setattr(sdpa_backward, "_MIN_WINDOW_ROWS", 1)
    monkeypatch.setattr(sdpa_backward, "_WINDOWS", 10**9)
    assert sdpa_backward._window_rows(150, 32) == 32
    windowed = _grads(q, k, v, go, segs, dils, **kw)
    for a, b in zip(windowed, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_gradcheck_sdpa_backward(sdpa_mode, small_windows) -> None:
    q, k, v, _ = _inputs(40, 3, 3, 4, F64, "cpu", seed=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        return ra.dilated_attention(q, k, v, [8, 16], [1, 2], causal=True)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_lse_gradient_and_masks_take_the_kernel(sdpa_mode) -> None:
    """What SDPA's backward cannot express runs our kernel, still exact."""
    segs, dils = [8, 16], [1, 2]
    q, k, v, go = _inputs(50, 4, 4, 8, F64, "cpu", seed=4)
    # a gradient through lse
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ra.dilated_attention(qs, ks, vs, segs, dils, return_lse=True)
    g = torch.autograd.grad((out * go).sum() + lse.sum(), (qs, ks, vs))
    qo, ko, vo = (t.clone().requires_grad_() for t in (q, k, v))
    out_o, lse_o = reference_attention(qo, ko, vo, segs, dils)
    want = torch.autograd.grad((out_o * go).sum() + lse_o.sum(), (qo, ko, vo))
    for a, b in zip(g, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # a key padding mask and documents never take the SDPA path
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[:, 3] = True
    pattern = ra.Pattern(segs, dils)
    qr = q.clone().requires_grad_()
    assert not sdpa_backward.sdpa_backward_applies(qr, k, v, pattern, mask)
    assert not sdpa_backward.sdpa_backward_applies(
        qr, k, v, pattern.with_documents([0, 20, 50]), None
    )
    # segment lengths that do not nest, longer than one segment
    assert not sdpa_backward.sdpa_backward_applies(qr, k, v, ra.Pattern([6, 16], [1, 2]), None)
    assert sdpa_backward.sdpa_backward_applies(qr, k, v, ra.Pattern([6, 64], [1, 2]), None)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("causal", [False, True])
def test_non_finite_keys_take_the_kernel(bad, where, causal, sdpa_mode, monkeypatch):
    """A non-finite key or value row: exactly our kernel's answer (SDPA's
    backward would spread it through the zero weights of masked keys)."""
    segs, dils = [8, 16, 32], [1, 2, 4]
    q, k, v, go = _inputs(45, 3, 3, 8, F64, "cpu", seed=5)
    (k if where == "k" else v)[:, 20] = bad
    got = _grads(q, k, v, go, segs, dils, causal=causal)
    monkeypatch.setenv(sdpa_backward.BACKWARD_ENV, "kernel")
    want = _grads(q, k, v, go, segs, dils, causal=causal)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_compiled_calls_keep_the_operator_autograd(sdpa_mode, monkeypatch) -> None:
    """Under torch.compile the SDPA backward is not used: the graph holds the
    operator (its autograd, its Meta kernel), so gradients are the kernel's."""
    q, k, v, go = _inputs(64, 2, 2, 8, torch.float32, "cpu", seed=8)
    qc = q.clone().requires_grad_()
    f = torch.compile(lambda q: ra.dilated_attention(q, k, v, [16, 32], [1, 2]), fullgraph=True)
    (got,) = torch.autograd.grad(f(qc), qc, go)
    monkeypatch.setenv(sdpa_backward.BACKWARD_ENV, "kernel")
    qe = q.clone().requires_grad_()
    (want,) = torch.autograd.grad(ra.dilated_attention(qe, k, v, [16, 32], [1, 2]), qe, go)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_double_backward_raises(sdpa_mode) -> None:
    q, k, v, _ = _inputs(24, 2, 2, 4, F64, "cpu", seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        return ra.dilated_attention(q, k, v, [8], [2])

    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.gradgradcheck(fn, (q, k, v))


def test_mode_is_checked_and_cpu_default_is_the_kernel(monkeypatch) -> None:
    q, k, v, _ = _inputs(24, 2, 2, 4, torch.float32, "cpu", seed=7)
    q.requires_grad_()
    pattern = ra.Pattern([8], [2])
    monkeypatch.delenv(sdpa_backward.BACKWARD_ENV, raising=False)
    assert sdpa_backward.backward_mode() == "auto"
    assert not sdpa_backward.sdpa_backward_applies(q, k, v, pattern, None)
    monkeypatch.setenv(sdpa_backward.BACKWARD_ENV, "sdpa")
    assert sdpa_backward.sdpa_backward_applies(q, k, v, pattern, None)
    with torch.no_grad():
        assert not sdpa_backward.sdpa_backward_applies(q, k, v, pattern, None)
    monkeypatch.setenv(sdpa_backward.BACKWARD_ENV, "fast")
    with pytest.raises(ValueError, match="RING_ATTENTION_BACKWARD"):
        ra.dilated_attention(q, k, v, [8], [2])


@CUDA
@pytest.mark.parametrize("backend", sdpa_backward.SDPA_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_backward_on_cuda_matches_oracle(backend, case, dtype, monkeypatch, small_windows):
    monkeypatch.setenv(sdpa_backward.SDPA_BACKEND_ENV, backend)
    monkeypatch.delenv(sdpa_backward.BACKWARD_ENV, raising=False)  # auto: SDPA on CUDA
    segs, dils, kw = CASES[case]
    seed = random.randrange(2**31)
    n = random.Random(seed).randrange(70, 300)
    q, k, v, go = _inputs(n, 8, 4, 64, dtype, "cuda", seed)
    qr = q.clone().requires_grad_()
    assert sdpa_backward.sdpa_backward_applies(qr, k, v, ra.Pattern(segs, dils, **kw), None)
    got = _grads(q, k, v, go, segs, dils, **kw)
    _check(got, _oracle(q, k, v, go, segs, dils, **kw), 2e-2)
    monkeypatch.setenv(sdpa_backward.BACKWARD_ENV, "kernel")
    kernel = _grads(q, k, v, go, segs, dils, **kw)
    _check(got, [t.to("cpu", F64) for t in kernel], 2e-2)


@CUDA
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sdpa_backward_on_cuda_long_windows(head_dim, monkeypatch):
    """Several default-size windows (131072 rows each) on the GPU: the same
    gradients as our kernel."""
    monkeypatch.delenv(sdpa_backward.BACKWARD_ENV, raising=False)
    segs, dils = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12]
    q, k, v, go = _inputs(300_000, 2, 2, head_dim, torch.bfloat16, "cuda", seed=9)
    got = _grads(q, k, v, go, segs, dils)
    monkeypatch.setenv(sdpa_backward.BACKWARD_ENV, "kernel")
    want = _grads(q, k, v, go, segs, dils)
    _check(got, [t.to("cpu", F64) for t in want], 1e-2)
