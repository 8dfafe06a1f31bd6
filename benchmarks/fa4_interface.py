"""Every launch of the dense per-branch path through flash-attn-4's real
Python interface, on the CPU, with fake CUDA tensors: no GPU, no kernel run.

The route (ring_attention/local/dispatch.py, as on a compute capability 9.0
device, both passes forced dense), the view planner's launches
(ring_attention/local/spans.py, branches.py) and flash-attn-4's ``_flash_attn_fwd``
/ ``_flash_attn_bwd`` run for real on ``FakeTensor`` q, k, v (``meta``
storage, ``device=cuda``): flash-attn-4's checks and assertions, and the CuTe
DSL's compile of each kernel variant for sm_90a (its documented
cross-compile variables; the compiled kernels land in its on-disk cache).
Copies are counted by wrapping the interface's ``maybe_contiguous``, which
silently copies a tensor that is not 16-byte aligned or whose strides are
not multiples of 8 elements; outputs (``out``, ``lse``, ``dq``, ``dk``,
``dv``) it asserts aligned instead.

Install flash-attn-4 for this interpreter with ``bash scripts/fa4_cpu.sh``
(build/fa4_cpu), then::

    source <(bash scripts/fa4_cpu.sh --env)
    python -m benchmarks.fa4_interface [--cases NAME,...] [--json FILE]

One JSON record per case (stdout, and ``--json``), after a control (a
misaligned q, which must be counted as a copy); exit 1 when the control or a
case fails (an error, a launch off flash-attn-4, or a copy in the forward).
tests/test_fa4_interface.py runs it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import importlib.util
import json
import os
import sys
import time
import traceback
import types
from typing import Any

SEGS, DILS = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12]
CROSS_COMPILE = {"FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a",
                 "FLASH_ATTENTION_NUM_SMS": "132"}  # fmt: skip
DOCS = [0, 3000, 3001, 7000, 10240]

# name: (batch, n, heads, kv_heads, head_dim, causal, head_offsets, cu_seqlens)
CASES: dict[str, tuple[int, int, int, int, int, bool, str, list[int] | None]] = {
    "131k-16x128": (1, 131072, 16, 16, 128, False, "modulo", None),
    "131k-16x128-causal": (1, 131072, 16, 16, 128, True, "modulo", None),
    "131k-12x64": (1, 131072, 12, 12, 64, False, "modulo", None),
    "131k-12x64-causal": (1, 131072, 12, 12, 64, True, "modulo", None),
    # 24 query / 6 K/V heads (r = 6 splits a class into runs), batch 2, a
    # length with short last segments in every branch
    "gqa-24x6x64-tails-batch2": (2, 40000, 24, 6, 64, True, "modulo", None),
    "documents-24x6x64": (1, 10240, 24, 6, 64, False, "modulo", DOCS),
    "grouped-offsets-16x128-causal": (1, 131072, 16, 16, 128, True, "grouped", None),
    "grouped-offsets-24x6x64-causal": (1, 10240, 24, 6, 64, True, "grouped", None),
}
# what the interface receives, by position and keyword, per entry point
ARGS = {
    "_flash_attn_fwd": (("q", "k", "v"), ("out", "lse")),
    "_flash_attn_bwd": (("q", "k", "v", "out", "dout", "lse"), ("dq", "dk", "dv")),
}


def missing() -> str | None:
    """What is missing for the check here (None: flash-attn-4 is importable)."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn-4 is not installed (bash scripts/fa4_cpu.sh installs it for the CPU)"
    return None


def load_interface() -> Any:
    """``flash_attn.cute.interface``, imported for cross-compiling on a
    machine without a GPU: the cross-compile variables set (where unset) and,
    where Triton is missing, a placeholder for ``quack.autotuner`` (quack's
    ``__init__`` imports it; flash-attn-4 uses none of it)."""
    for key, value in CROSS_COMPILE.items():
        os.environ.setdefault(key, value)
    if importlib.util.find_spec("triton") is None and "quack.autotuner" not in sys.modules:
        stub = types.ModuleType("quack.autotuner")

        class AutotuneConfig:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.__dict__.update(kwargs)

        stub.AutotuneConfig = AutotuneConfig  # type: ignore[attr-defined]
        stub.autotune = lambda *a, **k: lambda fn: fn  # type: ignore[attr-defined]
        sys.modules["quack.autotuner"] = stub
    from flash_attn.cute import interface

    return interface


