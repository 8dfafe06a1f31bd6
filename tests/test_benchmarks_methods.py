"""The benchmarks' methods library (benchmarks/methods.py), in this process:
the exact work count against the oracle, the FlexAttention baseline's block
masks, and the flash-attn-4 baseline (its layouts and merge with the library
stood in by math; the real library on a GPU)."""

from __future__ import annotations

import random

import pytest
import torch
from oracle import multiplicity


@pytest.fixture(scope="module")
def methods():
    """benchmarks/methods.py (it imports only torch)."""
    from benchmarks import methods

    return methods


def test_pattern_pairs_equal_the_oracle(methods) -> None:
    """The exact pattern work (FLOP counts) equals the oracle's multiplicity
    matrix summed, whole sequence and any rows (a rank's pieces)."""
    rng = random.Random(7)
    for _ in range(40):
        n, heads = rng.randint(1, 200), rng.randint(1, 6)
        segs = [rng.randint(1, 260) for _ in range(rng.randint(1, 3))]
        dils = [rng.randint(1, min(w, 7)) for w in segs]
        causal = rng.random() < 0.5
        groups = heads >= len(segs) and rng.random() < 0.3
        m = multiplicity(n, heads, segs, dils, causal, groups)
        assert methods.pattern_pairs(n, heads, segs, dils, causal, groups, batch=3) == (
            3 * int(m.sum())
        )
        a, b = sorted(rng.sample(range(n + 1), 2)) if n > 1 else (0, n)
        rows = [(0, a), (b, n - b)]
        expect = int(m[:, :a].sum() + m[:, b:].sum())
        assert methods.pattern_pairs(n, heads, segs, dils, causal, groups, rows=rows) == expect


def test_flex_block_masks_cover_the_pattern(methods) -> None:
    """The analytic FlexAttention block masks never skip a reached block and
    never call a block full that is not (ragged n and segments included)."""
    for n, segs, dils in [(300, [64, 160], [1, 3]), (1000, [128, 384], [1, 6]),
                          (640, [640], [1]), (513, [100, 2048], [2, 12])]:  # fmt: skip
        for causal in (False, True):
            ours = methods.flex_block_state(n, segs, dils, causal, "cpu")
            ref = methods.reference_block_state(n, 12, segs, dils, causal, "cpu")
            assert ((ref > 0) <= (ours > 0)).all()
            assert ((ours == 2) <= (ref == 2)).all()
            assert (ref > 0).any()


class _FA4StandIn:
    """flash-attn-4's calling convention ((B, L, H, D) in and out, lse (B, H, L)
    float32, a backward from a given out / lse) over plain float32 math: what
    the fa4 baseline's own code (layouts, LSE, merge) is checked against on a
    machine where flash-attn-4 cannot run."""

    def __init__(self, sdpa) -> None:
        self.m = sdpa  # benchmarks/sdpa.py: its math reference
        self.calls = 0

    def flash_attn_func(self, q, k, v, *, softmax_scale, causal, return_lse):
        assert return_lse and q.dim() == 4 and q.stride(-1) == 1
        self.calls += 1
        out, lse = self.m._math_fwd(*(t.transpose(1, 2) for t in (q, k, v)), causal, softmax_scale)
        return out.transpose(1, 2), lse

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale, causal):
        assert lse.dtype == torch.float32 and lse.is_contiguous()
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        grads = self.m._math_bwd(
            *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, causal, softmax_scale
        )
        return tuple(g.transpose(1, 2) for g in grads)


@pytest.mark.parametrize("causal", [False, True])
def test_fa4_baseline_layout_and_merge(methods, monkeypatch, causal: bool) -> None:
    """gather + flash-attn-4 computes ra.dilated_attention, forward and
    gradients (with flash-attn-4's calling convention stood in by math: the
    adapter's transposes and LSE shapes are what this checks; a run of the
    real library is the CUDA test below)."""
    import ring_attention as ra
    from benchmarks import sdpa
    from ring_attention.local import backends  # where the gather baseline looks flash-attn-4 up

    stand_in = _FA4StandIn(sdpa)
    monkeypatch.setattr(backends, "fa4_interface", lambda: stand_in)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    n, h, d, segs, dils = 700, 5, 16, [64, 160, 384], [1, 3, 4]
    q, k, v, g = (torch.randn(2, n, h, d, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = methods.gather_sdpa_dilated(
        *leaves, segs, dils, causal, return_lse=True, backend="fa4"
    )
    grads = torch.autograd.grad(out, leaves, g)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    rout, rlse = ra.dilated_attention(*ref, segs, dils, causal=causal, return_lse=True)
    rgrads = torch.autograd.grad(rout, ref, g.double())
    assert stand_in.calls > len(segs)  # per branch and offset class, full and ragged chunks
    torch.testing.assert_close(out.double(), rout, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), rlse, atol=2e-5, rtol=1e-4)
    for a, b in zip(grads, rgrads, strict=True):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=1e-4)


def test_fa4_is_reported_where_it_cannot_run(methods) -> None:
    cpu = torch.device("cpu")
    assert "fa4" not in methods.default_methods(cpu)
    assert "fa4" in methods.default_methods(torch.device("cuda"))
    meth = methods.Methods([64], [1], False, cpu)
    assert "CUDA" in meth.unsupported("fa4", False)
    assert meth.backends("fa4", methods.SDPA_BACKENDS) == ["fa4"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: flash-attn-4 not run")
def test_fa4_baseline_on_cuda_matches_the_oracle(methods) -> None:
    missing = methods.fa4_missing()
    if missing:
        pytest.skip(f"flash-attn-4 does not import here: {missing}")
    import ring_attention as ra

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    n, h, d, segs, dils = 5000, 4, 128, [512, 1024, 2048], [1, 2, 4]
    q, k, v, g = (torch.randn(1, n, h, d, generator=gen) for _ in range(4))
    for causal in (False, True):
        x = [t.cuda().bfloat16().requires_grad_() for t in (q, k, v)]
        out = methods.gather_sdpa_dilated(*x, segs, dils, causal, backend="fa4")
        grads = torch.autograd.grad(out, x, g.cuda().bfloat16())
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        rout = ra.dilated_attention(*ref, segs, dils, causal=causal)
        rgrads = torch.autograd.grad(rout, ref, g.double())
        for a, b in zip((out, *grads), (rout, *rgrads), strict=True):
            err = (a.double().cpu() - b).norm() / b.norm()
            assert err < 2e-2, (causal, err.item())
