"""The report of benchmarks/bench_gpu.py: the result rows, the markdown table
(with footnotes), the issue's targets as PASS/FAIL lines, and the markdown /
JSON files (rewritten after every case).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from gpu_plan import METHODS, SAME_PATTERN_BASELINES, dense_flops, flex_visited_flops, tensor_bytes
from gpu_timing import GiB, fmt_rate


@dataclass
class Row:
    heads: int
    dim: int
    n: int
    method: str
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    fwd_peak: int | None = None
    fwdbwd_peak: int | None = None
    fwd_status: str = "not run"
    fwdbwd_status: str = "not run"
    fwd_backend: str = ""
    fwdbwd_backend: str = ""
    runs: str = ""
    notes: list[str] = field(default_factory=list)


class BenchReport:
    """Output half of :class:`bench_gpu.Bench` (which holds the state it reads)."""

    def largest(self) -> dict[str, tuple[int, int, int] | None]:
        out = {}
        for m in METHODS:
            ok = [
                (r.n, r.heads, r.dim)
                for r in self.rows.values()
                if r.method == m and r.fwdbwd_status == "ok"
            ]
            out[m] = max(ok) if ok else None
        return out

    def table(self) -> list[str]:
        args = self.args
        lines = [
            "| n | h | d | method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
            "| peak GiB (fwd / fwd+bwd) | fwd+bwd peak / 8·|q| | time / ours (fwd / fwd+bwd) |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        order = {m: i for i, m in enumerate(METHODS)}
        foot = []
        for key in sorted(self.rows, key=lambda k: (k[0], k[1], k[2], order[k[3]])):
            r = self.rows[key]
            ours = self.rows.get((r.heads, r.dim, r.n, "ours"))
            tb = tensor_bytes(r.n, r.heads, r.dim, self.dtype)
            cells = []
            for tag, bwd in (("fwd", False), ("fwdbwd", True)):
                ms = getattr(r, f"{tag}_ms")
                if ms is None:
                    st = getattr(r, f"{tag}_status")
                    cells += [st if len(st) <= 60 else st[:57] + "...", "—"]
                else:
                    tf = self.flops(r.n, r.heads, r.dim, bwd) / (ms * 1e-3) / 1e12
                    cells += [f"{ms:.2f}", fmt_rate(tf)]
            peaks = [getattr(r, f"{t}_peak") for t in ("fwd", "fwdbwd")]
            peak_s = " / ".join("—" if p is None else f"{p / GiB:.2f}" for p in peaks)
            pratio = "—" if peaks[1] is None else f"{peaks[1] / (8 * tb):.2f}"
            ratios = []
            for tag in ("fwd", "fwdbwd"):
                a = getattr(r, f"{tag}_ms")
                b = getattr(ours, f"{tag}_ms") if ours is not None else None
                ratios.append("—" if a is None or b is None else f"{a / b:.2f}")
            label = r.method
            if r.method in ("gather", "dense"):
                bks = {r.fwd_backend, r.fwdbwd_backend} - {""}
                if bks:
                    label += f" [{'/'.join(sorted(bks))}]"
            if r.method == "gather":
                label = label.replace("gather", "gather+SDPA")
            if r.method == "dense":
                label = label.replace("dense", "dense SDPA†")
                rates = []
                for tag, bwd in (("fwd", False), ("fwdbwd", True)):
                    ms = getattr(r, f"{tag}_ms")
                    if ms is not None:
                        df = dense_flops(r.n, r.heads, r.dim, args.causal) * (3.5 if bwd else 1)
                        rates.append(f"{tag} {df / (ms * 1e-3) / 1e12:.0f}")
                if rates:
                    foot.append(
                        f"- † dense n={r.n} h={r.heads} d={r.dim}: its own n² FLOPs run at "
                        f"{', '.join(rates)} TFLOP/s"
                    )
            if r.method == "flex":
                fv = flex_visited_flops(r.n, r.heads, r.dim, args.segments, args.causal)
                if r.fwd_ms is not None:
                    foot.append(
                        f"- flex n={r.n} h={r.heads} d={r.dim}: visits {fv / 1e12:.2f} TFLOP of "
                        f"blocks per forward ({fv / (r.fwd_ms * 1e-3) / 1e12:.0f} TFLOP/s on them)"
                    )
            for name, okv in self.check_ok.items():
                if not okv and name.split("[")[0] == r.method:
                    label += " (CHECK FAILED)"
                    break
            lines.append(
                f"| {r.n} | {r.heads} | {r.dim} | {label} | {cells[0]} | {cells[1]} | "
                f"{cells[2]} | {cells[3]} | {peak_s} | {pratio} | {ratios[0]} / {ratios[1]} |"
            )
        for key in sorted(self.rows, key=lambda k: (k[0], k[1], k[2], order[k[3]])):
            r = self.rows[key]
            if r.notes:
                foot.append(f"- n={r.n} h={r.heads} d={r.dim} {r.method}: " + " | ".join(r.notes))
        return [*lines, "", *foot]

    def targets(self) -> list[str]:
        args = self.args
        out = ["### targets (the issue's)"]
        mm = max(self.mm_rates) if self.mm_rates else None
        keys = sorted({(r.heads, r.dim, r.n) for r in self.rows.values()})
        for h, d, n in keys:
            ours = self.rows.get((h, d, n, "ours"))
            if ours is None:
                continue
            for tag, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
                t = getattr(ours, f"{tag}_ms")
                if t is None:
                    continue
                base = []
                for m in SAME_PATTERN_BASELINES:
                    rb = self.rows.get((h, d, n, m))
                    if rb is not None and getattr(rb, f"{tag}_ms") is not None:
                        base.append((getattr(rb, f"{tag}_ms"), m))
                if base:
                    tb, mb = min(base)
                    out.append(
                        f"- n={n} h={h} d={d} {label}: {tb / t:.2f}x the best same-pattern "
                        f"baseline ({mb}) — target >= 1.2: {'PASS' if tb / t >= 1.2 else 'FAIL'}"
                    )
                rf = self.rows.get((h, d, n, "flex"))
                if rf is not None and getattr(rf, f"{tag}_ms") is not None:
                    x = getattr(rf, f"{tag}_ms") / t
                    out.append(
                        f"- n={n} h={h} d={d} {label}: {x:.2f}x FlexAttention — target >= 2: "
                        f"{'PASS' if x >= 2 else 'FAIL'}"
                    )
                if tag == "fwd" and mm:
                    tf = self.flops(n, h, d, False) / (t * 1e-3) / 1e12
                    out.append(
                        f"- n={n} h={h} d={d} fwd: {tf:.0f} TFLOP/s = {tf / mm:.0%} of the "
                        f"matmul rate — target >= 50%: {'PASS' if tf >= 0.5 * mm else 'FAIL'}"
                    )
        if args.big_n:
            h, d = args.big_config
            rb = self.rows.get((h, d, args.big_n, "ours"))
            tb = tensor_bytes(args.big_n, h, d, self.dtype)
            if rb is None or rb.fwdbwd_status != "ok":
                st = "not run" if rb is None else rb.fwdbwd_status
                out.append(f"- fwd+bwd at n={args.big_n} h={h} d={d}: {st} — target: FAIL")
            elif rb.fwdbwd_peak is not None:
                x = rb.fwdbwd_peak / (8 * tb)
                out.append(
                    f"- fwd+bwd at n={args.big_n} h={h} d={d}: ran, peak "
                    f"{rb.fwdbwd_peak / GiB:.2f} GiB = {x:.2f}x the bytes of q, k, v, out and "
                    f"their gradients ({8 * tb / GiB:.1f} GiB) — target <= 1.3: "
                    f"{'PASS' if x <= 1.3 else 'FAIL'}"
                )
            else:
                out.append(f"- fwd+bwd at n={args.big_n} h={h} d={d}: ran; peak not measured")
        return out

    def write(self) -> None:
        args = self.args
        lines = list(self.header)
        if self.mm_rates:
            lines.append(
                "bf16 matmul rate (torch.mm "
                f"{args.mm_size}³, random data, median): "
                + ", ".join(f"{x:.0f}" for x in self.mm_rates)
                + " TFLOP/s (start, end)"
            )
        lines.append("")
        if self.check_lines:
            lines += [*self.check_lines, ""]
        lines.append(
            f"### results (dtype {str(self.dtype).replace('torch.', '')}, batch 1, "
            f"causal={args.causal}; time / ours > 1: ours is faster; "
            f"8·|q| = bytes of q, k, v, out, dq, dk, dv, dout)"
        )
        lines.append("")
        lines += self.table()
        lines.append("")
        big = self.largest()
        lines.append(
            "largest n that ran forward + backward: "
            + ", ".join(
                f"{m} {'—' if v is None else f'{v[0]} (h={v[1]}, d={v[2]})'}"
                for m, v in big.items()
                if m in args.methods
            )
            + (f" ({self.search_note})" if self.search_note else "")
        )
        lines.append("")
        lines += self.targets()
        if self.fatal:
            lines += ["", f"**stopped: CUDA context broken: {self.fatal}**"]
        lines.append("")
        lines.append(f"total wall time {self.elapsed():.0f} s (budget {args.budget_s:.0f} s)")
        text = "\n".join(lines) + "\n"
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "matmul_tflops": self.mm_rates,
                        "check": self.check_ok,
                        "rows": [asdict(r) for r in self.rows.values()],
                        "largest_fwdbwd": big,
                        "fatal": self.fatal,
                    },
                    f,
                    indent=1,
                )
        self._text = text
