"""``bench.py modes``: the ring, Ulysses and the ring x Ulysses hybrid side by
side on ``p`` gloo processes (CPU), and the planner's predictions for them.

    python benchmarks/bench.py modes                      # p = 4: ring 4x1, Ulysses 1x4, hybrid 2x2
    python benchmarks/bench.py modes --seq-len 4096 --kv-heads 4 --iters 5

One launch of ``p`` processes (``ring_attention.parallel.testing.run_distributed``,
one intra-op thread each) runs every mode on the same seeded q, k, v,
round-robin (ring, Ulysses, hybrid, ring, ...), so the modes see the same
machine load. Per mode and rank: the median wall time of a forward (no
grad) and of a forward + backward, the bytes sent per layer (the ring's
exchange events and the all-to-alls' counters), the peak of CPU tensor
bytes of one call (the profiler's allocation events, plus the inputs), and
the error of the gathered output against ``dilated_attention`` on the whole
sequence. Then the planner (``ring_attention.planner.modes``) predicts the
bytes and the peaks of every rank, printed beside the measurements.

On CPU processes sharing a few cores the wall times compare the modes' work
and waiting, not a GPU cluster's links: the planner's ``--mode compare``
makes that prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from .common import write_text

MiB = 2**20


def _grid_kwargs(mode: str, p: int, ulysses: int) -> tuple[dict, int, int]:
    """The call arguments of ``mode`` on this rank, and ``(R, U)``; every
    rank builds every group in the same order."""
    import torch.distributed as dist

    if mode == "ring":
        return {}, p, 1
    if mode == "ulysses":
        return {"ulysses_group": dist.group.WORLD}, 1, p
    U, R = ulysses, p // ulysses
    rank = dist.get_rank()
    rows = [dist.new_group([i * U + j for j in range(U)]) for i in range(R)]
    cols = [dist.new_group([i * U + j for i in range(R)]) for j in range(U)]
    i, j = divmod(rank, U)
    return {"group": cols[j], "ulysses_group": rows[i]}, R, U


def _worker(rank: int, world: int, spec: dict) -> dict:
    import gc

    import torch.distributed as dist

    import ring_attention as ra
    from ring_attention.parallel.exchange import register_exchange_hook
    from ring_attention.parallel.testing import tensor_peak
    from ring_attention.parallel.ulysses import last_all_to_all_stats

    g = torch.Generator().manual_seed(spec["seed"])
    B, n, H, Hkv, D = spec["batch"], spec["n"], spec["heads"], spec["kv_heads"], spec["head_dim"]
    q, go = (torch.randn(B, n, H, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, n, Hkv, D, generator=g) for _ in range(2))
    segs, dils, causal = spec["segments"], spec["dilations"], spec["causal"]
    modes = {m: _grid_kwargs(m, world, spec["ulysses"]) for m in spec["modes"]}
    local = {m: [ra.shard_sequence(t, 1, **kw).contiguous() for t in (q, k, v, go)]
             for m, (kw, _, _) in modes.items()}  # fmt: skip
    ring_sent: dict[str, int] = {}

    def hook(event) -> None:
        ring_sent[event.phase] = ring_sent.get(event.phase, 0) + event.bytes_sent

    def call(mode: str, backward: bool) -> None:
        kw = modes[mode][0]
        ql, kl, vl, gl = local[mode]
        if backward:
            leaves = [t.detach().requires_grad_() for t in (ql, kl, vl)]
            out = ra.ring_dilated_attention(*leaves, segs, dils, causal=causal, **kw)
            torch.autograd.grad(out, leaves, gl)
        else:
            with torch.no_grad():
                ra.ring_dilated_attention(ql, kl, vl, segs, dils, causal=causal, **kw)

    def settle() -> None:
        gc.collect()
        dist.barrier()

    res: dict = {m: {"rank": rank, "local_len": local[m][0].shape[1]} for m in modes}
    for m in modes:  # warm-up, bytes, tensor peaks, check
        call(m, True)
        for backward in (False, True):
            settle()
            ring_sent.clear()
            with register_exchange_hook(hook):
                call(m, backward)
            key = "fb" if backward else "f"
            res[m][f"a2a_{key}"] = last_all_to_all_stats.bytes_sent() if m != "ring" else 0
            res[m][f"ring_{key}"] = sum(ring_sent.values())
            settle()
            inputs = sum(t.numel() * t.element_size() for t in local[m][: 4 if backward else 3])
            res[m][f"peak_{key}"] = inputs + tensor_peak(lambda m=m, b=backward: call(m, b))
        with torch.no_grad():
            out = ra.ring_dilated_attention(*local[m][:3], segs, dils, causal=causal,
                                            **modes[m][0])  # fmt: skip
            full = ra.gather_sequence(out, 1, **modes[m][0])
        if rank == 0:
            with torch.no_grad():
                ref = ra.dilated_attention(q, k, v, segs, dils, causal=causal)
            res[m]["max_abs_err"] = (full - ref).abs().max().item()
        for key in ("f_ms", "fb_ms"):
            res[m][key] = []
    for _ in range(spec["iters"]):  # round-robin timing
        for m in modes:
            for backward, key in ((False, "f_ms"), (True, "fb_ms")):
                settle()
                t0 = time.perf_counter()
                call(m, backward)
                res[m][key].append((time.perf_counter() - t0) * 1e3)
    return res


def _predict(a: argparse.Namespace, R: int, U: int):
    from ring_attention.planner.capacity import Setup
    from ring_attention.planner.modes import evaluate_mode
    from ring_attention.planner.timing import Link

    setup = Setup(
        ranks=a.p, device="cpu", memory=1 << 62, reserve=0, heads=a.heads, kv_heads=a.kv_heads,
        head_dim=a.head_dim, batch=a.batch, dtype="float32", pattern=None,
        segments=tuple(a.segments), dilations=tuple(a.dilations), causal=a.causal,
        link=Link(10.0, 100.0), source="plan",
    )  # fmt: skip
    return evaluate_mode(setup, a.seq_len, R, U)


def cmd_modes(a: argparse.Namespace) -> int:
    from ring_attention.parallel.testing import run_distributed

    if a.p % a.ulysses:
        raise SystemExit(f"--ulysses {a.ulysses} must divide --p {a.p}")
    spec = dict(
        n=a.seq_len, batch=a.batch, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
        segments=list(a.segments), dilations=list(a.dilations), causal=a.causal, seed=0,
        iters=a.iters, ulysses=a.ulysses, modes=["ring", "ulysses", "hybrid"],
    )  # fmt: skip
    t0 = time.perf_counter()
    results = run_distributed(_worker, a.p, spec, timeout=a.timeout_s, threads=a.threads)
    took = time.perf_counter() - t0
    grids = {"ring": (a.p, 1), "ulysses": (1, a.p), "hybrid": (a.p // a.ulysses, a.ulysses)}
    lines = [
        f"ring, Ulysses and hybrid on {a.p} gloo processes ({a.threads} thread each): "
        f"n={a.seq_len} batch={a.batch} heads={a.heads} kv_heads={a.kv_heads} "
        f"head_dim={a.head_dim} segments={list(a.segments)} dilations={list(a.dilations)} "
        f"causal={a.causal} float32; {a.iters} round-robin iterations, {took:.0f} s",
        "",
        "| mode | R x U | fwd ms | fwd+bwd ms | sent/rank fwd+bwd MiB (all-to-all + ring) | "
        "planner MiB | peak fwd / fwd+bwd MiB | planner MiB | max err vs 1 process |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    record: dict = {"spec": spec, "modes": {}}
    for m, (R, U) in grids.items():
        rows = [r[m] for r in results]
        pred = _predict(a, R, U)
        f = max(statistics.median(r["f_ms"]) for r in rows)
        fb = max(statistics.median(r["fb_ms"]) for r in rows)
        sent = max(r["a2a_fb"] + r["ring_fb"] for r in rows)
        a2a = max(r["a2a_fb"] for r in rows)
        ring = max(r["ring_fb"] for r in rows)
        p_sent = pred.worst["sent_forward_backward"]
        peak = max(r["peak_fb"] for r in rows)
        p_peak = pred.worst["training_peak"]
        peak_f = max(r["peak_f"] for r in rows)
        p_peak_f = pred.worst["forward_peak"]
        lines.append(
            f"| {m} | {R} x {U} | {f:.0f} | {fb:.0f} | {sent / MiB:.2f} ({a2a / MiB:.2f} + "
            f"{ring / MiB:.2f}) | {p_sent / MiB:.2f} | {peak_f / MiB:.1f} / {peak / MiB:.1f} | "
            f"{p_peak_f / MiB:.1f} / {p_peak / MiB:.1f} | "
            f"{rows[0]['max_abs_err']:.1e} |"
        )
        record["modes"][m] = {
            "grid": [R, U], "ranks": rows,
            "predicted": [{"sent_f": x.sent_forward, "sent_fb": x.sent_forward_backward,
                           "peak_f": x.forward_peak, "peak_fb": x.training_peak}
                          for x in pred.ranks],
        }  # fmt: skip
    lines += ["", _choice(a, grids, record)]
    lines += [
        "",
        "fwd, fwd+bwd ms: the slowest rank's median wall time; sent: bytes a rank hands to "
        "torch.distributed per layer (worst rank); peak: CPU tensor bytes of one forward "
        "(no grad) / forward + backward with the inputs (worst rank); planner: "
        "ring_attention.planner.modes; the choice: ra.plan_mesh's grid for these ranks",
    ]
    print("\n".join(lines))
    if a.json:
        write_text(a.json, [json.dumps(record)])
    return 0


def _choice(a: argparse.Namespace, grids: dict, record: dict) -> str:
    """``ra.plan_mesh``'s grid for this shape on ``p`` CPU ranks (one node)
    against the measured modes: its fwd+bwd time over the fastest's, and
    each mode's spread over the iterations (the noise)."""
    from ring_attention.core.pattern import Pattern
    from ring_attention.parallel.auto import choose_grid

    pattern = Pattern(list(a.segments), list(a.dilations), causal=a.causal)
    best = choose_grid(a.seq_len, a.heads, a.kv_heads, a.head_dim, pattern, world=a.p,
                       gpus_per_node=a.p, device="cpu", dtype=torch.float32,
                       batch=a.batch)  # fmt: skip
    slowest = {m: [max(it) for it in zip(*(r["fb_ms"] for r in v["ranks"]), strict=True)]
               for m, v in record["modes"].items()}  # fmt: skip
    fb = {m: statistics.median(t) for m, t in slowest.items()}
    chosen = next((m for m, g in grids.items() if g == (best.ring, best.ulysses)), None)
    record["choice"] = {"grid": [best.ring, best.ulysses], "mode": chosen,
                        "predicted_fb_s": best.seconds, "why": best.why}  # fmt: skip
    spread = ", ".join(f"{m} {min(t):.0f}-{max(t):.0f}" for m, t in slowest.items())
    fastest = min(fb, key=fb.get)
    ratio = f"{fb[chosen] / fb[fastest]:.2f}x the fastest ({fastest})" if chosen else "not run"
    return (f"the choice (plan_mesh, {a.p} CPU ranks in one node): {best.ring} x {best.ulysses}"
            f" ({chosen}), predicted {best.seconds * 1e3:.0f} ms fwd+bwd; measured: {ratio}; "
            f"the slowest rank's fwd+bwd ms over the iterations: {spread}")  # fmt: skip


def add_parser(sub) -> None:
    p = sub.add_parser("modes", help="ring, Ulysses and hybrid side by side (gloo, CPU)")
    p.add_argument("--p", type=int, default=4, help="processes (4)")
    p.add_argument("--ulysses", type=int, default=2, help="U of the hybrid (2: 2 x 2)")
    p.add_argument("--seq-len", type=int, default=8192, help="global sequence length (8192)")
    p.add_argument("--segments", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--dilations", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16, help="query heads (16)")
    p.add_argument("--kv-heads", type=int, default=16, help="K/V heads (16)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=3, help="round-robin timed iterations (3)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process (1)")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--json", default=os.environ.get("MODES_JSON"), help="write everything here")
    p.set_defaults(func=cmd_modes)
