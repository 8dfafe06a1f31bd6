"""Benchmarks of ring_attention: one entry point, one subcommand per question.

    python benchmarks/bench.py local      # the local op vs baselines: time, memory, GFLOP/s vs n
    python benchmarks/bench.py ring       # the ring under torchrun: p = 1, 2, 4, 8, strong + weak
    python benchmarks/bench.py ring-run   # one ring run (the main job; run it under torchrun)
    python benchmarks/bench.py bytes      # bytes a rank sends per layer, from the exchange plans
    python benchmarks/bench.py llm        # grouped K/V heads and packed documents: bytes, time
    python benchmarks/bench.py modes      # ring, Ulysses and hybrid side by side (p = 4, CPU)
    python benchmarks/bench.py tiles      # one-thread timings of the CPU kernels' tile products
    python benchmarks/bench.py efficiency # the CPU kernels' share of sgemm's rate, in CPU time
    python benchmarks/bench.py check      # every method against a reference, then exit
    python benchmarks/bench.py report     # tables and plots again from the result files
    python benchmarks/bench.py views      # the GPU check of the dense per-branch path
    python benchmarks/bench.py host       # the dense path's host time per call (no GPU needed)

``python benchmarks/bench.py SUBCOMMAND --help`` describes every option. The
sweeps (local, ring) append one JSON line per finished point to
``OUT_DIR/{local,ring}.jsonl`` (format: benchmarks/README.md) and skip the
points already there, so a killed run resumes where it stopped; at the end
they write a markdown table (``.md``) and plots (``.png``) beside it.
Defaults depend on the device: small sizes and float32 on the CPU, the GPU
sizes and bfloat16 on CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

from . import compare, cpu_efficiency, cpu_tile_gemm, llm, measure, methods, modes
from .common import DEFAULT_OUT, DTYPES, RING_DILATIONS, RING_SEGMENTS, parse_config
from .local_report import finish_local
from .local_sweep import cmd_local
from .ring_run import cmd_ring_run
from .ring_sweep import cmd_ring, finish_ring
from .tables import cmd_bytes, cmd_check


# --------------------------------------------------------------------------- #
# bench.py report
# --------------------------------------------------------------------------- #
def cmd_report(a: argparse.Namespace) -> int:
    rc = 1
    for name, finish in (("local", finish_local), ("ring", finish_ring)):
        path = os.path.join(a.out_dir, f"{name}.jsonl")
        if os.path.exists(path):
            rc = finish(measure.ResultFile(path), a.out_dir)
    if rc:
        print(f"no local.jsonl or ring.jsonl in {a.out_dir}")
    return 0 if rc == 0 else 1


# --------------------------------------------------------------------------- #
# the command line
# --------------------------------------------------------------------------- #
def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on the CPU",
    )


def add_methods(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument(
        "--methods",
        nargs="+",
        choices=methods.METHODS,
        default=None,
        help=f"what to {verb} (default: all; fa4, flash-attn-4, on CUDA only)",
    )


def add_pattern(p: argparse.ArgumentParser, segs, dils) -> None:
    p.add_argument(
        "--segments",
        type=int,
        nargs="+",
        default=segs,
        help=f"segment lengths w_i (default {segs})",
    )
    p.add_argument(
        "--dilations",
        type=int,
        nargs="+",
        default=dils,
        help=f"dilation rates r_i (default {dils})",
    )
    p.add_argument("--causal", action="store_true", help="keys only at or before the query")


def add_ring_run_options(p: argparse.ArgumentParser) -> None:
    """The options of one ring run (``ring-run``, the main job)."""
    p.add_argument("--seq-len", type=int, default=8192, help="global sequence length (8192)")
    add_pattern(p, list(RING_SEGMENTS), list(RING_DILATIONS))
    p.add_argument("--batch", type=int, default=1, help="batch size (1)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (64)")
    p.add_argument(
        "--head-groups", action="store_true", help="branch i applies only to head group i"
    )
    p.add_argument(
        "--layout",
        choices=["contiguous", "zigzag"],
        default="contiguous",
        help="how the sequence is sharded; zigzag balances causal work (contiguous)",
    )
    add_dtype(p)
    p.add_argument("--backward", action="store_true", help="also time forward + backward")
    p.add_argument("--iters", type=int, default=3, help="timed calls; the median is shown (3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (1)")
    p.add_argument(
        "--check",
        choices=["auto", "yes", "no"],
        default="auto",
        help="compare with one process on rank 0 (auto: when it needs less than "
        "half of the free memory)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the global q, k, v (0)")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: one GPU per process when there are enough, else the CPU",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="process group backend (auto: NCCL on GPUs, gloo on the CPU)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads per process (0: cores / processes on this node)",
    )
    p.add_argument(
        "--timeout-min", type=float, default=10.0, help="process group timeout in minutes (10)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subparser per subcommand, in ``--help``'s order."""
    parser = argparse.ArgumentParser(
        prog="bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    add_local_parser(sub)
    add_ring_parser(sub)
    add_ring_run_parser(sub)
    add_bytes_parser(sub)
    llm.add_parser(sub)
    modes.add_parser(sub)
    cpu_tile_gemm.add_parser(sub)
    cpu_efficiency.add_parser(sub)
    add_check_parser(sub)
    compare.add_parser(sub)
    # its own parser: main() hands it the arguments (bench.py views --help)
    sub.add_parser("views", help="the GPU check of the dense per-branch path (views_check.py)")
    sub.add_parser("host", help="the dense path's host time per call (host_overhead.py)")
    add_report_parser(sub)
    return parser


def add_local_parser(sub: argparse._SubParsersAction) -> None:
    """``bench.py local``: the local op against the baselines."""
    p = sub.add_parser(
        "local",
        help="the local op vs baselines: time, memory, rate vs n",
        description=LOCAL_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_local_inputs(p)
    add_local_baselines(p)
    add_local_timing(p)
    add_output(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    p.set_defaults(func=cmd_local)


def add_local_inputs(p: argparse.ArgumentParser) -> None:
    """``local``: the device, the sizes, the pattern, the dtype, the methods and passes."""
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help=DEVICE_HELP)
    p.add_argument(
        "--seq-lens",
        type=int,
        nargs="+",
        help="n values (CPU: 2048 4096 8192; CUDA: 32768 131072 524288 1048576)",
    )
    p.add_argument(
        "--configs",
        type=parse_config,
        nargs="+",
        help="HEADSxHEAD_DIM (CPU: 8x64; CUDA: 12x64 16x128)",
    )
    p.add_argument("--batch", type=int, default=1, help="batch size (1)")
    add_pattern(p, list(methods.LONGNET_SEGMENTS), list(methods.LONGNET_DILATIONS))
    add_dtype(p)
    add_methods(p, "measure")
    p.add_argument(
        "--passes",
        nargs="+",
        choices=["fwd", "fwdbwd"],
        default=["fwd", "fwdbwd"],
        help="forward (no_grad), forward + backward (both)",
    )


def add_local_baselines(p: argparse.ArgumentParser) -> None:
    """``local``: which SDPA backends the baselines try, and up to which n."""
    p.add_argument(
        "--sdpa-backends",
        nargs="+",
        choices=methods.SDPA_BACKENDS,
        default=list(methods.SDPA_BACKENDS),
        help="CUDA: gather and dense try each, the fastest is kept",
    )
    p.add_argument(
        "--prune-after-n",
        type=int,
        default=32768,
        help="above this n only the SDPA backend that won at a smaller n is tried",
    )
    p.add_argument(
        "--dense-max-n", type=int, help="dense SDPA only up to this n (CPU 8192, CUDA 131072)"
    )
    p.add_argument(
        "--small-max-n",
        type=int,
        default=131072,
        help="order: every method up to this n first, then ours, then the baselines",
    )


def add_local_timing(p: argparse.ArgumentParser) -> None:
    """``local``: warm-up, rounds, time limits, memory, the fwd+bwd size search, threads."""
    p.add_argument("--warmup", type=int, default=1, help="untimed calls of each method first (1)")
    p.add_argument(
        "--iters", type=int, help="timed rounds over the methods, median reported (CPU 3, CUDA 5)"
    )
    p.add_argument(
        "--max-case-s",
        type=float,
        help="stop the round-robin timing of a (config, n, pass) after this many seconds "
        "per method, at least one round (CPU 20, CUDA 8)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="skip what would end after this many seconds (0: no budget); "
        "skipped points are not recorded, a re-run does them",
    )
    p.add_argument("--no-memory", action="store_true", help="do not measure peak memory")
    p.add_argument(
        "--flex-eager",
        action="store_true",
        help="FlexAttention without torch.compile (a slow reference; debugging)",
    )
    p.add_argument(
        "--search-step",
        type=int,
        help="then ours fwd+bwd at growing n in these steps until it does not fit "
        "(CPU 0 = off, CUDA 524288)",
    )
    p.add_argument(
        "--search-max-n", type=int, default=4194304, help="the search stops here (4194304)"
    )
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's)")


def add_ring_parser(sub: argparse._SubParsersAction) -> None:
    """``bench.py ring``: the ring's strong and weak scaling under torchrun."""
    p = sub.add_parser(
        "ring",
        help="the ring under torchrun: strong and weak scaling",
        description=RING_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8], help="p values")
    p.add_argument(
        "--scaling",
        nargs="+",
        choices=["strong", "weak"],
        default=["strong", "weak"],
        help="strong: n fixed; weak: n / p fixed (both)",
    )
    p.add_argument("--seq-len", type=int, default=8192, help="strong scaling: n (8192)")
    p.add_argument("--shard", type=int, default=2048, help="weak scaling: n / p (2048)")
    add_pattern(p, list(RING_SEGMENTS), list(RING_DILATIONS))
    p.add_argument("--batch", type=int, default=1, help="batch size (1)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (64)")
    p.add_argument(
        "--layout",
        choices=["contiguous", "zigzag"],
        default="contiguous",
        help="sharding of the sequence (contiguous)",
    )
    add_dtype(p)
    p.add_argument("--iters", type=int, default=3, help="timed calls per run, median reported (3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (1)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process (1)")
    p.add_argument("--check", action="store_true", help="also check against one process")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per torchrun launch")
    p.add_argument("--budget-s", type=float, default=0.0, help="0: no budget")
    add_output(p)
    p.set_defaults(func=cmd_ring)


def add_ring_run_parser(sub: argparse._SubParsersAction) -> None:
    """``bench.py ring-run``: one ring run (the main job)."""
    p = sub.add_parser(
        "ring-run",
        help="one ring run (the main job; launch it with torchrun)",
        description=RING_RUN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_ring_run_options(p)
    p.add_argument("--json", help="write everything (config, per-rank rows, check) here")
    p.add_argument("--verbose", action="store_true", help="more per-rank columns")
    p.add_argument("--quiet", action="store_true", help="print nothing (with --json)")
    p.add_argument(
        "--print-nproc",
        action="store_true",
        help="check the arguments, print how many processes scripts/run_ring.sh launches "
        "(one per GPU with two or more GPUs, else $NPROC, default 4) and exit",
    )
    p.set_defaults(func=cmd_ring_run)


def add_bytes_parser(sub: argparse._SubParsersAction) -> None:
    """``bench.py bytes``: bytes a rank sends per layer."""
    p = sub.add_parser("bytes", help="bytes a rank sends per layer, from the exchange plans")
    p.add_argument(
        "--seq-lens",
        type=int,
        nargs="+",
        default=[4096, 8192, 16384, 32768, 65536],
        help="n of the first table (4096 ... 65536)",
    )
    p.add_argument("--p", type=int, default=4, help="ranks of the bytes-vs-n table (4)")
    p.add_argument("--shard", type=int, default=4096, help="n / p of the second table (4096)")
    p.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=[2, 4, 8, 16, 32],
        help="p of the second table (2 4 8 16 32)",
    )
    p.add_argument("--heads", type=int, default=8, help="attention heads (8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (64)")
    add_pattern(p, list(RING_SEGMENTS), list(RING_DILATIONS))
    add_output(p, resumable=False)
    p.set_defaults(func=cmd_bytes)


def add_check_parser(sub: argparse._SubParsersAction) -> None:
    """``bench.py check``: every method against a reference."""
    p = sub.add_parser("check", help="every method against a reference, then exit")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help=DEVICE_HELP)
    p.add_argument("--n", type=int, help="sequence length (CPU 1000, CUDA 10240)")
    p.add_argument(
        "--configs", type=parse_config, nargs="+", default=[(6, 32)], help="HEADSxHEAD_DIM (6x32)"
    )
    p.add_argument("--segments", type=int, nargs="+", help="(CPU 128 384 1024; CUDA LongNet)")
    p.add_argument("--dilations", type=int, nargs="+", help="(CPU 1 3 8; CUDA LongNet)")
    add_dtype(p)
    add_methods(p, "check")
    p.add_argument("--flex-eager", action="store_true", help="FlexAttention without compile")
    p.set_defaults(func=cmd_check)


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    """``bench.py report``: tables and plots again from the result files."""
    p = sub.add_parser("report", help="tables and plots again from the result files")
    add_output(p, resumable=False)
    p.set_defaults(func=cmd_report)


