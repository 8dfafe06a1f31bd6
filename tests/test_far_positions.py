"""Blocks at global positions far from 0 (docs/design.md §6: block starts up to
2**62 work, larger ones raise) on the CPU kernels and on the CUDA kernels in
the emulator, forward and backward, against the float64 oracle.

A block of n positions at base B equals the oracle's answer at 0 when every
branch cuts B + [0, n) as it cuts [0, n): each w divides B, or one segment
holds B + [0, n) at a relative start that r divides; and with documents
[0, B, B + 5, B + n], whose second document starts at B. The bases cross
2**61 - 1, where the segment walk's "no document end" used to sit (positions
past it never finished, or grew a segment list until memory ran out).

Each run is a subprocess with an address-space limit and a timeout: a walk
that does not end fails one test, it does not take the machine's memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from child_env import with_path

TESTS = os.path.dirname(os.path.abspath(__file__))
BASES = [2**61 - 8, 2**61, 2**62]

SCRIPT = """
import resource, sys
import torch
from op_helpers import (GRAD_TOL, LSE_TOL, OUT_TOL, OPS, Cfg, acc_dtype, close, fresh_acc,
                        make_inputs, run_oracle)
if {emulated!r}:
    from cuda_emulator import build
    ops = build.load()
    ops.configure(0, {cc!r})
else:
    ops = OPS
# room for the inputs, not for a runaway segment list
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + 2 * 2**30, hard))

dtype = {dtype}
# w divides every base, or holds a base's block whole at a start r divides
SEGS, DILS = [4, 8, 2**62, 2**63 - 1], [2, 4, 8, 2]
n, checked = 37, 0
for base in {bases!r}:
    for causal in (False, True):
        for docs in (False, True):
            # documents start at base: any pattern (here also dilations of
            # 2**59 and one clamped to past 2**62: one active row per segment
            # and head, tiles of r * 64 positions beyond int64)
            segs, dils = SEGS, DILS
            if docs:
                segs, dils = SEGS + [2**60, 2**63 - 1], DILS + [2**59, 2**63 - 1]
            cfg = Cfg(batch=1, n=n, heads=4, head_dim={head_dim!r}, segment_lengths=segs,
                      dilation_rates=dils, causal=causal, kv_heads=2,
                      cu_seqlens=[0, 5, n] if docs else None)
            cu = torch.tensor([0, base, base + 5, base + n]) if docs else None
            args = (segs, dils, causal, cfg.resolved_scale(), False, False, None, cu)
            ctx = (base, causal, docs)
            q, k, v, go, _ = make_inputs(cfg, dtype, "cpu", seed=checked)
            want = run_oracle(cfg, q, k, v, go, None)
            # two query blocks x three key blocks, as a ring calls them (one
            # block of each at 2**62, the last start allowed)
            q_blocks, k_blocks = [(0, 20), (20, n)], [(0, 9), (9, 30), (30, n)]
            if base + 30 > 2**62:
                q_blocks = k_blocks = [(0, n)]
            out, lse = fresh_acc(q)
            for qa, qb in q_blocks:
                acc = fresh_acc(q[:, qa:qb])
                for ka, kb in k_blocks:
                    ops.block_forward(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], *acc, base + qa,
                                      base + ka, *args)
                out[:, qa:qb], lse[:, :, qa:qb] = acc
            close(out, want[0], OUT_TOL[dtype], "out", ctx)
            close(lse, want[1], LSE_TOL[dtype], "lse", ctx)
            final = out.to(dtype)
            grads = [torch.zeros(x.shape, dtype=acc_dtype(dtype)) for x in (q, k, v)]
            for qa, qb in q_blocks:
                for ka, kb in k_blocks:
                    parts = [g.clone() for g in (grads[0][:, qa:qb], grads[1][:, ka:kb],
                                                 grads[2][:, ka:kb])]
                    ops.block_backward(
                        go[:, qa:qb].contiguous(), None, q[:, qa:qb].contiguous(),
                        k[:, ka:kb].contiguous(), v[:, ka:kb].contiguous(),
                        final[:, qa:qb].contiguous(), lse[:, :, qa:qb].contiguous(),
                        *parts, base + qa, base + ka, *args)
                    grads[0][:, qa:qb] = parts[0]
                    grads[1][:, ka:kb] = parts[1]
                    grads[2][:, ka:kb] = parts[2]
            for name, g, w in zip(("dq", "dk", "dv"), grads, want[2:]):
                close(g, w, GRAD_TOL[dtype], name, ctx)
            checked += 1
print("ok", checked)
"""


def _run(emulated: bool, dtype: str, head_dim: int = 8, cc: int = 90) -> None:
    script = textwrap.dedent(
        SCRIPT.format(emulated=emulated, cc=cc, dtype=dtype, head_dim=head_dim, bases=BASES)
    )
    proc = subprocess.run(  # tests/ on the child's path: its helpers
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
        env=with_path(TESTS),
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.split() == ["ok", str(len(BASES) * 4)], proc.stdout + proc.stderr


@pytest.mark.parametrize("dtype", ["torch.float64", "torch.float32"])
def test_cpu_blocks_far_from_zero_match_the_oracle(dtype: str) -> None:
    _run(False, dtype)


@pytest.mark.parametrize(
    "dtype,head_dim", [("torch.float32", 8), ("torch.bfloat16", 64)], ids=["simt", "mma"]
)
def test_emulated_cuda_blocks_far_from_zero_match_the_oracle(emu, dtype, head_dim) -> None:
    """The CUDA kernels (SIMT fp32, tensor-core bf16) at the same bases; the
    fixture builds the emulator, the subprocess loads it."""
    _run(True, dtype, head_dim)


@pytest.mark.parametrize("q_start,k_start", [(2**62 + 1, 2**62), (2**62, 2**63 - 8)])
def test_starts_past_2_62_raise_naming_them(emu, q_start: int, k_start: int) -> None:
    """Past the documented range, CPU and emulated CUDA kernels raise naming
    q_start and k_start."""
    import torch
    from op_helpers import OPS, fresh_acc

    q = torch.randn(1, 4, 2, 8)
    for ops in (OPS, emu):
        out, lse = fresh_acc(q)
        with pytest.raises(RuntimeError, match="q_start and k_start"):
            ops.block_forward(
                q, q, q, out, lse, q_start, k_start, [8], [2], False, 0.5, False, False, None, None
            )
