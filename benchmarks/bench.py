"""Benchmarks of ring_attention: one entry point, one subcommand per question.

    python benchmarks/bench.py local      # the local op vs baselines: time, memory, GFLOP/s vs n
    python benchmarks/bench.py ring       # the ring under torchrun: p = 1, 2, 4, 8, strong + weak
    python benchmarks/bench.py ring-run   # one ring run (the main job; run it under torchrun)
    python benchmarks/bench.py bytes      # bytes a rank sends per layer, from the exchange plans
    python benchmarks/bench.py check      # every method against a reference, then exit
    python benchmarks/bench.py report     # tables and plots again from the result files

``python benchmarks/bench.py SUBCOMMAND --help`` describes every option. The
sweeps (local, ring) append one JSON line per finished point to
``OUT_DIR/{local,ring}.jsonl`` (format: benchmarks/README.md) and skip the
points already there, so a killed run resumes where it stopped; at the end
they write a markdown table (``.md``) and plots (``.png``) beside it.
Defaults depend on the device: small sizes and float32 on the CPU, the GPU
sizes and bfloat16 on CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import measure
import methods
import torch
from measure import GiB, MiB

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(measure.ROOT, "build", "bench")
ROW_BLOCK = 1024  # rows of the seeded global tensors generated per block
RING_SEGMENTS, RING_DILATIONS = (512, 2048, 8192), (1, 4, 16)


# --------------------------------------------------------------------------- #
# small helpers
# --------------------------------------------------------------------------- #
def parse_config(text: str) -> tuple[int, int]:
    """``"12x64"`` -> (heads, head_dim)."""
    try:
        h, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        msg = f"expected HEADSxHEAD_DIM like 12x64, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if h < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"heads and head_dim must be positive, got {text!r}")
    return h, d


def resolve_device(name: str, present: bool = True) -> torch.device:
    """``auto``: CUDA when available; ``present=False`` allows a device that is
    not there (plans only)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if present and name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def rate_unit(device_type: str) -> tuple[str, float]:
    return ("TFLOP/s", 1e12) if device_type == "cuda" else ("GFLOP/s", 1e9)


def progress(items: Sequence[Any], desc: str):
    """A tqdm bar over ``items`` (plain iteration when tqdm is not installed)."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"{desc}: {len(items)} to run (pip install tqdm for a progress bar)")
        return items
    return tqdm(items, desc=desc, dynamic_ncols=True, file=sys.stderr)


def say(text: str) -> None:
    """Print without breaking a tqdm bar."""
    try:
        from tqdm import tqdm

        tqdm.write(text)
    except ImportError:
        print(text, flush=True)


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> list[str]:
    align = align or "r" * len(header)
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    lines = ["| " + " | ".join(header) + " |", sep]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return lines


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}f}"


def pyplot():
    """matplotlib's pyplot (Agg), or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')")
        return None
    return plt


