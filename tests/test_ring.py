"""Ring dilated attention across real processes (gloo on CPU).

Each world size 1..5 is launched once (``ring_attention.parallel.testing.run_distributed``) and
runs every case of ``CASES`` plus the sharding checks; the parametrised tests
below read the cached results. On every rank the full-sequence reference is
recomputed from the same seed, so each rank checks its own shard of:

* the ring output and the q/k/v gradients against the single-process op
  ``ring_attention.dilated_attention`` (same dtype) and against the float64
  oracle (``tests/oracle.py``);
* ``gather_sequence`` of the ring output against the oracle.

Global lengths divide nothing (37, 101), and one case (n=4) leaves a rank of
a 5-rank ring with an empty shard.
"""

from __future__ import annotations

import pytest
import torch
from oracle import reference_attention

import ring_attention as ra
from ring_attention import RingDilatedAttention
from ring_attention.parallel.api import ring_dilated_attention
from ring_attention.parallel.exchange import last_exchange_stats
from ring_attention.parallel.exchange_plan import PLAN_CACHE
from ring_attention.parallel.sharding import (
    gather_sequence,
    layout_pieces,
    shard_bounds,
    shard_sequence,
)
from ring_attention.parallel.testing import run_distributed

LONGNET = ([8, 16, 32], [1, 2, 4])

# name -> configuration. ``segs=None`` means dense: [(n, 1)].
CASES: dict[str, dict] = {
    "longnet": dict(n=101, pattern=LONGNET, causal=False),
    "longnet_causal": dict(n=101, pattern=LONGNET, causal=True),
    "dense": dict(n=37, pattern=None, causal=False),
    "dense_causal": dict(n=37, pattern=None, causal=True),
    "local": dict(n=37, pattern=([4], [1]), causal=False),
    "local_dilated_causal": dict(n=101, pattern=([8], [2]), causal=True),
    "head_groups": dict(n=101, pattern=LONGNET, causal=True, head_groups=True, heads=5),
    "scale": dict(n=37, pattern=([6, 12], [1, 3]), causal=False, scale=0.3, batch=1),
    "float64": dict(n=37, pattern=LONGNET, causal=True, dtype=torch.float64),
    "bfloat16": dict(n=101, pattern=LONGNET, causal=True, dtype=torch.bfloat16),
    "zigzag_dense_causal": dict(n=37, pattern=None, causal=True, layout="zigzag"),
    "zigzag_longnet": dict(n=101, pattern=LONGNET, causal=True, layout="zigzag", heads=3),
    "zigzag_noncausal": dict(n=37, pattern=([8, 16], [1, 2]), causal=False, layout="zigzag"),
    "tiny": dict(n=4, pattern=([2, 4], [1, 2]), causal=True),
    # grouped K/V heads: K/V travel at K/V-head width
    "gqa": dict(n=101, pattern=LONGNET, causal=True, heads=4, kv_heads=2),
    "mqa": dict(n=37, pattern=([8, 16], [1, 2]), causal=False, heads=3, kv_heads=1),
    "gqa_head_groups": dict(
        n=101, pattern=LONGNET, causal=True, heads=6, kv_heads=2, head_groups=True
    ),
    # packed documents (global boundaries): empty, length-1, shorter than a
    # segment, spanning several ranks, boundaries shared with no shard
    "documents": dict(n=101, pattern=LONGNET, causal=True, cu_seqlens=[0, 0, 1, 6, 6, 58, 59, 101]),
    "documents_dense": dict(n=37, pattern=None, causal=True, cu_seqlens=[0, 13, 14, 30, 37]),
    "documents_zigzag": dict(
        n=101, pattern=LONGNET, causal=True, layout="zigzag", cu_seqlens=[0, 3, 40, 41, 90, 101]
    ),
    "documents_gqa_grouped": dict(
        n=101,
        pattern=LONGNET,
        causal=False,
        heads=4,
        kv_heads=2,
        head_offsets="grouped",
        cu_seqlens=[0, 20, 77, 101],
    ),
    # a loss that uses lse: its gradient enters the backward
    "lse": dict(n=101, pattern=LONGNET, causal=True, lse=True),
    "lse_documents_gqa": dict(
        n=37,
        pattern=([8, 16], [1, 2]),
        causal=False,
        heads=4,
        kv_heads=2,
        cu_seqlens=[0, 9, 37],
        lse=True,
    ),
    # pattern values far beyond the sequence (docs/design.md §6: they work)
    "huge_values": dict(n=37, pattern=([2**63 - 1, 8], [2**63 - 1, 2]), causal=True, heads=5),
    "huge_values_documents_gqa": dict(
        n=37,
        pattern=([10**18], [10**17]),
        causal=False,
        heads=4,
        kv_heads=2,
        head_offsets="grouped",
        cu_seqlens=[0, 5, 20, 37],
    ),
    # sliding windows (only the rows inside the band travel): smaller than,
    # equal to and larger than a shard (n = 101: shards of 20-51 rows) and the
    # segments; one-sided; with documents, grouped K/V heads and lse
    "window_dense_causal": dict(n=101, pattern=None, causal=True, window=(9, 0)),
    "window_dense_right": dict(n=101, pattern=None, causal=False, window=(-1, 25)),
    "window_longnet": dict(n=101, pattern=LONGNET, causal=False, window=(16, 16)),
    "window_large_zigzag": dict(
        n=101, pattern=([64, 8], [2, 1]), causal=True, window=(60, -1), layout="zigzag"
    ),
    "window_documents_gqa_lse": dict(
        n=101,
        pattern=([40, 101], [1, 2]),
        causal=True,
        heads=4,
        kv_heads=2,
        cu_seqlens=[0, 30, 31, 101],
        window=(21, 0),
        lse=True,
    ),
}

TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2e-2, 2e-2),
}

LSE_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2}

WORLD_SIZES = [1, 2, 3, 4, 5]


def _config(case: dict) -> dict:
    c = dict(
        batch=2, heads=4, kv_heads=None, head_dim=8, head_groups=False, scale=None,
        layout="contiguous", dtype=torch.float32, cu_seqlens=None, head_offsets="modulo",
        lse=False, window=None,
    )  # fmt: skip
    c.update(case)
    if c["kv_heads"] is None:
        c["kv_heads"] = c["heads"]
    if c["pattern"] is None:
        c["pattern"] = ([c["n"]], [1])
    return c


def _inputs(c: dict) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1234 + c["n"])
    shape = (c["batch"], c["n"], c["heads"], c["head_dim"])
    kv_shape = (c["batch"], c["n"], c["kv_heads"], c["head_dim"])
    q, go = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(kv_shape, generator=g, dtype=torch.float64) for _ in range(2))
    return tuple(t.to(c["dtype"]) for t in (q, k, v, go))


def _lse_weight(c: dict) -> torch.Tensor:
    """Weights of lse in the loss of the ``lse`` cases: (batch, heads, n)."""
    g = torch.Generator().manual_seed(99 + c["n"])
    return torch.randn(c["batch"], c["heads"], c["n"], generator=g, dtype=torch.float64)


