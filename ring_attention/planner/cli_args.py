"""The capacity planner's options: the parser, with the range of every
option checked while parsing (:mod:`.cli_types`)."""

import argparse

from ..core.config import backward_heads
from ..core.geometry import MAX_SEQ_LEN
from ..core.layout import LAYOUTS
from ..core.links import INTRA_DEFAULTS, LINKS, Link
from ..core.pairs import MAX_HEADS
from ..core.pattern import HEAD_OFFSETS
from .cli_types import (
    MAX_BYTES,
    MICROSECONDS,
    RATE,
    _checked,
    int_in,
    number_in,
    reserve,
    size_in,
)
from .memory import DTYPE_BYTES
from .presets import MODELS, PATTERNS
from .throughput import dtype_name
from .traffic import MAX_WORLD_SIZE

#: A rank count the planner models (:data:`.traffic.MAX_WORLD_SIZE`).
RANKS = int_in(1, MAX_WORLD_SIZE)


def _backward_heads(text: str) -> str:
    try:
        backward_heads(1, 1, 4, text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected all, auto or an integer >= 1, got {text!r}"
        ) from None
    return text


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


_DTYPE = _checked(
    f"expected one of {sorted(DTYPE_BYTES)} (or bf16, fp16, fp32, fp64)",
    dtype_name,
    lambda name: name in DTYPE_BYTES,
    lambda text, _: repr(text),
)
#: ``--far-bytes``: ``off``, ``auto`` or a size.
_FAR_BYTES = _checked(
    f"--far-bytes must be off, auto or a size in [0, {MAX_BYTES:.4g}]",
    lambda text: text if text in ("off", "auto") else size_in(0, MAX_BYTES)(text),
    lambda _: True, lambda text, _: repr(text),
)  # fmt: skip
_MEMORY = size_in(1, MAX_BYTES)
_HEADS = int_in(1, MAX_HEADS)
_LENGTH = size_in(1, MAX_SEQ_LEN)


