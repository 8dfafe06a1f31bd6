"""Control messages between ranks (ring_attention/parallel/handshake.py), in real gloo
processes: every message has one fixed size and names its call, so ranks in
different calls, or ranks whose calls disagree, or a rank whose own checks
fail, make every rank raise the library's own ValueError — never a transport
abort and never a hang (docs/design.md §6)."""

from __future__ import annotations

import functools

import pytest
import torch

import ring_attention as ra
from ring_attention.parallel.testing import run_distributed

WORLD = 3
E, HEADS = 16, 4


def _attempt(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # the test inspects the type and message
        return type(exc).__name__, str(exc)
    return "no error", ""


def _suite(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(2, 31, HEADS, 8)
    local = ra.shard_sequence(x, 1)
    res: dict[str, tuple[str, str]] = {}

    # A rank in gather_sequence while the others run the ring.
    if rank == 0:
        res["out_of_step"] = _attempt(lambda: ra.gather_sequence(local, 1))
    else:
        res["out_of_step"] = _attempt(
            lambda: ra.ring_dilated_attention(local, local, local, [8], [1])
        )

    # MultiheadDilatedAttention with a pattern on rank 0, dense elsewhere.
    kw = {"segment_lengths": [4, 8], "dilation_rates": [1, 2]} if rank == 0 else {}
    group = torch.distributed.group.WORLD
    mha = ra.MultiheadDilatedAttention(E, HEADS, batch_first=True, group=group, **kw)
    y = ra.shard_sequence(torch.randn(2, 29, E), 1)
    res["mha_pattern"] = _attempt(lambda: mha(y, y, y, need_weights=False))

    # need_weights=True on rank 1 only: the module's own check fails there.
    dense = ra.MultiheadDilatedAttention(E, HEADS, batch_first=True, group=group)
    res["mha_need_weights"] = _attempt(lambda: dense(y, y, y, need_weights=rank == 1))

    # head_dim 0 on rank 2 only.
    z = local[..., :0] if rank == 2 else local
    res["head_dim"] = _attempt(lambda: ra.ring_dilated_attention(z, z, z, [8], [1]))

    # cu_seqlens that differ between ranks.
    cu = [0, 10, 31] if rank else [0, 11, 31]
    res["documents"] = _attempt(
        lambda: ra.ring_dilated_attention(local, local, local, [8], [1], cu_seqlens=cu)
    )

    # A sliding window on rank 1 only (or one of another width).
    window = {0: None, 1: (4, 0), 2: (5, 0)}[rank]
    res["window"] = _attempt(
        lambda: ra.ring_dilated_attention(local, local, local, [8], [1], window=window)
    )

    # The group is still usable afterwards.
    out = ra.gather_sequence(ra.ring_dilated_attention(local, local, local, [8, 16], [1, 2]), 1)
    ref = ra.dilated_attention(x, x, x, [8, 16], [1, 2])
    res["after"] = ("ok", str((out - ref).abs().max().item()))
    return res


@functools.cache
def _results() -> list[dict]:
    """Each rank's results of the suite (run once per test process)."""
    return run_distributed(_suite, WORLD, timeout=300, pg_timeout=30)


def _value_errors(case: str) -> list[tuple[int, str]]:
    """(rank, message) for every rank, each having raised a ValueError in ``case``."""
    errors = []
    for rank, res in enumerate(_results()):
        kind, msg = res[case]
        assert kind == "ValueError", (rank, kind, msg)
        errors.append((rank, msg))
    return errors


def test_ranks_in_different_calls_are_out_of_step() -> None:
    for rank, msg in _value_errors("out_of_step"):
        assert "out of step" in msg and "gather_sequence" in msg, (rank, msg)


def test_modules_with_different_patterns_disagree_on_every_rank() -> None:
    for rank, msg in _value_errors("mha_pattern"):
        assert "pattern" in msg, (rank, msg)


@pytest.mark.parametrize("case,culprit,word", [("mha_need_weights", 1, "need_weights"),
                                                ("head_dim", 2, "head_dim")])  # fmt: skip
def test_a_rank_failing_its_own_checks_fails_every_rank(case, culprit, word) -> None:
    for rank, msg in _value_errors(case):
        if rank == culprit:
            assert word in msg, (rank, msg)
        else:
            # the culprit and its own error, on every other rank
            assert f"rank {culprit} failed: " in msg and word in msg, (rank, msg)


def test_documents_that_differ_between_ranks_raise_on_every_rank() -> None:
    for rank, msg in _value_errors("documents"):
        assert "pattern" in msg and "documents" in msg, (rank, msg)
        # the same number of documents: the boundaries that differ are shown
        assert "differ first at cu_seqlens[1]" in msg, (rank, msg)
        assert "rank 0: cu_seqlens[0:] = [0, 11, 31] (2 documents)" in msg, (rank, msg)
        assert "rank 1: cu_seqlens[0:] = [0, 10, 31] (2 documents)" in msg, (rank, msg)


def test_windows_that_differ_between_ranks_raise_on_every_rank() -> None:
    for rank, msg in _value_errors("window"):
        assert "window=(4,0)" in msg and "window=(5,0)" in msg, (rank, msg)


def test_the_group_is_usable_after_the_errors() -> None:
    for res in _results():
        assert float(res["after"][1]) < 1e-5
