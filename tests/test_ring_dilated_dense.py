"""The ring's dilated blocks whose segments cross the pieces, through the dense backends
(ring_attention/local/block_calls.py, ring_attention/local/blocks.py).

Each world size (2, 3) is launched once (real gloo processes) and runs every case of
``CASES`` twice, the dense route forced (the CPU stand-in backend) and our kernels forced:
every rank's out, lse and q/k/v gradients agree between the two and with the float64 oracle
(``tests/oracle.py``), and the dense run proves it ran densely: backend calls, no call of our
block kernels, blocks of packed K/V rows read through a row map among them, and K/V checked
once a pass (the ring's all-reduced check), not once a block. Lengths divide by no world
size, so segments (8, 16, 32) cross the pieces. With a NaN key the pass runs again, each
block checking its K/V, those reading it on our kernel: its answer.

``test_dense_blocks_never_read_unreached_rows``: one block at a time, the K/V rows no query of
the block reaches (contiguous K/V) and the map entries of rows not sent (packed K/V) hold NaN:
the dense block's results equal our kernel's on clean K/V.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from op_helpers import CaseRuns, CountingBackend
from oracle import reference_attention

from ring_attention.core import config
from ring_attention.core.call import Call
from ring_attention.core.pattern import Pattern
from ring_attention.local import backends, ops
from ring_attention.local.block_calls import block_calls
from ring_attention.local.blocks import Blocks
from ring_attention.local.rows import reached_rows
from ring_attention.local.spans import Route
from ring_attention.parallel.sharding import layout_pieces, shard_sequence

LONGNET = ([8, 16, 32], [1, 2, 4])

# name -> configuration (n = 77: no world size divides it)
# packed: some block reads packed K/V rows through a row map at every world size
CASES: dict[str, dict] = {
    "causal_gqa_grouped": dict(causal=True, heads=4, kv_heads=2, head_offsets="grouped"),
    "zigzag_noncausal_gqa_far": dict(
        causal=False, layout="zigzag", heads=4, kv_heads=2, far="100000000", packed=True
    ),
    "zigzag_causal_mqa_head_groups": dict(
        causal=True, layout="zigzag", heads=3, kv_heads=1, head_groups=True, packed=True
    ),
    "float64_noncausal": dict(causal=False, dtype=torch.float64, packed=True),
    "causal_nan_key": dict(causal=True, heads=2, kv_heads=2, nan=True),
}
N = 77
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _lse_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, rows no branch reaches (-inf on both sides) equal."""
    both = torch.isneginf(a) & torch.isneginf(b)
    return torch.where(both, 0.0, a - b).abs().max().item()


def _ring(c: dict, mode: str, q, k, v, go) -> tuple[list[torch.Tensor], dict]:
    """One ring call forward and backward with both passes' mode ``mode``: ``[out, lse, dq, dk,
    dv]`` and the counts of backend calls, our block kernels' calls and packed blocks."""
    from ring_attention.local import blocks
    from ring_attention.parallel.api import ring_dilated_attention
    from ring_attention.parallel.exchange import Exchanger

    layout = c.get("layout", "contiguous")
    os.environ[config.FORWARD] = os.environ[config.BACKWARD] = mode
    if "far" in c:
        os.environ[config.FAR_BYTES] = c["far"]
    counts = {"kernel": 0, "packed": 0, "far": 0, "block_checks": 0}
    counter = CountingBackend(backends.BACKENDS["cpu"])
    saved = ops.block_forward, ops.block_backward, blocks.Blocks.forward, Exchanger.far_received
    kv_finite = blocks.KvFinite

    def kernel(fn):
        def run(*args):
            counts["kernel"] += 1
            return fn(*args)

        return run

    def forward(self, *args):
        counts["packed"] += args[-1] is not None  # (k_rows, as ring.py passes it)
        return saved[2](self, *args)

    def far_received(self, *args):
        for step in saved[3](self, *args):
            counts["far"] += 1
            yield step

    def block_check(*args):
        counts["block_checks"] += 1
        return kv_finite(*args)

    backends.BACKENDS["cpu"] = counter
    ops.block_forward, ops.block_backward = kernel(saved[0]), kernel(saved[1])
    blocks.Blocks.forward, Exchanger.far_received = forward, far_received
    blocks.KvFinite = block_check
    try:
        ql, kl, vl = (shard_sequence(t, layout=layout).clone().requires_grad_() for t in (q, k, v))
        out, lse = ring_dilated_attention(
            ql, kl, vl, *LONGNET, causal=c["causal"], layout=layout, return_lse=True,
            head_groups=c.get("head_groups", False),
            head_offsets=c.get("head_offsets", "modulo"),
        )  # fmt: skip
        (out.double() * shard_sequence(go, layout=layout).double()).sum().backward()
    finally:
        backends.BACKENDS["cpu"] = counter.inner
        ops.block_forward, ops.block_backward, blocks.Blocks.forward, Exchanger.far_received = saved
        blocks.KvFinite = kv_finite
        for env in (config.FORWARD, config.BACKWARD, config.FAR_BYTES):
            os.environ.pop(env, None)
    return [out.detach(), lse, ql.grad, kl.grad, vl.grad], {**counts, **counter.calls}


