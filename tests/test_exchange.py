"""The exchange plan and the traffic of the ring.

* (a) all-local patterns (every segment inside a shard) exchange nothing;
* (b) every rank receives exactly the (row, head) pairs its queries reach,
  checked against an independent computation from the oracle's
  multiplicity matrix, both in the plan and in the traffic of a real run;
* (c) for a LongNet-style pattern the bytes a rank sends per layer stay flat
  when ``n`` (and with it the number of ranks) doubles at a fixed shard size,
  while a dense ring grows linearly;
* (d) ranks that disagree on pattern, length, dtype, heads, causal, scale, or
  that reject their inputs raise ``ValueError`` on every rank, promptly;
* (e) the plan cache: a repeated call builds nothing.

(a), (b)-plan and (c) build plans directly (no processes); the rest runs in
one 4-rank gloo launch.
"""

from __future__ import annotations

import functools

import pytest
import torch
from oracle import multiplicity

import ring_attention
from ring_attention.core.cache import LRUCache
from ring_attention.core.pattern import Pattern
from ring_attention.parallel import exchange, ring
from ring_attention.parallel.api import ring_dilated_attention
from ring_attention.parallel.exchange import last_exchange_stats, register_exchange_hook
from ring_attention.parallel.exchange_plan import PLAN_CACHE, build_plan, get_plan
from ring_attention.parallel.sharding import layout_pieces, shard_sequence
from ring_attention.parallel.testing import run_distributed


def _plan(world, rank, n, heads, segs, dils, causal, head_groups, layout="contiguous", cache=None):
    """The plan of ``rank`` (built fresh, or through ``cache``)."""
    pattern = Pattern(segs, dils, causal=causal, head_groups=head_groups)
    if cache is None:
        return build_plan(pattern, n, heads, heads, world, rank, layout)
    return get_plan(pattern, n, heads, heads, world, rank, layout, cache=cache)


LONGNET = ([8, 16, 32], [1, 2, 4])

# (n, world, heads, segs, dils, causal, head_groups, layout)
PLAN_CASES = {
    "longnet": (101, 4, 4, *LONGNET, False, False, "contiguous"),
    "longnet_causal": (101, 4, 4, *LONGNET, True, False, "contiguous"),
    "dense_causal_p5": (37, 5, 2, [37], [1], True, False, "contiguous"),
    "dense_p3": (37, 3, 2, [64], [1], False, False, "contiguous"),
    "local": (37, 5, 3, [4], [1], False, False, "contiguous"),
    "dilated_offsets": (50, 3, 5, [10, 25], [2, 5], True, False, "contiguous"),
    "head_groups": (101, 3, 5, *LONGNET, True, True, "contiguous"),
    "zigzag_causal": (101, 3, 4, *LONGNET, True, False, "zigzag"),
    "zigzag_dense": (37, 4, 2, [37], [1], True, False, "zigzag"),
    "tiny": (4, 5, 2, [2, 4], [1, 2], True, False, "contiguous"),
}


def _needed(mult: torch.Tensor, q_pieces, k_start: int, k_len: int) -> set[tuple[int, int]]:
    """(global key row, head) pairs of ``[k_start, k_start + k_len)`` that some
    query of ``q_pieces`` reaches, from the multiplicity matrix."""
    _, n, _ = mult.shape
    qmask = torch.zeros(n, dtype=torch.bool)
    for p in q_pieces:
        qmask[p.start : p.start + p.length] = True
    if not qmask.any() or k_len == 0:
        return set()
    reach = (mult[:, qmask, k_start : k_start + k_len] > 0).any(dim=1)  # (H, k_len)
    return {(k_start + u, h) for h, u in reach.nonzero().tolist()}


