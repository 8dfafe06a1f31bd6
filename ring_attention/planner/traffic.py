"""What every rank of a ring sends, receives and computes per layer
(:func:`predict_traffic`), from the ring's plans or closed forms (docs/planner.md)."""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from ..core.checks import check_int
from ..core.geometry import active_before, segment_around
from ..core.layout import Layout, Piece, layout_pieces, resolve_layout, shard_bounds
from ..core.pairs import check_planner_args, ranks_pairs
from ..core.pattern import Pattern
from .progressions import union_stats

#: Where the rows come from (``auto``: the plan when cheap and installed).
SOURCES = ("auto", "plan", "analytic")

_PLAN_WORK_LIMIT = 1 << 24  # p * n * heads: build real plans up to this
#: Ranks the traffic model takes (its ``(p, p)`` tables grow with p * p).
MAX_WORLD_SIZE = 1 << 12
_CHUNK = 1 << 18  # (rank, distance) pairs evaluated at once
_NONE = torch.empty(0, dtype=torch.int64)
#: A branch with at most this many rows of one offset in the longest piece has
#: its rows listed per pair instead of entering the memo's keys.
_LISTED_ROWS = 2
_FEW_RESIDUES = 16  # piece starts modulo a dilation: few keep few keys
_BIG = 1 << 62  # a listed row that is not there