class Counter:
    """Launches and copies per entry point while :meth:`wrapped` is active."""

    def __init__(self) -> None:
        self.launches: collections.Counter[str] = collections.Counter()
        self.copies: collections.Counter[str] = collections.Counter()
        self._names: dict[int, str] = {}
        self._entry = ""

    @contextlib.contextmanager
    def wrapped(self, iface):
        saved = {name: getattr(iface, name) for name in (*ARGS, "maybe_contiguous")}

        def entry(name):
            fn = saved[name]
            positional, keywords = ARGS[name]

            # (wraps: the interface reaches its compile caches as attributes
            # of these functions, through the module's globals)
            @functools.wraps(fn)
            def call(*args, **kwargs):
                self.launches[name] += 1
                self._entry = name
                self._names = {id(t): a for a, t in zip(positional, args, strict=False)}
                self._names.update({id(kwargs[a]): a for a in keywords if a in kwargs})
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._names, self._entry = {}, ""

            return call

        def maybe_contiguous(t, *args, **kwargs):
            got = saved["maybe_contiguous"](t, *args, **kwargs)
            if got is not None and got is not t:
                self.copies[f"{self._entry}:{self._names.get(id(t), '?')}"] += 1
            return got

        try:
            for name in ARGS:
                setattr(iface, name, entry(name))
            iface.maybe_contiguous = maybe_contiguous
            yield self
        finally:
            for name, fn in saved.items():
                setattr(iface, name, fn)


def launch_program(routes, q, k, v, go, causal: bool, scale: float) -> None:
    """Every launch of the forward and the backward of the dense path, as
    ring_attention/local/branches.py's ``dense_forward`` and ``dense_backward`` make
    them: the same :class:`~ring_attention.local.branches.Program` (the planner's
    geometry), views of q, k, v, dout, out and of part buffers of the same
    sizes, the same backend calls. Only the merge operators and their index
    maps are left out: on a CPU-only PyTorch, fake CUDA tensors cannot be
    sliced (``as_strided`` works), and the merge is no flash-attn-4 call."""
    import torch

    from ring_attention.local.backends import backend
    from ring_attention.local.branches import _program

    d, dev, dt, acc = q.shape[3], q.device, q.dtype, torch.float32
    out = torch.empty_like(q)
    prog = _program("forward", routes["forward"], q, k, v, out)
    parts = torch.empty(prog.q_rows, d, dtype=dt, device=dev)
    part_lse = torch.empty(prog.lse_rows, dtype=acc, device=dev)
    for *_, launches in prog.spans:
        for (name, into_out), qg, kg, vg, og, lg in launches:
            backend(name).forward(
                q.as_strided(*qg), k.as_strided(*kg), v.as_strided(*vg), causal, scale,
                (out if into_out else parts).as_strided(*og), part_lse.as_strided(*lg),
            )  # fmt: skip
    yield "forward"
    prog = _program("backward", routes["backward"], go, q, k, v, out)
    gq = torch.empty(prog.q_rows, d, dtype=dt, device=dev)
    gk, gv = (torch.empty(prog.kv_rows, d, dtype=dt, device=dev) for _ in "kv")
    # the window's merged lse in part order (dense_backward's torch.take)
    part_lse = torch.empty(prog.q_rows, dtype=acc, device=dev)
    for *_, launches in prog.spans:
        for name, dog, qg, kg, vg, og, lg, gqg, gkg, gvg in launches:
            backend(name).backward(
                go.as_strided(*dog), q.as_strided(*qg), k.as_strided(*kg), v.as_strided(*vg),
                out.as_strided(*og), part_lse.as_strided(*lg), causal, scale,
                gq.as_strided(*gqg), gk.as_strided(*gkg), gv.as_strided(*gvg),
            )  # fmt: skip
    yield "backward"


