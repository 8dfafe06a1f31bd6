"""The capacity planner's options turned into a :class:`~.capacity.Setup`
(defaults per device, checks), and :class:`Impossible`, the error a request
that cannot be met raises."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from .capacity import Setup
from .cli_args import parse_size
from .memory import DTYPE_BYTES
from .presets import MODELS, ModelShape
from .throughput import dtype_name, load_records
from .timing import LINKS, Link

__all__ = ["Impossible", "build_setup"]


class Impossible(Exception):
    """A request that cannot be met; the message says why (after the
    ``report`` lines printed so far)."""

    def __init__(self, message: str, report: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.report = list(report)


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
