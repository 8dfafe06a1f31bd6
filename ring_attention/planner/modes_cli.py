"""``python -m ring_attention.planner --mode ulysses|hybrid|compare``: one
attention layer per rank for Ulysses, the hybrid, or all three modes side
by side with the advice (:mod:`.modes`).

    python -m ring_attention.planner --mode compare --gpus 64 --gpus-per-node 8 \\
        --seq-len 1M --model llama3-8b --link-gbps 400 --intra-gbps 3600
"""

from __future__ import annotations

import argparse

from ..core.links import INTRA_DEFAULTS
from .capacity import Setup
from .cli_types import MICROSECONDS, RANKS, RATE
from .modes import ModeEvaluation, advice, compare_modes, evaluate_mode, grid_for
from .timing import Link

__all__ = ["INTRA_DEFAULTS", "add_arguments", "mode_report"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``--mode`` options of the planner's command line."""
    g = ap.add_argument_group("sharding mode (ring, Ulysses, hybrid)")
    g.add_argument(
        "--mode",
        default="ring",
        choices=["ring", "ulysses", "hybrid", "compare"],
        help="ring: the ring over every rank (the report above); ulysses: all-to-all over every "
        "rank; hybrid: Ulysses inside a node x ring between nodes; compare: the three side by "
        "side and which wins (needs --seq-len)",
    )
    g.add_argument("--gpus-per-node", type=RANKS, default=8, help="ranks per node")
    g.add_argument("--ulysses", type=RANKS, help="U of the hybrid (default: --gpus-per-node)")
    g.add_argument(
        "--intra-gbps",
        type=RATE,
        help="link inside a node, Gbit/s each way (default "
        f"{INTRA_DEFAULTS['cuda'][0]:g} on cuda, {INTRA_DEFAULTS['cpu'][0]:g} on cpu)",
    )
    g.add_argument(
        "--intra-latency-us",
        type=MICROSECONDS,
        help="latency inside a node, microseconds (default "
        f"{INTRA_DEFAULTS['cuda'][1]:g} on cuda, {INTRA_DEFAULTS['cpu'][1]:g} on cpu)",
    )


def _b(x: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} B"


def _t(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _links(args: argparse.Namespace, setup: Setup) -> tuple[Link, str]:
    gbps, lat, why = INTRA_DEFAULTS[setup.device]
    given = args.intra_gbps is not None or args.intra_latency_us is not None
    link = Link(gbps if args.intra_gbps is None else args.intra_gbps,
                lat if args.intra_latency_us is None else args.intra_latency_us)  # fmt: skip
    return link, "given" if given else why


def _details(ev: ModeEvaluation, usable: int) -> list[str]:
    worst = ev.worst
    j = max(range(len(ev.ranks)), key=lambda r: ev.ranks[r].training_peak)
    m = ev.ranks[j]
    fits = "fits" if worst["training_peak"] <= usable else "does NOT fit"
    lines = [
        f"{ev.mode}: {ev.ring} ring(s) x {ev.ulysses} Ulysses rank(s)"
        + (f"; {ev.idle} Ulysses rank(s) hold no head" if ev.idle else ""),
        f"  bytes/rank   sent per layer: forward {_b(worst['sent_forward'])}, forward+backward "
        f"{_b(worst['sent_forward_backward'])} (all-to-all {_b(worst['a2a_forward_backward'])}, "
        f"ring {_b(worst['ring_forward_backward'])})",
        f"  peak memory  {_b(worst['training_peak'])} training, {_b(worst['forward_peak'])} "
        f"inference (rank {j}; {fits}, {_b(usable)} usable):",
    ]
    lines += [f"      {k:<28} {_b(v):>12}" for k, v in m.training_items.items() if v]
    f = max(ev.ranks, key=lambda r: r.seconds[1])
    lines.append(
        f"  time/layer   forward {_t(worst['forward_s'])}, forward+backward "
        f"{_t(worst['forward_backward_s'])} (all-to-alls {_t(f.a2a_seconds[1])} of it; rank "
        f"{f.rank}; kernel rate {ev.rate_source})"
    )
    return lines


def mode_report(args: argparse.Namespace, setup: Setup, seq_len: int) -> list[str]:
    """The report of ``--mode`` (not ``ring``) at ``seq_len`` tokens."""
    intra, why = _links(args, setup)
    G = args.gpus_per_node
    lines = [
        f"  links        inside a node {intra.gbps:g} Gbit/s, {intra.latency_us:g} us ({why}); "
        f"between nodes {setup.link.gbps:g} Gbit/s, {setup.link.latency_us:g} us; "
        f"{G} ranks per node",
        "",
    ]
    if args.mode == "compare":
        evals = compare_modes(setup, seq_len, G, intra, setup.link, args.ulysses)
        lines.append(f"Three modes at n = {seq_len:,} on {setup.ranks} ranks, one attention layer:")
        lines.append(
            f"  {'mode':<8} {'R x U':>9} {'sent fwd+bwd':>13} {'a2a':>11} {'ring':>11} "
            f"{'training peak':>14} {'fwd+bwd time':>13}"
        )
        for ev in evals:
            w = ev.worst
            lines.append(
                f"  {ev.mode:<8} {f'{ev.ring} x {ev.ulysses}':>9} "
                f"{_b(w['sent_forward_backward']):>13} {_b(w['a2a_forward_backward']):>11} "
                f"{_b(w['ring_forward_backward']):>11} {_b(w['training_peak']):>14} "
                f"{_t(w['forward_backward_s']):>13}"
            )
        lines.append("")
        lines += ["Advice: " + a if i == 0 else "        " + a
                  for i, a in enumerate(advice(evals, setup.usable))]  # fmt: skip
        lines.append("")
        for ev in evals:
            lines += _details(ev, setup.usable)
    else:
        R, U = grid_for(args.mode, setup.ranks, G, args.ulysses)
        one_node = setup.ranks <= G
        ev = evaluate_mode(
            setup, seq_len, R, U, a2a_link=intra if U <= G else setup.link,
            ring_link=intra if one_node else setup.link, mode=args.mode,
        )  # fmt: skip
        lines.append(f"One attention layer at n = {seq_len:,}:")
        lines += _details(ev, setup.usable)
    lines += [
        "",
        "Assumptions (modes): the all-to-alls (q, k, v out; out, lse back; both reversed in "
        "the backward) are not overlapped with compute and take the link inside a node when "
        "the Ulysses group fits in one; the ring's steps overlap as in the ring report; a "
        "rank's heads are those of torch.tensor_split over U, its K/V heads only those they "
        "read; memory: the largest phase (exchange buffers, stretch tensors, the attention's "
        "own items).",
    ]
    return lines
