"""The ring's per-step blocks through the dense backends (ring_attention/local/blocks.py).

Each world size (2, 3) is launched once (real gloo processes) and runs every
case of ``CASES``; the tests below read the cached results. Every rank
checks its shard of ``out``, ``lse`` and the q/k/v gradients against the
float64 oracle (``tests/oracle.py``) on the whole sequence, and counts the
calls of the CPU stand-in backend (a counting wrapper around it): with the
dense route forced, for plain dense attention one forward and one backward
call per block that some key of some query reaches (computed here from the
layout's pieces); for a dilated pattern some calls (the local op's
per-branch path per piece where every piece holds whole segments, else each
block's branches as strided views: tests/test_ring_dilated_dense.py); none
where the route keeps our kernels.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from op_helpers import CaseRuns, CountingBackend, OpLog
from oracle import reference_attention

from ring_attention.core import config
from ring_attention.core.pattern import Pattern
from ring_attention.local import backends
from ring_attention.local.block_calls import block_kind
from ring_attention.local.dispatch import block_shape, decide_blocks, route_blocks
from ring_attention.parallel.sharding import layout_pieces, shard_sequence
from ring_attention.parallel.testing import run_distributed

# name -> configuration; lengths divide nothing (37, 53), GQA and MQA included.
CASES: dict[str, dict] = {
    "noncausal": dict(n=37, causal=False),
    "causal_gqa": dict(n=37, causal=True, heads=4, kv_heads=2),
    "zigzag_causal_mqa": dict(n=53, causal=True, layout="zigzag", heads=3, kv_heads=1),
    "zigzag_noncausal_gqa": dict(n=53, causal=False, layout="zigzag", heads=6, kv_heads=2),
    "float64_zigzag_causal": dict(n=37, causal=True, layout="zigzag", dtype=torch.float64),
    "bfloat16_causal": dict(n=53, causal=True, heads=4, kv_heads=2, dtype=torch.bfloat16),
    "segment_beyond_n": dict(n=37, causal=True, segment=1 << 40),
    # the route keeps our kernels: auto on the CPU, documents, a gradient
    # reaching lse (backward only)
    "auto_cpu": dict(n=37, causal=True, mode="auto", dense=(False, False)),
    "documents": dict(n=37, causal=True, cu_seqlens=[0, 13, 37], dense=(False, False)),
    "lse_gradient": dict(n=37, causal=True, layout="zigzag", lse=True, dense=(True, False)),
    # dilated: pieces of 48 (2 ranks) and 32 (3 ranks; zigzag: 16) hold whole
    # segments (the local op per piece), zigzag's 24 (2 ranks) do not
    "dilated_causal_gqa_head_groups": dict(
        n=96, causal=True, pattern=([8, 16], [1, 2]), heads=4, kv_heads=2, head_groups=True
    ),
    "dilated_zigzag_noncausal": dict(
        n=96, causal=False, pattern=([16, 8], [2, 1]), layout="zigzag", heads=3
    ),
    "dilated_ragged": dict(n=37, causal=True, pattern=([8, 16], [1, 2])),
}

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def expected_blocks(n: int, world: int, rank: int, layout: str, causal: bool) -> int:
    """Blocks of this rank that some key of some query reaches (plain dense attention)."""
    mine = [p for p in layout_pieces(n, world, rank, layout) if p.length]
    every = [p for r in range(world) for p in layout_pieces(n, world, r, layout) if p.length]
    return sum(not causal or k.start <= q.start + q.length - 1 for q in mine for k in every)


def _lse_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, rows no branch reaches (-inf on both sides) equal."""
    both = torch.isneginf(a) & torch.isneginf(b)
    return torch.where(both, 0.0, a - b).abs().max().item()


