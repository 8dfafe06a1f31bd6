"""``python -m ring_attention.planner``: the capacity planner's command line, the
rules between its options and the searches (examples: docs/performance.md)."""

import argparse
import os
import sys
import time
from collections.abc import Sequence

from ..core.geometry import MAX_SEQ_LEN
from ..core.links import INTRA_DEFAULTS, LINKS, Link
from ..core.pattern import Pattern
from .capacity import Setup, evaluate, fewest_ranks, floor_peak, floor_ranks, largest_length
from .cli_args import build_parser
from .cli_report import (
    ASSUMPTIONS,
    MODE_ASSUMPTIONS,
    MODEL_ASSUMPTIONS,
    fmt_bytes,
    fmt_tokens,
    header,
    layer_details,
    mode_lines,
    model_lines,
)
from .cli_types import MAX_BYTES
from .modes import MODES, advice, compare_modes, grid_for
from .presets import MODELS, ModelShape
from .throughput import load_records
from .traffic import MAX_WORLD_SIZE


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


def _ranks(args: argparse.Namespace) -> int | None:
    return args.gpus if args.gpus is not None else args.processes


def _device(args: argparse.Namespace) -> str:
    gpu = args.gpus is not None or args.gpu_memory is not None
    return args.device or ("cuda" if gpu else "cpu")


