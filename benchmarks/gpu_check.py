"""``bench_gpu.py --check``: every method (and SDPA backend) against
gather + SDPA in float32 (float64 on CPU), and the analytic FlexAttention block
masks against ``create_block_mask``.
"""

from __future__ import annotations

import math

import torch
from baselines import gather_sdpa_dilated
from gpu_baselines import Methods, branch_block_mask, dense_blocks, flex_module, make_mask_mod
from gpu_plan import DTYPES, FLEX_BLOCK
from gpu_timing import free_memory, is_fatal, rel_err, short_error


def check_block_masks(args, device) -> list[str]:
    """Analytic BlockMask == create_block_mask's (partial and full blocks)."""
    fa = flex_module()
    lines = []
    heads = 12
    for n in (1024, 1280, 4096):
        for w, r in ((128, 1), (256, 2), (512, 4), (384, 3), (1024, 6), (2048, 12), (8192, 2)):
            for causal in (False, True):
                ours = branch_block_mask(n, heads, w, r, causal, device)
                ref = fa.create_block_mask(
                    make_mask_mod(w, r, causal, device), None, heads, n, n, device=device
                )
                nb = n // FLEX_BLOCK
                for part in ("kv", "full_kv"):
                    a = dense_blocks(
                        getattr(ours, f"{part}_num_blocks"), getattr(ours, f"{part}_indices"), nb
                    )
                    b = dense_blocks(
                        getattr(ref, f"{part}_num_blocks"), getattr(ref, f"{part}_indices"), nb
                    )
                    a = a.expand_as(b)
                    if not torch.equal(a, b):
                        lines.append(
                            f"block mask MISMATCH n={n} w={w} r={r} causal={causal} ({part})"
                        )
    lines.append(
        "block masks: analytic == create_block_mask" if not lines else "block masks: MISMATCH"
    )
    return lines


def run_check(args, device, meth: Methods, methods=None) -> tuple[list[str], dict[str, bool]]:
    """Every method (and SDPA backend) against gather+SDPA in float32 (float64 on CPU).

    ``methods``: which (default ``args.methods``); "ours" is always run first,
    for the "out vs ours" column. Returns the markdown lines and
    {method[backend]: ok}.
    """
    methods = list(args.methods if methods is None else methods)
    if "ours" not in methods:
        methods.insert(0, "ours")
    dtype = DTYPES[args.dtype] if device.type == "cuda" else torch.float32
    ref_dtype = torch.float32 if device.type == "cuda" else torch.float64
    tol_out, tol_grad = (1.5e-2, 3e-2) if dtype in (torch.bfloat16, torch.float16) else (1e-4, 1e-4)
    n = args.check_n
    lines = [
        f"### check: n={n}, {str(dtype).replace('torch.', '')} vs gather+SDPA in "
        f"{str(ref_dtype).replace('torch.', '')}, ‖x - ref‖ / ‖ref‖ "
        f"(tolerance out {tol_out:g}, grads {tol_grad:g}); 'out vs ours': the same "
        "measure against ra.dilated_attention in the same dtype",
        "",
        "| h | d | method | out | lse | dq | dk | dv | out vs ours | ok |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    ok: dict[str, bool] = {}
    gen = torch.Generator(device="cpu").manual_seed(1234)
    dense_pattern = len(meth.segs) == 1 and meth.dils[0] == 1 and meth.segs[0] >= n
    for h, d in args.configs:
        shape = (1, n, h, d)
        base = [torch.randn(shape, generator=gen) for _ in range(4)]
        qr, kr, vr = (t.to(device, ref_dtype).requires_grad_() for t in base[:3])
        gr = base[3].to(device, ref_dtype)
        ro, rl = gather_sdpa_dilated(
            qr, kr, vr, meth.segs, meth.dils, causal=meth.causal, return_lse=True
        )
        rgrads = torch.autograd.grad(ro, (qr, kr, vr), gr)
        ours_out = None
        for m in methods:
            if m == "dense" and not dense_pattern:
                continue
            for backend in meth.backends(m):
                name = f"{m}[{backend}]" if backend else m
                row = [str(h), str(d), name]
                try:
                    do_bwd = not (m == "flex" and device.type != "cuda")  # no CPU flex bwd
                    q, k, v = (t.to(device, dtype).requires_grad_(do_bwd) for t in base[:3])
                    g = base[3].to(device, dtype)
                    with torch.set_grad_enabled(do_bwd):
                        if m == "dense":
                            out, lse = meth.call(m, backend, q, k, v), None
                        else:
                            out, lse = meth.call(m, backend, q, k, v, return_lse=True)
                    errs = [rel_err(out, ro)]
                    errs.append(rel_err(lse, rl) if lse is not None else float("nan"))
                    if do_bwd:
                        grads = torch.autograd.grad(out, (q, k, v), g)
                        errs += [rel_err(a, b) for a, b in zip(grads, rgrads, strict=True)]
                    else:
                        errs += [float("nan")] * 3
                    good = errs[0] <= tol_out and all(
                        e <= tol_grad for e in errs[1:] if not math.isnan(e)
                    )
                    if m == "ours":
                        ours_out = out.detach()
                        errs.append(float("nan"))
                    else:
                        errs.append(
                            rel_err(out, ours_out) if ours_out is not None else float("nan")
                        )
                    row += [f"{e:.2e}" if not math.isnan(e) else "—" for e in errs]
                    row.append("ok" if good else "**FAIL**")
                except Exception as exc:
                    good = False
                    row += ["—"] * 6 + [f"**error** {short_error(exc)}"]
                    if is_fatal(exc):
                        lines.append("| " + " | ".join(row) + " |")
                        raise
                ok[name] = ok.get(name, True) and good
                line = "| " + " | ".join(row) + " |"
                lines.append(line)
                print(line, flush=True)
        del qr, kr, vr, gr, ro, rl, rgrads, ours_out
        free_memory(device)
    if "flex" in methods:
        try:
            bm_lines = check_block_masks(args, device)
        except Exception as exc:
            bm_lines = [f"block masks: error {short_error(exc)}"]
        ok["flex-block-mask"] = bm_lines[-1].endswith("create_block_mask")
        for s in bm_lines:
            print(s, flush=True)
        lines += ["", *bm_lines]
    return lines, ok
