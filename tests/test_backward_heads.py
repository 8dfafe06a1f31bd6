"""The ring's backward by head groups (``RING_ATTENTION_BACKWARD_HEADS``): gradients bit-equal to
one group's at every group size, on real gloo processes (the ring at world 3, the hybrid at 4)."""

from __future__ import annotations

import os

import pytest
import torch

from ring_attention.core.config import BACKWARD_HEADS, backward_heads
from ring_attention.core.geometry import head_groups
from ring_attention.parallel.testing import run_distributed

# n, heads, kv_heads, segments, dilations, causal, layout, dtype, documents, window
CASES = [
    (45, 4, 4, [8, 16], [1, 2], True, "zigzag", torch.float32, None, None),
    (47, 6, 2, [16, 48], [1, 4], False, "contiguous", torch.bfloat16, None, None),
    (48, 4, 2, [48], [1], True, "contiguous", torch.float32, [0, 10, 30, 48], None),
    (45, 3, 3, [45], [1], False, "contiguous", torch.bfloat16, None, (7, 3)),
]
SETTINGS = ["1", "2", "3", "auto"]  # against "all"


def _grads(case, kw: dict, setting: str, rank: int, world: int) -> list[torch.Tensor]:
    import ring_attention as ra

    n, H, KVH, segs, dils, causal, layout, dtype, docs, window = case
    os.environ[BACKWARD_HEADS] = setting
    g = torch.Generator().manual_seed(11)
    q, go = (torch.randn(2, n, H, 8, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, n, KVH, 8, generator=g).to(dtype) for _ in range(2))
    q, k, v, go = (ra.shard_sequence(t, layout=layout, **kw).contiguous() for t in (q, k, v, go))
    for t in (q, k, v):
        t.requires_grad_()
    kw = dict(kw, causal=causal, layout=layout, cu_seqlens=docs, window=window, return_lse=True)
    out, lse = ra.ring_dilated_attention(q, k, v, segs, dils, **kw)
    glse = torch.randn(lse.shape, generator=g).to(lse.dtype)  # a gradient reaching lse too
    torch.autograd.backward([out, lse], [go, glse])
    return [t.grad for t in (q, k, v)]


def _worker(rank: int, world: int, hybrid: bool, far: str) -> list[bool]:
    import torch.distributed as dist

    os.environ["RING_ATTENTION_FAR_BYTES"] = far  # a group's far transfers: the whole call's

    kw: dict = {}
    if hybrid:  # 2 x 2: ring across rows, Ulysses inside one
        rows = [dist.new_group(r) for r in ([0, 1], [2, 3])]
        cols = [dist.new_group(c) for c in ([0, 2], [1, 3])]
        kw = dict(ulysses_group=rows[rank // 2], group=cols[rank % 2])
    equal = []
    for case in CASES:
        want = _grads(case, kw, "all", rank, world)
        for setting in SETTINGS:
            got = _grads(case, kw, setting, rank, world)
            equal.append(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))
    return equal


# far: some transfers in the far group; every one (a group's far dK/dV return finishes behind
# the next group's local blocks)
@pytest.mark.parametrize(
    "world, hybrid, far",
    [(3, False, "off"), (3, False, "3000"), (5, False, "1000000000"), (4, True, "off")],
)
def test_grouped_backward_is_bit_equal(world: int, hybrid: bool, far: str) -> None:
    results = run_distributed(_worker, world, hybrid, far)
    assert all(all(r) for r in results), results


def test_group_sizes_hold_whole_kv_heads() -> None:
    assert backward_heads(16, 1, 2, "all") == 0
    assert backward_heads(16, 1, 2, "auto") == 2  # 3 * 2 * 4 bytes <= 16 * 2
    assert backward_heads(16, 1, 4, "auto") == 0  # fp32: its gradients are its accumulators
    assert backward_heads(8, 4, 2, "3") == 4 and backward_heads(8, 4, 2, "5") == 4
    assert backward_heads(8, 4, 2, "8") == 0  # one group
    assert head_groups(5, 1, 2) == [(0, 2, 0, 2), (2, 4, 2, 4), (4, 5, 4, 5)]
    # heads 3..5 of a hybrid's rank, 2 query heads per K/V head: kv 1 and 2 locally 0 and 1
    assert head_groups(3, 2, 2, 3) == [(0, 1, 0, 1), (1, 3, 1, 2)]
    with pytest.raises(ValueError, match=BACKWARD_HEADS):
        backward_heads(4, 1, 4, "0")


def _disagreeing_worker(rank: int, world: int) -> str:
    import ring_attention as ra

    os.environ[BACKWARD_HEADS] = "1" if rank == 0 else "all"
    q = torch.randn(1, 8, 2, 4, requires_grad=True)
    try:
        ra.ring_dilated_attention(q, q, q, [24], [1])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_disagree_on_the_groups_raise_on_every_rank() -> None:
    for message in run_distributed(_disagreeing_worker, 3):
        assert BACKWARD_HEADS in message and "[1, 0, 0]" in message, message


def test_the_planner_advises_the_most_heads_per_group_that_fit() -> None:
    from ring_attention.planner.capacity import Setup, evaluate

    shape = dict(heads=8, kv_heads=8, head_dim=64, batch=1, dtype="bfloat16", reserve=0)
    base = dict(ranks=4, device="cuda", backward_heads="auto", source="analytic", **shape)
    roomy = evaluate(Setup(memory=10**12, **base), 2**16)
    assert roomy.group_heads == 0  # everything fits: one group, no extra transfers
    peaks = {g: max(m.training_peak for m in roomy.memories_with(g)) for g in (0, 4, 2, 1)}
    # (half the heads a group: the slices' copies cost more than the accumulators save)
    assert peaks[4] > peaks[0] > peaks[2] > peaks[1]
    tight = evaluate(Setup(memory=peaks[2], **base), 2**16)
    assert tight.group_heads == 2 and tight.training_peak == peaks[2]
    # one ring pass per group: each step's latency paid 4 times in the backward
    assert tight.times[0].forward_backward > roomy.times[0].forward_backward
    assert tight.times[0].forward == roomy.times[0].forward
