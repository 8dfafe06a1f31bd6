"""The view planner (ring_attention/local/spans.py): every branch's rows as strided
views of q, k, v, checked against the gather indices the per-branch SDPA path
used before it (``_gather_calls`` below, its index builder kept as the
reference), against the oracle's activity (documents, windows), for storage
sharing (no copy) and for the strides docs/design.md gives."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
from oracle import active, head_group_bounds

from ring_attention.core.pattern import Pattern
from ring_attention.local.spans import PART_ALIGN, SpanPlan, batched, head_runs, plan_spans

BIG = 1 << 40  # one window


def _gather_calls(length: int, heads: int, kv_heads: int, pattern: Pattern):
    """The per-branch SDPA path's gather indices (one window of ``length``
    rows): per (branch, offset class, full segments | short last segment)
    ``(q_index, kv_index, heads_of_class)``, flat rows ``pos * heads + h`` and
    ``pos * kv_heads + h // group`` of shape ``(segments, rows, heads)``."""
    group = heads // kv_heads
    calls = {}
    for b, (w, r) in enumerate(pattern.branches):
        by_offset: dict[int, list[int]] = {}
        for h in pattern.applies(b, heads):
            by_offset.setdefault(pattern.offset(h, b, heads), []).append(h)
        nfull, rem = divmod(length, w)
        for o, hs in sorted(by_offset.items()):
            h_idx = torch.tensor(hs, dtype=torch.long)
            parts = []
            if nfull:
                parts.append((torch.arange(nfull) * w)[:, None] + torch.arange(o, w, r)[None, :])
            if rem > o:
                parts.append(nfull * w + torch.arange(o, rem, r)[None, :])
            for pos in parts:
                pos = pos[:, :, None]
                start = int(pos[0, 0, 0])
                calls[(b, o, start)] = (pos * heads + h_idx, pos * kv_heads + h_idx // group, hs)
    return calls


# (n, heads, kv_heads, segments, dilations, keyword arguments of Pattern)
SHAPES = {
    "tails": (150, 5, 5, [8, 16, 32], [1, 2, 4], {}),
    "n<w": (20, 4, 2, [8, 64], [1, 3], {}),
    "r-not-dividing-heads": (77, 7, 7, [12, 24], [3, 5], {}),
    "r-not-dividing-w": (100, 6, 3, [10, 35], [3, 4], {}),
    "head-groups": (90, 5, 5, [6, 12, 30], [1, 2, 3], {"head_groups": True}),
    "grouped-offsets": (96, 6, 2, [8, 32], [2, 3], {"head_offsets": "grouped"}),
    "grouped-offsets-groups": (
        64,
        7,
        7,
        [8, 16],
        [2, 3],
        {"head_offsets": "grouped", "head_groups": True},
    ),
    "gqa-r6-g4": (144, 24, 6, [12, 72], [1, 6], {}),
    "gqa-odd-split": (60, 6, 2, [6, 12], [2, 3], {}),
    "mqa": (50, 6, 1, [10, 20], [2, 4], {"causal": True}),
}


def _inputs(shape, batch=2, dtype=torch.float32, seed=0):
    n, heads, kv_heads = shape[:3]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, heads, 8, generator=g).to(dtype)
    k = torch.randn(batch, n, kv_heads, 8, generator=g).to(dtype)
    return q, k


def _classes(calls, q, k):
    """The calls with the classes of a ``head_shift`` call apart, one head
    each, each class's view checked equal to its head of the call's."""
    for call in calls:
        if not call.head_shift:
            yield call
            continue
        for c in range(call.q_heads):
            shift = c * call.head_shift
            one = dataclasses.replace(
                call, offset=call.offset + shift, start=call.start + shift,
                q_head=call.q_head + c * call.q_head_stride, q_heads=1,
                kv_head=call.kv_head + c * call.kv_head_stride, kv_heads=1, head_shift=0,
            )  # fmt: skip
            assert torch.equal(call.view(q)[:, :, :, c : c + 1], one.view(q))
            assert torch.equal(call.view(k, True)[:, :, :, c : c + 1], one.view(k, True))
            yield one


def test_one_head_classes_side_by_side() -> None:
    """LongNet over 16 heads: r = 12's classes 4 ... 11 (one head each) in
    two calls (2731 and 2730 rows); 12 heads: all twelve in two; GQA's
    classes keep their calls (a K/V head a query head only)."""
    pattern = Pattern([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12])
    for heads, kv_heads, calls in ((16, 16, 19), (12, 12, 15), (24, 6, 31)):
        (window,) = plan_spans(pattern, 131072, heads, kv_heads, 131072).spans
        assert len(window.calls) == calls, heads
    shifted = [c for c in window.calls if c.head_shift]
    assert not shifted
    (window,) = plan_spans(pattern, 131072, 16, 16, 131072).spans
    shifted = [(c.offset, c.q_heads, c.rows, c.head_shift) for c in window.calls if c.head_shift]
    assert shifted == [(4, 4, 2731, 1), (8, 4, 2730, 1)]


