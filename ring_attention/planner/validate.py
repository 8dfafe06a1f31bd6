"""Predictions of the planner against measured ring runs on this machine.

    python -m ring_attention.planner.validate                 # ~2 min on 2 cores
    python -m ring_attention.planner.validate --seq-len 8192 --worlds 1 2

Run from a checkout: it times the local operator (unless ``--bench-json``),
runs ``ring_dilated_attention`` in ``p`` fresh gloo processes for every
``p`` in ``--worlds`` (tensor and resident peaks, CPU and wall time per
rank), predicts the same with the planner, and prints one markdown table
per quantity (worst rank per ``p``, and every rank); ``--json`` keeps it
all. What is measured and how: docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..core.pairs import pattern_flops, reached_pairs
from ..core.pattern import Pattern
from ..testing import run_distributed
from .capacity import Setup, evaluate
from .memory import KERNEL_WORKSPACE
from .throughput import load_records
from .timing import Link

__all__ = ["main"]

MiB = 2**20


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def resident_growth(call) -> int:
    """Peak resident bytes ``call()`` adds (``VmHWM`` after minus ``VmRSS`` before)."""
    base = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    call()
    return _status_bytes("VmHWM") - base


def tensor_peak(call) -> int:
    """Peak CPU tensor bytes allocated by ``call()`` and not yet freed.

    From the PyTorch profiler's allocation events, in time order: a running
    sum of the blocks allocated during the call, less those of them freed
    (matched by address). Frees of blocks allocated before the call (another
    thread may release an earlier call's buffers at any moment) are ignored.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = []

    def walk(evs) -> None:
        for e in evs:
            if e.typed[0] == _EventType.Allocation:
                a = e.typed[1]
                events.append((e.start_time_ns, a.alloc_size, a.ptr))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    live: dict[int, int] = {}
    total = peak = 0
    for _, size, ptr in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live[ptr] = size
            total += size
            peak = max(peak, total)
        elif ptr in live:
            total -= live.pop(ptr)
    return peak


def _inputs(spec: dict, world: int, rank: int) -> list[torch.Tensor]:
    import ring_attention as ra

    g = torch.Generator().manual_seed(spec["seed"])
    shape = (spec["batch"], spec["n"], spec["heads"], spec["head_dim"])
    full = [torch.randn(shape, generator=g) for _ in range(4)]  # q, k, v, grad_out
    del world, rank  # the default group decides the shard
    return [ra.shard_sequence(t, dim=1).contiguous() for t in full]


def _ring_worker(rank: int, world: int, spec: dict) -> dict:
    import gc

    import torch.distributed as dist

    import ring_attention as ra
    from ring_attention.parallel.exchange import last_exchange_stats

    q, k, v, go = _inputs(spec, world, rank)
    segs, dils = spec["segments"], spec["dilations"]
    out: dict = {"rank": rank, "local_len": q.shape[1]}
    for mode in ("fwd", "fwdbwd"):
        backward = mode == "fwdbwd"
        qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))

        def call(qq=qq, kk=kk, vv=vv, backward=backward) -> None:
            for t in (qq, kk, vv):
                t.grad = None
            if backward:
                ra.ring_dilated_attention(qq, kk, vv, segs, dils, causal=spec["causal"]).backward(
                    go
                )
            else:
                with torch.no_grad():
                    ra.ring_dilated_attention(qq, kk, vv, segs, dils, causal=spec["causal"])

        def settle(qq=qq, kk=kk, vv=vv) -> None:
            for t in (qq, kk, vv):
                t.grad = None
            gc.collect()
            dist.barrier()

        call()  # warm-up: builds and caches the plan
        settle()
        tensor = tensor_peak(call)
        settle()
        resident = resident_growth(call)
        buffers = dict(last_exchange_stats.buffer_bytes)
        cpu, wall = [], []
        for _ in range(spec["iters"]):
            settle()
            t0, c0 = time.perf_counter(), time.thread_time()
            call()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
        inputs = sum(t.numel() * t.element_size() for t in (q, k, v)) + (
            go.numel() * go.element_size() if backward else 0
        )
        out[mode] = {
            "inputs": inputs,
            "tensor_call": tensor,
            "resident_call": resident,
            "buffers": buffers,
            "cpu_s": statistics.median(cpu),
            "wall_s": statistics.median(wall),
        }
    return out


