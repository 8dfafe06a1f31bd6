"""Checked option types of the command lines: a bad value is refused while
parsing (exit 2); sizes take units (``80GB``, ``24GiB``, ``1e9``, ``64K``)."""

import argparse
import math
import re
from collections.abc import Callable

#: The most memory per rank the planner takes (256 TiB; inside int64).
MAX_BYTES = 2**48

#: Unit -> multiplier (``b``: a billion tokens).
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12, "kb": 10**3,
          "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """``"80GB"`` (10^9), ``"24GiB"`` (2^30), ``"1e9"``, ``"64K"``, ``"1B"`` -> an int."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    value = float(m.group(1)) if m else math.nan
    if not m or m.group(2).lower() not in _UNITS or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 80GB, 24GiB, 1e9, 64K)")
    return int(value * _UNITS[m.group(2).lower()])


def _checked(expected: str, convert: Callable, ok: Callable, got: Callable):
    """A parser type: ``convert(text)``, checked by ``ok``; else ``expected``, what it got."""

    def parse(text: str):
        try:
            x = convert(text)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
        if not ok(x):
            raise argparse.ArgumentTypeError(f"{expected}, got {got(text, x)}")
        return x

    return parse


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``[low, high]``."""
    expected = f"expected an integer in [{low}, {high}]"
    return _checked(expected, int, lambda n: low <= n <= high, lambda _, n: n)


def size_in(low: int, high: int) -> Callable[[str], int]:
    """A size (:func:`parse_size`) in ``[low, high]``."""
    expected = f"expected a size in [{low}, {high:.4g}] (e.g. 80GB, 24GiB, 1e9, 64K)"
    return _checked(expected, parse_size, lambda n: low <= n <= high,
                    lambda text, n: f"{text!r} = {n}")  # fmt: skip


def number_in(low: float, high: float, *, above: bool = False) -> Callable[[str], float]:
    """A finite number in ``[low, high]`` (``above``: ``> low``)."""
    expected = f"expected a finite number {'>' if above else '>='} {low:g} and <= {high:g}"

    def ok(x: float) -> bool:
        return math.isfinite(x) and (x > low if above else x >= low) and x <= high

    return _checked(expected, float, ok, lambda text, _: repr(text))


def reserve(text: str) -> tuple[str, float]:
    """Memory kept free per rank: a share (``"10%"``, in ``[0, 100)``) as
    ``("%", 10.0)``, or bytes (a size in ``[0, MAX_BYTES]``) as ``("bytes", n)``."""
    expected = f"expected bytes (8GB, at most {MAX_BYTES:.4g}) or a share in [0%, 100%) (10%)"
    text = str(text).strip()
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if math.isfinite(share) and 0 <= share < 100:
                return ("%", share)
        else:
            n = parse_size(text)
            if n <= MAX_BYTES:
                return ("bytes", n)
    except (ValueError, argparse.ArgumentTypeError):
        pass
    raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")


#: A bandwidth (Gbit/s) or a rate (TFLOP/s): finite, from 10^-6.
RATE = number_in(1e-6, 1e9)
#: A latency in microseconds: finite, >= 0 (at most about 16 minutes).
MICROSECONDS = number_in(0, 1e9)