def write_text(path: str, lines: Sequence[str]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- #
# bench.py local
# --------------------------------------------------------------------------- #
def local_defaults(args: argparse.Namespace, device: torch.device) -> None:
    """Fill the device-dependent defaults (None) of ``bench.py local``."""
    cuda = device.type == "cuda"
    defaults = {
        "seq_lens": [32768, 131072, 524288, 1048576] if cuda else [2048, 4096, 8192],
        "configs": [(12, 64), (16, 128)] if cuda else [(8, 64)],
        "iters": 5 if cuda else 3,
        "dense_max_n": 131072 if cuda else 8192,
        "search_step": 524288 if cuda else 0,
        "max_case_s": 8.0 if cuda else 20.0,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def local_groups(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """The sweep's points, grouped: the methods of one (config, n, pass) are
    timed round-robin on the same inputs, so that a load change on a shared
    machine hits them alike. Most informative first: every method up to
    --small-max-n, then ours above it, then the baselines above it."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for h, d in args.configs:
        for n in args.seq_lens:
            for m in args.methods:
                if m == "dense" and n > args.dense_max_n:
                    continue
                for p in args.passes:
                    late = n > args.small_max_n and m != "ours"
                    groups.setdefault((late, n, h, d, p), []).append(
                        {"method": m, "pass": p, "n": n, "heads": h, "head_dim": d}
                    )
    return [groups[k] for k in sorted(groups)]


def local_points(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [pt for group in local_groups(args) for pt in group]


def local_key(args: argparse.Namespace, device: torch.device, pt: dict[str, Any]) -> str:
    return measure.point_key(
        kind="local",
        method=pt["method"],
        pass_=pt["pass"],
        n=pt["n"],
        heads=pt["heads"],
        head_dim=pt["head_dim"],
        batch=args.batch,
        dtype=dtype_name(args.dtype_t),
        causal=args.causal,
        segments=list(args.segments),
        dilations=list(args.dilations),
        device=device.type,
        threads=torch.get_num_threads() if device.type == "cpu" else None,
        flex_compiled=not args.flex_eager if pt["method"] == "flex" else None,
    )


class LocalSweep:
    """Runs the points of ``bench.py local`` and records them."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args, self.device = args, device
        self.meth = methods.Methods(
            args.segments, args.dilations, args.causal, device, flex_compiled=not args.flex_eager
        )
        self.store = measure.ResultFile(os.path.join(args.out_dir, "local.jsonl"), args.redo)
        self.t0 = time.perf_counter()
        self.sec_per_flop: dict[tuple, float] = {}
        self.winner: dict[tuple, str] = {}  # fastest CUDA SDPA backend so far
        self.fatal: str | None = None
        self.run: dict[str, Any] = {}

    def left_s(self) -> float:
        if not self.args.budget_s:
            return math.inf
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def start_run(self) -> None:
        env = measure.environment(self.device)
        hw = measure.hardware_rate(self.device, self.args.configs[0][1])
        unit, scale = rate_unit(self.device.type)
        self.run = {
            "kind": "run",
            "run_id": uuid.uuid4().hex[:12],
            "sweep": "local",
            **env,
            "hardware_flop_rate": hw["flop_rate"],
            "hardware_what": hw["what"],
            "ring_attention": self.meth.ra_error or "ok",
        }
        self.store.append(self.run)
        say(f"# {measure.describe(env)}")
        say(f"# hardware rate: {hw['flop_rate'] / scale:.1f} {unit} ({hw['what']})")
        if self.meth.ra_error:
            say(f"# ring_attention not importable ({self.meth.ra_error})")
            say("# 'ours' fails; the baselines run")

    def inputs(self, pt: dict[str, Any], backward: bool):
        shape = (self.args.batch, pt["n"], pt["heads"], pt["head_dim"])
        gen = torch.Generator(device=self.device).manual_seed(0)
        ts = [
            torch.empty(shape, device=self.device, dtype=self.args.dtype_t).normal_(generator=gen)
            for _ in range(4 if backward else 3)
        ]
        for t in ts[:3]:
            t.requires_grad_(backward)
        return ts[:3], (ts[3] if backward else None)

    def point_flops(self, pt: dict[str, Any], backward: bool) -> tuple[int, float]:
        a = self.args
        pairs = methods.pattern_pairs(
            pt["n"], pt["heads"], a.segments, a.dilations, a.causal, batch=a.batch
        )
        return pairs, methods.flops(pairs, pt["head_dim"], backward)

    def own_pairs(self, pt: dict[str, Any], pairs: int) -> int:
        """Pairs the method computes: dense all n², flex every visited block."""
        a = self.args
        if pt["method"] == "dense":
            return methods.dense_pairs(pt["n"], pt["heads"], a.causal, a.batch)
        if pt["method"] == "flex":
            return methods.flex_visited_pairs(
                pt["n"], pt["heads"], a.segments, a.dilations, a.causal, a.batch
            )
        return pairs

    def base_record(self, pt: dict[str, Any]) -> dict[str, Any]:
        a = self.args
        pairs, fl = self.point_flops(pt, pt["pass"] == "fwdbwd")
        return {
            "key": local_key(a, self.device, pt), "kind": "local", "run_id": self.run["run_id"],
            **pt, "batch": a.batch, "dtype": dtype_name(a.dtype_t), "causal": a.causal,
            "segments": list(a.segments), "dilations": list(a.dilations),
            "device": self.device.type, "pairs": pairs, "flops": fl,
            "same_function": pt["method"] in methods.SAME_FUNCTION
            or self.meth.dense_is_pattern(pt["n"]),
        }  # fmt: skip

    def measure_group(self, pts: list[dict[str, Any]], iters: int, warmup: int) -> list[dict]:
        """Time every method (and CUDA SDPA backend) of one (config, n, pass)
        round-robin on the same inputs, then the peak memory of one call each;
        one record per point."""
        a, dev = self.args, self.device
        backward = pts[0]["pass"] == "fwdbwd"
        recs = [self.base_record(pt) for pt in pts]
        variants: list[tuple[int, str | None]] = []
        for i, pt in enumerate(pts):
            reason = self.meth.unsupported(pt["method"], backward)
            if reason:
                recs[i].update(status="unsupported", reason=reason)
                continue
            wkey = (pt["method"], pt["pass"], pt["heads"], pt["head_dim"])
            backends = self.meth.backends(pt["method"], a.sdpa_backends)
            if pt["n"] > a.prune_after_n and wkey in self.winner:
                backends = [self.winner[wkey]]
            variants += [(i, b) for b in backends]
        if not variants:
            return recs
        # The hardware rate before and after (the load of a shared machine moves
        # during a sweep); the higher sample is the points' reference.
        hw = [measure.hardware_rate(dev, pts[0]["head_dim"])["flop_rate"]]
        notes: dict[tuple, str] = {}
        times: dict[tuple, list[float]] = {v: [] for v in variants}
        extra: dict[tuple, dict[str, Any]] = {v: {} for v in variants}
        in_bytes = 0
        try:
            (q, k, v_), g = self.inputs(pts[0], backward)
        except Exception as exc:  # the inputs did not fit
            for var in variants:
                notes[var] = "OOM" if measure.is_oom(exc) else measure.short_error(exc)
        else:
            in_bytes = measure.tensor_bytes(q, k, v_, g)
            calls = {var: self.make_call(pts[var[0]]["method"], var[1], (q, k, v_), g)
                     for var in variants}  # fmt: skip

            def attempt(var, what: Callable[[], Any]) -> Any:
                try:
                    return what()
                except Exception as exc:  # recorded; the sweep goes on
                    notes[var] = "OOM" if measure.is_oom(exc) else measure.short_error(exc)
                    if measure.is_fatal(exc):
                        self.fatal = notes[var]
                    measure.free_memory(dev)
                    return None

            def alive() -> list[tuple]:
                return [var for var in variants if var not in notes and not self.fatal]

            for var in alive():  # warm-up: compilation, allocator
                t0 = time.perf_counter()
                attempt(var, lambda c=calls[var]: [c() for _ in range(warmup)])
                measure.sync(dev)
                extra[var]["warmup_s"] = time.perf_counter() - t0
            start = time.perf_counter()
            for _ in range(max(iters, 1)):
                for var in alive():
                    ms = attempt(var, lambda c=calls[var]: measure.time_once(c, dev))
                    if ms is not None:
                        times[var].append(ms)
                if time.perf_counter() - start > a.max_case_s * max(len(alive()), 1):
                    break
            for var in alive():
                if not a.no_memory:
                    extra[var]["growth"] = attempt(
                        var, lambda c=calls[var]: measure.peak_growth_bytes(c, dev)
                    )
            del q, k, v_, g, calls
        measure.free_memory(dev)
        hw.append(measure.hardware_rate(dev, pts[0]["head_dim"])["flop_rate"])
        for i, rec in enumerate(recs):
            if "status" not in rec:
                mine = [var for var in variants if var[0] == i]
                self.finish_record(rec, mine, times, extra, notes, in_bytes)
                rec.update(hardware_flop_rate=max(hw), hardware_samples=hw,
                           load_avg=os.getloadavg()[0])  # fmt: skip
        return recs

    def make_call(self, method: str, backend: str | None, qkv, g) -> Callable[[], None]:
        def call() -> None:
            if g is not None:
                out = self.meth.call(method, backend, *qkv)
                torch.autograd.grad(out, qkv, g)
            else:
                with torch.no_grad():
                    self.meth.call(method, backend, *qkv)

        return call

    def finish_record(self, rec, mine, times, extra, notes, in_bytes) -> None:
        """Status, the fastest backend's time, rates and peak memory of one point."""
        tried = {
            (b or "default"): notes.get((i, b), f"{measure.median(times[(i, b)]):.3f} ms")
            for i, b in mine
        }
        ok = [var for var in mine if var not in notes and times[var]]
        rec["tried"] = tried
        if not ok:
            oom = any(t == "OOM" for t in tried.values())
            rec.update(status="oom" if oom else "error",
                       reason="; ".join(f"{b}: {t}" for b, t in tried.items()))  # fmt: skip
            return
        best = min(ok, key=lambda var: measure.median(times[var]))
        ms = measure.median(times[best])
        wkey = (rec["method"], rec["pass"], rec["heads"], rec["head_dim"])
        if best[1] is not None:
            self.winner[wkey] = best[1]
        self.sec_per_flop[wkey] = ms * 1e-3 / rec["flops"]
        own = self.own_pairs(rec, rec["pairs"])
        own_flops = methods.flops(own, rec["head_dim"], rec["pass"] == "fwdbwd")
        growth = extra[best].get("growth")
        rec.update(
            status="ok", backend=best[1], ms=ms, times_ms=times[best], runs=len(times[best]),
            warmup_s=extra[best].get("warmup_s"), input_bytes=in_bytes,
            peak_bytes=None if growth is None else in_bytes + growth,
            pattern_flop_rate=rec["flops"] / (ms * 1e-3) if rec["same_function"] else None,
            own_pairs=own,
            own_flop_rate=own_flops / (ms * 1e-3),
        )  # fmt: skip

    def predicted_s(self, pt: dict[str, Any], runs: int) -> float | None:
        spf = self.sec_per_flop.get((pt["method"], pt["pass"], pt["heads"], pt["head_dim"]))
        if spf is None:
            return None
        return spf * self.point_flops(pt, pt["pass"] == "fwdbwd")[1] * runs

    def run_group(self, pts: list[dict[str, Any]], iters: int, warmup: int) -> list[dict] | None:
        """Measure and record one group; None when the budget skips it."""
        a = self.args
        runs = warmup + iters + (0 if a.no_memory else 1)
        pred = [self.predicted_s(pt, runs) for pt in pts]
        total = sum(x for x in pred if x is not None)
        if self.left_s() <= 0 or total > self.left_s():
            say(f"skipped (budget): {pts[0]['pass']} n={pts[0]['n']} "
                f"({', '.join(pt['method'] for pt in pts)})")  # fmt: skip
            return None
        recs = self.measure_group(pts, iters, warmup)
        for rec in recs:
            self.store.append(rec)
            say(local_line(rec))
        return recs

    def search(self) -> None:
        """Ours fwd+bwd at growing n (--search-step) until it does not fit: the
        largest n that runs. From the largest swept n (or down from it if it failed)."""
        a = self.args
        if not a.search_step or "ours" not in a.methods or self.fatal:
            return
        h, d = a.configs[-1]
        done = [
            r
            for r in self.store.records.values()
            if r.get("method") == "ours"
            and r.get("pass") == "fwdbwd"
            and (r.get("heads"), r.get("head_dim")) == (h, d)
            and r.get("dtype") == dtype_name(a.dtype_t)
        ]
        ok = [r["n"] for r in done if r["status"] == "ok"]
        step = a.search_step
        if ok:
            n, direction = max(ok) + step, 1
        else:
            n, direction = max(a.seq_lens) - step, -1
        while 0 < n <= a.search_max_n and not self.fatal and self.left_s() > 0:
            pt = {"method": "ours", "pass": "fwdbwd", "n": n, "heads": h, "head_dim": d}
            key = local_key(a, self.device, pt)
            rec = self.store.records.get(key) if self.store.done(key) else None
            if rec is None:
                recs = self.run_group([pt], iters=1, warmup=0)
                if recs is None:
                    return
                rec = recs[0]
            if (rec["status"] == "ok") != (direction == 1):
                return
            n += direction * step


def local_line(rec: dict[str, Any]) -> str:
    """One line per recorded point while the sweep runs."""
    head = (
        f"{rec['method']:6s} {rec['pass']:6s} n={rec['n']:<8d} h={rec['heads']} d={rec['head_dim']}"
    )
    if rec["status"] != "ok":
        return f"{head}: {rec['status']} ({rec.get('reason', '')})"
    unit, scale = rate_unit(rec["device"])
    rate = rec["pattern_flop_rate"] or rec["own_flop_rate"]
    peak = "—" if rec["peak_bytes"] is None else f"{rec['peak_bytes'] / MiB:.0f} MiB"
    be = f" [{rec['backend']}]" if rec.get("backend") else ""
    return f"{head}{be}: {rec['ms']:.2f} ms, {rate / scale:.2f} {unit}, peak {peak}"


def latest_run(store: measure.ResultFile) -> dict[str, Any] | None:
    return store.runs[-1] if store.runs else None


def local_rows(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    order = {m: i for i, m in enumerate(methods.METHODS)}
    rows = [r for r in records if r.get("kind") == "local"]
    return sorted(
        rows,
        key=lambda r: (
            r["dtype"],
            r["heads"],
            r["head_dim"],
            r["n"],
            r["pass"],
            order.get(r["method"], 9),
        ),
    )


def local_report(store: measure.ResultFile) -> list[str]:
    """The markdown table of every local point in the file (+ notes, targets)."""
    rows = local_rows(store.records.values())
    if not rows:
        return ["(no local results)"]
    unit, scale = rate_unit(rows[0]["device"])
    by = {(r["dtype"], r["heads"], r["head_dim"], r["n"], r["pass"], r["method"]): r for r in rows}
    table = []
    for r in rows:
        ours = by.get((r["dtype"], r["heads"], r["head_dim"], r["n"], r["pass"], "ours"))
        label = {"gather": "gather+SDPA", "dense": "dense SDPA†", "flex": "FlexAttention"}.get(
            r["method"], r["method"]
        )
        if r.get("backend"):
            label += f" [{r['backend']}]"
        if r["status"] != "ok":
            cells = [r["status"] + (": " + r["reason"][:60] if r.get("reason") else "")] + [""] * 5
        else:
            hw = r.get("hardware_flop_rate")
            rate = r["pattern_flop_rate"] if r["same_function"] else r["own_flop_rate"]
            ratio = "—"
            if ours and ours["status"] == "ok":
                ratio = f"{r['ms'] / ours['ms']:.2f}"
            peak = r["peak_bytes"]
            qkvo = 4 * r["input_bytes"] // (4 if r["pass"] == "fwdbwd" else 3)
            cells = [
                f"{r['ms']:.1f}",
                ratio,
                f"{rate / scale:.2f}",
                "—" if not hw else f"{100 * rate / hw:.0f}%",
                "—" if peak is None else f"{peak / MiB:.0f}",
                "—" if peak is None else f"{peak / qkvo:.2f}",
            ]
        table.append([r["n"], f"{r['heads']}x{r['head_dim']}", r["pass"], label, *cells])
    lines = md_table(
        [
            "n",
            "heads x dim",
            "pass",
            "method",
            "ms",
            "time / ours",
            unit,
            "of hw",
            "peak MiB",
            "peak / qkvo",
        ],
        table,
        "rrll" + "r" * 6,
    )
    run = latest_run(store)
    lines += [
        "",
        f"{unit}: pattern FLOPs (4·d per reached (query, key) pair forward, 3.5x for fwd+bwd, "
        "counted exactly) / median time; † dense SDPA computes all n² pairs (a different "
        "function unless the pattern is dense): its column counts its own FLOPs. 'of hw': "
        "that rate / the hardware rate measured beside the point (the higher of a sample "
        "before and after it)"
        + (f" ({run['hardware_what']})" if run else "")
        + ". time / ours > 1: ours is faster. peak: inputs + the peak growth of one call; "
        "qkvo: bytes of q, k, v, out.",
    ]
    if rows[0]["device"] == "cuda":
        lines += ["", *cuda_targets(rows, by)]
    return lines


def cuda_targets(rows, by) -> list[str]:
    """The GPU goals, PASS/FAIL: >= 1.2x the best same-function baseline, >= 2x
    FlexAttention, forward >= 50% of the matmul rate, fwd+bwd peak <= 1.3x the
    bytes of q, k, v, out and their gradients."""
    out = ["### targets"]
    for r in rows:
        if r["method"] != "ours" or r["status"] != "ok":
            continue
        k = (r["dtype"], r["heads"], r["head_dim"], r["n"], r["pass"])
        where = f"n={r['n']} h={r['heads']} d={r['head_dim']} {r['pass']}"
        base = [
            (by[(*k, m)]["ms"], m)
            for m in ("gather", "flex")
            if (*k, m) in by and by[(*k, m)]["status"] == "ok"
        ]
        if base:
            t, m = min(base)
            x = t / r["ms"]
            out.append(
                f"- {where}: {x:.2f}x the best same-function baseline ({m}), "
                f"target >= 1.2: {'PASS' if x >= 1.2 else 'FAIL'}"
            )
        fx = by.get((*k, "flex"))
        if fx and fx["status"] == "ok":
            x = fx["ms"] / r["ms"]
            out.append(
                f"- {where}: {x:.2f}x FlexAttention, target >= 2: {'PASS' if x >= 2 else 'FAIL'}"
            )
        if r["pass"] == "fwd" and r.get("hardware_flop_rate"):
            x = r["pattern_flop_rate"] / r["hardware_flop_rate"]
            out.append(
                f"- {where}: {x:.0%} of the matmul rate, target >= 50%: "
                f"{'PASS' if x >= 0.5 else 'FAIL'}"
            )
        if r["pass"] == "fwdbwd" and r["peak_bytes"]:
            x = r["peak_bytes"] / (2 * r["input_bytes"])  # inputs = q, k, v, dout
            out.append(
                f"- {where}: peak {x:.2f}x the bytes of q, k, v, out, dq, dk, dv, dout, "
                f"target <= 1.3: {'PASS' if x <= 1.3 else 'FAIL'}"
            )
    big = max(
        (
            r["n"]
            for r in rows
            if r["method"] == "ours" and r["pass"] == "fwdbwd" and r["status"] == "ok"
        ),
        default=None,
    )
    out.append(f"- largest n that ran ours fwd+bwd: {big or '—'}")
    return out


def load_range(rows: Iterable[dict[str, Any]]) -> str:
    """The 1-minute load average over the points, ``min-max``."""
    loads = [r["load_avg"] for r in rows if r.get("load_avg") is not None]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?"


def local_plot(store: measure.ResultFile, path: str) -> bool:
    """Time, pattern rate and peak memory vs n (one line per method and pass)."""
    plt = pyplot()
    rows = [r for r in local_rows(store.records.values()) if r["status"] == "ok"]
    if plt is None or not rows:
        return False
    unit, scale = rate_unit(rows[0]["device"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    styles = {"ours": "C0", "gather": "C1", "flex": "C2", "dense": "C3"}
    configs = sorted({(r["heads"], r["head_dim"], r["dtype"]) for r in rows})
    for h, d, dt in configs:
        for m in methods.METHODS:
            for p, ls in (("fwd", "-"), ("fwdbwd", "--")):
                pts = sorted(
                    (r["n"], r)
                    for r in rows
                    if (r["heads"], r["head_dim"], r["dtype"], r["method"], r["pass"])
                    == (h, d, dt, m, p)
                )
                if not pts:
                    continue
                ns = [n for n, _ in pts]
                lab = f"{m} {p}" + (f" ({h}x{d})" if len(configs) > 1 else "")
                kw = dict(color=styles.get(m), linestyle=ls, marker="o", label=lab)
                axes[0].plot(ns, [r["ms"] for _, r in pts], **kw)
                if pts[0][1]["same_function"]:
                    axes[1].plot(ns, [r["pattern_flop_rate"] / scale for _, r in pts], **kw)
                if all(r["peak_bytes"] for _, r in pts):
                    axes[2].plot(ns, [r["peak_bytes"] / MiB for _, r in pts], **kw)
        hw: dict[int, list[float]] = {}
        for r in rows:
            if (r["heads"], r["head_dim"], r["dtype"]) == (h, d, dt):
                hw.setdefault(r["n"], []).append(r["hardware_flop_rate"])
        ns = sorted(hw)
        axes[1].plot(ns, [measure.median(hw[n]) / scale for n in ns], "k:", marker=".",
                     label="hardware rate (median beside the points)")  # fmt: skip
    run = latest_run(store)
    titles = ("time per call (median)", f"pattern {unit} (exact FLOPs / time)", "peak memory")
    ylabels = ("ms", unit, "MiB")
    for ax, title, yl in zip(axes, titles, ylabels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(yl)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    axes[1].set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7, handles=axes[1].get_lines()[-1:])
    r0 = rows[0]
    sub = (
        f"{r0['dtype']}, batch {r0['batch']}, segments {r0['segments']}, dilations "
        f"{r0['dilations']}, causal={r0['causal']}"
    )
    if run:
        sub += f" — {run['device_name']}, load {load_range(rows)}, commit {run['commit']}"
    fig.suptitle(f"ring_attention.dilated_attention vs baselines ({sub})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def local_dry_run(args: argparse.Namespace, device: torch.device) -> int:
    """The plan: points, their exact work and bytes; nothing runs."""
    a = args
    print(
        f"# bench.py local plan (dry run) for {device.type}: dtype {dtype_name(a.dtype_t)}, "
        f"batch {a.batch}, segments {list(a.segments)}, dilations {list(a.dilations)}, "
        f"causal={a.causal}, budget {a.budget_s or 'none'} s"
    )
    itemsize = torch.empty((), dtype=a.dtype_t).element_size()
    rows = []
    for i, pt in enumerate(local_points(a), 1):
        backward = pt["pass"] == "fwdbwd"
        pairs = methods.pattern_pairs(
            pt["n"], pt["heads"], a.segments, a.dilations, a.causal, batch=a.batch
        )
        qb = a.batch * pt["n"] * pt["heads"] * pt["head_dim"] * itemsize
        rows.append(
            [
                i,
                pt["n"],
                pt["heads"],
                pt["head_dim"],
                pt["method"],
                pt["pass"],
                pairs,
                f"{methods.flops(pairs, pt['head_dim'], backward) / 1e9:.1f}",
                f"{qb / MiB:.0f}",
            ]
        )
    print(
        "\n".join(
            md_table(
                ["#", "n", "h", "d", "method", "pass", "pattern pairs", "pattern GFLOP", "|q| MiB"],
                rows,
                "rrrrllrrr",
            )
        )
    )
    if a.search_step:
        print(
            f"then ours fwd+bwd ({a.configs[-1][0]}x{a.configs[-1][1]}) at n + "
            f"{a.search_step}, ... up to {a.search_max_n}, until it does not fit"
        )
    print(f"{len(rows)} points; results to {os.path.join(a.out_dir, 'local.jsonl')}")
    return 0


def cmd_local(args: argparse.Namespace) -> int:
    device = resolve_device(args.device, present=not args.dry_run)
    local_defaults(args, device)
    if len(args.segments) != len(args.dilations):
        raise SystemExit("--segments and --dilations need the same length")
    args.dtype_t = resolve_dtype(args.dtype, device)
    if args.dry_run:
        return local_dry_run(args, device)
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    sweep = LocalSweep(args, device)
    groups = local_groups(args)
    todo = [[p for p in g if not sweep.store.done(local_key(args, device, p))] for g in groups]
    todo = [g for g in todo if g]
    n_all, n_todo = sum(map(len, groups)), sum(map(len, todo))
    print(f"{n_all} points: {n_all - n_todo} already in {sweep.store.path}, {n_todo} to run")
    if todo or args.search_step:
        sweep.start_run()
    for group in progress(todo, "local"):
        if sweep.fatal:
            say(f"stopped: CUDA context broken ({sweep.fatal})")
            break
        sweep.run_group(group, args.iters, args.warmup)
    sweep.search()
    rc = finish_local(sweep.store, args.out_dir)
    return 1 if sweep.fatal else rc


def local_summary(store: measure.ResultFile) -> list[str]:
    """One row per (config, n, pass): every method's time, ours' rate against
    the hardware's, ours' peak memory."""
    rows = [r for r in local_rows(store.records.values()) if r["status"] == "ok"]
    if not rows:
        return []
    unit, scale = rate_unit(rows[0]["device"])
    cases = sorted({(r["dtype"], r["heads"], r["head_dim"], r["n"], r["pass"]) for r in rows},
                   key=lambda c: (c[0], c[1], c[2], c[4], c[3]))  # fmt: skip
    by = {(r["dtype"], r["heads"], r["head_dim"], r["n"], r["pass"], r["method"]): r for r in rows}
    table = []
    for case in cases:
        ours = by.get((*case, "ours"))
        ms = [by.get((*case, m)) for m in methods.METHODS]
        table.append([
            case[3], f"{case[1]}x{case[2]}", case[4],
            *("—" if r is None else f"{r['ms']:.0f}" for r in ms),
            "—" if ours is None else f"{ours['pattern_flop_rate'] / scale:.1f}",
            "—" if ours is None else f"{ours['hardware_flop_rate'] / scale:.1f}",
            "—" if ours is None or ours["peak_bytes"] is None
            else f"{ours['peak_bytes'] / MiB:.0f}",
        ])  # fmt: skip
    return md_table(
        ["n", "heads x dim", "pass", "ours ms", "gather+SDPA ms", "FlexAttention ms",
         "dense SDPA† ms", f"ours {unit}", f"hardware {unit}", "ours peak MiB"],
        table, "rrl" + "r" * 7,
    )  # fmt: skip


def finish_local(store: measure.ResultFile, out_dir: str) -> int:
    lines = local_report(store)
    run = latest_run(store)
    head = [f"# bench.py local — {measure.describe(run)}", ""] if run else []
    summary = local_summary(store)
    if summary:
        load = load_range(store.records.values())
        head += [f"Load average (1 min) while the points ran: {load}.", "", "## Summary", "",
                 *summary, "", "## Every point", ""]  # fmt: skip
    write_text(os.path.join(out_dir, "local.md"), head + lines)
    png = os.path.join(out_dir, "local.png")
    plotted = local_plot(store, png)
    print("\n".join(lines))
    print(f"\nwrote {os.path.join(out_dir, 'local.md')}" + (f", {png}" if plotted else ""))
    return 0


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
    if world > 1:
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

    def fwd() -> None:
        with torch.no_grad():
            methods.ring_call(q, k, v, a.segments, a.dilations, **kw)

    row: dict[str, Any] = {"rank": rank, "shard": q.shape[1], "pieces": pieces}
    wall, cpu = timed(fwd)
    barrier()
    growth = measure.peak_growth_bytes(fwd, device)
    held = measure.tensor_bytes(q, k, v)
    row.update(
        fwd_ms=measure.median(wall),
        fwd_cpu_ms=measure.median(cpu),
        fwd_times_ms=wall,
        fwd_peak_bytes=None if growth is None else held + growth,
    )
    c = methods.exchange_counters()
    row.update(sent_fwd=c["sent_fwd"], buffers_fwd=c["buffers"])
    out, grads = None, []
    if a.backward:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def fwdbwd() -> None:
            o = methods.ring_call(*leaves, a.segments, a.dilations, **kw)
            torch.autograd.grad(o, leaves, go)

        wall, cpu = timed(fwdbwd)
        barrier()
        growth = measure.peak_growth_bytes(fwdbwd, device)
        held = measure.tensor_bytes(q, k, v, go)
        row.update(
            fwdbwd_ms=measure.median(wall),
            fwdbwd_cpu_ms=measure.median(cpu),
            fwdbwd_times_ms=wall,
            fwdbwd_peak_bytes=None if growth is None else held + growth,
        )
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


def cmd_ring_run(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    if len(a.segments) != len(a.dilations):
        raise SystemExit("--segments and --dilations need the same length")
    if a.print_nproc:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(gpus if gpus >= 2 else int(os.environ.get("NPROC", "4")))
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
        backend = dist.get_backend() if world > 1 else "none"
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
    if world > 1:
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


# --------------------------------------------------------------------------- #
# bench.py ring: strong and weak scaling, launching torchrun per point
# --------------------------------------------------------------------------- #
def ring_key(a: argparse.Namespace, scaling: str, p: int, n: int, device: str) -> str:
    return measure.point_key(
        kind="ring",
        scaling=scaling,
        p=p,
        n=n,
        batch=a.batch,
        heads=a.heads,
        head_dim=a.head_dim,
        segments=list(a.segments),
        dilations=list(a.dilations),
        causal=a.causal,
        layout=a.layout,
        dtype=a.dtype,
        threads=a.threads,
        device=device,
        backward=True,
    )


def ring_launch(a, p: int, n: int, device: str, log_path: str) -> tuple[dict | None, str]:
    """One torchrun launch of ``bench.py ring-run``; its JSON (or None) and why not."""
    with tempfile.TemporaryDirectory(prefix="ring_run_") as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={p}",
            os.path.join(HERE, "bench.py"),
            "ring-run",
            "--seq-len",
            str(n),
            "--batch",
            str(a.batch),
            "--heads",
            str(a.heads),
            "--head-dim",
            str(a.head_dim),
            "--segments",
            *map(str, a.segments),
            "--dilations",
            *map(str, a.dilations),
            "--layout",
            a.layout,
            "--dtype",
            a.dtype,
            "--iters",
            str(a.iters),
            "--warmup",
            str(a.warmup),
            "--threads",
            str(a.threads),
            "--device",
            device,
            "--backward",
            "--check",
            "yes" if a.check else "no",
            "--json",
            out,
            "--verbose",
        ]
        if a.causal:
            cmd.append("--causal")
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        with open(log_path, "w") as log:
            log.write(" ".join(cmd) + "\n")
            log.flush()
            try:
                proc = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=a.timeout_s
                )
            except subprocess.TimeoutExpired:
                return None, f"timed out after {a.timeout_s} s (log {log_path})"
        if proc.returncode != 0 or not os.path.exists(out):
            with open(log_path) as f:
                tail = " | ".join(f.read().strip().splitlines()[-3:])
            return None, f"rc={proc.returncode}: {tail[-300:]} (log {log_path})"
        with open(out) as f:
            return json.load(f), ""


def cmd_ring(a: argparse.Namespace) -> int:
    if len(a.segments) != len(a.dilations):
        raise SystemExit("--segments and --dilations need the same length")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if gpus else "cpu"
    store = measure.ResultFile(os.path.join(a.out_dir, "ring.jsonl"), a.redo)
    logs = os.path.join(a.out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    pts = [(s, p, a.seq_len if s == "strong" else a.shard * p) for s in a.scaling for p in a.worlds]
    todo = [x for x in pts if not store.done(ring_key(a, *x, device))]
    print(
        f"{len(pts)} ring runs: {len(pts) - len(todo)} already in {store.path}, "
        f"{len(todo)} to run (torchrun, {'NCCL' if device == 'cuda' else 'gloo'})"
    )
    t0 = time.perf_counter()
    if todo:
        env = {**measure.environment(torch.device(device)), "threads": a.threads}  # per process
        run = {"kind": "run", "run_id": uuid.uuid4().hex[:12], "sweep": "ring", **env}
        store.append(run)
        say(f"# {measure.describe(env)}")
    for scaling, p, n in progress(todo, "ring"):
        if a.budget_s and time.perf_counter() - t0 > a.budget_s:
            say(f"skipped (budget): {scaling} p={p}")
            continue
        base = {
            "kind": "ring",
            "key": ring_key(a, scaling, p, n, device),
            "run_id": run["run_id"],
            "scaling": scaling,
            "p": p,
            "n": n,
            "device": device,
        }
        if device == "cuda" and p > gpus:
            store.append({**base, "status": "unsupported", "reason": f"only {gpus} GPU(s)"})
            continue
        log = os.path.join(logs, f"ring_{scaling}_p{p}_n{n}.log")
        res, why = ring_launch(a, p, n, device, log)
        if res is None:
            store.append({**base, "status": "error", "reason": why})
            say(f"{scaling} p={p} n={n}: error {why}")
            continue
        rec = {**base, "status": "ok", **ring_summary(res)}
        store.append(rec)
        say(
            f"{scaling} p={p} n={n}: fwd+bwd max cpu {rec['fwdbwd_cpu_ms']:.0f} ms, "
            f"peak/rank {fmt(rec['peak_MiB'])} MiB, sent/rank {rec['sent_MiB']:.2f} MiB"
        )
    return finish_ring(store, a.out_dir)


def ring_summary(res: dict) -> dict[str, Any]:
    """What the tables and plots need from one launch (max over ranks), plus the ranks."""
    ranks = res["ranks"]

    def mx(key: str) -> float:
        vals = [r[key] for r in ranks if r.get(key) is not None]
        return max(vals) if vals else math.nan

    cfg = res["config"]
    return {
        "config": cfg,
        "ranks": ranks,
        "threads": res["threads"],
        "cores": res["cores"],
        "dtype": res["dtype"],
        "check": res["check"],
        "env": res["env"],
        "fwd_ms": mx("fwd_ms"),
        "fwd_cpu_ms": mx("fwd_cpu_ms"),
        "fwdbwd_ms": mx("fwdbwd_ms"),
        "fwdbwd_cpu_ms": mx("fwdbwd_cpu_ms"),
        "peak_MiB": mx("fwdbwd_peak_bytes") / MiB,
        "fwd_peak_MiB": mx("fwd_peak_bytes") / MiB,
        "sent_MiB": mx("sent_all") / MiB,
        "sent_fwd_MiB": mx("sent_fwd") / MiB,
        "plan_MiB": mx("plan_all") / MiB,
        "plan_fwd_MiB": mx("plan_fwd") / MiB,
        "buffers_MiB": max(max(r["buffers_fwd"], r.get("buffers_all", 0)) for r in ranks) / MiB,
        "pairs_total": sum(r["pairs"] for r in ranks),
        "work_max_over_mean": max(r["pairs"] for r in ranks)
        / max(1e-9, sum(r["pairs"] for r in ranks) / len(ranks)),
    }


RING_COLUMNS = ["p", "n", "shard", "fwd ms", "fwd+bwd ms", "fwd+bwd CPU ms", "speed-up",
                "peak MiB/rank", "buffers MiB", "sent MiB/rank", "plan MiB/rank"]  # fmt: skip


def speedup(r: dict[str, Any], one: dict[str, Any]) -> float:
    """Pattern work per second of the slowest rank's CPU time, relative to p = 1:
    CPU(1) / max CPU(p) for strong scaling, the same with the work grown for weak."""
    return (r["pairs_total"] / r["fwdbwd_cpu_ms"]) / (one["pairs_total"] / one["fwdbwd_cpu_ms"])


def ring_sorted(store: measure.ResultFile, scaling: str, ok_only: bool = False) -> list[dict]:
    rows = [r for r in store.records.values() if r.get("kind") == "ring"]
    rows = [r for r in rows if r["scaling"] == scaling and (r["status"] == "ok" or not ok_only)]
    return sorted(rows, key=lambda r: r["p"])


def ring_report(store: measure.ResultFile) -> list[str]:
    lines: list[str] = []
    for scaling in ("strong", "weak"):
        sel = ring_sorted(store, scaling)
        one = next((r for r in sel if r["p"] == 1 and r["status"] == "ok"), None)
        table = []
        for r in sel:
            if r["status"] != "ok":
                why = f"{r['status']}: {r.get('reason', '')[:50]}"
                table.append([r["p"], r["n"], why] + [""] * (len(RING_COLUMNS) - 3))
                continue
            table.append([
                r["p"], r["n"], r["ranks"][0]["shard"], f"{r['fwd_ms']:.0f}",
                f"{r['fwdbwd_ms']:.0f}", f"{r['fwdbwd_cpu_ms']:.0f}",
                "—" if one is None else f"{speedup(r, one):.2f}", fmt(r["peak_MiB"]),
                f"{r['buffers_MiB']:.1f}", f"{r['sent_MiB']:.2f}", f"{r['plan_MiB']:.2f}",
            ])  # fmt: skip
        if table:
            lines += [f"### {scaling} scaling", "", *md_table(RING_COLUMNS, table), ""]
    ok = [r for s in ("strong", "weak") for r in ring_sorted(store, s, ok_only=True)]
    if not ok:
        return lines or ["(no ring results)"]
    c, r0 = ok[0]["config"], ok[0]
    lines.append(
        f"batch {c['batch']}, {c['heads']} heads, head_dim {c['head_dim']}, {r0['dtype']}, "
        f"segments {c['segments']}, dilations {c['dilations']}, causal={c['causal']}, "
        f"layout {c['layout']}; {r0['threads']} thread(s) per process on {r0['cores']} cores. "
        "Max over ranks: ms = wall time per call (median); CPU ms = the process's CPU time "
        "(with more processes than cores the ranks take turns, so wall time does not fall with "
        "p: CPU time does); speed-up = pattern work / slowest rank's CPU time, relative to "
        "p = 1; peak = inputs + peak growth of one fwd+bwd call; sent = bytes handed to "
        "torch.distributed per layer (fwd+bwd); plan = the same from the exchange plan."
    )
    return lines


def ring_plot(store: measure.ResultFile, path: str) -> bool:
    plt = pyplot()
    series = {s: ring_sorted(store, s, ok_only=True) for s in ("strong", "weak")}
    if plt is None or not any(series.values()):
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for (scaling, sel), color in zip(series.items(), ("C0", "C1"), strict=True):
        if not sel:
            continue
        ps, ns = [r["p"] for r in sel], [r["n"] for r in sel]
        if sel[0]["p"] == 1:
            axes[0].plot(ps, [speedup(r, sel[0]) for r in sel], "o-", color=color, label=scaling)
        axes[1].plot(ps, [r["peak_MiB"] for r in sel], "o-", color=color, label=scaling)
        if scaling == "weak":  # n = shard * p
            axes[2].plot(ns, [r["sent_MiB"] for r in sel], "o-", color=color, label="measured")
            axes[2].plot(ns, [r["plan_MiB"] for r in sel], "x--", color="k", label="exchange plan")
            for r in sel:
                axes[2].annotate(f"p={r['p']}", (r["n"], r["sent_MiB"]), fontsize=7)
    ps = sorted({r["p"] for sel in series.values() for r in sel})
    axes[0].plot(ps, ps, ":", color="gray", label="ideal")
    axes[0].set(xlabel="processes p", ylabel="speed-up", title="fwd+bwd speed-up (CPU time)")
    axes[1].set(xlabel="processes p", ylabel="MiB", title="peak memory per rank (fwd+bwd)")
    axes[2].set(xlabel="n = shard x p", ylabel="MiB", title="bytes sent per rank per layer (weak)")
    axes[2].set_xscale("log", base=2)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    r0 = next(sel[0] for sel in series.values() if sel)
    c = r0["config"]
    fig.suptitle(
        f"ring_dilated_attention under torchrun: {c['heads']}x{c['head_dim']}, segments "
        f"{c['segments']}, dilations {c['dilations']}, {r0['dtype']}, "
        f"{r0['env']['device_name']}, load {r0['env']['load_avg'][0]:.1f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def finish_ring(store: measure.ResultFile, out_dir: str) -> int:
    lines = ring_report(store)
    run = latest_run(store)
    head = [f"# bench.py ring — {measure.describe(run)}", ""] if run else []
    write_text(os.path.join(out_dir, "ring.md"), head + lines)
    png = os.path.join(out_dir, "ring.png")
    plotted = ring_plot(store, png)
    print("\n".join(lines))
    print(f"\nwrote {os.path.join(out_dir, 'ring.md')}" + (f", {png}" if plotted else ""))
    bad = [r for r in store.records.values() if r.get("kind") == "ring" and r["status"] == "error"]
    return 1 if bad else 0


# --------------------------------------------------------------------------- #
# bench.py bytes: from the exchange plans only
# --------------------------------------------------------------------------- #
def longnet_to(n: int, w0: int = 512) -> tuple[list[int], list[int]]:
    """LongNet grown to ``n``: segments ``w0 * 4**i < n`` and ``n``, dilations
    ``w / w0`` (every branch reaches ``w0`` keys per query)."""
    segs = [w0 * 4**i for i in range(32) if w0 * 4**i < n] + [n]
    return segs, [max(1, w // w0) for w in segs]


def max_sent(n: int, p: int, a: argparse.Namespace, segs, dils, causal: bool) -> tuple[int, int]:
    """Max over ranks of the bytes sent per layer (fwd, fwd+bwd)."""
    best = (0, 0)
    for rank in range(p):
        b = methods.plan_bytes_sent(
            n,
            a.heads,
            segs,
            dils,
            causal=causal,
            head_groups=False,
            layout="contiguous",
            batch=1,
            head_dim=a.head_dim,
            itemsize=4,
            world=p,
            rank=rank,
        )
        best = (max(best[0], b[0]), max(best[1], b[1]))
    return best


def cmd_bytes(a: argparse.Namespace) -> int:
    segs, dils = list(a.segments), list(a.dilations)
    cases = [
        ("pattern", lambda n: (segs, dils), False),
        ("grown to n", longnet_to, False),
        ("dense causal", lambda n: ([n], [1]), True),
    ]
    hdr = [f"{name} {p}" for name, _, _ in cases for p in ("fwd", "fwd+bwd")]
    out = [
        f"# Bytes a rank sends per layer (MiB, max over ranks, exchange plans; float32, "
        f"batch 1, {a.heads} heads, head_dim {a.head_dim}; pattern = segments {segs}, "
        f"dilations {dils}; grown to n = segments 512·4^i and n, w/r = 512)",
        "",
        f"## vs n at p = {a.p}",
        "",
    ]
    rows = []
    for n in a.seq_lens:
        vals = [x / MiB for _, pat, causal in cases for x in max_sent(n, a.p, a, *pat(n), causal)]
        rows.append([n, n // a.p, *(f"{x:.2f}" for x in vals)])
    out += md_table(["n", "shard", *hdr], rows) + ["", f"## vs n at shard = {a.shard}", ""]
    rows = []
    for p in a.worlds:
        n = a.shard * p
        vals = [x / MiB for _, pat, causal in cases for x in max_sent(n, p, a, *pat(n), causal)]
        rows.append([n, p, *(f"{x:.2f}" for x in vals)])
    out += md_table(["n", "p", *hdr], rows)
    bound = 2 * a.heads * sum(w // r for w, r in zip(segs, dils, strict=True)) * a.head_dim * 4
    out += [
        "",
        f"The pattern's bound 2·heads·Σ(w/r)·d·4 B = {bound / MiB:.2f} MiB per layer "
        "forward, whatever n and p.",
    ]
    write_text(os.path.join(a.out_dir, "bytes.md"), out)
    print("\n".join(out))
    return 0


# --------------------------------------------------------------------------- #
# bench.py check
# --------------------------------------------------------------------------- #
CHECK_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def cmd_check(a: argparse.Namespace) -> int:
    """Every method (and CUDA SDPA backend) vs gather+SDPA in a wider dtype,
    and the analytic FlexAttention block masks vs ``create_block_mask``."""
    import warnings

    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, device)
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    n = a.n or (10240 if device.type == "cuda" else 1000)
    segs = a.segments or (
        list(methods.LONGNET_SEGMENTS) if device.type == "cuda" else [128, 384, 1024]
    )
    dils = a.dilations or (list(methods.LONGNET_DILATIONS) if device.type == "cuda" else [1, 3, 8])
    tol = CHECK_TOL[dtype]
    print(
        f"check on {device.type}: n={n}, {dtype_name(dtype)} vs gather+SDPA in "
        f"{dtype_name(ref_dtype)}, segments {segs}, dilations {dils}; rel. error, "
        f"tolerance {tol:g}"
    )
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    bad: list[str] = []
    rows = []
    gen = torch.Generator().manual_seed(1234)
    for h, d in a.configs:
        base = [torch.randn(1, n, h, d, generator=gen) for _ in range(4)]
        for causal in (False, True):
            meth = methods.Methods(segs, dils, causal, device, flex_compiled=not a.flex_eager)
            leaves = [t.to(device, ref_dtype).requires_grad_() for t in base[:3]]
            ro, rl = methods.gather_sdpa_dilated(*leaves, segs, dils, causal, return_lse=True)
            rgrads = torch.autograd.grad(ro, leaves, base[3].to(device, ref_dtype))
            for m in a.methods:
                if m == "dense" and not meth.dense_is_pattern(n):
                    continue
                for backend in meth.backends(m, methods.SDPA_BACKENDS):
                    name = m + (f"[{backend}]" if backend else "")
                    bwd = meth.unsupported(m, True) is None
                    try:
                        x = [t.to(device, dtype).requires_grad_(bwd) for t in base[:3]]
                        with torch.set_grad_enabled(bwd):
                            out, lse = meth.call(m, backend, *x, return_lse=True)
                        errs = [
                            measure.rel_err(out, ro),
                            measure.rel_err(lse, rl) if lse is not None else math.nan,
                        ]
                        if bwd:
                            g = torch.autograd.grad(out, x, base[3].to(device, dtype))
                            errs += [measure.rel_err(u, w) for u, w in zip(g, rgrads, strict=True)]
                        else:
                            errs += [math.nan] * 3
                        ok = all(e <= tol for e in errs if not math.isnan(e))
                        cells = [f"{e:.1e}" if not math.isnan(e) else "n/a" for e in errs]
                    except Exception as exc:  # reported as a failure
                        ok, cells = False, [measure.short_error(exc, 60)] + [""] * 4
                        if measure.is_fatal(exc):
                            raise
                    if not ok:
                        bad.append(f"{name} {h}x{d} causal={causal}")
                    rows.append([f"{h}x{d}", causal, name, *cells, "ok" if ok else "FAIL"])
                    print(
                        f"  {h}x{d} causal={causal} {name}: {' '.join(cells)} "
                        f"{'ok' if ok else 'FAIL'}",
                        flush=True,
                    )
    lines = md_table(
        ["heads x dim", "causal", "method", "out", "lse", "dq", "dk", "dv", "ok"],
        rows,
        "rll" + "r" * 5 + "l",
    )
    if "flex" in a.methods:
        lines += ["", *check_block_masks(device, bad)]
    print("\n".join(["", *lines]))
    print("n/a: not available (FlexAttention on the CPU has no backward, compiled no LSE)")
    print("check: " + ("PASS" if not bad else "FAILED: " + "; ".join(bad)))
    return 1 if bad else 0


def check_block_masks(device: torch.device, bad: list[str]) -> list[str]:
    """The analytic block masks against ``create_block_mask`` (ragged sizes too)."""
    out = []
    for n in (1000, 1280):
        for segs, dils in (
            ([128, 256, 512], [1, 2, 4]),
            ([384, 1024], [1, 6]),
            ([100, 2048], [1, 12]),
            ([1024], [1]),
        ):
            for causal in (False, True):
                ours = methods.flex_block_state(n, segs, dils, causal, device)
                ref = methods.reference_block_state(n, 12, segs, dils, causal, device)
                # never skip a reached block; never call a block full that is not
                if not (((ref > 0) <= (ours > 0)).all() and ((ours == 2) <= (ref == 2)).all()):
                    bad.append(f"block mask n={n} {segs} {dils} causal={causal}")
    out.append(
        "flex block masks vs create_block_mask: "
        + ("ok" if not any(b.startswith("block mask") for b in bad) else "MISMATCH")
    )
    return out


# --------------------------------------------------------------------------- #
# bench.py report
# --------------------------------------------------------------------------- #
def cmd_report(a: argparse.Namespace) -> int:
    rc = 1
    for name, finish in (("local", finish_local), ("ring", finish_ring)):
        path = os.path.join(a.out_dir, f"{name}.jsonl")
        if os.path.exists(path):
            rc = finish(measure.ResultFile(path), a.out_dir)
    if rc:
        print(f"no local.jsonl or ring.jsonl in {a.out_dir}")
    return 0 if rc == 0 else 1


# --------------------------------------------------------------------------- #
# the command line
# --------------------------------------------------------------------------- #
def add_pattern(p: argparse.ArgumentParser, segs, dils) -> None:
    p.add_argument(
        "--segments",
        type=int,
        nargs="+",
        default=segs,
        help=f"segment lengths w_i (default {segs})",
    )
    p.add_argument(
        "--dilations",
        type=int,
        nargs="+",
        default=dils,
        help=f"dilation rates r_i (default {dils})",
    )
    p.add_argument("--causal", action="store_true", help="keys only at or before the query")


def add_ring_run_options(p: argparse.ArgumentParser) -> None:
    """The options of one ring run (``ring-run``, the main job)."""
    p.add_argument("--seq-len", type=int, default=8192, help="global sequence length (8192)")
    add_pattern(p, list(RING_SEGMENTS), list(RING_DILATIONS))
    p.add_argument("--batch", type=int, default=1, help="batch size (1)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (64)")
    p.add_argument(
        "--head-groups", action="store_true", help="branch i applies only to head group i"
    )
    p.add_argument(
        "--layout",
        choices=["contiguous", "zigzag"],
        default="contiguous",
        help="how the sequence is sharded; zigzag balances causal work (contiguous)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on the CPU",
    )
    p.add_argument("--backward", action="store_true", help="also time forward + backward")
    p.add_argument("--iters", type=int, default=3, help="timed calls; the median is shown (3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (1)")
    p.add_argument(
        "--check",
        choices=["auto", "yes", "no"],
        default="auto",
        help="compare with one process on rank 0 (auto: when it needs less than "
        "half of the free memory)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the global q, k, v (0)")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: one GPU per process when there are enough, else the CPU",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="process group backend (auto: NCCL on GPUs, gloo on the CPU)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads per process (0: cores / processes on this node)",
    )
    p.add_argument(
        "--timeout-min", type=float, default=10.0, help="process group timeout in minutes (10)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    p = sub.add_parser(
        "local",
        help="the local op vs baselines: time, memory, rate vs n",
        description=LOCAL_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help=DEVICE_HELP)
    p.add_argument(
        "--seq-lens",
        type=int,
        nargs="+",
        help="n values (CPU: 2048 4096 8192; CUDA: 32768 131072 524288 1048576)",
    )
    p.add_argument(
        "--configs",
        type=parse_config,
        nargs="+",
        help="HEADSxHEAD_DIM (CPU: 8x64; CUDA: 12x64 16x128)",
    )
    p.add_argument("--batch", type=int, default=1, help="batch size (1)")
    add_pattern(p, list(methods.LONGNET_SEGMENTS), list(methods.LONGNET_DILATIONS))
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on the CPU",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        choices=methods.METHODS,
        default=list(methods.METHODS),
        help="what to measure (all)",
    )
    p.add_argument(
        "--passes",
        nargs="+",
        choices=["fwd", "fwdbwd"],
        default=["fwd", "fwdbwd"],
        help="forward (no_grad), forward + backward (both)",
    )
    p.add_argument(
        "--sdpa-backends",
        nargs="+",
        choices=methods.SDPA_BACKENDS,
        default=list(methods.SDPA_BACKENDS),
        help="CUDA: gather and dense try each, the fastest is kept",
    )
    p.add_argument(
        "--prune-after-n",
        type=int,
        default=32768,
        help="above this n only the SDPA backend that won at a smaller n is tried",
    )
    p.add_argument(
        "--dense-max-n", type=int, help="dense SDPA only up to this n (CPU 8192, CUDA 131072)"
    )
    p.add_argument(
        "--small-max-n",
        type=int,
        default=131072,
        help="order: every method up to this n first, then ours, then the baselines",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed calls of each method first (1)")
    p.add_argument(
        "--iters", type=int, help="timed rounds over the methods, median reported (CPU 3, CUDA 5)"
    )
    p.add_argument(
        "--max-case-s",
        type=float,
        help="stop the round-robin timing of a (config, n, pass) after this many seconds "
        "per method, at least one round (CPU 20, CUDA 8)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="skip what would end after this many seconds (0: no budget); "
        "skipped points are not recorded, a re-run does them",
    )
    p.add_argument("--no-memory", action="store_true", help="do not measure peak memory")
    p.add_argument(
        "--flex-eager",
        action="store_true",
        help="FlexAttention without torch.compile (a slow reference; debugging)",
    )
    p.add_argument(
        "--search-step",
        type=int,
        help="then ours fwd+bwd at growing n in these steps until it does not fit "
        "(CPU 0 = off, CUDA 524288)",
    )
    p.add_argument(
        "--search-max-n", type=int, default=4194304, help="the search stops here (4194304)"
    )
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's)")
    add_output(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    p.set_defaults(func=cmd_local)

    p = sub.add_parser(
        "ring",
        help="the ring under torchrun: strong and weak scaling",
        description=RING_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8], help="p values")
    p.add_argument(
        "--scaling",
        nargs="+",
        choices=["strong", "weak"],
        default=["strong", "weak"],
        help="strong: n fixed; weak: n / p fixed (both)",
    )
    p.add_argument("--seq-len", type=int, default=8192, help="strong scaling: n (8192)")
    p.add_argument("--shard", type=int, default=2048, help="weak scaling: n / p (2048)")
    add_pattern(p, list(RING_SEGMENTS), list(RING_DILATIONS))
    p.add_argument("--batch", type=int, default=1, help="batch size (1)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (64)")
    p.add_argument(
        "--layout",
        choices=["contiguous", "zigzag"],
        default="contiguous",
        help="sharding of the sequence (contiguous)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on the CPU",
    )
    p.add_argument("--iters", type=int, default=3, help="timed calls per run, median reported (3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (1)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process (1)")
    p.add_argument("--check", action="store_true", help="also check against one process")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per torchrun launch")
    p.add_argument("--budget-s", type=float, default=0.0, help="0: no budget")
    add_output(p)
    p.set_defaults(func=cmd_ring)

    p = sub.add_parser(
        "ring-run",
        help="one ring run (the main job; launch it with torchrun)",
        description=RING_RUN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_ring_run_options(p)
    p.add_argument("--json", help="write everything (config, per-rank rows, check) here")
    p.add_argument("--verbose", action="store_true", help="more per-rank columns")
    p.add_argument("--quiet", action="store_true", help="print nothing (with --json)")
    p.add_argument(
        "--print-nproc",
        action="store_true",
        help="check the arguments, print how many processes scripts/run_ring.sh launches "
        "(one per GPU with two or more GPUs, else $NPROC, default 4) and exit",
    )
    p.set_defaults(func=cmd_ring_run)

    p = sub.add_parser("bytes", help="bytes a rank sends per layer, from the exchange plans")
    p.add_argument(
        "--seq-lens",
        type=int,
        nargs="+",
        default=[4096, 8192, 16384, 32768, 65536],
        help="n of the first table (4096 ... 65536)",
    )
    p.add_argument("--p", type=int, default=4, help="ranks of the bytes-vs-n table (4)")
    p.add_argument("--shard", type=int, default=4096, help="n / p of the second table (4096)")
    p.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=[2, 4, 8, 16, 32],
        help="p of the second table (2 4 8 16 32)",
    )
    p.add_argument("--heads", type=int, default=8, help="attention heads (8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (64)")
    add_pattern(p, list(RING_SEGMENTS), list(RING_DILATIONS))
    add_output(p, resumable=False)
    p.set_defaults(func=cmd_bytes)

    p = sub.add_parser("check", help="every method against a reference, then exit")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help=DEVICE_HELP)
    p.add_argument("--n", type=int, help="sequence length (CPU 1000, CUDA 10240)")
    p.add_argument(
        "--configs", type=parse_config, nargs="+", default=[(6, 32)], help="HEADSxHEAD_DIM (6x32)"
    )
    p.add_argument("--segments", type=int, nargs="+", help="(CPU 128 384 1024; CUDA LongNet)")
    p.add_argument("--dilations", type=int, nargs="+", help="(CPU 1 3 8; CUDA LongNet)")
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on the CPU",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        choices=methods.METHODS,
        default=list(methods.METHODS),
        help="what to check (all)",
    )
    p.add_argument("--flex-eager", action="store_true", help="FlexAttention without compile")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("report", help="tables and plots again from the result files")
    add_output(p, resumable=False)
    p.set_defaults(func=cmd_report)
    return parser


def add_output(p: argparse.ArgumentParser, resumable: bool = True) -> None:
    p.add_argument(
        "--out-dir",
        default=DEFAULT_OUT,
        help=f"result files go here (default {os.path.relpath(DEFAULT_OUT)})",
    )
    if resumable:
        p.add_argument(
            "--redo",
            action="store_true",
            help="measure again the points already in the result file",
        )


DEVICE_HELP = "auto: CUDA when a GPU is visible, else the CPU"

LOCAL_HELP = """\
ring_attention.dilated_attention against baselines, on the same inputs:
  ours    ring_attention.dilated_attention
  gather  gather + PyTorch SDPA per branch and head-offset class, merged by LSE (exact)
  flex    FlexAttention, one call: mask_mod (reachable) + score_mod (+ log multiplicity): exact
  dense   SDPA over all n² pairs: a cost reference (the same function only for a dense pattern)
For each (n, heads x head_dim, method, pass): median time, effective rate = pattern FLOPs
(4·d per reached (query, key) pair forward, 3.5x for fwd+bwd, counted exactly) / time,
against the hardware rate measured in the same run (CPU: fp32 GEMMs at the kernel's tile
shapes; CUDA: a bf16 matmul), and peak memory (inputs + the growth of one call).
"""

RING_HELP = """\
ring_dilated_attention under torchrun for p = 1, 2, 4, 8 processes (gloo on the CPU, NCCL
on GPUs, one launch of `bench.py ring-run` per point): strong scaling (fixed n) and weak
scaling (fixed n / p). Per rank: wall and CPU time of fwd and fwd+bwd, peak memory, bytes
sent per layer (measured and from the exchange plan).
"""

RING_RUN_HELP = """\
Ring dilated attention across processes, checked against one process.

Launch under torchrun, one process per GPU (NCCL) or several CPU processes (gloo):
    torchrun --standalone --nproc-per-node=4 benchmarks/bench.py ring-run --backward
(`bash scripts/run_ring.sh [options]` sets up and launches it; without torchrun it runs
one process.)
Every rank builds the same seeded global q, k, v and runs ring_dilated_attention on its
shard; rank 0 prints per rank: wall and CPU time, GFLOP/s of the pattern, peak memory,
bytes sent per layer (measured and from the exchange plan), and the error of the gathered
result against ring_attention.dilated_attention on the whole sequence in one process.
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with contextlib.suppress(BrokenPipeError):
        return args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
