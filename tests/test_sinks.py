"""Attention sinks (docs/design.md §1): one virtual key of value 0 and score
``sinks[h]`` in every query's softmax, added once whatever the branches,
ranks or blocks; ``lse`` includes it; gradients reach ``sinks``. Against the
float64 oracle (tests/oracle.py, which puts the sink in the softmax itself),
forward and backward, one process and the ring, Ulysses and the hybrid."""

from __future__ import annotations

import pytest
import torch
from oracle import reference_attention

import ring_attention as ra
from ring_attention.parallel.testing import run_distributed

F64 = torch.float64
TOL = {F64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}

CASES = {
    # name: (heads, kv_heads, n, segments, dilations, keywords)
    "longnet-causal-gqa": (6, 2, 61, [8, 16, 32], [1, 2, 4], {"causal": True}),
    "documents-window": (4, 4, 50, [8, 32], [1, 2],
                         {"causal": True, "cu_seqlens": [0, 20, 21, 50], "window": (6, 0)}),
    "head-groups-grouped": (6, 3, 40, [8, 16], [1, 2],
                            {"head_groups": True, "head_offsets": "grouped"}),
    "dense-padding": (3, 1, 33, [33], [1], {"padding": True}),
}  # fmt: skip


def _inputs(case: str, seed: int = 0):
    heads, kv, n, segs, dils, kw = CASES[case]
    kw = dict(kw)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n, heads, 8, generator=g, dtype=F64)
    k, v = (torch.randn(2, n, kv, 8, generator=g, dtype=F64) for _ in range(2))
    go = torch.randn(2, n, heads, 8, generator=g, dtype=F64)
    gl = torch.randn(2, heads, n, generator=g, dtype=F64)
    sinks = (torch.randn(heads, generator=g, dtype=F64) * 2).float().double()  # fp32 values
    if kw.pop("padding", False):
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[0, : n // 2] = True  # early rows reach nothing, causal or not: every key masked
        mask[0, n // 2 :] = True
        mask[1, ::3] = True
        kw["key_padding_mask"] = mask
    return q, k, v, go, gl, sinks, segs, dils, kw


def _oracle(q, k, v, go, gl, sinks, segs, dils, kw):
    q, k, v, sinks = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    out, lse = reference_attention(
        q, k, v, segs, dils, causal=kw.get("causal", False),
        head_groups=kw.get("head_groups", False), key_padding_mask=kw.get("key_padding_mask"),
        grouped_offsets=kw.get("head_offsets") == "grouped", cu_seqlens=kw.get("cu_seqlens"),
        window=kw.get("window"), sinks=sinks,
    )  # fmt: skip
    ((out * go).sum() + (lse * gl).sum()).backward()
    return [t.detach() for t in (out, lse, q.grad, k.grad, v.grad, sinks.grad)]


def _close(got, want, tol, what):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        torch.testing.assert_close(a.to(F64), b, atol=tol * 4, rtol=tol * 4, msg=f"{what}: {name}")


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_local_sinks_match_the_oracle(case: str, dtype: torch.dtype) -> None:
    q, k, v, go, gl, sinks, segs, dils, kw = _inputs(case)
    q, k, v = (t.to(dtype).to(F64) for t in (q, k, v))  # the same values in every dtype
    want = _oracle(q, k, v, go, gl, sinks, segs, dils, kw)
    qd, kd, vd = (t.to(dtype).requires_grad_() for t in (q, k, v))
    s = sinks.clone().to(F64 if dtype == F64 else torch.float32).requires_grad_()
    out, lse = ra.dilated_attention(qd, kd, vd, segs, dils, return_lse=True, sinks=s, **kw)
    ((out.to(F64) * go).sum() + (lse.to(F64) * gl).sum()).backward()
    got = [out, lse, qd.grad, kd.grad, vd.grad, s.grad]
    _close(got, want, TOL[dtype], f"{case} {dtype}")


def test_rows_that_reach_nothing_get_the_sink() -> None:
    q, k, v, _, _, sinks, segs, dils, kw = _inputs("dense-padding")
    out, lse = ra.dilated_attention(q, k, v, segs, dils, return_lse=True, sinks=sinks, **kw)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(lse[0], sinks[:, None].expand_as(lse[0]))


def test_gradcheck_with_sinks() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 9, 3, 4, generator=g, dtype=F64, requires_grad=True)
    k, v = (torch.randn(1, 9, 1, 4, generator=g, dtype=F64, requires_grad=True) for _ in "kv")
    s = torch.randn(3, generator=g, dtype=F64, requires_grad=True)

    def fn(q, k, v, s):
        return ra.dilated_attention(q, k, v, [4, 8], [1, 2], causal=True, return_lse=True, sinks=s)

    assert torch.autograd.gradcheck(fn, (q, k, v, s))


@pytest.mark.parametrize(
    ("sinks", "words"),
    [
        (torch.zeros(5), r"shape \(heads,\) = \(3,\)"),
        (torch.zeros(3, dtype=torch.int64), "floating dtype"),
        ([0.0, 0.0, 0.0], "must be a tensor"),
        (torch.zeros(3, device="meta"), "must be on cpu"),
    ],
)
def test_bad_sinks_raise_naming_sinks(sinks, words) -> None:
    q = torch.randn(1, 8, 3, 4)
    with pytest.raises(ValueError, match=f"sinks.*{words}|{words}"):
        ra.dilated_attention(q, q[:, :, :1], q[:, :, :1], [4], [1], sinks=sinks)


def _sharded_worker(rank: int, world: int, mode: str, case: str) -> list[str]:
    """Every rank checks its shard of out, lse, dq, dk, dv and the sum over
    ranks of sinks.grad against the oracle; returns what failed."""
    import torch.distributed as dist

    q, k, v, go, gl, sinks, segs, dils, kw = _inputs(case, seed=5)
    kw.pop("key_padding_mask", None)  # the ring takes no mask
    want = _oracle(q, k, v, go, gl, sinks, segs, dils, kw)
    if mode == "ring":
        groups = {"group": None}
    elif mode == "ulysses":
        groups = {"group": None, "ulysses_group": dist.group.WORLD}
    else:  # 2 x 2: ring index rank // 2, Ulysses index rank % 2
        rows = [dist.new_group([2 * i, 2 * i + 1]) for i in range(2)]
        cols = [dist.new_group([j, j + 2]) for j in range(2)]
        groups = {"group": cols[rank % 2], "ulysses_group": rows[rank // 2]}
    local = [ra.shard_sequence(t, dim=1, **groups) for t in (q, k, v, go)]
    gl_local = ra.shard_sequence(gl, dim=2, **groups)
    ql, kl, vl = (t.clone().requires_grad_() for t in local[:3])
    s = sinks.clone().requires_grad_()
    out, lse = ra.ring_dilated_attention(ql, kl, vl, segs, dils, return_lse=True, sinks=s,
                                         **groups, **kw)  # fmt: skip
    ((out * local[3]).sum() + (lse * gl_local).sum()).backward()
    dsinks = s.grad.clone()
    dist.all_reduce(dsinks)
    mine = [ra.shard_sequence(t, dim=d, **groups) for t, d in
            zip(want[:5], (1, 2, 1, 1, 1), strict=True)]  # fmt: skip
    failed = []
    got = [out, lse, ql.grad, kl.grad, vl.grad, dsinks]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, [*mine, want[5]],
                          strict=True):  # fmt: skip
        if not torch.allclose(a.detach(), b, atol=1e-9, rtol=1e-9):
            failed.append(f"rank {rank} {mode} {case} {name}: {(a - b).abs().max().item():.2e}")
    return failed


@pytest.mark.parametrize("world", [3, 4])
def test_sharded_sinks_match_the_oracle(world: int) -> None:
    """The ring (3 ranks), Ulysses and the 2 x 2 hybrid (4 ranks): the sink
    is added once per query, sinks.grad summed over the ranks is one
    process's."""
    modes = ["ring"] if world == 3 else ["ulysses", "hybrid", "ring"]
    failed = []
    for mode in modes:
        for case in ("longnet-causal-gqa", "documents-window"):
            for rank_failed in run_distributed(_sharded_worker, world, mode, case):
                failed += rank_failed
    assert not failed, "\n".join(failed)


def _bad_sinks_worker(rank: int, world: int, mode: str) -> str:
    import torch.distributed as dist

    q = torch.randn(1, 8, 4, 4)
    groups = {"group": None} if mode == "ring" else {"ulysses_group": dist.group.WORLD}
    sinks = torch.zeros(4) if rank else torch.zeros(3)  # rank 0's is bad
    try:
        ra.ring_dilated_attention(q, q, q, [4], [1], sinks=sinks, **groups)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_one_rank_with_bad_sinks_makes_every_rank_raise(mode: str) -> None:
    got = run_distributed(_bad_sinks_worker, 2, mode, pg_timeout=30, timeout=120)
    assert "sinks must have shape" in got[0], got
    assert "rank 0" in got[1] and "sinks" in got[1], got
