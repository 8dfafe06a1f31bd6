"""torch.library.opcheck of every operator (schema, fake/meta kernels,
autograd registration, AOT dispatch), with and without the optional
arguments (grouped K/V heads, documents, grouped offsets, grad_lse), and
gradcheck of the local op's autograd (ring_attention/local/ops.py) in float64
on both outputs; double backward raises.
"""

from __future__ import annotations

import pytest
import torch
from op_helpers import F64, OPS, Cfg, acc_dtype, fresh_acc, kslice, make_inputs

import ring_attention as ra


def _op_args(dtype: torch.dtype, mask: bool, device: str, requires_grad: bool, features: bool):
    if features:  # kv_heads < heads, documents, grouped offsets, a window
        cfg = Cfg(2, 11, 4, 4, [4, 8], [2, 2], True, False, 0.5, mask, 2, True, [0, 3, 3, 4, 11])
        cfg.window = (3, 1)
    else:
        cfg = Cfg(2, 11, 3, 4, [4, 8], [2, 2], True, False, 0.5, mask)
    q, k, v, go, kpm = make_inputs(cfg, dtype, device, seed=24)
    if mask:  # make sure some rows of the mask are set
        kpm = kpm.clone()
        kpm[0, 3] = True
    if requires_grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    glse = (
        torch.randn(2, cfg.heads, 11, dtype=acc_dtype(dtype), device=device) if features else None
    )
    return cfg, q, k, v, go, glse, cfg.pattern(kpm, device)


OPCHECK_PARAMS = [
    pytest.param(F64, False, False, id="f64"),
    pytest.param(torch.float32, False, False, id="f32"),
    pytest.param(F64, True, False, id="f64-mask"),
    pytest.param(torch.float32, True, False, id="f32-mask"),
    pytest.param(F64, False, True, id="f64-features"),
    pytest.param(torch.float32, True, True, id="f32-mask-features"),
]


@pytest.mark.parametrize(("dtype", "mask", "features"), OPCHECK_PARAMS)
def test_opcheck_dilated_attention(device, dtype, mask, features) -> None:
    _, q, k, v, _, _, pattern = _op_args(dtype, mask, device, True, features)
    torch.library.opcheck(OPS.dilated_attention.default, (q, k, v, *pattern))


@pytest.mark.parametrize(("dtype", "mask", "features"), OPCHECK_PARAMS)
def test_opcheck_dilated_attention_backward(device, dtype, mask, features) -> None:
    _, q, k, v, go, glse, pattern = _op_args(dtype, mask, device, False, features)
    out, lse = OPS.dilated_attention(q, k, v, *pattern)
    torch.library.opcheck(
        OPS.dilated_attention_backward.default, (go, glse, q, k, v, out, lse, *pattern)
    )


@pytest.mark.parametrize(("dtype", "mask", "features"), OPCHECK_PARAMS)
def test_opcheck_block_forward(device, dtype, mask, features) -> None:
    _, q, k, v, _, _, pattern = _op_args(dtype, mask, device, False, features)
    out, lse = fresh_acc(q, 5)
    head, (kpm, cu), window = pattern[:6], pattern[6:8], pattern[8:]
    args = (q[:, 4:9].contiguous(), k[:, 2:9].contiguous(), v[:, 2:9].contiguous(), out, lse, 4, 2)
    torch.library.opcheck(OPS.block_forward.default, (*args, *head, kslice(kpm, 2, 9), cu, *window))


