"""The ring handshake: before any K/V moves, the ranks of a ring call agree.

One small all-gather of int64 metadata per call (local length, batch, heads,
head_dim, dtype, pattern hash, causal, head_groups, scale, layout, grad mode
and an error flag). Ranks that disagree, or a rank whose own inputs failed
validation, make every rank raise ``ValueError`` (DESIGN.md §6) instead of
some ranks entering the ring and hanging.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .sharding import LAYOUTS, all_gather_ints, dtype_code, dtype_name, layout_shard_lengths

__all__ = ["handshake", "ring_metadata"]


_MAGIC = 0x52494E47  # "RING"
_FIELDS = (
    "magic", "error", "seq_len_local", "batch", "heads", "head_dim", "dtype",
    "pattern_hash", "n_branches", "causal", "head_groups", "scale", "layout",
    "requires_grad",
)  # fmt: skip


def _pattern_hash(segs: Sequence[int], dils: Sequence[int]) -> int:
    return zlib.crc32(repr((tuple(segs), tuple(dils))).encode())


def _scale_bits(scale: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def _bits_scale(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def handshake(
    group: dist.ProcessGroup | None, world: int, values: dict[str, int] | None, layout: str, pattern
) -> int:
    """All-gather the metadata of every rank and check it agrees.

    ``values`` is ``None`` when this rank's own inputs failed validation (it
    then raises its own error after the handshake). Returns the global length.
    Raises ``ValueError`` on every rank when ranks disagree.
    """
    if values is None:
        row = [_MAGIC, 1] + [-1] * (len(_FIELDS) - 2)
    else:
        row = [values.get(f, 0) for f in _FIELDS]
        row[0], row[1] = _MAGIC, 0
    rows = all_gather_ints(row, group)
    table = {f: [r[i] for r in rows] for i, f in enumerate(_FIELDS)}
    if any(m != _MAGIC for m in table["magic"]):
        raise ValueError(
            "ring_dilated_attention: ranks are out of step (a rank is running a different "
            "collective than the ring handshake)"
        )
    bad = [r for r, e in enumerate(table["error"]) if e]
    if bad:
        if values is None:
            return -1  # the caller raises its own error
        raise ValueError(
            f"ring_dilated_attention: rank(s) {bad} rejected their inputs (see the error "
            "raised there); the ring was not run"
        )

    def differ(name: str) -> bool:
        return len(set(table[name])) > 1

    prefix = "ring_dilated_attention: ranks disagree on "
    if differ("pattern_hash") or differ("n_branches"):
        try:
            patterns = [None] * world
            dist.all_gather_object(patterns, pattern, group=group)
            detail = ", ".join(
                f"rank {r}: segment_lengths={list(p[0])} dilation_rates={list(p[1])}"
                for r, p in enumerate(patterns)
            )
        except Exception:  # pragma: no cover - the message is a courtesy
            detail = f"pattern hashes {table['pattern_hash']}"
        raise ValueError(prefix + f"the pattern (segment_lengths/dilation_rates): {detail}")
    if differ("dtype"):
        raise ValueError(
            prefix + f"the dtype: {[dtype_name(c) for c in table['dtype']]} (rank order)"
        )
    for name, what in (
        ("heads", "the number of heads (q.shape[2])"),
        ("head_dim", "head_dim (q.shape[3])"),
        ("batch", "the batch size (q.shape[0])"),
        ("causal", "causal"),
        ("head_groups", "head_groups"),
        ("layout", "layout"),
        ("requires_grad", "whether a gradient is needed (every rank must run the backward)"),
    ):
        if differ(name):
            vals = table[name]
            if name in ("causal", "head_groups", "requires_grad"):
                vals = [bool(x) for x in vals]
            if name == "layout":
                vals = [LAYOUTS[x] if 0 <= x < len(LAYOUTS) else x for x in vals]
            raise ValueError(prefix + f"{what}: {vals} (rank order)")
    if differ("scale"):
        raise ValueError(prefix + f"scale: {[_bits_scale(b) for b in table['scale']]} (rank order)")
    lengths = table["seq_len_local"]
    n = sum(lengths)
    expected = layout_shard_lengths(n, world, layout)
    if lengths != expected:
        raise ValueError(
            f"ring_dilated_attention: the local sequence lengths {lengths} (rank order, global "
            f"length {n}) do not follow the layout={layout!r} sharding convention, which expects "
            f"{expected} (torch.tensor_split); shard inputs with ring_attention.shard_sequence"
        )
    return n


def ring_metadata(
    q: torch.Tensor,
    segs: Sequence[int],
    dils: Sequence[int],
    *,
    causal: bool,
    head_groups: bool,
    scale: float,
    layout: str,
    needs_grad: bool,
) -> dict[str, int]:
    """This rank's row of the handshake (``q``: the validated local query)."""
    B, L, H, D = q.shape
    return {
        "seq_len_local": L,
        "batch": B,
        "heads": H,
        "head_dim": D,
        "dtype": dtype_code(q.dtype),
        "pattern_hash": _pattern_hash(segs, dils),
        "n_branches": len(segs),
        "causal": int(bool(causal)),
        "head_groups": int(bool(head_groups)),
        "scale": _scale_bits(scale),
        "layout": LAYOUTS.index(layout),
        "requires_grad": int(needs_grad),
    }
