"""A small bounded, thread-safe LRU cache with hit/miss counters."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["LRUCache"]

V = TypeVar("V")


class LRUCache(Generic[V]):
    """A thread-safe LRU cache bounded in entries and in bytes (exchange plans,
    pattern matrices).

    Args:
        maxsize: the most entries kept.
        max_bytes: the most bytes kept (``None``: no byte bound); the least
            recently used entries are evicted until both bounds hold, and a
            value larger than ``max_bytes`` is returned without being kept.
        size_of: the size in bytes of a value (required with ``max_bytes``).

    Attributes:
        hits: lookups answered from the cache.
        misses: lookups that built a value.
        nbytes: bytes of the values kept (0 without ``size_of``).

    Both bounds can be changed at run time (``cache.maxsize = ...``,
    ``cache.max_bytes = ...``); they take effect at the next insertion.
    """

    def __init__(
        self,
        maxsize: int = 64,
        *,
        max_bytes: int | None = None,
        size_of: Callable[[V], int] | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        if max_bytes is not None and size_of is None:
            raise ValueError("max_bytes needs size_of (the size in bytes of a value)")
        self.maxsize = int(maxsize)
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.nbytes = 0
        self._size_of = size_of
        self._data: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.RLock()

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
            self.hits = 0
            self.misses = 0
            self.nbytes = 0

    def info(self) -> dict[str, int]:
        """``{"hits", "misses", "size", "maxsize"}`` (``nbytes`` and
        ``max_bytes`` are attributes)."""
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "size": len(self._data),
                "maxsize": self.maxsize,
            }

    def __repr__(self) -> str:
        i = self.info()
        return (
            f"LRUCache(maxsize={i['maxsize']}, size={i['size']}, hits={i['hits']}, "
            f"misses={i['misses']}, nbytes={self.nbytes}, max_bytes={self.max_bytes})"
        )
