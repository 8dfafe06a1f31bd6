"""A small bounded, thread-safe LRU cache with hit/miss counters."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["LRUCache"]

V = TypeVar("V")


class LRUCache(Generic[V]):
    """A bounded, thread-safe LRU cache with hit/miss counters (exchange
    plans, pattern matrices).

    Attributes:
        maxsize: the most entries kept; the least recently used is evicted.
        hits: lookups answered from the cache.
        misses: lookups that built a value.
    """

    def __init__(self, maxsize: int = 64) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = int(maxsize)
        self.hits = 0
        self.misses = 0
        self._data: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.RLock()

    def get(self, key: Hashable, build: Callable[[], V]) -> V:
        """The value under ``key``, built with ``build()`` on a miss."""
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
                self.hits += 1
                return value
            self.misses += 1
            value = build()
            self._data[key] = value
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
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

    def info(self) -> dict[str, int]:
        """``{"hits", "misses", "size", "maxsize"}``."""
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
            f"LRUCache(maxsize={i['maxsize']}, size={i['size']}, "
            f"hits={i['hits']}, misses={i['misses']})"
        )
