"""Head-parallel (Ulysses) and ring x Ulysses hybrid attention across real
processes (gloo), docs/design.md §2.

Each world size (4, 5, 6, 8) is launched once
(``ring_attention.parallel.testing.run_distributed``) and runs its cases: grids of
``R`` rings x ``U`` Ulysses ranks (2 to 8 ranks) built from groups or from a
``DeviceMesh``, several disjoint grids side by side where ``copies > 1``
(like data-parallel replicas; this is how grids of 2 and 3 ranks run in the
launch of 6). On every rank the whole
sequence is recomputed from the same seed, and the rank checks its shard
``i * U + j`` of the output, ``lse`` and the q/k/v gradients (a loss that
uses ``lse`` too) against the float64 oracle (``tests/oracle.py``), plus
``shard_sequence``/``gather_sequence`` with the same arguments. Global
lengths divide nothing; head counts that do not divide ``U`` (6 over 4, 3
over 4: a rank with no head), K/V heads 1 and 2 under ``U = 4``; documents
spanning ranks; causal and not; both layouts.

A second launch checks ranks that disagree: every rank raises
``ValueError``, none hangs. Single-process tests cover the one engine's
head range (ring_attention/local/engine.py) and the folded layout.
"""

from __future__ import annotations

import pytest
import torch
from oracle import reference_attention

import ring_attention as ra
from ring_attention.core.call import Call
from ring_attention.core.layout import layout_pieces, layout_shard_lengths, shard_bounds
from ring_attention.core.pattern import Pattern
from ring_attention.local import engine
from ring_attention.parallel.testing import run_distributed
from ring_attention.parallel.ulysses import kv_head_range

LONGNET = ([8, 16, 32], [1, 2, 4])
F64 = torch.float64

