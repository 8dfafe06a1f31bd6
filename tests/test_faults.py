"""Faults in real gloo process groups (docs/design.md §6): a rank that dies in
the middle of the forward or of the backward, a rank that never enters, and a
rank that raises after the ranks agreed (the handshake) make every other rank
raise within the group's timeout, never hang, and leave a process group that
``destroy_process_group`` tears down. A normal run tears down cleanly too.

The faults are injected at the first point-to-point batch of a phase through
``register_exchange_hook``, so they happen after the handshake, with transfers
in flight. The group timeout is 10 s here; every bound asserted is that
timeout plus a margin for a loaded machine, never a speed.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import ring_attention as ra
from ring_attention.parallel.exchange import register_exchange_hook
from ring_attention.parallel.testing import run_distributed

PG_TIMEOUT = 10.0
BOUND = PG_TIMEOUT + 20.0  # raise within the group timeout, plus scheduling slack
N, SEGS, DILS = 96, [16, 32, 96], [1, 2, 4]


class InjectedFault(RuntimeError):
    pass


def _fault_hook(kind: str, phase: str):
    def hook(event) -> None:
        if not event.phase.startswith(phase):
            return
        if kind == "die":
            os._exit(3)  # no word to anybody, transfers in flight
        raise InjectedFault(f"injected after the handshake ({event.phase})")

    return hook


def _worker(rank: int, world: int, kind: str, phase: str) -> dict:
    """Rank 1 misbehaves (``kind``: die, raise, absent); the others run the
    ring forward and backward and report how they ended and how long it took."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, N, 4, 8, generator=g) for _ in range(3))
    ql, kl, vl = (ra.shard_sequence(t, 1).requires_grad_() for t in (q, k, v))
    if rank == 1 and kind == "absent":
        time.sleep(10 * BOUND)  # never enters; the harness stops it
    if rank == 1:
        register_exchange_hook(_fault_hook(kind, phase))
    t0 = time.monotonic()
    outcome = "returned"
    try:
        out = ra.ring_dilated_attention(ql, kl, vl, SEGS, DILS, causal=True)
        out.sum().backward()
    except Exception as exc:  # what a user would see
        outcome = f"{type(exc).__name__}: {str(exc)[:300]}"
    raised_after = time.monotonic() - t0
    t1 = time.monotonic()
    dist.destroy_process_group()
    return {
        "outcome": outcome,
        "seconds": raised_after,
        "destroy_seconds": time.monotonic() - t1,
        "initialized_after": dist.is_initialized(),
    }


CASES = [
    ("die", "forward"),  # killed mid-forward
    ("die", "backward"),  # killed mid-backward
    ("raise", "forward"),  # raises after the handshake, mid-forward
    ("raise", "backward"),  # ... mid-backward
    ("absent", ""),  # never enters
]


@pytest.mark.parametrize("kind,phase", CASES, ids=[f"{k}-{p or 'never'}" for k, p in CASES])
def test_a_faulty_rank_makes_every_other_rank_raise(kind: str, phase: str) -> None:
    # Three ranks: rank 0 holds the positions before the faulty rank's (the
    # role of a two-rank group's rank 0) and rank 2 those after them; both
    # must raise, so a group of two would check nothing more.
    world = 3
    dead = (1,) if kind in ("die", "absent") else ()
    results = run_distributed(
        _worker,
        world,
        kind,
        phase,
        timeout=BOUND + 60,
        pg_timeout=PG_TIMEOUT,
        expect_dead=dead,
    )
    for rank, res in enumerate(results):
        if rank in dead:
            assert res is None
            continue
        if rank == 1:  # raised itself
            assert "injected after the handshake" in res["outcome"], res
            continue
        print(f"{kind}-{phase or 'never'} world={world} rank={rank}: raised after "
              f"{res['seconds']:.2f} s, destroyed in {res['destroy_seconds']:.2f} s: "
              f"{res['outcome'][:100]!r}")  # fmt: skip
        assert res["outcome"] != "returned", f"rank {rank} finished without its peer: {res}"
        assert res["seconds"] < BOUND, (rank, res)
        assert res["destroy_seconds"] < BOUND and not res["initialized_after"], (rank, res)


def _clean_worker(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, N, 4, 8, generator=g)
    ql = ra.shard_sequence(q, 1).requires_grad_()
    out = ra.ring_dilated_attention(ql, ql, ql, SEGS, DILS, causal=True)
    out.sum().backward()
    t0 = time.monotonic()
    dist.destroy_process_group()
    return {"destroy_seconds": time.monotonic() - t0, "initialized": dist.is_initialized()}


def test_a_normal_run_tears_its_group_down() -> None:
    for res in run_distributed(_clean_worker, 3, pg_timeout=PG_TIMEOUT):
        assert not res["initialized"] and res["destroy_seconds"] < BOUND, res
