"""The capacity planner (ring_attention/planner).

* closed-form reached pairs == brute-force counts of the multiplicity matrix
  (tests/oracle.py; ring_attention.core.multiplicity for documents and grouped
  offsets), whole sequence and query ranges;
* unions of dilated rows == brute force, on every counting path;
* the analytic exchange model == the ring's own plans (rows and span rows
  per rank and step), and == brute force from the multiplicity matrix with
  grouped K/V heads, documents, grouped offsets, zigzag, head groups, on
  both counting paths (a branch's rows in the memo's keys or listed per pair);
* the memory model == the ring's own buffer accounting
  (``last_exchange_stats.buffer_bytes``) and the tensor bytes it allocates,
  in a real 3-process gloo run;
* throughput records, the schedule's time model, whole-model parameters;
* the searches and the command line (``--help``, a GPU plan, CPU processes,
  impossible requests).
"""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys

import pytest
import torch
from oracle import multiplicity as oracle_multiplicity

from ring_attention.core import pairs
from ring_attention.core.config import backward_heads
from ring_attention.core.layout import layout_pieces
from ring_attention.core.multiplicity import multiplicity
from ring_attention.core.pairs import pattern_flops, reached_pairs
from ring_attention.core.pattern import Pattern
from ring_attention.parallel.testing import run_distributed
from ring_attention.planner import progressions, traffic
from ring_attention.planner.capacity import (
    Evaluation,
    Setup,
    evaluate,
    fewest_ranks,
    floor_peak,
    floor_ranks,
    largest_length,
)
from ring_attention.planner.cli import main
from ring_attention.planner.cli_types import parse_size
from ring_attention.planner.memory import layer_memories, transport_buffers
from ring_attention.planner.presets import MODELS, longnet_pattern
from ring_attention.planner.progressions import union_stats
from ring_attention.planner.throughput import Rates, assumed_rates, rates_from_records
from ring_attention.planner.timing import Link, layer_times
from ring_attention.planner.traffic import all_pieces, predict_traffic


def _random_pattern(rng: random.Random, n: int, heads: int, *, docs: bool, offsets: bool):
    m = rng.randint(1, 3)
    segs = [rng.randint(1, n + 10) for _ in range(m)]
    dils = [rng.randint(1, min(w, 8)) for w in segs]
    head_groups = heads >= m and rng.random() < 0.3
    pattern = Pattern(
        segs,
        dils,
        causal=rng.random() < 0.5,
        head_groups=head_groups,
        head_offsets=rng.choice(["modulo", "grouped"]) if offsets else "modulo",
    )
    if docs and rng.random() < 0.6:
        cuts = sorted(rng.randint(0, n) for _ in range(rng.randint(0, 4)))
        pattern = pattern.with_documents([0, *cuts, n])
    return pattern


# ---------------------------------------------------------------------------
# Pairs.


@pytest.mark.parametrize("seed", range(6))
def test_pairs_match_the_oracle_multiplicity(seed: int) -> None:
    rng = random.Random(1000 + seed)
    for _ in range(25):
        n, heads = rng.randint(1, 70), rng.randint(1, 6)
        pattern = _random_pattern(rng, n, heads, docs=False, offsets=False)
        m = oracle_multiplicity(
            n, heads, pattern.segment_lengths, pattern.dilation_rates, pattern.causal,
            pattern.head_groups,
        )  # fmt: skip
        assert reached_pairs(pattern, n, heads) == int(m.sum())
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        assert reached_pairs(pattern, n, heads, [(lo, hi - lo)]) == int(m[:, lo:hi].sum())


@pytest.mark.parametrize("seed", range(6))
def test_pairs_with_documents_and_grouped_offsets(monkeypatch, seed: int) -> None:
    # every rank's pairs at once: in int64 (even seeds) or rank by rank in
    # Python integers (odd seeds); sliding windows in half the patterns
    if seed % 2:
        monkeypatch.setattr(pairs, "_INT64_SAFE", 0)
    rng = random.Random(2000 + seed)
    for _ in range(25):
        n, heads = rng.randint(1, 70), rng.randint(1, 6)
        pattern = _random_pattern(rng, n, heads, docs=True, offsets=True)
        if rng.random() < 0.5:
            pattern = dataclasses.replace(pattern, window=(rng.randint(-1, 9), rng.randint(-1, 9)))
        m = multiplicity(pattern, n, heads, dtype=torch.float64)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        assert reached_pairs(pattern, n, heads) == int(m.sum())
        assert reached_pairs(pattern, n, heads, [(lo, hi - lo)]) == int(m[:, lo:hi].sum())
        p, layout = rng.randint(1, 5), rng.choice(["contiguous", "zigzag"])
        ranges = [[(pc.start, pc.length) for pc in ps] for ps in all_pieces(n, p, layout)]
        assert pairs.ranks_pairs(pattern, n, heads, ranges) == [
            sum(int(m[:, s : s + k].sum()) for s, k in rs) for rs in ranges
        ], (pattern, n, heads, p, layout)


