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
  which returns no LSE. This is done by overriding ``baselines.sdpa_with_lse``
  / ``baselines._sdpa_bwd`` for CUDA inputs (see ``_install_backend_hooks``);
* ``flex``   — FlexAttention (``torch.compile(flex_attention)``). The pattern is
  a SUM of branches (a key reached by two branches counts twice), which one
  ``mask_mod`` cannot express, so: one call per branch with that branch's
  ``mask_mod`` (same segment, query and key both active for the head:
  ``(t mod w) mod r == h mod r``, causal ``u <= t``), ``return_lse=True``,
  then the branches are merged by LSE (as gather + SDPA). Each branch's
  ``BlockMask`` is built analytically (``_branch_block_mask``; checked against
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
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import baselines  # noqa: E402
from baselines import dense_sdpa, gather_sdpa_dilated, pattern_pairs  # noqa: E402

LONGNET_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
LONGNET_DILATIONS = (1, 2, 4, 6, 12)
CONFIGS = ("12x64", "16x128")
SEQ_LENS = (32768, 131072, 524288, 1048576)
BIG_N = 1572864  # 1.5M = 48 * 32768
METHODS = ("ours", "gather", "flex", "dense")
SAME_PATTERN_BASELINES = ("gather", "flex")  # compute the same function as ours
SDPA_BACKENDS = ("flash", "cudnn", "efficient")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FLEX_BLOCK = 128
GiB = 1024**3


# --------------------------------------------------------------------------- #
# pattern bookkeeping (no CUDA)
# --------------------------------------------------------------------------- #
def parse_config(text: str) -> tuple[int, int]:
    try:
        h, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        msg = f"config must look like 12x64 (heads x dim), got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if h < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"config needs positive heads and dim, got {text!r}")
    return h, d


def fwd_flops(n: int, heads: int, dim: int, segs, dils, causal: bool) -> int:
    """Pattern FLOPs of one forward (4·d per reached pair, batch 1)."""
    return 4 * dim * pattern_pairs(n, heads, segs, dils, causal)


def dense_flops(n: int, heads: int, dim: int, causal: bool) -> int:
    pairs = n * (n + 1) // 2 if causal else n * n
    return 4 * dim * heads * pairs


def flex_visited_flops(n: int, heads: int, dim: int, segs, causal: bool) -> int:
    """FLOPs FlexAttention spends: every visited 128x128 block in full, all branches."""
    total_blocks = 0
    for w in segs:
        start = 0
        while start < n:
            length = min(w, n - start)
            nb = -(-length // FLEX_BLOCK)
            total_blocks += nb * (nb + 1) // 2 if causal else nb * nb
            start += w
    return 4 * dim * heads * total_blocks * FLEX_BLOCK * FLEX_BLOCK


def tensor_bytes(n: int, heads: int, dim: int, dtype: torch.dtype) -> int:
    return n * heads * dim * torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- #
# the plan
# --------------------------------------------------------------------------- #
@dataclass
class Case:
    phase: int
    heads: int
    dim: int
    n: int
    method: str
    passes: tuple[str, ...]  # subset of ("fwd", "fwdbwd")
    search: bool = False  # phase 4: ours fwd+bwd at growing n


def plan_cases(args) -> list[Case]:
    """The cases in execution order: the most informative per second first.

    1. every method but flex at the small n (32K, 128K), both configurations;
    2. ours at the large n (512K, 1M) and at --big-n (1.5M, h=16, d=128);
    3. flex at the small n (its compiles, and its check, come here);
    4. the baselines at the large n.
    (Phase 5, the largest-n search for ours, is not a case list: see Bench.search.)
    """
    cfgs = args.configs
    small = [n for n in args.seq_lens if n <= args.small_max_n]
    large = [n for n in args.seq_lens if n > args.small_max_n]
    both = ("fwd", "fwdbwd")
    cases: list[Case] = []

    def methods_for(n):
        return [m for m in args.methods if m != "dense" or n <= args.dense_max_n]

    for n in small:
        for h, d in cfgs:
            cases += [Case(1, h, d, n, m, both) for m in methods_for(n) if m != "flex"]
    if "ours" in args.methods:
        for n in large:
            for h, d in cfgs:
                cases.append(Case(2, h, d, n, "ours", both))
        if args.big_n:
            h, d = args.big_config
            cases.append(Case(2, h, d, args.big_n, "ours", both))
    if "flex" in args.methods:
        for n in small:
            for h, d in cfgs:
                cases.append(Case(3, h, d, n, "flex", both))
    for n in large:
        for h, d in cfgs:
            cases += [Case(4, h, d, n, m, both) for m in methods_for(n) if m != "ours"]
    return cases


def search_sizes(args, start: int) -> list[int]:
    if not args.search_step or "ours" not in args.methods:
        return []
    out, n = [], start + args.search_step
    while n <= args.search_max_n:
        out.append(n)
        n += args.search_step
    return out


def dry_run(args) -> None:
    segs, dils = args.segments, args.dilations
    dtype = DTYPES[args.dtype]
    print(
        f"# bench_gpu plan (dry run, no CUDA): dtype {args.dtype}, batch 1, causal={args.causal}, "
        f"segments={list(segs)}, dilations={list(dils)}, budget {args.budget_s:.0f} s"
    )
    print(
        f"# matmul rate: bf16 torch.mm {args.mm_size}^3 "
        f"({2 * args.mm_size**3 / 1e12:.2f} TFLOP per product), {args.mm_iters} timed"
    )
    if not args.no_check:
        print(
            f"# check first: n={args.check_n}, every configuration, methods {list(args.methods)} "
            "(dense only for a dense pattern) vs gather+SDPA in float32"
        )
    print(
        "| # | phase | n | h | d | method | passes | pairs | fwd TFLOP | fwd+bwd TFLOP "
        "| |q| GiB | 8·|q| GiB | flex visited TFLOP (fwd) | dense TFLOP (fwd) |"
    )
    print("|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    cases = plan_cases(args)
    for i, c in enumerate(cases, 1):
        pairs = pattern_pairs(c.n, c.heads, segs, dils, args.causal)
        ff = 4 * c.dim * pairs
        tb = tensor_bytes(c.n, c.heads, c.dim, dtype)
        fv = flex_visited_flops(c.n, c.heads, c.dim, segs, args.causal)
        df = dense_flops(c.n, c.heads, c.dim, args.causal)
        print(
            f"| {i} | {c.phase} | {c.n} | {c.heads} | {c.dim} | {c.method} | "
            f"{'+'.join(c.passes)} | {pairs} | {ff / 1e12:.3f} | {3.5 * ff / 1e12:.3f} | "
            f"{tb / GiB:.2f} | {8 * tb / GiB:.2f} | "
            f"{fv / 1e12:.3f} | {df / 1e12:.1f} |"
        )
    start = max([c.n for c in cases if c.method == "ours"], default=0)
    sizes = search_sizes(args, max(start, args.big_n or 0))
    if sizes:
        h, d = args.big_config
        print(
            f"phase 4: ours fwd+bwd h={h} d={d} at n = {sizes[0]}, ... up to {sizes[-1]} "
            f"(step {args.search_step}) until OOM or budget"
        )
    print(f"{len(cases)} cases; dense SDPA only for n <= {args.dense_max_n}")


# --------------------------------------------------------------------------- #
# gather + SDPA with a chosen CUDA backend
# --------------------------------------------------------------------------- #
_GATHER_BACKEND: list[str | None] = [None]  # None: baselines' own choice
_HOOKS_INSTALLED = [False]


def _lse_rows(lse: torch.Tensor, length: int) -> torch.Tensor:
    """Any backend's LSE ((B, H, L), padded (B, H, Lpad) or (B, H, L, 1)) -> (B, H, L)."""
    return lse.reshape(lse.shape[0], lse.shape[1], -1)[..., :length]


def _cuda_sdpa_fwd(backend: str, q, k, v, causal: bool, scale: float):
    aten = torch.ops.aten
    length = q.shape[-2]
    if backend == "flash":
        out, lse, cq, ck, mq, mk, rng, unused, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        extra = (cq, ck, mq, mk, rng, unused)
    elif backend == "cudnn":
        out, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        extra = (cq, ck, mq, mk, seed, off)
    elif backend == "efficient":
        out, lse, seed, off = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        extra = (seed, off)
    else:
        raise ValueError(f"unknown SDPA backend {backend!r}")
    state = ("bench_gpu", backend, tuple(lse.shape), extra)
    return out, _lse_rows(lse, length), state


def _cuda_sdpa_bwd(do, q, k, v, out, lse, state, causal: bool, scale: float):
    aten = torch.ops.aten
    _, backend, lse_shape, extra = state
    buf = torch.zeros(lse_shape, dtype=torch.float32, device=q.device)
    _lse_rows(buf, lse.shape[-1]).copy_(lse)
    if backend == "flash":
        cq, ck, mq, mk, rng, unused = extra
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, buf, cq, ck, mq, mk, 0.0, causal, rng, unused, scale=scale
        )
    elif backend == "cudnn":
        cq, ck, mq, mk, seed, off = extra
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, out, buf, seed, off, None, cq, ck, mq, mk, 0.0, causal, scale=scale
        )
    else:
        seed, off = extra
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out, buf, seed, off, 0.0, [True, True, True, False], causal,
            scale=scale,
        )  # fmt: skip
    return dq, dk, dv