def _run_case(rank: int, world: int, name: str, c: dict) -> dict:
    dtype, heads = c.get("dtype", torch.float32), c.get("heads", 2)
    kv_heads = c.get("kv_heads", heads)
    g = torch.Generator().manual_seed(list(CASES).index(name))
    q = torch.randn(2, N, heads, 16, generator=g).to(dtype)
    k = torch.randn(2, N, kv_heads, 16, generator=g).to(dtype)
    v = torch.randn(2, N, kv_heads, 16, generator=g).to(dtype)
    go = torch.randn(2, N, heads, 16, generator=g).to(dtype)
    if c.get("nan"):
        k[1, 5, 0, 3] = float("nan")  # rank 0's piece, reached by every later rank
    dense, counts = _ring(c, "dense", q, k, v, go)
    kernel, _ = _ring(c, "kernel", q, k, v, go)
    labels = ("out", "lse", "dq", "dk", "dv")
    result = {"counts": counts}
    if c.get("nan"):
        result["same"] = all(
            torch.allclose(a.double(), b.double(), rtol=0, atol=TOL[dtype], equal_nan=True)
            for a, b in zip(dense, kernel, strict=True)
        )
        return result
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ro, rl = reference_attention(
        *ref, *LONGNET, c["causal"], head_groups=c.get("head_groups", False),
        grouped_offsets=c.get("head_offsets") == "grouped",
    )  # fmt: skip
    (ro * go.double()).sum().backward()
    layout = c.get("layout", "contiguous")
    rows = torch.cat([torch.arange(p.start, p.start + p.length)
                      for p in layout_pieces(N, world, rank, layout)])  # fmt: skip
    want = [ro[:, rows], rl[:, :, rows], *(t.grad[:, rows] for t in ref)]

    def err(a: torch.Tensor, b: torch.Tensor, label: str) -> float:
        a, b = a.double(), b.double()
        return _lse_error(a, b) if label == "lse" else (a - b).abs().max().item()

    result["kernel"] = {x: err(a, b, x) for x, a, b in zip(labels, dense, kernel, strict=True)}
    result["oracle"] = {x: err(a, b, x) for x, a, b in zip(labels, dense, want, strict=True)}
    return result


_results = CaseRuns(_run_case, CASES)


@_results.each
def test_ring_dilated_dense_blocks(world: int, name: str) -> None:
    c = CASES[name]
    tol = TOL[c.get("dtype", torch.float32)]
    results = _results.of(world, name)
    for rank, r in enumerate(results):
        counts = r["counts"]
        where = f"rank {rank}: {counts}"
        assert counts["forward"] > 0 and counts["backward"] > 0, where
        if c.get("nan"):
            assert r["same"], where
            continue
        assert counts["kernel"] == 0, where  # every block dense, the received ones included
        assert counts["block_checks"] == 0, where  # K/V checked once a pass, not once a block
        for label in r["kernel"]:
            assert r["kernel"][label] <= tol, f"rank {rank}: {label} off our kernels' by {r}"
            assert r["oracle"][label] <= tol, f"rank {rank}: {label} off the oracle's by {r}"
    if c.get("packed"):  # blocks of packed rows read through a row map: the dense path ran them
        assert sum(r["counts"]["packed"] for r in results) > 0
    if "far" in c:  # the far group's blocks among them
        assert sum(r["counts"]["far"] for r in results) > 0
    if c.get("nan"):  # the pass again, each block checking its K/V; those reading it: ours
        assert all(r["counts"]["block_checks"] > 0 for r in results)
        assert sum(r["counts"]["kernel"] for r in results) > 0


