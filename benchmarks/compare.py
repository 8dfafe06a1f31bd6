"""``bench.py compare``: two ``bench.py local`` result folders point by point,
typically this checkout against an earlier commit (exported by
``scripts/prev_tree.sh`` and timed in the same ``gpu_check.sh`` run): time,
the old / new ratio, peak memory, and the matmul rate sampled beside each
point in both runs (a machine that changed state between the runs shows
there)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from . import measure
from .common import fmt, md_table, rate_unit, write_text
from .local_report import local_rows


def _result_file(folder: str) -> measure.ResultFile | None:
    path = os.path.join(folder, "local.jsonl")
    return measure.ResultFile(path) if os.path.exists(path) else None


def _describe(store: measure.ResultFile) -> str:
    run = store.runs[-1] if store.runs else {}
    return (
        f"commit {run.get('commit', '?')}, {run.get('date', '?')[:16]}, "
        f"{run.get('device_name', '?')}"
    )


def compare_report(new: measure.ResultFile, old: measure.ResultFile) -> list[str]:
    """The markdown comparison of the points both files hold (the latest
    record of each); empty when they share none."""
    rows = local_rows(new.records.values())
    pairs = [(a, old.records.get(a["key"])) for a in rows]
    pairs = [(a, b) for a, b in pairs if b is not None and b.get("kind") == "local"]
    if not pairs:
        return []
    unmatched = len(rows) - len(pairs)
    unit, scale = rate_unit(pairs[0][0]["device"])
    table, ratios = [], {}
    for a, b in pairs:
        label = [a["n"], f"{a['heads']}x{a['head_dim']}", a["pass"], a["method"]]
        if a["status"] != "ok" or b["status"] != "ok":
            table.append(label + [a["status"], b["status"], "—", "—", "—"])
            continue
        ratio = b["ms"] / a["ms"]
        ratios.setdefault(a["pass"], []).append(ratio)
        rates = [r.get("hardware_flop_rate") for r in (a, b)]
        table.append(
            label
            + [
                f"{a['ms']:.1f}",
                f"{b['ms']:.1f}",
                f"{ratio:.2f}",
                f"{a['peak_bytes'] / b['peak_bytes']:.2f}",
                ", ".join(fmt(x / scale if x else None, 0) for x in rates),
            ]
        )
    lines = [
        f"new: {_describe(new)}",
        f"old: {_describe(old)}",
        "",
        *md_table(
            [
                "n",
                "heads x dim",
                "pass",
                "method",
                "new ms",
                "old ms",
                "old / new",
                "peak new / old",
                f"matmul {unit} new, old",
            ],
            table,
            align="rrllrrrrr",
        ),
        "",
    ]
    for pass_, rs in sorted(ratios.items()):
        geo = math.exp(sum(math.log(r) for r in rs) / len(rs))
        lines.append(
            f"- {pass_}: old / new {min(rs):.2f}-{max(rs):.2f}, geometric mean {geo:.2f}"
            f" over {len(rs)} points (above 1: the new one is faster)"
        )
    if unmatched:
        lines.append(f"- {unmatched} points of the new run are not in the old one (left out)")
    return lines


def cmd_compare(a: argparse.Namespace) -> int:
    stores: list[Any] = [_result_file(a.new), _result_file(a.old)]
    for folder, store in zip((a.new, a.old), stores, strict=True):
        if store is None:
            print(f"compare: no local.jsonl in {folder}")
            return 1
    lines = compare_report(*stores)
    if not lines:
        print(f"compare: {a.new} and {a.old} share no point")
        return 1
    print("\n".join(lines))
    if a.out:
        write_text(a.out, lines)
        print(f"wrote {a.out}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="two local result folders point by point (e.g. against an earlier commit)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("new", help="folder of the new run's local.jsonl")
    p.add_argument("old", help="folder of the old run's local.jsonl")
    p.add_argument("--out", help="also write the table to this markdown file")
    p.set_defaults(func=cmd_compare)
