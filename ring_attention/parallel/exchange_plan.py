"""The ring's exchange plan (docs/design.md §4.1, §4.2): per ring distance,
the K/V rows a rank sends and receives; cached in :data:`PLAN_CACHE`."""

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..core.cache import LRUCache
from ..core.checks import check_int
from ..core.geometry import MAX_SEQ_LEN
from ..core.layout import Piece, layout_pieces, resolve_layout
from ..core.pattern import Pattern
from ..local.rows import reached_rows

__all__ = ["PLAN_CACHE", "ExchangePlan", "Step", "build_plan", "exchange_rows", "get_plan",
           "reaches"]  # fmt: skip

_EMPTY = torch.empty(0, dtype=torch.int64)
# reaches(): key chunks of _PROBE_ROWS rows, doubling up to _MAX_PROBE_ROWS.
_PROBE_ROWS, _MAX_PROBE_ROWS = 1 << 12, 1 << 20


def _check_plan_args(pattern: Pattern, seq_len: object, heads: object, kv_heads: object,
                     world_size: object, rank: object, layout: str, fold: object = 1,
                     head_range: tuple[int, int, int] = (0, 0, 0)) -> tuple:  # fmt: skip
    """The cache key of a plan, its arguments checked (docs/design.md §6)."""
    if not isinstance(pattern, Pattern):
        raise ValueError(f"pattern must be a Pattern, got {type(pattern).__name__}")
    n = check_int(seq_len, "seq_len", 0, MAX_SEQ_LEN)
    h = check_int(heads, "heads", 1, MAX_SEQ_LEN)
    kv = check_int(kv_heads, "kv_heads", 1, h)
    if head_range[1] == 0 and h % kv:
        raise ValueError(f"kv_heads must divide heads = {h}, got kv_heads = {kv}")
    p = check_int(world_size, "world_size", 1, MAX_SEQ_LEN)
    j = check_int(rank, "rank", 0, p - 1)
    layout = resolve_layout(layout, pattern)
    pattern.check_heads(h if head_range[1] == 0 else head_range[1])
    pattern.check_length(n)
    f = check_int(fold, "fold", 1, MAX_SEQ_LEN)
    return (pattern, n, h, kv, p, j, layout, f, tuple(int(x) for x in head_range))


def exchange_rows(q_pieces: Sequence[Piece | tuple[int, int]], k_start: int, k_len: int, heads: int,
                  kv_heads: int, pattern: Pattern,
                  head_range: tuple[int, int, int] = (0, 0, 0)) -> torch.Tensor:  # fmt: skip
    """Sorted flat indices ``row * kv_heads + g`` (``row`` relative to
    ``k_start``) of the key rows some query of ``q_pieces`` reaches."""
    ranges = [(int(p[0]), int(p[1])) for p in q_pieces if int(p[1]) > 0]
    if k_len <= 0 or not ranges:
        return _EMPTY
    return reached_rows([r[0] for r in ranges], [r[1] for r in ranges], k_start, k_len, heads,
                        kv_heads, pattern, head_range)  # fmt: skip


def reaches(q_piece: Piece | tuple[int, int], k_start: int, k_len: int, heads: int,
            pattern: Pattern, kv_heads: int = 1,
            head_range: tuple[int, int, int] = (0, 0, 0)) -> bool:  # fmt: skip
    """Whether some query of ``q_piece`` reaches some key of ``[k_start,
    k_start + k_len)``, probing in doubling chunks."""
    q_start, q_len = int(q_piece[0]), int(q_piece[1])
    if q_len <= 0:
        return False
    w = max(pattern.segment_lengths)
    start = max(int(k_start), q_start - w + 1)
    end = min(int(k_start) + int(k_len), q_start + q_len + w - 1)
    size = _PROBE_ROWS
    while start < end:
        n = min(size, end - start)
        if exchange_rows([(q_start, q_len)], start, n, heads, kv_heads, pattern,
                         head_range).numel():  # fmt: skip
            return True
        start, size = start + n, min(2 * size, _MAX_PROBE_ROWS)
    return False