def _run_case(rank: int, world: int, name: str, c: dict) -> dict:
    from ring_attention.parallel.api import ring_dilated_attention

    n, causal = c["n"], c["causal"]
    layout, dtype = c.get("layout", "contiguous"), c.get("dtype", torch.float32)
    heads, kv_heads = c.get("heads", 2), c.get("kv_heads", c.get("heads", 2))
    mode = c.get("mode", "dense")
    pattern = c.get("pattern", ([c.get("segment", n)], [1]))
    os.environ[config.FORWARD] = os.environ[config.BACKWARD] = mode
    g = torch.Generator().manual_seed(list(CASES).index(name))
    q = torch.randn(2, n, heads, 16, generator=g).to(dtype)
    k = torch.randn(2, n, kv_heads, 16, generator=g).to(dtype)
    v = torch.randn(2, n, kv_heads, 16, generator=g).to(dtype)
    go = torch.randn(2, n, heads, 16, generator=g).to(dtype)
    glse = torch.randn(2, heads, n, generator=g)

    counter = CountingBackend(backends.BACKENDS["cpu"])
    backends.BACKENDS["cpu"] = counter
    try:
        ql, kl, vl = (shard_sequence(t, layout=layout).clone().requires_grad_() for t in (q, k, v))
        out, lse = ring_dilated_attention(
            ql, kl, vl, *pattern, causal=causal, layout=layout, cu_seqlens=c.get("cu_seqlens"),
            head_groups=c.get("head_groups", False), return_lse=True,
        )  # fmt: skip
        loss = (out.float() * shard_sequence(go, layout=layout).float()).sum()
        if c.get("lse"):
            loss = loss + (lse * shard_sequence(glse, dim=2, layout=layout)).sum()
        loss.backward()
    finally:
        backends.BACKENDS["cpu"] = counter.inner
        del os.environ[config.FORWARD], os.environ[config.BACKWARD]

    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ro, rl = reference_attention(
        *ref,
        *pattern,
        causal,
        cu_seqlens=c.get("cu_seqlens"),
        head_groups=c.get("head_groups", False),
    )
    rloss = (ro * go.double()).sum()
    if c.get("lse"):
        rloss = rloss + (rl * glse.double()).sum()
    rloss.backward()
    rows = torch.cat(
        [torch.arange(p.start, p.start + p.length) for p in layout_pieces(n, world, rank, layout)]
    )
    errors = {
        "out": (out.double() - ro[:, rows]).abs().max().item(),
        "lse": _lse_error(lse.double(), rl[:, :, rows]),
    }
    for label, mine, full in (("dq", ql, ref[0]), ("dk", kl, ref[1]), ("dv", vl, ref[2])):
        errors[label] = (mine.grad.double() - full.grad[:, rows]).abs().max().item()
    return {"errors": errors, "calls": counter.calls}


_results = CaseRuns(_run_case, CASES)


@_results.each
def test_ring_dense_blocks(world: int, name: str) -> None:
    c = CASES[name]
    tol = TOL[c.get("dtype", torch.float32)]
    fwd_dense, bwd_dense = c.get("dense", (True, True))
    for rank, r in enumerate(_results.of(world, name)):
        for label, err in r["errors"].items():
            assert err <= tol, f"rank {rank}: {label} off by {err}"
        layout = c.get("layout", "contiguous")
        if "pattern" in c:  # dilated: dense calls, segments inside the pieces or crossing them
            assert r["calls"]["forward"] > 0, f"rank {rank}: {r['calls']}"
            assert r["calls"]["backward"] > 0, f"rank {rank}: {r['calls']}"
            continue
        blocks = expected_blocks(c["n"], world, rank, layout, c["causal"])
        assert r["calls"] == {
            "forward": blocks if fwd_dense else 0,
            "backward": blocks if bwd_dense else 0,
        }, f"rank {rank}"


