"""``bench.py ring-run``: one ring run under torchrun, checked against one
process (the main job, ``scripts/run_ring.sh``)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import torch

from . import measure, methods
from .common import ROW_BLOCK, dtype_name, fmt, resolve_dtype, write_text
from .measure import GiB, MiB


# --------------------------------------------------------------------------- #
# bench.py ring-run: one ring run (the main job), under torchrun
# --------------------------------------------------------------------------- #
def make_rows(which: int, start: int, length: int, a: argparse.Namespace) -> torch.Tensor:
    """Rows ``[start, start + length)`` of global tensor ``which`` (0 q, 1 k, 2 v,
    3 grad_out), float32 on the CPU, the same on every rank (seeded per block of
    rows, so a rank only generates the rows it holds)."""
    out = torch.empty(a.batch, length, a.heads, a.head_dim)
    if length == 0:
        return out
    for blk in range(start // ROW_BLOCK, (start + length - 1) // ROW_BLOCK + 1):
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + which * 10_007 + blk)
        rows = torch.randn(a.batch, ROW_BLOCK, a.heads, a.head_dim, generator=g)
        b0 = blk * ROW_BLOCK
        lo, hi = max(start, b0), min(start + length, b0 + ROW_BLOCK)
        out[:, lo - start : hi - start] = rows[:, lo - b0 : hi - b0]
    return out


def ring_setup(a: argparse.Namespace) -> tuple[torch.device, int, int, int]:
    """Process group (when launched by torchrun with more than one process) and device."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    dev = a.device
    if dev == "auto":
        dev = "cuda" if gpus and local_world <= gpus else "cpu"
    if dev == "cuda":
        if not gpus:
            raise SystemExit("--device cuda: no GPU visible")
        torch.cuda.set_device(local_rank % gpus)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    cores = os.cpu_count() or 1
    torch.set_num_threads(a.threads or max(1, cores // max(1, local_world)))
    backend = a.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" and local_world <= gpus else "gloo"
    # One process joins a process group too when a backend is named: the
    # ring then runs its collectives (handshake, exchange plan) through it
    # (NCCL on a single GPU, as far as one GPU allows).
    if world > 1 or a.backend != "auto":
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(minutes=a.timeout_min),
            **({"device_id": device} if backend == "nccl" else {}),
        )
        return device, dist.get_rank(), world, cores
    return device, 0, 1, cores


def reference_need_bytes(a: argparse.Namespace, itemsize: int) -> int:
    """Bytes the single-process check needs on rank 0: the whole q, k, v, out
    (+ grad_out, dq, dk, dv) and the gathered ring output (+ grads)."""
    q = a.batch * a.seq_len * a.heads * a.head_dim * itemsize
    return q * ((8 + 4) if a.backward else (4 + 1))


def decide_check(a: argparse.Namespace, device: torch.device, itemsize: int) -> tuple[bool, str]:
    need = reference_need_bytes(a, itemsize)
    free = measure.available_bytes(device)
    where = f"{free / GiB:.1f} GiB free" if free is not None else "free memory unknown"
    if a.check == "no":
        return False, "check: off (--check no)"
    if a.check == "yes":
        return True, f"check: on (--check yes); the single process needs ~{need / GiB:.2f} GiB"
    if free is not None and need <= 0.5 * free:
        return True, (
            f"check: on — the single-process reference needs ~{need / GiB:.2f} GiB "
            f"({where} on rank 0)"
        )
    return False, (
        f"check: SKIPPED — the single-process reference would need ~{need / GiB:.1f} GiB "
        f"({where} on rank 0; it runs when it needs at most half); --check yes forces it"
    )


def ring_rank_run(a: argparse.Namespace, device, rank: int, world: int) -> tuple[dict, Any]:
    """This rank's measurements; also returns (out, grads) for the check."""
    import torch.distributed as dist

    dtype = resolve_dtype(a.dtype, device)
    pieces = methods.layout_pieces(a.seq_len, world, rank, a.layout)
    kw = dict(causal=a.causal, head_groups=a.head_groups, layout=a.layout)

    def local(which: int) -> torch.Tensor:
        parts = [make_rows(which, s, ln, a) for s, ln in pieces]
        return torch.cat(parts, dim=1).to(device=device, dtype=dtype)

    q, k, v, go = (local(i) for i in range(4))
    cpu_clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time

    def barrier():
        if world > 1:
            dist.barrier()

    def timed(call: Callable[[], Any]) -> tuple[list[float], list[float]]:
        for _ in range(a.warmup):
            barrier()
            call()
        wall, cpu = [], []
        for _ in range(a.iters):
            barrier()
            measure.sync(device)
            t0, c0 = time.perf_counter(), cpu_clock()
            call()
            measure.sync(device)
            cpu.append((cpu_clock() - c0) * 1e3)
            wall.append((time.perf_counter() - t0) * 1e3)
        return wall, cpu

    def measured(name: str, call: Callable[[], Any], *inputs: torch.Tensor) -> dict:
        """``call``'s median wall and CPU ms, its wall times and its peak bytes
        (``inputs`` held plus what the call grows), keyed ``{name}_...``."""
        wall, cpu = timed(call)
        barrier()
        growth = measure.peak_growth_bytes(call, device)
        held = measure.tensor_bytes(*inputs)
        return {
            f"{name}_ms": measure.median(wall),
            f"{name}_cpu_ms": measure.median(cpu),
            f"{name}_times_ms": wall,
            f"{name}_peak_bytes": None if growth is None else held + growth,
        }

    def fwd() -> None:
        with torch.no_grad():
            methods.ring_call(q, k, v, a.segments, a.dilations, **kw)

    row: dict[str, Any] = {"rank": rank, "shard": q.shape[1], "pieces": pieces}
    row.update(measured("fwd", fwd, q, k, v))
    c = methods.exchange_counters()
    row.update(sent_fwd=c["sent_fwd"], buffers_fwd=c["buffers"])
    out, grads = None, []
    if a.backward:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def fwdbwd() -> None:
            o = methods.ring_call(*leaves, a.segments, a.dilations, **kw)
            torch.autograd.grad(o, leaves, go)

        row.update(measured("fwdbwd", fwdbwd, q, k, v, go))
        c = methods.exchange_counters()
        row.update(sent_all=c["sent_all"], buffers_all=c["buffers"])
        if a.check_on:
            out = methods.ring_call(*leaves, a.segments, a.dilations, **kw)
            grads = list(torch.autograd.grad(out, leaves, go))
    elif a.check_on:
        with torch.no_grad():
            out = methods.ring_call(q, k, v, a.segments, a.dilations, **kw)
    itemsize = torch.empty((), dtype=dtype).element_size()
    row["plan_fwd"], row["plan_all"] = methods.plan_bytes_sent(
        a.seq_len,
        a.heads,
        a.segments,
        a.dilations,
        **kw,
        batch=a.batch,
        head_dim=a.head_dim,
        itemsize=itemsize,
    )
    row["pairs"] = methods.pattern_pairs(
        a.seq_len, a.heads, a.segments, a.dilations, a.causal, a.head_groups, a.batch, pieces
    )
    return row, (out, grads)


def ring_check(a, device, rank: int, out, grads) -> dict[str, float] | None:
    """The gathered ring output (and grads) vs one process on rank 0:
    relative (Frobenius) and max abs errors."""
    ra = methods.ring_attention()
    full = [ra.gather_sequence(t.detach(), dim=1, layout=a.layout) for t in [out, *grads]]
    if rank != 0:
        return None
    dtype = resolve_dtype(a.dtype, device)
    fq, fk, fv, fgo = (make_rows(i, 0, a.seq_len, a).to(device, dtype) for i in range(4))
    leaves = [t.requires_grad_(a.backward) for t in (fq, fk, fv)]
    with torch.set_grad_enabled(a.backward):
        ref = ra.dilated_attention(
            *leaves, a.segments, a.dilations, causal=a.causal, head_groups=a.head_groups
        )
    refs = [ref.detach()]
    if a.backward:
        refs += list(torch.autograd.grad(ref, leaves, fgo))
    errs: dict[str, float] = {}
    for name, x, r in zip(("out", "dq", "dk", "dv"), full, refs, strict=False):
        errs[name] = measure.rel_err(x, r)
        errs[name + "_max_abs"] = (x.double() - r.double()).abs().max().item()
    return errs


RING_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def ring_table(rows: list[dict], a: argparse.Namespace, verbose: bool) -> list[str]:
    """Rank 0's table: one row per rank, at most 100 columns."""
    bwd = a.backward
    hdr = (
        f"{'rank':>4} {'shard':>7} {'fwd ms':>8} {'cpu ms':>8}"
        + (f" {'fwd+bwd ms':>10} {'cpu ms':>8}" if bwd else "")
        + f" {'GFLOP/s':>8} {'peak MiB':>9} {'sent MiB':>9} {'plan MiB':>9}"
    )
    lines = [hdr]
    for r in rows:
        rate_ms = r["fwdbwd_ms"] if bwd else r["fwd_ms"]
        gfs = methods.flops(r["pairs"], a.head_dim, bwd) / (rate_ms * 1e6)
        peak = r["fwdbwd_peak_bytes"] if bwd else r["fwd_peak_bytes"]
        sent = r["sent_all"] if bwd else r["sent_fwd"]
        plan = r["plan_all"] if bwd else r["plan_fwd"]
        line = f"{r['rank']:>4} {r['shard']:>7} {r['fwd_ms']:>8.1f} {r['fwd_cpu_ms']:>8.1f}"
        if bwd:
            line += f" {r['fwdbwd_ms']:>10.1f} {r['fwdbwd_cpu_ms']:>8.1f}"
        line += (
            f" {gfs:>8.1f} {fmt(None if peak is None else peak / MiB):>9}"
            f" {sent / MiB:>9.3f} {plan / MiB:>9.3f}"
        )
        lines.append(line)
    if verbose:
        lines.append("")
        lines.append(
            f"{'rank':>4} {'pieces':>22} {'pairs':>13} {'buffers MiB':>11}"
            f" {'sent fwd MiB':>12} {'plan fwd MiB':>12}"
        )
        for r in rows:
            pieces = ",".join(f"{s}+{ln}" for s, ln in r["pieces"])
            buf = max(r["buffers_fwd"], r.get("buffers_all", 0))
            lines.append(
                f"{r['rank']:>4} {pieces:>22} {r['pairs']:>13} {buf / MiB:>11.2f}"
                f" {r['sent_fwd'] / MiB:>12.3f} {r['plan_fwd'] / MiB:>12.3f}"
            )
    return lines


def check_ring_args(a: argparse.Namespace) -> int:
    """Every option of ``ring-run`` checked once, before any process starts
    work (``scripts/run_ring.sh`` runs ``--print-nproc`` first, which checks
    too): ``SystemExit`` naming the option and what it must be. Returns the
    number of processes ``scripts/run_ring.sh`` launches (one per GPU with two
    or more GPUs, else ``$NPROC``, default 4)."""
    from ring_attention.core.pattern import Pattern

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SystemExit(f"ring-run: {message}")

    need(1 <= a.seq_len < 2**62, f"--seq-len must be in [1, 2**62), got {a.seq_len}")
    for option, value in (("--batch", a.batch), ("--heads", a.heads),
                          ("--head-dim", a.head_dim), ("--iters", a.iters)):  # fmt: skip
        need(value >= 1, f"{option} must be >= 1, got {value}")
    need(a.warmup >= 0, f"--warmup must be >= 0, got {a.warmup}")
    need(a.threads >= 0, f"--threads must be >= 0 (0: cores / processes), got {a.threads}")
    need(0 <= a.seed < 2**32, f"--seed must be in [0, 2**32), got {a.seed}")
    need(0 < a.timeout_min < float("inf"), f"--timeout-min must be > 0, got {a.timeout_min}")
    try:
        Pattern(a.segments, a.dilations, head_groups=a.head_groups).check_heads(a.heads)
    except ValueError as e:
        raise SystemExit(f"ring-run: --segments / --dilations / --head-groups: {e}") from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = os.environ.get("NPROC", "4")
    need(nproc.isdigit() and int(nproc) >= 1, f"NPROC must be a positive integer, got {nproc!r}")
    if a.device == "cpu" or (a.device == "auto" and gpus < 2):
        # q, k, v and grad_out as float32, all ranks of this machine together
        need_bytes = 4 * 4 * a.batch * a.seq_len * a.heads * a.head_dim
        free = measure.available_bytes(torch.device("cpu"))
        need(
            free is None or need_bytes <= free,
            f"--seq-len {a.seq_len} x --batch {a.batch} x --heads {a.heads} x --head-dim "
            f"{a.head_dim}: the inputs alone need {need_bytes / GiB:.1f} GiB, "
            f"{(free or 0) / GiB:.1f} GiB are available",
        )
    return gpus if gpus >= 2 else int(nproc)


def cmd_ring_run(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    nproc = check_ring_args(a)
    if a.print_nproc:
        print(nproc)
        return 0
    device, rank, world, cores = ring_setup(a)
    dtype = resolve_dtype(a.dtype, device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    decision = [decide_check(a, device, itemsize) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(decision, src=0)
    a.check_on, check_line = decision[0]
    threads = torch.get_num_threads()
    if rank == 0 and not a.quiet:
        backend = dist.get_backend() if dist.is_initialized() else "none"
        print(
            f"ring_dilated_attention: {world} process(es), backend {backend}, {device.type}, "
            f"{dtype_name(dtype)}, {threads} thread(s) per process"
        )
        note(
            f"n={a.seq_len} batch={a.batch} heads={a.heads} head_dim={a.head_dim} "
            f"segments={list(a.segments)} dilations={list(a.dilations)} causal={a.causal} "
            f"head_groups={a.head_groups} layout={a.layout} iters={a.iters} "
            f"warmup={a.warmup} backward={a.backward}"
        )
        note(check_line)
        sys.stdout.flush()
    row, (out, grads) = ring_rank_run(a, device, rank, world)
    errs = ring_check(a, device, rank, out, grads) if a.check_on else None
    rows = [None] * world
    if world > 1:
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    rc = 0
    if rank == 0:
        tol = RING_TOL[dtype]
        failed = errs is not None and any(
            v > tol for k, v in errs.items() if not k.endswith("_max_abs")
        )
        rc = 1 if failed else 0
        if not a.quiet:
            print_ring_report(a, rows, device, world, cores, threads, errs, tol)
        if a.json:
            env = measure.environment(device)
            write_text(
                a.json,
                [
                    json.dumps(
                        {
                            "config": {
                                k: v for k, v in vars(a).items() if k not in ("func", "json")
                            },
                            "world": world,
                            "device": device.type,
                            "dtype": dtype_name(dtype),
                            "threads": threads,
                            "cores": cores,
                            "env": env,
                            "ranks": rows,
                            "check": errs,
                            "check_tolerance": tol if errs is not None else None,
                        }
                    )
                ],
            )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return rc


def note(text: str) -> None:
    """An explanation line of the main job's output, wrapped at 100 columns."""
    print(textwrap.fill(text, width=100, initial_indent="  ", subsequent_indent="    "))


def print_ring_report(a, rows, device, world, cores, threads, errs, tol) -> None:
    print("\n".join(ring_table(rows, a, a.verbose)))
    n_ms = "fwd+bwd" if a.backward else "fwd"
    note(
        f"ms: wall time per call (median of {a.iters}); cpu ms: the process's CPU time; "
        f"GFLOP/s: pattern FLOPs / wall time ({n_ms}); peak MiB: inputs + the peak growth of "
        f"one call; sent, plan MiB: bytes sent per layer ({n_ms}), measured and from the "
        "exchange plan"
    )
    if device.type == "cpu" and world * threads > cores:
        note(
            f"{world} processes x {threads} thread(s) on {cores} cores take turns: wall time "
            f"cannot fall {world}x, per-rank cpu ms can"
        )
    pairs = [r["pairs"] for r in rows]
    if world > 1 and max(pairs) > 0:
        note(f"load balance: work (pairs) max/mean {max(pairs) / (sum(pairs) / world):.2f}")
    if errs is None:
        note("check: not run (see above)")
    else:
        rel = ", ".join(f"{k} {v:.1e}" for k, v in errs.items() if not k.endswith("_max_abs"))
        mx = max(v for k, v in errs.items() if k.endswith("_max_abs"))
        ok = all(v <= tol for k, v in errs.items() if not k.endswith("_max_abs"))
        note(
            f"check vs one process: {'PASS' if ok else 'FAIL'} (relative error <= {tol:g}): "
            f"{rel}; max abs error {mx:.1e}"
        )
    if not a.verbose and not a.json:
        note("more per rank: --verbose; everything as JSON: --json FILE")
