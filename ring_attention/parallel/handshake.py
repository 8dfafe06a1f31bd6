"""Agreement between ranks before anything large moves (docs/design.md §6):
fixed-size int64 control messages, all-gathered, so every rank raises."""

import struct
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..core.config import MODES, backward_mode, forward_mode
from ..core.dtypes import dtype_code, dtype_name
from ..core.layout import LAYOUTS, Layout, layout_code, layout_digest, layout_shard_lengths
from ..core.pattern import Pattern
from .mesh import Topology, digest_of, report_grid_error, resolve_topology

#: The call name of a generation step over the sequence-parallel group.
GENERATION = "generation over the group (use_cache, no cu_seq_lens_q)"
#: Words (int64) of every control message.
WORDS = 20
_MAGIC = 0x52494E47  # "RING"
_CALLS = {
    "ring_dilated_attention": 1,
    "gather_sequence": 2,
    # the two rounds of a ring x Ulysses grid (grid_handshake)
    "ring_dilated_attention (Ulysses group)": 3,
    "ring_dilated_attention (ring of the grid)": 4,
    "gather_sequence (Ulysses group)": 5,
    "gather_sequence (ring of the grid)": 6,
    # generation over the group (ring_attention.hf.generation): its rounds
    # inside the Ulysses group, then along the ring
    GENERATION: 7,
    f"{GENERATION} (ring of the grid)": 8,
}
_NAMES = {v: k for k, v in _CALLS.items()}

#: The ring handshake's fields, in :func:`ring_message`'s order (the hybrid's
#: row round sends the same message: ring_attention/parallel/ulysses.py).
RING_FIELDS = ("seq_len_local", "batch", "heads", "kv_heads", "head_dim", "dtype", "pattern",
               "scale", "layout", "requires_grad", "far_bytes", "backward_heads",
               "dense_modes")  # fmt: skip
#: What the fields compared after the pattern are, in error messages (in the order compared).
RING_WHAT = {
    "dtype": "the dtype",
    "heads": "the number of heads (q.shape[2])",
    "kv_heads": "the number of K/V heads (k.shape[2])",
    "head_dim": "head_dim (q.shape[3])",
    "batch": "the batch size (q.shape[0])",
    "layout": "layout",
    "requires_grad": "whether a gradient is needed (every rank must run the backward)",
    "far_bytes": "RING_ATTENTION_FAR_BYTES (the far group's threshold in bytes)",
    "backward_heads": "RING_ATTENTION_BACKWARD_HEADS (the backward's heads per group)",
    "dense_modes": "RING_ATTENTION_FORWARD/BACKWARD (a K/V check over the ranks)",
    "scale": "scale",
}
_GATHER_DIMS = WORDS - 3 - 5  # shapes of up to 12 dimensions
_GATHER_FIELDS = ("ndim", "dim", "dtype", "layout", *(f"size{i}" for i in range(_GATHER_DIMS)),
                  "layout_digest")  # fmt: skip


def control_device(group: dist.ProcessGroup | None) -> torch.device:
    """Device of the small int64 control messages."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def gather_objects(value: object, group: dist.ProcessGroup | None,
                   order: Sequence[int] | None = None) -> list:  # fmt: skip
    """Every rank's ``value`` (by index: ``order`` as for :func:`reject`)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out if order is None else [out[g] for g in order]


Reason = tuple[int, str]


def failure(error: BaseException | Reason | None) -> Reason:
    """``(global rank, text)`` of a failure to report: this rank's own
    error, or a peer's passed on (its ``failed_rank``: the origin kept)."""
    if isinstance(error, tuple):
        return error
    if getattr(error, "failed_rank", None) is not None:
        return error.failed_rank  # type: ignore[union-attr]
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if error is None:
        return me, "its inputs failed validation"
    return me, str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