def _nan_worker(rank: int, world: int) -> dict:
    """Dense forced against our kernels forced, K holding a NaN row (our
    kernels exclude it): the blocks reading it take our kernels (their
    dense calls, queued before the check is read, dropped)."""
    from ring_attention.local import ops
    from ring_attention.parallel.api import ring_dilated_attention

    n = 37
    g = torch.Generator().manual_seed(7)
    q, k, v, go = (torch.randn(1, n, 2, 8, generator=g) for _ in range(4))
    k[0, 3, 1] = float("nan")
    runs = {}
    for mode in ("kernel", "dense"):
        os.environ[config.FORWARD] = os.environ[config.BACKWARD] = mode
        counter = CountingBackend(backends.BACKENDS["cpu"])
        backends.BACKENDS["cpu"] = counter
        kernel = {"forward": 0, "backward": 0}
        block_ops = ops.block_forward, ops.block_backward

        def counted(pass_, fn, kernel=kernel):
            def run(*args):
                kernel[pass_] += 1
                return fn(*args)

            return run

        ops.block_forward, ops.block_backward = (
            counted(p, f) for p, f in zip(("forward", "backward"), block_ops, strict=True)
        )
        try:
            ql, kl, vl = (shard_sequence(t).clone().requires_grad_() for t in (q, k, v))
            out = ring_dilated_attention(ql, kl, vl, [n], [1], causal=True)
            (out * shard_sequence(go)).sum().backward()
        finally:
            backends.BACKENDS["cpu"] = counter.inner
            ops.block_forward, ops.block_backward = block_ops
            del os.environ[config.FORWARD], os.environ[config.BACKWARD]
        runs[mode] = ([out.detach(), ql.grad, kl.grad, vl.grad], counter.calls, kernel)
    same = all(
        torch.allclose(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)
        for a, b in zip(runs["kernel"][0], runs["dense"][0], strict=True)
    )
    return {"same": same, "calls": runs["dense"][1], "kernel": runs["dense"][2]}


def test_ring_dense_non_finite_keys_take_our_kernels() -> None:
    results = run_distributed(_nan_worker, 3)
    # rank 0 holds the NaN row: each pass runs densely, reads the ranks'
    # check (not finite) and runs again checking each block; there every
    # block reading rank 0's K takes our kernel (one a rank and pass), its
    # dense call queued and dropped. Rank r reads r + 1 pieces (its own
    # diagonal and those before): twice r + 1 dense calls a pass.
    for rank, r in enumerate(results):
        assert r["same"], f"rank {rank}"
        assert r["calls"] == {"forward": 2 * rank + 2, "backward": 2 * rank + 2}, f"rank {rank}"
        assert r["kernel"] == {"forward": 1, "backward": 1}, f"rank {rank}"


def _reads_of(fn, log: list[int]):
    """``fn`` (a ring pass), appending the host reads of each outermost call to ``log``."""
    depth = [0]

    def run(*args, **kwargs):
        if depth[0]:  # the pass run again (non-finite K/V): the same pass's reads
            return fn(*args, **kwargs)
        depth[0] += 1
        try:
            with OpLog() as ops_:
                res = fn(*args, **kwargs)
        finally:
            depth[0] -= 1
        # bool() of a tensor (the plan's index reads, .item() of host tensors, are not counted)
        log.append(sum(op in ("is_nonzero", "_local_scalar_dense") for op in ops_.ops))
        return res

    return run


