"""The ring's CPU transport reads the rows of partly needed sender pieces in
place through row maps (ring_attention/parallel/exchange.py): a 6-process gloo ring
(shards of 21-22 rows of 131: dividing nothing) against the float64 oracle
and the single-process op, forward and backward, for dilated branches,
causal or not, zigzag, grouped K/V heads, head groups, documents, windows;
every rank's transport buffers equal the planner's model byte for byte (the
cases without a window: the traffic model takes none), and row maps are in
use (the model's ``row maps`` item is not zero).
"""

from __future__ import annotations

import pytest
import torch
from test_ring import LONGNET, LSE_TOL, TOLERANCES, _config, _run_case

from ring_attention.core.pattern import Pattern
from ring_attention.parallel.exchange import last_exchange_stats
from ring_attention.parallel.testing import run_distributed
from ring_attention.planner.memory import transport_buffers
from ring_attention.planner.traffic import predict_traffic

WORLD = 6
CASES: dict[str, dict] = {
    "longnet": dict(n=131, pattern=LONGNET, causal=False),
    "longnet_causal_f64": dict(n=131, pattern=LONGNET, causal=True, dtype=torch.float64),
    "zigzag_gqa": dict(
        n=131, pattern=([16, 64], [2, 8]), causal=True, layout="zigzag", heads=6, kv_heads=2
    ),
    "head_groups_bf16": dict(
        n=131, pattern=LONGNET, causal=True, head_groups=True, heads=3, dtype=torch.bfloat16
    ),
    "documents_grouped_lse": dict(
        n=131,
        pattern=([24, 131], [3, 4]),
        causal=False,
        heads=4,
        kv_heads=2,
        head_offsets="grouped",
        cu_seqlens=[0, 7, 60, 61, 131],
        lse=True,
    ),
    "window_dilated": dict(n=131, pattern=([48, 131], [2, 5]), causal=True, window=(40, 0)),
}


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name, case in CASES.items():
        res = _run_case(_config(case))
        res["buffers"] = dict(last_exchange_stats.buffer_bytes)
        out[name] = res
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD)


def assert_matches_oracle(r: dict, dtype: torch.dtype, ctx: tuple) -> None:
    """One rank's result of ``_run_case`` within the dtype's tolerances of the
    float64 oracle: out (its shard and gathered), lse, dq, dk, dv."""
    atol, rtol = TOLERANCES[dtype]
    assert r["shape_ok"] and r["finite"], ctx
    assert r["out_vs_oracle"] <= atol + rtol * r["scale_out"], ctx
    assert r["gathered_vs_oracle"] <= atol + rtol * r["scale_out"], ctx
    assert r["lse_vs_oracle"] <= LSE_TOL[dtype], ctx
    for g in ("dq", "dk", "dv"):
        assert r[f"{g}_vs_oracle"] <= atol + rtol * r[f"scale_{g}"], (*ctx, g)


@pytest.mark.parametrize("name", list(CASES))
def test_ring_with_row_maps_matches_the_oracle(results, name) -> None:
    c = _config(CASES[name])
    for rank, res in enumerate(results):
        assert_matches_oracle(res[name], c["dtype"], (name, rank))


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "window" not in c])
def test_row_map_buffers_match_the_planner(results, name) -> None:
    c = _config(CASES[name])
    segs, dils = c["pattern"]
    pattern = Pattern(segs, dils, causal=c["causal"], head_groups=c["head_groups"],
                      head_offsets=c["head_offsets"], window=c["window"]
                      ).with_documents(c["cu_seqlens"])  # fmt: skip
    tr = predict_traffic(pattern, c["n"], c["heads"], c["kv_heads"], WORLD, c["layout"])
    itemsize = torch.empty(0, dtype=c["dtype"]).element_size()
    model = transport_buffers(tr, c["batch"], c["head_dim"], itemsize)
    for rank, res in enumerate(results):
        want = {p: int(sum(items.values())[rank]) for p, items in model.items()}
        got = res[name]["buffers"]
        assert {p: got.get(p, 0) for p in want} == want, (name, rank)
    assert int(model["backward"]["row maps"].max()) > 0, f"{name}: no piece read by a row map"
