"""Agreement between the ranks of a ring x Ulysses grid, once per call
(docs/design.md §6), before anything large moves.

No process group spans the whole grid, so the check takes two of the small
fixed-size rounds of :mod:`ring_attention.parallel.handshake`: one inside the Ulysses
group (a row), then one along the ring (a column). The row round carries the
call's arguments and the local lengths; the column round carries each row's
stretch length, a digest of its lengths and of its arguments, or the
failure the row round found (a rank's own error: which rank and its
message, passed on). Every row meets every column, so after the two rounds
every rank knows everything any rank found, and every rank raises: the rank
whose own checks failed its own error, the others ``ValueError`` naming it
(``"rank j failed: ..."``); none is left waiting in a collective. Rows come
back by index (a mesh's coordinates), not group rank.

The local lengths must follow the sharding of docs/design.md §2: shard
``i * U + j`` of ``layout`` over ``R * U`` ranks.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import torch.distributed as dist

from ..core.layout import layout_shard_lengths
from .handshake import Reason, exchange_message, reject
from .mesh import Topology, report_grid_error, resolve_topology

__all__ = ["grid_handshake"]

_GRID_FIELDS = ("ring_index", "ring_size", "grid")


def _digest(values: Sequence[int]) -> int:
    text = repr([int(v) for v in values]).encode()
    return (zlib.crc32(text) << 30) ^ zlib.adler32(text)


def _rounds(call: str) -> tuple[str, str]:
    return f"{call} (Ulysses group)", f"{call} (ring of the grid)"


def grid_handshake(
    topo: Topology,
    call: str,
    fields: Sequence[str],
    message: Sequence[int] | None,
    layout: str,
    *,
    error: BaseException | Reason | None = None,
    explain: Callable[[str, list[int]], str | None] | None = None,
    describe: Callable[[], str] | None = None,
) -> tuple[int, list[int]]:
    """Check that every rank of the grid makes the same call; returns the
    global length and the local lengths of this rank's row (by Ulysses index).

    Args:
        topo: this rank's grid (``U > 1``).
        call: the public name of the call (messages).
        fields: the names of ``message``'s values; ``fields[0]`` is the local
            sequence length, the others must be equal on every rank.
        message: this rank's values, or ``None`` when its inputs failed
            validation (it takes part, and then the caller raises its error).
        layout: the sharding layout.
        error: with ``message=None``, why (the others' message names it).
        explain: ``explain(field, values)`` -> the message of a disagreement
            on ``field`` (values in row order), or ``None`` for the default.
        describe: this rank's arguments in words (the message when two rows
            disagree).

    Returns ``(-1, [])`` on a rank that passed ``message=None`` (after taking
    part in both rounds).

    Raises:
        ValueError: on every rank of the grid, naming what differs or the
            rank whose own checks failed (:func:`~ring_attention.parallel.handshake.peer_error`).
    """
    row_call, col_call = _rounds(call)
    U, R = topo.ulysses_size, topo.ring_size
    err: Exception | None = None
    row_lengths: list[int] = []
    args_digest = 0
    payload = None
    if message is not None:
        payload = [*message, topo.ring_index, topo.ring_size, topo.digest("ulysses")]
    try:
        rows = exchange_message(topo.ulysses_group, row_call, payload, error, topo.ulysses_order)
        if rows is not None:
            names = (*fields, *_GRID_FIELDS)
            table = {f: [r[k] for r in rows] for k, f in enumerate(names)}
            for f in names[1:]:
                vals = table[f]
                if len(set(vals)) > 1:
                    text = explain(f, vals) if explain is not None else None
                    raise ValueError(
                        text
                        or f"{call}: the ranks of a Ulysses group disagree on {f}: {vals} "
                        "(Ulysses-index order)"
                    )
            row_lengths = table[fields[0]]
            args_digest = _digest(payload[1 : len(fields)])
    except ValueError as exc:
        err = exc

    n = sum(row_lengths)
    if R > 1:
        col = None
        if message is not None and err is None:
            col = [n, _digest(row_lengths), topo.ulysses_index, U, topo.digest("ring"), args_digest]
        why = error if message is None else err  # passed on along the ring
        try:
            cols = exchange_message(topo.ring_group, col_call, col, why, topo.ring_order)
            if cols is not None:
                _check_columns(call, topo, cols, row_lengths, layout, describe)
                n = sum(c[0] for c in cols)
        except ValueError as exc:
            err = err or exc
    if message is None:
        return -1, []
    if err is not None:
        raise err
    expected = layout_shard_lengths(n, topo.world_size, layout)
    mine = expected[topo.ring_index * U : (topo.ring_index + 1) * U]
    if row_lengths != mine:  # (R = 1 only: the column round checked it otherwise)
        raise ValueError(_lengths_error(call, topo.ring_index, row_lengths, mine, n, layout))
    return n, row_lengths


def _lengths_error(call: str, i: int, got: list[int], want: list[int], n: int, layout: str) -> str:
    return (
        f"{call}: the local sequence lengths of the ranks with ring index {i} are {got} "
        f"(Ulysses-index order, global length {n}), but layout={layout!r} over the grid expects "
        f"{want}: shard i * U + j of the layout over R * U ranks; shard inputs with "
        "ring_attention.shard_sequence(..., group=..., ulysses_group=...) or mesh="
    )


def _check_columns(
    call: str,
    topo: Topology,
    cols: list[list[int]],
    row_lengths: list[int],
    layout: str,
    describe: Callable[[], str] | None,
) -> None:
    """The column round's checks (every rank of a column sees the same rows)."""
    prefix = f"{call}: the ranks of a ring disagree on "
    for k, what in ((2, "their Ulysses index"), (3, "the Ulysses group size"), (4, "the grid")):
        vals = [c[k] for c in cols]
        if len(set(vals)) > 1:
            if k == 4:
                vals = "ranks and groups differ"
            raise ValueError(prefix + f"{what}: {vals} (ring-index order)")
    if len({c[5] for c in cols}) > 1:
        words: list = [None] * topo.ring_size
        dist.all_gather_object(words, describe() if describe else "?", group=topo.ring_group)
        if topo.ring_order is not None:
            words = [words[g] for g in topo.ring_order]
        detail = "; ".join(f"ring index {i}: {w}" for i, w in enumerate(words))
        raise ValueError(prefix + f"the arguments of the call: {detail}")
    n = sum(c[0] for c in cols)
    U = topo.ulysses_size
    expected = layout_shard_lengths(n, topo.world_size, layout)
    for i, c in enumerate(cols):
        want = expected[i * U : (i + 1) * U]
        if c[1] != _digest(want):
            got = row_lengths if i == topo.ring_index else "(see that rank's error)"
            raise ValueError(
                _lengths_error(call, i, got, want, n, layout)
                if isinstance(got, list)
                else f"{call}: the local sequence lengths of the ranks with ring index {i} do "
                f"not follow layout={layout!r} over the grid (global length {n}: expected {want})"
            )


def reject_through(topo: Topology, call: str, error: BaseException) -> None:
    """Take part in the rounds of ``call`` over ``topo`` as a rank whose
    inputs failed (``error``): the other ranks raise naming it."""
    if topo.ulysses_size > 1:
        grid_handshake(topo, call, (), None, "contiguous", error=error)
    elif topo.ring_size > 1:
        reject(topo.ring_group, call, error, topo.ring_order)


def topology_of(group, ulysses_group, mesh, call: str) -> Topology:
    """:func:`~ring_attention.parallel.mesh.resolve_topology`; a rank whose grid
    arguments fail there tells its peers (which then raise naming it)
    before it raises its own error."""
    try:
        return resolve_topology(group, ulysses_group, mesh)
    except ValueError as exc:
        mode = None if mesh is not None else "grid"
        topo = report_grid_error(group, ulysses_group, mesh, exc, mode)
        if topo is not None:
            reject_through(topo, call, exc)
        raise