def _per_device(links: dict[str, Link], key: str) -> str:
    """``"X on cuda, Y on cpu"``: the default ``key`` of each device's link."""
    return f"{getattr(links['cuda'], key):g} on cuda, {getattr(links['cpu'], key):g} on cpu"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """One default per option in ``--help``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS):
            return text  # (every option of this parser has option strings)
        if action.nargs == 0:  # store_true
            return f"{text} (default: off)".strip() if action.default is False else text
        return f"{text} (default: %(default)s)".strip()


def build_parser() -> argparse.ArgumentParser:
    """The planner's command line."""
    ap = argparse.ArgumentParser(prog="python -m ring_attention.planner", description=(
        "Capacity planner for ring dilated attention: the longest sequence that fits per rank, "
        "the predicted time per layer and the bytes per link, per attention layer and for a "
        "whole model. With --seq-len and no rank count: the fewest ranks."
    ), formatter_class=_HelpFormatter)  # fmt: skip
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr (a line "
                    "rewritten on a terminal; elsewhere a line per evaluation once a search has "
                    "run 10 s)")  # fmt: skip
    ap.add_argument("--time-limit", type=number_in(0, 1e6, above=True), default=600,
                    help="seconds a search (the fewest ranks, the longest sequence) may run: "
                    "past them it stops after the evaluation under way and says what it "
                    "found")  # fmt: skip
    g = ap.add_argument_group("ranks")
    g.add_argument("--gpus", type=RANKS, help="ranks, one per GPU (device cuda)")
    g.add_argument("--processes", type=RANKS, help="ranks as processes (device from --device)")
    g.add_argument("--device", choices=["cuda", "cpu"],
                   help="default: cuda with --gpus or --gpu-memory")  # fmt: skip
    g.add_argument("--gpu-memory", type=_MEMORY, help="memory per GPU (default 80GB)")
    g.add_argument("--memory", type=_MEMORY, help="with --device cpu: the host memory shared by "
                   "all processes (default: this machine's); on GPUs the same as "
                   "--gpu-memory")  # fmt: skip
    g.add_argument("--reserve", type=reserve, default=None, help="memory kept free "
                   "per rank: bytes (8GB) or a share (10%%); default 10%% on GPUs (CUDA context, "
                   "allocator, NCCL), 400MB per CPU process (interpreter, torch, "
                   "gloo)")  # fmt: skip
    g.add_argument("--threads", type=int_in(1, 4096), default=1, help="CPU threads per process")
    g = ap.add_argument_group("attention")
    g.add_argument("--heads", type=_HEADS, default=None, help="query heads (default 16)")
    g.add_argument("--kv-heads", type=_HEADS, default=None, help="K/V heads (default: --heads)")
    g.add_argument("--head-dim", type=int_in(1, 2**16), default=None, help="default 128")
    g.add_argument("--dtype", type=_DTYPE, default=None, help="bf16, fp16, float32, float64 "
                   "(default bf16 on cuda, float32 on cpu)")  # fmt: skip
    g.add_argument("--batch", type=int_in(1, 2**20), default=1, help="sequences per step")
    g.add_argument("--pattern", default="longnet", choices=sorted(PATTERNS), help="preset branches")
    g.add_argument("--segments", type=_LENGTH, nargs="+",
                   help="explicit segment lengths (default: --pattern's)")  # fmt: skip
    g.add_argument("--dilations", type=int_in(1, MAX_SEQ_LEN), nargs="+",
                   help="explicit dilation rates (default: --pattern's)")  # fmt: skip
    g.add_argument("--causal", action="store_true", help="keys only at or before the query")
    g.add_argument("--head-groups", action="store_true", help="one head group per branch")
    g.add_argument("--head-offsets", default="modulo", choices=list(HEAD_OFFSETS),
                   help="offset rule")  # fmt: skip
    g.add_argument("--document-length", type=_LENGTH, help="pack documents of this length")
    g.add_argument("--layout", default="contiguous", choices=list(LAYOUTS), help="sharding")
    g.add_argument("--seq-len", type=_LENGTH, help="evaluate this length (e.g. 1e9)")
    g = ap.add_argument_group("whole model (sequence-parallel training)")
    g.add_argument("--model", choices=sorted(MODELS), help="a preset shape (sets the heads too)")
    g.add_argument("--layers", type=int_in(1, 2**16), help="blocks of a whole model, with "
                   "--hidden (default: --model's, else none)")  # fmt: skip
    g.add_argument("--hidden", type=int_in(1, 2**24),
                   help="model width, with --layers (default: --model's, else none)")  # fmt: skip
    g.add_argument("--ffn", type=int_in(1, 2**26), help="MLP width (default 4 x hidden)")
    g.add_argument("--gated", action="store_true", help="gated MLP (SwiGLU)")
    g.add_argument("--vocab", type=int_in(0, 2**30), default=0, help="vocabulary (0: no embedding)")
    g.add_argument("--no-checkpointing", action="store_true", help="keep every activation")
    g.add_argument("--replicate-params", action="store_true", help="no FSDP/ZeRO-3 sharding")
    g.add_argument("--matmul-tflops", type=RATE,
                   help="dense matmul rate (default: assumed per device, printed)")  # fmt: skip
    g = ap.add_argument_group("rates and links")
    g.add_argument("--bench-json", help="benchmark records (ring_attention/planner/throughput.py)")
    g.add_argument("--tflops", type=_tflops, help="kernel rate F or F,B (forward, fwd+bwd; "
                   "default: --bench-json's, else assumed per device and dtype, "
                   "printed)")  # fmt: skip
    link = {k: v[0] for k, v in LINKS.items()}
    g.add_argument("--link-gbps", type=RATE, help="link bandwidth per rank each way, Gbit/s "
                   f"(default {_per_device(link, 'gbps')})")  # fmt: skip
    g.add_argument("--link-latency-us", type=MICROSECONDS, help="latency per transfer, "
                   f"microseconds (default {_per_device(link, 'latency_us')})")  # fmt: skip
    g.add_argument("--message-us", type=MICROSECONDS, help="cost of each further message in one "
                   "batch (the far group), microseconds (default "
                   f"{_per_device(link, 'message_us')})")  # fmt: skip
    g.add_argument("--far-bytes", type=_FAR_BYTES, default="off", help="the ring's "
                   "RING_ATTENTION_FAR_BYTES: transfers of at most this many K/V bytes travel in "
                   "one far group per pass ('auto': latency x bandwidth; 'off': the ring alone, "
                   "the default); both schedules are printed")  # fmt: skip
    g.add_argument("--backward-heads", type=_backward_heads, default="all", help="the ring's "
                   "RING_ATTENTION_BACKWARD_HEADS: its backward by groups of this many heads, one "
                   "ring pass each ('auto': the planner's advice, the fastest whose peak "
                   "fits)")  # fmt: skip
    g.add_argument("--source", default="auto", choices=["auto", "plan", "analytic"],
                   help="exchanged rows: the ring's plan (small sizes) or closed "
                   "forms")  # fmt: skip
    g = ap.add_argument_group("sharding mode (ring, Ulysses, hybrid)")
    g.add_argument("--mode", default="ring", choices=["ring", "ulysses", "hybrid", "compare"],
                   help="ring: the ring over every rank (the report above); ulysses: all-to-all "
                   "over every rank; hybrid: Ulysses inside a node x ring between nodes; compare: "
                   "the three side by side and which wins (needs --seq-len)")  # fmt: skip
    g.add_argument("--gpus-per-node", type=RANKS, default=8, help="ranks per node")
    g.add_argument("--ulysses", type=RANKS, help="U of the hybrid (default: --gpus-per-node)")
    intra = {k: Link(*v[:2]) for k, v in INTRA_DEFAULTS.items()}
    g.add_argument("--intra-gbps", type=RATE, help="link inside a node, Gbit/s each way "
                   f"(default {_per_device(intra, 'gbps')})")  # fmt: skip
    g.add_argument("--intra-latency-us", type=MICROSECONDS, help="latency inside a node, "
                   f"microseconds (default {_per_device(intra, 'latency_us')})")  # fmt: skip
    return ap