def _memory(args: argparse.Namespace, device: str, ranks: int) -> tuple[int, int]:
    """Bytes per rank and the reserve kept free of them."""
    if device == "cuda":
        memory = args.gpu_memory or args.memory or 80 * 10**9
    else:
        memory = (args.memory or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // ranks
    kind, value = args.reserve or (("%", 10.0) if device == "cuda" else ("bytes", 400 * 10**6))
    return memory, int(memory * value / 100) if kind == "%" else int(value)


def check_args(args: argparse.Namespace) -> None:
    """The rules between options, before any planning; raises
    :class:`OptionError` naming the option. Fills in a ``--model``'s shape."""
    ranks, device = _ranks(args), _device(args)
    model = MODELS.get(args.model)
    for name, default in (("heads", 16), ("kv_heads", None), ("head_dim", 128)):
        if getattr(args, name) is None:  # a --model's, else the default (kv_heads: heads)
            setattr(args, name, getattr(model, name) if model else default or args.heads)
    memory, reserve = _memory(args, device, ranks or 1)
    own_model = [(o, g) for o, g in (("--ffn", args.ffn is not None), ("--gated", args.gated),
                                     ("--vocab", args.vocab != 0)) if g]  # fmt: skip
    grid = ranks is not None and args.seq_len is not None and args.mode in ("hybrid", "compare")
    records = _error(load_records, args.bench_json) if args.bench_json else None
    rules = [  # (broken, option, message), in the order they are checked
        (args.gpus is not None and args.processes is not None, "--processes",
         "give either --gpus or --processes, not both"),
        (device == "cpu" and args.gpu_memory is not None, "--gpu-memory",
         "is for GPUs; with --device cpu give --memory"),
        (args.heads % args.kv_heads, "--kv-heads",
         f"kv_heads must divide heads: got --heads {args.heads}, --kv-heads {args.kv_heads}"),
        ((args.layers is None) != (args.hidden is None),  # name the one given
         "--hidden" if args.layers is None else "--layers",
         "a whole model needs both --layers and --hidden"),
        (args.layers is None and own_model, own_model[0][0] if own_model else "",
         "shapes a whole model of --layers and --hidden (a --model preset has its own): give "
         "them, or leave it out"),
        ((args.segments is None) != (args.dilations is None),
         "--dilations" if args.segments is None else "--segments",
         "--segments and --dilations go together"),
        (args.segments is not None, "--segments/--dilations",
         args.segments is not None and _error(Pattern, args.segments, args.dilations)),
        (ranks is None and args.seq_len is None, "--seq-len",
         "give --gpus/--processes (the longest sequence) or --seq-len (the fewest ranks)"),
        (ranks is None and device == "cpu", "--seq-len",
         "the fewest-ranks search is for GPUs (CPU processes on one machine share its memory): "
         "give --gpus or --gpu-memory, or --processes"),
        (reserve >= memory, "--reserve",
         f"{reserve:,} bytes leave nothing of the {memory:,} bytes per rank"),
        (records, "--bench-json", f"cannot read its records: {records}"),
        (args.mode != "ring" and (ranks is None or args.seq_len is None), "--mode",
         f"--mode {args.mode} needs --gpus/--processes and --seq-len"),
        (grid, "--ulysses" if args.ulysses else "--gpus-per-node",
         grid and _error(grid_for, "hybrid", ranks, args.gpus_per_node, args.ulysses)),
    ]  # fmt: skip
    for broken, option, message in rules:
        if broken and message:
            raise OptionError(option, message)


def _error(fn, *args) -> str | None:
    """What ``fn(*args)`` raises (``OSError``, ``ValueError``), else ``None``."""
    try:
        fn(*args)
    except (OSError, ValueError) as exc:
        return str(exc)
    return None


def build_setup(args: argparse.Namespace, ranks: int) -> Setup:
    """The :class:`Setup` the arguments (checked by :func:`check_args`)
    describe, on ``ranks`` processes."""
    device = _device(args)
    model = MODELS.get(args.model)
    if args.layers is not None:
        if args.heads * args.head_dim != args.hidden:
            print(f"note: heads x head_dim = {args.heads * args.head_dim} differs from --hidden "
                  f"{args.hidden} (the projections map between them)")  # fmt: skip
        model = ModelShape(
            args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim,
            4 * args.hidden if args.ffn is None else args.ffn, args.gated, args.vocab,
        )  # fmt: skip
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    memory, reserve = _memory(args, device, ranks)
    d = LINKS[device][0]
    link = Link(d.gbps if args.link_gbps is None else args.link_gbps,
                d.latency_us if args.link_latency_us is None else args.link_latency_us,
                d.message_us if args.message_us is None else args.message_us)  # fmt: skip
    records = tuple(load_records(args.bench_json)) if args.bench_json else None
    far = {"off": 0, "auto": link.far_bytes}.get(args.far_bytes, args.far_bytes)
    as_given = ("heads", "kv_heads", "head_dim", "batch", "causal", "head_groups", "head_offsets",
                "document_length", "layout", "tflops", "threads", "matmul_tflops", "source",
                "backward_heads")  # fmt: skip
    return Setup(
        ranks=ranks, device=device, memory=memory, reserve=reserve, dtype=dtype,
        pattern=None if args.segments else args.pattern,
        segments=tuple(args.segments) if args.segments else None,
        dilations=tuple(args.dilations) if args.dilations else None, records=records, link=link,
        far_bytes=far, model=model, checkpointing=not args.no_checkpointing,
        shard_params=not args.replicate_params, **{name: getattr(args, name) for name in as_given},
    )  # fmt: skip


class _Progress:
    """A search's progress on stderr, and its time limit (:class:`Impossible`)."""

    def __init__(
        self, what: str, unit: str, limit: float, quiet: bool, start: float | None = None
    ) -> None:
        self.what, self.unit, self.limit = what, unit, limit
        self.tty = not quiet and sys.stderr.isatty()
        self.lines = not quiet and not self.tty
        self.tries, self.last, self.fits, self.fails = 0, 0, [], []
        self.start = time.monotonic() if start is None else start

    def state(self) -> str:
        """What the search has found: the best value that fits, the nearest that does not
        (ranks: the fewest that fit, the most that do not; tokens: the reverse)."""
        ranks, at = self.unit == "ranks", "on" if self.unit == "ranks" else "at"
        best = (min if ranks else max)(self.fits, default=None)
        worst = (max if ranks else min)(self.fails, default=0 if ranks else None)
        found = "no fit yet" if best is None else f"fits {at} {best:,}"
        missed = "none too long yet" if worst is None else f"not {at} {worst:,}"
        return f"{self.tries} tried ({self.last:,} last), {found}, {missed}"

    def __call__(self, value: int, fits: bool) -> None:
        self.tries, self.last = self.tries + 1, value
        (self.fits if fits else self.fails).append(value)
        elapsed = time.monotonic() - self.start
        text = f"planner: {self.what}: {self.state()}, {elapsed:.0f} s"
        if self.tty or (self.lines and elapsed >= _QUIET_SECONDS):
            sys.stderr.write(f"\r{text}\033[K" if self.tty else text + "\n")
            sys.stderr.flush()
        if elapsed > self.limit:
            raise Impossible(
                f"the search for the {self.what} stopped after {elapsed:.0f} s (--time-limit "
                f"{self.limit:g}): {self.state()} {self.unit}; raise --time-limit, or give "
                + ("--gpus/--processes" if self.unit == "ranks" else "--seq-len")
            )

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tty and self.tries:  # clear the line
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


#: Seconds a search runs before its progress goes to a stderr that is not a terminal.
_QUIET_SECONDS = 10.0

_LABELS = {
    "inference": "one attention layer, inference (forward)",
    "training": "one attention layer, training (forward + backward)",
    "model": "whole model, training",
}


def _too_large(setup: Setup, seq_len: int, goal: str, limit: int) -> str | None:
    """Why ``seq_len`` tokens need more ranks than ``limit`` (or ``None``)."""
    if floor_ranks(setup, seq_len, goal, limit) is not None:
        return None
    floor, need = floor_peak(setup, seq_len, limit, goal), floor_ranks(setup, seq_len, goal)
    model = ", the model" * (goal == "model")
    what = (f"{fmt_tokens(seq_len)} tokens need more than {limit:,} ranks with "
            f"{fmt_bytes(setup.usable)} usable each ({goal}): at {limit:,} ranks the items that "
            f"do not depend on the exchange (inputs, accumulators, casts{model}) alone take "
            f"{fmt_bytes(floor)} per rank")  # fmt: skip
    if need is None:
        top = fmt_bytes(floor_peak(setup, seq_len, MAX_SEQ_LEN, goal))
        return (f"{what}, and {top} with one token per rank: no number of ranks holds them (what "
                "does not shrink with more ranks exceeds the memory)")  # fmt: skip
    return (f"{what}; at least {need:,} ranks would be needed, and the planner models at most "
            f"{limit:,} (its tables of rank pairs grow as the square of the ranks)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Plan and print (``args`` parsed and checked by :func:`main`); returns
    the exit status (2: impossible, explained)."""
    ranks = _ranks(args)
    try:
        setup = build_setup(args, ranks or 1)
        setup.pattern_at(max(args.seq_len or 1, 1)).check_heads(setup.heads)
        peaks = {"inference": lambda ev: ev.forward_peak, "training": lambda ev: ev.training_peak}
        if setup.model is not None:
            peaks["model"] = lambda ev: ev.model_peak
        goal = "model" if setup.model is not None else "training"
        if ranks is not None and args.seq_len is not None:
            floor = floor_peak(setup, args.seq_len, ranks, "inference")
            if floor > MAX_BYTES:  # beyond any memory: no need to count (nor overflow) it
                raise Impossible(
                    f"{fmt_tokens(args.seq_len)} tokens do not fit on {ranks} ranks: their "
                    f"inputs and accumulators alone take {fmt_bytes(floor)} per rank, "
                    f"{fmt_bytes(setup.usable)} usable"
                )
        if args.mode != "ring":  # Ulysses, the hybrid, or the three compared
            print("\n".join(header(setup, args) + _mode_report(args, setup, args.seq_len)))
            return 0
        if ranks is None:  # fewest ranks for --seq-len
            why = _too_large(setup, args.seq_len, goal, MAX_WORLD_SIZE)
            if why is not None:
                raise Impossible(why)
            what = f"fewest ranks for {fmt_tokens(args.seq_len)} tokens"
            with _Progress(what, "ranks", args.time_limit, args.quiet) as progress:
                ev = fewest_ranks(setup, args.seq_len, peaks[goal], progress=progress)
            if ev is None:
                raise Impossible(
                    f"{args.seq_len:,} tokens do not fit on any number of ranks up to "
                    f"{MAX_WORLD_SIZE:,} with {fmt_bytes(setup.usable)} usable each (what does "
                    "not shrink with more ranks, e.g. replicated parameters, exceeds it)"
                )
            setup, details = ev.setup, ev
            within = " (within 2 %)" if setup.ranks > 50 else ""
            out = [*header(setup, args), "", f"Fewest ranks for {fmt_tokens(args.seq_len)} "
                   f"tokens ({goal}): {setup.ranks}{within}"]  # fmt: skip
        elif args.seq_len is not None:  # this length on these ranks
            details = evaluate(setup, args.seq_len)
            out = [*header(setup, args), "",
                   f"Does {fmt_tokens(args.seq_len)} fit on {setup.ranks} ranks?"]  # fmt: skip
            for name, fn in peaks.items():
                need = fn(details)
                verdict = "yes" if need <= setup.usable else "NO"
                out.append(f"  {_LABELS[name]:<52} {verdict}: {fmt_bytes(need)} per rank")
            need = peaks[goal](details)
            if need > setup.usable:
                about = -(-setup.ranks * need // setup.usable)
                raise Impossible(
                    f"{fmt_tokens(args.seq_len)} tokens do not fit on {setup.ranks} ranks "
                    f"({goal}): {fmt_bytes(need)} per rank needed, {fmt_bytes(setup.usable)} "
                    f"usable; about {about} ranks would fit it (memory per rank falls about as "
                    "1/p; without --gpus/--processes the planner searches the fewest)",
                    out,
                )
        else:  # the longest length on these ranks
            out = [*header(setup, args), ""]
            cache: dict = {}
            longest, start = {}, time.monotonic()
            for name, fn in peaks.items():  # the searches share evaluations and the time limit
                what = f"longest sequence on {setup.ranks} ranks ({name})"
                with _Progress(what, "tokens", args.time_limit, args.quiet, start) as progress:
                    longest[name] = largest_length(setup, fn, cache=cache, progress=progress)
            if longest[goal] is None:
                ev1, why = evaluate(setup, setup.ranks), ""
                need = peaks[goal](ev1)
                if setup.model is not None:
                    items = ev1.model_items(ev1.worst(lambda j: sum(ev1.model_items(j).values())))
                    top = max(items, key=items.get)
                    why = f"; the largest item, {top}, alone needs {fmt_bytes(items[top])}"
                raise Impossible(
                    f"not even one token per rank fits ({goal}): {fmt_bytes(need)} per rank "
                    f"needed at 1 token per rank, {fmt_bytes(setup.usable)} usable{why}"
                )
            out.append("Longest sequence that fits (within 0.5 %):")
            for name, ev in longest.items():
                text = ("nothing fits (not even one token per rank)" if ev is None else
                        f"{fmt_tokens(ev.seq_len)} tokens "
                        f"({fmt_tokens(int(ev.traffic.local_len.max()))} per rank)")  # fmt: skip
                out.append(f"  {_LABELS[name]:<52} {text}")
            details = longest[goal]
        out += ["", f"One attention layer at n = {fmt_tokens(details.seq_len)}:"]
        out += layer_details(details)
        if setup.model is not None:
            out += ["", *model_lines(details)]
        out += ["", *ASSUMPTIONS, *(MODEL_ASSUMPTIONS if setup.model is not None else [])]
        print("\n".join(out))
        return 0
    except (Impossible, ValueError) as exc:  # ValueError: a bad pattern or configuration
        print("\n".join([*getattr(exc, "report", []), "", f"Not possible: {exc}"]).lstrip("\n"))
        return 2


def _mode_report(args: argparse.Namespace, setup: Setup, seq_len: int) -> list[str]:
    """The report of ``--mode`` (not ``ring``) at ``seq_len`` tokens."""
    gbps, lat, why = INTRA_DEFAULTS[setup.device]
    if args.intra_gbps is not None or args.intra_latency_us is not None:
        why = "given"
    intra = Link(gbps if args.intra_gbps is None else args.intra_gbps,
                 lat if args.intra_latency_us is None else args.intra_latency_us)  # fmt: skip
    G, inter = args.gpus_per_node, setup.link
    lines = [
        f"  links        inside a node {intra.gbps:g} Gbit/s, {intra.latency_us:g} us ({why}); "
        f"between nodes {inter.gbps:g} Gbit/s, {inter.latency_us:g} us; {G} ranks per node",
        "",
    ]
    modes = MODES if args.mode == "compare" else (args.mode,)
    evals = compare_modes(setup, seq_len, G, intra, inter, args.ulysses, modes)
    lines += mode_lines(evals, setup.usable, advice(evals, setup.usable))
    return lines + MODE_ASSUMPTIONS


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ring_attention.planner``: the exit status
    (0; 2 for a bad option, named as argparse does, or a request that cannot be met)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        try:
            check_args(args)
        except OptionError as exc:
            parser.error(str(exc))
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    return run(args)
