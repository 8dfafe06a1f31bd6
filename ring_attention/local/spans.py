"""The local op's branches as strided views of q, k, v (no gather, no copy), planned into spans of
whole segments and their dense calls (docs/design.md §5, "The local op through dense attention per
branch": the views, the spans, the part buffers and the merge operators' slot maps)."""

import bisect
import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..core.cache import LRUCache
from ..core.pattern import Pattern

#: Spans hold at least this many rows (the calls stay large) and about
#: 1/SPANS of the sequence (the part buffers stay small).
SPANS = 16

#: A call's rows take a multiple of this many rows in the part buffers: every part view (its LSE
#: too) starts 16-byte aligned with strides multiples of 8 elements (``backends.aligned``).
PART_ALIGN = 8


def _padded(rows: int) -> int:
    return -(-rows // PART_ALIGN) * PART_ALIGN


@dataclass(frozen=True)
class Call:
    """One dense attention call: rows ``start + s * seg_stride + j * row_stride`` (``s <
    segments``, ``j < rows``) of query heads ``q_head + c * q_head_stride`` against the same
    rows of K/V heads ``kv_head + i * kv_head_stride``; query head ``c`` reads K/V head ``c //
    group``. With a ``head_shift``, head index ``c`` also moves its rows by ``c * head_shift``
    positions (offset classes of one head each, side by side in one call)."""

    branch: int
    offset: int
    start: int
    segments: int
    seg_stride: int
    rows: int
    row_stride: int
    q_head: int
    q_heads: int
    q_head_stride: int
    kv_head: int
    kv_heads: int
    kv_head_stride: int
    kv_slot: int  # slot of the K/V-side sums (dk, dv)
    head_shift: int = 0  # positions a head index moves (classes of one head each as heads)

    @property
    def group(self) -> int:
        """Query heads per K/V head of the call."""
        return self.q_heads // self.kv_heads

    def positions(self) -> torch.Tensor:
        """``(segments, 1, rows)`` int64 absolute positions (``(segments, q_heads, rows)`` with a
        ``head_shift``)."""
        s = torch.arange(self.segments, dtype=torch.int64)[:, None, None] * self.seg_stride
        j = torch.arange(self.rows, dtype=torch.int64)[None, None, :] * self.row_stride
        pos = self.start + s + j
        if self.head_shift:
            pos = pos + torch.arange(self.q_heads)[None, :, None] * self.head_shift
        return pos

    def side(self, kv: bool) -> tuple[int, int, int]:
        """``(first head, heads, head stride)`` of the query side (the K/V side with ``kv``)."""
        if kv:
            return self.kv_head, self.kv_heads, self.kv_head_stride
        return self.q_head, self.q_heads, self.q_head_stride

    def geometry(self, shape: Sequence[int], stride: Sequence[int], kv: bool = False) -> "Geometry":
        """:meth:`view`'s geometry on a tensor of this ``shape`` and ``stride``."""
        head, count, step = self.side(kv)
        sb, sn, sh, sd = stride
        heads = step * sh + self.head_shift * sn
        steps = (sb, self.seg_stride * sn, self.row_stride * sn, heads, sd)
        size = (shape[0], self.segments, self.rows, count, shape[3])
        return size, steps, self.start * sn + head * sh

    def view(self, t: torch.Tensor, kv: bool = False) -> torch.Tensor:
        """The call's rows of ``t`` ``(B, n, heads, d)`` (K/V-shaped with ``kv``) as a ``(B,
        segments, rows, heads_of_call, d)`` view."""
        return _apply(t, self.geometry(t.shape, t.stride(), kv))

    def lse_geometry(self, shape: Sequence[int], stride: Sequence[int]) -> "Geometry":
        """:meth:`lse_view`'s geometry on an ``lse`` of this ``shape`` and ``stride``."""
        lb, lh, ln = stride
        heads = self.q_head_stride * lh + self.head_shift * ln
        steps = (lb, self.seg_stride * ln, heads, self.row_stride * ln)
        size = (shape[0], self.segments, self.q_heads, self.rows)
        return size, steps, self.start * ln + self.q_head * lh

    def lse_view(self, lse: torch.Tensor) -> torch.Tensor:
        """The call's rows of ``lse`` ``(B, H, n)`` as ``(B, segments, heads, rows)``."""
        return _apply(lse, self.lse_geometry(lse.shape, lse.stride()))

    def part_rows(self, batch: int, kv: bool = False) -> int:
        """Rows the call's outputs take in its span's part buffer: ``(B, segments, heads,
        rows)``, ``rows`` padded to :data:`PART_ALIGN`."""
        return batch * self.segments * self.side(kv)[1] * _padded(self.rows)

    def part_geometry(self, base: int, batch: int, kv: bool, width: int | None) -> "Geometry":
        """The call's rows ``[base, base + part_rows)`` of a contiguous part buffer (``(rows,
        width)``, or ``(rows,)`` with ``width`` None) as ``(B, segments, heads, rows[, width])``."""
        size = (batch, self.segments, self.side(kv)[1], self.rows)
        padded = (*size[:3], _padded(self.rows))
        if width is not None:
            size, padded = (*size, width), (*padded, width)
        stride = tuple(math.prod(padded[i + 1 :]) for i in range(len(padded)))
        return size, stride, base * (width or 1)


#: A view as ``(size, stride, offset)``, the offset in elements from the
#: viewed tensor's own storage offset (``Tensor.as_strided`` adds it).
Geometry = tuple[tuple[int, ...], tuple[int, ...], int]


def _apply(t: torch.Tensor, g: Geometry) -> torch.Tensor:
    return t.as_strided(g[0], g[1], t.storage_offset() + g[2])


def batch_groups(gs: Sequence[Geometry]) -> list[tuple[Geometry, ...]]:
    """``(B, S, ...)`` geometries as groups of ``(B * S, ...)`` ones: one group where batch and
    segments merge in all, else B groups of ``(S, ...)`` ones, one a batch row."""
    merged = tuple(
        ((b * s, *size), (sb if s == 1 else ss, *stride), offset)
        for (b, s, *size), (sb, ss, *stride), offset in gs
        if s == 1 or b == 1 or sb == s * ss
    )
    if len(merged) == len(gs):
        return [merged]
    return [tuple((g[0][1:], g[1][1:], g[2] + i * g[1][0]) for g in gs) for i in range(gs[0][0][0])]


def batched(view: torch.Tensor) -> list[torch.Tensor]:
    """A ``(B, S, ...)`` view as ``(B * S, ...)`` views: one where batch and segments merge, else
    one per batch row."""
    return [_apply(view, g) for (g,) in batch_groups([(tuple(view.shape), view.stride(), 0)])]


@dataclass(frozen=True)
class Span:
    """Positions ``[start, start + length)`` and the calls that cover them."""

    start: int
    length: int
    calls: tuple[Call, ...]
    q_slots: int
    kv_slots: int

    def part_order(self) -> list[int]:
        """Indices of :attr:`calls` in their part-buffer order: the other branches' calls, then
        branch 0's."""
        return sorted(range(len(self.calls)), key=lambda i: not self.calls[i].branch)  # stable


def head_runs(kv: list[int]) -> list[tuple[int, int, int, int]]:
    """Split the K/V heads ``kv`` (non-decreasing) of a class's query heads into runs ``(c0, c1,
    gg, step)`` with ``kv[c0 + i] == kv[c0] + (i // gg) * step`` (greedy)."""
    groups = [(x, len(list(g))) for x, g in itertools.groupby(kv)]  # (value, count)
    runs, c, i = [], 0, 0
    while i < len(groups):  # groups i..j-1: gg heads each, values stepping evenly
        gg, j = groups[i][1], i + 1
        step = groups[j][0] - groups[i][0] if j < len(groups) else 1
        while j < len(groups) and groups[j][1] == gg and groups[j][0] - groups[j - 1][0] == step:
            j += 1
        runs.append((c, c + (j - i) * gg, gg, step if j > i + 1 else 1))
        c, i = c + (j - i) * gg, j
    return runs


def _classes(pattern: Pattern, branch: int, heads: "HeadRange"):
    """``(offset, [(q_head, q_heads, q_stride, kv_head, kv_heads, kv_stride)])`` per offset class
    of the branch."""
    start, total, group = heads.start, heads.total, heads.group
    by_offset: dict[int, list[int]] = {}
    for h in pattern.applies(branch, total):
        if start <= h < start + heads.count:
            by_offset.setdefault(pattern.offset(h, branch, total), []).append(h)
    for o, hs in sorted(by_offset.items()):
        step = hs[1] - hs[0] if len(hs) > 1 else 1
        kv = [h // group - start // group for h in hs]
        runs = []
        for c0, c1, gg, kv_step in head_runs(kv):
            runs.append((hs[c0] - start, c1 - c0, step, kv[c0], (c1 - c0) // gg, kv_step))
        yield o, runs


def _piece_calls(
    pattern: Pattern, start: int, length: int, heads: "HeadRange", slots: list[int]
) -> list[Call]:
    """Calls of positions ``[start, start + length)``, which begin a segment of every branch and
    end a document or a whole segment of every branch."""
    calls = []
    for b, (w, r) in enumerate(pattern.branches):
        branch: list[tuple[int, Call]] = []
        w = min(w, length) if length else w
        nfull, rem = divmod(length, w)
        for o, runs in _classes(pattern, b, heads):
            parts = []
            if nfull and o < w:
                parts.append((start + o, nfull, -(-(w - o) // r)))
            if rem > o:
                parts.append((start + nfull * w + o, 1, -(-(rem - o) // r)))
            for part, (first, segments, rows) in enumerate(parts):
                for k, (qh, qc, qs, kh, kc, ks) in enumerate(runs):
                    call = (b, o, first, segments, w, rows, r, qh, qc, qs, kh, kc, ks)
                    branch.append((part, Call(*call, kv_slot=slots[b] + k)))
        calls += _side_by_side(branch)
    return calls


def _side_by_side(calls: list[tuple[int, Call]]) -> list[Call]:
    """A branch's calls (``(part, call)``), those of one query and one K/V head whose starts and
    heads step evenly merged into one call each (``head_shift``)."""
    out: list[Call] = []
    runs: dict[tuple[int, ...], list[Call]] = {}

    def step(a: Call, b: Call) -> tuple[int, int, int]:
        return b.start - a.start, b.q_head - a.q_head, b.kv_head - a.kv_head

    def emit(run: list[Call]) -> None:
        if len(run) > 1:
            shift, q_stride, kv_stride = step(run[0], run[1])
            run = [dataclasses.replace(
                run[0], q_heads=len(run), q_head_stride=q_stride, kv_heads=len(run),
                kv_head_stride=kv_stride, head_shift=shift,
            )]  # fmt: skip
        out.extend(run)

    for part, call in calls:
        if call.q_heads != 1 or call.kv_heads != 1:
            out.append(call)
            continue
        run = runs.setdefault((part, call.segments, call.rows, call.kv_slot), [])
        if run:  # a run steps evenly (as its first step, this one's if none) and forward
            first = step(run[0], run[1] if len(run) > 1 else call)
            if step(run[-1], call) != first or call.start <= run[-1].start:
                emit(run)
                run.clear()
        run.append(call)
    for run in runs.values():
        emit(run)
    return out


def _cuts(n: int, documents: tuple[int, ...] | None, period: int, target: int) -> list[int]:
    """Span boundaries ``0 = c_0 < ... < c_k = n``: document boundaries or multiples of
    ``period`` from a document's start, each span near ``target`` rows."""
    docs = sorted(set(documents if documents is not None else (0, n)))  # no empty documents
    cuts, a = [0], 0
    while a < n:
        limit = min(a + target, n)
        e = docs[bisect.bisect_right(docs, limit - 1) - 1]  # where the document of limit - 1 starts
        # the last document boundary or multiple of the period from e in (a, limit]
        best = max(docs[bisect.bisect_right(docs, limit) - 1], e + (limit - e) // period * period)
        if best <= a:  # none: the next safe point
            j = bisect.bisect_right(docs, a) - 1
            best = min(docs[j] + ((a - docs[j]) // period + 1) * period, docs[j + 1])
        cuts.append(best)
        a = best
    return cuts


@dataclass(frozen=True)
class SpanPlan:
    """The spans of one ``(pattern, n, heads, kv_heads)`` problem and their calls."""

    pattern: Pattern
    n: int
    heads: int
    kv_heads: int
    span_rows: int
    head_range: tuple[int, int, int]
    spans: tuple[Span, ...] = field(compare=False, hash=False, repr=False)

    @property
    def calls(self) -> int:
        """Dense calls of one pass over the sequence."""
        return sum(len(w.calls) for w in self.spans)

    def index(
        self, i: int, batch: int, device: torch.device
    ) -> tuple[torch.Tensor, int, torch.Tensor, int]:
        """``(q_index, q_rows, kv_index, kv_rows)`` of span ``i``: int32 ``(slots, B, length,
        heads)`` part rows (``-1``: none) and each side's buffer rows (cached)."""
        return _INDEX.get(
            (self, i, batch, str(device)),
            lambda: _index_of(self.spans[i], batch, self.heads, self.kv_heads, device),
        )

    def lse_index(self, i: int, batch: int, device: torch.device) -> torch.Tensor:
        """Int64 flat index into ``(B, heads, n)`` of every query-side part row of span ``i``, so
        ``torch.take(lse, index)`` lays ``lse`` out as the parts (cached)."""
        span = self.spans[i]

        def build():
            flat = []
            lse = (batch, self.heads, self.n), (self.heads * self.n, self.n, 1)  # shape, stride
            for call in (span.calls[j] for j in span.part_order()):
                size, stride, offset = call.lse_geometry(*lse)
                axes = (torch.arange(e) * s for e, s in zip(size, stride, strict=True))
                index = sum(torch.meshgrid(*axes, indexing="ij")) + offset
                pad = _padded(call.rows) - call.rows  # the parts' padding: any valid index
                flat.append(torch.nn.functional.pad(index, (0, pad)).reshape(-1))
            return torch.cat(flat).to(device) if flat else torch.zeros(0, dtype=torch.int64)

        return _LSE_INDEX.get((self, i, batch, str(device)), build)


class HeadRange(NamedTuple):
    """Query heads ``[start, start + count)`` of ``total`` (``group`` per K/V head)."""

    start: int
    count: int
    total: int
    group: int


def plan_spans(
    pattern: Pattern, n: int, heads: int, kv_heads: int, span_rows: int,
    head_range: tuple[int, int, int] = (0, 0, 0),
) -> SpanPlan:  # fmt: skip
    """The :class:`SpanPlan` of a problem (cached); ``head_range``: ``(head_start, total_heads,
    total_kv_heads)``, ``total_heads`` 0: every head."""
    key = (pattern, n, heads, kv_heads, span_rows, head_range)
    return _PLANS.get(key, lambda: SpanPlan(*key, spans=_plan(*key)))


def _plan(pattern: Pattern, n: int, heads: int, kv_heads: int, span_rows: int,
          head_range: tuple[int, int, int]):  # fmt: skip
    start, all_heads, all_kv = head_range if head_range[1] else (0, heads, kv_heads)
    hr = HeadRange(start, heads, all_heads, all_heads // all_kv)
    slots = [0]  # K/V slots: per branch, as many as its classes have head runs at most
    for b in range(pattern.n_branches):
        slots.append(slots[-1] + max((len(r) for _, r in _classes(pattern, b, hr)), default=0))
    period = math.lcm(*(min(w, n + 1) for w in pattern.segment_lengths))
    cuts = _cuts(n, pattern.documents, period, max(span_rows, -(-n // SPANS)))
    docs = pattern.documents or (0, n)
    spans = []
    for a, b in itertools.pairwise(cuts):
        calls: list[Call] = []
        inner = docs[bisect.bisect_right(docs, a) : bisect.bisect_left(docs, b)]
        for lo, hi in itertools.pairwise([a, *inner, b]):  # the documents' pieces of [a, b)
            calls += _piece_calls(pattern, lo, hi - lo, hr, slots)
        spans.append(Span(a, b - a, tuple(calls), pattern.n_branches, slots[-1]))
    return tuple(spans)


_PLANS: LRUCache[SpanPlan] = LRUCache(32, name="span plans")


def _index_of(
    span: Span, batch: int, heads: int, kv_heads: int, device: torch.device
) -> tuple[torch.Tensor, int, torch.Tensor, int]:
    """:meth:`SpanPlan.index` of ``span``."""
    res: list = []
    bi = torch.arange(batch, device=device)[:, None, None, None]
    for kv, slots, width in ((False, span.q_slots, heads), (True, span.kv_slots, kv_heads)):
        index = torch.full((slots, batch, span.length, width), -1, dtype=torch.int32, device=device)
        base = 0
        for call in (span.calls[j] for j in span.part_order()):
            count = call.part_rows(batch, kv)
            pos = (call.positions() - span.start).to(device)[None]
            head, call_heads, step = call.side(kv)
            hs = (head + step * torch.arange(call_heads, device=device))[None, None, :, None]
            rows = torch.arange(base, base + count, dtype=torch.int32, device=device)
            rows = rows.view(batch, call.segments, -1, _padded(call.rows))[..., : call.rows]
            index[call.kv_slot if kv else call.branch][bi, pos, hs] = rows
            base += count
        if base >= 2**31:
            raise RuntimeError(f"span of {base} part rows: beyond int32 (smaller spans needed)")
        res += [index, base]
    return tuple(res)  # type: ignore[return-value]


_INDEX: LRUCache[tuple[torch.Tensor, int, torch.Tensor, int]] = LRUCache(
    32, name="span indices", max_bytes=1 << 30, size_of=lambda v: v[0].nbytes + v[2].nbytes
)
_LSE_INDEX: LRUCache[torch.Tensor] = LRUCache(
    32, name="span lse indices", max_bytes=1 << 30, size_of=lambda v: v.nbytes
)


@dataclass(frozen=True)
class Route:
    """The path of one pass: ``dense`` (call ``j`` of span ``i`` on ``backends[i][j]``; the
    ring's blocks: no spans, ``((name,),)``) or our kernel, and why."""

    dense: bool
    why: str
    spans: SpanPlan | None = None
    backends: tuple[tuple[str, ...], ...] = ()