# name -> configuration; ``pattern=None``: dense.
CASES: dict[str, dict] = {
    # world 6 as three grids of 2 ranks side by side
    "u2_dense_causal": dict(
        world=6, copies=3, R=1, U=2, heads=4, kv=4, n=37, pattern=None, causal=True
    ),
    "u2_longnet_gqa_documents_lse": dict(
        world=6, copies=3, R=1, U=2, heads=6, kv=2, n=41, causal=True, docs=[0, 3, 30, 41], lse=True
    ),
    "r2u1_mesh2d": dict(world=6, copies=3, R=2, U=1, heads=4, kv=2, n=37, causal=True, via="mesh"),
    "mesh1d_ring": dict(
        world=6, copies=3, R=2, U=1, heads=3, kv=3, n=29, causal=False, via="mesh1d"
    ),
    # world 6 as two grids of 3 ranks
    "u3_heads5_mqa_documents": dict(
        world=6, copies=2, R=1, U=3, heads=5, kv=1, n=40, causal=False, docs=[0, 17, 17, 40]
    ),
    "u3_zigzag_lse": dict(
        world=6,
        copies=2,
        R=1,
        U=3,
        heads=6,
        kv=3,
        n=43,
        causal=True,
        layout="zigzag",
        lse=True,
        docs=[0, 21, 43],
    ),
    # world 4
    "u4_heads6_kv2_lse": dict(
        world=4, R=1, U=4, heads=6, kv=2, n=45, causal=True, docs=[0, 11, 44, 45], lse=True
    ),
    "u4_heads6_kv1": dict(world=4, R=1, U=4, heads=6, kv=1, n=37, causal=False),
    "u4_heads3_idle_rank": dict(world=4, R=1, U=4, heads=3, kv=3, n=30, causal=True),
    "r2u2_gqa_documents_lse": dict(
        world=4, R=2, U=2, heads=6, kv=2, n=47, causal=True, docs=[0, 5, 29, 47], lse=True
    ),
    "r2u2_zigzag_mesh": dict(
        world=4, R=2, U=2, heads=4, kv=4, n=38, causal=True, layout="zigzag", via="mesh"
    ),
    "r2u2_head_groups_grouped_offsets": dict(
        world=4,
        R=2,
        U=2,
        heads=6,
        kv=3,
        n=45,
        causal=True,
        head_groups=True,
        head_offsets="grouped",
    ),
    "r4u1_mesh1d_dense": dict(world=4, R=4, U=1, heads=2, kv=1, n=23, pattern=None, via="mesh1d"),
    "two_grids_u2": dict(world=4, R=1, U=2, copies=2, heads=5, kv=5, n=33, causal=True),
    # world 5
    "u5_heads6_kv2": dict(world=5, R=1, U=5, heads=6, kv=2, n=41, causal=True, docs=[0, 9, 41]),
    "u5_float32_zigzag": dict(
        world=5, R=1, U=5, heads=5, kv=5, n=39, causal=False, layout="zigzag", dtype=torch.float32
    ),
    # world 6
    "r2u3_mqa_zigzag_lse": dict(
        world=6,
        R=2,
        U=3,
        heads=6,
        kv=1,
        n=53,
        causal=True,
        layout="zigzag",
        docs=[0, 26, 53],
        lse=True,
    ),
    "r3u2_dense_documents": dict(
        world=6, R=3, U=2, heads=5, kv=5, n=44, pattern=None, causal=False, docs=[0, 7, 30, 44]
    ),
    "r2u3_bfloat16_mesh": dict(
        world=6, R=2, U=3, heads=6, kv=3, n=50, causal=True, dtype=torch.bfloat16, via="mesh"
    ),
    # world 8: U = 4 with R = 2
    "r2u4_heads6_kv2_lse": dict(
        world=8, R=2, U=4, heads=6, kv=2, n=57, causal=True, docs=[0, 13, 50, 57], lse=True
    ),
    "r2u4_heads6_kv1_zigzag_mesh": dict(
        world=8, R=2, U=4, heads=6, kv=1, n=49, causal=True, layout="zigzag", via="mesh"
    ),
    # sliding windows (with the pattern, with documents, both sides)
    "u2_window_documents_lse": dict(
        world=6,
        copies=3,
        R=1,
        U=2,
        heads=6,
        kv=2,
        n=41,
        causal=True,
        docs=[0, 3, 30, 41],
        window=(5, 0),
        lse=True,
    ),
    "u3_dense_window_both_sides": dict(
        world=6, copies=2, R=1, U=3, heads=5, kv=5, n=40, pattern=None, window=(4, 3)
    ),
    "r2u2_window_zigzag": dict(
        world=4, R=2, U=2, heads=6, kv=3, n=47, causal=True, layout="zigzag", window=(9, 0)
    ),
}

TOL = {F64: 1e-10, torch.float32: 3e-5, torch.bfloat16: 3e-2}


def _config(name: str) -> dict:
    c = dict(
        pattern=LONGNET, causal=False, docs=None, layout="contiguous", lse=False, via="groups",
        dtype=F64, head_groups=False, head_offsets="modulo", copies=1, batch=2, head_dim=4,
        window=None,
    )  # fmt: skip
    c.update(CASES[name])
    if c["pattern"] is None:
        c["pattern"] = ([c["n"]], [1])
    return c


def _expected_shard(x: torch.Tensor, shards: int, index: int, layout: str, dim: int = 1):
    """Piece ``index`` of ``shards`` as docs/design.md §2 defines it, from
    ``torch.tensor_split`` directly."""
    if layout == "contiguous":
        return torch.tensor_split(x, shards, dim)[index]
    chunks = torch.tensor_split(x, 2 * shards, dim)
    return torch.cat([chunks[index], chunks[2 * shards - 1 - index]], dim)


