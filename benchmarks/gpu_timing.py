"""Timing and memory for benchmarks/bench_gpu.py: CUDA-event medians, peak
memory of one call, the bf16 matmul rate, and the error classification
(OOM / fatal CUDA error) the sweep's budget logic relies on.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch

GiB = 1024**3


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(fn, device, warmup: int, iters: int, max_s: float):
    """Median ms of ``fn`` (CUDA events), peak bytes of one call, runs, warm-up s."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    sync(device)
    warm_s = time.perf_counter() - t0
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    times = []
    t1 = time.perf_counter()
    for _ in range(iters):
        if device.type == "cuda":
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        else:
            s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - s) * 1e3)
        if time.perf_counter() - t1 > max_s:
            break
    return statistics.median(times), peak, len(times), warm_s


def matmul_rate(device, size: int, iters: int) -> float | None:
    """bf16 torch.mm TFLOP/s on random data (median of ``iters``); None off CUDA."""
    if device.type != "cuda":
        return None
    ab = [torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2)]
    ms, _, _, _ = measure(lambda: torch.mm(ab[0], ab[1]), device, 3, iters, 10.0)
    ab.clear()
    free_memory(device)
    return 2 * size**3 / (ms * 1e-3) / 1e12


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, _OOM) or "out of memory" in str(exc).lower()


def is_fatal(exc: BaseException) -> bool:
    s = str(exc)
    return any(
        p in s
        for p in ("illegal memory access", "device-side assert", "unspecified launch failure",
                  "CUDA error: an illegal", "misaligned address")
    )  # fmt: skip


def fmt_rate(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def short_error(exc: BaseException, limit: int = 90) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:limit]}"


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖x - ref‖ / ‖ref‖`` in float64 (inf when ``x`` is not finite)."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return math.inf
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
