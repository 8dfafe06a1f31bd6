"""A score of +inf gives lse = +inf (as ``torch.logsumexp`` does), not NaN.

Query row t holds +inf in one dimension and every key a positive value there,
so each score t reaches is +inf: its lse is +inf (its output is NaN, inf /
inf, as SDPA's), while every other row is exactly what it is without the
+inf. Two branches, so the +inf block merges with a finite one; the block
operators split 2 x 3 (as a ring calls them) merge it with blocks that do and
do not reach it. CPU kernels (every dtype) and the CUDA kernels in the
emulator.
"""

from __future__ import annotations

import pytest
import torch
from op_helpers import Cfg, fresh_acc

import ring_attention as ra

SEGS, DILS = [8, 24], [1, 2]
N, HEADS, T = 30, 2, 13  # query row T (head 0) has the +inf


def _inputs(dtype: torch.dtype, d: int = 8):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, N, HEADS, d, generator=g, dtype=torch.float64) for _ in range(3))
    k[..., 0] = k[..., 0].abs() + 0.5  # positive: inf * k > 0
    bad = q.clone()
    bad[0, T, 0, 0] = float("inf")
    return (x.to(dtype) for x in (q, bad, k, v))


def _check(lse: torch.Tensor, lse_clean: torch.Tensor, out: torch.Tensor, out_clean) -> None:
    assert lse[0, 0, T] == float("inf"), lse[0, 0, T]
    rows = torch.ones_like(lse, dtype=torch.bool)
    rows[0, 0, T] = False
    torch.testing.assert_close(lse[rows], lse_clean[rows], rtol=0, atol=0)
    out_rows = rows.permute(0, 2, 1)  # (1, N, HEADS)
    torch.testing.assert_close(out[out_rows], out_clean[out_rows], rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_local_op_lse_is_inf(dtype: torch.dtype, causal: bool) -> None:
    q, bad, k, v = _inputs(dtype)
    kw = dict(causal=causal, return_lse=True)
    out_clean, lse_clean = ra.dilated_attention(q, k, v, SEGS, DILS, **kw)
    out, lse = ra.dilated_attention(bad, k, v, SEGS, DILS, **kw)
    assert torch.isinf(torch.logsumexp(torch.tensor([float("inf"), 1.0]), 0))
    _check(lse, lse_clean, out, out_clean)


def _blocks(ops, q, k, v, causal: bool):
    cfg = Cfg(1, N, HEADS, q.shape[3], SEGS, DILS, causal=causal)
    out, lse = fresh_acc(q)
    for qa, qb in [(0, 11), (11, N)]:
        acc = fresh_acc(q[:, qa:qb])
        for ka, kb in [(20, N), (0, 7), (7, 20)]:  # the +inf block neither first nor last
            ops.block_forward(
                q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], *acc, qa, ka, *cfg.pattern(None, "cpu")
            )
        out[:, qa:qb], lse[:, :, qa:qb] = acc
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_blocks_merge_an_inf_lse(causal: bool) -> None:
    from op_helpers import OPS

    q, bad, k, v = _inputs(torch.float32)
    out_clean, lse_clean = _blocks(OPS, q, k, v, causal)
    out, lse = _blocks(OPS, bad, k, v, causal)
    _check(lse, lse_clean, out, out_clean)


@pytest.mark.parametrize(
    "dtype,d,cc", [(torch.float32, 8, 90), (torch.bfloat16, 64, 90)], ids=["simt", "mma"]
)
def test_emulated_cuda_blocks_merge_an_inf_lse(emu, dtype, d, cc) -> None:
    emu.configure(0, cc)
    q, bad, k, v = _inputs(dtype, d)
    out_clean, lse_clean = _blocks(emu, q, k, v, False)
    out, lse = _blocks(emu, bad, k, v, False)
    _check(lse, lse_clean, out, out_clean)
