"""Every ``RING_ATTENTION_*`` environment variable the Python side reads, parsed once per value and
checked (``ValueError`` naming the variable); :data:`KNOBS` is the table docs/design.md lists."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .cache import cached
from .links import LINKS

__all__ = [
    "BACKWARD",
    "DENSE_BACKEND",
    "DENSE_BACKENDS",
    "EMULATOR_SANITIZE",
    "FAR_BYTES",
    "FORWARD",
    "KNOBS",
    "MODES",
    "SPAN_ROWS",
    "Knob",
    "backward_mode",
    "dense_backend",
    "emulator_sanitize",
    "far_bytes",
    "forward_mode",
    "span_rows",
]

FORWARD = "RING_ATTENTION_FORWARD"
BACKWARD = "RING_ATTENTION_BACKWARD"
DENSE_BACKEND = "RING_ATTENTION_DENSE_BACKEND"
SPAN_ROWS = "RING_ATTENTION_DENSE_SPAN_ROWS"
EMULATOR_SANITIZE = "RING_ATTENTION_EMULATOR_SANITIZE"
FAR_BYTES = "RING_ATTENTION_FAR_BYTES"

#: ``auto``: the table of ring_attention/local/dispatch.py; ``kernel``: always our
#: kernels; ``dense``: the per-branch dense backends wherever one can run the
#: call (the CPU included, through PyTorch's CPU flash attention), and the
#: ring's blocks of plain dense attention through them likewise.
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


def _get(name: str, default: str) -> str:
    return os.environ.get(name, default)


def forward_mode() -> str:
    """``RING_ATTENTION_FORWARD``: one of :data:`MODES` (default ``auto``)."""
    return _choice(FORWARD, _get(FORWARD, "auto"), MODES)


def backward_mode() -> str:
    """``RING_ATTENTION_BACKWARD``: one of :data:`MODES` (default ``auto``)."""
    return _choice(BACKWARD, _get(BACKWARD, "auto"), MODES)


def dense_backend() -> str:
    """``RING_ATTENTION_DENSE_BACKEND``: one of :data:`DENSE_BACKENDS` (default ``auto``)."""
    return _choice(DENSE_BACKEND, _get(DENSE_BACKEND, "auto"), DENSE_BACKENDS)


@cached("config rows")
def _rows(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1 or str(value) != raw.strip():
        raise ValueError(f"{SPAN_ROWS} must be an integer >= 1, got {raw!r}")
    return value


def span_rows() -> int:
    """``RING_ATTENTION_DENSE_SPAN_ROWS``: the fewest rows of a span (default 131072)."""
    return _rows(_get(SPAN_ROWS, "131072"))


@cached("config far bytes")
def _far(raw: str, device_type: str) -> int:
    if raw == "off":
        return 0
    if raw == "auto":
        return LINKS["cuda" if device_type == "cuda" else "cpu"][0].far_bytes
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0 or str(value) != raw.strip():
        raise ValueError(f"{FAR_BYTES} must be off, auto or an integer >= 0, got {raw!r}")
    return value


def far_bytes(device_type: str) -> int:
    """``RING_ATTENTION_FAR_BYTES`` for ``device_type`` (0: ``off``, the default)."""
    return _far(_get(FAR_BYTES, "off"), device_type)


def emulator_sanitize() -> list[str]:
    """``RING_ATTENTION_EMULATOR_SANITIZE``: flags of a sanitized CUDA emulator build."""
    return _get(EMULATOR_SANITIZE, "").split()
