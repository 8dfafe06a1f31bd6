"""The block operators on packed K/V rows with a row map (``k_rows``,
csrc/params.h), what the ring's CPU transport hands them for sender pieces
needed only in part: the reached (position, K/V head) rows of a key block
packed into ``(batch, rows, head_dim)``, read and their dK/dV accumulated in
place. Equal to the same block on the whole key range (to rounding: the
dK/dV sums may be ordered differently), with the rows in the exchange's
order (evenly spaced runs: read in place) and in a random order (gathered
row by row), for several key tiles, grouped K/V heads, documents, grouped
offsets and windows, on the CPU kernels and the CUDA kernels (emulated);
and the map's checks.
"""

from __future__ import annotations

import re

import op_helpers as oh
import pytest
import torch

OPS = torch.ops.ring_attention

# (cfg arguments beyond batch, n, heads, head_dim; query block; key block)
LONG_CASES = [
    # several 256-key tiles per run, two K/V heads, a window
    (
        dict(
            segment_lengths=[96, 1200],
            dilation_rates=[1, 3],
            causal=True,
            kv_heads=2,
            window=(700, 0),
        ),
        (900, 1200),
        (0, 900),
    ),
    (
        dict(segment_lengths=[64, 600, 1200], dilation_rates=[2, 3, 4], grouped_offsets=True),
        (0, 300),
        (300, 1200),
    ),
]


def _cases():
    for i, (ws, rs, causal, hg, qr, kr) in enumerate(oh.UNREACHED_CASES):
        yield pytest.param(oh.Cfg(2, 48, 5, 8, ws, rs, causal, hg, 0.3), qr, kr, id=f"unreached{i}")
        cfg = oh.Cfg(2, 48, 6, 8, ws, rs, causal, hg, 0.3, False, 2, i % 2 == 1)
        cfg.cu_seqlens = [0, 5, 5, 19, 20, 33, 48]
        yield pytest.param(cfg, qr, kr, id=f"documents{i}")
    for i, (kw, qr, kr) in enumerate(LONG_CASES):
        yield pytest.param(oh.Cfg(1, 1200, 4, 16, **kw), qr, kr, id=f"long{i}")


def _packed(k: torch.Tensor, reached: torch.Tensor, order: str, seed: int):
    """The reached rows of k (B, Lk, Hkv, D) as (B, rows, D) and their
    (Lk, Hkv) int32 map (-1: not packed): in flat order (the exchange's) or
    shuffled."""
    flat = reached.reshape(-1).nonzero().squeeze(1)
    if order == "shuffled":
        g = torch.Generator().manual_seed(seed)
        flat = flat[torch.randperm(flat.numel(), generator=g)]
    B, _, _, D = k.shape
    rows = k.reshape(B, -1, D)[:, flat.to(k.device)].contiguous()
    rmap = torch.full((reached.numel(),), -1, dtype=torch.int32)
    rmap[flat] = torch.arange(flat.numel(), dtype=torch.int32)
    return rows, rmap.view(reached.shape).to(k.device), flat.to(k.device)