def _plan(name, window_rows=BIG) -> SpanPlan:
    n, heads, kv_heads, segs, dils, kw = SHAPES[name]
    return plan_spans(Pattern(segs, dils, **kw), n, heads, kv_heads, window_rows)


@pytest.mark.parametrize("name", list(SHAPES))
def test_views_equal_the_gather_indices(name) -> None:
    n, heads, kv_heads, segs, dils, kw = SHAPES[name]
    pattern = Pattern(segs, dils, **kw)
    q, k = _inputs(SHAPES[name])
    plan = _plan(name)
    assert len(plan.spans) == 1
    ref = _gather_calls(n, heads, kv_heads, pattern)
    q_flat, k_flat = q.reshape(2, n * heads, 8), k.reshape(2, n * kv_heads, 8)
    covered = set()
    for call in _classes(plan.spans[0].calls, q, k):
        qi, ki, hs = ref[(call.branch, call.offset, call.start)]
        c0 = hs.index(call.q_head)
        sub = slice(c0, c0 + call.q_heads)
        call_heads = [call.q_head + c * call.q_head_stride for c in range(call.q_heads)]
        assert hs[sub] == call_heads, (name, call)
        covered.update((call.branch, call.offset, call.start, h) for h in call_heads)
        s, rows = qi.shape[:2]
        assert (call.segments, call.rows) == (s, rows), (name, call)
        want_q = q_flat.index_select(1, qi[:, :, sub].reshape(-1)).view(2, s, rows, -1, 8)
        assert torch.equal(call.view(q), want_q), (name, call)
        # K/V at K/V-head width: each query head of the call reads kv head c // group
        want_k = k_flat.index_select(1, ki[:, :, sub].reshape(-1)).view(2, s, rows, -1, 8)
        got_k = call.view(k, kv=True).repeat_interleave(call.group, dim=3)
        assert torch.equal(got_k, want_k), (name, call)
    assert covered == {(b, o, start, h) for (b, o, start), (_, _, hs) in ref.items() for h in hs}, (
        name
    )


@pytest.mark.parametrize("name", list(SHAPES))
def test_views_share_storage_and_have_the_strides(name) -> None:
    n, _heads, _kv_heads, segs, dils, kw = SHAPES[name]
    q, k = _inputs(SHAPES[name])
    d = q.shape[-1]
    for call in _plan(name).spans[0].calls:
        w, r = Pattern(segs, dils, **kw).branches[call.branch]
        for t, kv in ((q, False), (k, True)):
            v = call.view(t, kv)
            width = t.shape[2]
            assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            head = call.kv_head if kv else call.q_head
            assert v.data_ptr() == t.data_ptr() + (call.start * width + head) * d * t.itemsize
            step = call.kv_head_stride if kv else call.q_head_stride
            head = step * d + call.head_shift * width * d  # classes side by side
            want = (n * width * d, w * width * d, r * width * d, head, 1)
            if call.segments == 1:  # a lone segment's stride is never used
                want = (want[0], v.stride(1), *want[2:])
            assert v.stride() == want, (name, call)
            if not kv:  # query heads: stride r (modulo offsets) or 1 (grouped)
                grouped = kw.get("head_offsets") == "grouped"
                want = 1 if grouped or call.head_shift else r
                assert call.q_heads == 1 or step == want, (name, call)


