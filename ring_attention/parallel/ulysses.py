"""Head-parallel (Ulysses) and ring x Ulysses hybrid attention: all-to-alls
trading sequence for heads around the attention (docs/design.md §3.1)."""

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core.call import Call, prepare
from ..core.checks import check_qkv, check_sinks, resolve_scale
from ..core.layout import Layout, check_layout, layout_pieces, resolve_layout, shard_bounds
from ..core.pattern import Pattern, as_flag
from ..local import engine
from .comm import comm_device
from .handshake import (
    RING_FIELDS,
    RING_WHAT,
    gather_objects,
    grid_handshake,
    named_values,
    reject,
    reject_through,
    ring_message,
    topology_of,
)
from .mesh import Topology, check_grid, check_ring, world_info
from .ring_spec import given_pattern, pattern_of_call
from .stretch import Row, from_stretch, to_stretch

__all__ = ["AllToAllStats", "last_all_to_all_stats", "reject_sharded", "sharded_attention",
           "ulysses_call"]  # fmt: skip

Tensor = torch.Tensor

_CALL = "ring_dilated_attention"


@dataclass
class AllToAllStats:
    """Bytes this rank's all-to-alls moved in the last Ulysses call (reset at
    every forward), per phase: ``"qkv"``, ``"out"``, ``"qkv_grad"``, ``"out_grad"``."""

    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget everything."""
        self.sent.clear()
        self.received.clear()

    def record(self, phase: str, sent: int, received: int) -> None:
        """Add one exchange."""
        self.sent[phase] = self.sent.get(phase, 0) + sent
        self.received[phase] = self.received.get(phase, 0) + received

    def bytes_sent(self, phase: str | None = None) -> int:
        """Bytes sent, all phases or one."""
        return sum(v for k, v in self.sent.items() if phase is None or k == phase)


#: All-to-all counters of the last Ulysses call on this rank (mutated in place).
last_all_to_all_stats = AllToAllStats()


@dataclass(frozen=True, eq=False)
class _Link:
    """The Ulysses group of a call: who is who, and the transport device."""

    group: dist.ProcessGroup
    peers: tuple[int, ...]  # global ranks, Ulysses-index order
    me: int
    device: torch.device  # compute device
    comm: torch.device  # transport device

    def exchange(self, sends: list[list[Tensor]],
                 recv: list[list[tuple[tuple[int, ...], torch.dtype]]],
                 phase: str) -> list[list[Tensor]]:  # fmt: skip
        """Send ``sends[p]`` to peer ``p`` and receive tensors of ``recv[p]``
        from it; parts of one dtype travel packed in one buffer per peer."""
        out: list[list[Tensor | None]] = [[None] * len(spec) for spec in recv]
        for k, t in enumerate(sends[self.me]):  # a copy: an output is never an input
            out[self.me][k] = t.clone(memory_format=torch.contiguous_format)
        sent = received = 0
        for dt in dict.fromkeys([d for spec in recv for _, d in spec]
                                + [t.dtype for ts in sends for t in ts]):  # fmt: skip
            ops, keep, inbox = [], [], []
            for p, peer in enumerate(self.peers):
                if p == self.me:
                    continue
                parts = [t.flatten() for t in sends[p] if t.dtype == dt]
                if sum(t.numel() for t in parts):
                    keep.append(torch.cat(parts).to(self.comm))  # kept alive until the wait
                    ops.append(dist.P2POp(dist.isend, keep[-1], peer, self.group))
                    sent += keep[-1].numel() * keep[-1].element_size()
                numel = sum(math.prod(s) for s, d in recv[p] if d == dt)
                if numel:
                    inbox.append((p, torch.empty(numel, dtype=dt, device=self.comm)))
                    ops.append(dist.P2POp(dist.irecv, inbox[-1][1], peer, self.group))
                    received += numel * inbox[-1][1].element_size()
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait()
            for p, buf in inbox:
                ks = [k for k, (_, d) in enumerate(recv[p]) if d == dt]
                parts = buf.to(self.device).split([math.prod(recv[p][k][0]) for k in ks])
                for k, part in zip(ks, parts, strict=True):
                    out[p][k] = part.view(recv[p][k][0])
        for p, spec in enumerate(recv):  # empty parts
            for k, (shape, d) in enumerate(spec):
                if out[p][k] is None:
                    out[p][k] = torch.empty(shape, dtype=d, device=self.device)
        last_all_to_all_stats.record(phase, sent, received)
        return out  # type: ignore[return-value]


class _AllToAll(torch.autograd.Function):
    """``link.exchange`` as an autograd function (gradients go back)."""

    @staticmethod
    def forward(ctx, link: _Link, counts: tuple[int, ...], recv, phase: str, *sends: Tensor):  # type: ignore[override]
        nested = _nest(sends, counts)
        got = link.exchange(nested, recv, phase)
        ctx.link, ctx.phase, ctx.recv = link, phase, recv
        ctx.back = [[(tuple(t.shape), t.dtype) for t in ts] for ts in nested]
        ctx.set_materialize_grads(False)
        return tuple(t for ts in got for t in ts)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):  # type: ignore[override]
        specs = [s for spec in ctx.recv for s in spec]
        grads = [torch.zeros(shape, dtype=dt, device=ctx.link.device) if g is None else g
                 for g, (shape, dt) in zip(grads, specs, strict=True)]  # fmt: skip
        got = ctx.link.exchange(_nest(grads, [len(s) for s in ctx.recv]), ctx.back,
                                ctx.phase + "_grad")  # fmt: skip
        return (None, None, None, None, *(t for ts in got for t in ts))


def _all_to_all(link: _Link, sends: list[list[Tensor]], recv: list[list[tuple]],
                phase: str) -> list[list[Tensor]]:  # fmt: skip
    flat = _AllToAll.apply(link, tuple(len(s) for s in sends), recv, phase,
                           *(t for ts in sends for t in ts))  # fmt: skip
    return _nest(flat, [len(spec) for spec in recv])


def _nest(flat, sizes) -> list[list]:
    """``flat`` cut into lists of ``sizes``."""
    parts = iter(flat)
    return [list(itertools.islice(parts, n)) for n in sizes]


def kv_head_range(head_start: int, count: int, heads: int, kv_heads: int) -> tuple[int, int]:
    """``[begin, end)`` of the K/V heads that query heads ``[head_start,
    head_start + count)`` read (empty for no query head)."""
    if count <= 0:
        return (0, 0)
    group = heads // kv_heads
    return head_start // group, (head_start + count - 1) // group + 1


def ulysses_call(q_local: Tensor, k_local: Tensor, v_local: Tensor, build: Callable[..., Pattern],
                 args: tuple, *, cu_seqlens: Sequence[int] | Tensor | None, scale: float | None,
                 group: dist.ProcessGroup | None, ulysses_group: dist.ProcessGroup | None, mesh,
                 layout: str, return_lse: bool, sinks: Tensor | None,
                 ring: Callable) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """``ring_dilated_attention`` with ``ulysses_group`` or ``mesh``, the pattern
    ``build(*args)`` built inside the agreement rounds; ``ring``: the ring."""
    topo = topology_of(group, ulysses_group, mesh, _CALL)
    check_grid(topo)
    if topo.ulysses_size == 1:  # a ring (a 1-D mesh), or one process
        if topo.ring_size > 1:
            return ring(q_local, k_local, v_local, build, args, cu_seqlens=cu_seqlens, scale=scale,
                        group=topo.ring_group, layout=layout, return_lse=return_lse,
                        ranks=topo.ring_ranks, sinks=sinks)  # fmt: skip
        pattern = pattern_of_call(cu_seqlens, build, *args)
        check_layout(layout)
        one, _ = prepare(q_local, k_local, v_local, pattern, scale=scale, return_lse=return_lse,
                         sinks=sinks)  # fmt: skip
        out, lse = engine.attend(one, q_local, k_local, v_local)
        return (out, lse) if one.return_lse else out

    message = pattern = error = None
    try:
        return_lse = as_flag(return_lse, "return_lse")
        pattern = pattern_of_call(cu_seqlens, build, *args)
        layout = resolve_layout(layout, pattern)
        shape = check_qkv(q_local, k_local, v_local)
        pattern.check_heads(shape.heads)
        check_sinks(sinks, shape.heads, q_local.device)
        scale = resolve_scale(scale, shape.head_dim)
        for g in (topo.ulysses_group, topo.ring_group):
            if g is not None:
                comm_device(g, q_local.device)  # raises for unsupported transports
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_local, k_local, v_local))
        # the window is part of the pattern, so of its digest in this message
        message = ring_message(q_local, shape.kv_heads, pattern, scale=scale, layout=layout,
                               needs_grad=grad)  # fmt: skip
    except Exception as exc:  # every rank must hear of it: reported in the rounds
        error = exc

    def describe() -> str:  # (only where every rank's checks passed)
        B, _, H, D = q_local.shape
        grad = message[RING_FIELDS.index("requires_grad")] if message else "?"
        return (f"batch {B}, heads {H}, kv_heads {k_local.shape[2]}, head_dim {D}, "
                f"{q_local.dtype}, {pattern.describe() if message else '?'}, scale {scale}, "
                f"layout {layout}, requires_grad {grad}")  # fmt: skip

    def explain(name: str, vals: list[int]) -> str | None:  # a disagreement in the row round
        prefix = f"{_CALL}: the ranks of a Ulysses group disagree on "
        if name == "pattern":
            mine = pattern.describe() if message else "?"
            words = gather_objects(mine, topo.ulysses_group, topo.ulysses_order)
            return prefix + "the pattern: " + "; ".join(f"Ulysses index {j}: {w}"
                                                         for j, w in enumerate(words))  # fmt: skip
        if name in ("dtype", "requires_grad"):  # as the ring says them
            return prefix + f"{RING_WHAT[name]}: {named_values(name, vals)} (Ulysses-index order)"
        return None

    n, row_lengths = grid_handshake(topo, _CALL, RING_FIELDS, message, layout, error=error,
                                    explain=explain, describe=describe)  # fmt: skip
    if error is not None:
        raise error
    pattern.check_length(n)
    last_all_to_all_stats.reset()

    U, W = topo.ulysses_size, topo.world_size
    H, Hkv = shape.heads, shape.kv_heads
    heads = tuple(shard_bounds(H, U))
    row = Row(pieces=tuple(tuple(layout_pieces(n, W, topo.ring_index * U + m, layout))
                           for m in range(U)),
              heads=heads, kv=tuple(kv_head_range(s, c, H, Hkv) for s, c in heads))  # fmt: skip
    assert row.lengths() == row_lengths
    link = _Link(topo.ulysses_group, topo.ulysses_ranks, topo.ulysses_index, q_local.device,
                 comm_device(topo.ulysses_group, q_local.device))  # fmt: skip
    out, lse = _ulysses(link, topo, row, q_local, k_local, v_local, pattern, scale, layout, ring)
    if sinks is not None:  # once per query: this rank's shard, every head
        out, lse = engine.fold_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def _ulysses(link: _Link, topo: Topology, row: Row, q: Tensor, k: Tensor, v: Tensor,
             pattern: Pattern, scale: float, layout: Layout,
             ring: Callable) -> tuple[Tensor, Tensor]:  # fmt: skip
    B, L, H, D = q.shape
    h0, hl = row.heads[link.me]
    kv0, kv1 = row.kv[link.me]
    dt = q.dtype
    # sequence -> heads
    sends = [[q.narrow(2, s, c), k.narrow(2, a, b - a), v.narrow(2, a, b - a)]
             for (s, c), (a, b) in zip(row.heads, row.kv, strict=True)]  # fmt: skip
    recv = [[((B, ln, hl, D), dt), ((B, ln, kv1 - kv0, D), dt), ((B, ln, kv1 - kv0, D), dt)]
            for ln in row.lengths()]  # fmt: skip
    got = _all_to_all(link, sends, recv, "qkv")
    qs, ks, vs = (to_stretch([g[x] for g in got], row, 1) for x in range(3))
    del got, sends  # the received blocks: copied into the stretch
    S = qs.shape[1]

    # the whole stretch, this rank's heads
    lse_dt = torch.float64 if dt == torch.float64 else torch.float32
    if hl == 0:  # more ranks than heads: nothing to compute, but the backward's
        # exchanges need this rank, so its (empty) output stays in the graph
        out_s = qs * 0
        lse_s = torch.zeros(B, 0, S, dtype=lse_dt, device=q.device)
    else:
        heads = (h0, H, k.shape[2])  # the global heads' offsets, groups and K/V heads
        if topo.ring_size == 1:
            out_s, lse_s = engine.attend(Call(pattern, scale).with_heads(*heads), qs, ks, vs)
        else:
            out_s, lse_s = ring(qs, ks, vs, given_pattern, (pattern,), cu_seqlens=None,
                                scale=scale, group=topo.ring_group, layout=layout,
                                return_lse=True, fold=topo.ulysses_size, ranks=topo.ring_ranks,
                                head_range=heads)  # fmt: skip
    del qs, ks, vs  # (kept by autograd where the backward needs them)

    # heads -> sequence
    sends = [[o, s] for o, s in zip(from_stretch(out_s, row, 1), from_stretch(lse_s, row, 2),
                                     strict=True)]  # fmt: skip
    del out_s, lse_s
    recv = [[((B, L, c, D), dt), ((B, c, L), lse_dt)] for _, c in row.heads]
    got = _all_to_all(link, sends, recv, "out")
    del sends
    out = torch.cat([g[0] for g in got], dim=2)
    lse = torch.cat([g[1] for g in got], dim=1)
    return out, lse


def reject_sharded(group, ulysses_group, mesh, error: BaseException | None = None) -> None:
    """Take part in a sharded call's agreement rounds as a rank whose inputs
    failed (``error``): the other ranks raise; the caller raises its own."""
    if ulysses_group is None and mesh is None:
        if world_info(group)[0] > 1:
            check_ring(group)
            reject(group, _CALL, error)
        return
    topo = topology_of(group, ulysses_group, mesh, _CALL)
    check_grid(topo)
    reject_through(topo, _CALL, error)


def sharded_attention(q_local: Tensor, k_local: Tensor, v_local: Tensor,
                      build: Callable[..., Pattern], args: tuple, *,
                      cu_seqlens: Sequence[int] | Tensor | None, scale: float | None,
                      group: dist.ProcessGroup | None, ulysses_group: dist.ProcessGroup | None,
                      mesh, layout: str, return_lse: bool, sinks: Tensor | None = None,
                      ring: Callable) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """The ring, Ulysses or the hybrid (by the groups) with the pattern
    ``build(*args)``: every entry of the package calls this; ``ring``: the ring's
    entry (ring_attention/parallel/ring.py), passed in as to :func:`ulysses_call`."""
    if ulysses_group is not None or mesh is not None:
        call = (q_local, k_local, v_local, build, args)
        kwargs = dict(cu_seqlens=cu_seqlens, scale=scale, group=group, ulysses_group=ulysses_group,
                      mesh=mesh, layout=layout, return_lse=return_lse, sinks=sinks,
                      ring=ring)  # fmt: skip
        if torch.compiler.is_compiling():
            from .ulysses_eager import ulysses_eagerly

            return ulysses_eagerly(ulysses_call, *call, **kwargs)
        return ulysses_call(*call, **kwargs)
    return ring(q_local, k_local, v_local, build, args, cu_seqlens=cu_seqlens, scale=scale,
                group=group, layout=layout, return_lse=return_lse, sinks=sinks)  # fmt: skip
