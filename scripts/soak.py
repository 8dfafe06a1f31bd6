"""Soak: many forward + backward steps of the local op and of a ring, with the
resident memory (RSS) of every process sampled as they go. Memory must stay
flat: a leak of even one small tensor per step shows as steady growth.

    python scripts/soak.py --steps 1000            # local op, then a 2-rank ring
    python scripts/soak.py --steps 200 --world 3

Prints, per run, the RSS after the warm-up steps, at the end, and the largest
step-to-step growth over the second half; exits 1 when the RSS grew by more
than --tolerance-mib from the end of the warm-up to the end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

import ring_attention as ra
from ring_attention.parallel.testing import run_distributed

SEGS, DILS = [64, 128, 256], [1, 2, 4]


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _steps(steps: int, warmup: int, ring: bool) -> list[float]:
    """RSS after the warm-up and after each 10th step."""
    g = torch.Generator().manual_seed(0)
    n = 1024
    q, k, v = (torch.randn(2, n, 4, 32, generator=g) for _ in range(3))
    if ring:
        q, k, v = (ra.shard_sequence(t, 1) for t in (q, k, v))
    fn = ra.ring_dilated_attention if ring else ra.dilated_attention
    samples = []
    for step in range(warmup + steps):
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = fn(qs, ks, vs, SEGS, DILS, causal=True, return_lse=True)
        (out.sum() + lse.clamp_min(-1e4).sum()).backward()
        if step + 1 == warmup or (step >= warmup and (step - warmup + 1) % 10 == 0):
            samples.append(rss_mib())
    return samples


def _ring_worker(rank: int, world: int, steps: int, warmup: int) -> list[float]:
    return _steps(steps, warmup, ring=True)


def report(name: str, samples: list[float], tolerance: float) -> bool:
    half = samples[len(samples) // 2 :]
    jump = max((b - a for a, b in itertools.pairwise(half)), default=0.0)
    growth = samples[-1] - samples[0]
    ok = growth <= tolerance
    print(
        f"{name}: RSS {samples[0]:.1f} MiB after warm-up, {samples[-1]:.1f} MiB at the end "
        f"({growth:+.1f} MiB; largest 10-step growth in the second half {jump:+.1f} MiB) "
        f"{'flat' if ok else 'GROWING'}"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--world", type=int, default=2, help="ring processes (gloo)")
    parser.add_argument("--tolerance-mib", type=float, default=8.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ok = report(
        f"local op, {args.steps} steps", _steps(args.steps, args.warmup, False), args.tolerance_mib
    )
    per_rank = run_distributed(
        _ring_worker, args.world, args.steps, args.warmup, timeout=3600, pg_timeout=600
    )
    for rank, samples in enumerate(per_rank):
        name = f"ring rank {rank}/{args.world}, {args.steps} steps"
        ok = report(name, samples, args.tolerance_mib) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
