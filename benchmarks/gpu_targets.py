"""The GPU targets, PASS / FAIL / unrun, over the results of a GPU run
(``scripts/gpu_check.sh``'s archives, or the folders inside them).

Targets (H100; bf16; LongNet segments 2048 ... 32768, dilations 1, 2, 4, 6, 12;
causal and not):

* forward >= 70 % of the measured matmul rate at 16 x 128 from 131072 tokens,
  >= 55 % at 12 x 64; forward + backward >= 60 % / >= 50 %; at 32K, 16 x 128,
  forward >= 45 % (:data:`SHARES`, :func:`share_target`);
* with only torch installed (no flash-attn-4): forward >= 45 % at 16 x 128
  from 131072;
* >= 3.5x the default of c4a8cfc at 16 x 128 from 131072;
* >= 1.5x the best of gather + SDPA, gather + flash-attn-4 and FlexAttention
  at every point;
* dense causal (a ring of 1, one segment = n) within 5 % of flash-attn-4
  called directly;
* 2M tokens forward + backward on one 80 GB card with a peak <= 1.3x the
  bytes of q, k, v, out and their gradients.

Besides the targets, one figure: the ring's dilated blocks (segments crossing
the pieces), dense route over our kernels (``benchmarks/ring_dense_check.py``'s
``dilated`` records), which decides whether ``auto`` takes them.

What did not run is reported as unrun, never as a pass::

    python -m benchmarks.gpu_targets RESULTS...   # archives (*.tar.gz), folders of them
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

# (config, pass, smallest n, largest n or None): the least share of the matmul rate
SHARES = (
    ("16x128", "fwd", 131072, None, 0.70),
    ("12x64", "fwd", 131072, None, 0.55),
    ("16x128", "fwdbwd", 131072, None, 0.60),
    ("12x64", "fwdbwd", 131072, None, 0.50),
    ("16x128", "fwd", 32768, 32768, 0.45),
)
TORCH_ONLY_SHARE = 0.45  # forward, 16 x 128, from 131072, flash-attn-4 hidden
PREV_COMMIT = "c4a8cfc"
OVER_PREV = 3.5  # x the old default, 16 x 128, from 131072
OVER_BASELINES = 1.5  # x the best same-function baseline, every point
BASELINES = ("gather", "fa4", "flex")
DENSE_SLACK = 1.05  # the dense causal ring over flash-attn-4 called directly
PEAK = 1.3  # 2M fwd+bwd peak over the bytes of q, k, v, out and their gradients


def share_target(config: str, n: int, pass_: str) -> float | None:
    """The least share of the matmul rate for a point (None: no target)."""
    for c, p, lo, hi, share in SHARES:
        if c == config and p == pass_ and n >= lo and (hi is None or n <= hi):
            return share
    return None


# --------------------------------------------------------------------------- #
# reading a run
# --------------------------------------------------------------------------- #
def _jsonl(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a killed stage
    return out


def _files(path: Path):
    """``(name, text)`` of the result files under ``path``: a folder (and
    the archives in it), or one archive."""
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            if p.name.endswith(".tar.gz"):
                yield from _files(p)
            elif p.suffix == ".jsonl":
                yield str(p), p.read_text()
    elif path.name.endswith(".tar.gz"):
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                if m.isfile() and m.name.endswith(".jsonl"):
                    f = tar.extractfile(m)
                    if f is not None:
                        yield f"{path.name}:{m.name}", io.TextIOWrapper(f).read()


class Run:
    """The records of a run: bench points (``views.jsonl``: each method's,
    the subprocess methods' included), their headers, ring-dense timings."""

    def __init__(self, paths: list[Path]) -> None:
        self.points: list[dict[str, Any]] = []
        self.headers: list[dict[str, Any]] = []
        self.big: list[dict[str, Any]] = []
        self.ring: list[dict[str, Any]] = []
        self.dilated: list[dict[str, Any]] = []
        for path in paths:
            for name, text in _files(path):
                recs = _jsonl(text)
                base = name.rsplit("/", 1)[-1]
                if base == "views.jsonl":
                    for r in recs:
                        if r.get("kind") == "run":
                            self.headers.append(r)
                        elif r.get("stage") == "bench" and "method" in r and "n" in r:
                            self.points.append(r)
                        elif r.get("stage") == "big":
                            self.big.append(r)
                elif base.endswith(".jsonl") and base.startswith("ring_dense_rank0"):
                    self.ring += [r for r in recs if r.get("stage") == "time"]
                    self.dilated += [
                        r for r in recs if r.get("stage") in ("dilated", "dilated_check")
                    ]
                elif base in ("prev.jsonl", "torch.jsonl"):
                    self.headers += [r for r in recs if r.get("kind") == "run"]

    def ok(self, method: str, **where) -> list[dict[str, Any]]:
        return [r for r in self.points if r["method"] == method and r.get("status") == "ok"
                and all(r.get(k) == v for k, v in where.items())]  # fmt: skip

    def device(self) -> str:
        names = sorted({h.get("device_name", "?") for h in self.headers})
        return ", ".join(names) or "?"


def _where(r: dict[str, Any]) -> str:
    return f"n={r['n']} {r['config']} {'causal' if r.get('causal') else 'not causal'} {r['pass']}"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# --------------------------------------------------------------------------- #
# the targets
# --------------------------------------------------------------------------- #
def shares(run: Run) -> list[str]:
    out = []
    for config, pass_, lo, hi, share in SHARES:
        pts = [r for r in run.ok("default", config=config, **{"pass": pass_})
               if r["n"] >= lo and (hi is None or r["n"] <= hi) and "of_mm" in r]  # fmt: skip
        what = f"{'forward' if pass_ == 'fwd' else 'forward+backward'} {config} " + (
            f"n={lo}" if hi == lo else f"from n={lo}"
        )
        if not pts:
            out.append(f"- unrun: {what} >= {share:.0%} of the matmul rate")
            continue
        worst = min(pts, key=lambda r: r["of_mm"])
        out.append(
            f"- {_verdict(worst['of_mm'] >= share)}: {what} >= {share:.0%} of the matmul "
            f"rate: least {worst['of_mm']:.0%} ({_where(worst)}; {len(pts)} points)"
        )
    pts = [
        r
        for r in run.ok("torch", config="16x128", **{"pass": "fwd"})
        if r["n"] >= 131072 and "of_mm" in r
    ]
    what = f"torch only (no flash-attn-4): forward 16x128 from n=131072 >= {TORCH_ONLY_SHARE:.0%}"
    if pts:
        worst = min(pts, key=lambda r: r["of_mm"])
        out.append(f"- {_verdict(worst['of_mm'] >= TORCH_ONLY_SHARE)}: {what}: least "
                   f"{worst['of_mm']:.0%} ({_where(worst)}; {len(pts)} points)")  # fmt: skip
    else:
        out.append(f"- unrun: {what}")
    return out


def _pairs(run: Run, method: str, **where):
    """``(default point, other point)`` at the same (n, config, causal, pass)."""
    key = lambda r: (r["n"], r["config"], bool(r.get("causal")), r["pass"])  # noqa: E731
    others = {key(r): r for r in run.ok(method, **where)}
    return [(r, others[key(r)]) for r in run.ok("default", **where) if key(r) in others]


def over_prev(run: Run) -> str:
    commits = {h.get("commit", "")[:7] for h in run.headers if "prev" in " ".join(h.get("argv", []))
               and "--tag" in h.get("argv", [])}  # fmt: skip
    pairs = [(d, p) for d, p in _pairs(run, "prev", config="16x128") if d["n"] >= 131072]
    what = f">= {OVER_PREV}x the default of {PREV_COMMIT} at 16x128 from n=131072"
    if not pairs:
        return f"- unrun: {what}"
    worst = min(pairs, key=lambda dp: dp[1]["ms"] / dp[0]["ms"])
    x = worst[1]["ms"] / worst[0]["ms"]
    tree = ", ".join(sorted(c for c in commits if c)) or "?"
    note = "" if any(c.startswith(PREV_COMMIT) for c in commits) else \
        f" (the earlier tree measured is {tree}, not {PREV_COMMIT})"  # fmt: skip
    return (f"- {_verdict(x >= OVER_PREV)}: {what}: least {x:.2f}x ({_where(worst[0])}; "
            f"{len(pairs)} points){note}")  # fmt: skip


def over_baselines(run: Run) -> str:
    what = f">= {OVER_BASELINES}x the best of gather+SDPA, gather+flash-attn-4, FlexAttention"
    rows = []
    for d in run.ok("default"):
        got = {m: r["ms"] for m in BASELINES for r in run.ok(m, n=d["n"], config=d["config"],
               causal=d.get("causal"), **{"pass": d["pass"]})}  # fmt: skip
        if got:
            best = min(got, key=got.get)
            rows.append((got[best] / d["ms"], best, d, len(got)))
    if not rows:
        return f"- unrun: {what} at every point"
    worst = min(rows, key=lambda r: r[0])
    partial = sum(1 for r in rows if r[3] < len(BASELINES))
    missing = len(run.ok("default")) - len(rows)
    note = (f"; {partial} of them without every baseline" if partial else "") + (
        f"; {missing} points without any baseline (unrun)" if missing else ""
    )
    return (
        f"- {_verdict(worst[0] >= OVER_BASELINES and not missing)}: {what}: least "
        f"{worst[0]:.2f}x ({worst[1]}, {_where(worst[2])}; {len(rows)} points{note})"
    )


def dense_ring(run: Run) -> str:
    what = f"dense causal ring of 1 within {DENSE_SLACK - 1:.0%} of flash-attn-4 called directly"
    by = {(r["shape"], r["pass"], r["method"]): r for r in run.ring}
    rows = []
    for (shape, pass_, method), r in by.items():
        d = by.get((shape, pass_, "direct"))
        if method == "ring_dense" and d:
            rows.append((r["median_s"] / d["median_s"], shape, pass_, r.get("backend")))
    if not rows:
        return f"- unrun: {what}"
    worst = max(rows)
    backends = sorted({str(r[3]) for r in rows})
    return (f"- {_verdict(worst[0] <= DENSE_SLACK)}: {what}: worst {worst[0]:.3f}x ({worst[1]} "
            f"{worst[2]}; backend {', '.join(backends)}; {len(rows)} points)")  # fmt: skip


def dilated_ratio(run: Run) -> str:
    """The ring's dilated blocks, dense over kernel (not a target: what decides ``auto``)."""
    what = "dilated ring blocks, dense route / our kernels (decides auto; not a target):"
    timed = [r for r in run.dilated if r["stage"] == "dilated" and r["method"] == "dense"]
    failed = [r for r in run.dilated if r["stage"] == "dilated_check" and r["status"] != "ok"]
    fail = f"; {len(failed)} points failed the check" if failed else ""
    if not timed:
        return f"{what} unrun{fail}"
    parts = []
    for p, name in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
        x = sorted(r["ratio"] for r in timed if r["pass"] == p)
        if x:
            parts.append(f"{name} {x[0]:.2f}-{x[-1]:.2f}x")
    r = timed[0]
    backends = ", ".join(sorted({str(t.get("backend")) for t in timed}))
    configs = ", ".join(sorted({t["config"] for t in timed}))
    causal = {bool(t["causal"]) for t in timed}
    kinds = "causal and not" if len(causal) == 2 else ("causal" if causal.pop() else "not causal")
    return (f"{what} {'; '.join(parts)} ({len(timed) // 2} points: {configs}, {kinds}, "
            f"n={r['n']} over p={r['p']}, backend {backends}){fail}")  # fmt: skip


def big(run: Run) -> str:
    what = f"2M tokens fwd+bwd on one 80 GB card, peak <= {PEAK}x q, k, v, out and their gradients"
    done = [r for r in run.big if r.get("status") == "ok" and r.get("n", 0) >= 2097152]
    if not done:
        why = "; ".join(f"n={r.get('n')}: {r.get('status')}" for r in run.big)
        return f"- unrun: {what}" + (f" (ran: {why})" if why else "")
    r = done[-1]
    peak = r.get("peak_over_tensors")
    if peak is None:
        return f"- unrun: {what} (no peak recorded)"
    card = run.device()
    note = "" if "H100" in card else f" (on {card}, not an 80 GB H100)"
    return f"- {_verdict(peak <= PEAK)}: {what}: {peak}x, {r.get('s')} s{note}"


def report(paths: list[Path]) -> list[str]:
    run = Run(paths)
    lines = [f"## targets (H100; bf16) over {len(run.points)} points, "
             f"{len(run.ring)} ring-dense timings; measured on: {run.device()}"]  # fmt: skip
    lines += shares(run)
    lines += [over_prev(run), over_baselines(run), dense_ring(run), big(run), dilated_ratio(run)]
    counts = {v: sum(1 for x in lines[1:] if x.startswith(f"- {v}")) for v in
              ("PASS", "FAIL", "unrun")}  # fmt: skip
    lines.append(f"targets: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['unrun']} unrun")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path)
    a = ap.parse_args(argv)
    print("\n".join(report(a.paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
