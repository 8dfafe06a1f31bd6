"""The ring's dense blocks on a GPU: checked, then timed against the dense
backend called directly on the same shards.

Run by ``scripts/gpu_check.sh --stages build,ringdense`` (torchrun, one
process per GPU; a lone process is a ring of one), or by hand::

    torchrun --nproc-per-node=1 -m benchmarks.ring_dense_check --device cuda --out OUT
    python -m benchmarks.ring_dense_check --dry-run --out OUT   # CPU, toy sizes, no GPU

Per rank and shape: ``check`` (the ring's out and q/k/v gradients with the
dense route forced, ``RING_ATTENTION_FORWARD/BACKWARD=dense``, against our
kernels forced and against SDPA in float32 on the whole sequence), then
``time`` (forward and forward+backward, median of ``--repeats``, the methods
round-robin in one run): ``ring_dense`` and ``ring_kernel`` (the ring both
ways; ``ring_kernel`` only up to ``--kernel-max-n`` rows, since our kernels'
ring at 131072 causal rows, 32 x 128, takes seconds a pass) and ``direct``
(the backend the dense route takes, called on this rank's blocks: the
diagonal causal, the others full; no exchange, no merge). Rank 0 prints each
record as it is made; ``OUT/ring_dense_rank<r>.jsonl`` gets every record as
it is made, and a table is printed at the end.

Then (rank 0) ``dilated``: the ring's dilated blocks (segments crossing the
pieces) of LongNet's pattern (the planner's ``longnet-paper``: segments 2048
... 32768, dilations 1, 2, 4, 6, 12), causal and not, at ``--dilated-configs``
(heads x head dim), global n 131072 over 8 virtual ranks (contiguous pieces of
16384): the last rank's blocks (its own piece and every earlier piece some
query reaches, the pieces the ring would send; no exchange) run by ``Blocks``
with the dense route forced (``route_blocks``' backend) and with our block
kernels forced. Out, lse and the q/k/v gradients are checked dense against
kernel, then forward and forward+backward timed (median of 3, round-robin):
one record a method and pass with the ratio dense / kernel and the dense calls
a pass, the figure that decides whether ``auto`` takes these blocks
(``dispatch.DILATED_AUTO``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ring_attention.core import config
from ring_attention.core.call import Call
from ring_attention.core.dtypes import acc_dtype
from ring_attention.core.pattern import Pattern
from ring_attention.local import backends, ops
from ring_attention.local.block_calls import block_calls, block_kind
from ring_attention.local.blocks import Blocks
from ring_attention.local.dispatch import route_blocks
from ring_attention.parallel.api import ring_dilated_attention
from ring_attention.parallel.sharding import layout_pieces, shard_sequence
from ring_attention.planner.presets import PATTERNS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _modes(mode: str) -> None:
    os.environ[config.FORWARD] = os.environ[config.BACKWARD] = mode


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(shape, dtype, device, seed):
    B, n, H, Hk, D = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, H, D, generator=g)
    k, v = (torch.randn(B, n, Hk, D, generator=g) for _ in range(2))
    go = torch.randn(B, n, H, D, generator=g)
    return [t.to(device, dtype) for t in (q, k, v, go)]


def _ring(q, k, v, n, causal, layout, mode, go=None):
    _modes(mode)
    leaves = [t.detach().requires_grad_(go is not None) for t in (q, k, v)]
    out = ring_dilated_attention(*leaves, [n], [1], causal=causal, layout=layout)
    if go is not None:
        out.backward(go)
    return [out.detach()] + [t.grad for t in leaves if go is not None]


def check(shape, dtype, device, causal, layout, world, rank) -> dict:
    """Dense route against our kernels and against float32 SDPA."""
    _, n, H, Hk, _ = shape
    q, k, v, go = _inputs(shape, dtype, device, 1)
    shard = [shard_sequence(t, layout=layout) for t in (q, k, v, go)]
    dense = _ring(*shard[:3], n, causal, layout, "dense", shard[3])
    kernel = _ring(*shard[:3], n, causal, layout, "kernel", shard[3])
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    rep = H // Hk
    ref = torch.nn.functional.scaled_dot_product_attention(
        leaves[0].transpose(1, 2),
        leaves[1].repeat_interleave(rep, 2).transpose(1, 2),
        leaves[2].repeat_interleave(rep, 2).transpose(1, 2),
        is_causal=causal,
    ).transpose(1, 2)
    ref.backward(go.float())
    full = [ref.detach()] + [t.grad for t in leaves]
    mine = [shard_sequence(t, layout=layout) for t in full]
    err = {
        f"{name}_vs_{other}": (a.float() - b.float()).abs().max().item()
        for other, ref_ in (("kernel", kernel), ("sdpa32", mine))
        for name, a, b in zip(("out", "dq", "dk", "dv"), dense, ref_, strict=True)
    }
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    status = "ok" if all(e <= tol for e in err.values()) else "FAIL"
    return {"stage": "check", "status": status, "tol": tol, **err}


def _direct(shape, dtype, device, causal, layout, world, rank, name):
    """This rank's blocks on backend ``name`` (forward, forward+backward)."""
    B, n, H, Hk, D = shape
    q, k, v, go = _inputs(shape, dtype, device, 2)
    scale = D**-0.5
    calls = []
    for qp in layout_pieces(n, world, rank, layout):
        for r in range(world):
            for kp in layout_pieces(n, world, r, layout):
                kind = block_kind(causal, qp.start, qp.length, kp.start, kp.length)
                if kind in (None, "skip"):
                    continue
                qs, ks = (
                    slice(qp.start, qp.start + qp.length),
                    slice(kp.start, kp.start + kp.length),
                )
                calls.append((q[:, qs], k[:, ks], v[:, ks], go[:, qs], kind == "causal"))
    be = backends.backend(name)
    acc = torch.float32

    def fwd():
        for qb, kb, vb, _, c in calls:
            o = torch.empty(B, H, qb.shape[1], D, dtype=dtype, device=device)
            lse = torch.empty(B, H, qb.shape[1], dtype=acc, device=device)
            be.forward(qb, kb, vb, c, scale, o, lse)

    def fwdbwd():
        for qb, kb, vb, gb, c in calls:
            lq, lk = qb.shape[1], kb.shape[1]
            o = torch.empty(B, H, lq, D, dtype=dtype, device=device)
            lse = torch.empty(B, H, lq, dtype=acc, device=device)
            be.forward(qb, kb, vb, c, scale, o, lse)
            gq = torch.empty(B, H, lq, D, dtype=dtype, device=device)
            gk, gv = (torch.empty(B, Hk, lk, D, dtype=dtype, device=device) for _ in range(2))
            be.backward(gb, qb, kb, vb, o.transpose(1, 2), lse, c, scale, gq, gk, gv)

    return fwd, fwdbwd