def _maxerr(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def _maxerr_finite(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max error where ``b`` is finite; inf where ``a`` and ``b`` disagree on
    which entries are -inf (rows that reach nothing)."""
    if not torch.equal(torch.isinf(a), torch.isinf(b)):
        return float("inf")
    keep = torch.isfinite(b)
    return _maxerr(a[keep], b[keep]) if keep.any() else 0.0


def _maxabs(a: torch.Tensor) -> float:
    return a.double().abs().max().item() if a.numel() else 0.0


def _run_case(c: dict, group=None) -> dict:
    """One rank's checks for one case (runs inside a worker)."""
    segs, dils = c["pattern"]
    kw = dict(causal=c["causal"], scale=c["scale"], head_groups=c["head_groups"])
    feat = dict(cu_seqlens=c["cu_seqlens"], head_offsets=c["head_offsets"], window=c["window"])
    layout = c["layout"]
    q, k, v, go = _inputs(c)
    glse = _lse_weight(c) if c["lse"] else None

    def loss(out: torch.Tensor, lse: torch.Tensor, go: torch.Tensor, glse) -> torch.Tensor:
        value = (out.double() * go.double()).sum()
        if glse is not None:  # a finite weight of every reached row's lse
            value = value + (torch.where(torch.isinf(lse), 0, lse).double() * glse).sum()
        return value

    # float64 oracle on the (dtype-rounded) inputs
    q64, k64, v64 = (t.to(torch.float64, copy=True).requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference_attention(
        q64, k64, v64, segs, dils, **kw, cu_seqlens=c["cu_seqlens"],
        grouped_offsets=c["head_offsets"] == "grouped", window=c["window"],
    )  # fmt: skip
    loss(ref, ref_lse, go, glse).backward()

    # single-process op, same dtype
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    loc, loc_lse = ra.dilated_attention(q1, k1, v1, segs, dils, **kw, **feat, return_lse=True)
    loss(loc, loc_lse, go, glse).backward()

    def shard(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return shard_sequence(t, dim, group, layout=layout)

    ql, kl, vl = (shard(t).detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = ring_dilated_attention(
        ql, kl, vl, segs, dils, group=group, layout=layout, return_lse=True, **kw, **feat
    )
    loss(out, lse, shard(go), None if glse is None else shard(glse, 2)).backward()
    full = gather_sequence(out.detach(), 1, group, layout=layout)

    res = {
        "shape_ok": out.shape == ql.shape and out.dtype == ql.dtype,
        "finite": bool(torch.isfinite(out).all()),
        "out_vs_oracle": _maxerr(out, shard(ref.detach())),
        "out_vs_local": _maxerr(out, shard(loc.detach())),
        "gathered_vs_oracle": _maxerr(full, ref.detach()),
        "lse_vs_oracle": _maxerr_finite(lse, shard(ref_lse.detach(), 2)),
        "scale_out": _maxabs(ref.detach()),
    }
    for name, mine, r64, r1 in (
        ("dq", ql, q64, q1),
        ("dk", kl, k64, k1),
        ("dv", vl, v64, v1),
    ):
        res[f"{name}_vs_oracle"] = _maxerr(mine.grad, shard(r64.grad))
        res[f"{name}_vs_local"] = _maxerr(mine.grad, shard(r1.grad))
        res[f"scale_{name}"] = _maxabs(r64.grad)
    res["bytes_sent"] = last_exchange_stats.bytes_sent()
    return res


def _sharding_checks(rank: int, world: int) -> dict:
    """shard_sequence / gather_sequence against torch.tensor_split."""
    res: dict[str, object] = {}
    for n in (1, 4, 37):
        for layout in ("contiguous", "zigzag"):
            x = torch.arange(2 * n * 3, dtype=torch.float32).reshape(2, n, 3)
            if layout == "contiguous":
                expect = torch.tensor_split(x, world, 1)[rank]
            else:
                chunks = torch.tensor_split(x, 2 * world, 1)
                expect = torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], 1)
            mine = shard_sequence(x, 1, layout=layout)
            res[f"shard_{n}_{layout}"] = torch.equal(mine, expect)
            res[f"gather_{n}_{layout}"] = torch.equal(gather_sequence(mine, 1, layout=layout), x)
            # another dim, negative index
            xt = x.transpose(1, 2).contiguous()
            mt = shard_sequence(xt, -1, layout=layout)
            res[f"gather_lastdim_{n}_{layout}"] = torch.equal(
                gather_sequence(mt, -1, layout=layout), xt
            )

    # gradient of gather_sequence: this rank's slice of the full gradient
    x = torch.randn(2, 37, 3, generator=torch.Generator().manual_seed(7))
    w = torch.randn(2, 37, 3, generator=torch.Generator().manual_seed(8))
    for layout in ("contiguous", "zigzag"):
        xl = shard_sequence(x, 1, layout=layout).detach().requires_grad_()
        (gather_sequence(xl, 1, layout=layout) * w).sum().backward()
        res[f"gather_grad_{layout}"] = torch.equal(xl.grad, shard_sequence(w, 1, layout=layout))

    # lengths that do not follow the convention raise on every rank
    if world > 1:
        bad = torch.zeros(1, 5 + (0 if rank == 0 else 1), 2)
        try:
            gather_sequence(bad, 1)
            res["gather_bad_lengths"] = "no error"
        except ValueError as exc:
            res["gather_bad_lengths"] = str(exc)
    return res


def _ring_suite(rank: int, world: int, names: list[str]) -> dict:
    out = {name: _run_case(_config(CASES[name])) for name in names}
    # the nn.Module gives the function's result
    c = _config(CASES["longnet_causal"])
    q, k, v, _ = _inputs(c)
    ql, kl, vl = (shard_sequence(t, 1) for t in (q, k, v))
    mod = RingDilatedAttention(*c["pattern"], causal=True)
    fn = ring_dilated_attention(ql, kl, vl, *c["pattern"], causal=True)
    out["_module_equal"] = torch.equal(mod(ql, kl, vl), fn)
    out["_sharding"] = _sharding_checks(rank, world)
    return out


_RESULTS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_distributed(_ring_suite, world, list(CASES), timeout=180)
    return _RESULTS[world]


# ---------------------------------------------------------------------------
# Distributed tests.


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ring_matches_single_process_and_oracle(world: int, case: str) -> None:
    c = _config(CASES[case])
    atol, rtol = TOLERANCES[c["dtype"]]
    for rank, res in enumerate(_results(world)):
        r = res[case]
        where = f"world={world} rank={rank} case={case}"
        assert r["shape_ok"], where
        assert r["finite"], where
        for what in ("out_vs_oracle", "out_vs_local", "gathered_vs_oracle"):
            assert r[what] <= atol + rtol * r["scale_out"], f"{where}: {what}={r[what]:.3g}"
        assert r["lse_vs_oracle"] <= LSE_TOL[c["dtype"]], f"{where}: lse={r['lse_vs_oracle']:.3g}"
        for g in ("dq", "dk", "dv"):
            for ref in ("oracle", "local"):
                err = r[f"{g}_vs_{ref}"]
                assert err <= atol + rtol * r[f"scale_{g}"], f"{where}: {g}_vs_{ref}={err:.3g}"
        if world == 1:
            assert r["bytes_sent"] == 0, where


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ring_exchanges_something_for_spanning_patterns(world: int) -> None:
    """A dense ring really communicates (the results above are not local-only)."""
    for rank, res in enumerate(_results(world)):
        if world > 1:
            assert res["dense"]["bytes_sent"] > 0, f"world={world} rank={rank}"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_module_matches_function(world: int) -> None:
    for res in _results(world):
        assert res["_module_equal"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_shard_and_gather_sequence(world: int) -> None:
    for rank, res in enumerate(_results(world)):
        checks = res["_sharding"]
        for key, value in checks.items():
            if key == "gather_bad_lengths":
                assert "gather_sequence" in value and "expects" in value, f"rank={rank}: {value}"
            else:
                assert value is True, f"world={world} rank={rank}: {key}"


# ---------------------------------------------------------------------------
# Single-process tests (no process group initialised).


@pytest.mark.parametrize("n,world", [(0, 3), (1, 1), (5, 5), (37, 4), (101, 5), (7, 3), (3, 5)])
def test_shard_bounds_follow_tensor_split(n: int, world: int) -> None:
    x = torch.arange(n)
    pieces = torch.tensor_split(x, world)
    bounds = shard_bounds(n, world)
    assert [length for _, length in bounds] == [len(p) for p in pieces]
    for (start, length), p in zip(bounds, pieces, strict=True):
        assert torch.equal(x[start : start + length], p)


@pytest.mark.parametrize("n,world", [(37, 4), (101, 5), (3, 2), (8, 4)])
def test_zigzag_pieces_partition_the_sequence(n: int, world: int) -> None:
    covered = []
    chunks = shard_bounds(n, 2 * world)
    for rank in range(world):
        pieces = layout_pieces(n, world, rank, "zigzag")
        assert [(p.start, p.length) for p in pieces] == [chunks[rank], chunks[2 * world - 1 - rank]]
        assert pieces[1].offset == pieces[0].length
        for p in pieces:
            covered.extend(range(p.start, p.start + p.length))
    assert sorted(covered) == list(range(n))


def test_single_process_is_identity_without_process_group() -> None:
    x = torch.randn(2, 7, 3)
    for layout in ("contiguous", "zigzag"):
        assert shard_sequence(x, 1, layout=layout) is x
        assert gather_sequence(x, 1, layout=layout) is x


@pytest.mark.parametrize("case", ["longnet_causal", "dense", "zigzag_longnet", "head_groups"])
def test_ring_without_process_group(case: str) -> None:
    """World size 1 without torch.distributed initialised: the ring is the
    single-process op, forward and backward."""
    c = _config(CASES[case])
    r = _run_case(c)
    atol, rtol = TOLERANCES[c["dtype"]]
    assert r["shape_ok"]
    assert r["out_vs_local"] <= atol + rtol * r["scale_out"]
    assert r["out_vs_oracle"] <= atol + rtol * r["scale_out"]
    for g in ("dq", "dk", "dv"):
        assert r[f"{g}_vs_oracle"] <= atol + rtol * r[f"scale_{g}"]
        assert r[f"{g}_vs_local"] <= atol + rtol * r[f"scale_{g}"]
    assert r["bytes_sent"] == 0


def test_bad_inputs_raise_value_error() -> None:
    q = torch.randn(1, 16, 4, 8)
    segs, dils = LONGNET
    with pytest.raises(ValueError, match="4-D"):
        ring_dilated_attention(q[0], q[0], q[0], segs, dils)
    with pytest.raises(ValueError, match="same shape"):
        ring_dilated_attention(q, q, q[:, :8], segs, dils)
    with pytest.raises(ValueError, match="dilation_rates"):
        ring_dilated_attention(q, q, q, [8, 16], [1])
    with pytest.raises(ValueError, match="dilation_rates"):
        ring_dilated_attention(q, q, q, [8], [16])
    with pytest.raises(ValueError, match="segment_lengths"):
        ring_dilated_attention(q, q, q, [], [])
    with pytest.raises(ValueError, match="head_groups"):
        ring_dilated_attention(q, q, q, [2, 4, 8, 8, 8], [1, 1, 1, 1, 1], head_groups=True)
    with pytest.raises(ValueError, match="layout"):
        ring_dilated_attention(q, q, q, segs, dils, layout="striped")
    with pytest.raises(ValueError, match="layout"):
        RingDilatedAttention(segs, dils, layout="striped")
    with pytest.raises(ValueError, match="dtype"):
        ring_dilated_attention(q, q, q.double(), segs, dils)
    with pytest.raises(ValueError, match="scale"):
        ring_dilated_attention(q, q, q, segs, dils, scale=-1.0)
    with pytest.raises(ValueError, match="dim"):
        shard_sequence(q, 4)
    with pytest.raises(ValueError, match="layout"):
        shard_sequence(q, 1, layout="striped")


def test_plan_cache_reused_single_process() -> None:
    """A repeated call builds no plan: hits grow, misses do not."""
    c = _config(CASES["longnet"])
    q, k, v, _ = _inputs(c)
    ring_dilated_attention(q, k, v, *c["pattern"])
    misses, hits = PLAN_CACHE.misses, PLAN_CACHE.hits
    ring_dilated_attention(q, k, v, *c["pattern"])
    assert PLAN_CACHE.misses == misses
    assert PLAN_CACHE.hits == hits + 1


def test_gradcheck_float64_single_process() -> None:
    c = _config(dict(n=11, pattern=([4, 8], [1, 2]), causal=True, batch=1, heads=2, head_dim=4))
    q, k, v, _ = (t.double() for t in _inputs(c))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda a, b, d: ring_dilated_attention(
            a, b, d, [4, 8], [1, 2], causal=True, layout="zigzag"
        ),
        (q, k, v),
    )


def test_public_exports() -> None:
    """The package exports the ring API under its normative names."""
    assert ra.ring_dilated_attention is ring_dilated_attention
    assert ra.RingDilatedAttention is RingDilatedAttention
    assert ra.shard_sequence is shard_sequence
    assert ra.gather_sequence is gather_sequence


def test_gradcheck_lse_documents_grouped_kv_single_process() -> None:
    """gradcheck on both outputs (out and lse) of the ring, with documents and
    grouped K/V heads (float64)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 11, 4, 3, dtype=torch.float64, generator=g).requires_grad_()
    k, v = (
        torch.randn(1, 11, 2, 3, dtype=torch.float64, generator=g).requires_grad_()
        for _ in range(2)
    )

    def fn(a, b, d):
        out, lse = ring_dilated_attention(
            a, b, d, [4, 8], [1, 2], causal=True, cu_seqlens=[0, 1, 7, 11], return_lse=True
        )
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_double_backward_of_the_ring_raises() -> None:
    q, k, v = (torch.randn(1, 9, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = ring_dilated_attention(q, k, v, [4], [1], causal=True)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(gq.sum(), k)
