"""The plan of benchmarks/bench_gpu.py: the pattern's FLOPs and tensor bytes,
the cases in execution order, the largest-n search sizes, ``--dry-run`` (no
CUDA needed) and the command-line options that shape the plan.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from baselines import LONGNET_DILATIONS, LONGNET_SEGMENTS, SDPA_BACKENDS, pattern_pairs
from gpu_timing import GiB

CONFIGS = ("12x64", "16x128")
SEQ_LENS = (32768, 131072, 524288, 1048576)
BIG_N = 1572864  # 1.5M = 48 * 32768
METHODS = ("ours", "gather", "flex", "dense")
SAME_PATTERN_BASELINES = ("gather", "flex")  # compute the same function as ours
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FLEX_BLOCK = 128


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


# --------------------------------------------------------------------------- #
# the command line
# --------------------------------------------------------------------------- #
def build_parser(description: str) -> argparse.ArgumentParser:
    """bench_gpu.py's command line (``description``: its help text)."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
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
