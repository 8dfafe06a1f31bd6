"""The planner for the ring, Ulysses and the hybrid: bytes sent, peak memory and
time per rank and layer, and which mode wins (docs/planner.md)."""

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..core.layout import Piece, layout_pieces, layout_shard_lengths, resolve_layout, shard_bounds
from ..core.links import Link
from .memory import KERNEL_WORKSPACE, LayerMemory, acc_bytes, layer_memories
from .timing import RankTime, layer_times
from .traffic import Traffic, traffic_of

MODES = ("ring", "ulysses", "hybrid")
_ZIGZAG = "piece copies (zigzag)"  # a memory item of .memory


@dataclass(frozen=True)
class ModeRank:
    """One rank of one mode: bytes sent per layer (all-to-all, ring),
    peak memory items and time."""

    rank: int
    a2a_forward: int
    a2a_forward_backward: int
    ring_forward: int
    ring_forward_backward: int
    forward_peak: int
    training_peak: int
    training_items: dict[str, int]
    time: RankTime | None
    a2a_seconds: tuple[float, float]  # forward, forward + backward

    @property
    def sent_forward(self) -> int:
        return self.a2a_forward + self.ring_forward

    @property
    def sent_forward_backward(self) -> int:
        return self.a2a_forward_backward + self.ring_forward_backward

    @property
    def seconds(self) -> tuple[float, float]:
        """Forward and forward + backward time of one layer."""
        f = self.time.forward if self.time else 0.0
        fb = self.time.forward_backward if self.time else 0.0
        return f + self.a2a_seconds[0], fb + self.a2a_seconds[1]


@dataclass(frozen=True, eq=False)
class ModeEvaluation:
    """A mode (``R`` rings x ``U`` Ulysses ranks) at one length."""

    mode: str
    ring: int
    ulysses: int
    seq_len: int
    ranks: list[ModeRank]
    idle: int  # ranks with no head (heads < U)
    rate_source: str

    @cached_property
    def worst(self) -> dict[str, float]:
        """The largest value over the ranks of every quantity."""
        names = ("sent_forward", "sent_forward_backward", "a2a_forward_backward",
                 "ring_forward_backward", "forward_peak", "training_peak")  # fmt: skip
        out = {k: max(getattr(x, k) for x in self.ranks) for k in names}
        out["forward_s"] = max(x.seconds[0] for x in self.ranks)
        out["forward_backward_s"] = max(x.seconds[1] for x in self.ranks)
        return out


def _a2a_bytes(L: list[int], c: list[int], k: list[int], j: int, D: int, B: int, s: int,
               a: int) -> tuple[int, int, int, int]:  # fmt: skip
    """Bytes rank ``j`` of a Ulysses group sends, forward and backward."""
    U = len(L)
    peers = [p for p in range(U) if p != j]
    qkv = sum(L[j] * (c[p] + 2 * k[p]) for p in peers) * D * B * s
    out = sum(L[p] * c[j] for p in peers) * (D * s + a) * B
    out_grad = sum(L[j] * c[p] for p in peers) * (D * s + a) * B
    qkv_grad = sum(L[p] * (c[j] + 2 * k[j]) for p in peers) * D * B * s
    return qkv, out, out_grad, qkv_grad


