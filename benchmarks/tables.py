"""``bench.py bytes`` (bytes a rank sends per layer, from the exchange plans)
and ``bench.py check`` (every method against a reference)."""

from __future__ import annotations

import argparse
import math
import os

import torch

from . import measure, methods
from .common import dtype_name, md_table, resolve_device, resolve_dtype, write_text
from .measure import MiB


# --------------------------------------------------------------------------- #
# bench.py bytes: from the exchange plans only
# --------------------------------------------------------------------------- #
def longnet_to(n: int, w0: int = 512) -> tuple[list[int], list[int]]:
    """LongNet grown to ``n``: segments ``w0 * 4**i < n`` and ``n``, dilations
    ``w / w0`` (every branch reaches ``w0`` keys per query)."""
    segs = [w0 * 4**i for i in range(32) if w0 * 4**i < n] + [n]
    return segs, [max(1, w // w0) for w in segs]


def max_sent(n: int, p: int, a: argparse.Namespace, segs, dils, causal: bool) -> tuple[int, int]:
    """Max over ranks of the bytes sent per layer (fwd, fwd+bwd)."""
    best = (0, 0)
    for rank in range(p):
        b = methods.plan_bytes_sent(
            n,
            a.heads,
            segs,
            dils,
            causal=causal,
            head_groups=False,
            layout="contiguous",
            batch=1,
            head_dim=a.head_dim,
            itemsize=4,
            world=p,
            rank=rank,
        )
        best = (max(best[0], b[0]), max(best[1], b[1]))
    return best


def cmd_bytes(a: argparse.Namespace) -> int:
    segs, dils = list(a.segments), list(a.dilations)
    cases = [
        ("pattern", lambda n: (segs, dils), False),
        ("grown to n", longnet_to, False),
        ("dense causal", lambda n: ([n], [1]), True),
    ]
    hdr = [f"{name} {p}" for name, _, _ in cases for p in ("fwd", "fwd+bwd")]
    out = [
        f"# Bytes a rank sends per layer (MiB, max over ranks, exchange plans; float32, "
        f"batch 1, {a.heads} heads, head_dim {a.head_dim}; pattern = segments {segs}, "
        f"dilations {dils}; grown to n = segments 512·4^i and n, w/r = 512)",
        "",
        f"## vs n at p = {a.p}",
        "",
    ]
    rows = []
    for n in a.seq_lens:
        vals = [x / MiB for _, pat, causal in cases for x in max_sent(n, a.p, a, *pat(n), causal)]
        rows.append([n, n // a.p, *(f"{x:.2f}" for x in vals)])
    out += md_table(["n", "shard", *hdr], rows) + ["", f"## vs n at shard = {a.shard}", ""]
    rows = []
    for p in a.worlds:
        n = a.shard * p
        vals = [x / MiB for _, pat, causal in cases for x in max_sent(n, p, a, *pat(n), causal)]
        rows.append([n, p, *(f"{x:.2f}" for x in vals)])
    out += md_table(["n", "p", *hdr], rows)
    bound = 2 * a.heads * sum(w // r for w, r in zip(segs, dils, strict=True)) * a.head_dim * 4
    out += [
        "",
        f"The pattern's bound 2·heads·Σ(w/r)·d·4 B = {bound / MiB:.2f} MiB per layer "
        "forward, whatever n and p.",
    ]
    write_text(os.path.join(a.out_dir, "bytes.md"), out)
    print("\n".join(out))
    return 0


# --------------------------------------------------------------------------- #
# bench.py check
# --------------------------------------------------------------------------- #
CHECK_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def cmd_check(a: argparse.Namespace) -> int:
    """Every method (and CUDA SDPA backend) vs gather+SDPA in a wider dtype,
    and the analytic FlexAttention block masks vs ``create_block_mask``."""
    import warnings

    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, device)
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    n = a.n or (10240 if device.type == "cuda" else 1000)
    segs = a.segments or (
        list(methods.LONGNET_SEGMENTS) if device.type == "cuda" else [128, 384, 1024]
    )
    dils = a.dilations or (list(methods.LONGNET_DILATIONS) if device.type == "cuda" else [1, 3, 8])
    tol = CHECK_TOL[dtype]
    a.methods = a.methods or methods.default_methods(device)
    print(
        f"check on {device.type}: n={n}, {dtype_name(dtype)} vs gather+SDPA in "
        f"{dtype_name(ref_dtype)}, segments {segs}, dilations {dils}; rel. error, "
        f"tolerance {tol:g}"
    )
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    bad: list[str] = []
    rows = []
    gen = torch.Generator().manual_seed(1234)
    for h, d in a.configs:
        base = [torch.randn(1, n, h, d, generator=gen) for _ in range(4)]
        for causal in (False, True):
            meth = methods.Methods(segs, dils, causal, device, flex_compiled=not a.flex_eager)
            leaves = [t.to(device, ref_dtype).requires_grad_() for t in base[:3]]
            ro, rl = methods.gather_sdpa_dilated(*leaves, segs, dils, causal, return_lse=True)
            rgrads = torch.autograd.grad(ro, leaves, base[3].to(device, ref_dtype))
            for m in a.methods:
                if m == "dense" and not meth.dense_is_pattern(n):
                    continue
                skip = meth.unsupported(m, False)
                if skip:
                    print(f"  {h}x{d} causal={causal} {m}: not run: {skip}", flush=True)
                    continue
                for backend in meth.backends(m, methods.SDPA_BACKENDS):
                    name = m + (f"[{backend}]" if backend else "")
                    bwd = meth.unsupported(m, True) is None
                    try:
                        x = [t.to(device, dtype).requires_grad_(bwd) for t in base[:3]]
                        with torch.set_grad_enabled(bwd):
                            out, lse = meth.call(m, backend, *x, return_lse=True)
                        errs = [
                            measure.rel_err(out, ro),
                            measure.rel_err(lse, rl) if lse is not None else math.nan,
                        ]
                        if bwd:
                            g = torch.autograd.grad(out, x, base[3].to(device, dtype))
                            errs += [measure.rel_err(u, w) for u, w in zip(g, rgrads, strict=True)]
                        else:
                            errs += [math.nan] * 3
                        ok = all(e <= tol for e in errs if not math.isnan(e))
                        cells = [f"{e:.1e}" if not math.isnan(e) else "n/a" for e in errs]
                    except Exception as exc:  # reported as a failure
                        ok, cells = False, [measure.short_error(exc, 60)] + [""] * 4
                        if measure.is_fatal(exc):
                            raise
                    if not ok:
                        bad.append(f"{name} {h}x{d} causal={causal}")
                    rows.append([f"{h}x{d}", causal, name, *cells, "ok" if ok else "FAIL"])
                    print(
                        f"  {h}x{d} causal={causal} {name}: {' '.join(cells)} "
                        f"{'ok' if ok else 'FAIL'}",
                        flush=True,
                    )
    lines = md_table(
        ["heads x dim", "causal", "method", "out", "lse", "dq", "dk", "dv", "ok"],
        rows,
        "rll" + "r" * 5 + "l",
    )
    if "flex" in a.methods:
        lines += ["", *check_block_masks(device, bad)]
    print("\n".join(["", *lines]))
    print("n/a: not available (FlexAttention on the CPU has no backward, compiled no LSE)")
    print("check: " + ("PASS" if not bad else "FAILED: " + "; ".join(bad)))
    return 1 if bad else 0


def check_block_masks(device: torch.device, bad: list[str]) -> list[str]:
    """The analytic block masks against ``create_block_mask`` (ragged sizes too)."""
    out = []
    for n in (1000, 1280):
        for segs, dils in (
            ([128, 256, 512], [1, 2, 4]),
            ([384, 1024], [1, 6]),
            ([100, 2048], [1, 12]),
            ([1024], [1]),
        ):
            for causal in (False, True):
                ours = methods.flex_block_state(n, segs, dils, causal, device)
                ref = methods.reference_block_state(n, 12, segs, dils, causal, device)
                # never skip a reached block; never call a block full that is not
                if not (((ref > 0) <= (ours > 0)).all() and ((ours == 2) <= (ref == 2)).all()):
                    bad.append(f"block mask n={n} {segs} {dils} causal={causal}")
    out.append(
        "flex block masks vs create_block_mask: "
        + ("ok" if not any(b.startswith("block mask") for b in bad) else "MISMATCH")
    )
    return out