def _block(pattern: Pattern, heads: int, kv_heads: int, qr: tuple[int, int],
           kr: tuple[int, int], packed: bool) -> dict[str, float]:  # fmt: skip
    """One block, dense (unreached rows or unsent map entries NaN) against our kernel."""
    f64, (qa, qb), (ka, kb) = torch.float64, qr, kr
    call = Call(pattern, 0.3)
    args = ops.op_args(call, "cpu")
    blk = Blocks(call, args, Route(True, "test", None, (("cpu",),)))
    blk.each_block = False  # (the pass's check would have said finite: NaN rows are never read)
    g = torch.Generator().manual_seed(qa * 131 + ka)
    q, go, o = (torch.randn(2, qb - qa, heads, 8, generator=g, dtype=f64) for _ in range(3))
    k, v = (torch.randn(2, kb - ka, kv_heads, 8, generator=g, dtype=f64) for _ in range(2))
    idx = reached_rows([qa], [qb - qa], ka, kb - ka, heads, kv_heads, pattern)
    assert 0 < idx.numel() < (kb - ka) * kv_heads, "the block should reach some rows only"
    nan = torch.full((2, 1, 8), math.nan, dtype=f64)
    if packed:  # the rows sent, and a NaN row where the map's other entries point
        kd, vd = (torch.cat([t.reshape(2, -1, 8)[:, idx], nan], 1) for t in (k, v))
        rows = torch.full(((kb - ka) * kv_heads,), idx.numel(), dtype=torch.int32)
        rows[idx] = torch.arange(idx.numel(), dtype=torch.int32)
        rows = rows.view(kb - ka, kv_heads)
    else:
        reached = torch.zeros((kb - ka) * kv_heads, dtype=torch.bool)
        reached[idx] = True
        kd, vd = (t.clone().reshape(2, -1, 8) for t in (k, v))
        for t in (kd, vd):
            t[:, ~reached] = math.nan
        kd, vd, rows = kd.view(k.shape), vd.view(v.shape), None

    def acc():
        return torch.zeros(2, qb - qa, heads, 8, dtype=f64), torch.full(
            (2, heads, qb - qa), -math.inf, dtype=f64
        )

    (out, lse), (want_out, want_lse) = acc(), acc()
    assert blk._dense_forward(q, kd, vd, out, lse, qa, ka, rows)
    ops.block_forward(q, k, v, want_out, want_lse, qa, ka, args, None)
    final = torch.where(torch.isneginf(want_lse), 0.0, want_lse)
    grads = [torch.zeros_like(t) for t in (q, kd, vd)]
    want = [torch.zeros_like(t) for t in (q, k, v)]
    assert blk._dense_backward(go, q, kd, vd, o, final, *grads, qa, ka, rows)
    ops.block_backward(go, None, q, k, v, o, final, *want, qa, ka, args, None)
    if packed:  # the rows sent; nothing added to the NaN row
        assert not grads[1][:, -1].any() and not grads[2][:, -1].any()
        grads[1:] = [t[:, :-1] for t in grads[1:]]
    want[1:] = [t.reshape(2, -1, 8)[:, idx] for t in want[1:]]
    grads[1:] = [t.reshape(2, -1, 8)[:, : idx.numel() if packed else None] for t in grads[1:]]
    if not packed:
        grads[1:] = [t[:, idx] for t in grads[1:]]
    errors = {"out": (out - want_out).abs().max().item(), "lse": _lse_error(lse, want_lse)}
    for label, a, b in zip(("dq", "dk", "dv"), grads, want, strict=True):
        errors[label] = (a - b).abs().max().item()
    return errors


