"""The capacity planner's options (``python -m ring_attention.planner
--help``): the parser, the range of every option (checked while parsing,
:mod:`.cli_types`; the rules between options: :func:`.cli_setup.check_args`),
the link defaults it prints."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..core.geometry import MAX_SEQ_LEN
from ..core.layout import LAYOUTS
from ..core.pairs import MAX_HEADS
from ..core.pattern import HEAD_OFFSETS
from .cli_setup import OptionError, check_args
from .cli_types import (
    MAX_BYTES,
    MICROSECONDS,
    RANKS,
    RATE,
    int_in,
    number_in,
    parse_size,
    reserve,
    size_in,
)
from .memory import DTYPE_BYTES
from .modes_cli import add_arguments as add_mode_arguments
from .presets import MODELS, PATTERNS
from .throughput import dtype_name
from .timing import LINKS

__all__ = ["LINK_DEFAULTS", "build_parser", "parse_args", "parse_size"]

#: Link defaults per device type: (Gbit/s, latency in us, why) (:data:`.timing.LINKS`).
LINK_DEFAULTS = {k: (link.gbps, link.latency_us, why) for k, (link, why) in LINKS.items()}


def _tflops(text: str) -> tuple[float, float]:
    try:
        parts = [RATE(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        parts = []
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(
            f"expected F or F,B (TFLOP/s, finite, in [1e-06, 1e+09]), got {text!r}"
        )
    return (parts[0], parts[-1])


def _dtype(text: str) -> str:
    name = dtype_name(text)
    if name not in DTYPE_BYTES:
        raise argparse.ArgumentTypeError(
            f"expected one of {sorted(DTYPE_BYTES)} (or bf16, fp16, fp32, fp64), got {text!r}"
        )
    return name


def _far_bytes(text: str) -> str | int:
    """``--far-bytes``: ``off``, ``auto`` or a size."""
    if text in ("off", "auto"):
        return text
    try:
        return size_in(0, MAX_BYTES)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"--far-bytes must be off, auto or a size in [0, {MAX_BYTES:.4g}], got {text!r}"
        ) from None


_MEMORY = size_in(1, MAX_BYTES)
_HEADS = int_in(1, MAX_HEADS)
_LENGTH = size_in(1, MAX_SEQ_LEN)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """One default per option in ``--help``: the help's own words where they
    name it, else ``(default: X)``; flags read ``(default: off)``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, argparse.SUPPRESS)
            or not (action.option_strings)
        ):
            return text
        if action.nargs == 0:  # store_true
            return f"{text} (default: off)".strip() if action.default is False else text
        return f"{text} (default: %(default)s)".strip()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the planner's arguments: a bad option, or a bad
    combination of them, exits 2 with argparse's message naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except OptionError as exc:
        parser.error(str(exc))
    return args


