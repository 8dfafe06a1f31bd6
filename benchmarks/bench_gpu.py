"""GPU benchmark of the local operator ``ra.dilated_attention`` (DESIGN.md §7).

One run on the GPU, bf16, batch 1, (h = 12, d = 64) and (h = 16, d = 128), the
LongNet pattern (segments 2048 4096 8192 16384 32768, dilations 1 2 4 6 12),
n from 32K to 1M, forward and forward + backward. Methods, on the same inputs:

* ``ours``   — ``ra.dilated_attention`` (the extension's CUDA kernels);
* ``gather`` — gather + PyTorch SDPA per branch and head-offset class, merged
  by LSE (``baselines.gather_sdpa_dilated``); on CUDA every SDPA backend in
  ``--sdpa-backends`` (flash, cuDNN, efficient) is timed and the fastest that
  runs is reported, separately for fwd and fwd+bwd. The fused kernel has to
  return its LSE for the merge, so the backend is chosen by calling its
  ``aten._scaled_dot_product_{flash,cudnn,efficient}_attention`` op (and the
  matching backward) — ``sdpa_kernel`` only steers ``F.scaled_dot_product_attention``,
  which returns no LSE. The backend is passed as ``backend=`` to
  ``gather_sdpa_dilated`` (``baselines.sdpa_with_lse``);
* ``flex``   — FlexAttention (``torch.compile(flex_attention)``). The pattern is
  a SUM of branches (a key reached by two branches counts twice), which one
  ``mask_mod`` cannot express, so: one call per branch with that branch's
  ``mask_mod`` (same segment, query and key both active for the head:
  ``(t mod w) mod r == h mod r``, causal ``u <= t``), ``return_lse=True``,
  then the branches are merged by LSE (as gather + SDPA). Each branch's
  ``BlockMask`` is built analytically (``gpu_baselines.branch_block_mask``; checked against
  ``create_block_mask`` in ``--check``), so no n² mask evaluation is needed;
* ``dense``  — plain SDPA over the whole sequence (``sdpa_kernel`` with each
  backend, fastest reported) where it fits (``--dense-max-n``). NOT the same
  function for a dilated pattern (n² pairs): a cost reference only; its own
  FLOP rate is given in a footnote.

Reported per (n, h, d, method): median time (CUDA events, after warm-up),
effective TFLOP/s = pattern FLOPs / time (4·d per reached (query, key) pair
forward, 3.5x that for forward + backward, pairs counted exactly by
``pattern_pairs``), peak memory (``torch.cuda.max_memory_allocated`` during one
call, inputs included), peak / bytes of (q, k, v, out, dq, dk, dv, dout) for
fwd+bwd, and time / time of ours (> 1: ours is faster). Also: the bf16 matmul
rate measured in the same run (8192³ ``torch.mm`` on random data), the largest
n that ran forward + backward per method (and a search upwards for ours), and
the issue's targets as PASS/FAIL lines.

Sweep order (most informative first; the table is sorted at the end):
  1. n = 32K, 128K: every method, both configurations;
  2. ours at 512K and 1M, then ours at 1.5M (fwd+bwd, h=16, d=128);
  3. the baselines at 512K and 1M;
  4. ours fwd+bwd at growing n (h=16, d=128) until OOM: the largest n.
A global budget (``--budget-s``) skips what is left ("skipped: budget"); a
case whose predicted time (from the same method's measured rate at a smaller
n) would overrun the budget is skipped too. The markdown file is rewritten
after every case, so a run killed from outside keeps its rows.

Usage::

    python benchmarks/bench_gpu.py --dry-run          # plan + FLOPs, no CUDA
    python benchmarks/bench_gpu.py --check            # correctness of every method, then exit
    python benchmarks/bench_gpu.py --out bench.md     # the benchmark (check first)
    python benchmarks/bench_gpu.py --ring-smoke       # ring (1 and 2 gloo processes) vs local op

Without a GPU it runs on the CPU (fp32; only useful as a smoke test with small
``--seq-lens``/``--configs``/pattern; flex backward is not supported there).

Modules: ``gpu_plan`` (FLOPs, cases, dry run), ``gpu_baselines`` (FlexAttention
and the method dispatch), ``gpu_timing`` (timing, memory, errors), ``gpu_check``
(``--check``), ``gpu_report`` (table, targets, files), ``gpu_ring_smoke``
(``--ring-smoke``); this file: the sweep driver and ``main``.
"""

