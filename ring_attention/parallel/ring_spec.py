"""What a ring call attends with, named by a string: the operator boundary of
the ring (:mod:`ring_attention.parallel.ring_ops`).

The ring runs as two custom operators, ``torch.ops.ring_attention.
ring_forward`` / ``ring_backward``, that ``torch.compile`` keeps opaque (they
communicate). Their tensors are arguments; everything else a call needs (its
:class:`~ring_attention.core.pattern.Pattern`, scale, process group and layout,
or the error that building them raised) is a :class:`RingSpec`, registered
here under a key derived from its contents and passed to the operators as
that string. :func:`ring_call_spec` builds and registers a spec; under
``torch.compile`` it runs once, while tracing (its ``_registered_spec``
carries ``torch.compiler.assume_constant_result``'s mark, set by
:func:`_assume_constant_result`), and its key becomes a constant
of the graph, so a compiled step neither re-validates nor recompiles.

A spec holds the pattern without the per-batch documents (those travel as a
tensor argument) so that the specs of a model are few. Specs registered while
compiling are kept for the life of the process; the others are kept in a
bounded least-recently-used table.
"""

from __future__ import annotations

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

__all__ = ["GroupError", "RingSpec", "get_spec", "pattern_of_call", "ring_call_spec"]


class GroupError(ValueError):
    """``group`` is not a process group (the ring cannot know its peers)."""


@dataclass(frozen=True, eq=False)
class RingSpec:
    """One ring call's configuration (all but its tensors).

    ``pattern`` is ``None`` exactly when ``error`` is set: the exception that
    building the call raised, which the operator reports through the ring's
    handshake, so that every rank raises. The group is held by a weak
    reference (``destroy_process_group`` must be able to release it)."""

    pattern: Pattern | None
    error: BaseException | None
    scale: float | None
    layout: str
    fold: int
    _group: Callable[[], dist.ProcessGroup | None]
    ranks: tuple[int, ...] | None = None  # global ranks by ring index (None: group order)
    # a hybrid ring's query heads: (head_start, total_heads, total_kv_heads); (0, 0, 0): all
    head_range: tuple[int, int, int] = (0, 0, 0)
    # the attention sinks' description (core.checks.sinks_meta), checked by every rank
    sinks: tuple | None = None

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (``None``: the default group)."""
        group = self._group()
        if group is None and self._group is not _DEFAULT_GROUP:
            raise RuntimeError(
                "the process group of this ring_dilated_attention call no longer exists "
                "(destroy_process_group released it)"
            )
        return group


def _default_group() -> None:
    return None


_DEFAULT_GROUP = _default_group


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
            raise RuntimeError(
                f"ring_attention: no ring call is registered under spec={key!r} (more than "
                f"{self.maxsize} distinct calls since it was made?)"
            )
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


def _assume_constant_result(fn: Callable[..., str]) -> Callable[..., str]:
    """``torch.compiler.assume_constant_result(fn)`` without its import of
    ``torch._dynamo`` (most of the seconds ``import ring_attention`` would
    take, paid by every process that never compiles): the same mark on
    ``fn``. tests/test_imports.py checks that the mark is the decorator's."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def ring_call_spec(
    build: Callable[..., Pattern],
    *args: Any,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    fold: int = 1,
    ranks: tuple[int, ...] | None = None,
    head_range: tuple[int, int, int] = (0, 0, 0),
    sinks: tuple | None = None,
) -> str:
    """Register the ring call whose pattern is ``build(*args)``; its key.

    ``build`` is a module-level function (or a ``functools.partial`` of one
    with constant arguments) and ``args`` values that ``torch.compile`` can
    hold as constants: Python values, modules, process groups, patterns
    (each an argument of its own: inside a ``functools.partial`` a module
    or a :class:`Pattern` is not one), not a closure nor a tensor. While
    tracing, the integers among them (in lists and tuples too), which
    ``dynamic=True`` makes symbolic where they come from an argument or a
    closure, are specialized first (:func:`_specialized`): the graph guards
    on their values, so another value recompiles instead of reusing this
    spec. An exception ``build`` raises is kept: the operator reports it in
    the handshake, so every rank raises (this one the exception itself).
    ``fold > 1``: each rank holds the stretch of its Ulysses group
    (:func:`ring_attention.core.layout.layout_pieces`). ``ranks``: the global
    ranks of the group by ring index (a mesh's coordinates), given by a
    grid call, which has checked its grid (the ring then skips its own
    check of the group); ``None``: the group-rank order. ``head_range``:
    the query heads ``(head_start, total_heads, total_kv_heads)`` the ranks
    of a hybrid's ring hold (``(0, 0, 0)``: every head). ``sinks``: the
    description of the call's attention sinks (shape, dtype, device:
    :func:`ring_attention.core.checks.sinks_meta`), checked by the operator
    on every rank.
    """
    if torch.compiler.is_compiling():
        args = tuple(_specialized(a) for a in args)
    return _registered_spec(
        build, *args, scale=scale, group=group, layout=layout, fold=fold, ranks=ranks,
        head_range=tuple(head_range), sinks=sinks,
    )  # fmt: skip


def _specialized(value: Any) -> Any:
    """``value`` with its integers (in lists and tuples too) plain Python
    ints: while ``torch.compile`` traces, ``operator.index`` turns a
    symbolic one into a constant that the graph guards on. (A float from
    an argument stays symbolic under ``dynamic=True`` and is refused by
    Dynamo, as in the one-process operators.)"""
    if isinstance(value, (list, tuple)):
        return type(value)(_specialized(v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool):
        return operator.index(value)
    return value


@_assume_constant_result
def _registered_spec(
    build: Callable[..., Pattern],
    *args: Any,
    scale: float | None,
    group: dist.ProcessGroup | None,
    layout: str,
    fold: int,
    ranks: tuple[int, ...] | None,
    head_range: tuple[int, int, int],
    sinks: tuple | None,
) -> str:
    """:func:`ring_call_spec`, its arguments constants (under
    ``torch.compile`` run once, while tracing: the mark of
    ``assume_constant_result``)."""
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
        ref, group_key = _DEFAULT_GROUP, "default"
    elif isinstance(group, dist.ProcessGroup):
        ref, group_key = weakref.ref(group), group.group_name
    else:
        ref, group_key = _DEFAULT_GROUP, "invalid"
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


def pattern_of_call(
    documents: Sequence[int] | torch.Tensor | None, build: Callable[..., Pattern], *args
) -> Pattern:
    """``build(*args)``, a :class:`Pattern`, with ``documents`` (``None``:
    its own)."""
    pattern = build(*args)
    if not isinstance(pattern, Pattern):
        raise ValueError(f"pattern must be a Pattern or a function returning one, got {pattern!r}")
    return pattern if documents is None else pattern.with_documents(documents)
