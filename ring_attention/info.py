"""Which path the local op takes for a shape, and why (docs/performance.md, "Which path a shape
takes"):

    python -m ring_attention.info [--seq-len 131072] [--heads 16] [--head-dim 128] \\
        [--dtype bfloat16] [--device cuda] [--capability 9.0] [--causal] ...

prints the forward's and the backward's route, the environment it read, the spans and each
branch's dense calls with their backends. Without options: the LongNet pattern at 131072 tokens,
16 heads x 128, bf16 on CUDA. No GPU needed: ``--capability`` stands in for the device's (9.0,
cuDNN assumed, without one). A bad option exits 2 with argparse's message naming it.
"""

import argparse
import os
import re
import sys
from collections import Counter

import torch

from .core import config
from .core.geometry import MAX_SEQ_LEN
from .core.pairs import MAX_HEADS
from .core.pattern import Pattern
from .local.dispatch import Unavailable, choose_backend, decide, unavailable
from .local.spans import Route
from .planner.cli_types import int_in

__all__ = ["describe", "main"]


def describe(
    pattern: Pattern, n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device, capability: tuple[int, int], missing: Unavailable | None = None,
) -> str:  # fmt: skip
    """The report :func:`main` prints (``missing``: the backends that cannot
    run, :func:`~.local.dispatch.unavailable`; ``None``: this process's)."""
    missing = unavailable() if missing is None else missing
    rows = config.span_rows()
    named = config.dense_backend()
    routes: dict[str, Route] = {}
    for pass_, env, mode in (("forward", config.FORWARD, config.forward_mode()),
                             ("backward", config.BACKWARD, config.backward_mode())):  # fmt: skip
        routes[pass_] = Route(False, f"{env}=kernel") if mode == "kernel" else decide(
            pass_, mode, named, rows, device, capability, dtype, n, heads, kv_heads, head_dim,
            pattern, (0, 0, 0), missing)  # fmt: skip
    cc = f" (sm_{capability[0]}{capability[1]})" if device.type == "cuda" else ""
    lines = [
        f"local op, n = {n}, {heads} query / {kv_heads} K/V heads, head_dim {head_dim}, "
        f"{str(dtype).removeprefix('torch.')} on {device.type}{cc}",
        f"pattern: {pattern.describe()}",
        "environment: "
        + " ".join(f"{k.name}={os.environ.get(k.name, k.default)}" for k in config.KNOBS[:4]),
    ]
    for pass_, r in routes.items():
        path = "dense per branch" if r.dense else "our kernel"
        lines.append(f"{pass_}: {path}: {r.why}")
    plan = next((r.spans for r in routes.values() if r.spans is not None), None)
    if plan is None:
        return "\n".join(lines)
    sizes = Counter(w.length for w in plan.spans)
    lines.append(
        f"spans: {', '.join(f'{c} x {s} rows' for s, c in sorted(sizes.items()))}; "
        f"{plan.calls} dense calls a pass"
    )
    for b, (w, r_) in enumerate(pattern.branches):
        shapes = Counter()
        took = {p: Counter() for p in routes}  # pass: (backend, why the others not): calls
        for i, span in enumerate(plan.spans):
            for j, call in enumerate(span.calls):
                if call.branch != b:
                    continue
                shapes[(call.segments, call.rows, call.q_heads, call.kv_heads)] += 1
                for p, r in routes.items():
                    if r.dense:
                        gqa = call.q_heads != call.kv_heads
                        fits = (device, dtype, head_dim, capability, call.rows, gqa, missing)
                        took[p][(r.backends[i][j], choose_backend(p, named, *fits)[1])] += 1
        calls = sum(shapes.values())
        desc = "; ".join(
            f"{c} x ({s} segments x {rows_} rows, {hq}/{hk} heads)"
            for (s, rows_, hq, hk), c in sorted(shapes.items())
        )
        lines.append(f"branch {b} (w {w}, r {r_}): {calls} call{'s' * (calls != 1)}: {desc}")
        for p, r in routes.items():
            if not r.dense:
                lines.append(f"  {p}: our kernel")
                continue
            for (name, why), c in sorted(took[p].items()):
                lines.append(f"  {p}: {name} x {c} ({why + '; ' if why else ''}{name}: chosen)")
    return "\n".join(lines)


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda (cuda:N), got {text!r}")
    return device


