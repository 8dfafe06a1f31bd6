"""How the benchmarks measure: time, peak memory, the hardware's rate, the
environment, and the resumable result file.

Result files are JSON Lines (one JSON object per line, appended as each point
finishes; the format is described in benchmarks/README.md). A point is
identified by its ``key`` (what was measured, not when), so a re-run skips
the points already in the file.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

SCHEMA = 1
MiB = 2**20
GiB = 2**30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Flash-attention tile shapes for the CPU hardware sample: 128 queries x 512
# keys. (The kernel's forward tile has 256 query rows; torch.bmm at 256 rows ran
# at 127-242 GFLOP/s against 220-326 at 128 on the same machine, a reference
# that moved with the shape rather than the hardware.)
CPU_TILE_Q, CPU_TILE_K = 128, 512


# --------------------------------------------------------------------------- #
# time
# --------------------------------------------------------------------------- #
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_once(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of one call (CUDA events on a GPU, the host clock elsewhere)."""
    if device.type == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_call(
    fn: Callable[[], Any], device: torch.device, warmup: int, iters: int, max_s: float
) -> list[float]:
    """Milliseconds of ``iters`` calls after ``warmup``; stops repeating after
    ``max_s`` (>= 1 call)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(max(iters, 1)):
        times.append(time_once(fn, device))
        if time.perf_counter() - start > max_s:
            break
    return times


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else math.nan


# --------------------------------------------------------------------------- #
# memory
# --------------------------------------------------------------------------- #
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_growth_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Bytes one call of ``fn`` touches beyond what is allocated before it.

    CUDA: ``max_memory_allocated`` during the call minus ``memory_allocated``
    before it. CPU (Linux): the process's high-water mark is reset
    (``/proc/self/clear_refs`` <- 5) and ``VmHWM - VmRSS`` read around the
    call (page granular). None elsewhere.
    """
    gc.collect()
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    # Free heap pages kept from earlier calls are given back first (malloc_trim)
    # and allocations above 64 KiB mmap-ed during the call (unmapped on free),
    # so that reused heap memory cannot hide the call's allocations. Afterwards
    # the threshold is 32 MiB, glibc's own ceiling for it: mmap-ing every
    # tensor makes the CPU kernels several times slower.
    libc = _libc()
    if libc is None or not os.access("/proc/self/clear_refs", os.W_OK):
        return None
    m_mmap_threshold = -3  # malloc.h
    libc.malloc_trim(0)
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        rss0 = _status_kib("VmRSS")
        fn()
        return (_status_kib("VmHWM") - rss0) * 1024
    finally:
        libc.mallopt(m_mmap_threshold, 32 * MiB)


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (CUDA: mem_get_info; CPU: MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------- #
# the hardware's rate, measured in the same run
# --------------------------------------------------------------------------- #
def hardware_rate(
    device: torch.device, head_dim: int, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """FLOP/s of the matrix products the kernels are made of.

    CPU: batched GEMMs at flash-attention tile shapes,
    ``(128 x d) @ (d x 512)`` and ``(128 x 512) @ (512 x d)``, 64 tiles per
    call, all intra-op threads, in the type the kernel multiplies in (bf16
    for bfloat16 runs, where the CPU has bf16 GEMMs; float32 otherwise); and,
    as ``sgemm_rate``, one large square float32 GEMM (``2048^3``), the usual
    yardstick. CUDA: a bf16 ``8192 x 8192 x 8192`` matmul (``sgemm_rate``
    None).
    """
    if device.type == "cuda":
        size = 8192
        a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
        ms = median(time_call(lambda: torch.mm(a, b), device, 3, 20, 10.0))
        what = f"bf16 torch.mm {size}x{size}x{size}"
        rate = 2 * size**3 / (ms * 1e-3)
        sgemm = None
    else:
        tiles, d = 64, head_dim
        tile_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        q = torch.randn(tiles, CPU_TILE_Q, d, dtype=tile_dtype)
        k = torch.randn(tiles, d, CPU_TILE_K, dtype=tile_dtype)
        p = torch.randn(tiles, CPU_TILE_Q, CPU_TILE_K, dtype=tile_dtype)
        v = torch.randn(tiles, CPU_TILE_K, d, dtype=tile_dtype)

        def tile_products():
            torch.bmm(q, k)
            torch.bmm(p, v)

        ms = median(time_call(tile_products, device, 2, 15, 5.0))
        kind = "bf16" if tile_dtype == torch.bfloat16 else "fp32"
        what = (
            f"{kind} bmm at tile shapes ({CPU_TILE_Q}x{d})@({d}x{CPU_TILE_K}) and "
            f"({CPU_TILE_Q}x{CPU_TILE_K})@({CPU_TILE_K}x{d}), {tiles} tiles, "
            f"{torch.get_num_threads()} threads"
        )
        rate = 2 * 2 * tiles * CPU_TILE_Q * CPU_TILE_K * d / (ms * 1e-3)
        size = 2048
        a, b = (torch.randn(size, size) for _ in range(2))
        sgemm = 2 * size**3 / (median(time_call(lambda: torch.mm(a, b), device, 1, 5, 3.0)) * 1e-3)
    free_memory(device)
    return {"flop_rate": rate, "what": what, "sgemm_rate": sgemm}


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #
def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def is_fatal(exc: BaseException) -> bool:
    """A CUDA error after which the context is unusable."""
    s = str(exc)
    return any(
        p in s
        for p in ("illegal memory access", "device-side assert", "unspecified launch failure",
                  "misaligned address")
    )  # fmt: skip


def short_error(exc: BaseException, limit: int = 160) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:limit]}"


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``|x - ref| / |ref|`` (Frobenius, float64); inf when ``x`` is not finite."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(x), finite):
        return math.inf
    x, ref = x[finite], ref[finite]  # lse is -inf where a query reaches nothing
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------- #
# environment
# --------------------------------------------------------------------------- #
def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def library_commit() -> str:
    """The commit of the ring_attention the benchmarks import: this
    checkout's (``+dirty`` with uncommitted changes), or, for a tree exported
    by scripts/prev_tree.sh and named by PYTHONPATH, the one in its
    SOURCE_COMMIT. Finding the package does not import it."""
    spec = importlib.util.find_spec("ring_attention")
    if spec is not None and spec.origin is not None:
        tree = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
        if tree != ROOT:
            try:
                with open(os.path.join(tree, "SOURCE_COMMIT")) as f:
                    return f.read().strip()[:7] + " (exported)"
            except OSError:
                return f"? ({tree})"
    commit = _git("rev-parse", "--short", "HEAD") or "?"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return commit + ("+dirty" if dirty else "")