def _install_backend_hooks() -> bool:
    """Route baselines' fused SDPA calls through ``_GATHER_BACKEND`` (CUDA only).

    Returns False (and leaves baselines alone) when baselines does not have the
    two functions: then gather uses its own backend choice only.
    """
    if _HOOKS_INSTALLED[0]:
        return True
    if not (hasattr(baselines, "sdpa_with_lse") and hasattr(baselines, "_sdpa_bwd")):
        return False
    orig_fwd, orig_bwd = baselines.sdpa_with_lse, baselines._sdpa_bwd

    def fwd(q, k, v, causal, scale):
        backend = _GATHER_BACKEND[0]
        if backend is not None and q.device.type == "cuda" and q.dtype != torch.float64:
            return _cuda_sdpa_fwd(backend, q, k, v, causal, scale)
        return orig_fwd(q, k, v, causal, scale)

    def bwd(do, q, k, v, out, lse, state, causal, scale):
        if isinstance(state, tuple) and state and state[0] == "bench_gpu":
            return _cuda_sdpa_bwd(do, q, k, v, out, lse, state, causal, scale)
        return orig_bwd(do, q, k, v, out, lse, state, causal, scale)

    baselines.sdpa_with_lse, baselines._sdpa_bwd = fwd, bwd
    _HOOKS_INSTALLED[0] = True
    return True


