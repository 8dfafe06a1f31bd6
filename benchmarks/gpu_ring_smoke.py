"""``bench_gpu.py --ring-smoke``: ``ring_dilated_attention`` (1 process, and
``--ring-world`` gloo processes on one device) against the local op.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from baselines import LONGNET_DILATIONS, LONGNET_SEGMENTS
from gpu_timing import rel_err, short_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ring_case(rank: int, world: int, spec: dict) -> dict:
    import ring_attention as ra
    from ring_attention.ring import ring_dilated_attention
    from ring_attention.sharding import layout_pieces

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, spec["dtype"])
    n, h, d = spec["n"], spec["heads"], spec["dim"]
    segs, dils, causal, layout = spec["segs"], spec["dils"], spec["causal"], spec["layout"]
    gen = torch.Generator().manual_seed(spec["seed"])
    full = [torch.randn(1, n, h, d, generator=gen).to(device, dtype) for _ in range(4)]
    q, k, v = (t.clone().requires_grad_() for t in full[:3])
    ref = ra.dilated_attention(q, k, v, segs, dils, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), full[3])
    pieces = layout_pieces(n, world, rank, layout)

    def shard(x):
        return torch.cat([x.narrow(1, p.start, p.length) for p in pieces], dim=1)

    ql, kl, vl = (shard(t).detach().clone().requires_grad_() for t in full[:3])
    out = ring_dilated_attention(ql, kl, vl, segs, dils, causal=causal, layout=layout)
    grads = torch.autograd.grad(out, (ql, kl, vl), shard(full[3]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    errs = {"out": rel_err(out, shard(ref.detach()))}
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        errs[name] = rel_err(a, shard(b))
    return errs


def _ring_worker(rank: int, world: int, specs: list[dict]) -> list[dict]:
    return [_ring_case(rank, world, s) for s in specs]


def ring_smoke(args) -> int:
    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    if cuda:
        n, h, d = 8192, 12, 64
        segs, dils = list(LONGNET_SEGMENTS[:3]), list(LONGNET_DILATIONS[:3])
        dtypes = ["float32", "bfloat16"]
    else:
        n, h, d = 1536, 6, 32
        segs, dils = [128, 256, 1024], [1, 2, 4]
        dtypes = ["float32"]
    tol = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 5e-3}
    specs = [
        dict(
            device=device,
            dtype=dt,
            n=n,
            heads=h,
            dim=d,
            segs=segs,
            dils=dils,
            causal=causal,
            layout=layout,
            seed=7,
        )
        for dt in dtypes
        for causal in (False, True)
        for layout in ("contiguous", "zigzag")
    ]
    print(f"ring smoke on {device}: n={n} h={h} d={d} segments={segs} dilations={dils}")
    print("| world | dtype | causal | layout | out | dq | dk | dv | ok |")
    print("|---:|---|---|---|---:|---:|---:|---:|---|")
    failed = 0

    def report(world, results):
        nonlocal failed
        for s, errs in zip(specs, results, strict=True):
            good = all(e <= tol[s["dtype"]] for e in errs.values())
            failed += not good
            es = " | ".join(f"{errs[k]:.2e}" for k in ("out", "dq", "dk", "dv"))
            print(
                f"| {world} | {s['dtype']} | {s['causal']} | {s['layout']} | {es} | "
                f"{'ok' if good else '**FAIL**'} |",
                flush=True,
            )

    t0 = time.perf_counter()
    try:
        report(1, _ring_worker(0, 1, specs))
    except Exception as exc:
        print(f"world 1: error {short_error(exc, 500)}")
        failed += 1
    if args.ring_world > 1:
        try:
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from dist_utils import run_distributed

            res = run_distributed(_ring_worker, args.ring_world, specs, timeout=240.0)
            for rank, rr in enumerate(res):
                print(f"(rank {rank})")
                report(args.ring_world, rr)
        except Exception as exc:
            print(f"world {args.ring_world} (gloo, one device): error {short_error(exc, 2000)}")
            failed += 1
    print(
        f"ring smoke: {'PASS' if not failed else f'{failed} FAILED'} "
        f"(rel. tolerance fp32 {tol['float32']:g}, bf16 {tol['bfloat16']:g}; "
        f"{time.perf_counter() - t0:.0f} s)"
    )
    return 1 if failed else 0
