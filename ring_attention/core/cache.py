"""Every cache of the package in one registry (:func:`cache_info`, :func:`clear_caches`), and its
two kinds: :class:`LRUCache` and :class:`PerBatch`."""

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch

V = TypeVar("V")
C = TypeVar("C")

_REGISTRY: dict[str, Any] = {}
_REGISTRY_LOCK = threading.Lock()


def register(name: str, cache: C) -> C:
    """Add ``cache`` to the registry under ``name`` (anything with ``info()`` and ``clear()``, or
    a ``functools`` cache); returns it."""
    with _REGISTRY_LOCK:
        if name in _REGISTRY and _REGISTRY[name] is not cache:
            raise ValueError(f"a cache is already registered as {name!r}")
        _REGISTRY[name] = cache
    return cache


def cached(name: str, maxsize: int | None = None) -> Callable[[Callable[..., V]], Callable[..., V]]:
    """``functools.lru_cache(maxsize)`` (``None``: unbounded), registered as ``name``."""
    return lambda fn: register(name, functools.lru_cache(maxsize=maxsize)(fn))


def _info_of(cache: Any) -> dict[str, Any]:
    if hasattr(cache, "cache_info"):  # functools
        i = cache.cache_info()
        return {"entries": i.currsize, "bytes": 0, "cap": i.maxsize, "hits": i.hits,
                "misses": i.misses}  # fmt: skip
    if isinstance(cache, LRUCache):
        i = cache.info()
        return {"entries": i["size"], "bytes": cache.nbytes, "cap": i["maxsize"],
                "hits": i["hits"], "misses": i["misses"]}  # fmt: skip
    return cache.info()


def cache_info() -> dict[str, dict[str, Any]]:
    """Every cache of the package: ``{name: {"entries", "bytes", "cap", "hits", "misses"}}``."""
    with _REGISTRY_LOCK:
        caches = dict(_REGISTRY)
    return {name: _info_of(cache) for name, cache in sorted(caches.items())}


def clear_caches() -> None:
    """Empty every cache of the package (the values are rebuilt on demand)."""
    with _REGISTRY_LOCK:
        caches = list(_REGISTRY.values())
    for cache in caches:
        (cache.cache_clear if hasattr(cache, "cache_clear") else cache.clear)()


class LRUCache(Generic[V]):
    """A thread-safe LRU cache bounded in entries (``maxsize``) and in bytes (``max_bytes``, with
    ``size_of``; a larger value is returned, not kept), registered as ``name``; counts
    ``hits``, ``misses`` and ``nbytes``."""

    def __init__(
        self, maxsize: int = 64, *, name: str | None = None, max_bytes: int | None = None,
        size_of: Callable[[V], int] | None = None,
    ) -> None:  # fmt: skip
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        if max_bytes is not None and size_of is None:
            raise ValueError("max_bytes needs size_of (the size in bytes of a value)")
        self.maxsize = int(maxsize)
        self.max_bytes = max_bytes
        self.hits = self.misses = self.nbytes = 0
        self._size_of = size_of
        self._data: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.RLock()
        if name is not None:
            register(name, self)

    def get(self, key: Hashable, build: Callable[[], V]) -> V:
        """The value under ``key``, built with ``build()`` on a miss."""
        with self._lock:
            entry = self._data.get(key)
            if entry is not None:
                self._data.move_to_end(key)
                self.hits += 1
                return entry[0]
            self.misses += 1
            value = build()
            size = self._size_of(value) if self._size_of is not None else 0
            if self.max_bytes is not None and size > self.max_bytes:
                return value  # too large to keep
            self._data[key] = (value, size)
            self.nbytes += size
            while len(self._data) > self.maxsize or (
                self.max_bytes is not None and self.nbytes > self.max_bytes
            ):
                _, (_, dropped) = self._data.popitem(last=False)
                self.nbytes -= dropped
            return value

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        with self._lock:
            self._data.clear()
            self.hits = self.misses = self.nbytes = 0

    def info(self) -> dict[str, int]:
        """``{"hits", "misses", "size", "maxsize"}``."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._data),
                    "maxsize": self.maxsize}  # fmt: skip

    def __repr__(self) -> str:
        i = self.info()
        return (
            f"LRUCache(maxsize={i['maxsize']}, size={i['size']}, hits={i['hits']}, "
            f"misses={i['misses']}, nbytes={self.nbytes}, max_bytes={self.max_bytes})"
        )


class PerBatch:
    """Values derived from one batch's tensor (a mask, ``cu_seq_lens_q``), reused by every layer
    while the tensor is the same object at the same version."""

    def __init__(self, name: str) -> None:
        self._source: tuple[weakref.ref, int] | None = None
        self._values: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        register(name, self)

    def get(self, source: torch.Tensor, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value under ``key`` for the batch of ``source``, built on a miss."""
        version = source._version if not source.is_inference() else -1
        with self._lock:
            if not (self._source and self._source[0]() is source and self._source[1] == version):
                self._source, self._values = (weakref.ref(source), version), {}
            if key in self._values:
                self.hits += 1
                return self._values[key]
            self.misses += 1
        value = build()
        with self._lock:
            if self._source is not None and self._source[0]() is source:
                self._values[key] = value
        return value

    def clear(self) -> None:
        with self._lock:
            self._source, self._values = None, {}
            self.hits = self.misses = 0

    def info(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._values), "bytes": 0, "cap": None, "hits": self.hits,
                    "misses": self.misses}  # fmt: skip
