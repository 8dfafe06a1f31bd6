"""The local op's forward and backward through PyTorch's fused SDPA per branch
(ring_attention/sdpa_branches.py), against the float64 oracle.

On the CPU the paths run only when asked for (``RING_ATTENTION_FORWARD=sdpa``,
``RING_ATTENTION_BACKWARD=sdpa``, with PyTorch's CPU flash attention); on CUDA
the backward is the default for fp16/bf16 (every CUDA SDPA backend is
checked), the forward at head_dim 128 from n = 131072 on.
"""

from __future__ import annotations

import random

import pytest
import torch
from oracle import reference_attention

import ring_attention as ra
from ring_attention import sdpa_branches

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
    monkeypatch.setenv(sdpa_branches.BACKWARD_ENV, "sdpa")


@pytest.fixture
def sdpa_forward_mode(monkeypatch):
    monkeypatch.setenv(sdpa_branches.FORWARD_ENV, "sdpa")


@pytest.fixture
def small_windows(monkeypatch):
    """Windows of one longest segment: several windows at test sizes."""
    monkeypatch.setattr(sdpa_branches, "_MIN_WINDOW_ROWS", 1)
    monkeypatch.setattr(sdpa_branches, "_WINDOWS", 10**9)


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


def _check(got, want, tol, names=("out", "dq", "dk", "dv"), seed=None):
    for name, a, b in zip(names, got, want, strict=True):
        a = a.to("cpu", F64)
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e} (seed {seed})"


def _forward(q, k, v, segs, dils, **kw):
    return ra.dilated_attention(q, k, v, segs, dils, return_lse=True, **kw)


def _oracle_forward(q, k, v, segs, dils, **kw):
    kw = dict(kw)
    kw["grouped_offsets"] = kw.pop("head_offsets", "modulo") == "grouped"
    return reference_attention(*(t.to("cpu", F64) for t in (q, k, v)), segs, dils, **kw)


def _check_lse(got, want, atol, seed):
    got = got.to("cpu", F64)
    unreached = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), unreached), f"seed {seed}: rows reaching no key"
    torch.testing.assert_close(got[~unreached], want[~unreached], rtol=0, atol=atol)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(5, 5), (6, 2), (3, 1)])
def test_sdpa_backward_matches_oracle_f64(case, heads, kv_heads, sdpa_mode, small_windows):
    segs, dils, kw = CASES[case]
    seed = random.randrange(2**31)
    n = random.Random(seed).randrange(33, 140)  # ragged: several windows, a short last one
    q, k, v, go = _inputs(n, heads, kv_heads, 16, F64, "cpu", seed)
    assert sdpa_branches.sdpa_backward_applies(
        q.requires_grad_(), k, v, ra.Pattern(segs, dils), None
    )
    _check(_grads(q, k, v, go, segs, dils, **kw), _oracle(q, k, v, go, segs, dils, **kw), 1e-10)


