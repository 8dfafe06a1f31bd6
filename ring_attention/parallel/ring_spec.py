"""A ring call's configuration, named by a string (docs/design.md §8): a
:class:`RingSpec` registered under a key of its contents."""

import operator
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.cache import register
from ..core.pattern import Pattern


class GroupError(ValueError):
    """``group`` is not a process group (the ring cannot know its peers)."""


@dataclass(frozen=True, eq=False)
class RingSpec:
    """One ring call's configuration (all but its tensors); ``pattern`` is
    ``None`` exactly when ``error`` is set; the group is held weakly."""

    pattern: Pattern | None
    error: BaseException | None
    scale: float | None
    layout: str
    fold: int
    _group: weakref.ref | None  # None: the default group
    ranks: tuple[int, ...] | None = None  # global ranks by ring index (None: group order)
    # a hybrid ring's query heads: (head_start, total_heads, total_kv_heads); (0, 0, 0): all
    head_range: tuple[int, int, int] = (0, 0, 0)
    # the attention sinks' description (core.checks.sinks_meta), checked by every rank
    sinks: tuple | None = None

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (``None``: the default group)."""
        group = None if self._group is None else self._group()
        if group is None and self._group is not None:
            raise RuntimeError("the process group of this ring_dilated_attention call no longer "
                               "exists (destroy_process_group released it)")  # fmt: skip
        return group


class _Registry:
    """Specs by key: pinned (registered while compiling) or LRU-bounded."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._pinned: dict[str, RingSpec] = {}
        self._recent: OrderedDict[str, RingSpec] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: str, spec: RingSpec, pin: bool) -> None:
        with self._lock:
            if pin:
                self._pinned[key] = spec
                return
            self._recent[key] = spec
            self._recent.move_to_end(key)
            while len(self._recent) > self.maxsize:
                self._recent.popitem(last=False)

    def get(self, key: str) -> RingSpec:
        with self._lock:
            spec = self._pinned.get(key) or self._recent.get(key)
        if spec is None:
            raise RuntimeError(f"ring_attention: no ring call is registered under spec={key!r} "
                               f"(more than {self.maxsize} distinct calls since it was "
                               "made?)")  # fmt: skip
        return spec

    def info(self) -> dict[str, object]:
        with self._lock:
            n = len(self._pinned) + len(self._recent)
        return {"entries": n, "bytes": 0, "cap": self.maxsize, "hits": 0, "misses": 0}

    def clear(self) -> None:
        """Drop the specs of eager calls (a compiled graph's pinned specs stay:
        the graph names them)."""
        with self._lock:
            self._recent.clear()


_REGISTRY = register("ring call specs", _Registry(maxsize=1024))


def get_spec(key: str) -> RingSpec:
    """The spec registered under ``key``."""
    return _REGISTRY.get(key)


def ring_call_spec(build: Callable[..., Pattern], *args: Any, scale: float | None = None,
                   group: dist.ProcessGroup | None = None, layout: str = "contiguous",
                   fold: int = 1, ranks: tuple[int, ...] | None = None,
                   head_range: tuple[int, int, int] = (0, 0, 0),
                   sinks: tuple | None = None) -> str:  # fmt: skip
    """Register the ring call whose pattern is ``build(*args)`` (a module-level
    function and constants); its key."""
    if torch.compiler.is_compiling():
        args = tuple(_specialized(a) for a in args)
    return _registered_spec(build, *args, scale=scale, group=group, layout=layout, fold=fold,
                            ranks=ranks, head_range=tuple(head_range), sinks=sinks)  # fmt: skip


def _specialized(value: Any) -> Any:
    """``value`` with its integers (in lists and tuples too) plain ints."""
    if isinstance(value, (list, tuple)):
        return type(value)(_specialized(v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool):
        return operator.index(value)
    return value


def _registered_spec(build: Callable[..., Pattern], *args: Any, scale: float | None,
                     group: dist.ProcessGroup | None, layout: str, fold: int,
                     ranks: tuple[int, ...] | None, head_range: tuple[int, int, int],
                     sinks: tuple | None) -> str:  # fmt: skip
    """:func:`ring_call_spec` on constants (run once, while tracing)."""
    try:
        pattern, error = build(*args), None
        if not isinstance(pattern, Pattern):
            raise TypeError(f"a ring call needs a Pattern, got {type(pattern).__name__}")
    except Exception as exc:
        pattern, error = None, exc
    # torch.compile hands a process group to a function like this one as a
    # fake script object wrapping the real group
    group = getattr(group, "real_obj", group)
    if group is None:
        ref, group_key = None, "default"
    elif isinstance(group, dist.ProcessGroup):
        ref, group_key = weakref.ref(group), group.group_name
    else:
        ref, group_key = None, "invalid"
        pattern, error = None, GroupError(f"group must be a ProcessGroup or None, got {group!r}")
    what = repr(pattern) if error is None else f"{type(error).__name__}: {error}"
    key = f"{what} | scale={scale!r} | group={group_key} | layout={layout!r} | fold={fold}"
    if ranks is not None:
        ranks = tuple(int(r) for r in ranks)
        key += f" | ranks={list(ranks)}"
    head_range = tuple(int(h) for h in head_range)
    if head_range[1]:
        key += f" | heads={list(head_range)}"
    if sinks is not None:
        key += f" | sinks={sinks!r}"
    spec = RingSpec(pattern=pattern, error=error, scale=scale, layout=layout, fold=fold,
                    _group=ref, ranks=ranks, head_range=head_range, sinks=sinks)  # fmt: skip
    _REGISTRY.add(key, spec, pin=torch.compiler.is_compiling())
    return key


# torch.compiler.assume_constant_result's mark, set without importing Dynamo
_registered_spec._dynamo_marked_constant = True  # type: ignore[attr-defined]


def given_pattern(pattern: Pattern) -> Pattern:
    """The builder of a pattern given built (:func:`ring_call_spec`'s ``build``)."""
    return pattern


def pattern_of_call(documents: Sequence[int] | torch.Tensor | None, build: Callable[..., Pattern],
                    *args) -> Pattern:  # fmt: skip
    """``build(*args)``, a :class:`Pattern`, with ``documents`` (``None``:
    its own)."""
    pattern = build(*args)
    if not isinstance(pattern, Pattern):
        raise ValueError(f"pattern must be a Pattern or a function returning one, got {pattern!r}")
    return pattern if documents is None else pattern.with_documents(documents)
