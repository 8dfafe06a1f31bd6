"""The ring's far group (``RING_ATTENTION_FAR_BYTES``, ring_attention/parallel/exchange.py):
transfers of at most that many K/V bytes travel in one batch per pass,
posted first, the others in their ring steps.

Real gloo rings against the float64 oracle and the single-process op,
forward and backward: world sizes 2-6 (shards that divide nothing), dilated
branches causal or not, zigzag, grouped K/V heads, head groups, documents,
windows, with a threshold that splits every ring into near and far transfers
and with every transfer far; the bytes exchanged equal the ring's; every
rank's transport buffers equal the planner's model with the same threshold
(the cases without a window); ranks that disagree on the knob raise, every
one of them.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_ring import _config, _run_case
from test_ring_rows import CASES, assert_matches_oracle

from ring_attention.core import config
from ring_attention.core.pattern import Pattern
from ring_attention.parallel.exchange import last_exchange_stats
from ring_attention.parallel.exchange_plan import build_plan
from ring_attention.parallel.testing import run_distributed
from ring_attention.planner.memory import transport_buffers
from ring_attention.planner.traffic import predict_traffic

#: world size -> the cases of tests/test_ring_rows.py run there
RINGS = {6: ["longnet", "zigzag_gqa", "documents_grouped_lse", "window_dilated"],
         2: ["longnet_causal_f64"], 3: ["zigzag_gqa"], 4: ["window_dilated"],
         5: ["head_groups_bf16"]}  # fmt: skip
ALL = 1 << 40  # every transfer far


def _pattern(c: dict) -> Pattern:
    segs, dils = c["pattern"]
    return Pattern(segs, dils, causal=c["causal"], head_groups=c["head_groups"],
                   head_offsets=c["head_offsets"], window=c["window"]
                   ).with_documents(c["cu_seqlens"])  # fmt: skip


def _sizes(c: dict, world: int) -> list[int]:
    """K/V bytes of every transfer of the ring (from every rank's plan)."""
    row = 2 * c["batch"] * c["head_dim"] * torch.empty(0, dtype=c["dtype"]).element_size()
    out = []
    for rank in range(world):
        plan = build_plan(_pattern(c), c["n"], c["heads"], c["kv_heads"], world, rank, c["layout"])
        out += [s.recv_rows * row for s in plan.steps if s.recv_rows]
    return sorted(out)


def _split_threshold(c: dict, world: int) -> int:
    """A threshold with transfers on both sides of it (the median size)."""
    sizes = _sizes(c, world)
    mid = sizes[len(sizes) // 2]
    assert sizes[0] <= mid < sizes[-1], sizes  # a case whose transfers differ
    return mid


def _bytes(c: dict, world: int, rank: int) -> tuple[int, int]:
    """Bytes a rank sends and receives per forward + backward (the plan's)."""
    plan = build_plan(_pattern(c), c["n"], c["heads"], c["kv_heads"], world, rank, c["layout"])
    itemsize = torch.empty(0, dtype=c["dtype"]).element_size()
    kw = dict(backward=True, grad_itemsize=8 if itemsize == 8 else 4)
    return (plan.bytes_sent(c["batch"], c["head_dim"], itemsize, **kw),
            plan.bytes_received(c["batch"], c["head_dim"], itemsize, **kw))  # fmt: skip


def _worker(rank: int, world: int, runs: list[tuple[str, int]]) -> tuple[list[dict], str]:
    import ring_attention as ra

    out = []
    for name, far in runs:
        os.environ[config.FAR_BYTES] = str(far)
        res = _run_case(_config(CASES[name]))
        res["buffers"] = dict(last_exchange_stats.buffer_bytes)
        res["bytes"] = (last_exchange_stats.bytes_sent(), last_exchange_stats.bytes_received())
        out.append(res)
    # ranks that disagree on the knob: every rank raises, naming it
    os.environ[config.FAR_BYTES] = "auto" if rank == 0 else "off"
    q = torch.randn(1, 8, 2, 4)
    try:
        ra.ring_dilated_attention(q, q, q, [16], [1])
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    return out, error


def _runs(world: int) -> list[tuple[str, int]]:
    """Every case of ``world`` with a threshold that splits its transfers
    (where they differ: not at 2 ranks) and with every transfer far."""
    out = [(n, ALL) for n in RINGS[world]]
    if world > 2:
        out += [(n, _split_threshold(_config(CASES[n]), world)) for n in RINGS[world]]
    return out


def _check(results: list[list[dict]], runs: list[tuple[str, int]], world: int) -> None:
    for i, (name, far) in enumerate(runs):
        c = _config(CASES[name])
        for rank, res in enumerate(results):
            r, ctx = res[i], (name, far, rank)
            assert_matches_oracle(r, c["dtype"], ctx)
            # the same rows travel whatever the schedule
            assert r["bytes"] == _bytes(c, world, rank), ctx
        if c["window"] is None:
            tr = predict_traffic(_pattern(c), c["n"], c["heads"], c["kv_heads"], world, c["layout"])
            itemsize = torch.empty(0, dtype=c["dtype"]).element_size()
            model = transport_buffers(tr, c["batch"], c["head_dim"], itemsize, far)
            for rank, res in enumerate(results):
                want = {p: int(sum(items.values())[rank]) for p, items in model.items()}
                got = res[i]["buffers"]
                assert {p: got.get(p, 0) for p in want} == want, (name, far, rank)
            if far:
                assert int(model["backward"]["far send K/V"].max()) > 0, (name, far)


@pytest.mark.parametrize("world", sorted(RINGS))
def test_far_group_matches_the_oracle_and_the_planner(world) -> None:
    runs = _runs(world)
    results = run_distributed(_worker, world, runs)
    _check([r for r, _ in results], runs, world)
    for _, msg in results:
        assert "RING_ATTENTION_FAR_BYTES" in msg and f"[125000{', 0' * (world - 1)}]" in msg, msg


def test_knob_values(monkeypatch) -> None:
    monkeypatch.delenv(config.FAR_BYTES, raising=False)
    assert (config.far_bytes("cpu"), config.far_bytes("cuda")) == (0, 0)  # off by default
    for raw, want in (("off", 0), ("0", 0), ("4096", 4096), ("auto", 125_000)):
        monkeypatch.setenv(config.FAR_BYTES, raw)
        assert config.far_bytes("cpu") == want
    monkeypatch.setenv(config.FAR_BYTES, "auto")
    assert config.far_bytes("cuda") == 500_000
    for raw in ("-1", "lots", "1e3"):
        monkeypatch.setenv(config.FAR_BYTES, raw)
        with pytest.raises(ValueError, match="RING_ATTENTION_FAR_BYTES must be off, auto or"):
            config.far_bytes("cpu")