def add_output(p: argparse.ArgumentParser, resumable: bool = True) -> None:
    p.add_argument(
        "--out-dir",
        default=DEFAULT_OUT,
        help=f"result files go here (default {os.path.relpath(DEFAULT_OUT)})",
    )
    if resumable:
        p.add_argument(
            "--redo",
            action="store_true",
            help="measure again the points already in the result file",
        )
        p.add_argument(
            "--write-tracked",
            action="store_true",
            help="write into result files that git tracks (published results); without it "
            "a sweep refuses to measure into them and leaves their reports as they are",
        )


DEVICE_HELP = "auto: CUDA when a GPU is visible, else the CPU"

LOCAL_HELP = """\
ring_attention.dilated_attention against baselines, on the same inputs:
  ours    ring_attention.dilated_attention
  gather  gather + PyTorch SDPA per branch and head-offset class, merged by LSE (exact)
  flex    FlexAttention, one call: mask_mod (reachable) + score_mod (+ log multiplicity): exact
  dense   SDPA over all n² pairs: a cost reference (the same function only for a dense pattern)
For each (n, heads x head_dim, method, pass): median time, effective rate = pattern FLOPs
(4·d per reached (query, key) pair forward, 3.5x for fwd+bwd, counted exactly) / time,
against the hardware rate measured in the same run (CPU: fp32 GEMMs at the kernel's tile
shapes; CUDA: a bf16 matmul), and peak memory (inputs + the growth of one call).
"""

