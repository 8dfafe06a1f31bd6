"""Every cache of the package sits in one registry: ``ra.cache_info()`` lists
it (entries, bytes, cap, hits, misses) and ``ra.clear_caches()`` empties it.
A cache built outside the registry fails the scan of live objects."""

from __future__ import annotations

import functools
import gc

import pytest
import torch

import ring_attention as ra
import ring_attention.hf  # its caches register on import
from ring_attention.core.cache import LRUCache, PerBatch, cache_info
from ring_attention.parallel.testing import run_distributed

KEYS = {"entries", "bytes", "cap", "hits", "misses"}


def _ring_entries(rank: int, world: int) -> dict:
    q = torch.randn(1, 50, 4, 8, requires_grad=True)
    ra.ring_dilated_attention(q, q, q, [16, 32], [1, 2], causal=True).sum().backward()
    before = ra.cache_info()
    ra.clear_caches()
    return {"before": before, "after": ra.cache_info()}


def test_every_cache_is_listed_and_cleared() -> None:
    q = torch.randn(2, 100, 4, 16, requires_grad=True)
    ra.dilated_attention(q, q, q, [16, 32], [1, 2], causal=True).sum().backward()
    info = ra.cache_info()
    assert info and all(set(v) == KEYS for v in info.values()), info
    assert info["config rows"]["entries"] >= 1 or info["dense routes"]["entries"] >= 1
    ra.clear_caches()
    assert all(v["entries"] == 0 for v in ra.cache_info().values()), ra.cache_info()


def test_the_ring_fills_its_caches_and_clear_empties_them() -> None:
    res = run_distributed(_ring_entries, 2)[0]
    before, after = res["before"], res["after"]
    assert before["exchange plans"]["entries"] >= 1 and before["ring call specs"]["entries"] >= 1
    assert all(v["entries"] == 0 for v in after.values()), after


@pytest.mark.filterwarnings("ignore::FutureWarning")  # isinstance on deprecated torch names
def test_no_cache_lives_outside_the_registry() -> None:
    registered = {id(c) for c in _registry_objects()}
    q = torch.randn(1, 64, 2, 8)
    ra.dilated_attention(q, q, q, [16], [2])
    stray = [o for o in _live() if isinstance(o, (LRUCache, PerBatch)) and id(o) not in registered]
    assert not stray, stray
    package_lru = [
        o
        for o in _live()
        if isinstance(o, functools._lru_cache_wrapper)
        and getattr(o, "__module__", "").startswith("ring_attention")
        and id(o) not in registered
    ]
    assert not package_lru, [f"{f.__module__}.{f.__qualname__}" for f in package_lru]


def _live() -> list:
    """The objects the collector tracks, less dead weak proxies (whose
    ``isinstance`` raises ``ReferenceError``)."""
    out = []
    for o in gc.get_objects():
        try:
            isinstance(o, LRUCache)
        except ReferenceError:
            continue
        out.append(o)
    return out


def _registry_objects():
    from ring_attention.core import cache

    return list(cache._REGISTRY.values())


def test_cache_info_names_are_stable() -> None:
    names = set(cache_info())
    for expected in ("exchange plans", "pattern matrices", "dense routes", "span plans",
                     "ring call specs", "transformers masks"):  # fmt: skip
        assert expected in names, names
