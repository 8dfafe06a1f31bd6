"""Peak memory per rank of one ring attention layer, item by item, from a
:class:`~.traffic.Traffic` (the items: docs/planner.md)."""

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.geometry import head_groups
from .throughput import acc_bytes

#: The backward kernel's ``delta``: a host vector on the CPU, not a tensor.
KERNEL_WORKSPACE = "kernel delta"

#: Bytes per element of the dtypes the kernels take.
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def _slots_used(index: torch.Tensor, posting: torch.Tensor) -> torch.Tensor:
    """``(p,)``: the buffers of one packed kind each rank touches (slots by ``index`` parity)."""
    return (posting & (index % 2 == 0)).any(1).long() + (posting & (index % 2 == 1)).any(1).long()


def transport_buffers(
    tr: Any, batch: int, head_dim: int, itemsize: int, far_bytes: int = 0
) -> dict[str, dict[str, torch.Tensor]]:
    """Bytes of every transport buffer each rank allocates per pass,
    ``{"forward" | "backward": {kind: (p,) bytes}}``."""
    acc = acc_bytes(itemsize)
    row = 2 * batch * head_dim  # a K and a V vector of one (row, K/V head)
    send_rows, recv_rows, *_ = tr.far(row * itemsize, far_bytes)
    sends, recvs = send_rows > 0, recv_rows > 0
    cap_s, cap_r = send_rows.max(1).values, recv_rows.max(1).values
    span = tr.span_rows.max(1).values
    any_s, any_r = sends.any(1).long(), (tr.recv_rows > 0).any(1).long()
    position = torch.cumsum((sends | recvs).long(), 1) - 1  # forward: slots by step position
    distance = torch.arange(tr.world_size).expand_as(position)  # backward: by distance
    row_map = any_r * 4 * tr.kv_heads * span  # int32 per (position, K/V head)
    far_sent = (tr.send_rows - send_rows).sum(1) * row
    far_received = (tr.recv_rows - recv_rows).sum(1) * row
    fwd = {
        "send K/V": any_s * row * cap_s * itemsize,
        "receive K/V": _slots_used(position, recvs) * row * cap_r * itemsize,
        "row maps": row_map,
        "far send K/V": far_sent * itemsize,
        "far receive K/V": far_received * itemsize,
    }
    back_r = _slots_used(distance, recvs)
    bwd = {
        **fwd,
        "receive K/V": back_r * row * cap_r * itemsize,
        "dK/dV returned": back_r * row * cap_r * acc,
        "dK/dV coming home": _slots_used(distance, sends) * row * cap_s * acc,
        "far dK/dV returned": far_received * acc,
        "far dK/dV coming home": far_sent * acc,
    }
    return {"forward": fwd, "backward": bwd}


def _with_indices(tr: Any, bufs: dict) -> dict:
    """``bufs`` and the int64 indices each pass makes of the received rows of a span after a
    piece's start (the ring's own plans tell; closed forms: none)."""
    idx = 0 if tr.shifted_rows is None else 8 * tr.shifted_rows.sum(1)
    return {k: {**v, "span indices": idx} for k, v in bufs.items()}


@dataclass(frozen=True)
class LayerMemory:
    """Bytes per rank of one attention layer, per item."""

    inputs: dict[str, int]  # before the call: q, k, v; grad_out (backward); the plan's indices
    forward: dict[str, int]  # what the forward allocates, at its peak
    backward: dict[str, int]  # what the backward allocates or keeps alive, at its peak
    buffers: dict[str, dict[str, int]] = field(default_factory=dict)  # transport, per pass

    @property
    def forward_peak(self) -> int:
        """Peak of an inference forward: q, k, v plus the forward's items."""
        inputs = sum(v for k, v in self.inputs.items() if k != "grad_out")
        return inputs + sum(self.forward.values())

    @property
    def backward_peak(self) -> int:
        """Peak of the backward: inputs with grad_out plus its items."""
        return sum(self.inputs.values()) + sum(self.backward.values())

    @property
    def training_peak(self) -> int:
        """Peak of forward + backward (grad_out exists during the backward only)."""
        return max(self.forward_peak, self.backward_peak)


def _items(
    L, heads: int, kv_heads: int, batch: int, head_dim: int, itemsize: int, *, plan_idx=0,
    zigzag: bool = False, buffers: tuple = (0, 0), group: bool = False,
) -> tuple[dict, dict, dict]:  # fmt: skip
    """``(inputs, forward, backward)`` items at the local length ``L`` (``group``: the
    backward's of a group of ``heads`` heads, sliced from more)."""
    acc = acc_bytes(itemsize)
    q = batch * L * heads * head_dim
    kv = batch * L * kv_heads * head_dim
    lse = batch * heads * L * acc
    cast = int(itemsize != acc)
    copies = (0, (3 * q + 2 * kv) * itemsize + lse * int(batch > 1) if group else 0)
    if zigzag:  # narrowing a (B, L, H, D) tensor to a piece copies unless B == 1 (and every
        # head is there), narrowing lse (B, H, L) unless B * H == 1; the pieces' results are
        # concatenated (new tensors), the cast pieces of one gradient live until then
        split, split_lse = int(batch > 1 or group), lse * int(batch * heads > 1)
        last_cat = torch.maximum(q - 2 * kv, kv) if cast else q + 2 * kv
        fwd_copies = (q + 2 * kv) * itemsize * split + q * itemsize + lse
        copies = (fwd_copies, (3 * q + 2 * kv) * itemsize * split + split_lse + last_cat * itemsize)
    inputs = {
        "q": q * itemsize,
        "k, v": 2 * kv * itemsize,
        "grad_out": q * itemsize,
        "plan indices (cached)": plan_idx,
    }
    forward = {
        "out accumulator": q * acc,
        "lse": lse,
        "out (input dtype)": q * itemsize * cast,
        "piece copies (zigzag)": copies[0],
        "transport buffers": buffers[0],
    }
    backward = {
        "out, lse (saved)": q * itemsize + lse,
        "dq, dk, dv accumulators": (q + 2 * kv) * acc,
        "dq, dk, dv (input dtype)": (q + 2 * kv) * itemsize * cast,
        "piece copies (zigzag)": copies[1],
        "transport buffers": buffers[1],
        KERNEL_WORKSPACE: batch * heads * L * acc,
    }
    return inputs, forward, backward