def test_batched_views_merge_batch_and_segments_only_when_they_can() -> None:
    x = torch.randn(3, 64, 4, 8)
    plan = plan_spans(Pattern([16], [2]), 64, 4, 4, BIG)
    full = next(c for c in plan.spans[0].calls if c.segments == 4)
    (merged,) = batched(full.view(x))  # 64 = 4 * 16: one view of 12 segments
    assert merged.shape == (12, 8, 2, 8)
    assert torch.equal(merged, full.view(x).reshape(12, 8, 2, 8))
    y = torch.randn(3, 70, 4, 8)
    plan = plan_spans(Pattern([16], [2]), 70, 4, 4, BIG)
    full = next(c for c in plan.spans[0].calls if c.segments == 4)
    views = batched(full.view(y))  # 70 rows: the batch stride is no multiple of 16
    assert len(views) == 3 and all(v.shape == (4, 8, 2, 8) for v in views)
    for i, v in enumerate(views):
        assert torch.equal(v, full.view(y)[i])
        assert v.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def test_head_runs() -> None:
    assert head_runs([0, 0, 1, 1]) == [(0, 4, 2, 1)]
    assert head_runs([0, 1, 3, 4]) == [(0, 2, 1, 1), (2, 4, 1, 1)]  # r = 6, 4 per K/V head
    assert head_runs([0, 2, 3, 5]) == [(0, 2, 1, 2), (2, 4, 1, 2)]
    assert head_runs([0, 0, 1]) == [(0, 2, 2, 1), (2, 3, 1, 1)]
    assert head_runs([2, 2, 2]) == [(0, 3, 3, 1)]
    assert head_runs([0, 2, 4, 6]) == [(0, 4, 1, 2)]
    rng = random.Random(0)
    for _ in range(200):
        kv = sorted(rng.randrange(6) for _ in range(rng.randrange(1, 9)))
        runs = head_runs(kv)
        assert runs[0][0] == 0 and runs[-1][1] == len(kv)
        for (c0, c1, gg, step), nxt in itertools.zip_longest(runs, runs[1:]):
            assert (c1 - c0) % gg == 0 and (nxt is None or nxt[0] == c1)
            assert all(kv[c0 + i] == kv[c0] + (i // gg) * step for i in range(c1 - c0))


def _activity(pattern: Pattern, n: int, heads: int, branch: int, cu) -> torch.Tensor:
    """Bool ``(n, heads)`` from the oracle: t active for (h, branch)."""
    w, r = pattern.branches[branch]
    grouped = pattern.head_offsets == "grouped"
    groups = head_group_bounds(heads, pattern.n_branches)
    act = torch.zeros(n, heads, dtype=torch.bool)
    for h in range(heads):
        if pattern.head_groups and not groups[branch][0] <= h < groups[branch][1]:
            continue
        act[:, h] = active(n, w, r, h, heads, grouped, cu)
    return act


CASES = [
    # (n, heads, kv_heads, segments, dilations, Pattern keywords, cu_seqlens, window_rows)
    (150, 5, 5, [8, 16, 32], [1, 2, 4], {}, None, 1),
    (150, 6, 2, [8, 16, 32], [1, 2, 4], {"head_offsets": "grouped"}, None, 40),
    (97, 24, 6, [6, 12], [1, 6], {}, None, 1),
    (120, 5, 5, [6, 12, 30], [1, 2, 3], {"head_groups": True}, None, 7),
    (140, 6, 3, [8, 16], [2, 4], {}, [0, 9, 9, 60, 61, 140], 1),
    (140, 4, 2, [8, 64], [1, 3], {"causal": True}, [0, 30, 100, 140], 50),
    (64, 4, 4, [8, 12], [2, 3], {}, [0, 5, 64], 1),  # lcm 24: cuts at 5 + 24 k
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_window_index_maps_cover_the_active_rows_once(case) -> None:
    n, heads, kv_heads, segs, dils, kw, cu, rows = CASES[case]
    pattern = Pattern(segs, dils, **kw).with_documents(cu)
    plan = plan_spans(pattern, n, heads, kv_heads, rows)
    if rows == 1:
        assert len(plan.spans) > 1
    group = heads // kv_heads
    starts = [w.start for w in plan.spans]
    assert starts[0] == 0 and sum(w.length for w in plan.spans) == n
    batch = 2
    q_full, kv_full = [], []
    for i, window in enumerate(plan.spans):
        q_index, q_rows, kv_index, kv_rows = plan.index(i, batch, torch.device("cpu"))
        assert q_index.shape == (pattern.n_branches, batch, window.length, heads)
        # every part row appears at most once; those no entry names are the
        # padding of each head's rows to a multiple of PART_ALIGN
        for index, total, kv in ((q_index, q_rows, False), (kv_index, kv_rows, True)):
            used = index[index >= 0]
            assert used.unique().numel() == used.numel() and int(used.max()) < total
            real = [batch * c.segments * (c.kv_heads if kv else c.q_heads) * c.rows
                    for c in window.calls]  # fmt: skip
            assert used.numel() == sum(real)
            assert total == sum(c.part_rows(batch, kv) for c in window.calls)
            assert all(c.part_rows(batch, kv) % PART_ALIGN == 0 for c in window.calls)
        q_full.append(q_index >= 0)
        kv_full.append(kv_index >= 0)
        for call in window.calls:  # a call's rows lie in its window and document
            pos = call.positions()
            assert window.start <= int(pos.min()) and int(pos.max()) < window.start + window.length
            if cu is not None:
                doc = next(j for j in range(len(cu) - 1) if cu[j] <= int(pos.min()) < cu[j + 1])
                assert int(pos.max()) < cu[doc + 1]
    q_full = torch.cat(q_full, dim=2)
    kv_full = torch.cat(kv_full, dim=2)
    for b in range(pattern.n_branches):
        act = _activity(pattern, n, heads, b, cu)
        assert torch.equal(q_full[b, 0], act) and torch.equal(q_full[b, 1], act), (case, b)
        # a K/V row is in some slot of the branch iff a query head of its group is active
        kv_act = act.view(n, kv_heads, group).any(-1)
        slots = {c.kv_slot for w in plan.spans for c in w.calls if c.branch == b}
        got = kv_full[sorted(slots), 0].any(0) if slots else torch.zeros_like(kv_act)
        assert torch.equal(got, kv_act), (case, b)
