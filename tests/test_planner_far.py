"""The planner's far-group schedule (ring_attention/planner/timing.py): the
transfers of at most ``far_bytes`` K/V bytes travel in one batch per pass.

* exact times of a 3-rank ring computed by hand, ring alone and both far
  thresholds;
* ``far_bytes = 0`` is the ring's model exactly; times grow with latency,
  per-message cost and bytes; latency-bound rings expose less with the group;
* the far group's buffers in the memory model;
* the command line prints both schedules.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from ring_attention.core.links import LINKS, Link
from ring_attention.core.pattern import Pattern
from ring_attention.planner.cli import main
from ring_attention.planner.memory import transport_buffers
from ring_attention.planner.throughput import Rates
from ring_attention.planner.timing import layer_times
from ring_attention.planner.traffic import Traffic, predict_traffic

# Units chosen so that every time is a small number of seconds: head_dim,
# batch and itemsize 1 (a K/V row is 2 bytes, its fp32 gradient 8), 1 s per
# byte, 1 s latency, 0.1 s per further message, 1 s per reached pair forward
# and backward.
_LINK = Link(gbps=8e-9, latency_us=1e6, message_us=1e5)
_RATES = Rates(forward=4.0, forward_backward=7.0, source="test")  # backward = 10 FLOP/s


def _hand_traffic() -> Traffic:
    """3 ranks, the same on each: 1 row from distance 1 (2 pairs), 3 rows
    from distance 2 (1 pair), 5 local pairs."""
    p = 3
    recv = torch.tensor([[0, 1, 3]] * p)
    pairs = torch.tensor([[0, 2, 1]] * p)
    return Traffic(
        pattern=Pattern([3], [1]), seq_len=3, heads=1, kv_heads=1, world_size=p,
        layout="contiguous", source="analytic", local_len=torch.ones(p, dtype=torch.int64),
        total_pairs=torch.full((p,), 8), local_pairs=torch.full((p,), 5), recv_rows=recv,
        send_rows=recv.clone(), span_rows=torch.zeros(p, p, dtype=torch.int64),
        step_pairs=pairs,
    )  # fmt: skip


@pytest.mark.parametrize(
    "far_bytes, forward, backward, messages",
    [
        # ring: x1 = 1 + 2 = 3, x2 = 1 + 6 = 7, g1 = 1 + 8 = 9, g2 = 1 + 24 = 25
        #   fwd = max(5, 3) + max(2, 7) + 1 = 13
        #   bwd = max(5, 3) + max(2, 7) + max(1, 9) + 25 = 46
        (0, 13.0, 46.0, 0),
        # distance 1 in the group: X = 1 + 0.1 + 2 = 3.1, G = 1.1 + 8 = 9.1
        #   c0' = max(5, 3.1) + 2 = 7; fwd = max(max(7, 7) + 1, 3.1 + 6) = 9.1
        #   bwd = max(max(7, 7) + 1 + 25, 7 + 9.1, 3.1 + 9.1 + (6 + 24)) = 42.2
        (2, 9.1, 42.2, 1),
        # both in the group: X = 1 + 0.2 + 8 = 9.2, G = 1.2 + 32 = 33.2
        #   fwd = max(5, 9.2) + 3 = 12.2; bwd = max(12.2, 12.2 + 33.2, 9.2 + 33.2) = 45.4
        (6, 12.2, 45.4, 2),
    ],
)
def test_times_by_hand(far_bytes, forward, backward, messages) -> None:
    for t in layer_times(_hand_traffic(), 1, 1, 1, _RATES, _LINK, far_bytes):
        assert math.isclose(t.forward, forward, rel_tol=1e-12)
        assert math.isclose(t.forward_backward, forward + backward, rel_tol=1e-12)
        assert (t.compute_forward, t.compute_forward_backward) == (8.0, 16.0)
        assert t.far_messages == messages
        assert t.steps == (2 if far_bytes < 2 else 1 if far_bytes < 6 else 0)


def _local_bound_traffic() -> Traffic:
    """4 ranks, the same on each: 1 row at distance 1 (far at 2 bytes), 3 rows at distances
    2 and 3; 20 local pairs, 2, 1, 1 per step."""
    p = 4
    recv, pairs = torch.tensor([[0, 1, 3, 3]] * p), torch.tensor([[0, 2, 1, 1]] * p)
    return replace(_hand_traffic(), world_size=p, local_len=torch.ones(p, dtype=torch.int64),
                   total_pairs=torch.full((p,), 24), local_pairs=torch.full((p,), 20),
                   recv_rows=recv, send_rows=recv.clone(), step_pairs=pairs,
                   span_rows=torch.zeros(p, p, dtype=torch.int64))  # fmt: skip


def test_far_and_near_returns_share_the_link() -> None:
    """Local blocks that hide the far K/V: after the far blocks, the far dK/dV, the near K/V
    after the first step and every near dK/dV cross the link one after another."""
    tr = _local_bound_traffic()
    # X_F = 1.1 + 2 = 3.1, G_F = 1.1 + 8 = 9.1, x = 1 + 6 = 7, g = 1 + 24 = 25 (both steps)
    #   c0' = b0' = max(20, 3.1) + 2 = 22; fwd = 22 + max(1, 7) + 1 = 30
    #   the ring's chain: 22 + max(1, 7) + max(1, 25) + 25 = 79; after the far blocks each way:
    #   far dK/dV 8 + step 3's K/V 6 + near dK/dV 2 x 24 = 62 bytes: 22 + 1 + 62 = 85
    for t in layer_times(tr, 1, 1, 1, _RATES, _LINK, 2):
        assert math.isclose(t.forward, 30.0, rel_tol=1e-12)
        assert math.isclose(t.forward_backward, 30.0 + 85.0, rel_tol=1e-12)
        assert (t.compute_forward_backward, t.steps, t.far_messages) == (48.0, 2, 1)


@pytest.mark.parametrize(
    "groups, backward",
    [
        # half the rows and pairs a group: X_F = 1.1 + 1 = 2.1, G_F = 1.1 + 4 = 5.1, x = 4,
        # g = 13, b_0' = max(10, 2.1 (+ 5.1: the first group's return)) + 1 = 11, the chain
        # 11 + 4 + 13 + 13 = 41. The first group's far return travels behind the second's
        # local blocks: after its far blocks 1 + (6 + 48) / 2 = 28 (its chain: 41); the last
        # group's: 1 + (6 + 48 + 8) / 2 = 32 after them: 43
        (2, 41.0 + 43.0),
        # a third: X_F = 1.1 + 2/3, G_F = 1.1 + 8/3, b_0' = 20/3 + 2/3, chains 22/3 + 3 + 9 + 9;
        # the last group: X_F + G_F (the previous return) + G_F + W (4 + 16) = 29.3
        (3, 2 * (22 / 3 + 21) + 29.3),
    ],
)
def test_a_groups_far_return_travels_behind_the_next_local_blocks(groups, backward) -> None:
    for t in layer_times(_local_bound_traffic(), 1, 1, 1, _RATES, _LINK, 2, groups):
        assert math.isclose(t.forward, 30.0, rel_tol=1e-12)
        assert math.isclose(t.forward_backward, 30.0 + backward, rel_tol=1e-12)


def test_the_advice_takes_more_groups_where_far_returns_hide() -> None:
    """Slow kernels, every transfer far: a group's far dK/dV hide behind the next group's
    local blocks, so one head a group exposes the least; the ring alone: one group."""
    from ring_attention.planner.capacity import Setup, evaluate

    base = dict(ranks=8, device="cuda", memory=10**12, reserve=0, heads=4, kv_heads=4,
                head_dim=16, batch=1, dtype="bfloat16", source="analytic", tflops=(0.01, 0.01),
                link=Link(1.0, 20.0, 2.0))  # fmt: skip
    for far, advice in ((1 << 40, 1), (0, 0)):
        times = {}
        for per in ("all", "2", "1", "auto"):
            ev = evaluate(Setup(far_bytes=far, backward_heads=per, **base), 2**14)
            times[per] = max(t.forward_backward for t in ev.times)
        assert ev.group_heads == advice
        assert times["auto"] == min(times.values())
    assert times["all"] < times["2"] < times["1"]  # the ring alone: latencies multiply


def _longnet_traffic(p: int) -> Traffic:
    pattern = Pattern([64, 256, 1024, 4096], [1, 4, 16, 64])
    return predict_traffic(pattern, 4096, 4, 2, p, source="analytic")


def test_no_group_is_the_ring() -> None:
    tr = _longnet_traffic(8)
    rates = Rates(1e9, 8e8, "test")
    link = Link(1.0, 50.0, 5.0)
    ring = layer_times(tr, 2, 16, 2, rates, link)
    assert layer_times(tr, 2, 16, 2, rates, link, 0) == ring
    # a threshold below the smallest transfer groups nothing either
    smallest = int(tr.recv_rows[tr.recv_rows > 0].min()) * 2 * 2 * 16 * 2
    assert layer_times(tr, 2, 16, 2, rates, link, smallest - 1) == ring
    assert any(t.far_messages for t in layer_times(tr, 2, 16, 2, rates, link, smallest))


def test_times_grow_with_every_cost() -> None:
    tr = _longnet_traffic(16)
    base = Link(1.0, 40.0, 4.0)
    far = 1 << 12
    for rates, strict in ((Rates(5e8, 4e8, "test"), False), (Rates(1e18, 1e18, "free"), True)):

        def worst(link: Link, rates=rates) -> tuple[float, float]:
            ts = layer_times(tr, 1, 16, 4, rates, link, far)
            return max(t.forward for t in ts), max(t.forward_backward for t in ts)

        ref = worst(base)
        for slower in (replace(base, latency_us=80.0), replace(base, message_us=8.0),
                       replace(base, gbps=0.5)):  # fmt: skip
            got = worst(slower)
            assert got[0] >= ref[0] and got[1] >= ref[1], slower
            if strict:  # nothing to hide behind: every cost shows
                assert got[0] > ref[0] and got[1] > ref[1], slower


def test_latency_bound_ring_exposes_less_with_the_group() -> None:
    """Many ranks, small transfers: p - 1 latencies in the ring, one (and p - 1
    message costs) in the group."""
    tr = _longnet_traffic(32)
    rates = Rates(1e10, 1e10, "test")
    link = LINKS["cuda"][0]
    ring = layer_times(tr, 1, 16, 2, rates, link)
    far = layer_times(tr, 1, 16, 2, rates, link, link.far_bytes)
    assert all(t.far_messages > 16 for t in far)
    ring_exposed = max(t.exposed_forward_backward for t in ring)
    far_exposed = max(t.exposed_forward_backward for t in far)
    assert far_exposed < 0.5 * ring_exposed


def test_group_buffers_hold_every_far_row() -> None:
    tr = _longnet_traffic(6)
    row = 2 * 3 * 8  # batch 3, head_dim 8: K and V
    ring = transport_buffers(tr, 3, 8, 2)
    again = transport_buffers(tr, 3, 8, 2, 0)
    assert all(torch.equal(v, again[ph][k]) for ph in ring for k, v in ring[ph].items())
    assert not any(int(v.sum()) for k, v in ring["backward"].items() if k.startswith("far"))
    every = transport_buffers(tr, 3, 8, 2, 1 << 40)
    sent, received = tr.send_rows.sum(1) * row, tr.recv_rows.sum(1) * row
    fwd, bwd = every["forward"], every["backward"]
    assert torch.equal(fwd["far send K/V"], sent * 2)
    assert torch.equal(fwd["far receive K/V"], received * 2)
    assert torch.equal(bwd["far dK/dV returned"], received * 4)
    assert torch.equal(bwd["far dK/dV coming home"], sent * 4)
    for k in ("send K/V", "receive K/V", "dK/dV returned", "dK/dV coming home"):
        assert int(bwd[k].sum()) == 0, k
    assert torch.equal(bwd["row maps"], ring["backward"]["row maps"])


def test_link_far_bytes_is_latency_times_bandwidth() -> None:
    assert Link(400.0, 10.0).far_bytes == 500_000
    assert LINKS["cpu"][0].far_bytes == 125_000


def test_cli_prints_both_schedules(capsys) -> None:
    argv = ["--gpus", "32", "--gpu-memory", "80GB", "--heads", "4", "--head-dim", "16",
            "--seq-len", "64K", "--quiet", "--far-bytes", "auto"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "far steps    ring alone:" in out
    assert "far group (transfers <= 500.00 kB)" in out
    assert "1 us per further message of a batch" in out
    assert main([*argv[:-1], "lots"]) == 2
    assert "--far-bytes must be off, auto or a size" in capsys.readouterr().err
