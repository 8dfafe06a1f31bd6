"""Argument fuzz across ranks (docs/design.md §6): one rank with a bad
argument, or in another call, in every mode (the ring, Ulysses, the ring x
Ulysses hybrid from groups and from a permuted ``DeviceMesh``, a 1-D mesh),
while the other ranks make a valid call. Every rank must raise within
seconds, never at the process group's timeout: the bad rank its own error
naming the argument, the others a ``ValueError`` (``"rank j failed: ..."``
where the bad rank's own checks failed). After each case every rank makes
the valid call again and must get the one-process answer: a failed check
leaves nothing behind (no stale error, no store keys out of step).

A second test draws random permutations of the ranks into 2-D meshes
(2 x 2, 3 x 2, 2 x 3, both dimension orders) and checks what the library
does against what ``DeviceMesh`` and ``DTensor`` say: ``shard_sequence``
hands rank ``(i, j)`` (its mesh coordinates) shard ``i * U + j``, where
DTensor's placement of ``Shard`` on both dimensions puts it (its
``compute_local_shape_and_global_offset``; in torch 2.13 ``distribute_tensor``
itself scatters by group rank, which disagrees with that for some
permutations);
``gather_sequence`` inverts it; the attention equals one process.
"""

from __future__ import annotations

import random
import re
import time

import pytest
import torch

import ring_attention as ra
from ring_attention.parallel.testing import run_distributed

F64 = torch.float64
N, HEADS, KV, D = 37, 4, 2, 4
SEGS, DILS = [8, 16], [1, 2]
PG_TIMEOUT = 30.0  # a hang shows as a raise after this long
PROMPT = 6.0  # seconds within which every rank must raise

MODES = ("ring", "ulysses", "hybrid", "mesh", "mesh1d")

#: bad value -> words one of which the bad rank's message must contain
BAD = {
    "segment_lengths": ["segment_lengths"],
    "cu_seqlens": ["cu_seqlens"],
    "window": ["window"],
    "k_local": ["kv_heads", "k"],
    "dtype": ["dtype"],
    "scale": ["scale"],
    "layout": ["layout"],
    "group": ["group", "mesh replaces"],
    "ulysses_group": ["ulysses_group", "Ulysses", "ring call"],
    "mesh": ["mesh"],
    "another_call": ["out of step", "another call", "ring call", "grid"],
}


