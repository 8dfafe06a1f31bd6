"""``layout="balanced"``: cuts that even out every rank's work, and exactness.

The balance is checked against an independent count: reached (query, key)
pairs summed over heads and branches from the dense boolean mask of the
pattern, built here position by position (not by the planner's closed forms
that the layout uses). The ring with the balanced layout is checked, forward
and backward, against single-process ``dilated_attention`` in float64, in
real gloo processes.
"""

from __future__ import annotations

import pytest
import torch

import ring_attention as ra
from ring_attention.core.layout import LAYOUTS, layout_pieces, resolve_layout
from ring_attention.core.pattern import Pattern
from ring_attention.parallel.testing import run_distributed

LONGNET = ([256, 512, 1024], [1, 2, 4])

#: name -> (n, segment_lengths, dilation_rates, causal, window, cu_seqlens, heads)
BALANCE_CASES = {
    "dense_causal": (4099, [4099], [1], True, None, None, 1),
    "longnet_causal": (4099, *LONGNET, True, None, None, 4),
    "window_causal": (4099, [4099], [1], True, (300, 0), None, 1),
    "documents_causal": (4099, [1024], [1], True, None, [0, 700, 710, 2500, 4000, 4099], 1),
    "longnet_documents": (3001, *LONGNET, True, None, [0, 1500, 1501, 3001], 4),
}


def _brute_row_work(n, segs, dils, causal, window, cu, heads) -> torch.Tensor:
    """Pairs each query row reaches, summed over heads (``h mod r`` offsets)
    and branches, from the dense mask."""
    t = torch.arange(n)
    bounds = torch.tensor(cu if cu is not None else [0, n])
    doc = torch.searchsorted(bounds, t, right=True) - 1
    rel = t - bounds[doc]
    work = torch.zeros(n, dtype=torch.int64)
    for w, r in zip(segs, dils, strict=True):
        seg = doc * (n + 1) + rel // w
        same = seg[:, None] == seg[None, :]
        if causal:
            same &= t[None, :] <= t[:, None]
        if window is not None and window[0] >= 0:
            same &= t[None, :] >= t[:, None] - window[0]
        if window is not None and window[1] >= 0:
            same &= t[None, :] <= t[:, None] + window[1]
        for h in range(heads):
            active = (rel % w) % r == h % r
            work += (same & active[:, None] & active[None, :]).sum(1)
    return work


def _rank_work(work: torch.Tensor, world: int, layout) -> list[int]:
    n = work.numel()
    return [
        sum(
            int(work[p.start : p.start + p.length].sum())
            for p in layout_pieces(n, world, r, layout)
        )
        for r in range(world)
    ]


@pytest.mark.parametrize("case", sorted(BALANCE_CASES))
def test_balanced_work_within_five_percent_of_the_mean(case: str) -> None:
    n, segs, dils, causal, window, cu, heads = BALANCE_CASES[case]
    work = _brute_row_work(n, segs, dils, causal, window, cu, heads)
    pattern = Pattern(segs, dils, causal=causal, window=window).with_documents(cu)
    layout = resolve_layout("balanced", pattern)
    for world in (2, 3, 5, 8):
        per_rank = _rank_work(work, world, layout)
        assert sum(per_rank) == int(work.sum())
        mean = sum(per_rank) / world
        assert max(per_rank) <= 1.05 * mean, (world, per_rank)
        assert min(per_rank) >= 0.95 * mean, (world, per_rank)
    # the count can tell: the contiguous layout is off by far more than 5 %
    per_rank = _rank_work(work, 5, "contiguous")
    mean = sum(per_rank) / 5
    assert max(per_rank) > 1.05 * mean or min(per_rank) < 0.95 * mean


def test_balanced_pieces_partition_the_sequence_and_fold() -> None:
    pattern = Pattern(*LONGNET, causal=True)
    layout = resolve_layout("balanced", pattern)
    for n in (0, 1, 4, 37, 4099):
        for world in (1, 2, 3, 5):
            covered = []
            for r in range(world):
                (piece,) = layout_pieces(n, world, r, layout)
                covered += range(piece.start, piece.start + piece.length)
            assert covered == list(range(n))
            # fold: the ring rank's stretch is its U shards of world * U, merged
            for r in range(world):
                (piece,) = layout_pieces(n, world, r, layout, fold=2)
                first = layout_pieces(n, world * 2, 2 * r, layout)[0]
                last = layout_pieces(n, world * 2, 2 * r + 1, layout)[0]
                assert piece.start == first.start
                assert piece.length == first.length + last.length
    # a dense non-causal pattern: every row's work is equal, pieces nearly so
    dense = resolve_layout("balanced", Pattern([8192], [1]))
    lengths = [layout_pieces(4099, 5, r, dense)[0].length for r in range(5)]
    assert max(lengths) - min(lengths) <= 1