# (pattern, causal, heads, K/V heads, offsets, queries, keys, K/V packed)
UNREACHED = [
    (LONGNET, True, 4, 2, "modulo", (40, 61), (13, 40)),  # an earlier piece
    (LONGNET, False, 4, 2, "grouped", (5, 29), (29, 60)),  # a later piece
    (([16, 64], [2, 4]), False, 6, 2, "modulo", (40, 70), (2, 30)),  # not adjacent
]
UNREACHED = [(*c, packed) for c in UNREACHED for packed in (False, True)] + [
    (([8, 32], [4, 4]), True, 2, 1, "grouped", (21, 45), (21, 45), False),  # the own block
]


@pytest.mark.parametrize("segments,causal,heads,kv_heads,offsets,qr,kr,packed", UNREACHED)
def test_dense_blocks_never_read_unreached_rows(segments, causal, heads, kv_heads, offsets, qr,
                                                kr, packed) -> None:  # fmt: skip
    pattern = Pattern(*segments, causal=causal, head_offsets=offsets)
    errors = _block(pattern, heads, kv_heads, qr, kr, packed)
    assert all(e <= 1e-12 for e in errors.values()), errors


def test_block_calls() -> None:
    """The calls of a block: one a class, head run and segment cut by the ranges, the segments
    inside both ranges in one call; none where no key precedes a query; none possible where a
    causal diagonal is cut across."""
    p = Pattern([8], [2], causal=True)
    (a, b) = block_calls(p, 2, 2, 12, 12, 0, 12)  # keys 0-11, queries 12-23: segment 8-15
    assert (a.q.offset, a.q.start, a.q.rows, a.k.start, a.k.rows) == (0, 0, 2, 8, 2)
    assert (b.q.offset, b.q.start, b.q.rows, b.k.start, b.k.rows) == (1, 1, 2, 9, 2)
    assert not a.causal and a.q.q_head == 0 and b.q.q_head == 1
    own = block_calls(p, 1, 1, 4, 40, 4, 40)  # [4, 44): segments 0, 1-4 inside, 5
    assert [(c.q.start, c.q.segments, c.q.rows, c.causal) for c in own] == [
        (0, 1, 2, True), (4, 4, 4, True), (36, 1, 2, True)
    ]  # fmt: skip
    assert block_calls(p, 2, 2, 0, 12, 12, 12) == ()  # keys after every query
    assert block_calls(p, 2, 2, 4, 8, 0, 8) is None  # queries 4-11, keys 0-7: cut
    assert block_calls(Pattern([8], [2]), 2, 2, 4, 8, 0, 8) is not None


def test_auto_keeps_our_kernels_for_dilated_blocks(monkeypatch) -> None:
    """On CUDA (fake tensors, an sm_90 device) ``auto`` takes the ring's plain dense blocks by
    the path table but keeps the dilated ones on our kernels (no measured row, and the ranks'
    K/V check is not posted for them); ``dense`` runs both densely."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ring_attention.local import dispatch

    monkeypatch.setattr(dispatch, "_capability", lambda d: (9, 0) if d.type == "cuda" else (0, 0))
    plain, dilated = Pattern([1 << 20], [1]), Pattern(*LONGNET)
    with FakeTensorMode():
        q = torch.empty(1, 40, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, 40, 2, 64, dtype=torch.bfloat16, device="cuda")
        for mode in ("auto", "dense"):
            monkeypatch.setenv(config.BACKWARD, mode)
            r = dispatch.route_blocks("backward", q, k, plain, 80, (0, 40, 80), 40)
            assert r.dense, r.why
            r = dispatch.route_blocks("backward", q, k, dilated, 80, (0, 40, 80), 40)
            assert r.dense == (mode == "dense"), r.why
            if mode == "auto":
                assert r.why == dispatch.DILATED_AUTO
            assert dispatch.may_be_dense("backward", torch.bfloat16, 64, 80, "dilated") == (
                mode == "dense"
            )
            assert dispatch.may_be_dense("backward", torch.bfloat16, 64, 80, "dense")