def exchange_message(group: dist.ProcessGroup | None, call: str, payload: Sequence[int] | None,
                     error: BaseException | Reason | None = None,
                     order: Sequence[int] | None = None) -> list[list[int]] | None:  # fmt: skip
    """One control round of ``call`` over ``group``: every rank's payload by
    index. ``ValueError`` on every rank for a failed rank or a different call."""
    body = [-1] * (WORDS - 3) if payload is None else list(payload)
    if len(body) > WORDS - 3:  # would break the equal sizes the transport relies on
        raise RuntimeError(f"{call}: a control payload of {len(body)} words (at most {WORDS - 3})")
    body += [0] * (WORDS - 3 - len(body))
    # one small all-gather of WORDS int64 per rank
    mine = torch.tensor([_MAGIC, _CALLS[call], int(payload is None), *body], dtype=torch.int64,
                        device=control_device(group))  # fmt: skip
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    rows = [t.cpu().tolist() for t in rows]
    if order is not None:
        rows = [rows[g] for g in order]
    calls = [r[1] if r[0] == _MAGIC else 0 for r in rows]
    if any(c != _CALLS[call] for c in calls):
        where = ", ".join(f"rank {i}: {_NAMES.get(c, 'not a ring_attention call')}"
                          for i, c in enumerate(calls))  # fmt: skip
        raise ValueError(f"{call}: ranks are out of step (every rank must make the same call): "
                         f"{where}")  # fmt: skip
    reasons: list = []
    if any(r[2] for r in rows):  # every rank sees the flags: every rank takes part
        reasons = gather_objects(failure(error) if payload is None else None, group)
    if payload is None:
        return None
    if reasons:
        seen = sorted({tuple(r) for r in reasons if r is not None})
        origin, reason = seen[0]
        others = sorted({o for o, _ in seen[1:]} - {origin})
        more = f" (and rank(s) {others})" if others else ""
        error = ValueError(f"{call.split(' (')[0]}: rank {origin} failed{more}: {reason}")
        error.failed_rank = (origin, reason)  # type: ignore[attr-defined]  # (see failure)
        raise error
    return [r[3:] for r in rows]


def reject(group: dist.ProcessGroup | None, call: str = "ring_dilated_attention",
           error: BaseException | Reason | None = None,
           order: Sequence[int] | None = None) -> None:  # fmt: skip
    """Take part in ``call``'s handshake as a rank whose inputs failed
    (``error``); the caller raises its own error."""
    exchange_message(group, call, None, error, order)


def ring_message(q: torch.Tensor, kv_heads: int, pattern: Pattern, *, scale: float, layout: Layout,
                 needs_grad: bool, far_bytes: int = 0,
                 backward_heads: int = 0) -> list[int]:  # fmt: skip
    """This rank's ring handshake payload in ``RING_FIELDS``' order (``q``: the validated local
    query; ``far_bytes``, ``backward_heads``: its ``RING_ATTENTION_FAR_BYTES``, its backward's
    heads per group; the dense modes read here)."""
    B, L, H, D = q.shape
    return [L, B, H, kv_heads, D, dtype_code(q.dtype), pattern.digest(),
            struct.unpack("<q", struct.pack("<d", float(scale)))[0],
            layout_code(layout), int(needs_grad), int(far_bytes), int(backward_heads),
            MODES.index(forward_mode()) * len(MODES) + MODES.index(backward_mode())]  # fmt: skip


def ring_handshake(group: dist.ProcessGroup | None, world: int, message: list[int] | None,
                   pattern: Pattern | None, layout: Layout, fold: int = 1,
                   error: BaseException | Reason | None = None,
                   order: Sequence[int] | None = None) -> int:  # fmt: skip
    """Check that every rank makes the same ring call; the global length (-1
    where ``message`` is ``None``). ``ValueError`` on every rank otherwise."""
    rows = exchange_message(group, "ring_dilated_attention", message, error, order)
    if rows is None:
        return -1
    table = {f: [r[i] for r in rows] for i, f in enumerate(RING_FIELDS)}
    prefix = "ring_dilated_attention: ranks disagree on "
    if len(set(table["pattern"])) > 1:
        mine = (pattern.describe(), pattern.documents) if pattern else ("?", None)
        gathered = gather_objects(mine, group, order)
        detail = "; ".join(f"rank {r}: {d}" for r, (d, _) in enumerate(gathered))
        raise ValueError(prefix + f"the pattern: {detail}" + _documents_detail(gathered))
    for name, what in RING_WHAT.items():
        if len(set(table[name])) > 1:
            raise ValueError(prefix + f"{what}: {named_values(name, table[name])} (rank order)")
    lengths = table["seq_len_local"]
    n = sum(lengths)
    expected = layout_shard_lengths(n, world, layout, fold)
    if lengths != expected:
        raise ValueError(f"ring_dilated_attention: the local sequence lengths {lengths} (rank "
                         f"order, global length {n}) do not follow the layout={layout!r} sharding "
                         f"convention, which expects {expected} ({_convention(layout)}); shard "
                         "inputs with ring_attention.shard_sequence")  # fmt: skip
    return n