# --------------------------------------------------------------------------- #
# FlexAttention, one call per branch, LSE-merged
# --------------------------------------------------------------------------- #
def _flex_mod():
    from torch.nn.attention import flex_attention as fa

    return fa


def _make_mask_mod(w: int, r: int, causal: bool, device):
    # w and r are captured as tensors: one compiled graph serves every branch
    # (Python ints in the closure would be guarded on: one recompile per branch).
    w_t = torch.tensor(w, dtype=torch.int64, device=device)
    r_t = torch.tensor(r, dtype=torch.int64, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        o = h % r_t
        m = (q_idx // w_t) == (kv_idx // w_t)
        m = m & ((q_idx % w_t) % r_t == o) & ((kv_idx % w_t) % r_t == o)
        if causal:
            m = m & (kv_idx <= q_idx)
        return m

    return mask_mod


def _branch_block_mask(n: int, heads: int, w: int, r: int, causal: bool, device):
    """The BlockMask of one branch, built from the pattern's block structure.

    Query block i visits the key blocks of its own segment (up to the diagonal
    when causal). With r > 1 every visited block is partial (the mask_mod
    decides per head); with r == 1 blocks are full except, causal, the
    diagonal. Needs n and w to be multiples of the block size; otherwise
    ``create_block_mask`` is used (evaluates the mask on all n² pairs).
    """
    fa = _flex_mod()
    mask_mod = _make_mask_mod(w, r, causal, device)
    bs = FLEX_BLOCK
    if n % bs or w % bs:
        return fa.create_block_mask(mask_mod, None, heads, n, n, device=device, _compile=True)
    nb, wb = n // bs, w // bs
    width = nb  # BlockMask wants (B, H, q_blocks, kv_blocks) index tensors
    i = torch.arange(nb, device=device, dtype=torch.int32)
    lo = (i // wb) * wb
    hi = torch.clamp(lo + wb, max=nb)
    if causal:
        hi = torch.minimum(hi, i + 1)
    cols = lo[:, None] + torch.arange(width, device=device, dtype=torch.int32)[None, :]
    zeros = torch.zeros(nb, dtype=torch.int32, device=device)
    zcols = torch.zeros_like(cols)
    if r > 1:
        part_num, part_idx = hi - lo, cols
        full_num, full_idx = zeros, zcols
    elif not causal:
        part_num, part_idx = zeros, zcols
        full_num, full_idx = hi - lo, cols
    else:
        part_num = torch.ones_like(zeros)
        part_idx = zcols.clone()
        part_idx[:, 0] = i
        full_num, full_idx = i - lo, cols
    # entries past the count are ignored; keep them in range
    part_idx = torch.where(part_idx < nb, part_idx, 0)
    full_idx = torch.where(full_idx < nb, full_idx, 0)

    def b4(x):
        return x.reshape(1, 1, *x.shape).contiguous()

    return fa.BlockMask.from_kv_blocks(
        b4(part_num), b4(part_idx), b4(full_num), b4(full_idx),
        BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(n, n),
    )  # fmt: skip


def _dense_blocks(num: torch.Tensor, idx: torch.Tensor, nk: int) -> torch.Tensor:
    """(..., nq) counts + (..., nq, m) indices -> (..., nq, nk) 0/1 block matrix."""
    out = torch.zeros(*num.shape, nk, dtype=torch.int32, device=num.device)
    m = idx.shape[-1]
    valid = torch.arange(m, device=num.device) < num[..., None]
    src = valid.to(torch.int32)
    out.scatter_add_(-1, torch.where(valid, idx.long(), 0), src)
    return (out > 0).to(torch.int32)


class FlexDilated:
    """FlexAttention over the multiset pattern: one call per branch, LSE merge."""

    def __init__(self, segs, dils, causal: bool, compile_mode: str, dynamic: str):
        self.segs, self.dils, self.causal = list(segs), list(dils), causal
        self._masks: dict = {}
        fa = _flex_mod()
        if compile_mode == "eager":
            self.fn = fa.flex_attention
        else:
            dyn = {"auto": None, "on": True, "off": False}[dynamic]
            self.fn = torch.compile(fa.flex_attention, dynamic=dyn)

    def masks(self, n: int, heads: int, device):
        key = (n, heads, str(device))
        if key not in self._masks:
            self._masks.clear()  # one sequence length at a time (they can be large)
            self._masks[key] = [
                _branch_block_mask(n, heads, w, r, self.causal, device)
                for w, r in zip(self.segs, self.dils, strict=True)
            ]
        return self._masks[key]

    def __call__(self, q, k, v, scale=None, return_lse=False):
        """(B, N, H, D) in and out, like ra.dilated_attention."""
        n, heads = q.shape[1], q.shape[2]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        outs, lses = [], []
        for bm in self.masks(n, heads, q.device):
            o, lse = self.fn(qt, kt, vt, block_mask=bm, scale=scale, return_lse=True)
            outs.append(o)
            lses.append(lse)
        lse = torch.logsumexp(torch.stack(lses), dim=0)
        safe = torch.where(torch.isneginf(lse), 0.0, lse)
        acc = None
        for o, lb in zip(outs, lses, strict=True):
            term = o.float() * torch.exp(lb - safe)[..., None]
            acc = term if acc is None else acc + term
        out = acc.to(q.dtype).transpose(1, 2)
        return (out, lse) if return_lse else out


def _configure_dynamo():
    try:
        import torch._dynamo as dynamo

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))
        if hasattr(dynamo.config, "accumulated_recompile_limit"):
            dynamo.config.accumulated_recompile_limit = max(
                1024, dynamo.config.accumulated_recompile_limit
            )
    except Exception as exc:  # pragma: no cover - best effort
        print(f"note: could not raise dynamo's recompile limit: {exc}")


# --------------------------------------------------------------------------- #
# the calls being measured
# --------------------------------------------------------------------------- #
class Methods:
    def __init__(self, args, device):
        self.args, self.device = args, device
        self.segs, self.dils, self.causal = list(args.segments), list(args.dilations), args.causal
        self.ra = None
        self.ra_error = None
        try:
            import ring_attention as ra

            self.ra = ra
        except Exception as exc:  # the extension may have failed to build
            self.ra_error = f"{type(exc).__name__}: {exc}"
        self.hooks = device.type == "cuda" and _install_backend_hooks()
        self._flex = None

    def backends(self, method: str) -> list[str]:
        if method == "gather":
            return list(self.args.sdpa_backends) if self.hooks else ["default"]
        if method == "dense":
            return list(self.args.sdpa_backends) if self.device.type == "cuda" else ["default"]
        return [""]

    @property
    def flex(self) -> FlexDilated:
        if self._flex is None:
            mode = "eager" if (self.args.flex_eager or self.device.type != "cuda") else "compile"
            self._flex = FlexDilated(
                self.segs, self.dils, self.causal, mode, self.args.flex_dynamic
            )
        return self._flex

    def call(self, method: str, backend: str, q, k, v, return_lse=False):
        segs, dils, causal = self.segs, self.dils, self.causal
        if method == "ours":
            if self.ra is None:
                raise RuntimeError(f"ring_attention not importable: {self.ra_error}")
            return self.ra.dilated_attention(
                q, k, v, segs, dils, causal=causal, return_lse=return_lse
            )
        if method == "gather":
            _GATHER_BACKEND[0] = None if backend == "default" else backend
            try:
                return gather_sdpa_dilated(
                    q, k, v, segs, dils, causal=causal, return_lse=return_lse
                )
            finally:
                _GATHER_BACKEND[0] = None
        if method == "flex":
            return self.flex(q, k, v, return_lse=return_lse)
        if method == "dense":
            if backend == "default":
                return dense_sdpa(q, k, v, causal=causal)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            sdp = {
                "flash": SDPBackend.FLASH_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
            }[backend]
            with sdpa_kernel([sdp]):
                return dense_sdpa(q, k, v, causal=causal)
        raise ValueError(f"unknown method {method!r}")


# --------------------------------------------------------------------------- #
# timing and memory
# --------------------------------------------------------------------------- #
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(fn, device, warmup: int, iters: int, max_s: float):
    """Median ms of ``fn`` (CUDA events), peak bytes of one call, runs, warm-up s."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    _sync(device)
    warm_s = time.perf_counter() - t0
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    times = []
    t1 = time.perf_counter()
    for _ in range(iters):
        if device.type == "cuda":
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        else:
            s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - s) * 1e3)
        if time.perf_counter() - t1 > max_s:
            break
    return statistics.median(times), peak, len(times), warm_s


def matmul_rate(device, size: int, iters: int) -> float | None:
    """bf16 torch.mm TFLOP/s on random data (median of ``iters``); None off CUDA."""
    if device.type != "cuda":
        return None
    ab = [torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2)]
    ms, _, _, _ = measure(lambda: torch.mm(ab[0], ab[1]), device, 3, iters, 10.0)
    ab.clear()
    _free(device)
    return 2 * size**3 / (ms * 1e-3) / 1e12


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, _OOM) or "out of memory" in str(exc).lower()


def _is_fatal(exc: BaseException) -> bool:
    s = str(exc)
    return any(
        p in s
        for p in ("illegal memory access", "device-side assert", "unspecified launch failure",
                  "CUDA error: an illegal", "misaligned address")
    )  # fmt: skip


def _rate(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def _short(exc: BaseException, limit: int = 90) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:limit]}"


# --------------------------------------------------------------------------- #
# correctness check of every method (small n)
# --------------------------------------------------------------------------- #
def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return math.inf
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_block_masks(args, device) -> list[str]:
    """Analytic BlockMask == create_block_mask's (partial and full blocks)."""
    fa = _flex_mod()
    lines = []
    heads = 12
    for n in (1024, 1280, 4096):
        for w, r in ((128, 1), (256, 2), (512, 4), (384, 3), (1024, 6), (2048, 12), (8192, 2)):
            for causal in (False, True):
                ours = _branch_block_mask(n, heads, w, r, causal, device)
                ref = fa.create_block_mask(
                    _make_mask_mod(w, r, causal, device), None, heads, n, n, device=device
                )
                nb = n // FLEX_BLOCK
                for part in ("kv", "full_kv"):
                    a = _dense_blocks(
                        getattr(ours, f"{part}_num_blocks"), getattr(ours, f"{part}_indices"), nb
                    )
                    b = _dense_blocks(
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
        _GATHER_BACKEND[0] = None
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
                    errs = [_rel(out, ro)]
                    errs.append(_rel(lse, rl) if lse is not None else float("nan"))
                    if do_bwd:
                        grads = torch.autograd.grad(out, (q, k, v), g)
                        errs += [_rel(a, b) for a, b in zip(grads, rgrads, strict=True)]
                    else:
                        errs += [float("nan")] * 3
                    good = errs[0] <= tol_out and all(
                        e <= tol_grad for e in errs[1:] if not math.isnan(e)
                    )
                    if m == "ours":
                        ours_out = out.detach()
                        errs.append(float("nan"))
                    else:
                        errs.append(_rel(out, ours_out) if ours_out is not None else float("nan"))
                    row += [f"{e:.2e}" if not math.isnan(e) else "—" for e in errs]
                    row.append("ok" if good else "**FAIL**")
                except Exception as exc:
                    good = False
                    row += ["—"] * 6 + [f"**error** {_short(exc)}"]
                    if _is_fatal(exc):
                        lines.append("| " + " | ".join(row) + " |")
                        raise
                ok[name] = ok.get(name, True) and good
                line = "| " + " | ".join(row) + " |"
                lines.append(line)
                print(line, flush=True)
        del qr, kr, vr, gr, ro, rl, rgrads, ours_out
        _free(device)
    if "flex" in methods:
        try:
            bm_lines = check_block_masks(args, device)
        except Exception as exc:
            bm_lines = [f"block masks: error {_short(exc)}"]
        ok["flex-block-mask"] = bm_lines[-1].endswith("create_block_mask")
        for s in bm_lines:
            print(s, flush=True)
        lines += ["", *bm_lines]
    return lines, ok


# --------------------------------------------------------------------------- #
# the benchmark
# --------------------------------------------------------------------------- #
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


class Bench:
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
                    f"{_rate(flops / (ms * 1e-3) / 1e12)} TFLOP/s, "
                    f"peak {'—' if peak is None else f'{peak / GiB:.2f} GiB'}, {nrun} runs, "
                    f"{spent:.1f} s",
                    flush=True,
                )
                if best is None or ms < best[0]:
                    best = (ms, peak, backend, nrun)
            except Exception as exc:
                oom = _is_oom(exc)
                statuses.append(
                    f"{backend + ': ' if backend else ''}{'OOM' if oom else _short(exc)}"
                )
                print(f"  {name} n={case.n} {tag}: {'OOM' if oom else _short(exc, 300)}")
                if _is_fatal(exc):
                    self.fatal = _short(exc)
                elif not oom and case.method != "ours":
                    self.broken[name] = "failed earlier"
            finally:
                _free(dev)
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
                    setattr(r, f"{p}_status", "OOM (inputs)" if _is_oom(exc) else _short(exc))
            if _is_fatal(exc):
                self.fatal = _short(exc)
        finally:
            del q, k, v, g
            _free(dev)
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
            lines, ok = [f"check of {', '.join(todo)} stopped: {_short(exc, 300)}"], {}
            if _is_fatal(exc):
                self.fatal = _short(exc)
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

    # --------------------------------------------------------------- output
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
                    cells += [f"{ms:.2f}", _rate(tf)]
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
            _configure_dynamo()
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


# --------------------------------------------------------------------------- #
# ring smoke test: ring_dilated_attention (1 process, 2 gloo processes) == local op
# --------------------------------------------------------------------------- #
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
    errs = {"out": _rel(out, shard(ref.detach()))}
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        errs[name] = _rel(a, shard(b))
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
        print(f"world 1: error {_short(exc, 500)}")
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
            print(f"world {args.ring_world} (gloo, one device): error {_short(exc, 2000)}")
            failed += 1
    print(
        f"ring smoke: {'PASS' if not failed else f'{failed} FAILED'} "
        f"(rel. tolerance fp32 {tol['float32']:g}, bf16 {tol['bfloat16']:g}; "
        f"{time.perf_counter() - t0:.0f} s)"
    )
    return 1 if failed else 0


# --------------------------------------------------------------------------- #
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the plan and FLOPs; no CUDA")
    p.add_argument("--check", action="store_true", help="correctness of every method, then exit")
    p.add_argument("--no-check", action="store_true", help="skip the check before the benchmark")
    p.add_argument("--ring-smoke", action="store_true", help="ring == local op, then exit")
    p.add_argument("--ring-world", type=int, default=2, help="gloo processes in --ring-smoke")
    p.add_argument(
        "--configs",
        type=parse_config,
        nargs="+",
        default=[parse_config(c) for c in CONFIGS],
        help="heads x head_dim, e.g. 12x64 16x128",
    )
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    p.add_argument(
        "--small-max-n",
        type=int,
        default=131072,
        help="n <= this: phase 1 (all methods first); larger n: phases 2 and 3",
    )
    p.add_argument(
        "--prune-after-n",
        type=int,
        default=32768,
        help="above this n, gather/dense time only the SDPA backends that won "
        "at a smaller n (same h, d)",
    )
    p.add_argument("--big-n", type=int, default=BIG_N, help="ours fwd+bwd at this n (0: off)")
    p.add_argument("--big-config", type=parse_config, default=parse_config("16x128"))
    p.add_argument(
        "--search-step",
        type=int,
        default=262144,
        help="phase 4: ours fwd+bwd at big-n + k*step until OOM (0: off)",
    )
    p.add_argument("--search-max-n", type=int, default=4194304)
    p.add_argument("--segments", type=int, nargs="+", default=list(LONGNET_SEGMENTS))
    p.add_argument("--dilations", type=int, nargs="+", default=list(LONGNET_DILATIONS))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument(
        "--sdpa-backends",
        nargs="+",
        choices=SDPA_BACKENDS,
        default=list(SDPA_BACKENDS),
        help="gather and dense: the fastest of these is reported (CUDA)",
    )
    p.add_argument("--dense-max-n", type=int, default=131072)
    p.add_argument("--flex-eager", action="store_true", help="no torch.compile (debug only)")
    p.add_argument(
        "--flex-dynamic",
        choices=["auto", "on", "off"],
        default="on",
        help="torch.compile(dynamic=None/True/False) for flex",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--max-case-s",
        type=float,
        default=8.0,
        help="stop repeating one timing after this many seconds (>= 1 run)",
    )
    p.add_argument("--budget-s", type=float, default=360.0)
    p.add_argument("--check-n", type=int, default=10240)
    p.add_argument("--mm-size", type=int, default=8192)
    p.add_argument("--mm-iters", type=int, default=20)
    p.add_argument("--out", help="markdown report (rewritten after every case)")
    p.add_argument("--json", help="also the raw rows as JSON")
    return p


def main(argv=None) -> int:
    p = build_parser()
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
            _configure_dynamo()
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
