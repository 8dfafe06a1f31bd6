"""The capacity planner's options turned into a :class:`~.capacity.Setup`:
the rules between options, checked once before planning
(:func:`check_args`, :class:`OptionError`), the defaults per device
(:func:`build_setup`), and :class:`Impossible`, the error a request that
cannot be met raises."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from ..core.pattern import Pattern
from .capacity import Setup
from .modes import grid_for
from .presets import MODELS, ModelShape
from .throughput import load_records
from .timing import LINKS, Link

__all__ = ["Impossible", "OptionError", "build_setup", "check_args"]


class Impossible(Exception):
    """A request that cannot be met; the message says why (after the
    ``report`` lines printed so far)."""

    def __init__(self, message: str, report: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.report = list(report)


class OptionError(ValueError):
    """A bad option or combination of options, found before planning; the
    parser reports it as argparse does (``argument OPTION: ...``, exit 2)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"argument {option}: {message}")


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _ranks(args: argparse.Namespace) -> int | None:
    return args.gpus if args.gpus is not None else args.processes


def _device(args: argparse.Namespace) -> str:
    return args.device or (
        "cuda" if args.gpus is not None or args.gpu_memory is not None else "cpu"
    )


def _memory(args: argparse.Namespace, device: str, ranks: int) -> tuple[int, int]:
    """Bytes per rank and the reserve kept free of them."""
    if device == "cuda":
        memory = args.gpu_memory or args.memory or 80 * 10**9
    else:
        memory = (args.memory or _host_memory()) // ranks
    kind, value = args.reserve or (("%", 10.0) if device == "cuda" else ("bytes", 400 * 10**6))
    return memory, int(memory * value / 100) if kind == "%" else int(value)


def check_args(args: argparse.Namespace) -> None:
    """The rules between options, before any planning (each option's own
    range is its parser type's, :mod:`.cli_types`); raises
    :class:`OptionError` naming the option. Fills in the attention shape a
    ``--model`` gives (``--heads``, ``--kv-heads``, ``--head-dim`` left out)."""
    ranks = _ranks(args)
    if args.gpus is not None and args.processes is not None:
        raise OptionError("--processes", "give either --gpus or --processes, not both")
    device = _device(args)
    if device == "cpu" and args.gpu_memory is not None:
        raise OptionError("--gpu-memory", "is for GPUs; with --device cpu give --memory")
    if args.model:
        model = MODELS[args.model]
        args.heads = model.heads if args.heads is None else args.heads
        args.kv_heads = model.kv_heads if args.kv_heads is None else args.kv_heads
        args.head_dim = model.head_dim if args.head_dim is None else args.head_dim
    args.heads = 16 if args.heads is None else args.heads
    args.kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    args.head_dim = 128 if args.head_dim is None else args.head_dim
    if args.heads % args.kv_heads:
        raise OptionError(
            "--kv-heads", f"kv_heads must divide heads: got --heads {args.heads}, --kv-heads "
            f"{args.kv_heads}"
        )  # fmt: skip
    if (args.layers is None) != (args.hidden is None):  # name the one given
        raise OptionError(
            "--hidden" if args.layers is None else "--layers",
            "a whole model needs both --layers and --hidden",
        )
    if args.layers is None:  # the shape of a model of one's own, else unused
        for option, given in (("--ffn", args.ffn is not None), ("--gated", args.gated),
                              ("--vocab", args.vocab != 0)):  # fmt: skip
            if given:
                raise OptionError(
                    option, "shapes a whole model of --layers and --hidden (a --model preset has "
                    "its own): give them, or leave it out"
                )  # fmt: skip
    if (args.segments is None) != (args.dilations is None):
        raise OptionError(
            "--dilations" if args.segments is None else "--segments",
            "--segments and --dilations go together",
        )
    if args.segments is not None:
        try:
            Pattern(args.segments, args.dilations)
        except ValueError as exc:
            raise OptionError("--segments/--dilations", str(exc)) from None
    if ranks is None and args.seq_len is None:
        raise OptionError(
            "--seq-len", "give --gpus/--processes (the longest sequence) or --seq-len (the "
            "fewest ranks)"
        )  # fmt: skip
    if ranks is None and device == "cpu":
        raise OptionError(
            "--seq-len", "the fewest-ranks search is for GPUs (CPU processes on one machine "
            "share its memory): give --gpus or --gpu-memory, or --processes"
        )  # fmt: skip
    memory, reserve = _memory(args, device, ranks or 1)
    if reserve >= memory:
        raise OptionError(
            "--reserve", f"{reserve:,} bytes leave nothing of the {memory:,} bytes per rank"
        )
    if args.bench_json:
        try:
            load_records(args.bench_json)
        except (OSError, ValueError) as exc:
            raise OptionError("--bench-json", f"cannot read its records: {exc}") from None
    if args.mode != "ring":
        if ranks is None or args.seq_len is None:
            raise OptionError(
                "--mode", f"--mode {args.mode} needs --gpus/--processes and --seq-len"
            )
        if args.mode in ("hybrid", "compare"):
            try:
                grid_for("hybrid", ranks, args.gpus_per_node, args.ulysses)
            except ValueError as exc:
                raise OptionError(
                    "--ulysses" if args.ulysses else "--gpus-per-node", str(exc)
                ) from None


def build_setup(args: argparse.Namespace, ranks: int) -> Setup:
    """The :class:`Setup` the arguments (checked by :func:`check_args`)
    describe, on ``ranks`` processes."""
    device = _device(args)
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    model = None
    if args.model:
        model = MODELS[args.model]
    if args.layers is not None:
        if heads * head_dim != args.hidden:
            print(
                f"note: heads x head_dim = {heads * head_dim} differs from --hidden {args.hidden} "
                "(the projections map between them)"
            )
        model = ModelShape(
            args.layers, args.hidden, heads, kv_heads, head_dim,
            4 * args.hidden if args.ffn is None else args.ffn, args.gated, args.vocab,
        )  # fmt: skip
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    memory, reserve = _memory(args, device, ranks)
    default_link = LINKS[device][0]
    link = Link(
        default_link.gbps if args.link_gbps is None else args.link_gbps,
        default_link.latency_us if args.link_latency_us is None else args.link_latency_us,
        default_link.message_us if args.message_us is None else args.message_us,
    )
    records = tuple(load_records(args.bench_json)) if args.bench_json else None
    far = {"off": 0, "auto": link.far_bytes}.get(args.far_bytes, args.far_bytes)
    return Setup(
        ranks=ranks,
        device=device,
        memory=memory,
        reserve=reserve,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        batch=args.batch,
        dtype=dtype,
        pattern=None if args.segments else args.pattern,
        segments=tuple(args.segments) if args.segments else None,
        dilations=tuple(args.dilations) if args.dilations else None,
        causal=args.causal,
        head_groups=args.head_groups,
        head_offsets=args.head_offsets,
        document_length=args.document_length,
        layout=args.layout,
        records=records,
        tflops=args.tflops,
        threads=args.threads,
        link=link,
        far_bytes=far,
        matmul_tflops=args.matmul_tflops,
        model=model,
        checkpointing=not args.no_checkpointing,
        shard_params=not args.replicate_params,
        source=args.source,
    )
