"""The exchange planner operator ``torch.ops.ring_attention.exchange_rows``
against the float64 oracle: the key rows of a block that some query of a set
of query ranges reaches, per K/V head (the union over the query heads that
read it), with documents, grouped offsets, head groups and causal masks.
"""

from __future__ import annotations

import random

import pytest
import torch
from op_helpers import OPS, Cfg, reached_rows


def planned(cfg: Cfg, q_ranges, k_start: int, k_len: int) -> list[int]:
    cu = None if cfg.cu_seqlens is None else torch.tensor(cfg.cu_seqlens, dtype=torch.int64)
    idx = OPS.exchange_rows(
        [a for a, _ in q_ranges],
        [n for _, n in q_ranges],
        k_start,
        k_len,
        cfg.heads,
        cfg.resolved_kv_heads(),
        cfg.segment_lengths,
        cfg.dilation_rates,
        cfg.causal,
        cfg.head_groups,
        cfg.grouped_offsets,
        cu,
    )
    assert idx.dtype == torch.int64 and idx.dim() == 1
    return idx.tolist()


def expected(cfg: Cfg, q_ranges, k_start: int, k_len: int) -> list[int]:
    """Flat indices row * kv_heads + kvh of the oracle's reached key rows."""
    reached = torch.zeros(k_len, cfg.resolved_kv_heads(), dtype=torch.bool)
    for a, n in q_ranges:
        if n > 0 and k_len > 0:
            reached |= reached_rows(cfg, (a, a + n), (k_start, k_start + k_len))
    return reached.flatten().nonzero().flatten().tolist()


def random_cfg(seed: int) -> tuple[Cfg, list[tuple[int, int]], int, int]:
    rng = random.Random(seed)
    n = rng.randint(8, 120)
    branches = rng.randint(1, 3)
    ws = [rng.randint(1, 40) for _ in range(branches)]
    rs = [rng.randint(1, min(w, 6)) for w in ws]
    heads = rng.choice([1, 2, 4, 6, 8])
    bounds = None
    if rng.random() < 0.7:
        bounds = [0]
        while bounds[-1] < n:
            bounds.append(min(n, bounds[-1] + rng.choice([0, 1, 2, 5, 9, 17, 33])))
    cfg = Cfg(
        batch=1,
        n=n,
        heads=heads,
        head_dim=1,
        segment_lengths=ws,
        dilation_rates=rs,
        causal=rng.random() < 0.5,
        head_groups=heads >= branches and rng.random() < 0.3,
        kv_heads=rng.choice([h for h in (1, 2, heads) if heads % h == 0]),
        grouped_offsets=rng.random() < 0.4,
        cu_seqlens=bounds,
    )
    q_ranges = []
    for _ in range(rng.randint(1, 3)):
        a = rng.randrange(n)
        q_ranges.append((a, rng.randint(0, n - a)))
    k_start = rng.randrange(n)
    return cfg, q_ranges, k_start, rng.randint(0, n - k_start)


@pytest.mark.parametrize("seed", range(60))
def test_exchange_rows_matches_oracle(seed) -> None:
    cfg, q_ranges, k_start, k_len = random_cfg(8000 + seed)
    got = planned(cfg, q_ranges, k_start, k_len)
    assert got == expected(cfg, q_ranges, k_start, k_len), f"{cfg} q={q_ranges} k={k_start}+{k_len}"


def test_rows_are_shared_by_the_heads_of_a_kv_head() -> None:
    """8 query heads on 2 K/V heads, r = 4: each K/V head's query heads cover
    all 4 offsets, so every key row of a segment is needed once per K/V head."""
    cfg = Cfg(1, 32, 8, 1, [16], [4], kv_heads=2)
    got = planned(cfg, [(0, 32)], 0, 32)
    assert got == list(range(64))
    # grouped offsets: heads 0..3 (K/V head 0) take offsets 0, 0, 1, 1
    cfg.grouped_offsets = True
    got = planned(cfg, [(0, 32)], 0, 32)
    assert got == [
        u * 2 + kvh for u in range(32) for kvh in range(2) if u % 16 % 4 in (2 * kvh, 2 * kvh + 1)
    ]


def test_documents_cut_what_a_rank_needs() -> None:
    """Keys of an earlier document are never needed by later queries."""
    cfg = Cfg(1, 40, 2, 1, [64], [1], cu_seqlens=[0, 10, 40])
    assert planned(cfg, [(20, 20)], 0, 20) == list(range(20, 40))  # rows 10..19, both heads
    cfg.cu_seqlens = None
    assert planned(cfg, [(20, 20)], 0, 20) == list(range(40))
