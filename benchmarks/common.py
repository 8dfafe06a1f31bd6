"""Shared helpers of the benchmark subcommands: argument parsing of
configurations, devices and dtypes, progress bars, markdown tables, plots."""

from __future__ import annotations

import argparse
import math
import os
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from . import measure

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(measure.ROOT, "build", "bench")
ROW_BLOCK = 1024  # rows of the seeded global tensors generated per block
RING_SEGMENTS, RING_DILATIONS = (512, 2048, 8192), (1, 4, 16)


# --------------------------------------------------------------------------- #
# small helpers
# --------------------------------------------------------------------------- #
def parse_config(text: str) -> tuple[int, int]:
    """``"12x64"`` -> (heads, head_dim)."""
    try:
        h, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        msg = f"expected HEADSxHEAD_DIM like 12x64, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if h < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"heads and head_dim must be positive, got {text!r}")
    return h, d


def resolve_device(name: str, present: bool = True) -> torch.device:
    """``auto``: CUDA when available; ``present=False`` allows a device that is
    not there (plans only)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if present and name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def rate_unit(device_type: str) -> tuple[str, float]:
    return ("TFLOP/s", 1e12) if device_type == "cuda" else ("GFLOP/s", 1e9)


def progress(items: Sequence[Any], desc: str, size: Callable[[Any], int] | None = None):
    """Yields ``items`` under a tqdm bar on stderr that counts points:
    ``size(item)`` of them per item (one by default); plain iteration when
    tqdm is not installed."""
    sizes = [1 if size is None else size(x) for x in items]
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"{desc}: {sum(sizes)} to run (pip install tqdm for a progress bar)")
        yield from items
        return
    with tqdm(total=sum(sizes), desc=desc, unit="point", dynamic_ncols=True,
              file=sys.stderr) as bar:  # fmt: skip
        for x, n in zip(items, sizes, strict=True):
            yield x
            bar.update(n)


def say(text: str) -> None:
    """Print without breaking a tqdm bar."""
    try:
        from tqdm import tqdm

        tqdm.write(text)
    except ImportError:
        print(text, flush=True)


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> list[str]:
    align = align or "r" * len(header)
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    lines = ["| " + " | ".join(header) + " |", sep]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return lines


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}f}"


def pyplot():
    """matplotlib's pyplot (Agg), or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')")
        return None
    return plt


#: The width of the markdown reports' prose (headers, notes): a terminal's.
WIDTH = 100


def wrap(text: str) -> list[str]:
    """``text`` as lines of at most ``WIDTH`` columns (a long word stays whole)."""
    return textwrap.wrap(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def heading(title: str, run: dict[str, Any] | None) -> list[str]:
    """A report's title and the run it describes (``measure.describe``),
    wrapped; nothing without a run."""
    return [f"# {title}", "", *wrap(measure.describe(run)), ""] if run else []


def write_text(path: str, lines: Sequence[str]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
