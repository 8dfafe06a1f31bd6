"""The CPU kernels' two float32 paths (csrc/cpu/packed_tiles.h,
``packed_tiles_fp32``).

On CPUs with AVX-512 the fp32 kernels copy each K/V tile once, K transposed
and V contiguous, and multiply with oneDNN's fp32 batch-reduce GEMM (the
forward keeps a key run's tiles for all its query tiles; the backward packs
per key tile for S, dP and dQ); ``RING_ATTENTION_CPU_FP32_PACK=0`` keeps
MKL's sgemm on the tiles in place. Both are checked against the float64
oracle, forward and backward, on ragged lengths, several key tiles per run,
causal query tiles that reach part of a packed tile, grouped K/V heads,
documents and a NaN in a V row that only later queries reach.
"""

from __future__ import annotations

import pytest
import torch
from op_helpers import Cfg, check_against_oracle, check_results, make_inputs, run_local, run_oracle

F32 = torch.float32
ENV = "RING_ATTENTION_CPU_FP32_PACK"


@pytest.fixture(params=["packed", "sgemm"])
def fp32_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "packed":
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, "0")
    return request.param


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_oracle(fp32_path, causal) -> None:
    cfg = Cfg(2, 150, 3, 33, [16, 64, 128], [1, 2, 4], causal, False, None, True)
    check_against_oracle(cfg, F32, "cpu", seed=7700 + causal)


def test_features_with_lse_gradient(fp32_path) -> None:
    """Grouped K/V heads, documents, grouped offsets, head groups, a key padding
    mask and a gradient through lse."""
    from op_helpers import lse_grad

    cfg = Cfg(2, 140, 8, 32, [16, 64], [2, 4], True, True, None, True, 2, True)
    cfg.cu_seqlens = [0, 1, 40, 40, 97, 140]
    q, k, v, go, mask = make_inputs(cfg, F32, "cpu", 7710)
    glse = lse_grad(cfg, "cpu", 7711)
    got = run_local(cfg, q, k, v, go, mask, glse)
    want = run_oracle(cfg, q, k, v, go, mask, glse)
    check_results(cfg, F32, got, want, f"{fp32_path} {cfg}")


def test_long_key_runs_in_several_tiles(fp32_path) -> None:
    """Runs of 1301 and 650-651 keys (several 512-key tiles, ragged last
    ones), causal, and a NaN in a V row of the second tile: earlier queries
    never see it, later ones do."""
    cfg = Cfg(1, 1301, 2, 64, [1301], [1], True, False, None, False)
    check_against_oracle(cfg, F32, "cpu", seed=7720)
    cfg = Cfg(1, 1301, 2, 64, [1301], [2], True, False, None, False)
    q, k, v, go, _ = make_inputs(cfg, F32, "cpu", 7721)
    u = 1101  # the second key tile of the run of odd positions
    v_bad = v.clone()
    v_bad[:, u] = float("nan")
    got = run_local(cfg, q, k, v_bad, go, None, None)
    want = run_oracle(cfg, q, k, v, go, None)
    early = slice(0, u)
    torch.testing.assert_close(
        got[0][:, early].double(), want[0][:, early].double(), atol=1e-4, rtol=1e-4
    )
    assert torch.isnan(got[0][:, u:]).any()
