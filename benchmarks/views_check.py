"""The GPU check of the dense per-branch path (ring_attention/local/branches.py), in
one process, within a time budget (``scripts/gpu_check.sh --stages views``):

* ``check``: out, lse, dq, dk, dv against a float64 oracle at n = 10240 (bf16,
  LongNet segments 2048 ... 32768, dilations 1 2 4 6 12): causal and not, both
  head-offset rules, grouped K/V heads (24 query / 6 K/V heads: r = 6 with 4
  query heads per K/V head splits its classes), documents; the dense path with
  each backend that can run (flash-attn-4, FlashAttention-2, cuDNN where rows
  are a multiple of 128),
  and our kernels beside them. The oracle works one head at a time on the
  device, with its own definition of segments (:func:`segment_starts`) and
  the library's head offsets (:func:`oracle_by_head`; tests/test_views_check.py
  checks it against tests/oracle.py's ``reference_attention``).
* ``dense``: dense attention at (16, 2048, 16, 128) and (16, 2048, 12, 64)
  (batch, n, heads, head_dim), flash-attn-4 and FlashAttention-2, forward and
  forward + backward, beside a bf16 ``torch.mm`` (8192^3): the card's ceiling.
* ``bench``: forward and forward + backward at 131K, 1M and 32K rows, 16 x 128
  and 12 x 64, not causal and causal (``--n``, ``--configs``, ``--causal``,
  ``--passes`` choose): each method of ``--methods`` per point, its median
  time, pattern TFLOP/s and share of the bf16 matmul rate measured at the
  start of the stage (``of_mm``). Methods: ``default`` (this tree's
  dispatch), ``dense`` (both passes forced dense), ``kernel`` (our kernels
  both ways), the baselines ``gather`` (gather + SDPA, the faster of its
  CUDA backends), ``fa4`` (gather + flash-attn-4) and ``flex``
  (FlexAttention), and two run in a subprocess: ``prev`` (the default of an
  earlier tree, ``--prev DIR``, ``scripts/prev_tree.sh``, with
  ``PYTHONPATH=DIR``) and ``torch`` (this tree's default with flash-attn-4
  made unimportable: what ``pip install torch`` alone gives). Where the
  dense path runs, its time per phase (the dense calls, the merge
  operators, the K/V check, the rest) is the median of 3 timed calls
  (``phases_ms``; each call's in ``phases_samples``).
* ``big``: forward + backward at 2M rows (16 x 128) with this tree's default:
  time and peak over the bytes of q, k, v, out and their gradients.

The first record of ``views.jsonl`` (``kind: run``) holds the date, device,
versions, commit, flash-attn-4's version or why it does not import, and the
command line and environment of the run.
Points run in that order until ``--budget-s`` is spent (the rest are recorded
as skipped). Writes ``OUT/views.jsonl`` (one record a point) and
``OUT/summary.md``; prints the summary last. ``--dry-run`` runs every stage on
the CPU at toy sizes (the CPU stand-in backend, float32), which is how the
tests exercise this script::

    python3 benchmarks/bench.py views --device cuda --out $OUT/views --budget-s 400 [--prev .prev]
    python3 benchmarks/bench.py views --dry-run --out build/views_dry
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from ring_attention.core.pattern import head_group_bounds, head_offset

from .measure import environment, hardware_rate, median, time_call
from .methods import flops, pattern_pairs

BENCH = Path(__file__).resolve().parent / "bench.py"

SEGS, DILS = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12]
STAGES = ("check", "dense", "bench", "big")
ENVS = ("RING_ATTENTION_FORWARD", "RING_ATTENTION_BACKWARD", "RING_ATTENTION_DENSE_BACKEND")


class Sizes:
    """The points of a run: the GPU's, or toy ones for --dry-run."""

    def __init__(self, dry: bool) -> None:
        if dry:
            self.segs, self.dils = [16, 32, 64], [1, 2, 4]
            self.check_n, self.check_docs = 200, [0, 70, 71, 150, 200]
            self.check_heads = [(4, 4, 16), (12, 3, 8)]  # (heads, kv_heads, head_dim)
            self.dense = [(2, 128, 4, 32)]
            self.bench_n, self.configs = [256, 512], [(2, 16)]
            self.big = (1024, 2, 16)
            self.dtype, self.tol = torch.float32, 1e-4
        else:
            self.segs, self.dils = SEGS, DILS
            self.check_n, self.check_docs = 10240, [0, 3000, 3001, 7000, 10240]
            self.check_heads = [(8, 8, 128), (24, 6, 64)]
            self.dense = [(16, 2048, 16, 128), (16, 2048, 12, 64)]
            # the targets' points first (131072), then 1M, then 32K
            self.bench_n, self.configs = [131072, 1048576, 32768], [(16, 128), (12, 64)]
            self.big = (2097152, 16, 128)
            self.dtype, self.tol = torch.bfloat16, 2e-2