def _calibrate_worker(rank: int, world: int, spec: dict) -> list[dict]:
    """Benchmark records of the local operator at every length in ``spec["lengths"]``."""
    import ring_attention as ra

    del rank, world
    records = []
    pattern = Pattern(spec["segments"], spec["dilations"], causal=spec["causal"])
    for n in spec["lengths"]:
        g = torch.Generator().manual_seed(1)
        shape = (spec["batch"], n, spec["heads"], spec["head_dim"])
        q, k, v, go = (torch.randn(shape, generator=g) for _ in range(4))
        pairs = reached_pairs(pattern, n, spec["heads"])
        for pass_ in ("forward", "forward+backward"):
            backward = pass_ == "forward+backward"
            qq, kk, vv = (t.requires_grad_(backward) for t in (q, k, v))

            def call(qq=qq, kk=kk, vv=vv, go=go, backward=backward) -> None:
                kw = dict(causal=spec["causal"])
                if backward:
                    for t in (qq, kk, vv):
                        t.grad = None
                    ra.dilated_attention(qq, kk, vv, spec["segments"], spec["dilations"], **kw
                                         ).backward(go)  # fmt: skip
                else:
                    with torch.no_grad():
                        ra.dilated_attention(qq, kk, vv, spec["segments"], spec["dilations"], **kw)

            call()
            times = []
            for _ in range(spec["iters"]):
                c0 = time.thread_time()
                call()
                times.append(time.thread_time() - c0)
            seconds = statistics.median(times)
            flops = pattern_flops(pairs, spec["head_dim"], spec["batch"], backward=backward)
            records.append({
                "impl": "ours", "pass": pass_, "n": n, "heads": spec["heads"],
                "head_dim": spec["head_dim"], "dtype": "float32", "device": "cpu",
                "batch": spec["batch"], "seconds": seconds, "flops": flops,
                "timer": "thread CPU time, 1 thread",
            })  # fmt: skip
    return records


def _predict(args: argparse.Namespace, records: list[dict], world: int) -> list[dict]:
    setup = Setup(
        ranks=world, device="cpu", memory=1 << 62, reserve=0, heads=args.heads,
        kv_heads=args.heads, head_dim=args.head_dim, batch=args.batch, dtype="float32",
        pattern=None, segments=tuple(args.segments), dilations=tuple(args.dilations),
        causal=args.causal, records=tuple(records),
        link=Link(args.link_gbps, args.link_latency_us), source="plan",
    )  # fmt: skip
    ev = evaluate(setup, args.seq_len)
    rows = []
    for j in range(world):
        m = ev.memories[j]
        inputs_fwd = m.inputs["q"] + m.inputs["k, v"]
        fwd_call = sum(m.forward.values())
        bwd_tensor = sum(v for k, v in m.backward.items() if k != KERNEL_WORKSPACE)
        bwd_all = sum(m.backward.values())
        t = ev.times[j]
        fb_inputs = inputs_fwd + m.inputs["grad_out"]
        rows.append({
            "rank": j,
            "fwd": {"tensor_peak": inputs_fwd + fwd_call, "resident_peak": inputs_fwd + fwd_call,
                    "buffers": sum(m.buffers["forward"].values()),
                    "compute_s": t.compute_forward, "layer_s": t.forward},
            "fwdbwd": {"tensor_peak": fb_inputs + max(fwd_call, bwd_tensor),
                       "resident_peak": fb_inputs + max(fwd_call, bwd_all),
                       "buffers": sum(m.buffers["backward"].values()),
                       "compute_s": t.compute_forward_backward, "layer_s": t.forward_backward},
            "rate_source": ev.rates.source,
        })  # fmt: skip
    return rows


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def _ratio(pred: float, meas: float) -> str:
    return f"{pred / meas:.3f}" if meas > 0 else "-"