def _mode_args(mode: str, rank: int, world: int, cache: dict) -> dict:
    """The valid grid arguments of ``mode`` (groups built once, by every rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not cache:
        cache["all"] = dist.new_group(list(range(world)))
        cache["rows"] = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cache["cols"] = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        cache["mesh"] = DeviceMesh("cpu", [[2, 3], [1, 0]], mesh_dim_names=("ring", "ulysses"))
        cache["mesh1d"] = DeviceMesh("cpu", [2, 0, 3, 1], mesh_dim_names=("sp",))
    i, j = divmod(rank, 2)
    return {
        "ring": dict(group=cache["all"]),
        "ulysses": dict(ulysses_group=cache["all"]),
        "hybrid": dict(group=cache["cols"][j], ulysses_group=cache["rows"][i]),
        "mesh": dict(mesh=cache["mesh"]),
        "mesh1d": dict(mesh=cache["mesh1d"]),
    }[mode]


def _bad_call(mode: str, bad: str, grid: dict, cache: dict, x: tuple) -> tuple[str, dict, tuple]:
    """(function, keyword arguments, tensors) of the bad rank's call, or
    ``("", {}, ())`` when ``bad`` does not apply to ``mode``."""
    q, k, v = x
    kw: dict = dict(grid)
    fn = "attention"
    if bad == "segment_lengths":
        kw["segment_lengths"] = [0, 16]
    elif bad == "cu_seqlens":
        kw["cu_seqlens"] = [0, 20, 10, N]
    elif bad == "window":
        kw["window"] = (-3, 0)
    elif bad == "k_local":
        k, v = k[:, :, :1].repeat(1, 1, 3, 1), v[:, :, :1].repeat(1, 1, 3, 1)
    elif bad == "dtype":
        q, k, v = (t.float() for t in (q, k, v))
    elif bad == "scale":
        kw["scale"] = float("nan")
    elif bad == "layout":
        kw["layout"] = "x"
    elif bad == "group":
        kw["group"] = cache["all"] if mode.startswith("mesh") else "x"
    elif bad == "ulysses_group":
        if mode == "ring":  # Ulysses on this rank, the ring on the others
            kw = dict(ulysses_group=cache["all"])
        else:
            kw["ulysses_group"] = "x"
    elif bad == "mesh":
        if not mode.startswith("mesh"):
            return "", {}, ()
        kw["mesh"] = "x"
    elif bad == "another_call":
        if mode == "ulysses":  # the ring over the same group
            kw = dict(group=cache["all"])
        else:  # gather_sequence over the same grid
            fn = "gather"
    return fn, kw, (q, k, v)


def _run(fn: str, kw: dict, q, k, v):
    if fn == "gather":
        return ra.gather_sequence(q, 1, **{a: b for a, b in kw.items() if a in
                                            ("group", "ulysses_group", "mesh")})  # fmt: skip
    kw = dict(kw)
    segs, dils = kw.pop("segment_lengths", SEGS), kw.pop("dilation_rates", DILS)
    return ra.ring_dilated_attention(q, k, v, segs, dils, causal=True, **kw)


def _one_rank_bad(rank: int, world: int, bad_ranks: list[int]) -> dict:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, N, HEADS, D, generator=g, dtype=F64)
    k, v = (torch.randn(1, N, KV, D, generator=g, dtype=F64) for _ in range(2))
    full = ra.dilated_attention(q, k, v, SEGS, DILS, causal=True)
    cache: dict = {}
    res: dict = {}
    # The ring and Ulysses over one group, both checked before (a rank that
    # switches to a configuration no rank has used is caught only by the
    # store's timeout: the others are already in the call's collectives)
    for warm in ("ring", "ulysses"):
        grid = _mode_args(warm, rank, world, cache)
        _run("attention", grid, *(ra.shard_sequence(t, 1, **grid) for t in (q, k, v)))
    for mode in MODES:
        grid = _mode_args(mode, rank, world, cache)
        local = tuple(ra.shard_sequence(t, 1, **grid) for t in (q, k, v))
        want = ra.shard_sequence(full, 1, **grid)
        res[(mode, "baseline")] = _err(_run("attention", grid, *local), want)
        for bad in BAD:
            for who in bad_ranks:
                fn, kw, x = _bad_call(mode, bad, grid, cache, local)
                if not fn:
                    continue
                if rank != who:
                    fn, kw, x = "attention", grid, local
                t0 = time.monotonic()
                try:
                    _run(fn, kw, *x)
                    outcome = ("no error", "")
                except (ValueError, RuntimeError) as exc:  # judged by the test
                    outcome = (ValueError.__name__ if isinstance(exc, ValueError)
                               else RuntimeError.__name__, str(exc))  # fmt: skip
                except Exception as exc:  # a failure of the test
                    outcome = (type(exc).__name__, str(exc))
                seconds = time.monotonic() - t0
                dist.barrier()  # the next call starts together
                after = _err(_run("attention", grid, *local), want)
                res[(mode, bad, who)] = (*outcome, seconds, after)
    return res


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _names(message: str, words: list[str]) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(w)}(?![A-Za-z0-9_])", message)
               for w in words)  # fmt: skip


def test_one_rank_bad_raises_on_every_rank_within_seconds() -> None:
    """4 ranks, the bad one rank 1 and rank 3 in turn, 5 modes x 11 bad
    values; the group's timeout is 30 s, every rank must raise within 6 s,
    then the valid call must still give the one-process answer."""
    bad_ranks = [1, 3]
    results = run_distributed(_one_rank_bad, 4, bad_ranks, timeout=600, pg_timeout=PG_TIMEOUT)
    problems = []
    cases = 0
    for key in results[0]:
        if key[1] == "baseline":
            for rank, r in enumerate(results):
                if r[key] > 1e-10:
                    problems.append(f"{key} rank {rank}: error {r[key]:.3g}")
            continue
        cases += 1
        mode, bad, who = key
        for rank, r in enumerate(results):
            kind, msg, seconds, after = r[key]
            where = f"{mode}/{bad} (bad rank {who}) rank {rank}: {kind}: {msg[:300]}"
            if kind not in ("ValueError", "RuntimeError") or seconds > PROMPT:
                problems.append(f"{where} after {seconds:.1f} s")
            elif rank == who and not _names(msg, BAD[bad]):
                problems.append(f"{where}: does not name the argument")
            elif (
                rank != who
                and bad not in ("dtype", "another_call")
                and not ("ulysses_group" == bad and mode == "ring")
                and f"rank {who} failed" not in msg
            ):
                problems.append(f"{where}: does not say which rank failed")
            if after > 1e-10:
                problems.append(f"{where}: the next valid call is off by {after:.3g}")
    slowest = max(r[k][2] for r in results for k in r if k[1] != "baseline")
    print(f"{cases} cases x 4 ranks, the slowest raise {slowest:.2f} s")
    assert cases >= 90, cases
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------
# Permuted meshes against DeviceMesh's and DTensor's coordinates.


def _layouts(world: int, seed: int) -> list[tuple[list[int], tuple[int, int], tuple[str, str]]]:
    """Random permutations of the ranks as (ranks, shape, dimension names)."""
    rnd = random.Random(seed)
    shapes = [(2, 2)] if world == 4 else [(3, 2), (2, 3)]
    out = []
    for shape in shapes:
        for names in (("ring", "ulysses"), ("ulysses", "ring")):
            for _ in range(2):
                perm = list(range(world))
                rnd.shuffle(perm)
                out.append((perm, shape, names))
    return out


def _meshes(rank: int, world: int, seed: int) -> list[dict]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    g = torch.Generator().manual_seed(seed)
    res = []
    for perm, shape, names in _layouts(world, seed):
        n = 12 * world  # divisible: DTensor's chunks are tensor_split's
        q = torch.randn(2, n, 6, D, generator=g, dtype=F64)
        k, v = (torch.randn(2, n, 2, D, generator=g, dtype=F64) for _ in range(2))
        mesh = DeviceMesh("cpu", torch.tensor(perm).view(shape), mesh_dim_names=names)
        coord = mesh.get_coordinate()
        i, j = coord[names.index("ring")], coord[names.index("ulysses")]
        U = shape[names.index("ulysses")]
        local = [ra.shard_sequence(t, 1, mesh=mesh) for t in (q, k, v)]
        want = torch.tensor_split(q, world, 1)[i * U + j]
        ok = {"shard": torch.equal(local[0], want), "dtensor": True}
        if names == ("ring", "ulysses"):  # DTensor splits along mesh dimension 0 first
            # where DTensor places this rank's shard (from its coordinates)
            shape_, offset = compute_local_shape_and_global_offset(
                q.shape, mesh, [Shard(1), Shard(1)]
            )
            ok["dtensor"] = torch.equal(local[0], q.narrow(1, offset[1], shape_[1]))
        full, full_lse = ra.dilated_attention(q, k, v, SEGS, DILS, causal=True, return_lse=True)
        try:
            out, lse = ra.ring_dilated_attention(
                *local, SEGS, DILS, causal=True, mesh=mesh, return_lse=True
            )
            ok["out"] = _err(out, torch.tensor_split(full, world, 1)[i * U + j])
            ok["lse"] = _err(lse, torch.tensor_split(full_lse, world, 2)[i * U + j])
            ok["gather"] = torch.equal(ra.gather_sequence(local[0], 1, mesh=mesh), q)
        except Exception as exc:  # reported by the test
            ok["raised"] = f"{type(exc).__name__}: {exc}"
        ring = mesh["ring"]  # a 1-D mesh: the ring of this rank's Ulysses index
        r_local = ra.shard_sequence(q, 1, mesh=ring)
        r_idx = ring.get_coordinate()[0]
        ok["ring_shard"] = torch.equal(r_local, torch.tensor_split(q, shape[names.index("ring")],
                                                                   1)[r_idx])  # fmt: skip
        res.append({"layout": (perm, shape, names), **ok})
    return res


@pytest.mark.parametrize("world", [4, 6])
def test_permuted_meshes_follow_device_mesh_coordinates(world: int) -> None:
    results = run_distributed(_meshes, world, 7 + world, timeout=300)
    problems = []
    for rank, rows in enumerate(results):
        for r in rows:
            where = f"rank {rank} mesh {r['layout']}"
            if "raised" in r:
                problems.append(f"{where}: {r['raised'][:300]}")
                continue
            for what in ("dtensor", "shard", "gather", "ring_shard"):
                if not r[what]:
                    problems.append(f"{where}: {what} differs")
            for what in ("out", "lse"):
                if r[what] > 1e-10:
                    problems.append(f"{where}: {what} off by {r[what]:.3g}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------
# A rank in another mode, in the first call of fresh groups.


def _other_mode(rank: int, world: int) -> dict:
    """Each case on new groups (no rank has checked them): the odd rank's
    call is the first call of its configuration, as is everyone else's."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, N, HEADS, D, generator=g, dtype=F64)
    k, v = (torch.randn(1, N, KV, D, generator=g, dtype=F64) for _ in range(2))
    full = ra.dilated_attention(q, k, v, SEGS, DILS, causal=True)
    _run("attention", {}, *(ra.shard_sequence(t, 1) for t in (q, k, v)))  # the first call's costs
    res = {}
    for case, odd in (("ulysses_vs_ring", 1), ("ring_vs_ulysses", 2), ("ring_vs_hybrid", 3),
                      ("gather_vs_hybrid", 0)):  # fmt: skip
        every = dist.new_group(list(range(world)))
        rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        i, j = divmod(rank, 2)
        hybrid = dict(group=cols[j], ulysses_group=rows[i])
        most, other, fn = {
            "ulysses_vs_ring": (dict(group=every), dict(ulysses_group=every), "attention"),
            "ring_vs_ulysses": (dict(ulysses_group=every), dict(group=every), "attention"),
            "ring_vs_hybrid": (hybrid, dict(group=every), "attention"),
            "gather_vs_hybrid": (hybrid, hybrid, "gather"),
        }[case]
        kw, call = (other, fn) if rank == odd else (most, "attention")
        local = tuple(ra.shard_sequence(t, 1, **kw) for t in (q, k, v))
        t0 = time.monotonic()
        try:
            _run(call, kw, *local)
            outcome = ("no error", "")
        except ValueError as exc:
            outcome = ("ValueError", str(exc))
        except Exception as exc:  # judged by the test
            outcome = (type(exc).__name__, str(exc))
        seconds = time.monotonic() - t0
        dist.barrier()
        local = tuple(ra.shard_sequence(t, 1, **most) for t in (q, k, v))
        after = _err(_run("attention", most, *local), ra.shard_sequence(full, 1, **most))
        res[case] = (*outcome, seconds, after)
    return res


def test_a_rank_in_another_mode_raises_on_every_rank_in_a_first_call() -> None:
    """Ulysses on one rank and the ring on the others (and the reverse, and
    the ring against the hybrid, gather_sequence against the attention), the
    first call of each configuration: ValueError on every rank within
    seconds, then the valid call works."""
    results = run_distributed(_other_mode, 4, timeout=300, pg_timeout=PG_TIMEOUT)
    problems = []
    for rank, r in enumerate(results):
        for case, (kind, msg, seconds, after) in r.items():
            where = f"{case} rank {rank}: {kind}: {msg[:300]} after {seconds:.1f} s"
            if kind != "ValueError" or seconds > PROMPT:
                problems.append(where)
            elif not any(w in msg for w in ("another call", "out of step", "failed")):
                problems.append(f"{where}: does not say a rank is in another call")
            if after > 1e-10:
                problems.append(f"{where}: the next valid call is off by {after:.3g}")
    assert not problems, "\n".join(problems)
