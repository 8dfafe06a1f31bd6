"""Kernel throughput: measured benchmark records (the nearest shape of
``ours``: the format in docs/planner.md), or labelled assumptions."""

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

_DTYPE_ALIASES = {
    alias: name
    for name, aliases in (("float32", "fp32 float"), ("float64", "fp64 double"),
                          ("bfloat16", "bf16"), ("float16", "fp16 half"))
    for alias in (*aliases.split(), f"torch.{name}")
}  # fmt: skip


def dtype_name(name: str) -> str:
    """Canonical dtype name (``bf16`` -> ``bfloat16``, ...)."""
    return _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())


def _device_type(name: str) -> str:
    return str(name).split(":")[0].lower()


@dataclass(frozen=True)
class Rates:
    """Effective kernel rates in FLOP/s (pattern FLOPs per second)."""

    forward: float
    forward_backward: float  # forward + backward together
    source: str  # where they come from (printed with every prediction)

    @property
    def backward(self) -> float:
        """Rate of the backward alone, so that ``4 d/forward + 10 d/backward
        = 14 d/forward_backward``."""
        inv = 14 / self.forward_backward - 4 / self.forward
        return 10 / inv if inv > 0 else self.forward_backward


def load_records(path: str | Path) -> list[dict]:
    """The records of a benchmark JSON file (see the module docstring)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("records")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of records or {{'records': [...]}}")
    return [r for r in data if isinstance(r, dict)]


def _rate(rec: dict) -> float | None:
    try:
        if rec.get("flops") is not None:
            return float(rec["flops"]) / float(rec["seconds"])
        return None if rec.get("gflops") is None else float(rec["gflops"]) * 1e9
    except (TypeError, ValueError, ZeroDivisionError):
        return None


def _nearest(records: list[dict], n: int, heads: int, head_dim: int) -> tuple[float, str] | None:
    """The median rate of the nearest shape in ``records``, and that shape."""
    best: dict[tuple, list[float]] = {}
    for rec in records:
        rate = _rate(rec)
        try:
            shape = (int(rec["n"]), int(rec["heads"]), int(rec["head_dim"]))
        except (KeyError, TypeError, ValueError):
            continue
        if rate and rate > 0 and min(shape) > 0:
            best.setdefault(shape, []).append(rate)
    if not best:
        return None

    def dist(shape: tuple) -> float:
        return sum(abs(math.log(a / b)) for a, b in zip(shape, (n, heads, head_dim), strict=True))

    shape = min(best, key=lambda s: (dist(s), -s[0]))
    return statistics.median(best[shape]), "n={} heads={} head_dim={}".format(*shape)


def rates_from_records(
    records: list[dict], *, n: int, heads: int, head_dim: int, dtype: str, device: str
) -> Rates | None:
    """Rates at the nearest shape, or ``None`` when the records hold no
    forward and forward+backward rate of ``ours`` for this dtype and device."""
    dtype, device = dtype_name(dtype), _device_type(device)
    found = []
    for pass_ in ("forward", "forward+backward"):
        pool = [r for r in records if r.get("impl") == "ours" and r.get("pass") == pass_
                and dtype_name(r.get("dtype", "")) == dtype
                and _device_type(r.get("device", "")) == device]  # fmt: skip
        hit = _nearest(pool, n, heads, head_dim)
        if hit is None:
            return None
        found.append(hit)
    (fwd, fs), (fb, bs) = found
    source = (
        f"measured: benchmark records of 'ours' {dtype} {device}, nearest shapes {fs} (forward), "
        f"{bs} (forward+backward)"
    )
    return Rates(forward=fwd, forward_backward=fb, source=source)


def assumed_rates(device: str, dtype: str, threads: int = 1) -> Rates:
    """Labelled defaults when nothing was measured: CPU 50 GFLOP/s per thread, CUDA bf16/fp16
    121 / 143 TFLOP/s (one H100: ``benchmarks/results/gpu_h100_2026-11-26/fa4``), float32 and
    float64 on GPUs placeholders (sources: docs/planner.md)."""
    dtype, device = dtype_name(dtype), _device_type(device)
    if device == "cpu":
        per = 50e9 * (0.5 if dtype == "float64" else 1.0) * max(1, threads)
        return Rates(per, per, f"ASSUMED {per / 1e9:.0f} GFLOP/s ({threads} thread(s) x 50, the "
                     "one-thread float32 rate in benchmarks/RESULTS.md); pass --bench-json or "
                     "--tflops")  # fmt: skip
    if dtype in ("float32", "float64"):
        fwd, fb = (20e12, 15e12) if dtype == "float32" else (10e12, 7.5e12)
        why = f"{dtype} kernels not timed on a GPU"
    else:
        fwd, fb = 121e12, 143e12
        why = "our local op on one H100, 16x128, n 524288 (benchmarks/RESULTS.md, H100 table)"
    return Rates(fwd, fb, f"ASSUMED {fwd / 1e12:.0f} / {fb / 1e12:.0f} TFLOP/s (forward / "
                 f"forward+backward): {why}; pass --bench-json or --tflops")  # fmt: skip


def acc_bytes(itemsize: int) -> int:
    """Accumulation bytes: float64 stays float64, everything else float32."""
    return 8 if itemsize == 8 else 4
