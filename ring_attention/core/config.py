"""Every ``RING_ATTENTION_*`` environment variable the Python side reads, parsed once per value and
checked (``ValueError`` naming the variable); :data:`KNOBS` is the table docs/design.md lists."""

import os
from dataclasses import dataclass

from .cache import cached
from .links import LINKS

FORWARD = "RING_ATTENTION_FORWARD"
BACKWARD = "RING_ATTENTION_BACKWARD"
BACKWARD_HEADS = "RING_ATTENTION_BACKWARD_HEADS"
DENSE_BACKEND = "RING_ATTENTION_DENSE_BACKEND"
SPAN_ROWS = "RING_ATTENTION_DENSE_SPAN_ROWS"
EMULATOR_SANITIZE = "RING_ATTENTION_EMULATOR_SANITIZE"
FAR_BYTES = "RING_ATTENTION_FAR_BYTES"

#: ``auto``: the table of ring_attention/local/dispatch.py; ``kernel``: always our kernels;
#: ``dense``: the dense backends wherever one can run the call (docs/design.md §5).
MODES = ("auto", "kernel", "dense")
#: ``auto``: the table's choice per call; a name: that backend where it can
#: run a call, the table's choice elsewhere.
DENSE_BACKENDS = ("auto", "fa4", "flash", "cudnn", "cpu")


@dataclass(frozen=True)
class Knob:
    """One environment variable: its name, accepted values (in words),
    default and what it selects."""

    name: str
    values: str
    default: str
    what: str


KNOBS = (
    Knob(FORWARD, ", ".join(MODES), "auto",
         "the local op's forward (and the ring's dense blocks): the dispatch table, our kernels, "
         "or the dense backends"),
    Knob(BACKWARD, ", ".join(MODES), "auto",
         "the backward, likewise (a gradient reaching lse always takes our kernel)"),
    Knob(BACKWARD_HEADS, "all, auto, or an integer >= 1", "all",
         "the ring's backward by groups of this many query heads (whole K/V heads' groups); auto: "
         "the most whose fp32 dq, dk, dv take no more bytes than q (all for fp32 and fp64)"),
    Knob(DENSE_BACKEND, ", ".join(DENSE_BACKENDS), "auto",
         "the dense backend of the per-branch calls: the table's, or the one named where it can "
         "run"),
    Knob(SPAN_ROWS, "an integer >= 1", "131072",
         "the fewest rows of a span of the per-branch path (its buffers: about n / 16 rows)"),
    Knob(FAR_BYTES, "off, auto, or an integer >= 0", "off",
         "the ring's transfers of at most this many K/V bytes travel in one batch per pass, "
         "posted first (auto: latency x bandwidth of the planner's link, 500 kB on cuda)"),
    Knob(EMULATOR_SANITIZE, "compiler flags", "(none)",
         "tests only: build the CUDA emulator with these flags (scripts/sanitize.sh)"),
)  # fmt: skip


@cached("config choices")
def _choice(name: str, raw: str, accepted: tuple[str, ...]) -> str:
    if raw not in accepted:
        raise ValueError(f"{name} must be one of {list(accepted)}, got {raw!r}")
    return raw


def forward_mode() -> str:
    """``RING_ATTENTION_FORWARD``: one of :data:`MODES` (default ``auto``)."""
    return _choice(FORWARD, os.environ.get(FORWARD, "auto"), MODES)


def backward_mode() -> str:
    """``RING_ATTENTION_BACKWARD``: one of :data:`MODES` (default ``auto``)."""
    return _choice(BACKWARD, os.environ.get(BACKWARD, "auto"), MODES)


def dense_backend() -> str:
    """``RING_ATTENTION_DENSE_BACKEND``: one of :data:`DENSE_BACKENDS` (default ``auto``)."""
    return _choice(DENSE_BACKEND, os.environ.get(DENSE_BACKEND, "auto"), DENSE_BACKENDS)


def _at_least(raw: str, low: int, message: str) -> int:
    """``raw`` as an integer written plainly, at least ``low``; else ``ValueError(message)``."""
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low or str(value) != raw.strip():
        raise ValueError(message)
    return value


@cached("config rows")
def _rows(raw: str) -> int:
    return _at_least(raw, 1, f"{SPAN_ROWS} must be an integer >= 1, got {raw!r}")


def span_rows() -> int:
    """``RING_ATTENTION_DENSE_SPAN_ROWS``: the fewest rows of a span (default 131072)."""
    return _rows(os.environ.get(SPAN_ROWS, "131072"))


@cached("config backward heads")
def _group(raw: str) -> str | int:
    if raw in ("all", "auto"):
        return raw
    return _at_least(raw, 1, f"{BACKWARD_HEADS} must be all, auto or an integer >= 1, got {raw!r}")


def backward_heads(heads: int, kv_group: int, itemsize: int, setting: str | None = None) -> int:
    """Query heads per group of the ring's backward (0: all at once) for ``heads`` query heads
    of ``itemsize`` bytes, ``kv_group`` per K/V head: ``setting`` or the variable (:data:`KNOBS`),
    rounded down to whole K/V heads' query heads, at least one K/V head's."""
    value = _group(os.environ.get(BACKWARD_HEADS, "all") if setting is None else str(setting))
    if value == "all" or (value == "auto" and itemsize >= 4):
        return 0
    if value == "auto":
        value = heads * itemsize * kv_group // (4 * (kv_group + 2))
    value = max(kv_group, value // kv_group * kv_group)
    return 0 if value >= heads else value


@cached("config far bytes")
def _far(raw: str, device_type: str) -> int:
    if raw == "off":
        return 0
    if raw == "auto":
        return LINKS["cuda" if device_type == "cuda" else "cpu"][0].far_bytes
    return _at_least(raw, 0, f"{FAR_BYTES} must be off, auto or an integer >= 0, got {raw!r}")


def far_bytes(device_type: str) -> int:
    """``RING_ATTENTION_FAR_BYTES`` for ``device_type`` (0: ``off``, the default)."""
    return _far(os.environ.get(FAR_BYTES, "off"), device_type)


def emulator_sanitize() -> list[str]:
    """``RING_ATTENTION_EMULATOR_SANITIZE``: flags of a sanitized CUDA emulator build."""
    return os.environ.get(EMULATOR_SANITIZE, "").split()