def test_pairs_of_a_billion_tokens_are_instant_and_consistent() -> None:
    n = 10**9
    segs, dils = longnet_pattern(n)
    pattern = Pattern(segs, dils)
    whole = reached_pairs(pattern, n, 16)
    halves = reached_pairs(pattern, n, 16, [(0, n // 2)]) + reached_pairs(
        pattern, n, 16, [(n // 2, n - n // 2)]
    )
    assert whole == halves
    # every branch reaches at most w / r = 2048 keys per query and head
    assert 0 < whole <= n * 16 * len(segs) * 2048
    assert pattern_flops(whole, 128) == 4 * 128 * whole
    assert pattern_flops(whole, 128, backward=True) == 14 * 128 * whole


# ---------------------------------------------------------------------------
# Unions of dilated rows.


def _brute_union(sets):
    rows = set()
    for lo, hi, r, p in sets:
        rows |= {u for u in range(lo, hi) if (u - p) % r == 0}
    return (len(rows), min(rows), max(rows)) if rows else (0, -1, -1)


@pytest.mark.parametrize(
    "limits",
    [
        {},  # defaults: listing, inclusion-exclusion, tables
        {"_MAX_LISTED": 0, "_FEW_CLASSES": 0},  # period tables
        {"_MAX_LISTED": 0, "_FEW_CLASSES": 0, "_MAX_PERIOD": 4},  # inclusion-exclusion
        {"_MAX_LISTED": 0, "_FEW_CLASSES": 0, "_MAX_PERIOD": 4, "_MAX_TERMS": 2},  # listing
    ],
)
def test_union_of_progressions_matches_brute_force(monkeypatch, limits) -> None:
    for name, value in limits.items():
        monkeypatch.setattr(progressions, name, value)
    progressions._periodic_count.cache_clear()
    rng = random.Random(str(limits))
    for _ in range(400):
        sets = [
            (rng.randint(0, 120), rng.randint(0, 300), rng.choice([1, 2, 3, 4, 6, 7, 8, 12, 16]),
             rng.randint(-20, 40))
            for _ in range(rng.randint(0, 6))
        ]  # fmt: skip
        assert union_stats(sets) == _brute_union(sets), sets
    progressions._periodic_count.cache_clear()


# ---------------------------------------------------------------------------
# Exchange model.


def _brute_traffic(pattern, n, heads, kv_heads, p, layout):
    """Rows, span rows and pairs per (rank, distance) from the multiplicity matrix."""
    m = multiplicity(pattern, n, heads, dtype=torch.float64)
    g = heads // kv_heads
    pieces = [layout_pieces(n, p, j, layout) for j in range(p)]
    recv, span, pairs = (torch.zeros(p, p, dtype=torch.int64) for _ in range(3))
    for j in range(p):
        qs = [t for pc in pieces[j] for t in range(pc.start, pc.start + pc.length)]
        for d in range(1, p):
            for pc in pieces[(j - d) % p]:
                ks = list(range(pc.start, pc.start + pc.length))
                if not ks or not qs:
                    continue
                block = m[:, qs][:, :, ks]
                needed = [
                    (row, kv)
                    for kv in range(kv_heads)
                    for row in torch.nonzero(block[kv * g : kv * g + g].sum((0, 1)))
                    .flatten()
                    .tolist()
                ]
                if needed:
                    lo = min(r for r, _ in needed)
                    hi = max(r for r, _ in needed) + 1
                    recv[j, d] += len(needed)
                    if len(needed) != (hi - lo) * kv_heads:
                        span[j, d] += hi - lo
                pairs[j, d] += int(block.sum())
    return recv, span, pairs


@pytest.mark.parametrize("seed", range(6))
def test_analytic_exchange_matches_brute_force(monkeypatch, seed: int) -> None:
    # every branch's rows in the memo's keys, the default, every branch listed per pair
    if seed % 3 != 1:
        listed = seed % 3 == 2
        monkeypatch.setattr(traffic, "_listed_branches", lambda b, *_: [listed] * len(b))
    rng = random.Random(3000 + seed)
    for _ in range(12):
        n, p = rng.randint(1, 45), rng.randint(1, 5)
        heads = rng.choice([1, 2, 3, 4, 6])
        kv_heads = rng.choice([k for k in range(1, heads + 1) if heads % k == 0])
        pattern = _random_pattern(rng, n, heads, docs=True, offsets=True)
        layout = rng.choice(["contiguous", "zigzag"])
        tr = predict_traffic(pattern, n, heads, kv_heads, p, layout, source="analytic")
        recv, span, pairs = _brute_traffic(pattern, n, heads, kv_heads, p, layout)
        ctx = (pattern, n, heads, kv_heads, p, layout)
        assert torch.equal(tr.recv_rows, recv), ctx
        assert torch.equal(tr.span_rows, span), ctx
        assert torch.equal(tr.step_pairs, pairs), ctx
        assert int(tr.total_pairs.sum()) == reached_pairs(pattern, n, heads)
        assert torch.equal(tr.local_pairs + tr.step_pairs.sum(1), tr.total_pairs)
        for d in range(1, p):  # what j sends at d is what j + d receives
            assert torch.equal(tr.send_rows[:, d], tr.recv_rows.roll(-d, 0)[:, d])


PLAN_CASES = [
    # n, p, heads, segments, dilations, causal, head_groups, layout
    (101, 4, 4, [8, 16, 32], [1, 2, 4], False, False, "contiguous"),
    (101, 4, 4, [8, 16, 32], [1, 2, 4], True, False, "contiguous"),
    (101, 3, 5, [8, 16, 32], [1, 2, 4], True, True, "contiguous"),
    (101, 3, 4, [8, 16, 32], [1, 2, 4], True, False, "zigzag"),
    (37, 5, 2, [37], [1], True, False, "contiguous"),
    (37, 4, 2, [37], [1], True, False, "zigzag"),
    (50, 3, 5, [10, 25], [2, 5], False, False, "contiguous"),
    (1000, 7, 3, [64, 256, 1024], [1, 4, 16], False, False, "contiguous"),
    (777, 6, 2, [100, 300, 900], [2, 3, 9], True, False, "zigzag"),
]


@pytest.mark.parametrize("case", PLAN_CASES)
def test_analytic_exchange_matches_the_ring_plan(case) -> None:
    n, p, heads, segs, dils, causal, head_groups, layout = case
    pattern = Pattern(segs, dils, causal=causal, head_groups=head_groups)
    analytic = predict_traffic(pattern, n, heads, heads, p, layout, source="analytic")
    plan = predict_traffic(pattern, n, heads, heads, p, layout, source="plan")
    assert plan.source == "plan" and analytic.source == "analytic"
    assert torch.equal(analytic.recv_rows, plan.recv_rows)
    assert torch.equal(analytic.send_rows, plan.send_rows)
    assert torch.equal(analytic.span_rows, plan.span_rows)
    assert int(plan.recv_rows.sum()) > 0


def test_pieces_follow_the_layout() -> None:
    for n, p in [(0, 3), (10, 4), (7, 7), (1001, 6)]:
        for layout in ("contiguous", "zigzag"):
            assert all_pieces(n, p, layout) == [layout_pieces(n, p, j, layout) for j in range(p)]


def test_longnet_bytes_stay_flat_at_a_fixed_shard() -> None:
    """The fixed LongNet pattern sends the same per rank from 8K to 128K tokens
    at a shard of 4096 (benchmarks/RESULTS.md: 1.00 MiB forward, fp32, 8 x 64)."""
    pattern = Pattern([512, 2048, 8192], [1, 4, 16])
    sent = []
    for p in (2, 4, 8, 16, 32):
        tr = predict_traffic(pattern, 4096 * p, 8, 8, p, source="analytic")
        sent.append(int(tr.rows_sent.max()) * 2 * 64 * 4)
    assert sent == [2**20] * 5


# ---------------------------------------------------------------------------
# Memory model vs the ring's own accounting, real processes.

MEMORY_CASES = [
    # n, heads, head_dim, batch, segments, dilations, causal, layout, dtype
    (1000, 4, 16, 2, [300], [1], False, "contiguous", torch.float32),
    (1000, 4, 16, 2, [64, 256, 1024], [1, 4, 16], False, "contiguous", torch.float32),
    (1001, 3, 8, 1, [64, 256, 1024], [1, 4, 16], True, "zigzag", torch.float32),
    (999, 4, 8, 2, [64, 256, 1024], [1, 4, 16], True, "zigzag", torch.bfloat16),
    (777, 2, 8, 1, [800], [1], True, "contiguous", torch.bfloat16),
    (777, 5, 8, 1, [100, 300], [2, 5], False, "contiguous", torch.float64),
]


def _memory_worker(rank: int, world: int, heads_per_group: str = "all") -> list[dict]:
    import gc
    import os

    import ring_attention as ra
    from ring_attention.parallel.exchange import last_exchange_stats
    from ring_attention.parallel.testing import tensor_peak

    out = []
    os.environ["RING_ATTENTION_BACKWARD_HEADS"] = heads_per_group
    for n, heads, head_dim, batch, segs, dils, causal, layout, dtype in MEMORY_CASES:
        g = torch.Generator().manual_seed(7)
        full = [torch.randn(batch, n, heads, head_dim, generator=g).to(dtype) for _ in range(4)]
        q, k, v, go = (ra.shard_sequence(t, layout=layout).contiguous() for t in full)
        for t in (q, k, v):
            t.requires_grad_()

        def call(q=q, k=k, v=v, go=go, segs=segs, dils=dils, causal=causal, layout=layout):
            for t in (q, k, v):
                t.grad = None
            ra.ring_dilated_attention(q, k, v, segs, dils, causal=causal, layout=layout).backward(
                go
            )

        call()  # warm-up: the plan is cached
        gc.collect()  # no earlier tensors freed inside the measured call
        peak = tensor_peak(call)
        out.append({"buffers": dict(last_exchange_stats.buffer_bytes), "peak": peak})
    return out


@pytest.mark.parametrize("heads_per_group", ["all", "1", "2"])
def test_memory_model_matches_the_ring_accounting(heads_per_group: str) -> None:
    world = 3
    measured = run_distributed(_memory_worker, world, heads_per_group)
    for i, (n, heads, head_dim, batch, segs, dils, causal, layout, dtype) in enumerate(
        MEMORY_CASES
    ):
        pattern = Pattern(segs, dils, causal=causal)
        tr = predict_traffic(pattern, n, heads, heads, world, layout)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        bufs = transport_buffers(tr, batch, head_dim, itemsize)
        per = backward_heads(heads, 1, itemsize, heads_per_group)
        memories = layer_memories(tr, batch, head_dim, itemsize, group_heads=per)
        for rank in range(world):
            got = measured[rank][i]
            want = {k: int(sum(v.values())[rank]) for k, v in bufs.items()}
            if not per:  # (by groups: the groups' buffers, one group at a time)
                assert {k: got["buffers"].get(k, 0) for k in want} == want, (i, rank)
            m = memories[rank]
            call = max(
                sum(m.forward.values()),
                sum(v for k, v in m.backward.items() if k != "kernel delta"),
            )
            # the same tensor bytes, but for the handshake's small control tensors
            assert abs(got["peak"] - call) <= 4096, (i, rank, got["peak"], call)
    assert any(sum(r["buffers"].values()) for rows in measured for r in rows)


# ---------------------------------------------------------------------------
# Rates and time.


def _record(pass_, n, heads, head_dim, seconds, **kw):
    rec = {"impl": "ours", "pass": pass_, "n": n, "heads": heads, "head_dim": head_dim,
           "dtype": "bf16", "device": "cuda:0", "seconds": seconds}  # fmt: skip
    rec.update(kw)
    return rec


def test_rates_come_from_the_nearest_record() -> None:
    records = [
        _record("forward", 4096, 16, 128, 1.0, flops=2e12),
        _record("forward", 65536, 16, 128, 1.0, flops=3e12),
        _record("forward+backward", 65536, 16, 128, 2.0, gflops=2500.0),
        _record("forward", 65536, 16, 128, 1.0, flops=9e12, impl="gather+SDPA"),
        {**_record("forward", 65536, 16, 128, 1.0, flops=9e12), "dtype": "float32"},
    ]
    rates = rates_from_records(records, n=50000, heads=16, head_dim=128, dtype="bfloat16",
                               device="cuda")  # fmt: skip
    assert rates is not None
    assert rates.forward == 3e12 and rates.forward_backward == 2.5e12
    assert "n=65536" in rates.source
    # 4d/fwd + 10d/bwd == 14d/fwd+bwd
    assert math.isclose(4 / rates.forward + 10 / rates.backward, 14 / rates.forward_backward)
    assert rates_from_records(records, n=1, heads=1, head_dim=1, dtype="float16",
                              device="cuda") is None  # fmt: skip
    assert "ASSUMED" in assumed_rates("cuda", "bf16").source
    assert assumed_rates("cpu", "float32", threads=2).forward == 100e9


def test_time_follows_the_schedule() -> None:
    pattern = Pattern([64, 256, 1024], [1, 4, 16])
    tr = predict_traffic(pattern, 2048, 4, 4, 4)
    rates = Rates(1e9, 1e9, "test")
    fast = layer_times(tr, 1, 16, 4, rates, Link(1e9, 0.0))
    for t in fast:  # communication all hidden
        assert math.isclose(t.forward, t.compute_forward, rel_tol=1e-9)
        assert math.isclose(t.forward_backward, t.compute_forward_backward, rel_tol=1e-9)
    link = Link(1e-3, 1e5)
    slow = layer_times(tr, 1, 16, 4, rates, link)
    for j, t in enumerate(slow):  # communication dominates: every transfer is exposed
        steps = tr.steps(j)
        assert t.steps == len(steps)
        rows = [max(int(tr.send_rows[j, d]), int(tr.recv_rows[j, d])) for d in steps]
        assert t.forward >= sum(link.seconds(2 * 16 * 4 * r) for r in rows) - 1e-9
        assert t.forward_backward > t.forward
    # compute time is pairs x 4d / rate
    j = 0
    assert math.isclose(
        fast[j].compute_forward, int(tr.total_pairs[j]) * 4 * 16 / 1e9, rel_tol=1e-12
    )


def test_model_parameter_counts() -> None:
    assert round(MODELS["llama2-7b"].params() / 1e9, 2) == 6.74
    assert round(MODELS["llama3-8b"].params() / 1e9, 2) == 8.03


# ---------------------------------------------------------------------------
# Searches and the command line.


def _cpu_setup(**kw) -> Setup:
    base = dict(ranks=3, device="cpu", memory=64 * 2**20, reserve=0, heads=4, kv_heads=4,
                head_dim=16, batch=1, dtype="float32", pattern="longnet")  # fmt: skip
    base.update(kw)
    return Setup(**base)


def test_largest_length_fits_and_the_next_does_not() -> None:
    # fixed branches: the peak grows with n. LongNet grown to n moves its top
    # branch with n, and the rows it exchanges (the largest step's packed
    # buffers) go up and down by a few percent from one length to the next.
    setup = _cpu_setup(pattern="longnet-paper")
    ev = largest_length(setup, lambda e: e.training_peak, rel_tol=0.01)
    assert ev is not None and ev.training_peak <= setup.usable
    beyond = evaluate(setup, int(ev.seq_len * 1.01) + setup.ranks + 1)
    assert beyond.training_peak > setup.usable
    assert largest_length(_cpu_setup(memory=1000), lambda e: e.training_peak) is None


def test_fewest_ranks_is_the_fewest() -> None:
    setup = _cpu_setup(memory=4 * 2**20)
    ev = fewest_ranks(setup, 20000, lambda e: e.training_peak)
    assert ev is not None and ev.training_peak <= setup.usable
    p = ev.setup.ranks
    assert p > 2
    from dataclasses import replace

    assert evaluate(replace(setup, ranks=p - 1), 20000).training_peak > setup.usable


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_floor_bounds_the_peak_and_the_fewest_ranks_from_below(layout) -> None:
    """floor_peak (the items that do not depend on the exchange, at the
    longest shard) never exceeds the evaluated peak of any goal, so
    floor_ranks never exceeds the fewest ranks; the command line refuses
    from it what needs more ranks than the planner models."""
    from dataclasses import replace

    model = MODELS["24x2048"]
    setup = _cpu_setup(memory=64 * 2**20, layout=layout, batch=2, dtype="bfloat16")
    for n, p in [(20000, 1), (20000, 3), (20001, 5), (7, 4), (99999, 7)]:
        ev = evaluate(replace(setup, ranks=p), n)
        assert floor_peak(setup, n, p, "inference") <= ev.forward_peak
        assert floor_peak(setup, n, p, "training") <= ev.training_peak
        with_model = Evaluation(replace(ev.setup, model=model), n, ev.pattern, ev.traffic)
        assert floor_peak(with_model.setup, n, p, "model") <= with_model.model_peak
    fewest = fewest_ranks(setup, 20000, lambda e: e.training_peak)
    low = floor_ranks(setup, 20000, "training")
    assert fewest is not None and 1 <= low <= fewest.setup.ranks
    assert floor_peak(setup, 20000, low, "training") <= setup.usable
    assert low > 1  # (so the bound below is tested)
    assert floor_peak(setup, 20000, low - 1, "training") > setup.usable
    assert floor_ranks(setup, 20000, "training", high=low - 1) is None
    tiny = _cpu_setup(memory=1000)  # one token per rank already needs more
    assert floor_ranks(tiny, 10**9, "training") is None


def test_parse_size() -> None:
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("1e9") == parse_size("1B") == 10**9
    assert parse_size("64K") == 64000


def test_cli_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ring_attention.planner", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0
    for flag in ("--gpus", "--gpu-memory", "--pattern", "--bench-json", "--link-gbps", "--model"):
        assert flag in done.stdout


def test_cli_gpu_plan(capsys) -> None:
    code = main(["--gpus", "8", "--gpu-memory", "80GB", "--heads", "16", "--head-dim", "128",
                 "--pattern", "longnet", "--dtype", "bf16", "--layers", "24", "--hidden",
                 "2048"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    for text in ("Longest sequence that fits", "one attention layer, training",
                 "whole model, training", "time/layer", "bytes/link", "ASSUMED",
                 "stored activations", "Assumptions:"):  # fmt: skip
        assert text in out, text


def test_cli_cpu_processes_at_a_length(capsys) -> None:
    code = main(["--device", "cpu", "--processes", "4", "--memory", "24GB", "--heads", "8",
                 "--head-dim", "64", "--dtype", "float32", "--seq-len", "16384",
                 "--segments", "512", "2048", "8192", "--dilations", "1", "4", "16"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4 x cpu" in out and "n = 16,384" in out
    assert "rows: plan" in out  # small enough to use the ring's own plan


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--gpus", "8", "--gpu-memory", "1GB", "--model", "llama2-7b", "--replicate-params"],
         "the largest item, parameters"),
        (["--gpus", "2", "--gpu-memory", "1GB", "--heads", "1", "--head-dim", "8", "--seq-len",
          "2e7"], "do not fit on 2 ranks"),
    ],
)  # fmt: skip
def test_cli_explains_impossible_requests(capsys, argv, reason) -> None:
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert "Not possible" in out and reason in out, out


@pytest.mark.parametrize(
    "argv, option, reason",
    [
        (["--gpus", "8", "--heads", "16", "--kv-heads", "3"], "--kv-heads",
         "kv_heads must divide heads"),
        (["--gpus", "2", "--segments", "8", "--dilations", "9"], "--segments/--dilations",
         "dilation_rates[0]"),
        (["--seq-len", "1e6", "--device", "cpu"], "--seq-len", "fewest-ranks search is for GPUs"),
    ],
)  # fmt: skip
def test_cli_refuses_bad_option_combinations(capsys, argv, option, reason) -> None:
    """Options that do not go together: argparse's error naming one, exit 2."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    error = captured.err.strip().splitlines()[-1]
    assert error.startswith(f"python -m ring_attention.planner: error: argument {option}: ")
    assert reason in error and captured.out == "", captured


_NO_EXTENSION = """
import sys
sys.modules["ring_attention._C"] = None  # as if the extension had not been built
import ring_attention
from ring_attention.planner import predict_traffic, reached_pairs
from ring_attention.planner.cli import main
from ring_attention.core.pattern import Pattern

assert main(["--device", "cpu", "--processes", "4", "--memory", "24GB", "--heads", "8",
             "--head-dim", "64", "--dtype", "float32", "--seq-len", "16384",
             "--segments", "512", "2048", "--dilations", "1", "4"]) == 0
pattern = Pattern([512, 2048], [1, 4], causal=True).with_documents([0, 1000, 16384])
assert predict_traffic(pattern, 16384, 8, 8, 4).source == "analytic"
assert reached_pairs(pattern, 16384, 8) > 0
assert "ring_attention.local.ops" not in sys.modules
try:
    ring_attention.dilated_attention
except ImportError as error:
    assert "ring_attention._C" in str(error), error
else:
    raise AssertionError("dilated_attention without the extension")
print("planner ran without the extension")
"""


def test_planner_imports_and_runs_without_the_extension() -> None:
    """The planner is arithmetic: with ring_attention._C hidden it imports,
    plans from its closed forms, and the public names that need the
    operators raise ImportError naming the extension."""
    done = subprocess.run(
        [sys.executable, "-c", _NO_EXTENSION], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "planner ran without the extension" in done.stdout