def test_windows_give_the_same_gradients(sdpa_mode, monkeypatch) -> None:
    segs, dils, kw = CASES["longnet-causal"]
    q, k, v, go = _inputs(150, 4, 2, 8, F64, "cpu", seed=11)
    whole = _grads(q, k, v, go, segs, dils, **kw)
    monkeypatch.setattr(sdpa_branches, "_MIN_WINDOW_ROWS", 1)
    monkeypatch.setattr(sdpa_branches, "_WINDOWS", 10**9)
    assert sdpa_branches._window_rows(150, 32) == 32
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
    assert not sdpa_branches.sdpa_backward_applies(qr, k, v, pattern, mask)
    assert not sdpa_branches.sdpa_backward_applies(
        qr, k, v, pattern.with_documents([0, 20, 50]), None
    )
    # segment lengths that do not nest, longer than one segment
    assert not sdpa_branches.sdpa_backward_applies(qr, k, v, ra.Pattern([6, 16], [1, 2]), None)
    assert sdpa_branches.sdpa_backward_applies(qr, k, v, ra.Pattern([6, 64], [1, 2]), None)


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
    monkeypatch.setenv(sdpa_branches.BACKWARD_ENV, "kernel")
    want = _grads(q, k, v, go, segs, dils, causal=causal)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_compiled_calls_keep_the_operator_autograd(
    sdpa_mode, sdpa_forward_mode, monkeypatch
) -> None:
    """Under torch.compile SDPA is not used: the graph holds the operator (its
    autograd, its Meta kernel), so out and gradients are the kernel's."""
    q, k, v, go = _inputs(64, 2, 2, 8, torch.float32, "cpu", seed=8)
    qc = q.clone().requires_grad_()
    f = torch.compile(lambda q: ra.dilated_attention(q, k, v, [16, 32], [1, 2]), fullgraph=True)
    out = f(qc)
    (got,) = torch.autograd.grad(out, qc, go)
    monkeypatch.setenv(sdpa_branches.BACKWARD_ENV, "kernel")
    monkeypatch.setenv(sdpa_branches.FORWARD_ENV, "kernel")
    qe = q.clone().requires_grad_()
    out_e = ra.dilated_attention(qe, k, v, [16, 32], [1, 2])
    (want,) = torch.autograd.grad(out_e, qe, go)
    torch.testing.assert_close(out, out_e, rtol=0, atol=0)
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
    monkeypatch.delenv(sdpa_branches.BACKWARD_ENV, raising=False)
    assert sdpa_branches.backward_mode() == "auto"
    assert not sdpa_branches.sdpa_backward_applies(q, k, v, pattern, None)
    monkeypatch.setenv(sdpa_branches.BACKWARD_ENV, "sdpa")
    assert sdpa_branches.sdpa_backward_applies(q, k, v, pattern, None)
    with torch.no_grad():
        assert not sdpa_branches.sdpa_backward_applies(q, k, v, pattern, None)
    monkeypatch.setenv(sdpa_branches.BACKWARD_ENV, "fast")
    with pytest.raises(ValueError, match="RING_ATTENTION_BACKWARD"):
        ra.dilated_attention(q, k, v, [8], [2])


