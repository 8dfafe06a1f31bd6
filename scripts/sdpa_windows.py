"""Time and memory of the local op's dense per-branch path against the rows
per window (``RING_ATTENTION_DENSE_SPAN_ROWS``, ring_attention/core/config.py),
on CUDA.

The per-branch calls of a window write their outputs (and in the backward
their gradients) into part buffers before one merge, so the window bounds
that memory; smaller windows mean more, smaller dense calls. This times the
default dispatch (bf16, LongNet pattern, batch 1) forward and forward+backward
with each window setting, in one process:

    python3 scripts/sdpa_windows.py --n 131072 524288 --windows 131072 65536 32768

Prints one markdown row per point: median ms of --iters calls (CUDA events,
after a warm-up call), and the peak (inputs + the peak growth of one call)
over the bytes of q, k, v, out (fwd) or q, k, v, out and their gradients
(fwd+bwd), as benchmarks/bench.py reports it.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import ring_attention as ra
from ring_attention.core import config

SEGMENTS = [2048, 4096, 8192, 16384, 32768]
DILATIONS = [1, 2, 4, 6, 12]


def one(n: int, heads: int, d: int, passes: str, iters: int) -> tuple[float, float]:
    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, n, heads, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    grad = passes == "fwdbwd"
    for t in (q, k, v):
        t.requires_grad_(grad)
    dout = torch.randn_like(q) if grad else None

    def call() -> None:
        out = ra.dilated_attention(q, k, v, SEGMENTS, DILATIONS)
        if grad:
            out.backward(dout)
            for t in (q, k, v):
                t.grad = None

    call()  # warm-up: caches, handles, cuDNN / flash selection
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - base
    unit = q.numel() * q.element_size()
    tensors = 8 if grad else 4  # q, k, v, out (+ dq, dk, dv, dout)
    inputs = (4 if grad else 3) * unit
    return statistics.median(times), (inputs + growth) / (tensors * unit)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[131072, 524288])
    p.add_argument("--configs", nargs="+", default=["12x64", "16x128"])
    p.add_argument("--windows", type=int, nargs="+", default=[131072, 65536, 32768])
    p.add_argument("--passes", nargs="+", default=["fwd", "fwdbwd"])
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16, LongNet, batch 1")
    print("| n | h x d | pass | window rows | ms | peak / tensors |")
    print("|---:|---|---|---:|---:|---:|")
    for n in a.n:
        for cfg in a.configs:
            heads, d = (int(x) for x in cfg.split("x"))
            for passes in a.passes:
                for w in a.windows:
                    os.environ[config.SPAN_ROWS] = str(w)
                    ms, peak = one(n, heads, d, passes, a.iters)
                    print(f"| {n} | {cfg} | {passes} | {w} | {ms:.1f} | {peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
