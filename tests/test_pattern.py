"""The Pattern value (ring_attention/core/pattern.py) and the argument contract of
docs/design.md §6 that it carries: pattern values are Python/NumPy integers or
0-d integer tensors, flags are bool, cu_seqlens is a 1-D non-decreasing
integer sequence from 0 to seq; and the byte-bounded caches."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import ring_attention as ra
from ring_attention.core.cache import LRUCache
from ring_attention.core.multiplicity import PATTERN_CACHE
from ring_attention.core.pattern import Pattern, head_group_bounds, head_offset


def qkv(n: int = 16, heads: int = 4, d: int = 8, kv_heads: int | None = None):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, heads, d, generator=g)
    k, v = (torch.randn(1, n, kv_heads or heads, d, generator=g) for _ in range(2))
    return q, k, v


# ------------------------------------------------------------------ values


@pytest.mark.parametrize(
    "segs,dils",
    [
        ([4, 8], [1, 2]),
        ((4, 8), (1, 2)),
        ([np.int64(4), np.int32(8)], [np.int16(1), 2]),
        ([torch.tensor(4), torch.tensor(8)], [torch.tensor(1), torch.tensor(2, dtype=torch.int32)]),
        (torch.tensor([4, 8]), torch.tensor([1, 2])),
        (np.array([4, 8]), np.array([1, 2])),
    ],
)
def test_integer_kinds_normalise_to_one_value(segs, dils) -> None:
    p = Pattern(segs, dils)
    assert p == Pattern([4, 8], [1, 2])
    assert hash(p) == hash(Pattern([4, 8], [1, 2]))
    assert p.segment_lengths == (4, 8) and all(type(w) is int for w in p.segment_lengths)


@pytest.mark.parametrize("scalar", [8, np.int64(8), torch.tensor(8)])
def test_one_integer_is_a_one_branch_pattern(scalar) -> None:
    assert Pattern(scalar, 2) == Pattern([8], [2])
    q, k, v = qkv()
    assert torch.equal(
        ra.dilated_attention(q, k, v, scalar, 2), ra.dilated_attention(q, k, v, [8], [2])
    )


@pytest.mark.parametrize(
    "segs,dils,match",
    [
        ([], [], "segment_lengths"),
        ([4, 8], [1], "same length"),
        ([0], [1], r"segment_lengths\[0\]"),
        ([4], [0], r"dilation_rates\[0\]"),
        ([4], [5], r"dilation_rates\[0\]"),
        ([4.0], [1], r"segment_lengths\[0\]"),
        ([True], [1], r"segment_lengths\[0\]"),
        ([4], ["1"], r"dilation_rates\[0\]"),
        ("48", [1, 1], "segment_lengths"),
        ([torch.tensor([4, 8])], [1], r"segment_lengths\[0\]"),
        ([torch.tensor(4.0)], [1], r"segment_lengths\[0\]"),
        (None, [1], "segment_lengths"),
    ],
)
def test_bad_values_raise_naming_the_argument(segs, dils, match) -> None:
    with pytest.raises(ValueError, match=match):
        Pattern(segs, dils)
    q, k, v = qkv()
    with pytest.raises(ValueError, match=match):
        ra.dilated_attention(q, k, v, segs, dils)


@pytest.mark.parametrize("flag", ["causal", "head_groups", "return_lse"])
@pytest.mark.parametrize("value", ["no", "", 1, 0, None, torch.tensor(True)])
def test_flags_must_be_bool(flag, value) -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=flag):
        ra.dilated_attention(q, k, v, [4], [1], **{flag: value})


def test_numpy_bool_is_a_flag() -> None:
    q, k, v = qkv()
    a = ra.dilated_attention(q, k, v, [4, 8], [1, 2], causal=np.bool_(True))
    assert torch.equal(a, ra.dilated_attention(q, k, v, [4, 8], [1, 2], causal=True))


def test_flags_are_checked_in_the_modules_and_the_ring() -> None:
    with pytest.raises(ValueError, match="causal"):
        ra.DilatedAttention([4], [1], causal="no")
    with pytest.raises(ValueError, match="head_groups"):
        ra.RingDilatedAttention([4, 8], [1, 2], head_groups="no")
    q, k, v = qkv()
    with pytest.raises(ValueError, match="causal"):
        ra.ring_dilated_attention(q, k, v, [4], [1], causal="yes")


def test_head_offsets_option() -> None:
    with pytest.raises(ValueError, match="head_offsets"):
        Pattern([4], [2], head_offsets="torchscale")
    assert Pattern([4], [2]) != Pattern([4], [2], head_offsets="grouped")


def test_head_dim_zero_names_head_dim() -> None:
    q = torch.randn(1, 8, 2, 0)
    with pytest.raises(ValueError, match="head_dim"):
        ra.dilated_attention(q, q, q, [4], [1])
    with pytest.raises(ValueError, match="head_dim"):
        ra.ring_dilated_attention(q, q, q, [4], [1])


def test_digest_is_the_same_in_every_process() -> None:
    p = Pattern([4, 8], [1, 2], causal=True, head_offsets="grouped").with_documents([0, 3, 16])
    code = (
        "from ring_attention.core.pattern import Pattern; print(Pattern([4, 8], [1, 2], "
        "causal=True, head_offsets='grouped').with_documents([0, 3, 16]).digest())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == p.digest()
    others = [
        Pattern([4, 8], [1, 2]),
        Pattern([4, 8], [1, 2], causal=True),
        Pattern([4, 8], [1, 2], causal=True, head_offsets="grouped"),
        Pattern([4, 8], [1, 2], causal=True, head_offsets="grouped").with_documents([0, 4, 16]),
    ]
    assert len({o.digest() for o in others} | {p.digest()}) == 5
    assert 0 <= p.digest() < 2**63


# ------------------------------------------------------------- documents


@pytest.mark.parametrize(
    "cu",
    [
        [0, 5, 5, 16],
        (0, 16),
        torch.tensor([0, 1, 16]),
        torch.tensor([0, 7, 16], dtype=torch.int32),
        np.array([0, 9, 16]),
    ],
)
def test_documents_accept_integer_sequences(cu) -> None:
    p = Pattern([4], [1]).with_documents(cu)
    assert p.documents[0] == 0 and p.documents[-1] == 16
    assert all(type(x) is int for x in p.documents)
    assert p.with_documents(None) == Pattern([4], [1])


@pytest.mark.parametrize(
    "cu,match",
    [
        (torch.tensor([[0, 16]]), "1-D"),
        (torch.tensor([0.0, 16.0]), "integer"),
        (torch.tensor([True, False]), "integer"),
        ([], "empty"),
        ([1, 16], "start at 0"),
        ([0, 9, 8, 16], r"non-decreasing, got cu_seqlens\[1\] = 9 > cu_seqlens\[2\] = 8"),
        (torch.tensor([0, 9, 8, 16]), r"cu_seqlens\[1\] = 9 > cu_seqlens\[2\] = 8"),
        (torch.tensor([2, 1, 16]), "start at 0"),
        (torch.tensor([], dtype=torch.int64), "empty"),
        ("0,16", "cu_seqlens"),
        ([0, 2.5, 16], r"cu_seqlens\[1\]"),
    ],
)
def test_bad_documents_raise(cu, match) -> None:
    with pytest.raises(ValueError, match=match):
        Pattern([4], [1]).with_documents(cu)


def test_documents_must_end_at_the_sequence_length() -> None:
    p = Pattern([4], [1]).with_documents([0, 5, 15])
    with pytest.raises(ValueError, match=r"cu_seqlens.*16"):
        p.check_length(16)
    p.check_length(15)


def test_many_documents_are_checked_without_a_python_loop_per_document() -> None:
    # 100k boundaries: a per-element Python check would take ~0.1 s; a
    # vectorised one is far cheaper. Only correctness is asserted here.
    cu = torch.arange(0, 200_001, 2)
    p = Pattern([4], [1]).with_documents(cu)
    assert len(p.documents) == cu.numel()
    bad = cu.clone()
    bad[50_000] = 0
    with pytest.raises(ValueError, match=r"cu_seqlens\[49999\] = 99998 > cu_seqlens\[50000\] = 0"):
        Pattern([4], [1]).with_documents(bad)


def test_with_documents_does_not_check_the_pattern_again(monkeypatch) -> None:
    """with_documents copies a checked pattern: only the documents are checked."""
    import ring_attention.core.pattern as pattern_module

    p = Pattern([4, 8], [1, 2], causal=True, head_offsets="grouped")

    def checked_again(*args, **kwargs):
        raise AssertionError("the pattern was checked again")

    monkeypatch.setattr(pattern_module, "_as_ints", checked_again)
    monkeypatch.setattr(pattern_module, "as_flag", checked_again)
    q = p.with_documents([0, 3, 12])
    assert q.documents == (0, 3, 12) and q.branches == p.branches and q.causal
    assert q.head_offsets == "grouped" and q.with_documents(None) == p
    with pytest.raises(ValueError, match="non-decreasing"):  # the documents still are
        p.with_documents([0, 5, 3])


# ----------------------------------------------------------- head offsets


def test_head_group_bounds() -> None:
    assert head_group_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert head_group_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("heads", [1, 3, 4, 6, 7, 12])
@pytest.mark.parametrize("r", [1, 2, 3, 4, 5])
def test_grouped_offsets_follow_torchscale(heads: int, r: int) -> None:
    """torchscale pads heads to a multiple of r, splits them as (r, heads/r)
    and keeps the diagonal of (position mod r, head group): the offset of head
    h is the index of its group, h // ceil(heads / r)."""
    per = -(-heads // r)
    padded = torch.arange(per * r).reshape(r, per)  # (r2 h) -> r2 = offset
    for h in range(heads):
        (row,) = torch.nonzero((padded == h).any(dim=1)).flatten().tolist()
        assert head_offset(h, r, heads, "grouped") == row
        assert head_offset(h, r, heads, "modulo") == h % r


# ------------------------------------------------------------------ caches


def test_lru_cache_is_bounded_in_bytes() -> None:
    cache: LRUCache[bytes] = LRUCache(maxsize=10, max_bytes=100, size_of=len)
    for i in range(5):
        cache.get(i, lambda: b"x" * 40)
    assert len(cache) == 2 and cache.nbytes == 80  # the three oldest went
    assert 4 in cache and 3 in cache
    big = cache.get("big", lambda: b"y" * 101)  # larger than the bound: not kept
    assert len(big) == 101 and "big" not in cache and cache.nbytes == 80
    cache.max_bytes = 40
    cache.get(9, lambda: b"z" * 10)
    assert cache.nbytes <= 40
    with pytest.raises(ValueError, match="size_of"):
        LRUCache(max_bytes=10)


def test_attention_weights_cache_stays_within_its_byte_bound() -> None:
    """need_weights=True (nn.MultiheadAttention's default) over many lengths
    keeps at most PATTERN_CACHE.max_bytes alive."""
    PATTERN_CACHE.clear()
    old = PATTERN_CACHE.max_bytes
    PATTERN_CACHE.max_bytes = 4 * 2**20
    try:
        m = ra.MultiheadDilatedAttention(
            16, 4, batch_first=True, segment_lengths=[8, 32], dilation_rates=[1, 2]
        )
        for n in range(300, 332):  # 4 heads * n * n * 4 bytes: ~1.5 MiB each
            x = torch.randn(1, n, 16)
            m(x, x, x)
            assert PATTERN_CACHE.nbytes <= PATTERN_CACHE.max_bytes
        assert 0 < len(PATTERN_CACHE) <= 2
    finally:
        PATTERN_CACHE.max_bytes = old
        PATTERN_CACHE.clear()