def _reads_worker(rank: int, world: int) -> dict:
    """Plain dense attention with the dense route forced on the CPU stand-in, causal and not,
    K/V finite and with a NaN key on the last rank: each pass's host reads and results, with
    the ring's one check a pass and with each block checking its own (the tree before)."""
    from ring_attention.parallel import ring
    from ring_attention.parallel.api import ring_dilated_attention

    n = 37
    g = torch.Generator().manual_seed(11)
    q, k, v, go = (torch.randn(2, n, 2, 8, generator=g) for _ in range(4))
    bad_k = k.clone()
    bad_k[1, n - 2, 0, 3] = float("nan")  # the last rank's piece
    os.environ[config.FORWARD] = os.environ[config.BACKWARD] = "dense"
    saved = ring.schedule_forward, ring.schedule_backward, ring.pass_check
    out = {}
    try:
        for causal in (False, True):
            for bad in (False, True):
                runs = []
                for per_block in (False, True):
                    reads: dict[str, list[int]] = {"forward": [], "backward": []}
                    ring.schedule_forward = _reads_of(saved[0], reads["forward"])
                    ring.schedule_backward = _reads_of(saved[1], reads["backward"])
                    ring.pass_check = (lambda *_a: None) if per_block else saved[2]
                    ql, kl, vl = (
                        shard_sequence(t).clone().requires_grad_()
                        for t in (q, bad_k if bad else k, v)
                    )
                    o, lse = ring_dilated_attention(
                        ql, kl, vl, [n], [1], causal=causal, return_lse=True
                    )
                    (o * shard_sequence(go)).sum().backward()
                    runs.append(([o, lse, ql.grad, kl.grad, vl.grad], reads))
                (mine, reads), (before, reads_before) = runs
                same = all(
                    torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
                    for a, b in zip(mine, before, strict=True)
                )
                out[f"{causal}-{bad}"] = {"reads": reads, "before": reads_before, "same": same}
    finally:
        ring.schedule_forward, ring.schedule_backward, ring.pass_check = saved
        del os.environ[config.FORWARD], os.environ[config.BACKWARD]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ring_dense_one_finiteness_read_a_pass(world: int) -> None:
    """The ring's K/V check is read on the host once a pass (forward, backward), not once a
    dense block as before (each block's read, asserted here on the tree before: the blocks);
    results bit for bit those of the check per block, finite or with a NaN key on one rank
    (then every rank runs the pass again, checking each block: our kernel's answer)."""
    for rank, r in enumerate(run_distributed(_reads_worker, world, timeout=300)):
        for case, c in r.items():
            causal = case.startswith("True")
            blocks = expected_blocks(37, world, rank, "contiguous", causal)
            where = f"rank {rank}, causal-bad {case}"
            assert c["same"], where
            assert c["before"] == {"forward": [blocks], "backward": [blocks]}, where
            if case.endswith("False"):  # finite
                assert c["reads"] == {"forward": [1], "backward": [1]}, where
            else:  # the pass's read, then the blocks' (each a read, as before)
                assert c["reads"] == {"forward": [1 + blocks], "backward": [1 + blocks]}, where


def test_block_kind() -> None:
    assert block_kind(False, 10, 5, 40, 7) == "full"
    assert block_kind(True, 10, 5, 0, 11) == "full"  # last key 10 = first query
    assert block_kind(True, 10, 5, 0, 12) is None  # cut across the diagonal
    assert block_kind(True, 10, 5, 10, 5) == "causal"
    assert block_kind(True, 10, 5, 15, 3) == "skip"
    assert block_kind(True, 10, 0, 0, 3) == "skip"


def test_block_shape() -> None:
    halves = (0, 32, 64)
    assert block_shape(Pattern([64], [1], causal=True), 64, halves)[0] == "dense"
    assert block_shape(Pattern([1 << 40], [1]), 64, halves)[0] == "dense"
    assert block_shape(Pattern([32], [1]), 64, halves)[0] == "local"
    assert block_shape(Pattern([16, 32], [1, 2]), 64, halves)[0] == "local"
    assert block_shape(Pattern([16, 32], [1, 2]), 64, (0, 21, 43, 64))[0] == "dilated"
    assert block_shape(Pattern([64], [2]), 64, halves)[0] == "dilated"
    assert block_shape(Pattern([64, 64], [1, 1]), 64, halves)[0] == "dilated"
    assert block_shape(Pattern([64], [1], window=(8, 0)), 64, halves) == (None, "a sliding window")
    assert block_shape(Pattern([64], [1]).with_documents([0, 10, 64]), 64, halves) == (
        None,
        "documents",
    )