def _capability(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d{1,3})\.(\d{1,3})\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected MAJOR.MINOR (e.g. 9.0), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _parser() -> argparse.ArgumentParser:
    """The options, each checked while parsing (:mod:`.planner.cli_types`)."""
    ap = argparse.ArgumentParser(prog="python -m ring_attention.info", description=__doc__)
    ap.add_argument("--seq-len", type=int_in(1, MAX_SEQ_LEN), default=131072)
    ap.add_argument("--heads", type=int_in(1, MAX_HEADS), default=16)
    ap.add_argument("--kv-heads", type=int_in(1, MAX_HEADS), default=None, help="default: --heads")
    ap.add_argument("--head-dim", type=int_in(1, 2**16), default=128)
    ap.add_argument(
        "--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32", "float64"]
    )
    ap.add_argument("--device", type=_device, default="cuda")
    ap.add_argument(
        "--capability", type=_capability, default=None,
        help="e.g. 9.0 (default: the device's; 9.0 where there is no CUDA device)",
    )  # fmt: skip
    ap.add_argument(
        "--segments", type=int_in(1, MAX_SEQ_LEN), nargs="+",
        default=[2048, 4096, 8192, 16384, 32768],
    )  # fmt: skip
    ap.add_argument("--dilations", type=int_in(1, MAX_SEQ_LEN), nargs="+", default=[1, 2, 4, 6, 12])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--head-groups", action="store_true")
    ap.add_argument("--head-offsets", default="modulo", choices=["modulo", "grouped"])
    ap.add_argument("--cu-seqlens", type=int_in(0, MAX_SEQ_LEN), nargs="+", default=None)
    return ap


def _checked(ap: argparse.ArgumentParser, option: str, check):
    """``check()``, its ``ValueError`` reported as argparse does, naming ``option``."""
    try:
        return check()
    except ValueError as exc:
        ap.error(f"argument {option}: {exc}")


def main(argv: list[str] | None = None) -> int:
    """Print the route; the exit status (2: a bad option, said as argparse does, naming it)."""
    ap = _parser()
    try:
        args = ap.parse_args(argv)
        assumed = args.device.type == "cuda" and not torch.cuda.is_available()
        capability = args.capability or (0, 0)
        if args.capability is None and args.device.type == "cuda":
            capability = (9, 0) if assumed else torch.cuda.get_device_capability(args.device)
        heads, kv_heads = args.heads, args.kv_heads or args.heads  # --kv-heads: >= 1 or None
        if heads % kv_heads:
            ap.error(f"argument --kv-heads: must divide --heads {heads}, got {kv_heads}")
        pattern = _checked(ap, "--segments/--dilations", lambda: Pattern(
            args.segments, args.dilations, causal=args.causal, head_groups=args.head_groups,
            head_offsets=args.head_offsets,
        ))  # fmt: skip
        pattern = _checked(ap, "--cu-seqlens", lambda: pattern.with_documents(args.cu_seqlens))
        _checked(ap, "--heads", lambda: pattern.check_heads(heads))
        _checked(ap, "--seq-len" if args.cu_seqlens is None else "--cu-seqlens",
                 lambda: pattern.check_length(args.seq_len))  # fmt: skip
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    dtype = getattr(torch, args.dtype)
    missing = unavailable()
    if assumed:  # what a CUDA build of PyTorch would find: its cuDNN
        missing = tuple((name, why) for name, why in missing if name != "cudnn")
    print(_defaults(ap, args, argv if argv is not None else sys.argv[1:], assumed))
    shape = (args.seq_len, heads, kv_heads, args.head_dim, dtype, args.device, capability)
    print(describe(pattern, *shape, missing))
    return 0


def _defaults(ap: argparse.ArgumentParser, args, argv: list[str], assumed: bool) -> str:
    """The line saying which values were defaults (the options not given)."""
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    shown = []
    for action in ap._actions:
        opt = action.option_strings[-1] if action.option_strings else None
        if opt is None or opt in given or opt == "--help":
            continue
        value = getattr(args, action.dest)
        if action.dest == "capability":
            if not assumed:
                continue
            value = "9.0 (no CUDA device here)"
        elif action.dest == "device":
            value = value.type
        elif action.dest == "kv_heads":
            value = f"{args.heads} (--heads)"
        elif value is None:
            value = "none"
        elif isinstance(value, list):
            value = " ".join(map(str, value))
        elif action.nargs == 0:
            continue
        shown.append(f"{opt} {value}")
    text = "defaults: " + (", ".join(shown) or "none (every option given)")
    if assumed:
        text += "; cuDNN assumed present (no CUDA device here; PyTorch's CUDA builds carry it)"
    return text + " (python -m ring_attention.info --help)"


if __name__ == "__main__":
    sys.exit(main())
