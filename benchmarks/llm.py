"""``bench.py llm``: what the LLM-training features cost (docs/design.md §1).

* **Grouped K/V heads**: bytes a rank sends per layer with K/V at K/V-head
  width (from the exchange plans) against the same model with K/V repeated to
  every query head; and the local operator's time and peak memory with
  grouped K/V against repeating K/V in memory first.
* **Packed documents**: the local operator on a packed sequence of many
  documents of random lengths (``cu_seqlens``) against the same tokens
  unpacked (one document): time, peak memory, and the cost of checking the
  boundaries.

Everything on one process; no result file (a table, printed and written to
``OUT_DIR/llm.md``).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from . import measure
from .measure import MiB


def _plan_bytes(pattern, n: int, heads: int, kv_heads: int, p: int, head_dim: int, itemsize: int):
    """Max over ranks of the bytes sent per layer, (forward, forward + backward)."""
    from ring_attention.parallel.exchange_plan import build_plan

    fwd = both = 0
    for rank in range(p):
        plan = build_plan(pattern, n, heads, kv_heads, p, rank)
        fwd = max(fwd, plan.bytes_sent(1, head_dim, itemsize))
        both = max(both, plan.bytes_sent(1, head_dim, itemsize, backward=True))
    return fwd, both


def _time(fn, a: argparse.Namespace) -> float:
    return measure.median(measure.time_call(fn, torch.device("cpu"), 1, a.iters, a.max_s))


def _step(q, k, v, kw: dict[str, Any], backward: bool):
    import ring_attention as ra

    def run() -> None:
        out = ra.dilated_attention(q, k, v, **kw)
        if backward:
            out.backward(torch.ones_like(out))

    return run


def _random_documents(n: int, count: int, seed: int) -> torch.Tensor:
    """``count`` documents of random lengths (some empty) covering ``n`` tokens."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, n + 1, (count - 1,), generator=g).sort().values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])


def cmd_llm(a: argparse.Namespace) -> int:
    from ring_attention.core.pattern import Pattern

    segs, dils = list(a.segments), list(a.dilations)
    pattern = Pattern(segs, dils, causal=True)
    out = [
        f"# LLM features — {measure.describe(measure.environment(torch.device('cpu')))}",
        "",
        f"Pattern: segments {segs}, dilations {dils}, causal.",
        "",
        f"## Grouped K/V heads: bytes a rank sends per layer (MiB, max over ranks; "
        f"{a.heads} query heads, {a.kv_heads} K/V heads, head_dim {a.head_dim}, "
        f"{a.itemsize}-byte elements, batch 1)",
        "",
    ]
    rows = []
    grouped = Pattern(segs, dils, causal=True, head_offsets="grouped")
    for n in a.seq_lens:
        for p in a.worlds:
            g = _plan_bytes(pattern, n, a.heads, a.kv_heads, p, a.head_dim, a.itemsize)
            o = _plan_bytes(grouped, n, a.heads, a.kv_heads, p, a.head_dim, a.itemsize)
            r = _plan_bytes(pattern, n, a.heads, a.heads, p, a.head_dim, a.itemsize)
            rows.append([n, p] + [f"{x / MiB:.2f}" for x in (r[0], g[0], o[0], r[1], g[1], o[1])])
    out += _table(
        ["n", "p", "repeated fwd", "GQA fwd", "GQA grouped-offsets fwd", "repeated fwd+bwd",
         "GQA fwd+bwd", "GQA grouped-offsets fwd+bwd"],
        rows,
    )  # fmt: skip
    out += [
        "",
        "K/V travel at K/V-head width: a K/V head's row goes once for all query heads of its "
        "group that reach it. With the default offsets (h mod r) the query heads of one group "
        "have different offsets in branches with r > 1, so they read different rows and the "
        "union is as large as the repeated heads' rows; with head_offsets='grouped' (contiguous "
        "heads share an offset) they read the same rows.",
        "",
    ]

    torch.set_num_threads(a.threads)
    h, hk, d = a.cpu_heads, a.cpu_kv_heads, a.cpu_head_dim
    out += [
        "",
        f"## Grouped K/V heads on the CPU: local op, float32, {h} query heads, {hk} K/V heads, "
        f"head_dim {d}, {a.threads} threads (median of {a.iters})",
        "",
    ]
    rows = []
    kw = {"segment_lengths": segs, "dilation_rates": dils, "causal": True}
    for n in a.cpu_seq_lens:
        g = torch.Generator().manual_seed(n)
        q = torch.randn(1, n, h, d, generator=g)
        k, v = (torch.randn(1, n, hk, d, generator=g) for _ in range(2))
        rep = [t.repeat_interleave(h // hk, dim=2) for t in (k, v)]
        row: list[Any] = [n]
        for backward in (False, True):
            qs, ks, vs = (t.clone().requires_grad_(backward) for t in (q, k, v))
            qr, kr, vr = (t.clone().requires_grad_(backward) for t in (q, *rep))
            tg = _time(_step(qs, ks, vs, kw, backward), a)
            tr = _time(_step(qr, kr, vr, kw, backward), a)
            row += [f"{tg / 1e3:.2f}", f"{tr / 1e3:.2f}"]
        mg = measure.peak_growth_bytes(_step(q, k, v, kw, False), torch.device("cpu"))
        mr = measure.peak_growth_bytes(_step(q, *rep, kw, False), torch.device("cpu"))
        inputs_g = measure.tensor_bytes(q, k, v)
        inputs_r = measure.tensor_bytes(q, *rep)
        row += [f"{(inputs_g + (mg or 0)) / MiB:.0f}", f"{(inputs_r + (mr or 0)) / MiB:.0f}"]
        rows.append(row)
    out += _table(
        ["n", "fwd GQA s", "fwd repeated s", "fwd+bwd GQA s", "fwd+bwd repeated s",
         "fwd MiB GQA", "fwd MiB repeated"],
        rows,
    )  # fmt: skip

    n = a.doc_seq_len
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, h, d, generator=g) for _ in range(3))
    cu = _random_documents(n, a.documents, seed=1)
    lengths = (cu[1:] - cu[:-1]).tolist()
    t0 = time.perf_counter()
    for _ in range(10):
        Pattern(segs, dils, causal=True).with_documents(cu)
    check_ms = (time.perf_counter() - t0) * 100
    out += [
        "",
        f"## Packed documents on the CPU: {a.documents} documents of random lengths "
        f"(min {min(lengths)}, median {sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}; "
        f"{lengths.count(0)} empty) in n = {n} tokens vs the same tokens unpacked; float32, "
        f"{h} heads, head_dim {d}, {a.threads} threads (median of {a.iters})",
        "",
    ]
    from ring_attention.core.pairs import reached_pairs

    rows = []
    for name, extra in (("unpacked", {}), ("packed", {"cu_seqlens": cu})):
        row = [name]
        pairs = reached_pairs(
            Pattern(segs, dils, causal=True).with_documents(extra.get("cu_seqlens")), n, h
        )
        for backward in (False, True):
            qs, ks, vs = (t.clone().requires_grad_(backward) for t in (q, k, v))
            ms = _time(_step(qs, ks, vs, {**kw, **extra}, backward), a)
            flops = 4 * d * pairs * (3.5 if backward else 1.0)
            row += [f"{ms / 1e3:.2f}", f"{flops / ms / 1e6:.0f}"]
        m = measure.peak_growth_bytes(_step(q, k, v, {**kw, **extra}, False), torch.device("cpu"))
        row.append(f"{(measure.tensor_bytes(q, k, v) + (m or 0)) / MiB:.0f}")
        rows.append(row)
    out += _table(
        [
            "",
            "fwd s",
            "fwd GFLOP/s",
            "fwd+bwd s",
            "fwd+bwd GFLOP/s",
            "fwd peak MiB (inputs + call)",
        ],
        rows,
    )
    out += [
        "",
        f"Checking {a.documents + 1} boundaries (Pattern.with_documents): {check_ms:.2f} ms per "
        "call. The packed sequence reaches fewer keys (nothing crosses a document), so it is "
        "faster; GFLOP/s counts each call's own reached pairs (4·d per pair forward, 3.5x for "
        "forward + backward); its memory is that of the unpacked call.",
    ]
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "llm.md"), "w") as f:
        f.write("\n".join(out) + "\n")
    print("\n".join(out))
    return 0