@contextlib.contextmanager
def env(**values: str | None):
    """Set (or, with None, unset) environment variables inside the block."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def paths_env(path: str, backend: str | None = None) -> dict[str, str | None]:
    """The environment of a path: ``dense`` (both passes, a backend named or
    the table's), ``kernel`` (our kernels both ways) or ``default``."""
    mode = {"dense": "dense", "kernel": "kernel", "default": None}[path]
    return {ENVS[0]: mode, ENVS[1]: mode, ENVS[2]: backend}


# --------------------------------------------------------------------------- #
# the float64 oracle, one head at a time on the device
# --------------------------------------------------------------------------- #
def segment_starts(n: int, w: int, cu: list[int] | None) -> torch.Tensor:
    """Long ``(n,)``: the start of the segment of length ``w`` holding each
    position; every document (``cu``, its boundaries) starts its own segments."""
    bounds = [0, n] if cu is None else [int(b) for b in cu]
    doc = torch.zeros(n, dtype=torch.long)
    for a, b in itertools.pairwise(bounds):
        doc[a:b] = a
    return doc + (torch.arange(n) - doc) // w * w


def multiplicity_head(n, heads, h, segs, dils, causal, head_groups, grouped, cu, device):
    """Float64 ``(n, n)``: the branches in which ``t`` reaches ``u`` for query
    head ``h`` (tests/oracle.py's ``multiplicity``, one head, on ``device``)."""
    m = torch.zeros(n, n, dtype=torch.float64, device=device)
    groups = head_group_bounds(heads, len(segs))
    pos = torch.arange(n, device=device)
    for i, (w, r) in enumerate(zip(segs, dils, strict=True)):
        if head_groups and not groups[i][0] <= h < groups[i][1]:
            continue
        seg = segment_starts(n, w, cu).to(device)
        offset = head_offset(h, r, heads, "grouped" if grouped else "modulo")
        act = (pos - seg) % r == offset
        reach = act[:, None] & act[None, :] & (seg[:, None] == seg[None, :])
        if causal:
            reach &= pos[None, :] <= pos[:, None]
        m += reach
    return m


def _attend_head(q, k, v, mult, scale):
    """tests/oracle.py's ``reference_attention`` for one (batch, head)."""
    reached = mult > 0
    nonempty = reached.any(-1)
    s = scale * q @ k.T
    rowmax = torch.where(reached, s, -math.inf).amax(-1, keepdim=True)
    rowmax = torch.where(nonempty[:, None], rowmax, 0).detach()
    weights = torch.where(reached, mult * torch.exp(torch.where(reached, s - rowmax, 0)), 0)
    denom = weights.sum(-1)
    safe = torch.where(nonempty, denom, 1)
    out = torch.where(nonempty[:, None], weights @ v / safe[:, None], 0)
    lse = torch.where(nonempty, torch.log(safe) + rowmax[:, 0], -math.inf)
    return out, lse


def oracle_by_head(q, k, v, go, segs, dils, *, causal=False, head_groups=False,
                   grouped=False, cu=None):  # fmt: skip
    """Float64 out, lse, dq, dk, dv (loss ``sum(out * go)``) of the pattern."""
    b_, n, heads, d = q.shape
    group = heads // k.shape[2]
    scale = d**-0.5
    q64, k64, v64, go64 = (t.double() for t in (q, k, v, go))
    out, dq = torch.zeros_like(q64), torch.zeros_like(q64)
    dk, dv = torch.zeros_like(k64), torch.zeros_like(v64)
    lse = torch.empty(b_, heads, n, dtype=torch.float64, device=q.device)
    for h in range(heads):
        mult = multiplicity_head(n, heads, h, segs, dils, causal, head_groups, grouped, cu,
                                 q.device)  # fmt: skip
        for b in range(b_):
            qh, kh, vh = (x.detach().requires_grad_() for x in
                          (q64[b, :, h], k64[b, :, h // group], v64[b, :, h // group]))  # fmt: skip
            o, lse_h = _attend_head(qh, kh, vh, mult, scale)
            gq, gk, gv = torch.autograd.grad(o, (qh, kh, vh), go64[b, :, h])
            out[b, :, h], lse[b, h], dq[b, :, h] = o.detach(), lse_h.detach(), gq
            dk[b, :, h // group] += gk
            dv[b, :, h // group] += gv
        del mult
    return out, lse, dq, dk, dv


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return math.inf
    return float((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30))


# --------------------------------------------------------------------------- #
# stages
# --------------------------------------------------------------------------- #
def _ra():
    import ring_attention as ra

    return ra


def stage_check(sz: Sizes, device, emit, left) -> None:
    from ring_attention.core.pattern import Pattern
    from ring_attention.local.backends import fa4_missing
    from ring_attention.local.dispatch import route

    ra = _ra()
    if device.type == "cuda":
        backends = ["flash", "cudnn"] + ([] if fa4_missing() else ["fa4"])
    else:
        backends = ["cpu"]
    n = sz.check_n
    cases = [  # name, (heads, kv_heads, d), keyword arguments
        ("non-causal", sz.check_heads[0], {}),
        ("causal", sz.check_heads[0], {"causal": True}),
        ("grouped-offsets-causal", sz.check_heads[0], {"causal": True, "head_offsets": "grouped"}),
        ("gqa-r6-causal", sz.check_heads[1], {"causal": True}),
        ("documents", sz.check_heads[1], {"cu_seqlens": sz.check_docs}),
    ]
    for name, (heads, kv_heads, d), kw in cases:
        if left() < 10:
            emit({"stage": "check", "case": name, "status": "skipped (budget)"})
            continue
        g = torch.Generator().manual_seed(len(name))
        q = torch.randn(1, n, heads, d, generator=g).to(device, sz.dtype)
        k, v = (torch.randn(1, n, kv_heads, d, generator=g).to(device, sz.dtype) for _ in "kv")
        go = torch.randn(1, n, heads, d, generator=g).to(device, sz.dtype)
        t0 = time.perf_counter()
        want = oracle_by_head(q, k, v, go, sz.segs, sz.dils, causal=kw.get("causal", False),
                              grouped=kw.get("head_offsets") == "grouped",
                              cu=kw.get("cu_seqlens"))  # fmt: skip
        oracle_s = time.perf_counter() - t0
        pattern = Pattern(sz.segs, sz.dils, causal=kw.get("causal", False),
                          head_offsets=kw.get("head_offsets", "modulo"))  # fmt: skip
        pattern = pattern.with_documents(kw.get("cu_seqlens"))
        for path, backend in [("dense", b) for b in backends] + [("kernel", None)]:
            rec = {"stage": "check", "case": name, "n": n, "heads": heads,
                   "kv_heads": kv_heads, "head_dim": d, "path": path, "backend": backend,
                   "oracle_s": round(oracle_s, 2)}  # fmt: skip
            try:
                with env(**paths_env(path, backend)):
                    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                    routes = [route(p, qg, kg, vg, pattern, None) for p in ("forward", "backward")]
                    out, lse = ra.dilated_attention(qg, kg, vg, sz.segs, sz.dils,
                                                    return_lse=True, **kw)  # fmt: skip
                    grads = torch.autograd.grad(out, (qg, kg, vg), go)
                got = (out, lse, *grads)
                errs = {x: rel_err(a, b) for x, a, b in
                        zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True)}  # fmt: skip
                rec.update(errors=errs, routes=[r.why[:160] for r in routes],
                           status="ok" if max(errs.values()) <= sz.tol else "FAIL")  # fmt: skip
            except Exception as exc:  # recorded; the next path runs
                rec.update(status=f"error: {type(exc).__name__}: {str(exc)[:300]}")
            emit(rec)
        del want


def _fa4_dense(q, k, v, do, backward: bool):
    from ring_attention.local.backends import fa4_interface

    iface = fa4_interface()
    out, lse = iface._flash_attn_fwd(q, k, v, causal=False, return_lse=True)[:2]
    if backward:
        iface._flash_attn_bwd(q, k, v, out, do, lse, causal=False)


def _fa2_dense(q, k, v, do, backward: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2).requires_grad_(backward) for x in (q, k, v))
    kernel = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH
    with sdpa_kernel([kernel]):
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
    if backward:
        out.backward(do.transpose(1, 2))


def stage_dense(sz: Sizes, device, emit, left) -> None:
    from ring_attention.local.backends import fa4_missing

    dt = torch.bfloat16 if device.type == "cuda" else sz.dtype
    rate = hardware_rate(device, sz.dense[0][3], dt)
    emit({"stage": "dense", "what": rate.get("what"), "flop_rate": rate.get("flop_rate")})
    for b, n, h, d in sz.dense:
        q, k, v, do = (torch.randn(b, n, h, d, device=device, dtype=dt) for _ in range(4))
        for name, fn in (("fa4", _fa4_dense), ("flash", _fa2_dense)):
            for backward in (False, True):
                rec = {"stage": "dense", "backend": name, "shape": [b, n, h, d],
                       "pass": "fwdbwd" if backward else "fwd"}  # fmt: skip
                if name == "fa4" and (device.type != "cuda" or fa4_missing()):
                    rec["status"] = f"skipped: {fa4_missing() or 'CUDA only'}"
                elif left() < 5:
                    rec["status"] = "skipped (budget)"
                else:

                    def run(fn=fn, bw=backward, args=(q, k, v, do)):
                        fn(*args, bw)

                    ms = median(time_call(run, device, 2, 10, 5.0))
                    fl = 4.0 * d * n * n * h * b * (3.5 if backward else 1.0)
                    rec.update(status="ok", ms=round(ms, 3), tflops=round(fl / ms / 1e9, 1),
                               of_mm=round(fl / ms / 1e-3 / rate["flop_rate"], 3))  # fmt: skip
                emit(rec)


PHASES = ("calls", "merge", "finite")
BASELINES = ("gather", "fa4", "flex")
SUBPROCESS = ("prev", "torch")  # methods run by a subprocess (``--tag``)


def _phases(call, device, budget_s: float, runs: int = 3) -> dict:
    """The dense path's milliseconds per phase: the median of ``runs`` timed
    calls (one slow call, e.g. a first launch or a host stall, is not the
    figure), each call's in ``phases_samples``; ``other``: the call's wall
    time less its phases' device time (the host between launches,
    allocations, syncs). Empty where the dense path did not run (or an
    earlier tree has none)."""
    try:
        from ring_attention.local.branches import phase_times
    except ImportError:  # an earlier tree (--prev) without the dense path
        return {}
    samples = []
    for _ in range(runs):
        with phase_times() as pt:
            t_one = min(time_call(call, device, 0, 1, budget_s))
        ms = {p: pt.totals().get(p, 0.0) * 1e3 for p in PHASES}
        if not any(ms.values()):
            return {}
        ms["other"] = t_one - sum(ms.values())
        samples.append({p: round(x, 3) for p, x in ms.items()})
    return {"phases_ms": {p: round(median(s[p] for s in samples), 2) for p in samples[0]},
            "phases_samples": samples}  # fmt: skip


class Baselines:
    """The same-function baselines of benchmarks/methods.py (gather + SDPA,
    gather + flash-attn-4, FlexAttention), one :class:`Methods` per pattern."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self._methods: dict = {}

    def fn(self, method, segs, dils, causal, device, q, k, v):
        """A call of ``method`` on q, k, v and its backend, or why it cannot run."""
        from .methods import Methods

        key = (tuple(segs), tuple(dils), causal, str(device))
        if key not in self._methods:  # compiled FlexAttention on the CPU: slow to build
            self._methods[key] = Methods(segs, dils, causal, device, flex_compiled=not self.dry)
        m = self._methods[key]
        why = m.unsupported(method, q.requires_grad)
        if why:
            return None, None, why
        backends = ["flash", "cudnn"] if method == "gather" and device.type == "cuda" else \
            m.backends(method, ())  # fmt: skip
        return m, backends, None


def _point(method, n, heads, d, causal, backward, device, dtype, segs, dils, budget_s,
           baselines: Baselines):  # fmt: skip
    """Time one (method, n, config, causal, pass): ms, pattern TFLOP/s and,
    where the dense path runs, its milliseconds per phase."""
    ra = _ra()
    g = torch.Generator(device=device).manual_seed(n + heads)
    q, k, v = (torch.randn(1, n, heads, d, generator=g, device=device, dtype=dtype)
               for _ in range(3))  # fmt: skip
    do = torch.randn_like(q) if backward else None
    for t in (q, k, v):
        t.requires_grad_(backward)

    def finish(out):
        if backward:
            out.backward(do)
            for t in (q, k, v):
                t.grad = None

    rec: dict = {}
    if method in BASELINES:
        m, backends, why = baselines.fn(method, segs, dils, causal, device, q, k, v)
        if why:
            return {"status": f"skipped: {why}"}
        best = None
        for backend in backends:

            def call(backend=backend):
                finish(m.call(method, backend, q, k, v))

            try:
                ms = median(time_call(call, device, 1, 5, budget_s))
            except Exception as exc:  # a backend that cannot run this case: the next one
                rec.setdefault("backend_errors", {})[str(backend)] = f"{type(exc).__name__}: " \
                    f"{str(exc)[:200]}"  # fmt: skip
                continue
            if best is None or ms < best[0]:
                best = (ms, backend)
        if best is None:
            raise RuntimeError(f"no backend ran: {rec.get('backend_errors')}")
        ms, rec["backend"] = best
    else:
        path = "default" if method in ("default", *SUBPROCESS) else method

        def call():
            finish(ra.dilated_attention(q, k, v, segs, dils, causal=causal))

        with env(**paths_env(path)):
            ms = median(time_call(call, device, 1, 5, budget_s))
            rec.update(_phases(call, device, budget_s))
    pairs = pattern_pairs(n, heads, segs, dils, causal)
    rec.update(ms=round(ms, 3), tflops=round(flops(pairs, d, backward) / ms / 1e9, 2))
    return rec


def bench_points(sz: Sizes, causal: list[bool], passes: list[str]):
    """``(n, heads, d, causal, backward)`` of the bench stage, in its order."""
    for n in sz.bench_n:
        for c in causal:
            for heads, d in sz.configs:
                for p in passes:
                    yield n, heads, d, c, p == "fwdbwd"


def stage_bench(sz: Sizes, device, emit, left, methods, causal, passes) -> None:
    rate = hardware_rate(device, sz.configs[0][1], sz.dtype)["flop_rate"]
    emit({"stage": "bench", "what": "matmul rate", "flop_rate": rate})
    baselines = Baselines(device.type == "cpu")
    for n, heads, d, c, backward in bench_points(sz, causal, passes):
        for method in methods:
            rec = {"stage": "bench", "method": method, "n": n, "config": f"{heads}x{d}",
                   "causal": c, "pass": "fwdbwd" if backward else "fwd"}  # fmt: skip
            if left() < 15:
                rec["status"] = "skipped (budget)"
            else:
                try:
                    budget = min(20.0, left() / 4)
                    got = _point(method, n, heads, d, c, backward, device, sz.dtype, sz.segs,
                                 sz.dils, budget, baselines)  # fmt: skip
                    rec.update(got)
                    rec.setdefault("status", "ok")
                    if "tflops" in rec:
                        rec["of_mm"] = round(rec["tflops"] * 1e12 / rate, 4)
                except Exception as exc:
                    rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            emit(rec)


def stage_big(sz: Sizes, device, emit, left) -> None:
    n, heads, d = sz.big
    rec = {"stage": "big", "n": n, "config": f"{heads}x{d}", "pass": "fwdbwd"}
    if left() < 30:
        emit(dict(rec, status="skipped (budget)"))
        return
    ra = _ra()
    q, k, v, do = (torch.randn(1, n, heads, d, device=device, dtype=sz.dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    unit = q.numel() * q.element_size()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    try:
        ra.dilated_attention(q, k, v, sz.segs, sz.dils).backward(do)
        if device.type == "cuda":
            torch.cuda.synchronize()
            growth = torch.cuda.max_memory_allocated() - base
            rec["peak_over_tensors"] = round((4 * unit + growth) / (8 * unit), 3)
        rec.update(status="ok", s=round(time.perf_counter() - t0, 2))
    except Exception as exc:
        rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
    emit(rec)


# --------------------------------------------------------------------------- #
# summary
# --------------------------------------------------------------------------- #
def summary(records: list[dict]) -> str:
    lines = ["## views_check summary", ""]
    chk = [r for r in records if r["stage"] == "check"]
    if chk:
        lines += ["### against the float64 oracle (relative errors)", "",
                  "| case | path | backend | out | lse | dq | dk | dv | status |",
                  "|---|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for r in chk:
            e = r.get("errors", {})
            cells = " | ".join(f"{e[x]:.1e}" if x in e else "" for x in
                               ("out", "lse", "dq", "dk", "dv"))  # fmt: skip
            lines.append(f"| {r['case']} | {r.get('path', '')} | {r.get('backend') or ''} | "
                         f"{cells} | {r['status']} |")  # fmt: skip
        lines.append("")
    dense = [r for r in records if r["stage"] == "dense"]
    if dense:
        lines += ["### dense attention and the card's ceiling", ""]
        for r in dense:
            if "what" in r:
                lines.append(f"- {r['what']}: {r['flop_rate'] / 1e12:.0f} TFLOP/s")
            else:
                got = f"{r['ms']} ms, {r['tflops']} TFLOP/s ({100 * r['of_mm']:.0f} % of mm)" \
                    if r["status"] == "ok" else r["status"]  # fmt: skip
                lines.append(f"- {r['backend']} {tuple(r['shape'])} {r['pass']}: {got}")
        lines.append("")
    bench = [r for r in records if r["stage"] == "bench"]
    if bench:
        lines += [
            "### the local op (ms, TFLOP/s, share of the matmul rate; dense path: "
            "calls / merge / finite / other ms, median of 3 calls)",
            "",
        ]
        lines += [
            f"- {r.get('method_of', 'this run')}: {r['what']} {r['flop_rate'] / 1e12:.0f} TFLOP/s"
            for r in bench
            if "method" not in r
        ]
        lines += ["",
                  "| n | h x d | causal | pass | method | ms | TFLOP/s | of mm | phases | status |",
                  "|---:|---|---|---|---|---:|---:|---:|---|---|"]  # fmt: skip
        for r in bench:
            if "method" not in r:
                continue
            ph = r.get("phases_ms")
            ph = " / ".join(str(ph.get(p, "?")) for p in ("calls", "merge", "finite", "other")) \
                if ph else ""  # fmt: skip
            of = f"{100 * r['of_mm']:.0f} %" if "of_mm" in r else ""
            method = r["method"] + (f" [{r['backend']}]" if r.get("backend") else "")
            cells = [r["n"], r["config"], "yes" if r.get("causal") else "no", r["pass"], method,
                     r.get("ms", ""), r.get("tflops", ""), of, ph, r["status"]]  # fmt: skip
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    for r in records:
        if r["stage"] == "big":
            lines.append(f"### {r['n']} rows, {r['config']}, fwd+bwd: {r['status']}, "
                         f"{r.get('s', '')} s, peak {r.get('peak_over_tensors', '?')}x "
                         "q, k, v, out and their gradients")  # fmt: skip
    return "\n".join(lines)


#: environment variables a run's header records (what changes the results)
ENV_PREFIXES = (
    "RING_ATTENTION_",
    "GPU_CHECK_",
    "FLASH_ATTENTION_",
    "CUTE_DSL_",
    "CUDA_",
    "TORCH",
    "PYTORCH_",
    "TRITON_",
    "OMP_",
    "PYTHONPATH",
    "BENCH_",
    "KERNELS_",
)


def run_environment() -> dict:
    """The command line and the environment variables that shape a run."""
    return {"argv": list(sys.argv), "env": {k: v for k, v in sorted(os.environ.items())
                                            if k.startswith(ENV_PREFIXES)}}  # fmt: skip


def header(device: torch.device) -> dict:
    """The first record of a run: when, where, which commit and flash-attn-4,
    the command line and the environment."""
    try:  # an earlier tree (--prev) may have no ring_attention.local.backends
        from ring_attention.local.backends import fa4_missing

        why = fa4_missing()
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    try:
        from importlib.metadata import version

        fa4 = why or version("flash-attn-4")
    except Exception as exc:  # recorded, not fatal: the header says why
        fa4 = f"{type(exc).__name__}: {exc}"
    return {"kind": "run", "sweep": "views", **environment(device), "flash_attn_4": fa4,
            **run_environment()}  # fmt: skip


class _NoFlashAttn:
    """A ``sys.meta_path`` entry that makes ``flash_attn`` unimportable (the
    ``torch`` method: this tree as ``pip install torch`` alone leaves it)."""

    def find_spec(self, name, path=None, target=None):
        if name == "flash_attn" or name.startswith("flash_attn."):
            raise ImportError("flash-attn-4 hidden (views_check --block-fa4)")
        return None


def _subprocess_method(a, method: str, out: Path, budget_s: float, emit) -> None:
    """Run ``method`` (``prev`` or ``torch``) over the bench points in a
    subprocess that records under its own header in ``OUT/<method>.jsonl``;
    its records are appended here with the subprocess's exit status."""
    cmd = [sys.executable, str(BENCH), "views", "--out", str(out), "--stages", "bench",
           "--tag", method, "--methods", method, "--budget-s", str(int(budget_s)),
           "--device", a.device, "--causal", a.causal, "--passes", a.passes]  # fmt: skip
    for opt, val in (("--n", a.n), ("--configs", a.configs)):
        if val:
            cmd += [opt, val]
    if a.dry_run:
        cmd.append("--dry-run")
    penv = dict(os.environ)
    if method == "prev":
        if not a.prev:
            emit({"stage": "bench", "method": method, "status": "skipped: no --prev tree"})
            return
        penv["PYTHONPATH"] = os.pathsep.join([str(Path(a.prev).resolve()),
                                              os.environ.get("PYTHONPATH", "")])  # fmt: skip
    else:
        cmd.append("--block-fa4")
    try:
        rc = subprocess.run(cmd, env=penv, timeout=max(budget_s + 10, 1)).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    path = out / f"{method}.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    for rec in recs:
        if rec.get("kind") != "run":  # its header stays in <method>.jsonl
            emit(dict(rec, run_rc=rc))
    if not recs:
        emit({"stage": "bench", "method": method, "status": f"error: subprocess rc={rc}"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench.py views", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="every stage on the CPU, toy sizes")
    ap.add_argument("--out", default="build/views_check")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument(
        "--methods",
        default="default",
        help="bench: default, dense, kernel, gather, fa4, flex, prev, torch",
    )
    ap.add_argument("--n", default=None, help="bench: lengths, comma-separated (in this order)")
    ap.add_argument("--configs", default=None, help="bench: HEADSxDIM, comma-separated")
    ap.add_argument("--causal", default="both", choices=["no", "yes", "both"])
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--prev", default=None, help="an earlier tree to time (scripts/prev_tree.sh)")
    ap.add_argument("--tag", default=None, help="(internal) a subprocess method's run")
    ap.add_argument("--block-fa4", action="store_true", help="make flash-attn-4 unimportable")
    a = ap.parse_args(argv)
    if a.block_fa4:
        sys.meta_path.insert(0, _NoFlashAttn())
    device = torch.device("cpu" if a.dry_run else a.device)
    sz = Sizes(a.dry_run)
    if a.n:
        sz.bench_n = [int(x) for x in a.n.split(",")]
    if a.configs:
        sz.configs = [tuple(int(v) for v in c.split("x")) for c in a.configs.split(",")]
    causal = {"no": [False], "yes": [True], "both": [False, True]}[a.causal]
    passes = a.passes.split(",")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.budget_s
    left = lambda: deadline - time.monotonic()  # noqa: E731
    jsonl = out / (f"{a.tag}.jsonl" if a.tag else "views.jsonl")
    jsonl.write_text(json.dumps(header(device)) + "\n")
    records: list[dict] = []

    def emit(rec: dict) -> None:
        records.append(rec)
        with jsonl.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)

    methods = a.methods.split(",")
    here = [m for m in methods if a.tag or m not in SUBPROCESS]
    for stage in a.stages.split(","):
        t0 = time.perf_counter()
        if stage == "check":
            stage_check(sz, device, emit, left)
        elif stage == "dense":
            stage_dense(sz, device, emit, left)
        elif stage == "bench":
            if here:
                stage_bench(sz, device, emit, left, here, causal, passes)
            sub = [m for m in methods if not a.tag and m in SUBPROCESS]
            for i, method in enumerate(sub):
                budget = (left() - 5) / (len(sub) - i)
                if budget < 30:
                    emit({"stage": "bench", "method": method, "status": "skipped (budget)"})
                else:
                    _subprocess_method(a, method, out, budget, emit)
        elif stage == "big":
            stage_big(sz, device, emit, left)
        else:
            raise SystemExit(f"views_check: unknown stage {stage!r} (stages: {STAGES})")
        print(
            f"== stage {stage}: {time.perf_counter() - t0:.0f} s, {left():.0f} s left", flush=True
        )
    if a.tag is None:
        text = summary(records)
        (out / "summary.md").write_text(text + "\n")
        print(text)
    bad = [r for r in records if r.get("stage") == "check" and r.get("status") != "ok"]
    return 1 if bad else 0