@pytest.mark.parametrize(("dtype", "mask", "features"), OPCHECK_PARAMS)
def test_opcheck_block_backward(device, dtype, mask, features) -> None:
    cfg, q, k, v, go, glse, pattern = _op_args(dtype, mask, device, False, features)
    out, lse = OPS.dilated_attention(q, k, v, *pattern)
    head, (kpm, cu), window = pattern[:6], pattern[6:8], pattern[8:]
    acc = acc_dtype(dtype)
    kvh = cfg.resolved_kv_heads()
    dq = torch.zeros(2, 5, cfg.heads, 4, dtype=acc, device=device)
    dk = torch.zeros(2, 7, kvh, 4, dtype=acc, device=device)
    dv = torch.zeros(2, 7, kvh, 4, dtype=acc, device=device)
    args = (
        go[:, 4:9].contiguous(),
        None if glse is None else glse[:, :, 4:9].contiguous(),
        q[:, 4:9].contiguous(),
        k[:, 2:9].contiguous(),
        v[:, 2:9].contiguous(),
        out[:, 4:9].contiguous(),
        lse[:, :, 4:9].contiguous(),
        dq,
        dk,
        dv,
        4,
        2,
    )
    mask_k = kslice(kpm, 2, 9)
    torch.library.opcheck(OPS.block_backward.default, (*args, *head, mask_k, cu, *window))


@pytest.mark.parametrize("features", [False, True], ids=["plain", "features"])
def test_opcheck_exchange_rows(features) -> None:
    """Schema and autograd registration only: exchange_rows is an eager CPU
    planning op whose output length depends on the values (no fake kernel)."""
    if features:
        args = ([0, 9], [5, 4], 3, 10, 4, 2, [4, 8], [2, 2], True, False, True)
        cu = torch.tensor([0, 3, 3, 4, 20], dtype=torch.int32)
    else:
        args = ([0, 9], [5, 4], 3, 10, 3, 3, [4, 8], [2, 2], True, False, False)
        cu = None
    torch.library.opcheck(
        OPS.exchange_rows.default,
        (*args, cu),
        test_utils=("test_schema", "test_autograd_registration"),
    )


@pytest.mark.parametrize(
    ("causal", "mask", "head_groups"),
    [(False, False, False), (True, False, False), (True, True, False), (False, True, True)],
    ids=["full", "causal", "causal-mask", "mask-groups"],
)
def test_gradcheck(device, causal, mask, head_groups) -> None:
    cfg = Cfg(2, 10, 3, 4, [4, 8, 3], [2, 2, 3], causal, head_groups, None, mask)
    q, k, v, _, kpm = make_inputs(cfg, F64, device, seed=25)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def fn(q, k, v):
        return ra.dilated_attention(
            q, k, v, cfg.segment_lengths, cfg.dilation_rates, key_padding_mask=kpm, **cfg.kwargs()
        )

    assert torch.autograd.gradcheck(fn, (q, k, v))


# Every position is active in the r = 1 branch and reaches itself, so no lse
# is -inf (finite differences of -inf are NaN).
GRADCHECK_BOTH = {
    "plain": Cfg(2, 10, 3, 4, [4, 8, 3], [1, 2, 3], False),
    "causal-gqa": Cfg(1, 10, 4, 4, [4, 8, 3], [1, 2, 3], True, False, None, False, 2),
    "mqa-documents": Cfg(1, 12, 3, 4, [4, 6], [1, 2], True, False, 0.7, False, 1, False),
    "grouped-offsets": Cfg(1, 9, 4, 4, [9, 4], [1, 3], False, False, None, False, 4, True),
}
GRADCHECK_BOTH["mqa-documents"].cu_seqlens = [0, 1, 1, 7, 12]


@pytest.mark.parametrize("case", list(GRADCHECK_BOTH))
def test_gradcheck_out_and_lse(device, case) -> None:
    cfg = GRADCHECK_BOTH[case]
    q, k, v, _, _ = make_inputs(cfg, F64, device, seed=26)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    pattern = cfg.pattern(None, device)

    def fn(q, k, v):
        return OPS.dilated_attention(q, k, v, *pattern)

    assert torch.isfinite(fn(q, k, v)[1]).all()
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradgradcheck_raises_double_backward_error(device) -> None:
    cfg = GRADCHECK_BOTH["causal-gqa"]
    q, k, v, _, _ = make_inputs(cfg, F64, device, seed=27)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    pattern = cfg.pattern(None, device)

    def fn(q, k, v):
        return OPS.dilated_attention(q, k, v, *pattern)

    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.gradgradcheck(fn, (q, k, v))
