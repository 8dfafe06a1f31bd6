"""Sequence parallelism over transformers models (docs/transformers.md): the
registered setting, a rank's batch and the DataLoader adapter of training."""

import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..core.layout import check_layout
from ..parallel.handshake import control_device
from ..parallel.mesh import check_group, resolve_topology, world_info
from ..parallel.sharding import shard_sequence

#: The name to pass as ``attn_implementation``.
ATTN_IMPLEMENTATION = "ring_dilated"
_IGNORE_INDEX = -100


class SequenceParallel:
    """The sequence-parallel ranks of ``register_transformers``, groups held
    by weak references (a strong one keeps gloo threads alive into shutdown)."""

    def __init__(
        self, group: dist.ProcessGroup | None, layout: str,
        ulysses_group: dist.ProcessGroup | None = None, mesh: Any = None, auto: bool = False,
    ) -> None:  # fmt: skip
        self._refs = tuple(None if g is None else weakref.ref(g) for g in (group, ulysses_group))
        self.mesh = mesh
        self.layout = layout
        self.auto = auto  # mesh="auto": each layer's grid is the planner's
        self._meshes: dict[tuple, dict[str, Any]] = {}

    def layer_spread(self, key: tuple, plan: Any) -> dict[str, Any]:
        """``mesh="auto"``: the groups of a layer, chosen once per ``key``."""
        if key not in self._meshes:
            mesh, prediction = plan()
            ring = prediction.ulysses == 1
            self._meshes[key] = {"group": self.group if ring else None, "ulysses_group": None,
                                 "mesh": None if ring else mesh}  # fmt: skip
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
                "with none")  # fmt: skip
        return group

    group = property(lambda self: self._live(0), doc="The ring, or ``None``.")
    ulysses_group = property(lambda self: self._live(1), doc="The Ulysses group, or ``None``.")

    @property
    def ring_only(self) -> bool:
        """Whether the batch shards and gathers over the ring alone."""
        return self._refs[1] is None and self.mesh is None  # mesh="auto": the ring's

    def spread(self) -> dict[str, Any]:
        """``group``/``ulysses_group``/``mesh`` as the functional API takes them."""
        return {"group": self.group, "ulysses_group": self.ulysses_group, "mesh": self.mesh}

    def _grid(self) -> tuple[int, int, tuple]:
        """``(size, rank, groups to gather over, Ulysses first)``."""
        if self.ring_only:
            size, rank = world_info(self.group)
            return size, rank, ((self.group, size, None),)
        topo = resolve_topology(**self.spread())  # (indices: a mesh's coordinates)
        return topo.world_size, topo.shard_index, (
            (topo.ulysses_group, topo.ulysses_size, topo.ulysses_order),
            (topo.ring_group, topo.ring_size, topo.ring_order))  # fmt: skip

    size = property(lambda self: self._grid()[0], doc="How many ranks share a sequence.")
    rank = property(lambda self: self._grid()[1], doc="This rank's shard of the sequence.")

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's piece of ``x`` along ``dim`` (contiguous)."""
        return shard_sequence(x, dim, layout=self.layout, **self.spread()).contiguous()

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in shard order, from the ranks sharing a sequence."""
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
    """The checked :class:`SequenceParallel` of these arguments, or ``None``."""
    if check_layout(layout) == "balanced":
        raise ValueError(
            "layout='balanced' is not available to transformers models: the sequence is sharded "
            "once for every layer, and balanced cuts follow one attention pattern (the layers' "
            "patterns may differ); use layout='contiguous' or 'zigzag'")  # fmt: skip
    auto = isinstance(mesh, str) and mesh == "auto"
    if auto and (ulysses_group is not None or layout != "contiguous"):
        raise ValueError(
            "mesh=\"auto\" chooses each layer's grid over group's ranks: it takes no "
            f"ulysses_group and the contiguous layout, got ulysses_group={ulysses_group!r}, "
            f"layout={layout!r}")  # fmt: skip
    check_group(group, "group")
    check_group(ulysses_group, "ulysses_group")
    if auto:
        return SequenceParallel(group or dist.group.WORLD, layout, auto=True)
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
    """The setting of the last ``register_transformers`` (or ``None``)."""
    return _state["sp"]


def _check_ids(t: Any, name: str) -> None:
    """Token ids, labels or positions: an integer tensor holding values."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be an integer tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")
    if t.is_meta:
        raise ValueError(f"{name} must hold values: got a tensor on the meta device")


