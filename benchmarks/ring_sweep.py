"""``bench.py ring``: ring scaling under torchrun, p = 1, 2, 4, 8 (strong and
weak), one ``ring-run`` launch per point; its report and plot."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import torch

from . import measure
from .common import HERE, fmt, heading, md_table, progress, pyplot, say, write_text
from .local_report import latest_run
from .measure import MiB
from .outputs import announce, kept_line, tracked_to_keep


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
    pts = [(s, p, a.seq_len if s == "strong" else a.shard * p) for s in a.scaling for p in a.worlds]
    todo = [x for x in pts if not store.done(ring_key(a, *x, device))]
    reports = [os.path.join(a.out_dir, f) for f in ("ring.md", "ring.png")]
    kept = tracked_to_keep(store, reports, bool(todo), a.write_tracked)
    announce(store, [ring_key(a, *x, device) for x in pts],
             [ring_key(a, *x, device) for x in todo],
             f"ring runs (torchrun, {'NCCL' if device == 'cuda' else 'gloo'})")  # fmt: skip
    logs = os.path.join(a.out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
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
    return finish_ring(store, a.out_dir, kept)


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


def finish_ring(store: measure.ResultFile, out_dir: str, kept: list[str] | None = None) -> int:
    """Print the table of ``store``; write it and the plot to ``out_dir``
    unless ``kept`` names files to leave as they are
    (:func:`benchmarks.outputs.tracked_to_keep`). 1 when a run failed."""
    lines = ring_report(store)
    bad = [r for r in store.records.values() if r.get("kind") == "ring" and r["status"] == "error"]
    if kept:
        print("\n".join(lines) + "\n\n" + kept_line(kept))
        return 1 if bad else 0
    run = latest_run(store)
    head = heading("bench.py ring", run)
    write_text(os.path.join(out_dir, "ring.md"), head + lines)
    png = os.path.join(out_dir, "ring.png")
    plotted = ring_plot(store, png)
    print("\n".join(lines))
    print(f"\nwrote {os.path.join(out_dir, 'ring.md')}" + (f", {png}" if plotted else ""))
    return 1 if bad else 0