def own_memory(
    local_len: int, heads: int, kv_heads: int, batch: int, head_dim: int, itemsize: int
) -> LayerMemory:
    """The items of a rank of ``local_len`` rows that do not depend on the
    exchange: a lower bound of the longest shard's :class:`LayerMemory`."""
    return LayerMemory(*_items(local_len, heads, kv_heads, batch, head_dim, itemsize))


def _by_groups(tr: Any, backward: dict, bufs: dict, per: int, *shape: int) -> tuple[dict, dict]:
    """``(backward items, transport buffers)`` of the ring's backward by groups of ``per`` heads
    (``shape``: batch, head_dim, itemsize, far_bytes): every rank's busiest group, beside the
    whole call's saved ``out``, ``lse`` and input-dtype ``dq``, ``dk``, ``dv``."""
    batch, head_dim, itemsize, far_bytes = shape
    zigzag = tr.layout == "zigzag" and tr.world_size > 1
    q, kv = (batch * tr.local_len * h * head_dim * itemsize for h in (tr.heads, tr.kv_heads))
    totals, items, buffers, prev = [], [], [], 0
    for h0, h1, g0, g1 in head_groups(tr.heads, tr.heads // tr.kv_heads, per):
        share = far_bytes * (g1 - g0) // tr.kv_heads  # as the ring's: the same steps go far
        gtr = tr.group(h0, h1, g1 - g0)
        b = _with_indices(gtr, transport_buffers(gtr, *shape[:3], share))["backward"]
        args = (tr.local_len, h1 - h0, g1 - g0, *shape[:3])
        _, _, group = _items(*args, zigzag=zigzag, buffers=(0, sum(b.values())), group=True)
        group["head group copies"] = group.pop("piece copies (zigzag)")
        group["out, lse (saved)"] = backward["out, lse (saved)"]
        group["dq, dk, dv (every head)"] = q + 2 * kv
        # (at most) the previous group's, while its far dK/dV return travels behind these
        # local blocks: accumulators, their casts, the far return's buffers
        group["previous group, far return"] = prev
        far = b["far dK/dV returned"] + b["far dK/dV coming home"]
        grads = group["dq, dk, dv accumulators"] + group["dq, dk, dv (input dtype)"]
        prev = torch.where(far > 0, far + grads, 0)
        totals.append(sum(group.values()) + torch.zeros(tr.world_size, dtype=torch.int64))
        items, buffers = items + [group], buffers + [b]
    pick, ranks = torch.stack(totals).argmax(0), torch.arange(tr.world_size)

    def busiest(dicts: list[dict]) -> dict:
        """Every rank's item of its busiest group."""
        p = tr.world_size
        return {
            k: torch.stack([torch.as_tensor(d[k]).expand(p) for d in dicts])[pick, ranks]
            for k in dicts[0]
        }

    return busiest(items), {"forward": bufs["forward"], "backward": busiest(buffers)}


def layer_memories(
    tr: Any, batch: int, head_dim: int, itemsize: int, *, device: str = "cpu",
    far_bytes: int = 0, group_heads: int = 0,
) -> list[LayerMemory]:  # fmt: skip
    """The :class:`LayerMemory` of every rank; ``device="cuda"`` adds the
    device copy of the plan's indices; ``group_heads``: the backward's heads per group
    (``RING_ATTENTION_BACKWARD_HEADS``; 0: every head at once; its groups' plans are cached too)."""
    plan_idx = 8 * (tr.rows_sent + tr.rows_received)
    bufs = _with_indices(tr, transport_buffers(tr, batch, head_dim, itemsize, far_bytes))
    inputs, forward, backward = _items(
        tr.local_len, tr.heads, tr.kv_heads, batch, head_dim, itemsize,
        plan_idx=plan_idx * (2 if device == "cuda" else 1) * (2 if group_heads else 1),
        zigzag=tr.layout == "zigzag" and tr.world_size > 1,
        buffers=(sum(bufs["forward"].values()), sum(bufs["backward"].values())),
    )  # fmt: skip
    if group_heads:
        shape = (batch, head_dim, itemsize, far_bytes)
        backward, bufs = _by_groups(tr, backward, bufs, group_heads, *shape)

    def at(items: dict[str, torch.Tensor], j: int) -> dict[str, int]:
        return {k: int(v[j]) if isinstance(v, torch.Tensor) else int(v) for k, v in items.items()}

    ranks = range(tr.world_size)
    return [LayerMemory(at(inputs, j), at(forward, j), at(backward, j),
                        {k: at(v, j) for k, v in bufs.items()}) for j in ranks]  # fmt: skip


def layer_memory(tr: Any, rank: int, *args: Any, **kwargs: Any) -> LayerMemory:
    """The :class:`LayerMemory` of one rank (:func:`layer_memories`' arguments)."""
    return layer_memories(tr, *args, **kwargs)[rank]
