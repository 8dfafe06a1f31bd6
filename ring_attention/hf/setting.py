"""The sequence-parallel setting that the ``"ring_dilated"`` entries read
(set by :func:`ring_attention.hf.register.register_transformers`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..core.layout import check_layout
from ..parallel.mesh import resolve_topology, world_info
from ..parallel.sharding import shard_sequence

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SequenceParallel",
    "import_transformers",
    "sequence_parallel",
    "spread_of",
]

#: The name to pass as ``attn_implementation``.
ATTN_IMPLEMENTATION = "ring_dilated"


class SequenceParallel:
    """The sequence-parallel ranks of ``register_transformers(group=...,
    ulysses_group=..., mesh=...)``: how the attention spreads a sequence
    (the ring over ``group``, Ulysses inside ``ulysses_group``, or their
    hybrid; docs/design.md §2) and what the batch sharding needs
    (:attr:`size`, :attr:`rank`, :meth:`shard`, :meth:`gather_object`).

    The groups are held by weak references: a strong one would keep a group
    that destroy_process_group released alive, with its gloo worker threads,
    into the interpreter's shutdown, where a thread still releasing a
    finished collective's tensors needs the GIL and aborts the process. A
    1-D mesh listing its ranks in group order is its ring group; other meshes
    are kept (a mesh holds no group; the ring then runs in its coordinates'
    order)."""

    def __init__(
        self, group: dist.ProcessGroup | None, layout: str,
        ulysses_group: dist.ProcessGroup | None = None, mesh: Any = None, auto: bool = False,
    ) -> None:  # fmt: skip
        self._refs = tuple(None if g is None else weakref.ref(g) for g in (group, ulysses_group))
        self.mesh = mesh
        self.layout = layout
        #: ``mesh="auto"``: each layer's grid over ``group``'s ranks is the
        #: planner's (:meth:`layer_spread`); the batch shards as for the ring
        #: (shard ``i * U + j`` is group rank ``i * U + j`` in every grid)
        self.auto = auto
        self._meshes: dict[tuple, dict[str, Any]] = {}

    def layer_spread(self, key: tuple, plan: Any) -> dict[str, Any]:
        """``mesh="auto"``: the groups of a layer, chosen once per ``key`` by
        ``plan()`` (a :class:`~ring_attention.parallel.auto.MeshPlan`; every
        rank decides the same, so the meshes are built in step)."""
        if key not in self._meshes:
            mesh, prediction = plan()
            if prediction.ulysses == 1:
                self._meshes[key] = {"group": self.group, "ulysses_group": None, "mesh": None}
            else:
                self._meshes[key] = {"group": None, "ulysses_group": None, "mesh": mesh}
        return self._meshes[key]

    def _live(self, index: int) -> dist.ProcessGroup | None:
        ref = self._refs[index]
        if ref is None:
            return None
        group = ref()
        if group is None:
            raise RuntimeError(
                "a process group given to register_transformers no longer exists "
                "(destroy_process_group released it): register again with live groups, or "
                "with none"
            )
        return group

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The ring (``None`` with Ulysses alone or a mesh)."""
        return self._live(0)

    @property
    def ulysses_group(self) -> dist.ProcessGroup | None:
        """The Ulysses group, or ``None``."""
        return self._live(1)

    @property
    def ring_only(self) -> bool:
        """Whether the attention is the ring alone (one operator, compiles)."""
        return self._refs[1] is None and self.mesh is None and not self.auto

    def spread(self) -> dict[str, Any]:
        """``group``/``ulysses_group``/``mesh`` as the functional API takes them
        (``mesh="auto"``: the ring's, which shards the batch the same)."""
        if self.auto:
            return {"group": self.group, "ulysses_group": None, "mesh": None}
        return {"group": self.group, "ulysses_group": self.ulysses_group, "mesh": self.mesh}

    def _grid(self) -> tuple[int, int, tuple]:
        """``(size, rank, groups)``: the ranks sharing a sequence, this rank's
        shard and the groups to gather over (Ulysses first, then the ring)."""
        if self.ring_only or self.auto:
            size, rank = world_info(self.group)
            return size, rank, ((self.group, size, None),)
        topo = resolve_topology(**self.spread())  # (indices: a mesh's coordinates)
        return topo.world_size, topo.shard_index, (
            (topo.ulysses_group, topo.ulysses_size, topo.ulysses_order),
            (topo.ring_group, topo.ring_size, topo.ring_order),
        )  # fmt: skip

    @property
    def size(self) -> int:
        """How many ranks share a sequence."""
        return self._grid()[0]

    @property
    def rank(self) -> int:
        """This rank's shard of the sequence (``i * U + j`` in the hybrid)."""
        return self._grid()[1]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's piece of ``x`` along ``dim`` (contiguous)."""
        return shard_sequence(x, dim, layout=self.layout, **self.spread()).contiguous()

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in shard order, from all the ranks that
        share a sequence (``all_gather_object`` inside the Ulysses group,
        then along the ring: no group of its own is needed)."""
        items = [obj]
        for group, size, order in self._grid()[2]:
            if size > 1:
                parts: list[Any] = [None] * size
                dist.all_gather_object(parts, items, group=group)
                if order is not None:  # group ranks -> indices
                    parts = [parts[g] for g in order]
                items = [x for part in parts for x in part]
        return items


def spread_of(group: Any, ulysses_group: Any, mesh: Any, layout: str) -> SequenceParallel | None:
    """The checked :class:`SequenceParallel` of these arguments (``None``:
    no sequence parallelism).

    Raises:
        ValueError: as :func:`register_transformers`.
    """
    if check_layout(layout) == "balanced":
        raise ValueError(
            "layout='balanced' is not available to transformers models: the sequence is sharded "
            "once for every layer, and balanced cuts follow one attention pattern (the layers' "
            "patterns may differ); use layout='contiguous' or 'zigzag'"
        )
    if isinstance(mesh, str) and mesh == "auto":
        if ulysses_group is not None or layout != "contiguous":
            raise ValueError(
                "mesh=\"auto\" chooses each layer's grid over group's ranks: it takes no "
                f"ulysses_group and the contiguous layout, got ulysses_group={ulysses_group!r}, "
                f"layout={layout!r}"
            )
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ValueError(
                f"group must be a torch.distributed ProcessGroup or None, got {group!r}"
            )
        return SequenceParallel(group or dist.group.WORLD, layout, auto=True)
    for name, g in (("group", group), ("ulysses_group", ulysses_group)):
        if g is not None and not isinstance(g, dist.ProcessGroup):
            raise ValueError(f"{name} must be a torch.distributed ProcessGroup or None, got {g!r}")
    if mesh is None and ulysses_group is None:
        return None if group is None else SequenceParallel(group, layout)
    topo = resolve_topology(group, ulysses_group, mesh)  # checks this rank's arguments
    if mesh is not None and mesh.ndim == 1 and topo.ring_order is None:
        group, mesh = mesh.get_group(), None  # a ring (its ranks in group order)
    return SequenceParallel(group, layout, ulysses_group, mesh)


_state: dict[str, SequenceParallel | None] = {"sp": None}


def set_sequence_parallel(sp: SequenceParallel | None) -> None:
    """Replace the sequence-parallel setting (:func:`register_transformers`)."""
    _state["sp"] = sp


def sequence_parallel() -> SequenceParallel | None:
    """The sequence-parallel setting of the last
    :func:`~ring_attention.hf.register.register_transformers`
    (``None``: every process attends over the whole sequence it is given)."""
    return _state["sp"]


def import_transformers() -> Any:
    """``transformers``, or an ``ImportError`` saying how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "ring_attention.register_transformers needs the Hugging Face transformers package: "
            "install the 'hf' extra (pip install 'ring_attention[hf]') or pip install transformers"
        ) from exc
    return transformers