def named_values(name: str, vals: list[int]) -> list:
    """The values ``vals`` of field ``name`` as an error message shows them."""
    to = {"layout": lambda x: LAYOUTS[x] if 0 <= x < len(LAYOUTS) else x, "dtype": dtype_name,
          "scale": lambda x: struct.unpack("<d", struct.pack("<q", int(x)))[0],
          "requires_grad": bool,
          "dense_modes": lambda x: "/".join(MODES[i] for i in divmod(x, len(MODES))),
          }.get(name)  # fmt: skip
    return vals if to is None else [to(x) for x in vals]


def _convention(layout: Layout) -> str:
    """Where a layout's lengths come from (error messages)."""
    if isinstance(layout, str):
        return "torch.tensor_split convention"
    return "the balanced cuts of its pattern: shard with the same pattern keywords"


def _documents_detail(gathered: list[tuple[str, tuple[int, ...] | None]]) -> str:
    """Where the ranks' document boundaries first differ (``""``: they agree)."""
    docs = [d for _, d in gathered]
    if len(set(docs)) <= 1 or any(d is None for d in docs):
        return ""
    longest = max(len(d) for d in docs)
    at = next(i for i in range(longest) if len({d[i] if i < len(d) else None for d in docs}) > 1)
    lo, hi = max(0, at - 2), at + 3
    parts = []
    for r, d in enumerate(docs):
        more = "" if hi >= len(d) else ", ..."
        parts.append(f"rank {r}: cu_seqlens[{lo}:] = [{'..., ' if lo else ''}"
                     f"{', '.join(map(str, d[lo:hi]))}{more}] ({len(d) - 1} "
                     "documents)")  # fmt: skip
    return f". The document boundaries differ first at cu_seqlens[{at}]: " + "; ".join(parts)


def gather_handshake(group: dist.ProcessGroup | None, world: int, x_local: torch.Tensor, dim: int,
                     layout: Layout, order: Sequence[int] | None = None) -> list[int]:  # fmt: skip
    """Check that every rank gathers pieces of one tensor along ``dim``; the
    local lengths along ``dim`` (by index: ``order`` as for :func:`reject`)."""
    if x_local.dim() > _GATHER_DIMS:
        error = ValueError(f"gather_sequence supports tensors of at most {_GATHER_DIMS} "
                           f"dimensions, got {x_local.dim()}")  # fmt: skip
        reject(group, "gather_sequence", error, order)
        raise error
    shape = list(x_local.shape) + [-1] * (_GATHER_DIMS - x_local.dim())
    message = [x_local.dim(), dim, dtype_code(x_local.dtype), layout_code(layout), *shape,
               layout_digest(layout)]  # fmt: skip
    rows = exchange_message(group, "gather_sequence", message, order=order)
    assert rows is not None
    table = {f: [r[i] for r in rows] for i, f in enumerate(_GATHER_FIELDS)}
    prefix = "gather_sequence: ranks disagree on "
    for name in ("ndim", "dim", "layout"):
        if len(set(table[name])) > 1:
            raise ValueError(prefix + f"{name}: {named_values(name, table[name])} (rank order)")
    if len(set(table["layout_digest"])) > 1:
        raise ValueError(prefix + "the pattern of layout='balanced' (segment_lengths, "
                         "dilation_rates, causal, window, cu_seqlens): each rank's cuts would "
                         "differ")  # fmt: skip
    if len(set(table["dtype"])) > 1:
        raise ValueError(prefix + f"the dtype: {named_values('dtype', table['dtype'])}")
    shapes = [r[4 : 4 + x_local.dim()] for r in rows]
    if len({tuple(s[:dim] + s[dim + 1 :]) for s in shapes}) > 1:
        raise ValueError(prefix + f"the shape outside dim {dim}: {shapes}")
    lengths = [s[dim] for s in shapes]
    n = sum(lengths)
    expected = layout_shard_lengths(n, world, layout)
    if lengths != expected:
        raise ValueError(f"gather_sequence: local lengths along dim {dim} are {lengths} (global "
                         f"length {n}), but layout={layout!r} expects {expected} "
                         f"({_convention(layout)})")  # fmt: skip
    return lengths


def _digest(values: Sequence[int]) -> int:
    return digest_of(repr([int(v) for v in values]))


