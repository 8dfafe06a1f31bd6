"""The exchange planner operator ``torch.ops.ring_attention.exchange_rows``
against the float64 oracle: the key rows of a block that some query of a set
of query ranges reaches, per K/V head (the union over the query heads that
read it), with documents, grouped offsets, head groups and causal masks.
"""

from __future__ import annotations

import random

import pytest
import torch
from child_env import with_path
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


def _shifted(cfg: Cfg, base: int) -> list[int]:
    """cfg's documents (one if none) moved to start at position base."""
    bounds = cfg.cu_seqlens if cfg.cu_seqlens is not None else [0, cfg.n]
    return [0, *(base + b for b in bounds)]


def far_cases() -> int:
    """Ranges past 2**61 - 1, where the segment walk's unbounded end used to
    sit (the call never returned), against the oracle at 0: documents from
    `base` on cut base + [0, n) exactly as the oracle cuts [0, n); without
    documents, w = 8 divides every base and one segment of 2**62 holds
    base + [0, 40) at a relative start that r = 8 divides. The count of cases."""
    count = 0
    for base in (2**61 - 1, 2**61, 2**62 - 128):
        for seed in range(8):
            cfg, q_ranges, k_start, k_len = random_cfg(8100 + seed)
            want = expected(cfg, q_ranges, k_start, k_len)
            far = Cfg(**{**cfg.__dict__, "cu_seqlens": _shifted(cfg, base), "n": base + cfg.n})
            got = planned(far, [(base + a, n) for a, n in q_ranges], base + k_start, k_len)
            assert got == want, f"{cfg} base={base} q={q_ranges} k={k_start}+{k_len}"
            count += 1
    for base in (2**61 - 8, 2**61, 2**62 - 128):
        for causal in (False, True):
            cfg = Cfg(1, 40, 6, 1, [8, 2**62], [2, 8], causal=causal, kv_heads=2)
            q_ranges, k_start, k_len = [(3, 30), (35, 5)], 4, 33
            want = expected(cfg, q_ranges, k_start, k_len)
            got = planned(cfg, [(base + a, n) for a, n in q_ranges], base + k_start, k_len)
            assert got == want and got, (base, causal)
            count += 1
    return count


def test_ranges_far_from_zero_match_the_oracle_in_a_subprocess() -> None:
    """far_cases() in a subprocess with a timeout: a walk that never ends
    fails this test, not the run."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    script = "from test_exchange_rows import far_cases; print('ok', far_cases())"
    proc = subprocess.run(  # tests/ on the child's path: its helpers
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        env=with_path(tests),
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.split() == ["ok", "30"], proc.stdout


BOUNDS_SCRIPT = """
import torch
import ring_attention  # noqa: F401
E = torch.ops.ring_attention.exchange_rows
P = ([8], [2], False, False, False, None)
for q_starts, q_lens, k_start, k_len, heads, kv_heads, match in {cases!r}:
    try:
        E(q_starts, q_lens, k_start, k_len, heads, kv_heads, *P)
    except RuntimeError as e:
        assert match in str(e), (match, str(e))
    else:
        raise AssertionError(f"no error for {{match}}")
print("ok")
"""

# (q_starts, q_lens, k_start, k_len, heads, kv_heads, what the message says)
BOUNDS = [
    ([0], [8], 0, 2**62, 4, 4, "k_start + k_len < 2**62"),  # k_len * kv_heads overflowed
    ([0], [8], 0, 2**61, 8, 8, "k_len * kv_heads must fit in int64"),
    ([0], [8], 2**62, 8, 4, 4, "k_start = 4611686018427387904"),
    ([0], [8], -1, 8, 4, 4, "k_start = -1"),
    ([2**63 - 10], [8], 0, 8, 4, 4, "q_starts[0] + q_lens[0] < 2**62"),  # q_hi overflowed
    ([0, 4], [8, 2**62 - 3], 0, 8, 4, 4, "q_starts[1] + q_lens[1]"),
    ([0], [-1], 0, 8, 4, 4, "q_lens[0] = -1"),
    ([0], [8, 8], 0, 8, 4, 4, "q_starts and q_lens must have the same length"),
    ([0], [8], 0, 8, 2**62, 2, "heads must be in [1, 2**62)"),
    ([0], [8], 0, 8, 0, 1, "heads must be in [1, 2**62)"),
]


def test_bounds_raise_naming_the_argument_in_a_subprocess() -> None:
    """Ranges past 2**62, or a k_len * kv_heads beyond int64 (a segfault
    before, and overflowing starts silently gave 0 rows): a RuntimeError that
    names the argument. In a subprocess, so a crash fails this test only."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", BOUNDS_SCRIPT.format(cases=BOUNDS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.split() == ["ok"], proc.stdout


def test_many_heads_cost_what_they_reach() -> None:
    """Heads enter by offset, never one by one: 2**40 query heads on 2**40
    K/V heads whose offsets (h, the dilation being clamped above them) reach
    rows 0..7 only answer at once with those 8 rows."""
    h = 2**40
    got = OPS.exchange_rows([0], [8], 0, 8, h, h, [2**62], [2**62], False, False, False, None)
    assert got.tolist() == [u * h + u for u in range(8)]