# --------------------------------------------------------------------------- #
# the forward
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(5, 5), (6, 2), (3, 1)])
def test_sdpa_forward_matches_oracle_f64(case, heads, kv_heads, sdpa_forward_mode, small_windows):
    segs, dils, kw = CASES[case]
    seed = random.randrange(2**31)
    n = random.Random(seed).randrange(33, 140)  # ragged: several windows, a short last one
    q, k, v, _ = _inputs(n, heads, kv_heads, 16, F64, "cpu", seed)
    assert sdpa_branches.sdpa_forward_applies(q, k, v, ra.Pattern(segs, dils, **kw), None)
    out, lse = _forward(q, k, v, segs, dils, **kw)
    want_out, want_lse = _oracle_forward(q, k, v, segs, dils, **kw)
    _check([out], [want_out], 1e-12, names=("out",), seed=seed)
    _check_lse(lse, want_lse, 1e-12, seed)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_forward_low_precision(dtype, tol, causal, sdpa_forward_mode, small_windows):
    segs, dils, kw = [8, 16, 32], [1, 2, 4], {"causal": causal}
    seed = random.randrange(2**31)
    n = random.Random(seed).randrange(33, 140)
    q, k, v, _ = _inputs(n, 4, 2, 16, dtype, "cpu", seed)
    out, lse = _forward(q, k, v, segs, dils, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    want_out, want_lse = _oracle_forward(q, k, v, segs, dils, **kw)
    _check([out], [want_out], tol, names=("out",), seed=seed)
    _check_lse(lse, want_lse, 50 * tol, seed)


@pytest.mark.parametrize("backward", ["sdpa", "kernel"])
@pytest.mark.parametrize("case", ["longnet-causal", "head-groups"])
def test_sdpa_forward_gradients_match_oracle_f64(
    backward, case, sdpa_forward_mode, small_windows, monkeypatch
):
    """Gradients after the SDPA forward: SDPA's backward or our kernel's, given
    the merged out and lse the forward made."""
    monkeypatch.setenv(sdpa_branches.BACKWARD_ENV, backward)
    segs, dils, kw = CASES[case]
    seed = random.randrange(2**31)
    n = random.Random(seed).randrange(33, 140)
    q, k, v, go = _inputs(n, 4, 2, 8, F64, "cpu", seed)
    got = _grads(q, k, v, go, segs, dils, **kw)
    _check(got, _oracle(q, k, v, go, segs, dils, **kw), 1e-10, seed=seed)


@pytest.mark.parametrize("backward", ["sdpa", "kernel"])
def test_gradcheck_sdpa_forward(backward, sdpa_forward_mode, small_windows, monkeypatch) -> None:
    """out and lse both differentiated (lse's gradient takes our kernel)."""
    monkeypatch.setenv(sdpa_branches.BACKWARD_ENV, backward)
    q, k, v, _ = _inputs(40, 3, 3, 4, F64, "cpu", seed=12)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        return ra.dilated_attention(q, k, v, [8, 16], [1, 2], causal=True, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("causal", [False, True])
def test_non_finite_keys_take_the_kernel_forward(
    bad, where, causal, sdpa_forward_mode, monkeypatch
):
    """A non-finite key or value row: exactly our kernel's out and lse (SDPA
    would spread it through the zero weights of a causal tile's masked keys)."""
    segs, dils = [8, 16, 32], [1, 2, 4]
    q, k, v, _ = _inputs(45, 3, 3, 8, F64, "cpu", seed=13)
    (k if where == "k" else v)[:, 20] = bad
    got = _forward(q, k, v, segs, dils, causal=causal)
    monkeypatch.setenv(sdpa_branches.FORWARD_ENV, "kernel")
    want = _forward(q, k, v, segs, dils, causal=causal)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(0, 40, 4, 8), (2, 0, 4, 8)])
