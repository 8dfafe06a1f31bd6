"""Bytes a rank sends per sliding-window layer against the sequence length:
the ring's are flat in n for a window (in ring mode and inside the hybrid),
linear in n for dense causal.
The planner's traffic model on the ring's own exchange plans (nothing run):

    python benchmarks/window_bytes.py [--seq-lens 16384 65536 262144] [--ranks 4]
"""

from __future__ import annotations

import argparse

import torch

import ring_attention  # noqa: F401  (the ring's exact plans, for the planner)
from ring_attention.planner.capacity import Setup
from ring_attention.planner.modes import evaluate_mode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536, 262144])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--window", type=int, default=4096, help="W: window=(W - 1, 0)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    p, grids = args.ranks, {"ring": (args.ranks, 1), "hybrid": (args.ranks // 2, 2)}
    print(f"{p} ranks, {args.heads} heads x {args.head_dim}, bf16, batch 1, causal; "
          "MB the busiest rank sends per layer, forward: ring + all-to-all "
          "(the all-to-alls move the rank's own shard: O(n / p) in any mode)")  # fmt: skip
    print(f"{'layer':<22}{'mode':<8}" + "".join(f"{n:>22}" for n in args.seq_lens))
    for name, window in ((f"window {args.window}", (args.window - 1, 0)), ("dense causal", None)):
        setup = Setup(p, "cuda", 80 << 30, 0, args.heads, args.heads, args.head_dim, 1, "bfloat16",
                      pattern="dense", causal=True, window=window, source="plan")  # fmt: skip
        for mode, (R, U) in grids.items():
            cells = []
            for n in args.seq_lens:
                ranks = evaluate_mode(setup, n, R, U, mode=mode).ranks
                ring = max(r.ring_forward for r in ranks) / 1e6
                a2a = max(r.a2a_forward for r in ranks) / 1e6
                cells.append(f"{ring:.2f} + {a2a:.2f}")
            print(f"{name:<22}{mode:<8}" + "".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