def environment(device: torch.device) -> dict[str, Any]:
    """Where and when: date, machine, load, versions, commit."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        dev = f"{p.name} (cc {p.major}.{p.minor}, {p.total_memory / GiB:.0f} GiB)"
    else:
        dev = f"CPU {cpu_model()}, {os.cpu_count()} cores"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "device_name": dev,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": library_commit(),
        "threads": torch.get_num_threads(),
    }


def describe(env: dict[str, Any]) -> str:
    load = ", ".join(f"{x:.1f}" for x in env["load_avg"])
    return (
        f"{env['date'][:10]} | {env['device_name']} | load avg {load} | torch {env['torch']}"
        f" | commit {env['commit']} | {env['threads']} threads"
    )


# --------------------------------------------------------------------------- #
# the result file
# --------------------------------------------------------------------------- #
def point_key(**fields: Any) -> str:
    """Canonical identity of a measured point (what, not when)."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


class ResultFile:
    """Append-only JSON Lines file; the latest record of a key wins."""

    def __init__(self, path: str, redo: bool = False):
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        self.runs: list[dict[str, Any]] = []
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.exists(path):
            for rec in read_records(path):
                if rec.get("kind") == "run":
                    self.runs.append(rec)
                elif "key" in rec:
                    self.records[rec["key"]] = rec
        self.redo_keys: set[str] = set(self.records) if redo else set()

    def done(self, key: str) -> bool:
        return key in self.records and key not in self.redo_keys

    def append(self, rec: dict[str, Any]) -> None:
        rec = {"schema": SCHEMA, **rec}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
        if rec.get("kind") == "run":
            self.runs.append(rec)
        else:
            self.records[rec["key"]] = rec
            self.redo_keys.discard(rec["key"])

    def run_of(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        return next((r for r in self.runs if r["run_id"] == rec.get("run_id")), None)


def read_records(path: str) -> list[dict[str, Any]]:
    """Every record of a result file; a line cut short by a killed run is skipped."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
