"""DilatedAttention, the nn.Module around the functional op, against the
float64 oracle (MultiheadDilatedAttention: tests/test_multihead.py and
tests/test_mha_dropin.py)."""

from __future__ import annotations

import pytest
import torch
from oracle import reference_attention

from ring_attention.modules import DilatedAttention

E, H = 16, 4
TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The shapes here are tiny: intra-op threads only add synchronisation
    (and stall badly on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_close(a, b, tol=TOL, what=""):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err}"


# ---------------------------------------------------------------------------
# DilatedAttention.


def test_dilated_attention_module() -> None:
    mod = DilatedAttention([4, 8], [1, 2], causal=True, scale=0.3, head_groups=True)
    assert mod.segment_lengths == (4, 8) and mod.dilation_rates == (1, 2)
    q, k, v = (torch.randn(2, 19, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kpm = torch.rand(2, 19) < 0.2
    out = mod(q, k, v, key_padding_mask=kpm)
    ref, _ = reference_attention(q, k, v, [4, 8], [1, 2], causal=True, scale=0.3,
                                 head_groups=True, key_padding_mask=kpm)  # fmt: skip
    assert_close(out, ref, 1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, 1e-10)
    assert "segment_lengths=[4, 8]" in repr(mod)


@pytest.mark.parametrize(
    "args,kw,match",
    [
        (([4, 8], [1]), {}, "same length"),
        (([4], [8]), {}, r"dilation_rates\[0\]"),
        (([], []), {}, "segment_lengths"),
        (([4], [1]), {"scale": -1.0}, "scale"),
    ],
)
def test_dilated_attention_module_errors_at_construction(args, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        DilatedAttention(*args, **kw)
