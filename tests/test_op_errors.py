"""The C++ operators called directly with bad grouped K/V heads, cu_seqlens or
grad_lse: a RuntimeError naming the argument, before any kernel runs (the
Python layer checks first with friendlier messages).
"""

from __future__ import annotations

import pytest
import torch
from op_helpers import OPS, Cfg, fresh_acc, make_inputs

CFG = Cfg(2, 12, 4, 8, [4, 8], [1, 2], True, False, 0.5, False, 2)


def _inputs():
    q, k, v, go, _ = make_inputs(CFG, torch.float32, "cpu", seed=1)
    return q, k, v, go


def _pattern(cu=None, grouped=False):
    return (CFG.segment_lengths, CFG.dilation_rates, True, 0.5, False, grouped, None, cu)


def _block_forward(q, k, v, q_start=0, k_start=0, cu=None):
    out, lse = fresh_acc(q)
    OPS.block_forward(q, k, v, out, lse, q_start, k_start, *_pattern(cu))


def _block_backward(glse, cu=None):
    q, k, v, go = _inputs()
    out, lse = OPS.dilated_attention(q, k, v, *_pattern())
    grads = [torch.zeros(x.shape) for x in (q, k, v)]
    OPS.block_backward(go, glse, q, k, v, out, lse, *grads, 0, 0, *_pattern(cu))


def _cu(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


CASES = {
    "kv_heads not dividing heads": (
        lambda q, k, v: OPS.dilated_attention(
            q, k.repeat(1, 1, 2, 1)[:, :, :3], v.repeat(1, 1, 2, 1)[:, :, :3], *_pattern()
        ),
        r"kv_heads",
    ),
    "k and v heads differ": (
        lambda q, k, v: OPS.dilated_attention(q, k, v[:, :, :1], *_pattern()),
        r"\bk and v\b",
    ),
    "local op: k length": (
        lambda q, k, v: OPS.dilated_attention(q, k[:, :5], v[:, :5], *_pattern()),
        r"sequence length",
    ),
    "cu_seqlens 2-D": (
        lambda q, k, v: OPS.dilated_attention(q, k, v, *_pattern(_cu([[0, 12]]))),
        r"cu_seqlens.*1-D",
    ),
    "cu_seqlens float": (
        lambda q, k, v: OPS.dilated_attention(q, k, v, *_pattern(torch.tensor([0.0, 12.0]))),
        r"cu_seqlens.*int32 or int64",
    ),
    "cu_seqlens device": (
        lambda q, k, v: OPS.dilated_attention(
            q, k, v, *_pattern(torch.empty(2, dtype=torch.int32, device="meta"))
        ),
        r"cu_seqlens.*device",
    ),
    "cu_seqlens empty": (
        lambda q, k, v: OPS.dilated_attention(q, k, v, *_pattern(_cu([]))),
        r"cu_seqlens",
    ),
    "cu_seqlens start": (
        lambda q, k, v: OPS.dilated_attention(q, k, v, *_pattern(_cu([1, 12]))),
        r"cu_seqlens must start at 0",
    ),
    "cu_seqlens decreasing": (
        lambda q, k, v: OPS.dilated_attention(q, k, v, *_pattern(_cu([0, 7, 5, 12], torch.int64))),
        r"cu_seqlens must be non-decreasing",
    ),
    "local op: cu_seqlens total": (
        lambda q, k, v: OPS.dilated_attention(q, k, v, *_pattern(_cu([0, 5, 11]))),
        r"cu_seqlens must end at the sequence length 12",
    ),
    "block op: cu_seqlens shorter than the blocks": (
        lambda q, k, v: _block_forward(q[:, :4], k[:, :4], v[:, :4], 8, 0, _cu([0, 5, 11])),
        r"cu_seqlens must end at or after the end of the blocks \(12\)",
    ),
    "grad_lse shape": (
        lambda q, k, v: _block_backward(torch.zeros(2, 4, 11)),
        r"grad_lse",
    ),
    "grad_lse dtype": (
        lambda q, k, v: _block_backward(torch.zeros(2, 4, 12, dtype=torch.float64)),
        r"grad_lse",
    ),
    "exchange_rows: kv_heads": (
        lambda q, k, v: OPS.exchange_rows(
            [0], [4], 0, 4, 4, 3, [4], [1], False, False, False, None
        ),
        r"kv_heads",
    ),
    "exchange_rows: cu_seqlens": (
        lambda q, k, v: OPS.exchange_rows(
            [0], [4], 0, 8, 4, 2, [4], [1], False, False, False, _cu([0, 6])
        ),
        r"cu_seqlens must end at or after",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_naming_the_argument(case) -> None:
    call, message = CASES[case]
    with pytest.raises(RuntimeError, match=message):
        call(*_inputs()[:3])


def test_valid_block_call_at_an_offset_passes() -> None:
    """The counterpart of the cu_seqlens checks: a block inside the documents is fine."""
    q, k, v, _ = _inputs()
    _block_forward(q[:, :4], k[:, :4], v[:, :4], 8, 0, _cu([0, 5, 12]))


BAD_SCALES = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0]


def _scaled(scale):
    p = list(_pattern())
    p[3] = scale
    return p


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("scale", BAD_SCALES)
def test_bad_scale_raises_in_every_operator(device, scale) -> None:
    """The operators check scale as the Python layer does (finite, > 0), on
    the CPU and in their Meta kernels, before any kernel runs."""
    q, k, v, go = (x.to(device) for x in _inputs())
    out, lse = fresh_acc(q)
    grads = [torch.zeros(x.shape, device=device) for x in (q, k, v)]
    calls = {
        "dilated_attention": lambda: OPS.dilated_attention(q, k, v, *_scaled(scale)),
        "dilated_attention_backward": lambda: OPS.dilated_attention_backward(
            go, None, q, k, v, q, lse, *_scaled(scale)
        ),
        "block_forward": lambda: OPS.block_forward(q, k, v, out, lse, 0, 0, *_scaled(scale)),
        "block_backward": lambda: OPS.block_backward(
            go, None, q, k, v, q, lse, *grads, 0, 0, *_scaled(scale)
        ),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="scale must be a finite positive number"):
            call()
        if device == "cpu":  # nothing was computed
            assert torch.isneginf(lse).all() and not out.any(), name