def documents_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document boundaries ``[0, e_1, ..., n]`` (int64) of packed
    ``position_ids`` ``(batch, n)``; ``None`` for one document per row."""
    from transformers.masking_utils import find_packed_sequence_indices

    _check_ids(position_ids, "position_ids")
    if position_ids.dim() not in (1, 2):
        raise ValueError(
            f"position_ids must be (batch, seq) or (seq,), got shape {tuple(position_ids.shape)}"
        )
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    n = position_ids.shape[-1]
    if n == 0 or position_ids.shape[0] == 0:  # nothing to split
        return None
    sequences = find_packed_sequence_indices(position_ids)
    if sequences is None:
        return None
    starts = sequences[:, 1:] != sequences[:, :-1]
    if not bool((starts == starts[:1]).all()):
        raise ValueError(
            "packed sequences (position_ids restarting inside a row) must have the same document "
            "boundaries in every batch row; flatten the batch into one row "
            "(DataCollatorWithFlattening) or pass cu_seq_lens_q")  # fmt: skip
    inner = torch.nonzero(starts[0]).flatten() + 1
    zero = inner.new_zeros(1)
    return torch.cat([zero, inner, zero + n]).to(torch.int64)


def _right_padding(attention_mask: Any, shape: tuple[int, int]) -> torch.Tensor | None:
    """The padded positions (``True``) of a right-padding mask, or ``None``."""
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else None
        raise ValueError(
            f"attention_mask must be a 2-D padding mask of input_ids' shape {shape} (1 = token, "
            f"0 = padding), got {got or attention_mask!r}")  # fmt: skip
    keep = attention_mask != 0
    if bool(keep.all()):
        return None
    if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ValueError(
            "attention_mask: sharded causal-LM batches take right padding only (with causal "
            "attention no token attends to the padding after it, so the mask is dropped); got a "
            "token after a padded position (pad on the right: tokenizer.padding_side = 'right')"
        )
    return ~keep


def _documents(
    position_ids: torch.Tensor | None, cu_seq_lens: torch.Tensor | None, n: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids, cu_seq_lens int32)`` of the whole sequence."""
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[1] != n:
            raise ValueError(
                f"position_ids must have shape (batch, seq) or (1, seq) with seq = {n}, got "
                f"{tuple(position_ids.shape)}")  # fmt: skip
        cu = documents_from_position_ids(position_ids)
        cu = torch.tensor([0, n]) if cu is None else cu
        if cu_seq_lens is not None and cu_seq_lens.tolist() != cu.tolist():
            raise ValueError(
                f"cu_seq_lens_q {cu_seq_lens.tolist()} disagrees with the documents of "
                f"position_ids {cu.tolist()}")  # fmt: skip
    elif cu_seq_lens is not None:
        cu = cu_seq_lens.to("cpu", torch.int64)
        if cu.dim() != 1 or cu.numel() < 2 or cu[0] != 0 or cu[-1] != n or (cu.diff() < 0).any():
            raise ValueError(
                f"cu_seq_lens_q must be the document boundaries [0, ..., {n}] (1-D, "
                f"non-decreasing), got {cu.tolist()}")  # fmt: skip
        position_ids = torch.arange(n) - torch.repeat_interleave(cu[:-1], cu.diff())
        position_ids = position_ids[None].to(device)
    else:
        position_ids = torch.arange(n, device=device)[None]
        cu = torch.tensor([0, n])
    return position_ids, cu.to(device=device, dtype=torch.int32)


