"""The exchange counters of the ring (docs/design.md §2.4).

Every batch of point-to-point operations the ring's transport
(:mod:`ring_attention.parallel.transport`) posts is reported as an
:class:`ExchangeEvent` to :data:`last_exchange_stats` (reset at every ring
forward, the backward's events appended) and to the hooks of
:func:`register_exchange_hook`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "ExchangeEvent",
    "ExchangeStats",
    "last_exchange_stats",
    "register_exchange_hook",
]


@dataclass(frozen=True)
class ExchangeEvent:
    """One posted batch of point-to-point operations on this rank.

    Attributes:
        phase: ``"forward_kv"``, ``"backward_kv"`` or ``"backward_grad"``.
        distance: the ring distance ``d`` of the step.
        send_to: group rank sent to (``None`` when nothing is sent).
        recv_from: group rank received from (``None`` when nothing is received).
        rows_sent / rows_received: (row, head) pairs, each one ``head_dim``
            vector of K and one of V (or of dK and dV), per batch element.
        bytes_sent / bytes_received: bytes of the buffers actually handed to
            ``torch.distributed``.
    """

    phase: str
    distance: int
    send_to: int | None
    recv_from: int | None
    rows_sent: int
    rows_received: int
    bytes_sent: int
    bytes_received: int


@dataclass
class ExchangeStats:
    """Events of the last ring call on this rank: reset at every forward, the
    backward's events appended.

    Attributes:
        events: the posted batches, in order.
        buffer_bytes: bytes of the transport buffers (packed send/receive
            buffers and the row maps of partly needed pieces) allocated per pass,
            ``{"forward": ..., "backward": ...}``; each pass frees its own when
            it returns (host staging copies of CUDA tensors on gloo are not
            counted).
    """

    events: list[ExchangeEvent] = field(default_factory=list)
    buffer_bytes: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget every event and buffer count."""
        self.events.clear()
        self.buffer_bytes.clear()

    def record(self, event: ExchangeEvent) -> None:
        """Append ``event``."""
        self.events.append(event)

    def _total(self, attr: str, phase: str | None) -> int:
        return sum(getattr(e, attr) for e in self.events if phase is None or e.phase == phase)

    def bytes_sent(self, phase: str | None = None) -> int:
        """Bytes sent, all phases or one."""
        return self._total("bytes_sent", phase)

    def bytes_received(self, phase: str | None = None) -> int:
        """Bytes received, all phases or one."""
        return self._total("bytes_received", phase)

    def rows_sent(self, phase: str | None = None) -> int:
        """(row, head) pairs sent, all phases or one."""
        return self._total("rows_sent", phase)

    def rows_received(self, phase: str | None = None) -> int:
        """(row, head) pairs received, all phases or one."""
        return self._total("rows_received", phase)


#: Exchange counters of the last call on this rank (mutated in place).
last_exchange_stats = ExchangeStats()

ExchangeHook = Callable[[ExchangeEvent], None]
_hooks: dict[int, ExchangeHook] = {}
_next_hook_id = 0


class _HookHandle:
    """Returned by :func:`register_exchange_hook`; ``remove()`` unregisters."""

    def __init__(self, hook_id: int) -> None:
        self.id = hook_id

    def remove(self) -> None:
        _hooks.pop(self.id, None)

    def __enter__(self) -> _HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register_exchange_hook(hook: ExchangeHook) -> _HookHandle:
    """Call ``hook(event)`` for every batch of P2P operations this process posts.

    Returns a handle whose ``remove()`` unregisters the hook (also usable as a
    context manager). Hooks observe real communication; they must not
    communicate themselves.
    """
    global _next_hook_id
    _next_hook_id += 1
    _hooks[_next_hook_id] = hook
    return _HookHandle(_next_hook_id)


def emit(event: ExchangeEvent) -> None:
    """Report ``event``: record it in :data:`last_exchange_stats`, then call every hook."""
    last_exchange_stats.record(event)
    for hook in list(_hooks.values()):
        hook(event)
