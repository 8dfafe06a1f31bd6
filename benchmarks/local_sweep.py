"""``bench.py local``: the local operator against its baselines, vs n
(time, peak memory, pattern FLOP rate, hardware rate); its report and plot."""

from __future__ import annotations

import argparse
import math
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from . import measure, methods
from .common import dtype_name, md_table, progress, rate_unit, resolve_device, resolve_dtype, say
from .local_report import finish_local
from .measure import MiB
from .outputs import announce, tracked_to_keep

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
    if args.methods is None:
        args.methods = methods.default_methods(device)


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
        hw = measure.hardware_rate(self.device, self.args.configs[0][1], self.args.dtype_t)
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
        hw = [measure.hardware_rate(dev, pts[0]["head_dim"], a.dtype_t)]
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
            for i, pt in enumerate(pts):
                if pt["method"] == "ours" and self.meth.ra is not None:
                    recs[i]["paths"] = self.meth.ours_paths(q, k, v_)
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
        hw.append(measure.hardware_rate(dev, pts[0]["head_dim"], a.dtype_t))
        rates = [h["flop_rate"] for h in hw]
        sgemm = [h["sgemm_rate"] for h in hw if h["sgemm_rate"]]
        for i, rec in enumerate(recs):
            if "status" not in rec:
                mine = [var for var in variants if var[0] == i]
                self.finish_record(rec, mine, times, extra, notes, in_bytes)
                rec.update(hardware_flop_rate=max(rates), hardware_samples=rates,
                           sgemm_flop_rate=max(sgemm) if sgemm else None,
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
    reports = [os.path.join(args.out_dir, f) for f in ("local.md", "local.png")]
    kept = tracked_to_keep(sweep.store, reports, bool(todo or args.search_step),
                           args.write_tracked)  # fmt: skip
    announce(sweep.store, [local_key(args, device, p) for g in groups for p in g],
             [local_key(args, device, p) for g in todo for p in g], "points")  # fmt: skip
    if todo or args.search_step:
        sweep.start_run()
    for group in progress(todo, "local", size=len):
        if sweep.fatal:
            say(f"stopped: CUDA context broken ({sweep.fatal})")
            break
        sweep.run_group(group, args.iters, args.warmup)
    sweep.search()
    rc = finish_local(sweep.store, args.out_dir, kept)
    return 1 if sweep.fatal else rc
