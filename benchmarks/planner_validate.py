"""Predictions of the planner against measured ring runs on this machine.

    python benchmarks/planner_validate.py                     # ~2 min on 2 cores
    python benchmarks/planner_validate.py --seq-len 8192 --worlds 1 2

Times the local operator (unless ``--bench-json``), runs the ring in ``p``
fresh gloo processes per ``p`` in ``--worlds`` (tensor and resident peaks,
CPU and wall time per rank), predicts the same and prints markdown tables
(worst rank per ``p``, every rank); ``--json`` keeps it all (docs/planner.md).
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

from ring_attention.core.pairs import pattern_flops, reached_pairs
from ring_attention.core.pattern import Pattern
from ring_attention.parallel.testing import run_distributed, tensor_peak
from ring_attention.planner.capacity import Setup, evaluate
from ring_attention.planner.memory import KERNEL_WORKSPACE
from ring_attention.planner.throughput import load_records
from ring_attention.planner.timing import Link

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


def _attention(fn, q, k, v, go, spec: dict, backward: bool):
    """A call of ``fn``: a forward under ``no_grad``, or forward + backward."""
    qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))

    def call() -> None:
        for t in (qq, kk, vv):
            t.grad = None
        with torch.set_grad_enabled(backward):
            out = fn(qq, kk, vv, spec["segments"], spec["dilations"], causal=spec["causal"])
        if backward:
            out.backward(go)

    call.leaves = (qq, kk, vv)  # type: ignore[attr-defined]
    return call


def _median_time(call, iters: int, before=lambda: None) -> tuple[float, float]:
    """Median thread CPU and wall seconds of ``iters`` calls (``before()`` untimed)."""
    cpu, wall = [], []
    for _ in range(iters):
        before()
        t0, c0 = time.perf_counter(), time.thread_time()
        call()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(cpu), statistics.median(wall)


def _ring_worker(rank: int, world: int, spec: dict) -> dict:
    import gc

    import torch.distributed as dist

    import ring_attention as ra
    from ring_attention.parallel.exchange import last_exchange_stats

    g = torch.Generator().manual_seed(spec["seed"])
    shape = (spec["batch"], spec["n"], spec["heads"], spec["head_dim"])
    full = [torch.randn(shape, generator=g) for _ in range(4)]  # q, k, v, grad_out
    q, k, v, go = (ra.shard_sequence(t, dim=1).contiguous() for t in full)  # the default group's
    out: dict = {"rank": rank, "local_len": q.shape[1]}
    for mode in ("fwd", "fwdbwd"):
        backward = mode == "fwdbwd"
        call = _attention(ra.ring_dilated_attention, q, k, v, go, spec, backward)

        def settle(call=call) -> None:
            for t in call.leaves:
                t.grad = None
            gc.collect()
            dist.barrier()

        call()  # warm-up: builds and caches the plan
        settle()
        tensor = tensor_peak(call)
        settle()
        resident = resident_growth(call)
        buffers = dict(last_exchange_stats.buffer_bytes)
        cpu, wall = _median_time(call, spec["iters"], settle)
        inputs = sum(t.numel() * t.element_size() for t in (q, k, v, go)[: 3 + backward])
        out[mode] = {"inputs": inputs, "tensor_call": tensor, "resident_call": resident,
                     "buffers": buffers, "cpu_s": cpu, "wall_s": wall}  # fmt: skip
    return out


def _calibrate_worker(rank: int, world: int, spec: dict) -> list[dict]:
    """Benchmark records of the local operator at every length in ``spec["lengths"]``."""
    import ring_attention as ra

    records = []
    pattern = Pattern(spec["segments"], spec["dilations"], causal=spec["causal"])
    for n in spec["lengths"]:
        g = torch.Generator().manual_seed(1)
        shape = (spec["batch"], n, spec["heads"], spec["head_dim"])
        q, k, v, go = (torch.randn(shape, generator=g) for _ in range(4))
        pairs = reached_pairs(pattern, n, spec["heads"])
        for pass_ in ("forward", "forward+backward"):
            backward = pass_ == "forward+backward"
            call = _attention(ra.dilated_attention, q, k, v, go, spec, backward)
            call()
            seconds = _median_time(call, spec["iters"])[0]
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


def _mib(x: float) -> str:
    return f"{x / MiB:.2f}"


def _ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


#: The tables of worst ranks: per quantity, columns, row values and format.
_WORST = {
    "memory": [
        ("tensor peak MiB (pred.)", "tensor peak MiB (meas.)", lambda r: r["tensor_peak"],
         lambda r: r["inputs"] + r["tensor_call"], _mib, True),
        ("resident peak MiB (pred.)", "resident peak MiB (meas.)", lambda r: r["resident_peak"],
         lambda r: r["inputs"] + r["resident_call"], _mib, True),
        ("buffers MiB (pred.)", "buffers MiB (meas.)", lambda r: r["buffers"],
         lambda r: max(r["buffers"].values(), default=0), _mib, False),
    ],
    "time": [
        ("compute ms (pred.)", "CPU ms (meas.)", lambda r: r["compute_s"], lambda r: r["cpu_s"],
         _ms, True),
        ("layer ms (pred.)", "wall ms (meas.)", lambda r: r["layer_s"], lambda r: r["wall_s"],
         _ms, True),
    ],
}  # fmt: skip


def report(results: dict) -> str:
    """Markdown tables of predicted vs measured (worst rank per p, then every rank)."""
    rows: dict[str, list] = {"memory": [], "time": [], "ranks": []}
    for world, (measured, predicted) in sorted(results["runs"].items(), key=lambda x: int(x[0])):
        for mode in ("fwd", "fwdbwd"):
            ms, ps = [r[mode] for r in measured], [r[mode] for r in predicted]
            for table, columns in _WORST.items():
                row = [world, mode]
                for _, _, pred, meas, fmt, ratio in columns:
                    p, m = max(map(pred, ps)), max(map(meas, ms))
                    row += [fmt(p), fmt(m)] + [_ratio(p, m)] * ratio
                rows[table].append(row)
            for rank, (mr, pr) in enumerate(zip(ms, ps, strict=True)):
                rows["ranks"].append(
                    [world, mode, rank, _mib(mr["inputs"] + mr["tensor_call"]),
                     _mib(pr["tensor_peak"]), _ms(mr["cpu_s"]), _ms(pr["compute_s"]),
                     _ratio(pr["compute_s"], mr["cpu_s"])]
                )  # fmt: skip
    headers = {
        table: [name for p, m, *_, ratio in columns for name in (p, m, "pred/meas")[: 2 + ratio]]
        for table, columns in _WORST.items()
    }
    headers["ranks"] = ["rank", "tensor peak MiB (meas.)", "(pred.)", "CPU ms (meas.)",
                        "compute ms (pred.)", "pred/meas"]  # fmt: skip
    return "\n\n".join(_table(["p", "mode", *headers[t]], rows[t]) for t in rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Arguments (see the module docstring)."""
    ap = argparse.ArgumentParser(
        prog="python benchmarks/planner_validate.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, default in (("seq-len", 16384), ("heads", 8), ("head-dim", 64), ("batch", 1),
                          ("segments", [512, 2048, 8192]), ("dilations", [1, 4, 16]),
                          ("worlds", [1, 2, 4]), ("seed", 0)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default,
                        nargs="+" if isinstance(default, list) else None)  # fmt: skip
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--iters", type=int, default=3, help="timed calls per mode (median)")
    ap.add_argument("--bench-json", help="use these records instead of calibrating")
    ap.add_argument("--records-out", default=None, help="write the calibration records here")
    ap.add_argument("--link-gbps", type=float, default=10.0)
    ap.add_argument("--link-latency-us", type=float, default=100.0)
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
        spec_n = dict(spec, lengths=lengths)
        records = run_distributed(_calibrate_worker, 1, spec_n, timeout=3600)[0]
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