@dataclass(frozen=True, eq=False)
class Step:
    """One ring ``distance`` of one rank's plan: peers, flat indices sent and
    received per piece, the sender's pieces and the pairs to compute."""

    distance: int
    send_to: int | None
    recv_from: int | None
    send_idx: tuple[torch.Tensor, ...]
    recv_idx: tuple[torch.Tensor, ...]
    recv_pieces: tuple[Piece, ...]
    pairs: tuple[tuple[int, int], ...]

    @property
    def send_counts(self) -> tuple[int, ...]:
        """Rows (row, head pairs) sent per local piece."""
        return tuple(int(i.numel()) for i in self.send_idx)

    @property
    def recv_counts(self) -> tuple[int, ...]:
        """Rows (row, head pairs) received per sender piece."""
        return tuple(int(i.numel()) for i in self.recv_idx)

    @property
    def send_rows(self) -> int:
        """Total (row, K/V head) pairs sent (each one ``head_dim`` vector of K and one of V)."""
        return sum(self.send_counts)

    @property
    def recv_rows(self) -> int:
        """Total (row, K/V head) pairs received."""
        return sum(self.recv_counts)


@dataclass(frozen=True, eq=False)
class ExchangePlan:
    """Everything one rank needs to run the ring for one configuration: the
    pieces, the local pairs that reach each other and the active steps."""

    pattern: Pattern
    seq_len: int
    heads: int
    kv_heads: int
    world_size: int
    rank: int
    layout: str
    pieces: tuple[Piece, ...]
    all_pieces: tuple[tuple[Piece, ...], ...]
    local_pairs: tuple[tuple[int, int], ...]
    steps: tuple[Step, ...]
    fold: int = 1
    head_range: tuple[int, int, int] = (0, 0, 0)
    _device_idx: dict = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def rows_sent(self) -> int:
        """(row, K/V head) pairs of K (and as many of V) this rank sends per forward."""
        return sum(s.send_rows for s in self.steps)

    @property
    def rows_received(self) -> int:
        """(row, K/V head) pairs of K (and as many of V) this rank receives per forward."""
        return sum(s.recv_rows for s in self.steps)

    @property
    def nbytes(self) -> int:
        """Bytes of the plan's row indices on the host."""
        return sum(sum(i.numel() * i.element_size() for i in (*s.send_idx, *s.recv_idx))
                   for s in self.steps)  # fmt: skip

    def step_for(self, distance: int) -> Step | None:
        """The step at ring distance ``distance``, or ``None`` if it is skipped."""
        return next((s for s in self.steps if s.distance == distance), None)

    def bytes_sent(self, batch: int, head_dim: int, itemsize: int, *, backward: bool = False,
                   grad_itemsize: int = 4) -> int:  # fmt: skip
        """Bytes this rank sends per layer: K and V rows forward; with
        ``backward=True`` also the backward's."""
        fwd = 2 * self.rows_sent * batch * head_dim * itemsize
        grads = 2 * self.rows_received * batch * head_dim * grad_itemsize
        return 2 * fwd + grads if backward else fwd

    def bytes_received(self, batch: int, head_dim: int, itemsize: int, *, backward: bool = False,
                       grad_itemsize: int = 4) -> int:  # fmt: skip
        """Bytes this rank receives per layer (see :meth:`bytes_sent`)."""
        fwd = 2 * self.rows_received * batch * head_dim * itemsize
        grads = 2 * self.rows_sent * batch * head_dim * grad_itemsize
        return 2 * fwd + grads if backward else fwd

    def indices_on(self, device: torch.device) -> dict[int, tuple[list, list]]:
        """``distance -> (send_idx, recv_idx)`` on ``device`` (copied once, kept)."""
        key = str(device)
        with self._lock:
            cached = self._device_idx.get(key)
            if cached is None:
                cached = {s.distance: ([i.to(device) for i in s.send_idx],
                                       [i.to(device) for i in s.recv_idx])
                          for s in self.steps}  # fmt: skip
                self._device_idx[key] = cached
            return cached


