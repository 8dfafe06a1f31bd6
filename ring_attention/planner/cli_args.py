"""The capacity planner's options (``python -m ring_attention.planner
--help``): the parser, its size and rate types, the link defaults it prints."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from ..core.layout import LAYOUTS
from ..core.pattern import HEAD_OFFSETS
from .modes_cli import add_arguments as add_mode_arguments
from .presets import MODELS, PATTERNS
from .timing import LINKS

__all__ = ["LINK_DEFAULTS", "build_parser", "parse_args", "parse_size"]

_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "b": 10**9,  # a billion tokens
    "t": 10**12,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

#: Link defaults per device type: (Gbit/s, latency in us, why) (:data:`.timing.LINKS`).
LINK_DEFAULTS = {k: (link.gbps, link.latency_us, why) for k, (link, why) in LINKS.items()}


def parse_size(text: str) -> int:
    """``"80GB"`` (10^9), ``"24GiB"`` (2^30), ``"1e9"``, ``"64K"``, ``"1B"`` -> an int."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 80GB, 24GiB, 1e9, 64K)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _tflops(text: str) -> tuple[float, float]:
    parts = [float(x) for x in text.split(",")]
    if len(parts) not in (1, 2) or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"--tflops takes F or F,B (positive), got {text!r}")
    return (parts[0], parts[-1])


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
    """Parse the planner's arguments."""
    return build_parser().parse_args(argv)


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
        "--quiet", action="store_true", help="no progress line on stderr (shown only to a terminal)"
    )
    g = ap.add_argument_group("ranks")
    g.add_argument("--gpus", type=int, help="ranks, one per GPU (device cuda)")
    g.add_argument("--processes", type=int, help="ranks as processes (device from --device)")
    g.add_argument(
        "--device", choices=["cuda", "cpu"], help="default: cuda with --gpus or --gpu-memory"
    )
    g.add_argument("--gpu-memory", type=parse_size, help="memory per GPU (default 80GB)")
    g.add_argument(
        "--memory",
        type=parse_size,
        help="with --device cpu: the host memory shared by all processes (default: this "
        "machine's); on GPUs the same as --gpu-memory",
    )
    g.add_argument(
        "--reserve",
        default=None,
        help="memory kept free per rank: bytes (8GB) or a share (10%%); default 10%% on GPUs "
        "(CUDA context, allocator, NCCL), 400MB per CPU process (interpreter, torch, gloo)",
    )
    g.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    g = ap.add_argument_group("attention")
    g.add_argument("--heads", type=int, default=None, help="query heads (default 16)")
    g.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: --heads)")
    g.add_argument("--head-dim", type=int, default=None, help="default 128")
    g.add_argument(
        "--dtype",
        default=None,
        help="bf16, fp16, float32, float64 (default bf16 on cuda, float32 on cpu)",
    )
    g.add_argument("--batch", type=int, default=1, help="sequences per step")
    g.add_argument("--pattern", default="longnet", choices=sorted(PATTERNS), help="preset branches")
    g.add_argument(
        "--segments",
        type=parse_size,
        nargs="+",
        help="explicit segment lengths (default: --pattern's)",
    )
    g.add_argument(
        "--dilations", type=int, nargs="+", help="explicit dilation rates (default: --pattern's)"
    )
    g.add_argument("--causal", action="store_true", help="keys only at or before the query")
    g.add_argument("--head-groups", action="store_true", help="one head group per branch")
    g.add_argument(
        "--head-offsets", default="modulo", choices=list(HEAD_OFFSETS), help="offset rule"
    )
    g.add_argument("--document-length", type=parse_size, help="pack documents of this length")
    g.add_argument("--layout", default="contiguous", choices=list(LAYOUTS), help="sharding")
    g.add_argument("--seq-len", type=parse_size, help="evaluate this length (e.g. 1e9)")
    g = ap.add_argument_group("whole model (sequence-parallel training)")
    g.add_argument("--model", choices=sorted(MODELS), help="a preset shape (sets the heads too)")
    g.add_argument(
        "--layers",
        type=int,
        help="blocks of a whole model, with --hidden (default: --model's, else none)",
    )
    g.add_argument(
        "--hidden", type=int, help="model width, with --layers (default: --model's, else none)"
    )
    g.add_argument("--ffn", type=int, help="MLP width (default 4 x hidden)")
    g.add_argument("--gated", action="store_true", help="gated MLP (SwiGLU)")
    g.add_argument("--vocab", type=int, default=0, help="vocabulary (0: no embedding)")
    g.add_argument("--no-checkpointing", action="store_true", help="keep every activation")
    g.add_argument("--replicate-params", action="store_true", help="no FSDP/ZeRO-3 sharding")
    g.add_argument(
        "--matmul-tflops",
        type=float,
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
        type=float,
        help="link bandwidth per rank each way, Gbit/s (default "
        f"{LINK_DEFAULTS['cuda'][0]:g} on cuda, {LINK_DEFAULTS['cpu'][0]:g} on cpu)",
    )
    g.add_argument(
        "--link-latency-us",
        type=float,
        help="latency per transfer, microseconds (default "
        f"{LINK_DEFAULTS['cuda'][1]:g} on cuda, {LINK_DEFAULTS['cpu'][1]:g} on cpu)",
    )
    g.add_argument(
        "--message-us",
        type=float,
        help="cost of each further message in one batch (the far group), microseconds "
        f"(default {LINKS['cuda'][0].message_us:g} on cuda, {LINKS['cpu'][0].message_us:g} on cpu)",
    )
    g.add_argument(
        "--far-bytes",
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
