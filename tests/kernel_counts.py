"""Instruction counts of the tensor-core kernels, executed by the CPU emulator
(tests/cuda_emulator): per forward and backward call, the whole-warp `mma`,
`ldmatrix`, shuffles and votes and the block barriers, and their ratios per
`mma`. Not a timing: it shows how a kernel change moved the instruction mix
(run it in a checkout of the earlier commit too, with this emulator).

    python tests/kernel_counts.py [--n 1024] [--head-dims 64 128]
"""

from __future__ import annotations

import argparse
import sys

import torch
from cuda_emulator import build
from op_helpers import Cfg, block_backward, block_forward, fresh_acc, make_inputs

NAMES = ["launches", "blocks", "lane arrivals", "barriers", "syncwarp", "shuffle", "vote", "mma",
         "ldmatrix"]  # fmt: skip


def counts(ops) -> dict[str, int]:
    return dict(zip(NAMES, ops.take_stats(), strict=True))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    a = p.parse_args()
    ops = build.load()
    if ops is None:
        print(f"kernel_counts: no emulator: {build.MISSING}")
        return 1
    ops.configure(0, 90)
    segs, dils = [256, 512, 1024], [1, 2, 4]
    print(f"bf16, sm_90, n {a.n}, heads {a.heads}, segments {segs}, dilations {dils}")
    print("| d | causal | pass | mma | ldmatrix / mma | barriers / 1000 mma | shuffles / mma |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for d in a.head_dims:
        for causal in (False, True):
            cfg = Cfg(1, a.n, a.heads, d, segs, dils, causal)
            q, k, v, go, _ = make_inputs(cfg, torch.bfloat16, "cpu", seed=d)
            out, lse = fresh_acc(q)
            ops.take_stats()
            block_forward(cfg, q, k, v, out, lse, 0, 0, None, ops=ops)
            fwd = counts(ops)
            grads = [torch.zeros(x.shape) for x in (q, k, v)]
            block_backward(cfg, go, q, k, v, out.bfloat16(), lse, *grads, 0, 0, None, ops=ops)
            bwd = counts(ops)
            for name, c in (("fwd", fwd), ("bwd", bwd)):
                mma = c["mma"]
                print(
                    f"| {d} | {causal} | {name} | {mma} | {c['ldmatrix'] / mma:.3f} | "
                    f"{1000 * c['barriers'] / mma:.1f} | {c['shuffle'] / mma:.3f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