ORDERS = ["flat", "shuffled"]
DTYPES = [
    pytest.param(oh.F64, id="f64"),
    pytest.param(torch.float32, id="f32"),
    pytest.param(torch.bfloat16, id="bf16"),
]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg,qr,kr", list(_cases()))
def test_packed_rows_equal_the_whole_key_block(cfg, qr, kr, dtype, order) -> None:
    _check_packed(OPS, cfg, qr, kr, dtype, order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg,qr,kr", [c for c in _cases() if "long" not in c.id])
def test_packed_rows_on_the_cuda_kernels(emu, cfg, qr, kr, dtype, order) -> None:
    """The same on the CUDA kernels (emulated): their K/V loads read rows
    through the map (SIMT and tensor-core paths, forward and backward)."""
    _check_packed(emu, cfg, qr, kr, dtype, order)


def _check_packed(ops, cfg, qr, kr, dtype, order) -> None:
    (qa, qb), (ka, kb) = qr, kr
    q, k, v, go, _ = oh.make_inputs(cfg, dtype, "cpu", seed=qa + 7 * kb)
    reached = oh.reached_rows(cfg, qr, kr)
    assert reached.any() and not reached.all(), "the key block should be reached in part"
    qb_, go_b = q[:, qa:qb].contiguous(), go[:, qa:qb].contiguous()
    kc, vc = k[:, ka:kb].contiguous(), v[:, ka:kb].contiguous()
    kp, rmap, flat = _packed(kc, reached, order, seed=kb)
    vp = vc.reshape(vc.shape[0], -1, vc.shape[3])[:, flat].contiguous()
    ctx = f"{cfg} q={qr} k={kr} {dtype} {order}"
    tol = 1e-12 if dtype == oh.F64 else 2e-5  # the order of the dK/dV sums may differ

    whole_out, whole_lse = oh.fresh_acc(q)
    oh.block_forward(cfg, q, k, v, whole_out, whole_lse, 0, 0, None, ops)
    out_f = whole_out[:, qa:qb].to(dtype).contiguous()
    lse_f = whole_lse[:, :, qa:qb].contiguous()
    acc = oh.acc_dtype(dtype)
    args = cfg.pattern(None, "cpu")

    out_w, lse_w = oh.fresh_acc(q, qb - qa)
    oh.block_forward(cfg, qb_, kc, vc, out_w, lse_w, qa, ka, None, ops)
    out_p, lse_p = oh.fresh_acc(q, qb - qa)
    ops.block_forward(qb_, kp, vp, out_p, lse_p, qa, ka, *args, k_rows=rmap)
    assert lse_w.isfinite().any(), ctx
    oh.close(out_p, out_w, tol, "out", ctx)
    oh.close(lse_p, lse_w, tol, "lse", ctx)

    dq_w = torch.zeros(qb_.shape, dtype=acc)
    dk_w, dv_w = (torch.zeros(kc.shape, dtype=acc) for _ in range(2))
    oh.block_backward(cfg, go_b, qb_, kc, vc, out_f, lse_f, dq_w, dk_w, dv_w, qa, ka, None, ops)
    dq_p = torch.zeros(qb_.shape, dtype=acc)
    dk_p, dv_p = (torch.zeros(kp.shape, dtype=acc) for _ in range(2))
    ops.block_backward(go_b, None, qb_, kp, vp, out_f, lse_f, dq_p, dk_p, dv_p, qa, ka, *args,
                       k_rows=rmap)  # fmt: skip
    B, D = kc.shape[0], kc.shape[3]
    oh.close(dq_p, dq_w, tol, "dq", ctx)
    oh.close(dk_p, dk_w.reshape(B, -1, D)[:, flat], tol, "dk", ctx)
    oh.close(dv_p, dv_w.reshape(B, -1, D)[:, flat], tol, "dv", ctx)
    assert dk_w.reshape(B, -1, D)[:, flat].abs().sum() > 0, ctx


def _small():
    cfg = oh.Cfg(1, 20, 2, 8, [8], [2])
    q, k, _, _, _ = oh.make_inputs(cfg, torch.float32, "cpu", seed=1)
    out, lse = oh.fresh_acc(q, 10)
    rows = k[:, :10].reshape(1, -1, 8).contiguous()
    rmap = torch.arange(20, dtype=torch.int32).view(10, 2)
    return cfg, q[:, 10:].contiguous(), rows, out, lse, rmap


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda m, r: (m.to(torch.int64), r), "dtype int32"),
        (lambda m, r: (m.view(-1), r), "2-D"),
        (lambda m, r: (m + 1, r), "[-1, 20)"),
        (lambda m, r: (m - 2, r), "[-1, 20)"),
        (lambda m, r: (m, r.view(1, 10, 2, 8)), "3-D"),
        (lambda m, r: (torch.zeros(10, 3, dtype=torch.int32), r), "kv_heads"),
    ],
)
def test_row_map_checks_name_k_rows(change, words) -> None:
    cfg, q, rows, out, lse, rmap = _small()
    rmap, rows = change(rmap, rows)
    with pytest.raises(RuntimeError, match=re.escape(words)):
        OPS.block_forward(q, rows, rows, out, lse, 10, 0, *cfg.pattern(None, "cpu"), k_rows=rmap)