def shard_causal_lm_batch(
    input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
    position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None, cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None, ignore_index: int = _IGNORE_INDEX,
    group: dist.ProcessGroup | None = None, ulysses_group: dist.ProcessGroup | None = None,
    mesh: Any = None, layout: str | None = None, **other: Any,
) -> dict[str, Any]:  # fmt: skip
    """This rank's causal-LM batch (``model(**batch)``) from the same full batch on every rank
    (docs/transformers.md); ``ValueError`` for bad shapes or padding and disagreeing documents."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    ids = input_ids is not None
    tokens = input_ids if ids else inputs_embeds
    for name, t in (("input_ids", input_ids), ("labels", labels), ("position_ids", position_ids)):
        if t is not None:
            _check_ids(t, name)
    dims = 2 if ids else 3
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != dims or tokens.shape[0] < 1:
        name, dims = ("input_ids", "seq") if ids else ("inputs_embeds", "seq, hidden")
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else tokens
        raise ValueError(f"{name} must be a (batch >= 1, {dims}) tensor, got {got!r}")
    batch, n = tokens.shape[:2]
    rows = None if position_ids is None or position_ids.dim() != 2 else position_ids.shape[0]
    if rows not in (None, 1, batch):
        raise ValueError(
            f"position_ids must have shape (batch, seq) = {(batch, n)} or (1, seq), got "
            f"{tuple(position_ids.shape)}")  # fmt: skip
    padding = None if attention_mask is None else _right_padding(attention_mask, (batch, n))
    position_ids, cu = _documents(position_ids, cu_seq_lens_q, n, tokens.device)
    del cu_seq_lens_k  # the same boundaries as cu_seq_lens_q (self-attention)

    if group is None and ulysses_group is None and mesh is None:
        sp = sequence_parallel()
        if layout is not None and sp is not None:
            sp = spread_of(sp.group, sp.ulysses_group, sp.mesh, layout)
    else:
        sp = spread_of(group, ulysses_group, mesh, "contiguous" if layout is None else layout)
    size = 1 if sp is None else sp.size

    def shard(x: torch.Tensor) -> torch.Tensor:  # contiguous: the loss views it flat
        return x if size == 1 else sp.shard(x, 1)

    out: dict[str, Any] = {
        k: shard(v) if isinstance(v, torch.Tensor) and v.shape[:2] == (batch, n) else v
        for k, v in other.items()
    }
    out["input_ids" if ids else "inputs_embeds"] = shard(tokens)
    out["position_ids"] = shard(position_ids)
    out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
    if labels is not None:
        if tuple(labels.shape) != (batch, n):
            raise ValueError(
                f"labels must have input_ids' shape {(batch, n)}, got {tuple(labels.shape)}"
            )
        if padding is not None:
            labels = labels.masked_fill(padding, ignore_index)
        shifted = torch.cat([labels[:, 1:], labels.new_full((batch, 1), ignore_index)], dim=1)
        out["labels"] = shard(labels)
        out["shift_labels"] = shard(shifted)
        out["num_items_in_batch"] = int((shifted != ignore_index).sum()) / size
    return out


def _to(batch: Mapping[str, Any], device: torch.device | None) -> dict[str, Any]:
    """``batch`` with its tensors on ``device`` (the CPU when ``None``)."""
    device = device or torch.device("cpu")
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class SequenceParallelDataLoader:
    """A data-parallel loader of causal-LM batches as this rank's
    sequence-parallel batches (docs/transformers.md)."""

    def __init__(self, dataloader: Iterable[Mapping[str, Any]], *, ignore_index: int = -100):
        self.dataloader = dataloader
        self.ignore_index = ignore_index

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes not found on the adapter itself
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def __len__(self) -> int:
        sp = sequence_parallel()
        return len(self.dataloader) * (1 if sp is None else sp.size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.dataloader:
            if not isinstance(batch, Mapping):
                raise ValueError(
                    "SequenceParallelDataLoader takes batches that are dicts (input_ids, labels, "
                    f"...), got {type(batch).__name__}")  # fmt: skip
            yield from self._steps(batch)

    def _steps(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """This rank's pieces of the sequence group's micro-batches."""
        sp = sequence_parallel()
        device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), None)
        if sp is None or sp.size == 1:
            batches = [dict(batch)]
        else:
            batches = [_to(b, device) for b in sp.gather_object(_to(batch, None))]
        steps = [shard_causal_lm_batch(**b, ignore_index=self.ignore_index) for b in batches]
        if all("shift_labels" in s for s in steps) and dist.is_initialized():
            world = dist.get_world_size()
            counts = [int((s["shift_labels"] != self.ignore_index).sum()) for s in steps]
            counts = torch.tensor(counts, dtype=torch.float64, device=control_device(None))
            dist.all_reduce(counts)
            for s, count in zip(steps, counts.tolist(), strict=True):
                s["num_items_in_batch"] = count / world
        return steps
