"""``python -m ring_attention.planner``: the capacity planner's command line:
the longest sequence on given ranks, the fewest ranks for a length, or one
length on given ranks (options: :mod:`.cli_args`; the setup they describe:
:mod:`.cli_setup`; the report: :mod:`.cli_report`; ``--mode``:
:mod:`.modes_cli`).

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
import sys
import time
from collections.abc import Sequence

from ..core.geometry import MAX_SEQ_LEN
from .capacity import Setup, evaluate, fewest_ranks, floor_peak, floor_ranks, largest_length
from .cli_args import parse_args
from .cli_report import (
    ASSUMPTIONS,
    MODEL_ASSUMPTIONS,
    fmt_bytes,
    fmt_tokens,
    header,
    layer_details,
    model_header,
    model_lines,
)
from .cli_setup import Impossible, build_setup
from .cli_types import MAX_BYTES
from .model import activation_bytes_per_token
from .modes_cli import mode_report
from .traffic import MAX_WORLD_SIZE

__all__ = ["main", "run"]


class _Progress:
    """A search's progress on stderr, and its time limit.

    On a terminal one line, rewritten in place; elsewhere (a pipe, a log) a
    line per evaluation once the search has run ``_QUIET_SECONDS``; nothing
    with ``--quiet``. Past ``limit`` seconds the search stops after the
    evaluation under way (:class:`Impossible`, with what it found)."""

    def __init__(
        self, what: str, unit: str, limit: float, quiet: bool, start: float | None = None
    ) -> None:
        self.what, self.unit, self.limit = what, unit, limit
        self.tty = not quiet and sys.stderr.isatty()
        self.lines = not quiet and not self.tty
        self.tries, self.last, self.fits, self.fails = 0, 0, [], []
        self.start = time.monotonic() if start is None else start

    def state(self) -> str:
        """What the search has found: the best value that fits, the nearest that does not."""
        tried = f"{self.tries} tried ({self.last:,} last)"
        if self.unit == "ranks":  # the fewest that fit, the most that do not
            best, worst = min(self.fits, default=None), max(self.fails, default=0)
            found = "no fit yet" if best is None else f"fits on {best:,}"
            return f"{tried}, {found}, not on {worst:,}"
        best, worst = max(self.fits, default=None), min(self.fails, default=None)
        found = "no fit yet" if best is None else f"fits at {best:,}"
        return f"{tried}, {found}, " + (
            "none too long yet" if worst is None else f"not at {worst:,}"
        )

    def __call__(self, value: int, fits: bool) -> None:
        self.tries, self.last = self.tries + 1, value
        (self.fits if fits else self.fails).append(value)
        elapsed = time.monotonic() - self.start
        text = f"planner: {self.what}: {self.state()}, {elapsed:.0f} s"
        if self.tty:
            sys.stderr.write(f"\r{text}\033[K")
            sys.stderr.flush()
        elif self.lines and elapsed >= _QUIET_SECONDS:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        if elapsed > self.limit:
            raise Impossible(
                f"the search for the {self.what} stopped after {elapsed:.0f} s (--time-limit "
                f"{self.limit:g}): {self.state()} {self.unit}; raise --time-limit, or give "
                + ("--gpus/--processes" if self.unit == "ranks" else "--seq-len")
            )

    def done(self) -> None:
        if self.tty and self.tries:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


#: Seconds a search runs before its progress goes to a stderr that is not a terminal.
_QUIET_SECONDS = 10.0

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


def _too_large(setup: Setup, seq_len: int, goal: str, limit: int) -> str | None:
    """Why ``seq_len`` tokens need more ranks than the planner models
    (``limit``), from the closed-form floor of the peak; ``None`` when
    ``limit`` ranks may hold them."""
    if floor_ranks(setup, seq_len, goal, limit) is not None:
        return None
    floor = floor_peak(setup, seq_len, limit, goal)
    need = floor_ranks(setup, seq_len, goal)
    what = (
        f"{fmt_tokens(seq_len)} tokens need more than {limit:,} ranks with "
        f"{fmt_bytes(setup.usable)} usable each ({goal}): at {limit:,} ranks the items that do "
        "not depend on the exchange (inputs, accumulators, casts"
        f"{', the model' * (goal == 'model')}"
        f") alone take {fmt_bytes(floor)} per rank"
    )
    if need is None:
        top = floor_peak(setup, seq_len, MAX_SEQ_LEN, goal)
        return (
            f"{what}, and {fmt_bytes(top)} with one token per rank: no number of ranks holds "
            "them (what does not shrink with more ranks exceeds the memory)"
        )
    return (
        f"{what}; at least {need:,} ranks would be needed, and the planner models at most "
        f"{limit:,} (its tables of rank pairs grow as the square of the ranks)"
    )


def run(args: argparse.Namespace) -> int:
    """Plan and print (``args`` from :func:`.cli_args.parse_args`, checked);
    returns the exit status (2: impossible, explained)."""
    ranks = args.gpus if args.gpus is not None else args.processes
    try:
        setup = build_setup(args, ranks or 1)
        setup.pattern_at(max(args.seq_len or 1, 1)).check_heads(setup.heads)
        peaks = _peak_fns(setup)
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
            print("\n".join(header(setup, args) + mode_report(args, setup, args.seq_len)))
            return 0
        out = []
        if ranks is None:  # fewest ranks for --seq-len
            why = _too_large(setup, args.seq_len, goal, MAX_WORLD_SIZE)
            if why is not None:
                raise Impossible(why)
            progress = _Progress(
                f"fewest ranks for {fmt_tokens(args.seq_len)} tokens", "ranks", args.time_limit,
                args.quiet,
            )  # fmt: skip
            try:
                ev = fewest_ranks(setup, args.seq_len, peaks[goal], progress=progress)
            finally:
                progress.done()
            if ev is None:
                raise Impossible(
                    f"{args.seq_len:,} tokens do not fit on any number of ranks up to "
                    f"{MAX_WORLD_SIZE:,} with {fmt_bytes(setup.usable)} usable each (what does "
                    "not shrink with more ranks, e.g. replicated parameters, exceeds it)"
                )
            setup = ev.setup
            out += header(setup, args)
            out.append("")
            out.append(
                f"Fewest ranks for {fmt_tokens(args.seq_len)} tokens ({goal}): {setup.ranks}"
                + (" (within 2 %)" if setup.ranks > 50 else "")
            )
            details = ev
        elif args.seq_len is not None:  # this length on these ranks
            out += header(setup, args)
            out.append("")
            details = evaluate(setup, args.seq_len)
            out.append(f"Does {fmt_tokens(args.seq_len)} fit on {setup.ranks} ranks?")
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
            out += header(setup, args)
            out.append("")
            cache: dict = {}
            longest, start = {}, time.monotonic()
            for name, fn in peaks.items():  # the searches share evaluations and the time limit
                progress = _Progress(
                    f"longest sequence on {setup.ranks} ranks ({name})", "tokens",
                    args.time_limit, args.quiet, start,
                )  # fmt: skip
                try:
                    longest[name] = largest_length(setup, fn, cache=cache, progress=progress)
                finally:
                    progress.done()
            if longest[goal] is None:
                ev1 = evaluate(setup, setup.ranks)
                need = peaks[goal](ev1)
                why = ""
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
                text = (
                    f"{fmt_tokens(ev.seq_len)} tokens "
                    f"({fmt_tokens(int(ev.traffic.local_len.max()))} per rank)"
                    if ev is not None
                    else "nothing fits (not even one token per rank)"
                )
                out.append(f"  {_LABELS[name]:<52} {text}")
            details = longest[goal] or longest["training"] or longest["inference"]
        out.append("")
        out.append(f"One attention layer at n = {fmt_tokens(details.seq_len)}:")
        out += layer_details(details, training=True)
        if setup.model is not None:
            out.append("")
            out.append(model_header(details.setup) + f", at n = {fmt_tokens(details.seq_len)}:")
            out += model_lines(details)
            act = activation_bytes_per_token(setup.model, setup.itemsize)
            out.append(f"  activations  {fmt_bytes(act)} per token and block without checkpointing")
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
    """Entry point of ``python -m ring_attention.planner``: the exit status
    (0; 2 for a bad option, said on stderr as argparse does, or for a
    request that cannot be met, said on stdout after ``Not possible:``)."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