def grid_handshake(topo, call: str, fields: Sequence[str], message: Sequence[int] | None,
                   layout: str, *, error: BaseException | Reason | None = None,
                   explain: Callable[[str, list[int]], str | None] | None = None,
                   describe: Callable[[], str] | None = None) -> tuple[int, list[int]]:  # fmt: skip
    """Check that every rank of the grid ``topo`` makes the same ``call``; the
    global length and the local lengths of this rank's row."""
    U = topo.ulysses_size
    err: Exception | None = None
    row_lengths: list[int] = []
    args_digest, payload = 0, None
    if message is not None:
        payload = [*message, topo.ring_index, topo.ring_size, topo.digest("ulysses")]
    try:
        rows = exchange_message(topo.ulysses_group, f"{call} (Ulysses group)", payload, error,
                                topo.ulysses_order)  # fmt: skip
        if rows is not None:
            for k, f in enumerate((*fields, "ring_index", "ring_size", "grid")):
                vals = [r[k] for r in rows]
                if k and len(set(vals)) > 1:
                    raise ValueError((explain(f, vals) if explain is not None else None)
                                     or f"{call}: the ranks of a Ulysses group disagree on {f}: "
                                     f"{vals} (Ulysses-index order)")  # fmt: skip
            row_lengths = [r[0] for r in rows]
            args_digest = _digest(payload[1 : len(fields)])
    except ValueError as exc:
        err = exc

    n = sum(row_lengths)
    if topo.ring_size > 1:
        col = None
        if message is not None and err is None:
            col = [n, _digest(row_lengths), topo.ulysses_index, U, topo.digest("ring"), args_digest]
        why = error if message is None else err  # passed on along the ring
        try:
            cols = exchange_message(topo.ring_group, f"{call} (ring of the grid)", col, why,
                                    topo.ring_order)  # fmt: skip
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
    return (f"{call}: the local sequence lengths of the ranks with ring index {i} are {got} "
            f"(Ulysses-index order, global length {n}), but layout={layout!r} over the grid "
            f"expects {want}: shard i * U + j of the layout over R * U ranks; shard inputs with "
            "ring_attention.shard_sequence(..., group=..., ulysses_group=...) or "
            "mesh=")  # fmt: skip


def _check_columns(call: str, topo, cols: list[list[int]], row_lengths: list[int], layout: str,
                   describe: Callable[[], str] | None) -> None:  # fmt: skip
    """The column round's checks (every rank of a column sees the same rows)."""
    prefix = f"{call}: the ranks of a ring disagree on "
    for k, what in ((2, "their Ulysses index"), (3, "the Ulysses group size"), (4, "the grid")):
        vals = [c[k] for c in cols]
        if len(set(vals)) > 1:
            if k == 4:
                vals = "ranks and groups differ"
            raise ValueError(prefix + f"{what}: {vals} (ring-index order)")
    if len({c[5] for c in cols}) > 1:
        words = gather_objects(describe() if describe else "?", topo.ring_group, topo.ring_order)
        detail = "; ".join(f"ring index {i}: {w}" for i, w in enumerate(words))
        raise ValueError(prefix + f"the arguments of the call: {detail}")
    n = sum(c[0] for c in cols)
    U = topo.ulysses_size
    expected = layout_shard_lengths(n, topo.world_size, layout)
    for i, c in enumerate(cols):
        want = expected[i * U : (i + 1) * U]
        if c[1] != _digest(want):
            if i == topo.ring_index:
                raise ValueError(_lengths_error(call, i, row_lengths, want, n, layout))
            raise ValueError(f"{call}: the local sequence lengths of the ranks with ring index {i} "
                             f"do not follow layout={layout!r} over the grid (global length {n}: "
                             f"expected {want})")  # fmt: skip


def reject_through(topo, call: str, error: BaseException) -> None:
    """Take part in the rounds of ``call`` over ``topo`` as a rank whose
    inputs failed (``error``): the other ranks raise naming it."""
    if topo.ulysses_size > 1:
        grid_handshake(topo, call, (), None, "contiguous", error=error)
    elif topo.ring_size > 1:
        reject(topo.ring_group, call, error, topo.ring_order)


def topology_of(group, ulysses_group, mesh, call: str) -> Topology:
    """:func:`~ring_attention.parallel.mesh.resolve_topology`; a rank whose grid
    arguments fail tells its peers (which then raise) before it raises."""
    try:
        return resolve_topology(group, ulysses_group, mesh)
    except ValueError as exc:
        mode = None if mesh is not None else "grid"
        topo = report_grid_error(group, ulysses_group, mesh, exc, mode)
        if topo is not None:
            reject_through(topo, call, exc)
        raise