def evaluate_mode(
    setup: Any, seq_len: int, R: int, U: int, *, a2a_link: Link | None = None,
    ring_link: Link | None = None, mode: str | None = None,
) -> ModeEvaluation:  # fmt: skip
    """Every rank of ``R`` rings x ``U`` Ulysses ranks at ``seq_len``
    (``U = 1``: the ring; ``R = 1``: Ulysses). Links default to the setup's."""
    a2a_link = a2a_link or setup.link
    ring_link = ring_link or setup.link
    pattern = setup.pattern_at(seq_len)
    layout = resolve_layout(setup.layout, pattern)
    H, Hkv, D, B, s = setup.heads, setup.kv_heads, setup.head_dim, setup.batch, setup.itemsize
    acc = acc_bytes(s)
    W = R * U
    lengths = layout_shard_lengths(seq_len, W, layout)
    heads = shard_bounds(H, U)
    c = [n for _, n in heads]
    g = H // Hkv  # the K/V heads of each rank's query heads
    k = [(st + n - 1) // g + 1 - st // g if n > 0 else 0 for st, n in heads]
    rates = setup.rates(max(layout_shard_lengths(seq_len, R, layout, U)))
    keys = [(c[j], k[j] if c[j] % max(k[j], 1) == 0 else c[j]) for j in range(U)]
    # the ring of R ranks, each holding its Ulysses group's stretch, as many pieces each
    pieces = [layout_pieces(seq_len, R, i, layout, U) for i in range(R)]
    runs = [len(ps) for ps in pieces]  # (zigzag: the middle rank's runs are adjacent, merged)
    for ps in pieces:
        end = sum(p.length for p in ps)
        ps += [Piece(ps[-1].start + ps[-1].length, 0, end)] * (max(runs) - len(ps))
    slices: dict[tuple[int, int], tuple[Traffic, list[LayerMemory], list[RankTime]]] = {}
    for key in keys:
        if key[0] and key not in slices:
            tr = traffic_of(pattern, seq_len, *key, pieces, layout, setup.source, U)
            mems = layer_memories(tr, B, D, s, device=setup.device)
            slices[key] = (tr, mems, layer_times(tr, B, D, s, rates, ring_link))
    out = []
    for v in range(W):
        i, j = divmod(v, U)
        row = lengths[i * U : (i + 1) * U]
        S = sum(row)
        qkv, o, og, qg = _a2a_bytes(row, c, k, j, D, B, s, acc)  # (U = 1: no peers, 0)
        tr_mem_time = slices.get(keys[j])
        ring_f = ring_fb = 0
        mem = time = None
        if tr_mem_time is not None:
            tr, mems, times = tr_mem_time
            ring_f = int(2 * tr.rows_sent[i]) * B * D * s
            ring_fb = 2 * ring_f + int(2 * tr.rows_received[i]) * B * D * acc
            mem, time = mems[i], times[i]
            if runs[i] == 1:  # one run: no copies
                fwd, bwd = {**mem.forward, _ZIGZAG: 0}, {**mem.backward, _ZIGZAG: 0}
                mem = LayerMemory(mem.inputs, fwd, bwd, mem.buffers)
        L = lengths[v]
        if U == 1:  # the ring itself: its own items
            f_own, t_own = (mem.forward, _training(mem)) if mem else ({}, {})
        else:
            f_own, t_own = _grid_items(L, S, H, c, k, j, D, B, s, acc, mem, (qkv, o, og))
        local = {"q, k, v": L * (H + 2 * Hkv) * D * B * s}
        f_items, t_items = {**local, **f_own}, {**local, "grad_out": L * H * D * B * s, **t_own}
        a2a_f = a2a_link.seconds(qkv) + a2a_link.seconds(o)
        a2a_b = a2a_link.seconds(og) + a2a_link.seconds(qg)
        out.append(ModeRank(
            rank=v, a2a_forward=qkv + o, a2a_forward_backward=qkv + o + og + qg,
            ring_forward=ring_f, ring_forward_backward=ring_fb,
            forward_peak=sum(f_items.values()), training_peak=sum(t_items.values()),
            training_items=t_items, time=time,
            a2a_seconds=(a2a_f, a2a_f + a2a_b),
        ))  # fmt: skip
    name = mode or ("ring" if U == 1 else "ulysses" if R == 1 else "hybrid")
    return ModeEvaluation(name, R, U, seq_len, out, sum(1 for x in c if x == 0), rates.source)


def _training(mem: LayerMemory) -> dict[str, int]:
    """The ring's own training items beyond q, k, v and grad_out."""
    extra = {k: v for k, v in mem.inputs.items() if k not in ("q", "k, v", "grad_out")}
    fwd, bwd = sum(mem.forward.values()), sum(mem.backward.values())
    return {**extra, **(mem.backward if bwd >= fwd else mem.forward)}


def _grid_items(L, S, H, c, k, j, D, B, s, acc, mem, a2a):
    """Peak memory items of one Ulysses rank beyond its q, k, v and grad_out: inference and
    training (``a2a``: the packed q, k, v and out, lse going out, their gradients coming back)."""
    send1, send2, back2 = a2a
    vec = D * B * s
    stretch = S * (c[j] + 2 * k[j]) * vec  # q, k, v of this rank's heads over the stretch
    o_s = S * c[j] * (vec + B * acc)  # out and lse over the stretch
    full = L * H * (vec + B * acc)  # out and lse of every head, own shard
    attn_f = sum(mem.forward.values()) if mem else 0
    attn_b = sum(v for k_, v in mem.backward.items() if k_ != KERNEL_WORKSPACE) if mem else 0
    plan = mem.inputs.get("plan indices (cached)", 0) if mem else 0
    # forward: the all-to-all of q/k/v, the attention, the all-to-all of out/lse
    fwd = {
        "all-to-all q, k, v": stretch + max(send1, stretch),
        "attention": stretch + attn_f,
        "all-to-all out, lse": max(o_s + send2 + full, 2 * full),
    }
    top = max(fwd, key=fwd.get)
    f_items = {"plan indices (cached)": plan, top: fwd[top]}
    # backward: the saved stretch and output, then the same three in reverse
    saved = stretch + o_s
    bwd = {
        "all-to-all grad out, lse": saved + full + back2 + send2 + o_s,
        "attention backward": saved + full + o_s + attn_b,
        "all-to-all grad q, k, v": full + 2 * stretch + send1,
    }
    btop = max(bwd, key=bwd.get)
    phase, value = (btop, bwd[btop]) if bwd[btop] >= fwd[top] else (top, fwd[top])
    return f_items, {"plan indices (cached)": plan, phase: value}


def grid_for(mode: str, ranks: int, gpus_per_node: int, ulysses: int | None = None):
    """``(R, U)`` of a mode on ``ranks``; ``ValueError`` (naming the options)
    where a Ulysses group would straddle two nodes."""
    if mode == "ring":
        return ranks, 1
    if mode == "ulysses":
        return 1, ranks
    G = gpus_per_node
    if ulysses is None:
        if ranks > G and ranks % G:
            raise ValueError(
                f"the hybrid puts one Ulysses group on each node: {ranks} ranks (--gpus/"
                f"--processes) are not a whole number of nodes of --gpus-per-node {G}; give "
                f"whole nodes, or --ulysses U (U dividing both {ranks} and {G})"
            )
        U = min(G, ranks)
    else:
        U = ulysses
        if ranks % U:
            raise ValueError(f"--ulysses {U} must divide the ranks ({ranks})")
        if ranks > G and G % U and U % G:
            raise ValueError(
                f"--ulysses {U} neither divides --gpus-per-node {G} nor is a multiple of it: "
                "its Ulysses groups would straddle nodes"
            )
    return ranks // U, U


def compare_modes(
    setup: Any, seq_len: int, gpus_per_node: int, intra: Link, inter: Link,
    ulysses: int | None = None, modes: tuple[str, ...] = MODES,
) -> list[ModeEvaluation]:  # fmt: skip
    """The ``modes`` on ``setup.ranks`` ranks, ``gpus_per_node`` per node
    (``intra`` inside a node, ``inter`` across nodes)."""
    ring = intra if setup.ranks <= gpus_per_node else inter
    grids = {mode: grid_for(mode, setup.ranks, gpus_per_node, ulysses) for mode in modes}
    return [evaluate_mode(setup, seq_len, R, U, a2a_link=intra if U <= gpus_per_node else inter,
                          ring_link=ring, mode=mode) for mode, (R, U) in grids.items()]  # fmt: skip


def advice(evals: list[ModeEvaluation], usable: int) -> list[str]:
    """Which mode wins: the fastest forward + backward among those that fit."""
    fits = [e for e in evals if e.worst["training_peak"] <= usable]
    if not fits:
        best_mem = min(evals, key=lambda e: e.worst["training_peak"])
        return [f"none fits; {best_mem.mode} needs the least memory per rank"]
    best = min(fits, key=lambda e: e.worst["forward_backward_s"])
    t = best.worst["forward_backward_s"]
    lines = [
        f"fastest that fits: {best.mode} ({best.ring} x {best.ulysses}), "
        + (f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms")
        + " per layer forward + backward"
    ]
    for e in (e for e in evals if e is not best):
        ratio = e.worst["forward_backward_s"] / max(t, 1e-30)
        lines.append(f"{e.mode}: {ratio:.2f}x the time" if e in fits else f"{e.mode} does not fit")
        if e.idle:
            lines.append(f"{e.mode}: {e.idle} of {e.ulysses} Ulysses ranks have no head")
    return lines