def timing(shape, dtype, device, causal, layout, world, rank, repeats, kernel_max_n):
    """Median seconds per method and pass, the methods round-robin."""
    n = shape[1]
    q, k, v, go = (shard_sequence(t, layout=layout) for t in _inputs(shape, dtype, device, 3))
    pattern = Pattern([n], [1], causal=causal)
    _modes("dense")
    route = route_blocks("forward", q, k, pattern, n, (0, n), 1)
    name = route.backends[0][0] if route.dense else None
    methods = {
        "ring_dense": (
            lambda: _ring(q, k, v, n, causal, layout, "dense"),
            lambda: _ring(q, k, v, n, causal, layout, "dense", go),
        ),
    }
    if n <= kernel_max_n:
        methods["ring_kernel"] = (
            lambda: _ring(q, k, v, n, causal, layout, "kernel"),
            lambda: _ring(q, k, v, n, causal, layout, "kernel", go),
        )
    if name is not None:
        methods["direct"] = _direct(shape, dtype, device, causal, layout, world, rank, name)
    samples = {(m, p): [] for m in methods for p in ("fwd", "fwdbwd")}
    for i in range(repeats + 1):  # the first round warms up
        for m, fns in methods.items():
            for p, fn in zip(("fwd", "fwdbwd"), fns, strict=True):
                if world > 1:
                    dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                if i:
                    samples[(m, p)].append(time.perf_counter() - t0)
    return [
        {"stage": "time", "method": m, "pass": p, "backend": name, "median_s": statistics.median(s)}
        for (m, p), s in samples.items()
    ]


