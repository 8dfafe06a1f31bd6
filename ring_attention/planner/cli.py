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

from .capacity import Setup, evaluate, fewest_ranks, largest_length
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
from .model import activation_bytes_per_token
from .modes_cli import mode_report

__all__ = ["main", "run"]


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
                f"\rplanner: fewest ranks for {fmt_tokens(self.seq_len)} tokens: "
                f"{self.tries} tried ({ranks:,} last), {best}, not on {self.fails:,}, "
                f"{time.monotonic() - self.start:.0f} s\033[K"
            )
            sys.stderr.flush()

    def done(self) -> None:
        if self.on and self.tries:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


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
                f"the reserve ({fmt_bytes(setup.reserve)}) leaves no memory of "
                f"{fmt_bytes(setup.memory)} per rank"
            )
        if args.mode != "ring":  # Ulysses, the hybrid, or the three compared
            if ranks is None or args.seq_len is None:
                raise Impossible(f"--mode {args.mode} needs --gpus/--processes and --seq-len")
            print("\n".join(header(setup, args) + mode_report(args, setup, args.seq_len)))
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
                    f"{fmt_bytes(setup.usable)} usable each (what does not shrink with more "
                    "ranks, e.g. replicated parameters, exceeds it)"
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
            longest = {name: largest_length(setup, fn, cache=cache) for name, fn in peaks.items()}
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
    """Entry point of ``python -m ring_attention.planner``."""
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
