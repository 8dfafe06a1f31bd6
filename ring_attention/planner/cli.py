"""``python -m ring_attention.planner``: the capacity planner's command line.

Examples::

    python -m ring_attention.planner --gpus 64 --gpu-memory 80GB --heads 16 --head-dim 128 \\
        --pattern longnet --dtype bf16 --layers 24 --hidden 2048
    python -m ring_attention.planner --device cpu --processes 4 --memory 24GB --heads 8 \\
        --head-dim 64 --dtype float32
    python -m ring_attention.planner --seq-len 1e9 --gpu-memory 80GB --heads 16 --head-dim 128
    python -m ring_attention.planner --mode compare --gpus 64 --gpus-per-node 8 --seq-len 1M \\
        --model llama3-8b
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence

from ..layout import LAYOUTS
from ..pattern import HEAD_OFFSETS
from .capacity import Evaluation, Setup, evaluate, fewest_ranks, largest_length
from .memory import DTYPE_BYTES
from .model import activation_bytes_per_token
from .modes_cli import add_arguments as add_mode_arguments
from .modes_cli import mode_report
from .pairs import pattern_flops
from .presets import MODELS, PATTERNS, ModelShape
from .throughput import dtype_name, load_records
from .timing import LINKS, Link

__all__ = ["build_parser", "main", "parse_args"]

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


class _Progress:
    """The fewest-ranks search's progress on one line of stderr (rewritten
    in place), shown only to a terminal and without ``--quiet``."""

    def __init__(self, seq_len: int, quiet: bool) -> None:
        self.on = not quiet and sys.stderr.isatty()
        self.seq_len, self.tries, self.fits, self.fails = seq_len, 0, None, 0
        self.start = time.monotonic()

    def __call__(self, ranks: int, fits: bool) -> None:
        self.tries += 1
        if fits:
            self.fits = ranks if self.fits is None else min(self.fits, ranks)
        else:
            self.fails = max(self.fails, ranks)
        if self.on:
            best = f"fits on {self.fits:,}" if self.fits is not None else "no fit yet"
            sys.stderr.write(
                f"\rplanner: fewest ranks for {_fmt_tokens(self.seq_len)} tokens: "
                f"{self.tries} tried ({ranks:,} last), {best}, not on {self.fails:,}, "
                f"{time.monotonic() - self.start:.0f} s\033[K"
            )
            sys.stderr.flush()

    def done(self) -> None:
        if self.on and self.tries:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


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


class Impossible(Exception):
    """A request that cannot be met; the message says why (after the
    ``report`` lines printed so far)."""

    def __init__(self, message: str, report: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.report = list(report)


def _fmt_bytes(x: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} B"


def _fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def _fmt_tokens(n: int) -> str:
    if n < 10**6:
        return f"{n:,}"
    e = len(str(n)) - 1
    return f"{n:,} ({n / 10**e:.2f}e{e})"


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _far_bytes(text: str, link: Link) -> int:
    """``--far-bytes``: ``off`` (0), ``auto`` (the link's latency x
    bandwidth) or a size."""
    if text == "off":
        return 0
    if text == "auto":
        return link.far_bytes
    try:
        return parse_size(text)
    except argparse.ArgumentTypeError:
        raise Impossible(f"--far-bytes must be off, auto or a size, got {text!r}") from None


def build_setup(args: argparse.Namespace, ranks: int) -> Setup:
    """The :class:`Setup` the arguments describe (``ranks`` processes)."""
    if args.gpus is not None and args.processes is not None:
        raise Impossible("give either --gpus or --processes, not both")
    device = args.device or (
        "cuda" if args.gpus is not None or args.gpu_memory is not None else "cpu"
    )
    model = None
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    if args.model:
        model = MODELS[args.model]
        heads = heads or model.heads
        kv_heads = kv_heads or model.kv_heads
        head_dim = head_dim or model.head_dim
    heads = heads or 16
    kv_heads = kv_heads or heads
    head_dim = head_dim or 128
    if args.layers or args.hidden:
        if not (args.layers and args.hidden):
            raise Impossible("a whole model needs both --layers and --hidden")
        if heads * head_dim != args.hidden:
            print(
                f"note: heads x head_dim = {heads * head_dim} differs from --hidden {args.hidden} "
                "(the projections map between them)"
            )
        model = ModelShape(
            args.layers, args.hidden, heads, kv_heads, head_dim,
            args.ffn or 4 * args.hidden, args.gated, args.vocab,
        )  # fmt: skip
    if min(heads, head_dim, kv_heads, args.batch, args.threads) < 1:
        raise Impossible("heads, kv_heads, head_dim, batch and threads must be >= 1")
    if heads % kv_heads:
        raise Impossible(f"kv_heads must divide heads: got heads={heads}, kv_heads={kv_heads}")
    dtype = dtype_name(args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    if dtype not in DTYPE_BYTES:
        raise Impossible(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {args.dtype!r}")
    if device == "cuda":
        memory = args.gpu_memory or args.memory or 80 * 10**9
    else:
        if args.gpu_memory is not None:
            raise Impossible("--gpu-memory is for GPUs; with --device cpu give --memory")
        memory = (args.memory or _host_memory()) // ranks
    reserve_text = args.reserve or ("10%" if device == "cuda" else "400MB")
    if reserve_text.endswith("%"):
        reserve = int(memory * float(reserve_text[:-1]) / 100)
    else:
        reserve = parse_size(reserve_text)
    default_link = LINKS[device][0]
    link = Link(
        args.link_gbps or default_link.gbps,
        default_link.latency_us if args.link_latency_us is None else args.link_latency_us,
        default_link.message_us if args.message_us is None else args.message_us,
    )
    records = tuple(load_records(args.bench_json)) if args.bench_json else None
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
        far_bytes=_far_bytes(args.far_bytes, link),
        matmul_tflops=args.matmul_tflops,
        model=model,
        checkpointing=not args.no_checkpointing,
        shard_params=not args.replicate_params,
        source=args.source,
    )


def _header(s: Setup, args: argparse.Namespace) -> list[str]:
    pat = (
        f"segments {list(s.segments)} dilations {list(s.dilations)}"
        if s.segments
        else f"{s.pattern}: {PATTERNS[s.pattern][0]}"
    )
    flags = ", ".join(
        x
        for x in (
            "causal" if s.causal else "non-causal",
            "head groups" if s.head_groups else "",
            f"{s.head_offsets} head offsets" if s.head_offsets != "modulo" else "",
            f"documents of {s.document_length:,} tokens" if s.document_length else "",
        )
        if x
    )
    link_why = (
        "given"
        if args.link_gbps or args.link_latency_us is not None or args.message_us is not None
        else LINK_DEFAULTS[s.device][2]
    )
    mem_note = "per GPU" if s.device == "cuda" else "per process (host memory / processes)"
    return [
        "ring_attention capacity planner",
        f"  ranks        {s.ranks} x {s.device}, {_fmt_bytes(s.memory)} {mem_note}; usable "
        f"{_fmt_bytes(s.usable)} (reserve {_fmt_bytes(s.reserve)})",
        f"  attention    {s.heads} heads (K/V {s.kv_heads}), head_dim {s.head_dim}, {s.dtype}, "
        f"batch {s.batch}, {s.layout} layout, {flags}",
        f"  pattern      {pat}",
        f"  link         {s.link.gbps:g} Gbit/s each way, {s.link.latency_us:g} us per transfer, "
        f"{s.link.message_us:g} us per further message of a batch ({link_why})",
    ]


def _layer_details(ev: Evaluation, training: bool) -> list[str]:
    s, tr = ev.setup, ev.traffic
    p = s.ranks
    lines = [
        f"  pattern      segments {list(ev.pattern.segment_lengths)} dilations "
        f"{list(ev.pattern.dilation_rates)}",
        f"  per rank     {_fmt_tokens(int(tr.local_len.max()))} tokens (longest shard)",
    ]
    pairs_max = int(tr.total_pairs.max())
    lines.append(
        f"  work         {pairs_max:.4g} reached pairs per batch row on the busiest rank "
        f"({int(tr.total_pairs.sum()):.4g} in all): "
        f"{pattern_flops(pairs_max, s.head_dim, s.batch) / 1e12:.4g} TFLOP forward, "
        f"{pattern_flops(pairs_max, s.head_dim, s.batch, backward=True) / 1e12:.4g} TFLOP fwd+bwd"
    )
    lines.append(f"  kernel rate  {ev.rates.source}")
    key = (lambda j: ev.memories[j].training_peak) if training else (
        lambda j: ev.memories[j].forward_peak
    )  # fmt: skip
    j = ev.worst(key)
    m = ev.memories[j]
    what = "training (forward + backward)" if training else "inference (forward)"
    peak = m.training_peak if training else m.forward_peak
    lines.append(f"  peak memory  {_fmt_bytes(peak)} on rank {j}, {what}:")
    items = dict(m.inputs)
    if not training:
        items.pop("grad_out")
    phase = m.backward if training and m.backward_peak >= m.forward_peak else m.forward
    items.update(phase)
    for name, v in items.items():
        if v:
            lines.append(f"      {name:<28} {_fmt_bytes(v):>12}")
    bufs = m.buffers["backward" if training else "forward"]
    if any(bufs.values()):
        lines.append(
            "      (transport buffers: "
            + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in bufs.items() if v)
            + ")"
        )
    t_rank = ev.worst(lambda k: ev.times[k].forward_backward)
    t = ev.times[t_rank]
    f_rank = ev.worst(lambda k: ev.times[k].forward)
    tf = ev.times[f_rank]
    lines.append(
        f"  time/layer   forward {_fmt_time(tf.forward)} (compute {_fmt_time(tf.compute_forward)},"
        f" exposed communication {_fmt_time(tf.exposed_forward)}; rank {f_rank})"
    )
    lines.append(
        f"               forward+backward {_fmt_time(t.forward_backward)} (compute "
        f"{_fmt_time(t.compute_forward_backward)}, exposed communication "
        f"{_fmt_time(t.exposed_forward_backward)}; rank {t_rank})"
    )
    lines += _far_lines(ev)
    row = 2 * s.batch * s.head_dim
    acc = 8 if s.itemsize == 8 else 4
    sent = tr.rows_sent
    recv = tr.rows_received
    fwd_sent = int(sent.max()) * row * s.itemsize
    fb_sent = int((2 * row * s.itemsize * sent + row * acc * recv).max())
    fb_recv = int((2 * row * s.itemsize * recv + row * acc * sent).max())
    big = int(max(tr.send_rows.max(), tr.recv_rows.max())) * row * s.itemsize
    steps = int(tr.active.sum(1).max())
    lines.append(
        f"  bytes/link   sent per rank per layer: forward {_fmt_bytes(fwd_sent)}, forward+backward "
        f"{_fmt_bytes(fb_sent)} (received: {_fmt_bytes(int(recv.max()) * row * s.itemsize)}, "
        f"{_fmt_bytes(fb_recv)}); largest transfer {_fmt_bytes(big)}; {steps} of {p - 1} ring "
        f"steps carry data (rows: {tr.source})"
    )
    return lines


def _far_lines(ev: Evaluation) -> list[str]:
    """The two schedules side by side: the ring alone and the far group
    (``--far-bytes``, else ``auto``), exposed communication of the slowest
    rank of each pass, and which is cheaper."""
    s = ev.setup
    far = s.far_bytes or s.link.far_bytes
    out = []
    for name, times in (
        ("ring alone", ev.times_with(0)),
        (f"far group (transfers <= {_fmt_bytes(far)})", ev.times_with(far)),
    ):
        f = max(times, key=lambda t: t.forward)
        fb = max(times, key=lambda t: t.forward_backward)
        msgs = max(t.far_messages for t in times)
        out.append(
            (name, fb.forward_backward, f"{name}: forward {_fmt_time(f.forward)} (exposed "
             f"{_fmt_time(f.exposed_forward)}, {f.exposed_forward / f.compute_forward:.0%} of "
             f"compute), forward+backward {_fmt_time(fb.forward_backward)} (exposed "
             f"{_fmt_time(fb.exposed_forward_backward)}, "
             f"{fb.exposed_forward_backward / fb.compute_forward_backward:.0%}); "
             f"{max(t.steps for t in times)} ring steps"
             + (f", {msgs} messages in the group" if msgs else ""))
        )  # fmt: skip
    best = min(out, key=lambda o: o[1])[0]
    return [
        f"  far steps    {out[0][2]}",
        f"               {out[1][2]}",
        f"               cheaper: {best} (RING_ATTENTION_FAR_BYTES: the ring's choice)",
    ]


def _model_lines(ev: Evaluation) -> list[str]:
    s = ev.setup
    shape = s.model
    assert shape is not None
    j = ev.worst(lambda k: sum(ev.model_items(k).values()))
    items = ev.model_items(j)
    lines = [f"  peak memory  {_fmt_bytes(sum(items.values()))} on rank {j}:"]
    lines += [f"      {k:<42} {_fmt_bytes(v):>12}" for k, v in items.items() if v]
    secs = ev.model_seconds()
    _, why = s.matmul_rate(ev.rates)
    lines.append(
        f"  step time    {_fmt_time(sum(secs.values()))} per training step of one sequence: "
        + "; ".join(f"{k} {_fmt_time(v)}" for k, v in secs.items())
        + f" (matmul rate {why})"
    )
    return lines


def _model_header(s: Setup) -> str:
    m = s.model
    assert m is not None
    return (
        f"Whole model: {m.layers} blocks, hidden {m.hidden}, MLP {m.ffn} "
        f"({'gated' if m.gated else 'GELU'}), vocab {m.vocab or 'none'}, "
        f"{m.params() / 1e9:.3g} B parameters;"
        f" training, activation checkpointing {'on' if s.checkpointing else 'off'}, parameters "
        f"{'sharded over the ranks (FSDP/ZeRO-3)' if s.shard_params else 'replicated'}"
    )


ASSUMPTIONS = [
    "Assumptions:",
    "  - memory per rank follows what ring_attention allocates (ring.py, exchange.py): inputs, "
    "fp32 accumulators (out, lse; dq, dk, dv), casts, transport buffers sized from the exchange "
    "rows, the backward kernel's delta, the cached plan's indices; kernel tiles not counted;",
    "  - time per layer = the ring schedule: each step's K/V transfer overlaps the previous "
    "step's compute, gradient returns overlap the next; compute = reached pairs x 4d (fwd) / "
    "10d (bwd) FLOPs at the kernel rate; transfer = latency + bytes / link; the slowest rank "
    "sets the pace; packing copies and launch overheads not modelled;",
    "  - one attention layer alone: q, k, v exist before the call (grad_out too for training); "
    "inference = forward under no_grad;",
]

MODEL_ASSUMPTIONS = [
    "  - whole model: sequence parallel, every rank holds batch x n / p tokens of every block; "
    "AdamW mixed precision at 16 B/parameter; stored activations per token and block: 4h + "
    "(2H + 2H_kv)d + 2f (3f gated) values + fp32 lse, or the block input h with checkpointing "
    "(one block recomputed at a time); the attention backward of one block and two residual "
    "gradients on top; chunked loss (no full logits); matmuls 2 FLOPs per parameter and token "
    "forward, 6 fwd+bwd, 8 with recomputation; optimizer step and data-parallel/FSDP "
    "collectives not modelled.",
]


_LABELS = {
    "inference": "one attention layer, inference (forward)",
    "training": "one attention layer, training (forward + backward)",
    "model": "whole model, training",
}


def _peak_fns(s: Setup):
    fns = {
        "inference": lambda ev: ev.forward_peak,
        "training": lambda ev: ev.training_peak,
    }
    if s.model is not None:
        fns["model"] = lambda ev: ev.model_peak
    return fns


def run(args: argparse.Namespace) -> int:
    """Plan and print; returns the exit status (2: impossible, explained)."""
    ranks = args.gpus if args.gpus is not None else args.processes
    try:
        if ranks is not None and ranks < 1:
            raise Impossible(f"the number of ranks must be >= 1, got {ranks}")
        if ranks is None and args.seq_len is None:
            raise Impossible(
                "give --gpus/--processes (longest sequence) or --seq-len (fewest ranks)"
            )
        setup = build_setup(args, ranks or 1)
        if ranks is None and setup.device == "cpu":
            raise Impossible(
                "the fewest-ranks search is for GPUs (CPU processes on one machine share its "
                "memory): give --gpus or --gpu-memory, or --processes"
            )
        setup.pattern_at(max(args.seq_len or 1, 1)).check_heads(setup.heads)
        if setup.usable <= 0:
            raise Impossible(
                f"the reserve ({_fmt_bytes(setup.reserve)}) leaves no memory of "
                f"{_fmt_bytes(setup.memory)} per rank"
            )
        if args.mode != "ring":  # Ulysses, the hybrid, or the three compared
            if ranks is None or args.seq_len is None:
                raise Impossible(f"--mode {args.mode} needs --gpus/--processes and --seq-len")
            print("\n".join(_header(setup, args) + mode_report(args, setup, args.seq_len)))
            return 0
        peaks = _peak_fns(setup)
        goal = "model" if setup.model is not None else "training"
        out = []
        if ranks is None:  # fewest ranks for --seq-len
            progress = _Progress(args.seq_len, args.quiet)
            try:
                ev = fewest_ranks(setup, args.seq_len, peaks[goal], progress=progress)
            finally:
                progress.done()
            if ev is None:
                raise Impossible(
                    f"{args.seq_len:,} tokens do not fit on any number of ranks up to 131072 with "
                    f"{_fmt_bytes(setup.usable)} usable each (what does not shrink with more "
                    "ranks, e.g. replicated parameters, exceeds it)"
                )
            setup = ev.setup
            out += _header(setup, args)
            out.append("")
            out.append(
                f"Fewest ranks for {_fmt_tokens(args.seq_len)} tokens ({goal}): {setup.ranks}"
                + (" (within 2 %)" if setup.ranks > 50 else "")
            )
            details = ev
        elif args.seq_len is not None:  # this length on these ranks
            out += _header(setup, args)
            out.append("")
            details = evaluate(setup, args.seq_len)
            out.append(f"Does {_fmt_tokens(args.seq_len)} fit on {setup.ranks} ranks?")
            for name, fn in peaks.items():
                need = fn(details)
                verdict = "yes" if need <= setup.usable else "NO"
                out.append(f"  {_LABELS[name]:<52} {verdict}: {_fmt_bytes(need)} per rank")
            need = peaks[goal](details)
            if need > setup.usable:
                about = -(-setup.ranks * need // setup.usable)
                raise Impossible(
                    f"{_fmt_tokens(args.seq_len)} tokens do not fit on {setup.ranks} ranks "
                    f"({goal}): {_fmt_bytes(need)} per rank needed, {_fmt_bytes(setup.usable)} "
                    f"usable; about {about} ranks would fit it (memory per rank falls about as "
                    "1/p; without --gpus/--processes the planner searches the fewest)",
                    out,
                )
        else:  # the longest length on these ranks
            out += _header(setup, args)
            out.append("")
            cache: dict = {}
            longest = {name: largest_length(setup, fn, cache=cache) for name, fn in peaks.items()}
            if longest[goal] is None:
                ev1 = evaluate(setup, setup.ranks)
                need = peaks[goal](ev1)
                why = ""
                if setup.model is not None:
                    items = ev1.model_items(ev1.worst(lambda j: sum(ev1.model_items(j).values())))
                    top = max(items, key=items.get)
                    why = f"; the largest item, {top}, alone needs {_fmt_bytes(items[top])}"
                raise Impossible(
                    f"not even one token per rank fits ({goal}): {_fmt_bytes(need)} per rank "
                    f"needed at 1 token per rank, {_fmt_bytes(setup.usable)} usable{why}"
                )
            out.append("Longest sequence that fits (within 0.5 %):")
            for name, ev in longest.items():
                text = (
                    f"{_fmt_tokens(ev.seq_len)} tokens "
                    f"({_fmt_tokens(int(ev.traffic.local_len.max()))} per rank)"
                    if ev is not None
                    else "nothing fits (not even one token per rank)"
                )
                out.append(f"  {_LABELS[name]:<52} {text}")
            details = longest[goal] or longest["training"] or longest["inference"]
        out.append("")
        out.append(f"One attention layer at n = {_fmt_tokens(details.seq_len)}:")
        out += _layer_details(details, training=True)
        if setup.model is not None:
            out.append("")
            out.append(_model_header(details.setup) + f", at n = {_fmt_tokens(details.seq_len)}:")
            out += _model_lines(details)
            act = activation_bytes_per_token(setup.model, setup.itemsize)
            out.append(
                f"  activations  {_fmt_bytes(act)} per token and block without checkpointing"
            )
        out.append("")
        out += ASSUMPTIONS + (MODEL_ASSUMPTIONS if setup.model is not None else [])
        print("\n".join(out))
        return 0
    except Impossible as exc:
        print("\n".join([*exc.report, "", f"Not possible: {exc}"] if exc.report else
                        [f"Not possible: {exc}"]))  # fmt: skip
        return 2
    except ValueError as exc:  # a bad pattern or configuration, named by the check
        print(f"Not possible: {exc}")
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ring_attention.planner``."""
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