def _table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return lines


def add_parser(sub) -> None:
    p = sub.add_parser("llm", help="cost of grouped K/V heads and packed documents")
    p.add_argument("--segments", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768],
                   help="segment lengths w_i (LongNet 2048 ... 32768)")  # fmt: skip
    p.add_argument("--dilations", type=int, nargs="+", default=[1, 2, 4, 6, 12],
                   help="dilation rates r_i (1 2 4 6 12)")  # fmt: skip
    p.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 131072],
                   help="n of the bytes table (65536 131072)")  # fmt: skip
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8],
                   help="p of the bytes table (4 8)")  # fmt: skip
    p.add_argument("--heads", type=int, default=32, help="query heads of the bytes table (32)")
    p.add_argument("--kv-heads", type=int, default=8, help="K/V heads of the bytes table (8)")
    p.add_argument("--head-dim", type=int, default=128, help="head_dim of the bytes table (128)")
    p.add_argument("--itemsize", type=int, default=2, help="bytes per element (2: bf16)")
    p.add_argument("--cpu-seq-lens", type=int, nargs="+", default=[8192, 16384],
                   help="n of the CPU GQA timing (8192 16384)")  # fmt: skip
    p.add_argument("--cpu-heads", type=int, default=8, help="query heads on the CPU (8)")
    p.add_argument("--cpu-kv-heads", type=int, default=2, help="K/V heads on the CPU (2)")
    p.add_argument("--cpu-head-dim", type=int, default=64, help="head_dim on the CPU (64)")
    p.add_argument("--doc-seq-len", type=int, default=65536, help="n of the packed run (65536)")
    p.add_argument("--documents", type=int, default=1000, help="documents packed (1000)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (2)")
    p.add_argument("--iters", type=int, default=3, help="timed calls per point (3)")
    p.add_argument("--max-s", type=float, default=120.0, help="stop repeating after (s)")
    p.add_argument(
        "--out-dir",
        default=os.path.join(measure.ROOT, "build", "bench"),
        help="where llm.md goes (build/bench)",
    )
    p.set_defaults(func=cmd_llm)