@dataclass(frozen=True, eq=False)
class Traffic:
    """Per rank and ring distance: rows exchanged, span rows, pairs computed,
    ``(p, p)`` int64 tensors indexed ``[rank, distance]`` (docs/planner.md)."""

    pattern: Pattern
    seq_len: int
    heads: int
    kv_heads: int
    world_size: int
    layout: str
    source: str  # "plan" or "analytic": where the rows came from
    local_len: torch.Tensor  # (p,) local sequence length of every rank
    total_pairs: torch.Tensor  # (p,) reached pairs of every rank's queries
    local_pairs: torch.Tensor  # (p,) pairs among the rank's own pieces
    recv_rows: torch.Tensor  # rows rank j receives from j - d (mod p)
    send_rows: torch.Tensor  # rows rank j sends to j + d (mod p)
    span_rows: torch.Tensor  # positions of the row maps of the pieces received at d
    step_pairs: torch.Tensor  # pairs computed on the rows received at d
    shifted_rows: torch.Tensor | None = None  # rows received at d in spans after a piece's start

    @cached_property
    def active(self) -> torch.Tensor:
        """``(p, p)`` bool: rank ``j`` sends or receives at distance ``d``
        (the plan keeps exactly these steps)."""
        return (self.recv_rows > 0) | (self.send_rows > 0)

    def steps(self, rank: int) -> list[int]:
        """The distances of ``rank``'s active steps, in order."""
        return torch.nonzero(self.active[rank]).flatten().tolist()

    def far(self, row_bytes: int, far_bytes: int) -> tuple[torch.Tensor, ...]:
        """``(send, recv, far_send, far_recv)``: ``(p, p)`` the rows sent and received in the
        ring, and bool masks of the transfers of at most ``far_bytes`` bytes, in the far group."""
        s, r = self.send_rows, self.recv_rows
        far_s = (s > 0) & (s * row_bytes <= far_bytes)
        far_r = (r > 0) & (r * row_bytes <= far_bytes)
        return torch.where(far_s, 0, s), torch.where(far_r, 0, r), far_s, far_r

    def group(self, h0: int, h1: int, kv_heads: int) -> "Traffic":
        """The rows of query heads ``[h0, h1)`` (``kv_heads`` K/V heads), a group of the
        ring's backward by heads: its own plans' (source ``plan``), else its share of these."""
        if self.source == "plan" and self.world_size > 1:
            heads = (h0, self.heads, self.kv_heads)
            args = (self.seq_len, h1 - h0, kv_heads, self.world_size, self.layout, 1, heads)
            counts = plan_rows(self.pattern, *args)
            recv, span, shift = counts["recv"], counts["span"], counts["shift"]
        else:
            recv, span, shift = -(-self.recv_rows * kv_heads // self.kv_heads), self.span_rows, None
        return replace(self, heads=h1 - h0, kv_heads=kv_heads, recv_rows=recv,
                       send_rows=_sends(recv), span_rows=span, shifted_rows=shift)  # fmt: skip

    @property
    def rows_sent(self) -> torch.Tensor:
        """``(p,)`` rows every rank sends per forward."""
        return self.send_rows.sum(1)

    @property
    def rows_received(self) -> torch.Tensor:
        """``(p,)`` rows every rank receives per forward."""
        return self.recv_rows.sum(1)


def kv_classes(pattern: Pattern, heads: int, kv_heads: int) -> Counter:
    """K/V heads grouped by what their query heads read: ``{(offsets per
    branch): number of K/V heads}`` (checked arguments)."""
    g = heads // kv_heads
    applies = [set(pattern.applies(i, heads)) for i in range(pattern.n_branches)]

    def offsets(kv: int, i: int) -> tuple[int, ...]:
        group = applies[i].intersection(range(kv * g, kv * g + g))
        return tuple(sorted({pattern.offset(h, i, heads) for h in group}))

    branches = range(pattern.n_branches)
    return Counter(tuple(offsets(kv, i) for i in branches) for kv in range(kv_heads))


def _odd_constant(i: int) -> int:
    """An odd 63-bit constant, the ``i``-th output of splitmix64 (hash mixing)."""
    m = (1 << 64) - 1
    z = ((i + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return ((z ^ (z >> 31)) & ((1 << 63) - 1)) | 1


def _unique_keys(
    n_rows: int, parts: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct keys of ``n_rows`` rows and each row's key index."""
    h = torch.zeros(n_rows, dtype=torch.int64)
    for b, (rows, vals) in enumerate(parts):
        if rows.numel():
            mult = torch.tensor([_odd_constant(6 * b + k) for k in range(6)], dtype=torch.int64)
            h.index_add_(0, rows, (vals * mult[:5]).sum(1) + mult[5])
    uniq, inverse = torch.unique(h, return_inverse=True)
    rep = torch.empty(uniq.numel(), dtype=torch.int64)
    rep.scatter_(0, inverse, torch.arange(n_rows))
    keys = torch.full((uniq.numel(), 5 * len(parts)), -1, dtype=torch.int64)
    where = torch.full((n_rows,), -1, dtype=torch.int64)
    exact = True
    for b, (rows, vals) in enumerate(parts):
        where.fill_(-1)
        where[rows] = torch.arange(rows.numel())
        at = where[rep]
        have = at >= 0
        keys[have, 5 * b : 5 * b + 5] = vals[at[have]]
        exact &= bool((vals == keys[inverse[rows], 5 * b : 5 * b + 5]).all())
        exact &= int(have[inverse].sum()) == rows.numel()
    if exact:
        return keys, inverse
    full = torch.full((n_rows, 5 * len(parts)), -1, dtype=torch.int64)
    for b, (rows, vals) in enumerate(parts):
        full[rows, 5 * b : 5 * b + 5] = vals
    return torch.unique(full, dim=0, return_inverse=True)


def _class_stats(
    key: tuple[int, ...], branches: list[tuple[int, int]], offsets: list[tuple], n_q: int,
    seen: dict[tuple, tuple[int, int, int]],
) -> tuple[int, ...]:  # fmt: skip
    """``(rows, first, last)`` of one sender piece for every K/V class."""
    shared = []
    for q in range(n_q):
        for i, (_, r) in enumerate(branches):
            at = 5 * (q * len(branches) + i)
            if key[at] >= 0:
                shared.append((i, r, *key[at : at + 5]))
    out: list[int] = []
    for offs in offsets:
        sets = tuple(sorted(
            (klo, khi, r, (res + o) % r) for i, r, klo, khi, res, qlen, qph in shared
            for o in offs[i] if qlen >= r or (o - qph) % r < qlen
        ))  # fmt: skip
        if sets not in seen:
            seen[sets] = union_stats(sets)
        out.extend(seen[sets])
    return tuple(out)


def _totals(
    per_class: torch.Tensor, class_counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, first, last)`` over the K/V heads from one head per class."""
    n_rows, first, last = per_class.unbind(2)
    have = n_rows > 0
    total = (n_rows * class_counts).sum(1)
    return total, torch.where(have, first, _BIG).amin(1), torch.where(have, last, -1).amax(1)


def _with_listed_rows(
    stats: torch.Tensor, columns: list[tuple[int, torch.Tensor, torch.Tensor]], listed: list[bool],
    branches: list[tuple[int, int]], offsets: list[tuple], longest: int,
) -> torch.Tensor:  # fmt: skip
    """``stats`` with the rows of the listed branches added."""
    n = stats.shape[0]
    out = stats.clone()
    listed_cols = [c for c in columns if listed[c[0]]]
    other_cols = [c for c in columns if not listed[c[0]]]
    for k, offs in enumerate(offsets):
        elems = []
        for i, rows, vals in listed_cols:
            r = branches[i][1]
            klo, khi, res, qlen, qph = (t[:, None] for t in vals.unbind(1))
            steps = torch.arange(-(-longest // r), dtype=torch.int64) * r
            for o in offs[i]:
                active = (qlen >= r) | ((o - qph) % r < qlen)
                e = klo + ((res + o - klo) % r) + steps
                full = torch.full((n, steps.numel()), _BIG, dtype=torch.int64)
                full[rows] = torch.where(active & (e < khi), e, _BIG)
                elems.append(full)
        if not elems:
            continue
        e = torch.cat(elems, 1)
        for i, rows, vals in other_cols:
            r = branches[i][1]
            klo, khi, res, qlen, qph = (t[:, None] for t in vals.unbind(1))
            er = e[rows]
            inside = (er >= klo) & (er < khi)
            held = torch.zeros_like(inside)
            for o in offs[i]:
                active = (qlen >= r) | ((o - qph) % r < qlen)
                held |= active & inside & ((er - res - o) % r == 0)
            e[rows] = torch.where(held, _BIG, er)
        e = e.sort(1).values
        new = e < _BIG
        new[:, 1:] &= e[:, 1:] != e[:, :-1]
        rows_k, first_k, last_k = stats[:, k].unbind(1)
        out[:, k, 0] = rows_k + new.sum(1)
        out[:, k, 1] = torch.where(rows_k > 0, torch.minimum(first_k, e[:, 0]), e[:, 0])
        out[:, k, 2] = torch.maximum(last_k, torch.where(new, e, -1).amax(1))
    return out


def _listed_branches(
    branches: list[tuple[int, int]], starts: torch.Tensor, bounds: torch.Tensor, longest: int
) -> list[bool]:
    """Which branches :func:`_analytic` lists per pair instead of keying."""
    out = []
    for w, r in branches:
        residues = torch.cat([starts.flatten(), bounds[:-1]]) % r
        many = w % r != 0 or torch.unique(residues).numel() > _FEW_RESIDUES
        out.append(-(-longest // r) <= _LISTED_ROWS and many)
    return out


def all_pieces(seq_len: int, p: int, layout: Layout) -> list[list[Piece]]:
    """Every rank's pieces, as :func:`ring_attention.core.layout.layout_pieces`
    gives them (computed from one split instead of one per rank)."""
    if not isinstance(layout, str):  # balanced: one (cached) set of cuts
        return [layout_pieces(seq_len, p, j, layout) for j in range(p)]
    if layout == "contiguous":
        return [[Piece(s, n, 0)] for s, n in shard_bounds(seq_len, p)]
    chunks = shard_bounds(seq_len, 2 * p)
    return [[Piece(*chunks[j], 0), Piece(*chunks[2 * p - 1 - j], chunks[j][1])] for j in range(p)]


def _analytic(
    pattern: Pattern, seq_len: int, heads: int, kv_heads: int, pieces: list[list[Piece]],
) -> dict[str, torch.Tensor]:  # fmt: skip
    p = len(pieces)
    branches = list(pattern.branches)
    offsets = pattern.branch_offsets(heads)
    classes = kv_classes(pattern, heads, kv_heads)
    starts = torch.tensor([[pc.start for pc in ps] for ps in pieces], dtype=torch.int64)
    lens = torch.tensor([[pc.length for pc in ps] for ps in pieces], dtype=torch.int64)
    n_pc = starts.shape[1]
    cu = pattern.documents_tensor("cpu")
    bounds = torch.tensor([0, seq_len]) if cu is None else cu
    out = {k: torch.zeros(p, p, dtype=torch.int64) for k in ("recv", "span", "pairs")}
    class_offsets = list(classes)
    class_counts = torch.tensor(list(classes.values()), dtype=torch.int64)
    longest = int(lens.max()) if lens.numel() else 0
    listed = _listed_branches(branches, starts, bounds, longest)
    memo: dict[tuple[int, ...], tuple[int, ...]] = {}
    unions: dict[tuple, tuple[int, int, int]] = {}

    per_chunk = max(1, _CHUNK // p)  # distances per chunk
    for d0 in range(1, p, per_chunk):
        ds = torch.arange(d0, min(p, d0 + per_chunk), dtype=torch.int64)
        j = torch.arange(p, dtype=torch.int64).repeat(ds.numel())
        d = ds.repeat_interleave(p)
        sender = (j - d) % p
        recv, span, pairs = (torch.zeros_like(j) for _ in range(3))
        for kp in range(n_pc):
            c = starts[sender, kp]
            e = c + lens[sender, kp]
            parts = []  # the memo's key parts: branches not listed
            columns = []  # (branch, rows, vals) of every shared segment
            for qp in range(n_pc):
                qa = starts[j, qp]
                qb = qa + lens[j, qp]
                valid = (qb > qa) & (e > c)
                left = e <= qa  # the sender piece lies before the query piece
                x = torch.where(left, qa, c)  # the segment must hold x ...
                y = torch.where(left, e - 1, qb - 1)  # ... and y
                for i, (w, r) in enumerate(branches):
                    parts.append((_NONE, _NONE.reshape(0, 5)))
                    # only pairs of pieces less than a segment apart can share one
                    rows = torch.nonzero(valid & (x - y < w)).flatten()
                    if rows.numel() == 0:
                        continue
                    s, se = segment_around(x[rows], w, bounds)
                    shared = (s <= y[rows]) & (left[rows] if pattern.causal else True)
                    rows, s, se = rows[shared], s[shared], se[shared]
                    rl, rc, re, rqa, rqb = (t[rows] for t in (left, c, e, qa, qb))
                    if rows.numel() == 0:
                        continue
                    klo = torch.where(rl, torch.maximum(rc, s), rc)
                    khi = torch.where(rl, re, torch.minimum(re, se))
                    qlo = torch.where(rl, rqa, torch.maximum(rqa, s))
                    qhi = torch.where(rl, torch.minimum(rqb, se), rqb)
                    qlen = qhi - qlo
                    phase = torch.where(qlen < r, (qlo - s) % r, 0)
                    parts5 = [klo - rc, khi - rc, (s - rc) % r, torch.clamp(qlen, max=r), phase]
                    vals = torch.stack(parts5, dim=1)
                    columns.append((i, rows, vals))
                    if not listed[i]:
                        parts[-1] = (rows, vals)
                    acc = torch.zeros_like(s)
                    for o, nh in offsets[i].items():
                        nq = active_before(qhi - s, o, r) - active_before(qlo - s, o, r)
                        nk = active_before(khi - s, o, r) - active_before(klo - s, o, r)
                        acc += nh * nq * nk
                    pairs.index_add_(0, rows, acc)
            keys, inverse = _unique_keys(j.numel(), parts)
            stats = []
            for key in map(tuple, keys.tolist()):
                if key not in memo:
                    memo[key] = _class_stats(key, branches, class_offsets, n_pc, unions)
                stats.append(memo[key])
            per_class = torch.tensor(stats, dtype=torch.int64).reshape(-1, len(classes), 3)
            if any(listed[i] for i, _, _ in columns):
                per_class = _with_listed_rows(
                    per_class[inverse], columns, listed, branches, class_offsets, longest
                )
                rows, first, last = _totals(per_class, class_counts)
            else:  # per key, then per pair
                rows, first, last = (t[inverse] for t in _totals(per_class, class_counts))
            width = torch.where(rows > 0, last - first + 1, 0)
            recv += rows
            span += torch.where(rows == width * kv_heads, 0, width)
        for name, t in (("recv", recv), ("span", span), ("pairs", pairs)):
            out[name][:, ds[0] : ds[-1] + 1] = t.view(ds.numel(), p).T
    return out


#: The ring's own ``build_plan``, set by ``ring_attention/__init__.py`` when the
#: compiled extension loads; without it the planner runs on closed forms.
exact_plans: Callable[..., Any] | None = None


def plan_rows(
    pattern: Pattern, seq_len: int, heads: int, kv_heads: int, p: int, layout: str, *ring: Any
) -> dict[str, torch.Tensor]:
    """``recv[j, d]`` and ``span[j, d]`` of every rank's own plan
    (:data:`exact_plans`; ``ring``: its fold and head range)."""
    assert exact_plans is not None
    recv, span, shift = (torch.zeros(p, p, dtype=torch.int64) for _ in range(3))
    for j in range(p):
        plan = exact_plans(pattern, seq_len, heads, kv_heads, p, j, layout, *ring)
        for step in plan.steps:
            recv[j, step.distance] = step.recv_rows
            for ix in step.recv_idx:
                if ix.numel():
                    lo, hi = int(ix[0]) // kv_heads, int(ix[-1]) // kv_heads + 1
                    if ix.numel() != (hi - lo) * kv_heads:
                        span[j, step.distance] += hi - lo
                    shift[j, step.distance] += ix.numel() if lo else 0
    return {"recv": recv, "span": span, "shift": shift}


def _sends(recv: torch.Tensor) -> torch.Tensor:
    """``send[j, d]``: what ``j + d`` receives from ``j``."""
    ranks = torch.arange(recv.shape[0])
    send = recv.gather(0, (ranks[:, None] + ranks) % recv.shape[0])
    send[:, 0] = 0
    return send


def predict_traffic(
    pattern: Pattern, seq_len: int, heads: int, kv_heads: int | None = None, world_size: int = 1,
    layout: str = "contiguous", *, source: str = "auto",
) -> Traffic:  # fmt: skip
    """The :class:`Traffic` of every rank of a ring of ``world_size``; ``source``:
    ``"plan"``, ``"analytic"`` or ``"auto"`` (docs/planner.md)."""
    seq_len, heads = check_planner_args(pattern, seq_len, heads)
    kv_heads = heads if kv_heads is None else check_int(kv_heads, "kv_heads", 1, heads)
    if heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads = {heads}, got kv_heads = {kv_heads}")
    layout = resolve_layout(layout, pattern)
    if source not in SOURCES:
        raise ValueError(f"source must be one of {list(SOURCES)}, got {source!r}")
    p = check_int(world_size, "world_size", 1, MAX_WORLD_SIZE)
    return traffic_of(pattern, seq_len, heads, kv_heads, all_pieces(seq_len, p, layout), layout,
                      source)  # fmt: skip


def traffic_of(
    pattern: Pattern, seq_len: int, heads: int, kv_heads: int, pieces: list[list[Piece]],
    layout: str, source: str = "auto", fold: int = 1,
) -> Traffic:  # fmt: skip
    """The :class:`Traffic` of the ranks holding ``pieces`` (checked arguments;
    ``fold``: the hybrid's Ulysses size), on one intra-op thread."""
    p = len(pieces)
    total = ranks_pairs(
        pattern, seq_len, heads, [[(pc.start, pc.length) for pc in ps] for ps in pieces]
    )
    if max(total) >= 1 << 62:
        raise ValueError(
            f"seq_len = {seq_len} on {p} ranks with {heads} heads: a rank's {max(total)} "
            "reached pairs exceed the planner's int64 counters"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: threads only add synchronisation
    try:
        counts = _analytic(pattern, seq_len, heads, kv_heads, pieces)
    finally:
        torch.set_num_threads(threads)
    use_plan = source == "plan" or (
        source == "auto" and p * seq_len * heads <= _PLAN_WORK_LIMIT and exact_plans is not None
    )
    if pattern.windowed and not use_plan:  # ranks_pairs counts them; the closed forms do not
        raise ValueError(
            f"the planner's closed forms do not take a sliding window (window="
            f"{pattern.window}); the ring's own plans do (source='plan', or 'auto' up to "
            f"p * n * heads = {_PLAN_WORK_LIMIT}, with the compiled extension)"
        )
    if use_plan and exact_plans is None:
        raise ImportError(
            "source='plan' builds the ring's own plans, which need the compiled extension "
            "ring_attention._C (scripts/setup.sh); source='analytic' does not"
        )
    if use_plan and p > 1:  # one rank exchanges nothing
        counts.update(plan_rows(pattern, seq_len, heads, kv_heads, p, layout, fold))
    recv = counts["recv"]
    send = _sends(recv)
    total_t = torch.tensor(total, dtype=torch.int64)
    return Traffic(
        pattern=pattern, seq_len=int(seq_len), heads=int(heads), kv_heads=int(kv_heads),
        world_size=p, layout=layout, source="plan" if use_plan else "analytic",
        local_len=torch.tensor([sum(pc.length for pc in ps) for ps in pieces], dtype=torch.int64),
        total_pairs=total_t, local_pairs=total_t - counts["pairs"].sum(1), recv_rows=recv,
        send_rows=send, span_rows=counts["span"], step_pairs=counts["pairs"],
        shifted_rows=counts.get("shift"),
    )  # fmt: skip
