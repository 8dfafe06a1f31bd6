"""Unions of arithmetic progressions cut to intervals, counted without visiting
their elements (:func:`union_stats`; docs/planner.md)."""

import itertools
import math
from collections.abc import Iterable

import torch

from ..core.cache import cached

#: A set ``{u in [lo, hi) : u ≡ residue (mod rate)}``.
Progression = tuple[int, int, int, int]  # (lo, hi, rate, residue)

_MAX_LISTED = 1 << 12  # unions of at most this many rows are listed
_FEW_CLASSES = 5  # unions of this many classes go straight to inclusion-exclusion
_MAX_PERIOD = 1 << 20  # longest period tabulated
_MAX_ENUMERATED = 1 << 22  # longest interval enumerated when the period is longer
_MAX_TERMS = 1 << 14  # non-empty intersections summed by inclusion-exclusion


def _count(lo: int, hi: int, rate: int, residue: int) -> int:
    f = lo + (residue - lo) % rate
    return (hi - f + rate - 1) // rate if f < hi else 0


def _minimal(classes: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Residue classes without those contained in another, sorted."""
    keep: list[tuple[int, int]] = []
    for rb, pb in sorted(set(classes)):  # a container's rate is never larger
        if not any(rb % ra == 0 and pb % ra == pa for ra, pa in keep):
            keep.append((rb, pb))
    return tuple(keep)


@cached("planner period tables", 256)
def _period_table(classes: tuple[tuple[int, int], ...], period: int) -> tuple[int, torch.Tensor]:
    """Members of one period of the union and their prefix counts."""
    member = torch.zeros(period, dtype=torch.bool)
    for rate, residue in classes:
        member[residue::rate] = True
    pre = torch.cumsum(member, 0)
    return int(pre[-1]), pre


def _crt(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The intersection of two residue classes, or ``None`` when empty."""
    (r1, p1), (r2, p2) = a, b
    g = math.gcd(r1, r2)
    if (p2 - p1) % g:
        return None
    m = r2 // g
    t = ((p2 - p1) // g * pow(r1 // g, -1, m)) % m if m > 1 else 0
    lcm = r1 // g * r2
    return lcm, (p1 + r1 * t) % lcm


def _inclusion_exclusion(x: int, y: int, classes: tuple[tuple[int, int], ...]) -> int | None:
    """Members of ``[x, y)`` in the union by inclusion-exclusion (or ``None``)."""
    total, terms = 0, 0
    stack = [(i + 1, cls, 1) for i, cls in enumerate(classes)]
    while stack:
        nxt, cls, size = stack.pop()
        n = _count(x, y, *cls)
        if n == 0:
            continue  # so is every intersection with more classes
        terms += 1
        if terms > _MAX_TERMS:
            return None
        total += n if size % 2 else -n
        for i in range(nxt, len(classes)):
            both = _crt(cls, classes[i])
            if both is not None:
                stack.append((i + 1, both, size + 1))
    return total


@cached("planner periodic counts", 1 << 16)
def _periodic_count(x: int, y: int, classes: tuple[tuple[int, int], ...]) -> int:
    """Members of ``[x, y)`` in the union of the residue classes."""
    period = math.lcm(*(r for r, _ in classes))
    if len(classes) <= _FEW_CLASSES or period > _MAX_PERIOD:
        count = _inclusion_exclusion(x, y, classes)
        if count is not None:
            return count
    if period <= _MAX_PERIOD:
        total, pre = _period_table(classes, period)

        def upto(z: int) -> int:  # members in [0, z)
            q, rem = divmod(z, period)
            return q * total + (int(pre[rem - 1]) if rem else 0)

        return upto(y) - upto(x)
    if y - x > _MAX_ENUMERATED:
        raise ValueError(
            f"the exchange model cannot count a union of {len(classes)} residue classes with "
            f"period {period} over {y - x} rows; use dilation rates that divide each other"
        )
    u = torch.arange(x, y, dtype=torch.int64)
    hit = torch.zeros(y - x, dtype=torch.bool)
    for rate, residue in classes:
        hit |= (u - residue) % rate == 0
    return int(hit.sum())


def union_stats(sets: Iterable[Progression]) -> tuple[int, int, int]:
    """``(count, first, last)`` of the union of the progressions ``sets``;
    ``(0, -1, -1)`` when it is empty."""
    live: list[tuple[int, int, int, int, int, int]] = []  # (rate, residue, lo, hi, first, last)
    for lo, hi, r, p in sets:
        p %= r
        f = lo + (p - lo) % r
        if f < hi:
            live.append((r, p, lo, hi, f, hi - 1 - (hi - 1 - p) % r))
    if not live:
        return 0, -1, -1
    first = min(s[4] for s in live)
    last = max(s[5] for s in live)
    kept: list[tuple[int, int, int, int, int, int]] = []
    for s in sorted(live):  # a progression inside another (a container's rate is never larger)
        r, p, _, _, f, l = s
        if not any(
            r % r2 == 0 and p % r2 == p2 and lo2 <= f and l < hi2 for r2, p2, lo2, hi2, _, _ in kept
        ):
            kept.append(s)
    if len(kept) == 1:
        r, p, lo, hi, _, _ = kept[0]
        return _count(lo, hi, r, p), first, last
    if sum((hi - lo) // r + 1 for r, _, lo, hi, _, _ in kept) <= _MAX_LISTED:
        # few rows (dilated branches near the gap, or far apart): list them
        rows = set()
        for r, _, _, hi, f, _ in kept:
            rows.update(range(f, hi, r))
        return len(rows), first, last
    cuts = sorted({s[2] for s in kept} | {s[3] for s in kept})
    count = 0
    for x, y in itertools.pairwise(cuts):
        classes = _minimal((r, p) for r, p, lo, hi, _, _ in kept if lo <= x and y <= hi)
        if classes:
            count += _periodic_count(x, y, classes)
    return count, first, last