def report(results: dict) -> str:
    """Markdown tables of predicted vs measured (worst rank per p, then every rank)."""
    mem_rows, time_rows, rank_rows = [], [], []
    for world, (measured, predicted) in sorted(results["runs"].items(), key=lambda x: int(x[0])):
        for mode in ("fwd", "fwdbwd"):
            ms = [r[mode] for r in measured]
            ps = [r[mode] for r in predicted]
            m_tensor = max(r["inputs"] + r["tensor_call"] for r in ms)
            p_tensor = max(r["tensor_peak"] for r in ps)
            m_res = max(r["inputs"] + r["resident_call"] for r in ms)
            p_res = max(r["resident_peak"] for r in ps)
            m_buf = max(max(r["buffers"].values(), default=0) for r in ms)
            p_buf = max(r["buffers"] for r in ps)
            mem_rows.append(
                [world, mode, f"{p_tensor / MiB:.2f}", f"{m_tensor / MiB:.2f}",
                 _ratio(p_tensor, m_tensor), f"{p_res / MiB:.2f}", f"{m_res / MiB:.2f}",
                 _ratio(p_res, m_res), f"{p_buf / MiB:.2f}", f"{m_buf / MiB:.2f}"]
            )  # fmt: skip
            m_cpu = max(r["cpu_s"] for r in ms)
            p_cpu = max(r["compute_s"] for r in ps)
            m_wall = max(r["wall_s"] for r in ms)
            p_wall = max(r["layer_s"] for r in ps)
            time_rows.append(
                [world, mode, f"{1e3 * p_cpu:.1f}", f"{1e3 * m_cpu:.1f}", _ratio(p_cpu, m_cpu),
                 f"{1e3 * p_wall:.1f}", f"{1e3 * m_wall:.1f}", _ratio(p_wall, m_wall)]
            )  # fmt: skip
            for mr, pr in zip(ms, ps, strict=True):
                rank = ms.index(mr)
                rank_rows.append(
                    [world, mode, rank, f"{(mr['inputs'] + mr['tensor_call']) / MiB:.2f}",
                     f"{pr['tensor_peak'] / MiB:.2f}", f"{1e3 * mr['cpu_s']:.1f}",
                     f"{1e3 * pr['compute_s']:.1f}", _ratio(pr["compute_s"], mr["cpu_s"])]
                )  # fmt: skip
    mem = _table(
        ["p", "mode", "tensor peak MiB (pred.)", "tensor peak MiB (meas.)", "pred/meas",
         "resident peak MiB (pred.)", "resident peak MiB (meas.)", "pred/meas",
         "buffers MiB (pred.)", "buffers MiB (meas.)"],
        mem_rows,
    )  # fmt: skip
    tim = _table(
        ["p", "mode", "compute ms (pred.)", "CPU ms (meas.)", "pred/meas", "layer ms (pred.)",
         "wall ms (meas.)", "pred/meas"],
        time_rows,
    )  # fmt: skip
    ranks = _table(
        ["p", "mode", "rank", "tensor peak MiB (meas.)", "(pred.)", "CPU ms (meas.)",
         "compute ms (pred.)", "pred/meas"],
        rank_rows,
    )  # fmt: skip
    return f"{mem}\n\n{tim}\n\n{ranks}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Arguments (see the module docstring)."""
    ap = argparse.ArgumentParser(
        prog="python -m ring_attention.planner.validate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--segments", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--dilations", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--iters", type=int, default=3, help="timed calls per mode (median)")
    ap.add_argument("--bench-json", help="use these records instead of calibrating")
    ap.add_argument("--records-out", default=None, help="write the calibration records here")
    ap.add_argument("--link-gbps", type=float, default=10.0)
    ap.add_argument("--link-latency-us", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write measurements and predictions here")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Calibrate, run, predict, print."""
    args = parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned workers
    spec = {
        "n": args.seq_len, "heads": args.heads, "head_dim": args.head_dim, "batch": args.batch,
        "segments": args.segments, "dilations": args.dilations, "causal": args.causal,
        "iters": args.iters, "seed": args.seed,
    }  # fmt: skip
    print(f"# load average before: {os.getloadavg()}", flush=True)
    if args.bench_json:
        records = load_records(args.bench_json)
    else:
        lengths = sorted({-(-args.seq_len // p) for p in args.worlds})
        records = run_distributed(_calibrate_worker, 1, dict(spec, lengths=lengths), timeout=3600)[
            0
        ]
        if args.records_out:
            Path(args.records_out).write_text(json.dumps(records, indent=1))
    results: dict = {"spec": spec, "records": records, "runs": {}, "load": []}
    for world in args.worlds:
        t0 = time.perf_counter()
        measured = run_distributed(_ring_worker, world, spec, timeout=3600, pg_timeout=1800)
        predicted = _predict(args, records, world)
        results["runs"][str(world)] = (measured, predicted)
        results["load"].append(os.getloadavg())
        print(f"# p={world}: {time.perf_counter() - t0:.0f} s, load {os.getloadavg()}", flush=True)
    results["rate_source"] = predicted[0]["rate_source"]
    print(f"# rates: {results['rate_source']}")
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