def test_layouts_and_errors_single_process() -> None:
    assert LAYOUTS == ("contiguous", "zigzag", "balanced")
    x = torch.randn(2, 10, 3)
    with pytest.raises(ValueError, match=r"layout must be one of.*balanced"):
        ra.shard_sequence(x, 1, layout="diagonal")
    with pytest.raises(ValueError, match="causal, window: the pattern places the cuts"):
        ra.shard_sequence(x, 1, layout="zigzag", causal=True, window=(2, 0))
    with pytest.raises(ValueError, match="dilation_rates needs segment_lengths"):
        ra.shard_sequence(x, 1, layout="balanced", dilation_rates=[1])
    with pytest.raises(ValueError, match=r"dilation_rates\[0\] must be <= segment_lengths"):
        ra.shard_sequence(x, 1, layout="balanced", segment_lengths=[2], dilation_rates=[4])
    with pytest.raises(ValueError, match="cu_seqlens must end at the sequence length 10"):
        ra.shard_sequence(x, 1, layout="balanced", cu_seqlens=[0, 4, 9])
    with pytest.raises(ValueError, match="resolve it with the pattern"):
        layout_pieces(10, 2, 0, "balanced")
    # one process: the identity, the keywords still checked
    assert ra.shard_sequence(x, 1, layout="balanced", causal=True) is x
    with pytest.raises(ValueError, match="not available to transformers models"):
        from ring_attention.hf.setting import spread_of

        spread_of(None, None, None, "balanced")


# -- real processes ---------------------------------------------------------

#: name -> (n, segment_lengths, dilation_rates, causal, window, cu_seqlens, heads, kv_heads)
RING_CASES = {
    "longnet_causal": (61, [8, 16, 32], [1, 2, 4], True, None, None, 4, 2),
    "dense_noncausal": (37, [64], [1], False, None, None, 2, 2),
    "dense_causal_gqa": (45, [64, 32], [1, 2], True, None, None, 4, 1),
    "window_causal": (53, [16, 64], [1, 2], True, (9, 0), None, 2, 1),
    "documents": (47, [8, 16], [1, 2], True, None, [0, 5, 20, 21, 47], 4, 4),
    "window_documents_noncausal": (43, [32], [2], False, (6, 4), [0, 30, 43], 2, 1),
}


def _kw(segs, dils, causal, window, cu) -> dict:
    return dict(segment_lengths=segs, dilation_rates=dils, causal=causal, window=window,
                cu_seqlens=cu)  # fmt: skip


