"""The report of ``bench.py local``: the markdown table, the summary and the
plot, from the result file."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from . import gpu_targets, measure, methods
from .common import heading, md_table, pyplot, rate_unit, wrap, write_text
from .measure import MiB
from .outputs import kept_line

# What the tables call each method.
LABELS = {
    "gather": "gather+SDPA",
    "fa4": "gather+FA4",
    "dense": "dense SDPA†",
    "flex": "FlexAttention",
}

# --------------------------------------------------------------------------- #
# bench.py local
# --------------------------------------------------------------------------- #


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
        label = LABELS.get(r["method"], r["method"])
        if r.get("backend") and r["method"] != "fa4":
            label += f" [{r['backend']}]"
        if r["status"] != "ok":
            cells = [r["status"] + (": " + r["reason"][:60] if r.get("reason") else "")] + [""] * 6
        else:
            hw = r.get("hardware_flop_rate")
            sgemm = r.get("sgemm_flop_rate")
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
                "—" if not sgemm else f"{100 * rate / sgemm:.0f}%",
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
            "of sgemm",
            "peak MiB",
            "peak / qkvo",
        ],
        table,
        "rrll" + "r" * 7,
    )
    run = latest_run(store)
    dense = any(r["method"] == "dense" for r in rows)
    note = (
        f"{unit}: pattern FLOPs (4·d per reached (query, key) pair forward, 3.5x for fwd+bwd, "
        "counted exactly) / median time"
        + (
            "; † dense SDPA computes all n² pairs (a different function unless the pattern "
            "is dense): its column counts its own FLOPs"
            if dense
            else ""
        )
        + ". 'of hw': that rate / the hardware rate measured beside the point (the higher of "
        "a sample before and after it)"
        + (f" ({run['hardware_what']})" if run else "")
        + "; 'of sgemm': that rate / a 2048^3 float32 torch.mm measured at the same times "
        "(CPU only). time / ours > 1: ours is faster. peak: inputs + the peak growth of one call; "
        "qkvo: bytes of q, k, v, out."
    )
    lines += ["", *wrap(note)]
    if rows[0]["device"] == "cuda":
        lines += ["", *cuda_targets(rows, by)]
    return lines


def cuda_targets(rows, by) -> list[str]:
    """The GPU targets of benchmarks/gpu_targets.py on ``bench.py local``'s
    points, PASS/FAIL: ours >= 1.5x the best same-function baseline (gather +
    SDPA, gather + flash-attn-4, FlexAttention), ours' share of the matmul
    rate (:func:`~benchmarks.gpu_targets.share_target`: by config, length and
    pass), fwd+bwd peak <= 1.3x the bytes of q, k, v, out and their
    gradients."""
    out = ["### targets (benchmarks/gpu_targets.py)"]
    for r in rows:
        if r["method"] != "ours" or r["status"] != "ok":
            continue
        k = (r["dtype"], r["heads"], r["head_dim"], r["n"], r["pass"])
        where = f"n={r['n']} h={r['heads']} d={r['head_dim']} {r['pass']}"
        base = [
            (by[(*k, m)]["ms"], m)
            for m in gpu_targets.BASELINES
            if (*k, m) in by and by[(*k, m)]["status"] == "ok"
        ]
        if base:
            t, m = min(base)
            x = t / r["ms"]
            want = gpu_targets.OVER_BASELINES
            out.append(
                f"- {where}: {x:.2f}x the best same-function baseline ({m}), "
                f"target >= {want}: {'PASS' if x >= want else 'FAIL'}"
            )
        share = gpu_targets.share_target(f"{r['heads']}x{r['head_dim']}", r["n"], r["pass"])
        if share is not None and r.get("hardware_flop_rate"):
            x = r["pattern_flop_rate"] / r["hardware_flop_rate"]
            out.append(
                f"- {where}: {x:.0%} of the matmul rate, target >= {share:.0%}: "
                f"{'PASS' if x >= share else 'FAIL'}"
            )
        if r["pass"] == "fwdbwd" and r["peak_bytes"]:
            x = r["peak_bytes"] / (2 * r["input_bytes"])  # inputs = q, k, v, dout
            out.append(
                f"- {where}: peak {x:.2f}x the bytes of q, k, v, out, dq, dk, dv, dout, "
                f"target <= {gpu_targets.PEAK}: {'PASS' if x <= gpu_targets.PEAK else 'FAIL'}"
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
    styles = {"ours": "C0", "gather": "C1", "flex": "C2", "dense": "C3", "fa4": "C4"}
    configs = sorted({(r["heads"], r["head_dim"], r["dtype"]) for r in rows})
    for h, d, dt in configs:
        for m in methods.METHODS:
            # fwd: solid line, filled dots; fwdbwd: dashed line, hollow squares
            for p, ls, mk, face in (("fwd", "-", "o", None), ("fwdbwd", "--", "s", "none")):
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
                kw = dict(color=styles.get(m), linestyle=ls, marker=mk, markerfacecolor=face,
                          label=lab)  # fmt: skip
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
    # long handles: a dashed line and its marker read apart from a solid one
    axes[0].legend(fontsize=7, handlelength=4)
    axes[1].legend(fontsize=7, handlelength=4, handles=axes[1].get_lines()[-1:])
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


def local_summary(store: measure.ResultFile) -> list[str]:
    """One row per (config, n, pass): the time of every method that ran, ours'
    rate against the hardware's, ours' peak memory."""
    rows = [r for r in local_rows(store.records.values()) if r["status"] == "ok"]
    if not rows:
        return []
    unit, scale = rate_unit(rows[0]["device"])
    cases = sorted({(r["dtype"], r["heads"], r["head_dim"], r["n"], r["pass"]) for r in rows},
                   key=lambda c: (c[0], c[1], c[2], c[4], c[3]))  # fmt: skip
    by = {(r["dtype"], r["heads"], r["head_dim"], r["n"], r["pass"], r["method"]): r for r in rows}
    # a column for each method that ran somewhere in the file
    shown = [m for m in methods.METHODS if any(r["method"] == m for r in rows)]
    table = []
    for case in cases:
        ours = by.get((*case, "ours"))
        ms = [by.get((*case, m)) for m in shown]
        table.append([
            case[3], f"{case[1]}x{case[2]}", case[4],
            *("—" if r is None else f"{r['ms']:.0f}" for r in ms),
            "—" if ours is None else f"{ours['pattern_flop_rate'] / scale:.1f}",
            "—" if ours is None else f"{ours['hardware_flop_rate'] / scale:.1f}",
            "—" if ours is None or ours["peak_bytes"] is None
            else f"{ours['peak_bytes'] / MiB:.0f}",
        ])  # fmt: skip
    return md_table(
        ["n", "heads x dim", "pass", *(f"{LABELS.get(m, m)} ms" for m in shown),
         f"ours {unit}", f"hardware {unit}", "ours peak MiB"],
        table, "rrl" + "r" * (len(shown) + 3),
    )  # fmt: skip


def finish_local(store: measure.ResultFile, out_dir: str, kept: list[str] | None = None) -> int:
    """Print the tables of ``store``; write them and the plot to ``out_dir``
    unless ``kept`` names files to leave as they are
    (:func:`benchmarks.outputs.tracked_to_keep`)."""
    lines = local_report(store)
    if kept:
        print("\n".join(lines) + "\n\n" + kept_line(kept))
        return 0
    run = latest_run(store)
    head = heading("bench.py local", run)
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