RING_HELP = """\
ring_dilated_attention under torchrun for p = 1, 2, 4, 8 processes (gloo on the CPU, NCCL
on GPUs, one launch of `bench.py ring-run` per point): strong scaling (fixed n) and weak
scaling (fixed n / p). Per rank: wall and CPU time of fwd and fwd+bwd, peak memory, bytes
sent per layer (measured and from the exchange plan).
"""

RING_RUN_HELP = """\
Ring dilated attention across processes, checked against one process.

Launch under torchrun, one process per GPU (NCCL) or several CPU processes (gloo):
    torchrun --standalone --nproc-per-node=4 benchmarks/bench.py ring-run --backward
(`bash scripts/run_ring.sh [options]` sets up and launches it; without torchrun it runs
one process.)
Every rank builds the same seeded global q, k, v and runs ring_dilated_attention on its
shard; rank 0 prints per rank: wall and CPU time, GFLOP/s of the pattern, peak memory,
bytes sent per layer (measured and from the exchange plan), and the error of the gathered
result against ring_attention.dilated_attention on the whole sequence in one process.
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["views"]:  # imported here: it needs ring_attention, the baselines do not
        from . import views_check

        return views_check.main(argv[1:])
    if argv[:1] == ["host"]:
        from . import host_overhead

        return host_overhead.main(argv[1:])
    args = build_parser().parse_args(argv)
    with contextlib.suppress(BrokenPipeError):
        return args.func(args)
    return 0