# --------------------------------------------------------------------------- #
# the ring's dilated blocks, one virtual rank's, dense route against our kernels
# --------------------------------------------------------------------------- #
DILATED_N, DILATED_P = 131072, 8  # global length, virtual ranks (contiguous pieces)
DILATED_SCALE = 256  # the dry run's divisor of the lengths (n 512, segments 8 ... 128)
DILATED_REPEATS = 3  # timed rounds (the check warms both methods up)


class _Counting:
    """A dense backend counting its calls."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def forward(self, *args) -> None:
        self.calls += 1
        self.inner.forward(*args)

    def backward(self, *args) -> None:
        self.calls += 1
        self.inner.backward(*args)


def _dilated_blocks(pattern: Pattern, n: int, world: int, heads: int) -> list[tuple[int, int]]:
    """``(q_start, k_start)`` of the last virtual rank's blocks (pieces of ``n // world``): its
    own and every earlier piece some query reaches (the pieces the ring sends it)."""
    piece, q0 = n // world, n - n // world
    return [(q0, r * piece) for r in range(world)
            if block_calls(pattern, heads, heads, q0, piece, r * piece, piece) != ()]  # fmt: skip


def _dilated_pass(fwd: Blocks, bwd: Blocks | None, blocks, q, ks, vs, go) -> list[torch.Tensor]:
    """The rank's pass over ``blocks`` as the ring runs it: the forward's ``[out, lse]`` (the
    accumulation dtype), with ``bwd`` also ``dq`` and each block's ``dk``, ``dv``."""
    B, L, H, D = q.shape
    acc = acc_dtype(q.dtype)
    out = torch.zeros(B, L, H, D, dtype=acc, device=q.device)
    lse = torch.full((B, H, L), -math.inf, dtype=acc, device=q.device)
    for (q0, k0), k, v in zip(blocks, ks, vs, strict=True):
        fwd.forward(q, k, v, out, lse, q0, k0)
    if bwd is None:
        return [out, lse]
    o = out.to(q.dtype)
    dq = torch.zeros_like(out)
    dks = [torch.zeros(k.shape, dtype=acc, device=k.device) for k in ks]
    dvs = [torch.zeros_like(d) for d in dks]
    for (q0, k0), k, v, dk, dv in zip(blocks, ks, vs, dks, dvs, strict=True):
        bwd.backward(go, None, q, k, v, o, lse, dq, dk, dv, q0, k0)
    return [out, lse, dq, *dks, *dvs]


