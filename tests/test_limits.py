"""Values at the limits (docs/design.md §6): pattern values far beyond the
sequence work, block positions near the int64 range raise, and a row stride
that BLAS cannot take (r · heads · head_dim > 2**31 - 1) still gives the right
answer.

A crash must fail one test, not the test run: the huge-value cases run in a
subprocess. Each case is checked against the float64 oracle, which computes
with the values as given (no clamping), forward and backward, lse included.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from child_env import with_path
from op_helpers import OPS, Cfg, block_forward, fresh_acc

BIG = 2**63 - 1

# (segment_lengths, dilation_rates, causal, head_groups, grouped_offsets,
#  heads, kv_heads, cu_seqlens); n = 37
HUGE_CASES = [
    ([BIG], [BIG], False, False, False, 5, 5, None),
    ([BIG], [BIG], True, False, False, 4, 2, None),
    ([sys.maxsize], [2], True, False, False, 3, 3, None),
    ([2**40, 7], [2**39, 3], False, False, False, 5, 5, None),
    ([10**18], [10**17], False, False, True, 4, 2, [0, 5, 20, 37]),
    ([2**62, 5], [2**61, 1], True, True, False, 5, 5, [0, 0, 1, 30, 37]),
    # r above n but below heads: offsets h mod r still differ from h
    ([2**50], [12], False, False, False, 16, 4, None),
    ([2**50], [2**49], False, False, True, 16, 4, None),
]

HUGE_SCRIPT = """
import torch
from op_helpers import Cfg, check_results, lse_grad, make_inputs, run_local, run_oracle
for i, (segs, dils, causal, groups, grouped, heads, kv_heads, cu) in enumerate({cases!r}):
    cfg = Cfg(batch=2, n=37, heads=heads, head_dim=4, segment_lengths=segs,
              dilation_rates=dils, causal=causal, head_groups=groups,
              grouped_offsets=grouped, kv_heads=kv_heads, cu_seqlens=cu, mask=True)
    for dtype in (torch.float64, torch.float32):
        q, k, v, go, mask = make_inputs(cfg, dtype, "cpu", seed=i)
        glse = lse_grad(cfg, "cpu", seed=i)
        got = run_local(cfg, q, k, v, go, mask, glse)
        want = run_oracle(cfg, q, k, v, go, mask, glse)
        check_results(cfg, dtype, got, want, (i, dtype))
print("ok", len({cases!r}))
"""


def test_huge_pattern_values_match_the_oracle_in_a_subprocess() -> None:
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(HUGE_SCRIPT.format(cases=HUGE_CASES))
    proc = subprocess.run(  # tests/ on the child's path: its helpers
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
        env=with_path(tests),
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.split() == ["ok", str(len(HUGE_CASES))], proc.stdout + proc.stderr
    assert "Parameter" not in proc.stderr, proc.stderr  # no BLAS argument error printed


@pytest.mark.parametrize(
    "segs,dils,cu,match",
    [
        ([2**63], [1], None, r"segment_lengths\[0\] must be at most 2\*\*63 - 1"),
        ([8, 2**70], [1, 2**69], None, r"segment_lengths\[1\] must be at most"),
        ([8], [1], [0, 2**63, 37], r"cu_seqlens\[1\] must fit in int64"),
        ([8], [1], [0, -(2**64), 37], r"cu_seqlens\[1\] must fit in int64"),
    ],
)
def test_values_beyond_int64_raise_naming_the_argument(segs, dils, cu, match) -> None:
    """The operators take int64: larger pattern values or boundaries raise a
    ValueError that names the argument (not the schema's type error), in the
    function, the module and the ring alike (all build a Pattern first)."""
    import ring_attention as ra

    q = torch.randn(1, 37, 2, 4)
    with pytest.raises(ValueError, match=match):
        ra.dilated_attention(q, q, q, segs, dils, cu_seqlens=cu)
    if cu is None:
        with pytest.raises(ValueError, match=match):
            ra.DilatedAttention(segs, dils)
        with pytest.raises(ValueError, match=match):
            ra.ring_dilated_attention(q, q, q, segs, dils)


@pytest.mark.parametrize("q_start,k_start", [(2**63 - 3, 0), (0, 2**62 + 5)])
def test_block_positions_near_int64_range_raise(q_start: int, k_start: int) -> None:
    cfg = Cfg(batch=1, n=4, heads=2, head_dim=4, segment_lengths=[8], dilation_rates=[2])
    q = torch.randn(1, 4, 2, 4)
    out, lse = fresh_acc(q)
    with pytest.raises(RuntimeError, match="q_start and k_start"):
        block_forward(cfg, q, q, q, out, lse, q_start, k_start, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_stride_beyond_blas_int_range(dtype: torch.dtype) -> None:
    """Query and key blocks of 2 rows at global position 600,000 with dilation
    600,001 and heads · head_dim = 4096: the active rows of a head are r rows
    apart, a stride of 2.46e9 elements, beyond BLAS's 32-bit leading dimension.
    Head 0 is active at position r = 600,001 only (offset 0): its query reaches its
    own key alone, so its output is that key's value row; no other head of the
    block is active. fp32 and bf16: the packed GEMMs (oneDNN's brgemm) take
    32-bit strides too (beyond them they failed with std::bad_alloc)."""
    heads, d, r = 64, 64, 600_001
    assert r * heads * d > 2**31 - 1
    start = r - 1
    cfg = Cfg(batch=1, n=2, heads=heads, head_dim=d, segment_lengths=[2**21], dilation_rates=[r])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, heads, d, generator=g).to(dtype) for _ in range(3))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    out, lse = fresh_acc(q)
    block_forward(cfg, q, k, v, out, lse, start, start, None)
    torch.testing.assert_close(out[0, 1, 0], v[0, 1, 0].float(), atol=tol, rtol=tol)
    scale = d**-0.5
    torch.testing.assert_close(
        lse[0, 0, 1], scale * (q[0, 1, 0].float() @ k[0, 1, 0].float()), atol=tol, rtol=tol
    )
    assert torch.isneginf(lse[0, 0, 0]) and torch.isneginf(lse[0, 1:]).all()
    assert (out[0, 0] == 0).all() and (out[0, 1, 1:] == 0).all()
    # and its gradients: dv of that row is grad_out's row, dq = dk = 0 there
    go = torch.randn(1, 2, heads, d, generator=g).to(dtype)
    dq, dk, dv = (torch.zeros(1, 2, heads, d) for _ in range(3))
    OPS.block_backward(
        go, None, q, k, v, out.to(q.dtype), lse, dq, dk, dv, start, start, *cfg.pattern(None, "cpu")
    )
    torch.testing.assert_close(dv[0, 1, 0], go[0, 1, 0].float(), atol=tol, rtol=tol)
    assert (dv[0, 0] == 0).all() and (dv[0, 1, 1:] == 0).all()
    # (p = 1, so dS = dP - delta = 0 up to the rounding of two dot products)
    torch.testing.assert_close(dq, torch.zeros_like(dq), atol=tol, rtol=0)
    torch.testing.assert_close(dk, torch.zeros_like(dk), atol=tol, rtol=0)