def _as_pairs(idx: torch.Tensor, start: int, heads: int) -> set[tuple[int, int]]:
    return {(start + i // heads, i % heads) for i in idx.tolist()}


def _expected_traffic(n, world, heads, segs, dils, causal, head_groups, layout):
    """needed[(receiver, sender)] = rows (independent of the planner)."""
    mult = multiplicity(n, heads, segs, dils, causal, head_groups)
    pieces = [layout_pieces(n, world, r, layout) for r in range(world)]
    needed = {}
    for r in range(world):
        for s in range(world):
            rows = set()
            for kp in pieces[s]:
                rows |= _needed(mult, pieces[r], kp.start, kp.length)
            needed[(r, s)] = rows
    return needed, pieces


# ---------------------------------------------------------------------------
# (b) plan == oracle, and (a) zero traffic for all-local patterns.


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_plan_rows_match_oracle_multiplicity(case: str) -> None:
    n, world, heads, segs, dils, causal, hg, layout = PLAN_CASES[case]
    needed, pieces = _expected_traffic(n, world, heads, segs, dils, causal, hg, layout)
    plans = [_plan(world, r, n, heads, segs, dils, causal, hg, layout) for r in range(world)]
    for r, plan in enumerate(plans):
        assert plan.pieces == tuple(pieces[r])
        by_d = {s.distance: s for s in plan.steps}
        for d in range(1, world):
            sender, receiver = (r - d) % world, (r + d) % world
            step = by_d.get(d)
            if not needed[(r, sender)] and not needed[(receiver, r)]:
                assert step is None, f"{case}: rank {r} keeps an empty step {d}"
                continue
            assert step is not None, f"{case}: rank {r} skips needed step {d}"
            got = set()
            for kp, idx in zip(step.recv_pieces, step.recv_idx, strict=True):
                assert idx.dtype == torch.int64
                assert torch.equal(idx, torch.unique(idx)), "indices sorted and unique"
                got |= _as_pairs(idx, kp.start, heads)
            assert got == needed[(r, sender)], f"{case}: rank {r} receives the wrong rows at d={d}"
            assert (step.recv_from is None) == (not needed[(r, sender)])
            sent = set()
            for kp, idx in zip(plan.pieces, step.send_idx, strict=True):
                sent |= _as_pairs(idx, kp.start, heads)
            assert sent == needed[(receiver, r)], f"{case}: rank {r} sends the wrong rows at d={d}"
            assert (step.send_to is None) == (not needed[(receiver, r)])
            # both ends agree: what r sends at d is what r+d receives at d
            other = plans[receiver].step_for(d)
            if step.send_to is not None:
                assert other is not None and other.recv_counts == step.send_counts
        # local blocks: every own (query piece, key piece) pair with a reached key is computed
        mult = multiplicity(n, heads, segs, dils, causal, hg)
        for qi, qp in enumerate(plan.pieces):
            for ki, kp in enumerate(plan.pieces):
                reach = bool(_needed(mult, [qp], kp.start, kp.length))
                assert ((qi, ki) in plan.local_pairs) == reach


@pytest.mark.parametrize(
    "n,world,segs,dils",
    [
        (64, 4, [8, 16], [1, 2]),
        (96, 4, [8, 24], [2, 3]),
        (60, 5, [4, 12], [1, 4]),
        (20, 1, [64], [1]),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_all_local_pattern_exchanges_nothing(n, world, segs, dils, causal, layout) -> None:
    """(a) Every segment lies inside one shard: no steps, zero bytes."""
    if layout == "zigzag" and world > 1:
        segs = [s // 2 for s in segs]  # zig-zag chunks are half a shard
        dils = [min(r, w) for r, w in zip(dils, segs, strict=True)]
    for r in range(world):
        plan = _plan(world, r, n, 4, segs, dils, causal, False, layout)
        assert plan.steps == ()
        assert plan.bytes_sent(2, 64, 2, backward=True) == 0
        assert plan.bytes_received(2, 64, 2, backward=True) == 0


# ---------------------------------------------------------------------------
# (c) bytes per rank per layer stay flat with n at a fixed shard size.


def _max_rows_sent(n: int, world: int, segs, dils, causal: bool, heads: int = 8) -> int:
    """Max over ranks of the rows a rank sends. The pattern repeats every
    ``max(segs)`` positions, so ranks beyond one period add nothing new."""
    period = max(1, max(segs) * world // n) if n else 1
    ranks = range(min(world, period + 1))
    return max(_plan(world, r, n, heads, segs, dils, causal, False).rows_sent for r in ranks)


@pytest.mark.parametrize("causal", [False, True])
def test_longnet_bytes_per_rank_flat_in_n(causal: bool) -> None:
    shard = 64
    segs, dils = [64, 128, 256, 512], [1, 2, 4, 8]  # w / r = 64, LongNet-like
    heads, head_dim, itemsize = 8, 64, 2
    sent = {}
    dense = {}
    for world in (8, 16, 32, 64):
        n = shard * world
        rows = _max_rows_sent(n, world, segs, dils, causal, heads)
        sent[n] = 2 * rows * head_dim * itemsize  # K and V, batch 1
        assert rows <= heads * sum(w // r for w, r in zip(segs, dils, strict=True)), (n, rows)
        if world <= 16:
            dense[n] = _plan(world, 0, n, 2, [n], [1], causal, False).rows_sent
    values = list(sent.values())
    assert values[0] > 0
    assert max(values) == min(values), f"bytes sent per rank grow with n: {sent}"
    # contrast: in a dense ring rank 0 sends to everyone -> grows with n
    d = list(dense.values())
    assert d[1] >= 1.9 * d[0], dense


@pytest.mark.parametrize("world", [8, 16, 32])
def test_longnet_bytes_per_rank_bounded_in_world_size(world: int) -> None:
    """At a fixed n, more ranks do not make a rank send more than
    ``heads * sum(w / r)`` rows."""
    n, heads = 2048, 4
    segs, dils = [128, 256, 512], [1, 2, 4]
    bound = heads * sum(w // r for w, r in zip(segs, dils, strict=True))
    assert 0 < _max_rows_sent(n, world, segs, dils, False, heads) <= bound


# ---------------------------------------------------------------------------
# (e) plan cache.


def test_plan_cache_lru_and_counters() -> None:
    cache = LRUCache(maxsize=2)
    args = (4, 1, 101, 4, *LONGNET, True, False)
    p1 = _plan(*args, cache=cache)
    assert (cache.hits, cache.misses) == (0, 1)
    assert _plan(*args, cache=cache) is p1
    assert (cache.hits, cache.misses) == (1, 1)
    _plan(4, 2, 101, 4, *LONGNET, True, False, cache=cache)
    _plan(4, 3, 101, 4, *LONGNET, True, False, cache=cache)
    assert len(cache) == 2  # bounded: the least recently used plan went
    _plan(*args, cache=cache)
    assert cache.misses == 4
    cache.clear()
    assert (len(cache), cache.hits, cache.misses) == (0, 0, 0)
    with pytest.raises(ValueError):
        LRUCache(maxsize=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"seq_len": 100.5}, r"seq_len must be an integer, got 100\.5"),
        ({"seq_len": True}, r"seq_len must be an integer"),
        ({"seq_len": -1}, r"seq_len must be in \[0, "),
        ({"seq_len": 2**62}, r"seq_len must be in \[0, 4611686018427387903\]"),
        ({"heads": 0}, r"heads must be in \[1, "),
        ({"heads": 8.0}, r"heads must be an integer"),
        ({"kv_heads": 3}, r"kv_heads must divide heads = 8, got kv_heads = 3"),
        ({"kv_heads": 16}, r"kv_heads must be in \[1, 8\]"),
        ({"cu_seqlens": [0, 50, 99]}, r"cu_seqlens must end at the sequence length 100"),
        ({"layout": "ring"}, r"layout must be one of"),
    ],
)
def test_exchange_plan_checks_its_arguments(kwargs: dict, match: str) -> None:
    """Before any planning, naming the argument (``100.5`` used to plan 100)."""
    args = {"seq_len": 100, "heads": 8, **kwargs}
    n, heads = args.pop("seq_len"), args.pop("heads")
    with pytest.raises(ValueError, match=match):
        ring.exchange_plan(n, heads, [16], [2], **args)


@pytest.mark.parametrize(
    "world_size,rank,match",
    [(0, 0, r"world_size must be in \[1, "), (3, 3, r"rank must be in \[0, 2\]"),
     (2.0, 0, r"world_size must be an integer")],
)  # fmt: skip
def test_build_plan_checks_world_and_rank(world_size, rank, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_plan(Pattern([16], [2]), 100, 8, 8, world_size, rank)
    with pytest.raises(ValueError, match=match):
        get_plan(Pattern([16], [2]), 100, 8, 8, world_size, rank)


def test_exchange_names_reexported_by_ring() -> None:
    """The transport's public names are importable from ``ring_attention.parallel.ring``
    too, as the same objects (``last_exchange_stats`` is mutated in place)."""
    for name in ("ExchangeEvent", "ExchangeStats", "last_exchange_stats", "register_exchange_hook"):
        assert getattr(ring, name) is getattr(exchange, name)
        assert name in ring.__all__


# ---------------------------------------------------------------------------
# Distributed: real traffic, mismatches, cache.

WORLD = 4
STAT_CASES = {
    "longnet_causal": dict(n=101, heads=4, pattern=LONGNET, causal=True, layout="contiguous"),
    "dense_zigzag": dict(n=37, heads=2, pattern=([37], [1]), causal=True, layout="zigzag"),
    "head_groups": dict(
        n=101, heads=5, pattern=LONGNET, causal=False, layout="contiguous", head_groups=True
    ),
}
LOCAL_CASE = dict(n=64, heads=4, pattern=([8, 16], [1, 2]), causal=True, layout="contiguous")
B, D = 2, 8


def _qkv(n: int, heads: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, n, heads, D, generator=g).to(dtype) for _ in range(4))


def _stat_run(c: dict) -> dict:
    segs, dils = c["pattern"]
    q, k, v, go = _qkv(c["n"], c["heads"])

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, 1, layout=c["layout"])

    ql, kl, vl = (shard(t).detach().clone().requires_grad_() for t in (q, k, v))
    hooked = []
    with register_exchange_hook(lambda e: hooked.append(e.__dict__.copy())):
        out = ring_dilated_attention(
            ql, kl, vl, segs, dils, causal=c["causal"], head_groups=c.get("head_groups", False),
            layout=c["layout"],
        )  # fmt: skip
        out.backward(shard(go))
    ref = ring_attention.dilated_attention(
        q, k, v, segs, dils, causal=c["causal"], head_groups=c.get("head_groups", False)
    )
    events = [e.__dict__.copy() for e in last_exchange_stats.events]
    return {
        "events": events,
        "hooked": hooked,
        "err": (out - shard(ref)).abs().max().item(),
        "buffer_bytes": dict(last_exchange_stats.buffer_bytes),
    }


def _exchange_suite(rank: int, world: int) -> dict:
    res: dict[str, object] = {}
    for name, c in STAT_CASES.items():
        res[name] = _stat_run(c)
    res["local"] = _stat_run(LOCAL_CASE)

    # (e) a repeated call builds no plan
    c = STAT_CASES["longnet_causal"]
    q, k, v, _ = (shard_sequence(t, 1) for t in _qkv(c["n"], c["heads"]))
    ring_dilated_attention(q, k, v, *c["pattern"], causal=True)
    before = (PLAN_CACHE.hits, PLAN_CACHE.misses)
    ring_dilated_attention(q, k, v, *c["pattern"], causal=True)
    res["cache"] = (before, (PLAN_CACHE.hits, PLAN_CACHE.misses))

    # (d) disagreements raise ValueError on every rank
    n, heads = 101, 4
    segs, dils = LONGNET
    qf, kf, vf, _ = _qkv(n, heads)
    good = tuple(shard_sequence(t, 1) for t in (qf, kf, vf))

    def attempt(fn) -> tuple[str, str]:
        try:
            fn()
        except Exception as exc:  # the test inspects the type
            return type(exc).__name__, str(exc)
        return "no error", ""

    bad_pattern = ([8, 16, 64], dils) if rank == 1 else (segs, dils)
    res["pattern"] = attempt(lambda: ring_dilated_attention(*good, *bad_pattern))
    # rank 0 takes one position less, the last rank one more: lengths break tensor_split
    lens = [26, 25, 25, 25]
    lens[0] -= 1
    lens[-1] += 1
    start = sum(lens[:rank])
    off = tuple(t[:, start : start + lens[rank]] for t in (qf, kf, vf))
    res["length"] = attempt(lambda: ring_dilated_attention(*off, segs, dils))
    dt = tuple(t.double() for t in good) if rank == 2 else good
    res["dtype"] = attempt(lambda: ring_dilated_attention(*dt, segs, dils))
    hd = tuple(t[:, :, :3].contiguous() for t in good) if rank == 3 else good
    res["heads"] = attempt(lambda: ring_dilated_attention(*hd, segs, dils))
    res["causal"] = attempt(lambda: ring_dilated_attention(*good, segs, dils, causal=rank == 0))
    res["scale"] = attempt(
        lambda: ring_dilated_attention(*good, segs, dils, scale=0.5 if rank else 0.25)
    )
    req = tuple(t.detach().clone().requires_grad_(rank == 0) for t in good)
    res["grad"] = attempt(lambda: ring_dilated_attention(*req, segs, dils))
    bad_input = (good[0][0], good[1][0], good[2][0]) if rank == 1 else good
    res["bad_input"] = attempt(lambda: ring_dilated_attention(*bad_input, segs, dils))
    # the group is still usable afterwards
    out = ring_dilated_attention(*good, segs, dils)
    ref = ring_attention.dilated_attention(qf, kf, vf, segs, dils)
    res["after_errors"] = (out - shard_sequence(ref, 1)).abs().max().item()

    # subgroups: ranks {0, 2} and {1, 3} each run their own ring at once
    import torch.distributed as dist

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    n_sub = 37 + rank % 2  # the two rings differ
    q2, k2, v2, go2 = _qkv(n_sub, 2, seed=rank % 2)
    parts = [shard_sequence(t, 1, group).detach().requires_grad_() for t in (q2, k2, v2)]
    out = ring_dilated_attention(*parts, [n_sub], [1], causal=True, group=group)
    out.backward(shard_sequence(go2, 1, group))
    full = [t.detach().requires_grad_() for t in (q2, k2, v2)]
    ref = ring_attention.dilated_attention(*full, [n_sub], [1], causal=True)
    ref.backward(go2)
    errs = [(out - shard_sequence(ref, 1, group)).abs().max().item()]
    errs += [
        (p.grad - shard_sequence(f.grad, 1, group)).abs().max().item()
        for p, f in zip(parts, full, strict=True)
    ]
    res["subgroup"] = (max(errs), last_exchange_stats.bytes_sent())
    return res


@functools.cache
def _results() -> list[dict]:
    """Each rank's results of the suite (run once per test process)."""
    return run_distributed(_exchange_suite, WORLD, timeout=150, pg_timeout=30)


@pytest.mark.parametrize("case", list(STAT_CASES))
def test_real_traffic_matches_oracle(case: str) -> None:
    """(b) In a real run every rank receives exactly the rows it needs."""
    c = STAT_CASES[case]
    segs, dils = c["pattern"]
    needed, _ = _expected_traffic(
        c["n"], WORLD, c["heads"], segs, dils, c["causal"], c.get("head_groups", False), c["layout"]
    )
    for rank, res in enumerate(_results()):
        r = res[case]
        assert r["err"] < 1e-5
        assert r["hooked"] == r["events"], "the hook sees every recorded event"
        for phase in ("forward_kv", "backward_kv", "backward_grad"):
            events = {e["distance"]: e for e in r["events"] if e["phase"] == phase}
            itemsize = 4  # float32 K/V, fp32 grads
            for d in range(1, WORLD):
                sender, receiver = (rank - d) % WORLD, (rank + d) % WORLD
                want_in = len(needed[(rank, sender)])  # K/V rows this rank receives
                want_out = len(needed[(receiver, rank)])  # K/V rows this rank sends
                if phase == "backward_grad":  # grads flow back: reversed
                    want_in, want_out = want_out, want_in
                e = events.get(d)
                if want_in == 0 and want_out == 0:
                    assert e is None, f"rank {rank} {phase} d={d}: empty step not skipped"
                    continue
                assert e is not None, f"rank {rank} {phase} d={d} missing"
                assert e["rows_received"] == want_in, (rank, phase, d)
                assert e["rows_sent"] == want_out, (rank, phase, d)
                assert e["bytes_received"] == 2 * B * D * itemsize * want_in
                assert e["bytes_sent"] == 2 * B * D * itemsize * want_out


def _span_rows(plan) -> int:
    """Rows (positions) of the widest step's row maps: per sender piece,
    first to last needed row, unless every (row, head) pair between them is
    needed (then the packed rows are used in place as they are)."""
    H, widest = plan.kv_heads, 0
    for s in plan.steps:
        rows = 0
        for ix in s.recv_idx:
            span = int(ix[-1]) // H - int(ix[0]) // H + 1 if ix.numel() else 0
            rows += span if ix.numel() != span * H else 0
        widest = max(widest, rows)
    return widest


def test_transport_buffers_are_counted() -> None:
    """Each pass reports its transport buffers, sized by what the plan needs:
    one packed send buffer, at most two packed receive buffers (one when one
    step receives), the same for returned gradients backward, and an int32
    row map (per pass) spanning the needed rows of sender pieces needed only
    in part, whose packed rows the kernels read in place. Pieces needed
    whole (a dense ring) need no map. None for an all-local pattern."""
    mapped = 0
    for rank, res in enumerate(_results()):
        assert res["local"]["buffer_bytes"] == {}
        for case, c in STAT_CASES.items():
            r = res[case]
            kv = [e for e in r["events"] if e["phase"] == "forward_kv"]
            plan = _plan(
                WORLD, rank, c["n"], c["heads"], *c["pattern"], c["causal"],
                c.get("head_groups", False), c["layout"],
            )  # fmt: skip
            span = 4 * _span_rows(plan) * plan.kv_heads
            if case == "dense_zigzag":
                assert span == 0, "a causal dense ring needs every sender piece whole or not at all"
            mapped += span > 0
            send = max((e["bytes_sent"] for e in kv), default=0)
            recv = max((e["bytes_received"] for e in kv), default=0)
            n_send = min(2, sum(1 for e in kv if e["rows_sent"]))
            n_recv = min(2, sum(1 for e in kv if e["rows_received"]))
            fwd, bwd = (r["buffer_bytes"].get(k, 0) for k in ("forward", "backward"))
            assert send + recv + span <= fwd <= send + n_recv * recv + span, (case, rank)
            lo = 2 * (send + recv) + span
            assert lo <= bwd <= send + 2 * n_recv * recv + n_send * send + span, (case, rank)
    assert mapped, "no case read rows through a row map"


def test_all_local_pattern_sends_zero_bytes_in_real_run() -> None:
    """(a) in a real 4-rank run."""
    for res in _results():
        r = res["local"]
        assert r["err"] < 1e-5
        assert sum(e["bytes_sent"] + e["bytes_received"] for e in r["events"]) == 0
        assert r["events"] == []


def test_repeated_call_builds_no_plan() -> None:
    """(e) on every rank: hits grow, misses do not."""
    for res in _results():
        (h0, m0), (h1, m1) = res["cache"]
        assert m1 == m0
        assert h1 == h0 + 1


@pytest.mark.parametrize(
    "case,words",
    [
        ("pattern", ["pattern", "[8, 16, 64]"]),
        ("length", ["sequence lengths", "tensor_split"]),
        ("dtype", ["dtype", "float64"]),
        ("heads", ["heads"]),
        ("causal", ["causal"]),
        ("scale", ["scale"]),
        ("grad", ["gradient", "backward"]),
    ],
)
def test_disagreeing_ranks_raise_on_every_rank(case: str, words: list[str]) -> None:
    """(d) A ValueError on every rank (the run has a timeout: no hang)."""
    for rank, res in enumerate(_results()):
        kind, msg = res[case]
        assert kind == "ValueError", f"rank {rank}: {kind}: {msg}"
        for w in words:
            assert w in msg, f"rank {rank}: {msg!r} lacks {w!r}"


def test_ring_on_subgroups() -> None:
    """Two 2-rank rings ({0, 2} and {1, 3}) at once: group ranks are
    translated to global ranks for the P2P traffic."""
    for rank, res in enumerate(_results()):
        err, sent = res["subgroup"]
        assert err < 1e-5, f"rank {rank}: {err}"
        if rank in (0, 1):  # the first rank of each ring sends its keys on
            assert sent > 0


def test_rank_with_bad_input_fails_every_rank() -> None:
    for rank, res in enumerate(_results()):
        kind, msg = res["bad_input"]
        assert kind == "ValueError", (rank, kind, msg)
        if rank == 1:
            assert "4-D" in msg
        else:
            assert "rank 1 failed: q must be 4-D" in msg, (rank, msg)  # its own error
    for res in _results():
        assert res["after_errors"] < 1e-5


def _dying_rank(rank: int, world: int) -> tuple[str, str, float]:
    import os
    import time

    # torch imports its compiler at a process's first call of a Python custom
    # operator, the ring's (seconds on a loaded machine): done here, untimed
    import torch._dynamo
    import torch.distributed as dist

    assert torch._dynamo
    # Both ranks finish joining the group first: gloo connects its mesh in
    # init_process_group, and a rank that died while its peer was still
    # connecting failed the peer's init instead of the ring under test.
    dist.barrier()
    if rank == 1:
        os._exit(3)  # dies without a word
    q = shard_sequence(torch.randn(1, 40, 2, 8), 1)
    t0 = time.monotonic()
    try:
        ring_dilated_attention(q, q, q, [40], [1])
    except Exception as exc:
        return type(exc).__name__, str(exc)[:200], time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def test_dead_rank_makes_the_others_raise() -> None:
    """docs/design.md §6: a rank that dies makes the others raise (no hang).
    Dead before the first ring call over the group, it is missed by the
    grid check's round in the store: the others raise at the store's
    timeout (the group's, 20 s)."""
    results = run_distributed(_dying_rank, 2, timeout=150, pg_timeout=20, expect_dead=(1,))
    kind, msg, seconds = results[0]
    assert kind != "no error", "rank 0 ran the ring without its peer"
    assert seconds < 25, f"rank 0 raised only after {seconds:.0f} s: {kind}: {msg}"


# ---------------------------------------------------------------------------
# Documents and grouped K/V heads in the plan.


def _doc_plans(n, world, cu, segs=(64,), dils=(1,), heads=2, kv_heads=2, causal=True):
    pattern = Pattern(list(segs), list(dils), causal=causal).with_documents(cu)
    return [build_plan(pattern, n, heads, kv_heads, world, r) for r in range(world)]


def test_documents_inside_one_shard_exchange_nothing() -> None:
    """Every document lies inside one shard: even a dense pattern sends nothing."""
    plans = _doc_plans(64, 4, [0, 10, 16, 30, 32, 48, 64])
    assert all(not p.steps for p in plans)
    assert all(p.rows_sent == 0 for p in plans)


@pytest.mark.parametrize("causal", [False, True])
def test_only_rows_of_documents_crossing_shards_travel(causal: bool) -> None:
    # shards of 16: documents [10, 20) and [40, 64) cross boundaries, the others do not
    cu = [0, 10, 20, 32, 40, 64]
    crossing = [(10, 20), (40, 64)]
    plans = _doc_plans(64, 4, cu, segs=(8, 32), dils=(1, 2), causal=causal)
    sent = 0
    for p in plans:
        for step in p.steps:
            for piece, idx in zip(p.pieces, step.send_idx, strict=True):
                rows = piece.start + idx // p.kv_heads
                inside = torch.zeros_like(rows, dtype=torch.bool)
                for a, b in crossing:
                    inside |= (rows >= a) & (rows < b)
                assert bool(inside.all()), f"rank {p.rank} sends rows outside crossing documents"
                sent += idx.numel()
    assert sent > 0  # the crossing documents do exchange rows


@pytest.mark.parametrize("segs,dils", [([64], [1]), ([8, 16, 32], [1, 2, 4])])
def test_grouped_kv_heads_travel_at_kv_width(segs, dils) -> None:
    """A K/V head's rows go once for every query head of its group: never
    more than the repeated-K/V plan sends, a quarter of it for 4 query heads
    per K/V head when all of them read the same rows (r = 1)."""
    pattern = Pattern(segs, dils, causal=True)
    n, world, heads = 96, 3, 8
    for r in range(world):
        gqa = build_plan(pattern, n, heads, 2, world, r)
        rep = build_plan(pattern, n, heads, heads, world, r)
        assert gqa.rows_sent <= rep.rows_sent
        if dils == [1]:
            assert 4 * gqa.rows_sent == rep.rows_sent
        assert gqa.bytes_sent(1, 64, 2) == 2 * gqa.rows_sent * 64 * 2