def _rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (rows -inf on both sides equal)."""
    a, b = a.double(), b.double()
    both = torch.isneginf(a) & torch.isneginf(b)
    diff = torch.where(both, 0.0, a - b).abs().max().item()
    return diff / max(torch.where(both, 0.0, b).abs().max().item(), 1e-30)


def dilated(config_: str, causal: bool, dtype, device, repeats: int, dry: bool) -> list[dict]:
    """The last virtual rank's dilated blocks of LongNet's pattern, dense route against our
    kernels: a ``dilated_check`` record, then a ``dilated`` record a method and pass."""
    H, D = (int(x) for x in config_.split("x"))
    scale = DILATED_SCALE if dry else 1
    n, world = DILATED_N // scale, DILATED_P
    segs, dils = PATTERNS["longnet-paper"][1](DILATED_N)
    pattern = Pattern([w // scale for w in segs], dils, causal=causal)
    piece = n // world
    blocks = _dilated_blocks(pattern, n, world, H)
    g = torch.Generator().manual_seed(4)
    q, go = (torch.randn(1, piece, H, D, generator=g).to(device, dtype) for _ in range(2))
    ks, vs = ([torch.randn(1, piece, H, D, generator=g).to(device, dtype) for _ in blocks]
              for _ in range(2))  # fmt: skip
    call = Call(pattern, D**-0.5)
    args = ops.op_args(call, device)
    bounds = tuple(range(0, n + 1, piece))
    _modes("dense")  # the route the ring's passes take with the dense mode forced
    routes = [route_blocks(p, q, ks[0], pattern, n, bounds, piece) for p in ("forward", "backward")]
    where = {"config": config_, "causal": causal, "n": n, "p": world, "virtual_rank": world - 1,
             "blocks": len(blocks), "segments": pattern.segment_lengths,
             "dilations": pattern.dilation_rates}  # fmt: skip
    if not all(r.dense for r in routes):
        why = "; ".join(r.why for r in routes if not r.dense)
        return [{"stage": "dilated_check", **where, "status": "FAIL", "why": why}]
    dense = [Blocks(call, args, r) for r in routes]
    counters = []
    for b in dense:
        b.each_block = False  # the ring's one K/V check a pass covers the blocks
        b.backend = _Counting(b.backend)
        counters.append(b.backend)
    kernel = Blocks(call, args, None)
    planned = sum(len(block_calls(pattern, H, H, q0, piece, k0, piece) or ())
                  for q0, k0 in blocks)  # fmt: skip
    got = _dilated_pass(dense[0], dense[1], blocks, q, ks, vs, go)
    calls = {"forward": counters[0].calls, "backward": counters[1].calls}
    want = _dilated_pass(kernel, kernel, blocks, q, ks, vs, go)
    names = ["out", "lse", "dq"] + [f"{x}{i}" for x in ("dk", "dv") for i in range(len(blocks))]
    err = {name: _rel_error(a, b) for name, a, b in zip(names, got, want, strict=True)}
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # every planned call ran densely (a block falling back to our kernel calls none)
    ok = all(e <= tol for e in err.values()) and calls == {"forward": planned,
                                                           "backward": planned}  # fmt: skip
    status = "ok" if ok else "FAIL"
    backend = routes[0].backends[0][0]
    records = [{"stage": "dilated_check", **where, "status": status, "tol": tol,
                "planned_calls": planned, "dense_calls": calls, "backend": backend,
                "max_rel_error": err}]  # fmt: skip
    methods = {
        "dense": (lambda: _dilated_pass(dense[0], None, blocks, q, ks, vs, go),
                  lambda: _dilated_pass(dense[0], dense[1], blocks, q, ks, vs, go)),
        "kernel": (lambda: _dilated_pass(kernel, None, blocks, q, ks, vs, go),
                   lambda: _dilated_pass(kernel, kernel, blocks, q, ks, vs, go)),
    }  # fmt: skip
    samples = {(m, p): [] for m in methods for p in ("fwd", "fwdbwd")}
    for _ in range(repeats):  # (the check warmed both up)
        for m, fns in methods.items():
            for p, fn in zip(("fwd", "fwdbwd"), fns, strict=True):
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                samples[(m, p)].append(time.perf_counter() - t0)
    ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    for (m, p), t in ms.items():
        records.append({"stage": "dilated", "method": m, "pass": p, **where, "ms": t,
                        "ratio": ms[("dense", p)] / ms[("kernel", p)], "status": status,
                        "dense_calls": planned * (1 if p == "fwd" else 2),
                        "backend": backend if m == "dense" else "kernel"})  # fmt: skip
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--out", type=Path, default=Path("/tmp/ring_dense_check"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--check-n", type=int, default=4099, help="length of the check (ragged)")
    shapes = ["1x32768x16x16x128", "1x131072x12x12x64", "1x131072x16x16x128", "1x131072x32x8x128"]
    ap.add_argument("--shapes", nargs="+", default=shapes, help="B x n x H x Hkv x D each")
    ap.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag"])
    ap.add_argument("--kernel-max-n", type=int, default=32768,
                    help="time our kernels' ring only up to this many rows")  # fmt: skip
    ap.add_argument(
        "--dilated-configs",
        nargs="*",
        default=["16x128", "12x64"],
        help="heads x head dim of the dilated blocks' points (none: skipped)",
    )
    ap.add_argument("--dry-run", action="store_true", help="the CPU, toy sizes (no GPU)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.dtype, args.check_n = "cpu", "fp32", 67
        args.shapes, args.repeats, args.dilated_configs = ["1x96x4x2x16"], 1, ["2x16"]
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(
                int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            )
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("gloo")  # ranks may share one GPU
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / f"ring_dense_rank{rank}.jsonl"
    jsonl.write_text("")
    rows = []

    def emit(r: dict) -> None:
        r.update(rank=rank, world=world, device=str(device), dtype=args.dtype, layout=args.layout)
        if device.type == "cuda":
            r["gpu"] = torch.cuda.get_device_name(device)
        rows.append(r)
        with jsonl.open("a") as f:
            f.write(json.dumps(r) + "\n")
        if rank == 0:
            print(json.dumps(r), flush=True)

    for causal in (True, False):
        c = check((2, args.check_n, 4, 2, 64 if device.type == "cuda" else 16), dtype, device,
                  causal, args.layout, world, rank)  # fmt: skip
        emit({"causal": causal, "n": args.check_n, **c})
    for spec in args.shapes:
        shape = tuple(int(x) for x in spec.split("x"))
        for r in timing(shape, dtype, device, True, args.layout, world, rank, args.repeats,
                        args.kernel_max_n):  # fmt: skip
            emit({"causal": True, "shape": spec, **r})
    if rank == 0:  # one process: no ring
        for cfg in args.dilated_configs:
            for causal in (True, False):
                for r in dilated(cfg, causal, dtype, device, DILATED_REPEATS, args.dry_run):
                    emit(r)
    if rank == 0:
        for r in rows:
            if r["stage"] == "check":
                print(f"check causal={r['causal']} n={r['n']}: {r['status']} "
                      f"(max err {max(v for k_, v in r.items() if '_vs_' in k_):.3g})")  # fmt: skip
        base = {(r["shape"], r["pass"]): r["median_s"] for r in rows if r.get("method") == "direct"}
        print("| shape | pass | method | backend | median ms | / direct |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if r["stage"] == "time":
                d = base.get((r["shape"], r["pass"]))
                ratio = f"{r['median_s'] / d:.2f}" if d else "-"
                print(f"| {r['shape']} | {r['pass']} | {r['method']} | {r['backend']} | "
                      f"{r['median_s'] * 1e3:.2f} | {ratio} |")  # fmt: skip
        print("| dilated | causal | pass | dense ms | kernel ms | dense / kernel | dense calls |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            if r["stage"] == "dilated_check" and r["status"] != "ok":
                print(f"| {r['config']} | {r['causal']} | check FAIL: {r.get('why', r)} |")
            if r["stage"] == "dilated" and r["method"] == "dense":
                k_ms = r["ms"] / r["ratio"]
                print(f"| {r['config']} n={r['n']} p={r['p']} | {r['causal']} | {r['pass']} | "
                      f"{r['ms']:.2f} | {k_ms:.2f} | {r['ratio']:.2f} | {r['dense_calls']} "
                      f"({r['backend']}) |")  # fmt: skip
    failed = any(r.get("status") == "FAIL" for r in rows)
    if world > 1:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