def test_route_blocks_tables(monkeypatch) -> None:
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    # auto on CUDA: the path table's rows (backward always, forward at d 128
    # always and at d 64 from 131072 rows)
    assert decide_blocks("backward", "auto", "auto", cuda, (9, 0), bf16, 4096, 8, 2, 64, 1).dense
    assert decide_blocks("forward", "auto", "auto", cuda, (9, 0), bf16, 4096, 8, 8, 128, 1).dense
    assert decide_blocks("forward", "auto", "auto", cuda, (9, 0), bf16, 131072, 8, 8, 64, 1).dense
    assert not decide_blocks("forward", "auto", "auto", cuda, (9, 0), bf16, 4096, 8, 8, 64, 1).dense
    # no backend takes fp32 on CUDA; cudnn named but rows not a multiple of 128 -> the next one
    f32 = decide_blocks("backward", "dense", "auto", cuda, (9, 0), torch.float32, 64, 8, 8, 64, 1)
    assert not f32.dense
    named = decide_blocks("forward", "dense", "cudnn", cuda, (9, 0), bf16, 4096, 8, 8, 64, 37)
    assert named.dense and named.backends[0][0] != "cudnn"
    # on the CPU: auto keeps our kernels, dense takes the stand-in, kernel forces ours
    q, k = torch.zeros(1, 8, 4, 16), torch.zeros(1, 8, 2, 16)
    p = Pattern([64], [1], causal=True)
    for env, dense in (("auto", False), ("dense", True), ("kernel", False)):
        monkeypatch.setenv(config.FORWARD, env)
        r = route_blocks("forward", q, k, p, 64, (0, 32, 64), 8)
        assert r.dense == dense, r.why
        if dense:
            assert r.backends == (("cpu",),)


@pytest.mark.parametrize("kernel_max_n", [32768, 64])
def test_the_gpu_script_runs_on_the_cpu(tmp_path, monkeypatch, kernel_max_n) -> None:
    """benchmarks/ring_dense_check.py --dry-run: the checks pass, every record
    reaches the file, and our kernels' ring is timed only up to --kernel-max-n;
    the dilated blocks (LongNet's pattern, scaled down) agree dense against our
    kernels, causal and not, every planned dense call made, and are timed both
    ways."""
    from benchmarks import ring_dense_check

    for env in (config.FORWARD, config.BACKWARD):  # the script sets them: restored after
        monkeypatch.setenv(env, "auto")
    args = ["--dry-run", "--out", str(tmp_path), "--kernel-max-n", str(kernel_max_n)]
    assert ring_dense_check.main(args) == 0
    recs = [json.loads(x) for x in (tmp_path / "ring_dense_rank0.jsonl").read_text().splitlines()]
    checks = [r for r in recs if r["stage"] == "check"]
    assert [r["status"] for r in checks] == ["ok", "ok"]
    timed = {(r["method"], r["pass"]) for r in recs if r["stage"] == "time"}
    methods = {"ring_dense", "direct"} | ({"ring_kernel"} if kernel_max_n >= 96 else set())
    assert timed == {(m, p) for m in methods for p in ("fwd", "fwdbwd")}
    dilated = [r for r in recs if r["stage"] == "dilated_check"]
    assert [(r["causal"], r["status"]) for r in dilated] == [(True, "ok"), (False, "ok")]
    assert all(r["blocks"] == 2 and r["segments"] == [8, 16, 32, 64, 128] for r in dilated)
    for r in dilated:  # every planned call made densely (none fell back to our kernel)
        planned = r["planned_calls"]
        assert planned > 0 and r["dense_calls"] == {"forward": planned, "backward": planned}
    timed = {(r["causal"], r["method"], r["pass"]) for r in recs if r["stage"] == "dilated"}
    assert timed == {(c, m, p) for c in (True, False) for m in ("dense", "kernel")
                     for p in ("fwd", "fwdbwd")}  # fmt: skip


def _modes_worker(rank: int, world: int) -> str:
    """Rank 1 forces the dense forward, the others not: every rank raises."""
    from ring_attention.parallel.api import ring_dilated_attention

    if rank == 1:
        os.environ[config.FORWARD] = "dense"
    x = torch.zeros(1, 8, 2, 8)
    try:
        ring_dilated_attention(x, x, x, [8 * world], [1])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ring_ranks_disagreeing_on_the_dense_mode_raise() -> None:
    """Whether a pass checks K/V over the ranks follows the mode: ranks must agree on it (a
    rank posting the check alone would hang), else every rank raises naming the variable."""
    for message in run_distributed(_modes_worker, 3):
        assert "ranks disagree on RING_ATTENTION_FORWARD/BACKWARD" in message, message
        assert "['auto/auto', 'dense/auto', 'auto/auto']" in message, message