def run_case(name: str, iface) -> dict[str, Any]:
    """The forward and backward of case ``name`` on fake CUDA tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ring_attention.core import config
    from ring_attention.core.pattern import Pattern
    from ring_attention.local import dispatch

    batch, n, heads, kv_heads, d, causal, offsets, cu = CASES[name]
    rec: dict[str, Any] = {"case": name, "batch": batch, "n": n, "heads": heads,
                           "kv_heads": kv_heads, "head_dim": d, "causal": causal,
                           "head_offsets": offsets, "documents": cu}  # fmt: skip
    t0 = time.perf_counter()
    counter = Counter()
    capability = dispatch._capability
    saved_env = {k: os.environ.get(k) for k in (config.FORWARD, config.BACKWARD)}
    try:
        os.environ[config.FORWARD] = os.environ[config.BACKWARD] = "dense"
        dispatch._capability = lambda device: (9, 0) if device.type == "cuda" else (0, 0)
        pattern = Pattern(SEGS, DILS, causal=causal, head_offsets=offsets).with_documents(cu)
        with FakeTensorMode(), counter.wrapped(iface):
            dev, dt = torch.device("cuda"), torch.bfloat16
            q, go = (torch.empty(batch, n, heads, d, device=dev, dtype=dt) for _ in "qg")
            k, v = (torch.empty(batch, n, kv_heads, d, device=dev, dtype=dt) for _ in "kv")
            routes = {p: dispatch.route(p, q, k, v, pattern, None) for p in ("forward", "backward")}
            rec["routes"] = {p: r.why for p, r in routes.items()}
            rec["backends"] = sorted({b for p in routes.values() for w in p.backends for b in w})
            rec["calls"] = routes["forward"].spans.calls if routes["forward"].spans else 0
            if all(r.dense for r in routes.values()):
                passes = launch_program(routes, q, k, v, go, causal, d**-0.5)
                for pass_, entry in zip(passes, ARGS, strict=True):
                    rec[pass_] = {"launches": counter.launches[entry],
                                  "copies": dict(counter.copies)}  # fmt: skip
                    counter.copies.clear()
    except Exception as exc:  # recorded: the case fails, the next one runs
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        rec["where"] = traceback.format_exc(limit=-4)[-1500:]
    finally:
        dispatch._capability = capability
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    rec["status"] = status(rec)
    return rec


def control(iface) -> dict[str, Any]:
    """The counter's control: one forward on a q view that starts 2 bytes
    past an aligned address, which flash-attn-4 must copy (and does count)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = Counter()
    rec: dict[str, Any] = {"case": "control: q misaligned by one element"}
    try:
        with FakeTensorMode(), counter.wrapped(iface):
            dev, dt = torch.device("cuda"), torch.bfloat16
            base = torch.empty(2048 * 4 * 64 + 1, device=dev, dtype=dt)
            q = base.as_strided((1, 2048, 4, 64), (2048 * 256, 256, 64, 1), 1)
            k, v = (torch.empty(1, 2048, 4, 64, device=dev, dtype=dt) for _ in "kv")
            iface._flash_attn_fwd(q, k, v, causal=False, return_lse=True)
        rec["copies"] = dict(counter.copies)
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    rec["status"] = "ok" if rec.get("copies", {}).get("_flash_attn_fwd:q") else "error"
    return rec


def status(rec: dict[str, Any]) -> str:
    """``ok``, or what is wrong with a case's record (a backward copy is
    reported in the record, not here: see the test)."""
    if "error" in rec:
        return "error"
    if rec.get("backends") != ["fa4"]:
        return f"not all on fa4: {rec.get('backends')} ({rec.get('routes')})"
    fwd = rec.get("forward", {})
    if not fwd.get("launches") or not rec.get("backward", {}).get("launches"):
        return "no launch"
    if fwd.get("copies"):
        return f"forward copies {fwd['copies']}"
    return "ok"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " +
                    ", ".join(CASES))  # fmt: skip
    ap.add_argument("--json", default=None, help="also write the records here (JSON lines)")
    a = ap.parse_args(argv)
    why = missing()
    if why:
        print(f"fa4_interface: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    iface = load_interface()
    print(f"fa4_interface: flash_attn.cute imported in {time.perf_counter() - t0:.1f} s",
          flush=True)  # fmt: skip
    records = []
    for name in ["control", *a.cases.split(",")]:
        rec = control(iface) if name == "control" else run_case(name, iface)
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