from __future__ import annotations

import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from gpu_baselines import Methods, configure_dynamo  # noqa: E402
from gpu_check import run_check  # noqa: E402
from gpu_plan import (  # noqa: E402
    DTYPES,
    METHODS,
    Case,
    build_parser,
    dry_run,
    fwd_flops,
    plan_cases,
    search_sizes,
)
from gpu_report import BenchReport, Row  # noqa: E402
from gpu_ring_smoke import ring_smoke  # noqa: E402
from gpu_timing import (  # noqa: E402
    GiB,
    fmt_rate,
    free_memory,
    is_fatal,
    is_oom,
    matmul_rate,
    measure,
    short_error,
)


# --------------------------------------------------------------------------- #
# the benchmark
# --------------------------------------------------------------------------- #
class Bench(BenchReport):
    def __init__(self, args, device):
        self.args, self.device = args, device
        self.dtype = DTYPES[args.dtype] if device.type == "cuda" else torch.float32
        self.meth = Methods(args, device)
        self.rows: dict[tuple, Row] = {}
        self.t0 = time.perf_counter()
        self.sec_per_flop: dict[tuple, float] = {}
        self.best_backend: dict[tuple, set[str]] = {}
        self.broken: dict[str, str] = {}  # method[backend] -> reason
        self.fatal: str | None = None
        self.mm_rates: list[float] = []
        self.check_lines: list[str] = []
        self.check_ok: dict[str, bool] = {}
        self.header: list[str] = []
        self.search_note = ""
        self._text = ""
        self.checked: set[str] = set()

    # ------------------------------------------------------------------ util
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def flops(self, n, h, d, backward: bool) -> float:
        f = fwd_flops(n, h, d, self.args.segments, self.args.dilations, self.args.causal)
        return f * (3.5 if backward else 1.0)

    def row(self, h, d, n, m) -> Row:
        key = (h, d, n, m)
        if key not in self.rows:
            self.rows[key] = Row(h, d, n, m)
        return self.rows[key]

    def _inputs(self, n, h, d, count):
        shape = (1, n, h, d)
        return [torch.randn(shape, device=self.device, dtype=self.dtype) for _ in range(count)]

    def predicted_s(self, method, h, d, n, backward, runs) -> float | None:
        spf = self.sec_per_flop.get((method, h, d, backward))
        if spf is None:
            return None
        return spf * self.flops(n, h, d, backward) * runs

    # ------------------------------------------------------------- one pass
    def run_pass(self, case: Case, backward: bool, q, k, v, g) -> None:
        args, dev = self.args, self.device
        r = self.row(case.heads, case.dim, case.n, case.method)
        tag = "fwdbwd" if backward else "fwd"
        if self.fatal:
            setattr(r, f"{tag}_status", "skipped: CUDA context broken")
            return
        if self.elapsed() > args.budget_s:
            setattr(r, f"{tag}_status", "skipped: budget")
            print(f"skipped: budget ({case.method} n={case.n} {tag})", flush=True)
            return
        if case.method == "flex" and backward and dev.type != "cuda":
            setattr(r, f"{tag}_status", "n/a (no flex backward on CPU)")
            return
        backends = self.meth.backends(case.method)
        key = (case.method, case.heads, case.dim)
        if case.n > args.prune_after_n and key in self.best_backend:
            backends = [b for b in backends if b in self.best_backend[key]] or backends
        per_run = self.predicted_s(case.method, case.heads, case.dim, case.n, backward, 1)
        if per_run is not None and backends:
            # warm-up + the peak-memory run + timed runs (cut at --max-case-s)
            timed = min(per_run * args.iters, args.max_case_s + per_run)
            pred = len(backends) * (per_run * (args.warmup + 1) + timed)
            if self.elapsed() + pred > args.budget_s:
                setattr(r, f"{tag}_status", f"skipped: budget (predicted {pred:.0f} s)")
                print(f"skipped: budget ({case.method} n={case.n} {tag}, ~{pred:.0f} s)")
                return
        best = None
        statuses = []
        for backend in backends:
            name = f"{case.method}[{backend}]" if backend else case.method
            if case.method != "ours" and self.check_ok.get(name) is False:
                self.broken[name] = "check failed"
            if name in self.broken:
                statuses.append(f"{backend or case.method}: skipped ({self.broken[name]})")
                continue
            if backward:

                def fn(backend=backend, meth=self.meth):
                    out = meth.call(case.method, backend, q, k, v)
                    torch.autograd.grad(out, (q, k, v), g)

            else:

                def fn(backend=backend, meth=self.meth):
                    with torch.no_grad():
                        meth.call(case.method, backend, q, k, v)

            try:
                t_start = time.perf_counter()
                ms, peak, nrun, warm_s = measure(fn, dev, args.warmup, args.iters, args.max_case_s)
                spent = time.perf_counter() - t_start
                flops = self.flops(case.n, case.heads, case.dim, backward)
                note = f"{backend + ': ' if backend else ''}{ms:.2f} ms"
                if warm_s > 5 * ms * 1e-3 * max(args.warmup, 1) + 2:
                    note += f" (warm-up {warm_s:.0f} s)"
                statuses.append(note)
                print(
                    f"  {case.method}{'[' + backend + ']' if backend else ''} n={case.n} "
                    f"h={case.heads} d={case.dim} {tag}: {ms:.2f} ms, "
                    f"{fmt_rate(flops / (ms * 1e-3) / 1e12)} TFLOP/s, "
                    f"peak {'—' if peak is None else f'{peak / GiB:.2f} GiB'}, {nrun} runs, "
                    f"{spent:.1f} s",
                    flush=True,
                )
                if best is None or ms < best[0]:
                    best = (ms, peak, backend, nrun)
            except Exception as exc:
                oom = is_oom(exc)
                statuses.append(
                    f"{backend + ': ' if backend else ''}{'OOM' if oom else short_error(exc)}"
                )
                print(f"  {name} n={case.n} {tag}: {'OOM' if oom else short_error(exc, 300)}")
                if is_fatal(exc):
                    self.fatal = short_error(exc)
                elif not oom and case.method != "ours":
                    self.broken[name] = "failed earlier"
            finally:
                free_memory(dev)
            if self.fatal:
                break
        if best is not None:
            ms, peak, backend, nrun = best
            # the latest (largest) n of the best backend predicts the next one best
            spf = ms * 1e-3 / self.flops(case.n, case.heads, case.dim, backward)
            self.sec_per_flop[(case.method, case.heads, case.dim, backward)] = spf
            setattr(r, f"{tag}_ms", ms)
            setattr(r, f"{tag}_peak", peak)
            setattr(r, f"{tag}_backend", backend)
            setattr(r, f"{tag}_status", "ok")
            if len(backends) > 1:
                self.best_backend.setdefault(key, set()).add(backend)
        else:
            joined = "; ".join(statuses)
            setattr(r, f"{tag}_status", "OOM" if "OOM" in joined else (joined or "error"))
        if len(backends) > 1 or best is None:
            r.notes.append(f"{tag}: " + "; ".join(statuses))

    def run_case(self, case: Case) -> None:
        dev = self.device
        r = self.row(case.heads, case.dim, case.n, case.method)
        if case.search:
            r.fwd_status = "—"
        if self.fatal or self.elapsed() > self.args.budget_s:
            for p in case.passes:
                setattr(r, f"{p}_status", "skipped: budget" if not self.fatal else "skipped")
            return
        print(f"case: phase {case.phase} {case.method} n={case.n} h={case.heads} d={case.dim}")
        q = k = v = g = None
        try:
            q, k, v = self._inputs(case.n, case.heads, case.dim, 3)
            if "fwd" in case.passes:
                self.run_pass(case, False, q, k, v, None)
            if "fwdbwd" in case.passes:
                (g,) = self._inputs(case.n, case.heads, case.dim, 1)
                for t in (q, k, v):
                    t.requires_grad_(True)
                self.run_pass(case, True, q, k, v, g)
        except Exception as exc:  # inputs did not fit
            for p in case.passes:
                if getattr(r, f"{p}_status") == "not run":
                    setattr(r, f"{p}_status", "OOM (inputs)" if is_oom(exc) else short_error(exc))
            if is_fatal(exc):
                self.fatal = short_error(exc)
        finally:
            del q, k, v, g
            free_memory(dev)
        self.write()

    def run_checks(self, methods: list[str]) -> None:
        todo = [m for m in methods if m not in self.checked]
        if not todo or self.fatal:
            return
        self.checked.update(todo)
        if self.elapsed() > self.args.budget_s:
            self.check_lines += ["", f"check of {', '.join(todo)}: skipped (budget)"]
            return
        t = time.perf_counter()
        try:
            lines, ok = run_check(self.args, self.device, self.meth, todo)
        except Exception as exc:
            lines, ok = [f"check of {', '.join(todo)} stopped: {short_error(exc, 300)}"], {}
            if is_fatal(exc):
                self.fatal = short_error(exc)
            print(lines[0], flush=True)
        if self.check_lines:
            lines = ["", *lines]
        lines.append(f"(check of {', '.join(todo)}: {time.perf_counter() - t:.0f} s)")
        self.check_lines += lines
        self.check_ok.update({k: v for k, v in ok.items() if k != "ours" or "ours" in todo})

    def largest_ours(self, h: int, d: int) -> int | None:
        key = (h, d, "ours")
        ok = [
            r.n
            for r in self.rows.values()
            if (r.heads, r.dim, r.method) == key and r.fwdbwd_status == "ok"
        ]
        return max(ok, default=None)

    def _search_one(self, n: int) -> str:
        h, d = self.args.big_config
        case = Case(4, h, d, n, "ours", ("fwdbwd",), search=True)
        saved = self.args.iters, self.args.warmup
        self.args.iters, self.args.warmup = 1, 0
        try:
            self.run_case(case)
        finally:
            self.args.iters, self.args.warmup = saved
        return self.row(h, d, n, "ours").fwdbwd_status

    def search(self, start: int) -> None:
        """Ours fwd+bwd (h, d = --big-config) at growing n until it fails: the
        largest n that runs. If ``start`` itself failed for lack of memory,
        step down instead, to the first n that runs."""
        args = self.args
        h, d = args.big_config
        if not args.search_step or "ours" not in args.methods or self.fatal:
            return
        first = self.rows.get((h, d, start, "ours"))
        st = first.fwdbwd_status if first is not None else "not run"
        if st != "ok":
            if "OOM" not in st:
                self.search_note = f"no search: n={start} fwd+bwd {st}"
                return
            n = start - args.search_step
            while n > 0 and not self.fatal:
                done = self.largest_ours(h, d)
                if done is not None and done >= n:
                    break
                if self.elapsed() > args.budget_s:
                    self.search_note = f"downward search stopped by the budget at n={n}"
                    return
                st = self._search_one(n)
                if st == "ok" or "OOM" not in st:
                    break
                n -= args.search_step
            self.search_note = (
                f"n={start} did not fit; searched down in steps of {args.search_step}"
            )
            return
        for n in search_sizes(args, start):
            if self.fatal:
                return
            if self.elapsed() > args.budget_s:
                print("skipped: budget (largest-n search)")
                self.search_note = f"search stopped by the budget before n={n}"
                return
            st = self._search_one(n)
            if st != "ok":
                self.search_note = (
                    f"search stopped by the budget at n={n}"
                    if st.startswith("skipped")
                    else f"first n that did not run fwd+bwd: {n} ({st})"
                )
                return
        self.search_note = f"search reached --search-max-n {args.search_max_n}"

    # ----------------------------------------------------------------- main
    def run(self) -> int:
        args, dev = self.args, self.device
        props = ""
        if dev.type == "cuda":
            p = torch.cuda.get_device_properties(dev)
            props = (
                f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / GiB:.1f} GiB, "
                f"cc {p.major}.{p.minor}"
            )
        so = "not importable: " + str(self.meth.ra_error)
        if self.meth.ra is not None:
            so = getattr(getattr(self.meth.ra, "_C", None), "__file__", "?")
        self.header = [
            "## bench_gpu: ring_attention.dilated_attention vs baselines",
            "",
            f"device {dev} {props}; torch {torch.__version__}, CUDA {torch.version.cuda}; "
            f"extension {so}",
            f"pattern: segments {list(args.segments)}, dilations {list(args.dilations)}; "
            f"SDPA backends {list(args.sdpa_backends)}; flex "
            f"{'eager' if args.flex_eager or dev.type != 'cuda' else 'torch.compile'} "
            f"(dynamic={args.flex_dynamic}); warm-up {args.warmup}, median of <= {args.iters} "
            f"({'CUDA events' if dev.type == 'cuda' else 'host clock'})",
        ]
        if dev.type != "cuda":
            self.header.append("**no GPU: CPU smoke run, float32 — not a GPU measurement**")
        print("\n".join(self.header), flush=True)
        rate = matmul_rate(dev, args.mm_size, args.mm_iters)
        if rate is not None:
            self.mm_rates.append(rate)
            print(f"bf16 matmul rate: {rate:.0f} TFLOP/s", flush=True)
        if "flex" in args.methods and dev.type == "cuda":
            configure_dynamo()
        # flex is checked right before its first case (its compiles are slow)
        self.checked = set() if not args.no_check else set(METHODS)
        self.run_checks([m for m in args.methods if m != "flex"])
        self.write()
        cases = plan_cases(args)
        for case in cases:
            if case.method not in self.checked:
                self.run_checks([case.method])
            self.run_case(case)
        if args.big_n:
            self.search(args.big_n)
        rate = matmul_rate(dev, args.mm_size, args.mm_iters) if not self.fatal else None
        if rate is not None:
            self.mm_rates.append(rate)
        self.write()
        print()
        print(self._text)
        bad_check = [k for k, v in self.check_ok.items() if not v]
        if bad_check:
            print(f"check FAILED for: {', '.join(bad_check)}")
        return 1 if (self.fatal or bad_check) else 0


def main(argv=None) -> int:
    p = build_parser(__doc__)
    args = p.parse_args(argv)
    if len(args.segments) != len(args.dilations):
        p.error("--segments and --dilations need the same length")
    args.segments, args.dilations = tuple(args.segments), tuple(args.dilations)
    if args.dry_run:
        dry_run(args)
        return 0
    if args.ring_smoke:
        return ring_smoke(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    bench = Bench(args, device)
    if args.check:
        if "flex" in args.methods and device.type == "cuda":
            configure_dynamo()
        lines, ok = run_check(args, device, bench.meth)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
        bad = [k for k, v in ok.items() if not v]
        print("check: " + ("PASS" if not bad else f"FAILED for {', '.join(bad)}"))
        return 1 if bad else 0
    return bench.run()


if __name__ == "__main__":
    sys.exit(main())
