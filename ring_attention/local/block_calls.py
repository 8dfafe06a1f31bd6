"""The dense calls of one ring block, per branch, offset class and K/V head run: pairs of strided
views, planned once per block shape (docs/design.md §5, the ring's per-step blocks)."""

from typing import NamedTuple

from ..core.cache import LRUCache
from ..core.pattern import Pattern
from .spans import Call, HeadRange, _classes


def block_kind(causal: bool, q_start: int, lq: int, k_start: int, lk: int) -> str | None:
    """``"full"``, ``"causal"`` or ``"skip"`` for one dense call of queries ``[q_start, q_start +
    lq)`` against keys ``[k_start, k_start + lk)``; ``None``: a causal diagonal cut across."""
    if lq == 0 or lk == 0:
        return "skip"
    if not causal or k_start + lk <= q_start + 1:
        return "full"
    if k_start >= q_start + lq:
        return "skip"
    if k_start == q_start and lk == lq:
        return "causal"
    return None


class BlockCall(NamedTuple):
    """One dense call of a block: its query rows (``q``, relative to the query piece), its key
    rows (``k``, relative to ``k_start``; its K/V heads), causal or full."""

    q: Call
    k: Call
    causal: bool


def block_calls(
    pattern: Pattern, heads: int, kv_heads: int, q_start: int, lq: int, k_start: int, lk: int
) -> tuple[BlockCall, ...] | None:
    """The dense calls of a block (cached; ``()``: no query reaches a key), ``None`` where some
    class's rows need more than one call (a causal diagonal cut across): our kernel's block."""
    key = (pattern, heads, kv_heads, q_start, lq, k_start, lk)
    return _PLANS.get(key, lambda: _plan(*key))


def _run(seg: int, w: int, r: int, o: int, lo: int, hi: int) -> tuple[int, int]:
    """``(first, count)``: the active positions of class ``o`` of segment ``[seg, seg + w)`` in
    ``[lo, hi)`` (csrc/pattern.h's ``active_run``)."""
    a, b = max(lo, seg), min(hi, seg + w)
    first = seg + o + (0 if a - seg <= o else -(-(a - seg - o) // r) * r)
    return first, (-(-(b - first) // r) if first < b else 0)


def _call(b: int, o: int, first: int, segments: int, w: int, rows: int, r: int,
          heads: tuple[int, ...]) -> Call:  # fmt: skip
    """A :class:`~.spans.Call` of these rows (strides of one-element dimensions: 1, so no view
    of a segment longer than the sequence computes a stride beyond int64)."""
    return Call(b, o, first, segments, w if segments > 1 else 1, rows, r if rows > 1 else 1,
                *heads, kv_slot=0)  # fmt: skip


def _plan(pattern: Pattern, heads: int, kv_heads: int, q0: int, lq: int, k0: int,
          lk: int) -> tuple[BlockCall, ...] | None:  # fmt: skip
    hr = HeadRange(0, heads, heads, heads // kv_heads)
    q1, k1 = q0 + lq, k0 + lk
    calls = []
    for b, (w, r) in enumerate(pattern.branches):
        lo, hi = max(q0 // w, k0 // w), min((q1 - 1) // w, (k1 - 1) // w)
        if lq == 0 or lk == 0 or lo > hi:
            continue
        # the segments meeting both ranges: the first and last (maybe cut), those between
        # lying inside both (one call for all of them)
        groups = [(lo, 1), (lo + 1, hi - lo - 1), (hi, 1)] if hi > lo else [(lo, 1)]
        groups = [(s, segments) for s, segments in groups if segments > 0]
        for o, runs in _classes(pattern, b, hr):
            for s, segments in groups:
                (qf, qn), (kf, kn) = (_run(s * w, w, r, o, *x) for x in ((q0, q1), (k0, k1)))
                if not qn or not kn:
                    continue
                kind = block_kind(pattern.causal, qf, r * (qn - 1) + 1, kf, r * (kn - 1) + 1)
                if kind is None:
                    return None
                if kind == "skip":
                    continue
                for run in runs:
                    q = _call(b, o, qf - q0, segments, w, qn, r, run)
                    k = _call(b, o, kf - k0, segments, w, kn, r, run)
                    calls.append(BlockCall(q, k, kind == "causal"))
    return tuple(calls)


_PLANS: LRUCache[tuple[BlockCall, ...] | None] = LRUCache(4096, name="ring block calls")