def _ring_worker(rank: int, world: int, names: list[str], grid: bool) -> dict:
    import torch.distributed as dist

    from ring_attention import RingDilatedAttention

    groups: dict = {}
    if grid:  # 2 x 2: ring index i = rank // 2, Ulysses index j = rank % 2
        rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups = dict(group=cols[rank % 2], ulysses_group=rows[rank // 2])
    out = {}
    for name in names:
        n, segs, dils, causal, window, cu, heads, kv = RING_CASES[name]
        g = torch.Generator().manual_seed(len(name) * 7 + n)
        q = torch.randn(2, n, heads, 4, generator=g, dtype=torch.float64)
        k = torch.randn(2, n, kv, 4, generator=g, dtype=torch.float64)
        v = torch.randn(2, n, kv, 4, generator=g, dtype=torch.float64)
        dy = torch.randn(2, n, heads, 4, generator=g, dtype=torch.float64)
        kw = _kw(segs, dils, causal, window, cu)
        sharded = [
            ra.shard_sequence(t, 1, layout="balanced", **groups, **kw).detach().requires_grad_()
            for t in (q, k, v)
        ]
        if name == "dense_noncausal" and not grid:  # the module, with the layout
            mod = RingDilatedAttention(segs, dils, causal=causal, layout="balanced", **groups)
            y = mod(*sharded)
        else:
            y = ra.ring_dilated_attention(*sharded, segs, dils, causal=causal, window=window,
                                          cu_seqlens=cu, layout="balanced", **groups)  # fmt: skip
        y.backward(ra.shard_sequence(dy, 1, layout="balanced", **groups, **kw))
        got = [y.detach(), *(t.grad for t in sharded)]
        full = [ra.gather_sequence(t, 1, layout="balanced", **groups, **kw) for t in got]
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = ra.dilated_attention(*ref_in, segs, dils, causal=causal, window=window,
                                   cu_seqlens=cu)  # fmt: skip
        ref.backward(dy)
        want = [ref.detach(), *(t.grad for t in ref_in)]
        out[name] = (
            max(float((a - b).abs().max()) for a, b in zip(full, want, strict=True)),
            sharded[0].shape[1],
        )
    return out


@pytest.mark.parametrize("world", [2, 3, 5])
def test_ring_with_balanced_layout_is_exact(world: int) -> None:
    results = run_distributed(_ring_worker, world, sorted(RING_CASES), False)
    for name in RING_CASES:
        errs = [r[name][0] for r in results]
        assert max(errs) < 1e-12, (name, errs)
        n = RING_CASES[name][0]
        assert sum(r[name][1] for r in results) == n
    # the cuts differ from contiguous ones where the work does (causal)
    lengths = [r["dense_causal_gqa"][1] for r in results]
    contiguous = [p.length for r in range(world) for p in layout_pieces(45, world, r)]
    assert lengths != contiguous


def test_hybrid_2x2_with_balanced_layout_is_exact() -> None:
    names = ["longnet_causal", "documents", "window_causal"]
    results = run_distributed(_ring_worker, 4, names, True)
    for name in names:
        assert max(r[name][0] for r in results) < 1e-12, name


def _roundtrip_worker(rank: int, world: int) -> tuple[bool, bool, list[int]]:
    kw = _kw(*LONGNET, True, None, [0, 100, 333, 1001])
    x = torch.randn(3, 1001, 2, generator=torch.Generator().manual_seed(0)).requires_grad_()
    local = ra.shard_sequence(x, 1, layout="balanced", **kw)
    full = ra.gather_sequence(local, 1, layout="balanced", **kw)
    full.backward(torch.ones_like(full))
    # each rank's gradient: ones on its own piece
    return torch.equal(full, x.detach()), bool(x.grad.sum() == local.numel()), [local.shape[1]]


@pytest.mark.parametrize("world", [2, 3])
def test_shard_and_gather_round_trip_balanced(world: int) -> None:
    results = run_distributed(_roundtrip_worker, world)
    assert all(r[0] and r[1] for r in results)
    lengths = [r[2][0] for r in results]
    assert sum(lengths) == 1001
    assert lengths != [p.length for r in range(world) for p in layout_pieces(1001, world, r)]


def _mismatch_worker(rank: int, world: int, what: str) -> str:
    n = 40
    q = torch.randn(1, n, 2, 4, generator=torch.Generator().manual_seed(1))
    causal = True
    layout = "balanced"
    if what == "layout" and rank == 0:
        layout = "contiguous"
    if what == "unknown":
        layout = "contiguous"
    if what == "pattern" and rank == world - 1:
        causal = False
    kw = {} if layout != "balanced" else _kw([8], [1], causal, None, None)
    local = ra.shard_sequence(q, 1, layout=layout, **kw)
    try:
        if what == "gather":
            kw = _kw([8], [1], rank != 0, None, None)
            ra.gather_sequence(local, 1, layout="balanced", **kw)
        elif what == "unknown":  # rank 0's layout is unknown: every rank raises
            bad = "diagonal" if rank == 0 else "contiguous"
            ra.ring_dilated_attention(local, local, local, [8], [1], causal=causal, layout=bad)
        else:
            ra.ring_dilated_attention(local, local, local, [8], [1], causal=causal, layout=layout)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what", ["layout", "pattern", "gather", "unknown"])
def test_ranks_that_disagree_raise_on_every_rank(what: str) -> None:
    results = run_distributed(_mismatch_worker, 3, what, timeout=60)
    assert all(r != "no error" for r in results), results
    if what == "layout":
        assert all("layout: ['contiguous', 'balanced', 'balanced']" in r for r in results)
    elif what == "pattern":
        assert all("ranks disagree on the pattern" in r for r in results)
    elif what == "gather":
        assert all("the pattern of layout='balanced'" in r for r in results)
    else:
        assert all("layout must be one of ['contiguous', 'zigzag', 'balanced']" in r
                   for r in results)  # fmt: skip
