"""A process that used the library ends cleanly: ``destroy_process_group``
releases every group it made, so no gloo thread outlives it into the
interpreter's shutdown (where one releasing a finished collective's tensors
needs the GIL and aborts the process: "terminate called without an active
exception", SIGABRT).

PyTorch's ``torch.distributed.nn.functional`` holds the default group in its
functions' default arguments when it is first imported after
``init_process_group``, and the first call of any ``torch.library`` custom
operator (the ring's) imports it through ``torch._dynamo``.
``ring_attention.parallel.comm`` imports it with the package and drops a group it
holds. So after a ring, Ulysses or hybrid call and ``destroy_process_group``
no gloo thread is left: in the harness's real processes, which import
``ring_attention`` before they make the group, and in a script that imports
it after ``torch.distributed.nn`` pinned the group.

The abort itself is a race (here 1 run in 16 of examples/sequence_parallel.py
before the fix; 22 in 30 of a plain-torch program that imports
``torch.distributed.nn`` after ``init_process_group``), so a few runs would
not catch its return; the threads left behind are there every time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from child_env import with_path
from torch.distributed.device_mesh import init_device_mesh

import ring_attention as ra
from ring_attention.parallel.testing import run_distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
N, HEADS, SEGS, DILS = 96, 12, [16, 32, 96], [1, 2, 4]
# the harness's workers and this check read thread names from /proc
pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="thread names come from /proc (Linux)"
)


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (its TCP loop and workers)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if "gloo" in n)


def _env() -> dict[str, str]:
    env = dict(with_path(ROOT), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return env


def _sharding(mode: str, world: int) -> dict:
    if mode == "ring":
        return {}  # the default group
    if mode == "ulysses":
        return {"ulysses_group": dist.group.WORLD}
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("ring", "ulysses"))
    return {"mesh": mesh}


def _attend(mode: str, world: int) -> None:
    """A forward, backward and gather of ``mode``; its tensors die on return."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, N, HEADS, 8, generator=g) for _ in range(3))
    kw = _sharding(mode, world)
    ql, kl, vl = (ra.shard_sequence(t, 1, **kw).requires_grad_() for t in (q, k, v))
    out = ra.ring_dilated_attention(ql, kl, vl, SEGS, DILS, causal=True, **kw)
    out.sum().backward()
    ra.gather_sequence(out.detach(), 1, **kw)


def _teardown_worker(rank: int, world: int, mode: str) -> list[str]:
    """``mode``'s calls, then destroy_process_group: the gloo threads left."""
    _attend(mode, world)
    dist.destroy_process_group()
    return gloo_threads()


@pytest.mark.parametrize("mode,world", [("ring", 3), ("ulysses", 3), ("hybrid", 4)])
def test_destroy_process_group_leaves_no_gloo_thread(mode: str, world: int) -> None:
    for rank, threads in enumerate(run_distributed(_teardown_worker, world, mode)):
        assert threads == [], f"{mode}, rank {rank}: {threads} outlive destroy_process_group"


_LATE = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
import torch.distributed.nn.functional as functional  # holds the group in its defaults
pinned = functional.all_reduce.__defaults__[-1] is dist.group.WORLD
import ring_attention as ra
q = torch.randn(1, 64, 4, 8, requires_grad=True)
ra.ring_dilated_attention(q, q, q, [16, 64], [1, 2]).sum().backward()
dist.destroy_process_group()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(json.dumps([pinned, sorted(n for n in names if "gloo" in n)]))
"""


def test_importing_the_package_after_the_group_releases_a_pinned_default_group() -> None:
    with tempfile.TemporaryDirectory(prefix="ra_exit_") as tmp:
        res = subprocess.run(
            [sys.executable, "-c", _LATE, os.path.join(tmp, "store")],
            capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=240,
        )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    pinned, threads = json.loads(res.stdout.strip().splitlines()[-1])
    assert pinned, "torch.distributed.nn no longer pins the group: the case is gone"
    assert threads == [], f"{threads} outlive destroy_process_group"