def test_empty_inputs_take_the_kernel(shape, sdpa_mode, sdpa_forward_mode) -> None:
    """No batch or no rows: the kernel's empty answers (the SDPA
    paths' row bookkeeping needs rows)."""
    b, n, h, d = shape
    q = torch.randn(b, n, h, d, dtype=F64, requires_grad=True)
    k, v = (torch.randn(b, n, 2, d, dtype=F64, requires_grad=True) for _ in range(2))
    pattern = ra.Pattern([8, 16], [1, 2])
    assert not sdpa_branches.sdpa_forward_applies(q, k, v, pattern, None)
    assert not sdpa_branches.sdpa_backward_applies(q, k, v, pattern, None)
    out, lse = ra.dilated_attention(q, k, v, [8, 16], [1, 2], return_lse=True)
    assert out.shape == q.shape and lse.shape == (b, h, n)
    (out.sum() + lse.clamp_min(0).sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_forward_mode_is_checked_and_cpu_default_is_the_kernel(monkeypatch) -> None:
    q, k, v, _ = _inputs(24, 2, 2, 4, torch.float32, "cpu", seed=14)
    pattern = ra.Pattern([8], [2])
    monkeypatch.delenv(sdpa_branches.FORWARD_ENV, raising=False)
    assert sdpa_branches.forward_mode() == "auto"
    assert not sdpa_branches.sdpa_forward_applies(q, k, v, pattern, None)
    monkeypatch.setenv(sdpa_branches.FORWARD_ENV, "sdpa")
    assert sdpa_branches.sdpa_forward_applies(q, k, v, pattern, None)
    mask = torch.zeros(2, 24, dtype=torch.bool)
    assert not sdpa_branches.sdpa_forward_applies(q, k, v, pattern, mask)
    assert not sdpa_branches.sdpa_forward_applies(
        q, k, v, pattern.with_documents([0, 10, 24]), None
    )
    assert not sdpa_branches.sdpa_forward_applies(q, k, v, ra.Pattern([6, 16], [1, 2]), None)
    monkeypatch.setenv(sdpa_branches.FORWARD_ENV, "fast")
    with pytest.raises(ValueError, match="RING_ATTENTION_FORWARD"):
        ra.dilated_attention(q, k, v, [8], [2])


@CUDA
@pytest.mark.parametrize("backend", sdpa_branches.SDPA_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_backward_on_cuda_matches_oracle(backend, case, dtype, monkeypatch, small_windows):
    monkeypatch.setenv(sdpa_branches.SDPA_BACKEND_ENV, backend)
    monkeypatch.delenv(sdpa_branches.BACKWARD_ENV, raising=False)  # auto: SDPA on CUDA
    segs, dils, kw = CASES[case]
    seed = random.randrange(2**31)
    n = random.Random(seed).randrange(70, 300)
    q, k, v, go = _inputs(n, 8, 4, 64, dtype, "cuda", seed)
    qr = q.clone().requires_grad_()
    assert sdpa_branches.sdpa_backward_applies(qr, k, v, ra.Pattern(segs, dils, **kw), None)
    got = _grads(q, k, v, go, segs, dils, **kw)
    _check(got, _oracle(q, k, v, go, segs, dils, **kw), 2e-2)
    monkeypatch.setenv(sdpa_branches.BACKWARD_ENV, "kernel")
    kernel = _grads(q, k, v, go, segs, dils, **kw)
    _check(got, [t.to("cpu", F64) for t in kernel], 2e-2)


@CUDA
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sdpa_backward_on_cuda_long_windows(head_dim, monkeypatch):
    """Several default-size windows (131072 rows each) on the GPU: the same
    gradients as our kernel."""
    monkeypatch.delenv(sdpa_branches.BACKWARD_ENV, raising=False)
    segs, dils = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12]
    q, k, v, go = _inputs(300_000, 2, 2, head_dim, torch.bfloat16, "cuda", seed=9)
    got = _grads(q, k, v, go, segs, dils)
    monkeypatch.setenv(sdpa_branches.BACKWARD_ENV, "kernel")
    want = _grads(q, k, v, go, segs, dils)
    _check(got, [t.to("cpu", F64) for t in want], 1e-2)


@CUDA
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_forward_on_cuda_matches_oracle(case, dtype, sdpa_forward_mode, small_windows):
    segs, dils, kw = CASES[case]
    seed = random.randrange(2**31)
    n = random.Random(seed).randrange(70, 300)
    q, k, v, _ = _inputs(n, 8, 4, 128, dtype, "cuda", seed)
    assert sdpa_branches.sdpa_forward_applies(q, k, v, ra.Pattern(segs, dils, **kw), None)
    out, lse = _forward(q, k, v, segs, dils, **kw)
    want_out, want_lse = _oracle_forward(q, k, v, segs, dils, **kw)
    _check([out], [want_out], 2e-2, names=("out",), seed=seed)
    _check_lse(lse, want_lse, 2e-2, seed)


@CUDA
def test_auto_forward_on_cuda_at_head_dim_128(monkeypatch):
    """auto takes SDPA's forward at head_dim 128 from n = 131072 on (several
    default-size windows here): the same out and lse as our kernel."""
    monkeypatch.delenv(sdpa_branches.FORWARD_ENV, raising=False)
    segs, dils = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12]
    q, k, v, _ = _inputs(300_000, 2, 2, 128, torch.bfloat16, "cuda", seed=15)
    assert sdpa_branches.sdpa_forward_applies(q, k, v, ra.Pattern(segs, dils), None)
    assert not sdpa_branches.sdpa_forward_applies(q[:, :131071], k, v, ra.Pattern(segs, dils), None)
    out, lse = _forward(q, k, v, segs, dils)
    monkeypatch.setenv(sdpa_branches.FORWARD_ENV, "kernel")
    want_out, want_lse = _forward(q, k, v, segs, dils)
    _check([out], [want_out.to("cpu", F64)], 1e-2, names=("out",))
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=2e-2)