def build_plan(pattern: Pattern, seq_len: int, heads: int, kv_heads: int, world_size: int,
               rank: int, layout: str = "contiguous", fold: int = 1,
               head_range: tuple[int, int, int] = (0, 0, 0)) -> ExchangePlan:  # fmt: skip
    """Build (without caching) the exchange plan of ``rank`` in a ring of
    ``world_size``. Raises ``ValueError`` naming a bad argument."""
    pattern, seq_len, heads, kv_heads, p, rank, layout, fold, head_range = _check_plan_args(
        pattern, seq_len, heads, kv_heads, world_size, rank, layout, fold, head_range)  # fmt: skip
    # every head: one K/V head answers whether a block is reached at all
    probe_kv = 1 if head_range[1] == 0 else kv_heads
    all_pieces = tuple(tuple(layout_pieces(seq_len, p, r, layout, fold)) for r in range(p))
    mine = all_pieces[rank]

    def rows(q_pieces: Sequence[Piece], k_piece: Piece) -> torch.Tensor:
        return exchange_rows(q_pieces, k_piece.start, k_piece.length, heads, kv_heads, pattern,
                             head_range)  # fmt: skip

    def reached(q_piece: Piece, k_piece: Piece) -> bool:
        return reaches(q_piece, k_piece.start, k_piece.length, heads, pattern, probe_kv,
                       head_range)  # fmt: skip

    local_pairs = tuple((qi, ki) for qi, qp in enumerate(mine) for ki, kp in enumerate(mine)
                        if reached(qp, kp))  # fmt: skip

    steps = []
    for d in range(1, p):
        to, frm = (rank + d) % p, (rank - d) % p
        send_idx = tuple(rows(all_pieces[to], kp) for kp in mine)
        sender = all_pieces[frm]
        recv_idx = tuple(rows(mine, kp) for kp in sender)
        pairs = tuple((qi, kj)
                      for kj, kp in enumerate(sender)
                      if recv_idx[kj].numel() > 0
                      for qi, qp in enumerate(mine)
                      if len(mine) == 1 or reached(qp, kp))  # fmt: skip
        sends = any(i.numel() > 0 for i in send_idx)
        recvs = any(i.numel() > 0 for i in recv_idx)
        if not (sends or recvs):
            continue
        steps.append(Step(distance=d, send_to=to if sends else None,
                          recv_from=frm if recvs else None, send_idx=send_idx, recv_idx=recv_idx,
                          recv_pieces=sender, pairs=pairs))  # fmt: skip

    return ExchangePlan(pattern=pattern, seq_len=seq_len, heads=heads, kv_heads=kv_heads,
                        world_size=p, rank=rank, layout=layout, pieces=mine, all_pieces=all_pieces,
                        local_pairs=local_pairs, steps=tuple(steps), fold=int(fold),
                        head_range=head_range)  # fmt: skip


#: The plan cache of ``ring_dilated_attention`` (64 plans, 512 MiB of indices).
PLAN_CACHE: LRUCache[ExchangePlan] = LRUCache(maxsize=64, name="exchange plans",
                                              max_bytes=512 * 2**20,
                                              size_of=lambda plan: plan.nbytes)  # fmt: skip


def get_plan(pattern: Pattern, seq_len: int, heads: int, kv_heads: int, world_size: int, rank: int,
             layout: str = "contiguous", fold: int = 1,
             head_range: tuple[int, int, int] = (0, 0, 0), *,
             cache: LRUCache[ExchangePlan] | None = None) -> ExchangePlan:  # fmt: skip
    """The cached plan for this configuration (built on first use); raises
    as :func:`build_plan` does."""
    key = _check_plan_args(pattern, seq_len, heads, kv_heads, world_size, rank, layout, fold,
                           head_range)  # fmt: skip
    return (PLAN_CACHE if cache is None else cache).get(key, lambda: build_plan(*key))