def _maxerr(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    if not torch.equal(torch.isinf(a), torch.isinf(b)):
        return float("inf")
    keep = torch.isfinite(b)
    return (a[keep] - b[keep]).abs().max().item() if keep.any() else 0.0


# ---------------------------------------------------------------------------
# Workers.

_GRIDS: dict = {}


def _grid(world: int, R: int, U: int, copies: int, via: str, rank: int) -> dict:
    """This rank's call arguments for ``copies`` disjoint R x U grids (built
    once per worker; every rank builds every group, in the same order)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    key = (R, U, copies, via)
    if key not in _GRIDS:
        RU = R * U
        copy, local = divmod(rank, RU)
        i, j = divmod(local, U)
        kw: dict = {}
        if via == "groups":
            rows = [[c * RU + i2 * U + j2 for j2 in range(U)] for c in range(copies)
                    for i2 in range(R)]  # fmt: skip
            cols = [[c * RU + i2 * U + j2 for i2 in range(R)] for c in range(copies)
                    for j2 in range(U)]  # fmt: skip
            row_groups = {tuple(r): dist.new_group(r) for r in rows}
            col_groups = {tuple(c): dist.new_group(c) for c in cols}
            my_row = tuple(copy * RU + i * U + j2 for j2 in range(U))
            my_col = tuple(copy * RU + i2 * U + j for i2 in range(R))
            kw = dict(ulysses_group=row_groups[my_row], group=col_groups[my_col] if R > 1 else None)
        elif via == "mesh":
            m = init_device_mesh("cpu", (copies, R, U), mesh_dim_names=("dp", "ring", "ulysses"))
            kw = dict(mesh=m["ring", "ulysses"])
        else:  # a 1-D mesh: a ring
            assert U == 1
            m = init_device_mesh("cpu", (copies, R), mesh_dim_names=("dp", "ring"))
            kw = dict(mesh=m["ring"])
        _GRIDS[key] = (kw, R * U, i * U + j)
    return _GRIDS[key]


def _inputs(c: dict, seed: int):
    g = torch.Generator().manual_seed(seed)
    B, n, H, Hkv, D = c["batch"], c["n"], c["heads"], c["kv"], c["head_dim"]
    q, go = (torch.randn(B, n, H, D, generator=g, dtype=F64) for _ in range(2))
    k, v = (torch.randn(B, n, Hkv, D, generator=g, dtype=F64) for _ in range(2))
    glse = torch.randn(B, H, n, generator=g, dtype=F64)
    return tuple(t.to(c["dtype"]) for t in (q, k, v, go)) + (glse,)


def _loss(out, lse, go, glse, use_lse):
    value = (out.double() * go.double()).sum()
    if use_lse:
        value = value + (torch.where(torch.isinf(lse), 0, lse).double() * glse).sum()
    return value


def _run_case(rank: int, world: int, name: str) -> dict:
    c = _config(name)
    kw, W, index = _grid(world, c["R"], c["U"], c["copies"], c["via"], rank)
    segs, dils = c["pattern"]
    pat = dict(causal=c["causal"], head_groups=c["head_groups"], window=c["window"])
    q, k, v, go, glse = _inputs(c, seed=sum(map(ord, name)))
    layout = c["layout"]

    q64, k64, v64 = (t.to(F64, copy=True).requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference_attention(
        q64, k64, v64, segs, dils, **pat, cu_seqlens=c["docs"],
        grouped_offsets=c["head_offsets"] == "grouped",
    )  # fmt: skip
    _loss(ref, ref_lse, go, glse, c["lse"]).backward()

    def mine(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return _expected_shard(t, W, index, layout, dim)

    res: dict = {}
    shards = [ra.shard_sequence(t, 1, layout=layout, **kw) for t in (q, k, v)]
    res["shard_ok"] = all(torch.equal(s, mine(t)) for s, t in zip(shards, (q, k, v), strict=True))
    ql, kl, vl = (s.detach().clone().requires_grad_() for s in shards)
    out, lse = ra.ring_dilated_attention(
        ql, kl, vl, segs, dils, **pat, cu_seqlens=c["docs"], head_offsets=c["head_offsets"],
        layout=layout, return_lse=True, **kw,
    )  # fmt: skip
    _loss(out, lse, mine(go), mine(glse, 2), c["lse"]).backward()
    res["shape_ok"] = out.shape == ql.shape and out.dtype == ql.dtype and lse.shape == (
        c["batch"], c["heads"], ql.shape[1]
    )  # fmt: skip
    res["out"] = _maxerr(out, mine(ref.detach()))
    res["lse"] = _maxerr(lse, mine(ref_lse.detach(), 2))
    for g, mine_t, ref_t in (("dq", ql, q64), ("dk", kl, k64), ("dv", vl, v64)):
        res[g] = _maxerr(mine_t.grad, mine(ref_t.grad))
    res["gathered"] = _maxerr(
        ra.gather_sequence(out.detach(), 1, layout=layout, **kw), ref.detach()
    )
    # gather_sequence's gradient: this rank's slice of the full one
    x = out.detach().double().requires_grad_()
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    (ra.gather_sequence(x, 1, layout=layout, **kw) * w).sum().backward()
    res["gather_grad_ok"] = torch.equal(x.grad, mine(w))
    res["scale"] = max(
        1.0, *(t.abs().max().item() for t in (ref, q64.grad, k64.grad, v64.grad))
    )  # fmt: skip
    return res


def _modules(rank: int, world: int) -> dict:
    """The modules take the same arguments and give the function's result
    (world 4, a 2 x 2 grid)."""
    kw, _, _ = _grid(world, 2, 2, 1, "groups", rank)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 37, 4, 8, generator=g) for _ in range(3))
    ql, kl, vl = (ra.shard_sequence(t, 1, **kw) for t in (q, k, v))
    mod = ra.RingDilatedAttention([8, 16], [1, 2], causal=True, **kw)
    fn = ra.ring_dilated_attention(ql, kl, vl, [8, 16], [1, 2], causal=True, **kw)
    res = {"ring_module": torch.equal(mod(ql, kl, vl), fn)}
    # MultiheadDilatedAttention sharded over the grid == the whole sequence on one process
    torch.manual_seed(5)
    full = ra.MultiheadDilatedAttention(
        16, 4, batch_first=True, segment_lengths=[8, 16], dilation_rates=[1, 2]
    ).double()
    sharded = ra.MultiheadDilatedAttention(
        16, 4, batch_first=True, segment_lengths=[8, 16], dilation_rates=[1, 2], **kw
    ).double()
    sharded.load_state_dict(full.state_dict())
    x = torch.randn(2, 37, 16, generator=g, dtype=F64)
    want, _ = full(x, x, x, need_weights=False)
    xl = ra.shard_sequence(x, 1, **kw)
    got, _ = sharded(xl, xl, xl, need_weights=False)
    res["mha"] = _maxerr(got, ra.shard_sequence(want, 1, **kw))
    return res


def _suite(rank: int, world: int, names: list[str]) -> dict:
    out = {name: _run_case(rank, world, name) for name in names}
    if world == 4:
        out["_modules"] = _modules(rank, world)
        out["_errors"] = _errors(rank, world)
    return out


_RESULTS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        names = [n for n in CASES if CASES[n]["world"] == world]
        _RESULTS[world] = run_distributed(_suite, world, names, timeout=240)
    return _RESULTS[world]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_oracle(name: str) -> None:
    c = _config(name)
    tol = TOL[c["dtype"]]
    for rank, r in enumerate(_results(c["world"])):
        res = r[name]
        where = f"{name} rank={rank}"
        assert res["shard_ok"] and res["shape_ok"] and res["gather_grad_ok"], where
        for what in ("out", "lse", "dq", "dk", "dv", "gathered"):
            assert res[what] <= tol * res["scale"], f"{where}: {what} error {res[what]:.3g}"


def test_modules_take_the_same_arguments() -> None:
    for rank, r in enumerate(_results(4)):
        assert r["_modules"]["ring_module"], rank
        assert r["_modules"]["mha"] <= 1e-10, (rank, r["_modules"]["mha"])


# ---------------------------------------------------------------------------
# Ranks that disagree: ValueError on every rank, never a hang.


def _attempt(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return f"ValueError: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _errors(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    kw, _, _ = _grid(world, 2, 2, 1, "groups", rank)
    n = 37
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, 4, 4, generator=g, dtype=F64) for _ in range(3))
    ql, kl, vl = (ra.shard_sequence(t, 1, **kw) for t in (q, k, v))
    segs, dils = [8, 16], [1, 2]

    def attend(a=ql, b=kl, c=vl, s=segs, d=dils, **extra):
        return ra.ring_dilated_attention(a, b, c, s, d, causal=True, **{**kw, **extra})

    res = {}
    # local lengths that do not follow shard i * U + j (ranks 0 and 3 swap lengths)
    bad = torch.randn(1, {0: 9, 3: 10}.get(rank, ql.shape[1]), 4, 4, dtype=F64)
    res["lengths"] = _attempt(lambda: attend(bad, bad, bad))
    res["dtype"] = _attempt(lambda: attend(*(t.float() for t in (ql, kl, vl))) if rank == 1
                            else attend())  # fmt: skip
    res["pattern"] = _attempt(lambda: attend(s=[8, 12]) if rank == 2 else attend())
    res["window"] = _attempt(lambda: attend(window=(3, 0)) if rank == 1 else attend())
    res["bad_input"] = _attempt(lambda: attend(b=kl[:, :, :3], c=vl[:, :, :3]) if rank == 0
                                else attend())  # fmt: skip
    res["grad"] = _attempt(lambda: attend(ql.clone().requires_grad_()) if rank == 3 else attend())
    res["out_of_step"] = _attempt(
        lambda: ra.gather_sequence(ql, 1, **kw) if rank == 0 else attend()
    )
    res["mesh_and_group"] = _attempt(
        lambda: attend(mesh=DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("ring", "ulysses")))
    )
    # groups that do not form one grid: rank 0 swaps its ring and Ulysses groups
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    i, j = divmod(rank, 2)
    grid = dict(group=cols[j], ulysses_group=rows[i])
    if rank == 0:
        grid = dict(group=rows[0], ulysses_group=cols[0])
    res["swapped_groups"] = _attempt(
        lambda: ra.ring_dilated_attention(ql, kl, vl, segs, dils, **grid)
    )
    # a mesh that is not the same on every rank (each built by every rank)
    a = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("ring", "ulysses"))
    b = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("ring", "ulysses"))
    res["mesh_differs"] = _attempt(
        lambda: ra.ring_dilated_attention(ql, kl, vl, segs, dils, mesh=b if rank == 0 else a)
    )
    # the failed check leaves nothing behind: mesh a, now on every rank, works
    # (it failed on ranks 1-3 a moment ago, and rank 0 has never checked it)
    res["mesh_again"] = _maxerr(
        ra.ring_dilated_attention(*(ra.shard_sequence(t, 1, mesh=a) for t in (q, k, v)), segs,
                                  dils, causal=True, mesh=a),
        ra.shard_sequence(ra.dilated_attention(q, k, v, segs, dils, causal=True), 1, mesh=a),
    )  # fmt: skip
    c1 = DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=("sp",))  # a mesh not used before
    c2 = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("ring", "ulysses"))
    res["mesh_1d_vs_2d"] = _attempt(
        lambda: ra.ring_dilated_attention(ql, kl, vl, segs, dils, mesh=c1 if rank == 0 else c2)
    )
    res["mesh_names"] = _attempt(
        lambda: attend(
            group=None, ulysses_group=None,
            mesh=DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("sp", "tp")),
        )
    )  # fmt: skip
    # still usable afterwards
    res["after"] = _maxerr(attend(), ra.shard_sequence(
        ra.dilated_attention(q, k, v, segs, dils, causal=True), 1, **kw))  # fmt: skip
    return res


ERRORS = {
    "lengths": "local sequence lengths",
    "dtype": "",
    "pattern": "",
    "window": "",
    "bad_input": "",
    "grad": "",
    "out_of_step": "",
    "mesh_and_group": "mesh replaces group and ulysses_group",
    "swapped_groups": "do not form one ring x Ulysses grid",
    "mesh_differs": "do not form one ring x Ulysses grid",
    "mesh_1d_vs_2d": "do not form one ring x Ulysses grid",
    "mesh_names": "mesh_dim_names",
}


def test_ranks_that_disagree_raise_value_error_on_every_rank() -> None:
    results = [r["_errors"] for r in _results(4)]
    for name, words in ERRORS.items():
        for rank, r in enumerate(results):
            assert r[name].startswith("ValueError"), f"{name} rank={rank}: {r[name]}"
            assert words in r[name], f"{name} rank={rank}: {r[name]}"
    # the rank with the bad value names it; the others say who rejected
    assert "dtype" in results[0]["dtype"] and "dtype" in results[1]["dtype"]
    assert "pattern" in results[2]["pattern"] and "pattern" in results[3]["pattern"]
    windows = [r["window"] for r in results]  # the window is part of the pattern
    assert all("pattern" in windows[r] for r in (0, 1)), windows  # rank 1's Ulysses group
    # passed on along the ring by rank 0 and rank 1 (which found it)
    assert all(f"rank {r - 2} failed" in windows[r] and "pattern" in windows[r] for r in (2, 3))
    assert "kv_heads" in results[0]["bad_input"]
    assert all("rank 0 failed: kv_heads" in results[r]["bad_input"] for r in (1, 2, 3))
    assert "gradient" in results[3]["grad"]
    assert all("out of step" in results[r]["out_of_step"] for r in (0, 1, 2))
    for r in results:
        assert r["after"] <= 1e-10 and r["mesh_again"] <= 1e-10


# ---------------------------------------------------------------------------
# One process.


@pytest.mark.parametrize(
    "heads,kv,start,count,pattern,kw",
    [
        (6, 2, 2, 2, LONGNET, dict(causal=True)),
        (6, 3, 1, 3, LONGNET, dict(causal=False, cu_seqlens=[0, 7, 30, 37])),
        (6, 1, 5, 1, ([4, 16], [2, 4]), dict(causal=True)),
        (8, 2, 3, 3, LONGNET, dict(causal=True, head_groups=True)),
        (6, 6, 2, 3, LONGNET, dict(causal=True, head_offsets="grouped", cu_seqlens=[0, 20, 37])),
        (5, 5, 0, 5, ([37], [1]), dict(causal=True)),  # the whole tensor: one call
        (4, 2, 0, 2, ([8, 16], [1, 2]), dict(causal=False)),  # fits as it is
        (6, 2, 4, 2, ([8, 16, 32], [1, 2, 4]), dict(causal=True, head_groups=True)),
    ],
)
def test_head_range_matches_the_whole_tensor(heads, kv, start, count, pattern, kw) -> None:
    """The engine's head range: heads [start, start + count) of the whole
    op, forward and backward (out and lse), float64."""
    g = torch.Generator().manual_seed(heads * 100 + start)
    n = 37
    q = torch.randn(2, n, heads, 4, generator=g, dtype=F64, requires_grad=True)
    k, v = (torch.randn(2, n, kv, 4, generator=g, dtype=F64, requires_grad=True) for _ in range(2))
    go = torch.randn(2, n, count, 4, generator=g, dtype=F64)
    gl = torch.randn(2, count, n, generator=g, dtype=F64)
    full, full_lse = ra.dilated_attention(q, k, v, *pattern, return_lse=True, **kw)
    ref = full[:, :, start : start + count]
    ref_lse = full_lse[:, start : start + count]
    (ref * go).sum().add((torch.where(torch.isinf(ref_lse), 0, ref_lse) * gl).sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    a, b = kv_head_range(start, count, heads, kv)
    pat = Pattern(
        *pattern, causal=kw.get("causal", False), head_groups=kw.get("head_groups", False),
        head_offsets=kw.get("head_offsets", "modulo"),
    ).with_documents(kw.get("cu_seqlens"))  # fmt: skip
    out, lse = engine.attend(
        Call(pat, 4**-0.5).with_heads(start, heads, kv), q[:, :, start : start + count],
        k[:, :, a:b], v[:, :, a:b],
    )  # fmt: skip
    (out * go).sum().add((torch.where(torch.isinf(lse), 0, lse) * gl).sum()).backward()
    assert _maxerr(out, ref) <= 1e-12
    assert _maxerr(lse, ref_lse) <= 1e-12
    for mine, want in zip((q.grad, k.grad, v.grad), grads, strict=True):
        assert _maxerr(mine, want) <= 1e-12


def test_head_range_gradcheck() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 7, 3, 2, generator=g, dtype=F64, requires_grad=True)
    k, v = (torch.randn(1, 7, 1, 2, generator=g, dtype=F64, requires_grad=True) for _ in range(2))
    pat = Pattern([4, 8], [2, 4], causal=True)

    def fn(a, b, c):
        out, lse = engine.attend(Call(pat, 0.7).with_heads(3, 6, 2), a, b, c)
        return out, lse.masked_fill(torch.isinf(lse), 0)  # rows that reach nothing

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("n,R,U", [(8, 3, 2), (37, 2, 3), (5, 2, 4), (0, 2, 2), (101, 3, 4)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_folded_layout_is_the_groups_stretch(n: int, R: int, U: int, layout: str) -> None:
    """Ring rank i of a hybrid holds exactly the shards i*U .. i*U+U-1."""
    x = torch.arange(n)
    for i in range(R):
        got = torch.cat([x[p.start : p.start + p.length] for p in
                         layout_pieces(n, R, i, layout, fold=U)])  # fmt: skip
        want = torch.cat([_expected_shard(x, R * U, i * U + j, layout, 0) for j in range(U)])
        assert torch.equal(got, want.sort().values)
    assert sum(layout_shard_lengths(n, R, layout, U)) == n
    if (n, R, U) == (8, 3, 2):
        assert layout_shard_lengths(n, R, layout, U) != [len(t) for t in torch.tensor_split(x, R)]


def test_heads_split_like_tensor_split() -> None:
    assert shard_bounds(6, 4) == [(0, 2), (2, 2), (4, 1), (5, 1)]
    assert [kv_head_range(s, c, 6, 2) for s, c in shard_bounds(6, 4)] == [
        (0, 1), (0, 2), (1, 2), (1, 2)
    ]  # fmt: skip
    assert kv_head_range(3, 0, 6, 2) == (0, 0)


def test_arguments_checked_before_anything_runs() -> None:
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="mesh replaces group and ulysses_group"):
        ra.ring_dilated_attention(q, q, q, [4], [1], mesh=object(), ulysses_group=object())
    with pytest.raises(ValueError, match="DeviceMesh"):
        ra.ring_dilated_attention(q, q, q, [4], [1], mesh=object())
    with pytest.raises(ValueError, match=r"ulysses_group must be a torch\.distributed"):
        ra.ring_dilated_attention(q, q, q, [4], [1], ulysses_group="world")
    with pytest.raises(ValueError, match=r"group must be a torch\.distributed"):
        ra.shard_sequence(q, 1, group=3, ulysses_group="world")


def _released(rank: int, world: int) -> dict:
    import gc
    import weakref

    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    q, k, v = (torch.randn(1, 9, 2, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
               for _ in range(3))  # fmt: skip
    out = ra.ring_dilated_attention(
        *(ra.shard_sequence(t, 1, ulysses_group=group) for t in (q, k, v)), [4], [1],
        ulysses_group=group,
    )  # fmt: skip
    want = ra.shard_sequence(ra.dilated_attention(q, k, v, [4], [1]), 1, ulysses_group=group)
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return {"err": _maxerr(out, want), "released": alive() is None}


def test_grid_check_does_not_keep_groups_alive() -> None:
    """The grid's once-per-configuration check holds its groups weakly:
    destroy_process_group releases them (a gloo group living into the
    interpreter's shutdown can abort the process there)."""
    for r in run_distributed(_released, 2, timeout=300):
        assert r["err"] <= 1e-10 and r["released"], r
