"""Sliding-window cost against the sequence length (CPU): a window of W keys
over n tokens costs O(n * W), dense causal attention O(n^2).

For each n, ``ra.dilated_attention`` on the dense causal pattern with
``window=(W - 1, 0)`` and without a window, timed round-robin in one process
(medians; the machine's load moves absolute times, so the table gives time
per token and the ratio to dense measured side by side), forward and
forward + backward.

    python benchmarks/window_scaling.py --seq-lens 4096 8192 16384 32768 --window 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import ring_attention as ra


def _time(fn, iters: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _call(q, k, v, window, backward: bool):
    def run() -> None:
        qq, kk, vv = (x.detach().requires_grad_(backward) for x in (q, k, v))
        out = ra.dilated_attention(qq, kk, vv, [q.shape[1]], [1], causal=True, window=window)
        if backward:
            out.sum().backward()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--window", type=int, default=256, help="keys a query reaches (W)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-dense-above", type=int, default=32768, help="skip dense past this n")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"# {time.strftime('%Y-%m-%d')} | {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
          f" | torch {torch.__version__} | {a.threads} thread(s) | float32 B=1 H={a.heads}"
          f" d={a.head_dim} | causal, window=(W - 1, 0), W={a.window}")  # fmt: skip
    print("| n | pass | window s | window us/token | dense s | window / dense |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in a.seq_lens:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, n, a.heads, a.head_dim, generator=g) for _ in range(3))
        for backward in (False, True):
            windowed = _call(q, k, v, (a.window - 1, 0), backward)
            dense = _call(q, k, v, None, backward) if n <= a.no_dense_above else None
            tw, td = [], []
            for _ in range(a.iters):  # round-robin: both see the same load
                tw.append(_time(windowed, 1))
                if dense is not None:
                    td.append(_time(dense, 1))
            t_w = statistics.median(tw)
            t_d = statistics.median(td) if td else float("nan")
            what = "fwd+bwd" if backward else "fwd"
            print(f"| {n} | {what} | {t_w:.4f} | {1e6 * t_w / n:.2f} | {t_d:.4f} | "
                  f"{t_w / t_d:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