def build_parser() -> argparse.ArgumentParser:
    """The planner's command line."""
    ap = argparse.ArgumentParser(
        prog="python -m ring_attention.planner",
        description=(
            "Capacity planner for ring dilated attention: the longest sequence that fits per "
            "rank, the predicted time per layer and the bytes per link, per attention layer "
            "and for a whole model. With --seq-len and no rank count: the fewest ranks."
        ),
        formatter_class=_HelpFormatter,
    )
    ap.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr (a line rewritten on a terminal; elsewhere a line per "
        "evaluation once a search has run 10 s)",
    )
    ap.add_argument(
        "--time-limit",
        type=number_in(0, 1e6, above=True),
        default=600,
        help="seconds a search (the fewest ranks, the longest sequence) may run: past them it "
        "stops after the evaluation under way and says what it found",
    )
    g = ap.add_argument_group("ranks")
    g.add_argument("--gpus", type=RANKS, help="ranks, one per GPU (device cuda)")
    g.add_argument("--processes", type=RANKS, help="ranks as processes (device from --device)")
    g.add_argument(
        "--device", choices=["cuda", "cpu"], help="default: cuda with --gpus or --gpu-memory"
    )
    g.add_argument("--gpu-memory", type=_MEMORY, help="memory per GPU (default 80GB)")
    g.add_argument(
        "--memory",
        type=_MEMORY,
        help="with --device cpu: the host memory shared by all processes (default: this "
        "machine's); on GPUs the same as --gpu-memory",
    )
    g.add_argument(
        "--reserve",
        type=reserve(MAX_BYTES),
        default=None,
        help="memory kept free per rank: bytes (8GB) or a share (10%%); default 10%% on GPUs "
        "(CUDA context, allocator, NCCL), 400MB per CPU process (interpreter, torch, gloo)",
    )
    g.add_argument("--threads", type=int_in(1, 4096), default=1, help="CPU threads per process")
    g = ap.add_argument_group("attention")
    g.add_argument("--heads", type=_HEADS, default=None, help="query heads (default 16)")
    g.add_argument("--kv-heads", type=_HEADS, default=None, help="K/V heads (default: --heads)")
    g.add_argument("--head-dim", type=int_in(1, 2**16), default=None, help="default 128")
    g.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        help="bf16, fp16, float32, float64 (default bf16 on cuda, float32 on cpu)",
    )
    g.add_argument("--batch", type=int_in(1, 2**20), default=1, help="sequences per step")
    g.add_argument("--pattern", default="longnet", choices=sorted(PATTERNS), help="preset branches")
    g.add_argument(
        "--segments",
        type=_LENGTH,
        nargs="+",
        help="explicit segment lengths (default: --pattern's)",
    )
    g.add_argument(
        "--dilations",
        type=int_in(1, MAX_SEQ_LEN),
        nargs="+",
        help="explicit dilation rates (default: --pattern's)",
    )
    g.add_argument("--causal", action="store_true", help="keys only at or before the query")
    g.add_argument("--head-groups", action="store_true", help="one head group per branch")
    g.add_argument(
        "--head-offsets", default="modulo", choices=list(HEAD_OFFSETS), help="offset rule"
    )
    g.add_argument("--document-length", type=_LENGTH, help="pack documents of this length")
    g.add_argument("--layout", default="contiguous", choices=list(LAYOUTS), help="sharding")
    g.add_argument("--seq-len", type=_LENGTH, help="evaluate this length (e.g. 1e9)")
    g = ap.add_argument_group("whole model (sequence-parallel training)")
    g.add_argument("--model", choices=sorted(MODELS), help="a preset shape (sets the heads too)")
    g.add_argument(
        "--layers",
        type=int_in(1, 2**16),
        help="blocks of a whole model, with --hidden (default: --model's, else none)",
    )
    g.add_argument(
        "--hidden",
        type=int_in(1, 2**24),
        help="model width, with --layers (default: --model's, else none)",
    )
    g.add_argument("--ffn", type=int_in(1, 2**26), help="MLP width (default 4 x hidden)")
    g.add_argument("--gated", action="store_true", help="gated MLP (SwiGLU)")
    g.add_argument("--vocab", type=int_in(0, 2**30), default=0, help="vocabulary (0: no embedding)")
    g.add_argument("--no-checkpointing", action="store_true", help="keep every activation")
    g.add_argument("--replicate-params", action="store_true", help="no FSDP/ZeRO-3 sharding")
    g.add_argument(
        "--matmul-tflops",
        type=RATE,
        help="dense matmul rate (default: assumed per device, printed)",
    )
    g = ap.add_argument_group("rates and links")
    g.add_argument("--bench-json", help="benchmark records (ring_attention/planner/throughput.py)")
    g.add_argument(
        "--tflops",
        type=_tflops,
        help="kernel rate F or F,B (forward, fwd+bwd; default: --bench-json's, "
        "else assumed per device and dtype, printed)",
    )
    g.add_argument(
        "--link-gbps",
        type=RATE,
        help="link bandwidth per rank each way, Gbit/s (default "
        f"{LINK_DEFAULTS['cuda'][0]:g} on cuda, {LINK_DEFAULTS['cpu'][0]:g} on cpu)",
    )
    g.add_argument(
        "--link-latency-us",
        type=MICROSECONDS,
        help="latency per transfer, microseconds (default "
        f"{LINK_DEFAULTS['cuda'][1]:g} on cuda, {LINK_DEFAULTS['cpu'][1]:g} on cpu)",
    )
    g.add_argument(
        "--message-us",
        type=MICROSECONDS,
        help="cost of each further message in one batch (the far group), microseconds "
        f"(default {LINKS['cuda'][0].message_us:g} on cuda, {LINKS['cpu'][0].message_us:g} on cpu)",
    )
    g.add_argument(
        "--far-bytes",
        type=_far_bytes,
        default="off",
        help="the ring's RING_ATTENTION_FAR_BYTES: transfers of at most this many K/V bytes "
        "travel in one far group per pass ('auto': latency x bandwidth; 'off': the ring "
        "alone, the default); both schedules are printed",
    )
    g.add_argument(
        "--source",
        default="auto",
        choices=["auto", "plan", "analytic"],
        help="exchanged rows: the ring's plan (small sizes) or closed forms",
    )
    add_mode_arguments(ap)
    return ap
