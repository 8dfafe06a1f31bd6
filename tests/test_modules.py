"""DilatedAttention, the nn.Module around the functional op, against the
float64 oracle (MultiheadDilatedAttention: tests/test_multihead.py and
tests/test_mha_dropin.py)."""

from __future__ import annotations

import pytest
import torch
from op_helpers import assert_max_abs
from oracle import reference_attention

import ring_attention as ra
from ring_attention.nn.modules import DilatedAttention

E, H = 16, 4


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
    assert_max_abs(out, ref, 1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want, strict=True):
        assert_max_abs(a, b, 1e-10)
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


def test_modules_take_grouped_kv_heads_and_documents() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 29, 6, 8, generator=g)
    k, v = (torch.randn(2, 29, 2, 8, generator=g) for _ in range(2))
    cu = torch.tensor([0, 3, 3, 20, 29])
    args = ([4, 8], [1, 2])
    want = ra.dilated_attention(q, k, v, *args, causal=True, cu_seqlens=cu)
    assert torch.equal(DilatedAttention(*args, causal=True)(q, k, v, cu_seqlens=cu), want)
    ring = ra.RingDilatedAttention(*args, causal=True)  # no process group: one process
    assert torch.equal(ring(q, k, v, cu_seqlens=cu), want)
