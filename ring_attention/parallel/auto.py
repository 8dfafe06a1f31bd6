"""The parallel mode chosen for you (docs/design.md §2): :func:`plan_mesh`, the
planner's fastest grid of ``R`` rings x ``U`` Ulysses ranks within the memory."""

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..core.checks import check_int, supported_dtypes
from ..core.layout import check_layout
from ..core.links import INTRA_DEFAULTS, LINKS, Link
from ..core.pattern import Pattern
from ..planner.capacity import Setup
from ..planner.modes import evaluate_mode
from .mesh import world_info

#: The longest sequence the planner's model plans (its int64 pair counts).
_MAX_PLANNED = 1 << 48


@dataclass(frozen=True)
class Prediction:
    """The planner's prediction for the chosen grid (per layer, the busiest
    rank; ``None`` where the model cannot say), and ``why`` in words."""

    ring: int
    ulysses: int
    seconds: float | None
    forward_seconds: float | None
    bytes_sent: int | None
    peak_bytes: int | None
    why: str


class MeshPlan(NamedTuple):
    """:func:`plan_mesh`'s answer: the mesh and the prediction."""

    mesh: Any
    prediction: Prediction


def _grids(world: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """Every ``(R, U)`` with ``R * U == world``, Ulysses groups inside nodes."""
    return [(world // U, U) for U in range(1, world + 1) if world % U == 0 and not (
        world > gpus_per_node and gpus_per_node % U and U % gpus_per_node)]  # fmt: skip


def choose_grid(seq_len: int, heads: int, kv_heads: int, head_dim: int, pattern: Pattern, *,
                world: int, gpus_per_node: int, device: str = "cuda",
                dtype: torch.dtype = torch.bfloat16, batch: int = 1, memory: int | None = None,
                layout: str = "contiguous") -> Prediction:  # fmt: skip
    """The fastest grid of ``world`` ranks for one layer that fits ``memory``
    bytes per rank (ties: the smaller ``U``; none fitting: the least memory)."""
    intra, inter = Link(*INTRA_DEFAULTS[device][:2]), LINKS[device][0]
    setup = Setup(ranks=world, device=device, memory=memory or 1 << 62, reserve=0, heads=heads,
                  kv_heads=kv_heads, head_dim=head_dim, batch=batch,
                  dtype=str(dtype).removeprefix("torch."), pattern=None,
                  segments=pattern.segment_lengths, dilations=pattern.dilation_rates,
                  causal=pattern.causal, head_groups=pattern.head_groups,
                  head_offsets=pattern.head_offsets, layout=layout, link=inter,
                  window=pattern.window if pattern.windowed else None)  # fmt: skip
    one_node = world <= gpus_per_node
    # a window bounds the ring's bytes, not Ulysses'
    grids = [(world, 1)] if pattern.windowed else _grids(world, gpus_per_node)
    evals = []
    for R, U in grids:
        try:
            ev = evaluate_mode(setup, seq_len, R, U,
                               a2a_link=intra if U <= gpus_per_node else inter,
                               ring_link=intra if one_node else inter)  # fmt: skip
        except ValueError:  # a window beyond the exact plans' reach: the ring, unpredicted
            if not pattern.windowed:
                raise
            why = "a sliding window: the ring, whose bytes the window bounds (not predicted)"
            return Prediction(world, 1, None, None, None, None, why)
        evals.append(ev)
    fits = [e for e in evals if e.worst["training_peak"] <= setup.memory]
    if fits:
        best = min(fits, key=lambda e: (e.worst["forward_backward_s"], e.ulysses))
        why = "fastest that fits"
    else:
        best = min(evals, key=lambda e: (e.worst["training_peak"], e.ulysses))
        why = "none fits: the least memory per rank"
    others = ", ".join(f"{e.ring}x{e.ulysses} {e.worst['forward_backward_s'] * 1e3:.3g} ms"
                       for e in evals if e is not best)  # fmt: skip
    w = best.worst
    return Prediction(best.ring, best.ulysses, w["forward_backward_s"], w["forward_s"],
                      int(w["sent_forward_backward"]), int(w["training_peak"]),
                      f"{why}: {best.ring} x {best.ulysses}"
                      + (f" (others: {others})" if others else ""))  # fmt: skip


def plan_mesh(seq_len: int, heads: int, kv_heads: int, head_dim: int, pattern: Pattern | tuple, *,
              group: dist.ProcessGroup | None = None, gpus_per_node: int | None = None,
              device_type: str | None = None, dtype: torch.dtype | None = None, batch: int = 1,
              memory: int | None = None, layout: str = "contiguous") -> MeshPlan:  # fmt: skip
    """The ring x Ulysses grid the planner predicts fastest for this layer:
    ``MeshPlan(mesh, prediction)`` (docs/parallel.md)."""
    if not isinstance(pattern, Pattern):
        if not isinstance(pattern, (tuple, list)) or len(pattern) != 2:
            raise ValueError(f"pattern must be a Pattern or (segment_lengths, dilation_rates), "
                             f"got {pattern!r}")  # fmt: skip
        pattern = Pattern(*pattern)
    seq_len = check_int(seq_len, "seq_len", 1, _MAX_PLANNED)
    heads = check_int(heads, "heads", 1, 1 << 31)
    kv_heads = check_int(kv_heads, "kv_heads", 1, heads)
    if heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads = {heads}, got kv_heads = {kv_heads}")
    head_dim = check_int(head_dim, "head_dim", 1, 1 << 20)
    batch = check_int(batch, "batch", 1, 1 << 31)
    if memory is not None:
        memory = check_int(memory, "memory", 1, 1 << 62)
    if dtype is not None and dtype not in supported_dtypes(torch.device("cpu")):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    pattern.check_heads(heads)
    check_layout(layout)
    world, _ = world_info(group)
    device = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device!r}")
    if dtype is None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if gpus_per_node is None:
        gpus_per_node = torch.cuda.device_count() if device == "cuda" else world
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be an integer >= 1, got {gpus_per_node!r}")
    prediction = choose_grid(seq_len, heads, kv_heads, head_dim, pattern, world=world,
                             gpus_per_node=gpus_per_node, device=device, dtype=dtype, batch=batch,
                             memory=memory, layout=layout)  # fmt: skip
    if not (dist.is_available() and dist.is_initialized()):
        return MeshPlan(None, prediction)
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    grid = torch.tensor(ranks).view(prediction.ring, prediction.ulysses)
    mesh = DeviceMesh(device, grid, mesh_dim_names=("ring", "ulysses"))
    return MeshPlan(mesh, prediction)
