"""The DataLoader adapter of sequence-parallel training:
:class:`SequenceParallelDataLoader`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.handshake import control_device
from .batch import shard_causal_lm_batch
from .setting import sequence_parallel

__all__ = ["SequenceParallelDataLoader"]


def _to(batch: Mapping[str, Any], device: torch.device | None) -> dict[str, Any]:
    """``batch`` with its tensors on ``device`` (the CPU when ``None``)."""
    device = device or torch.device("cpu")
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _device(batch: Mapping[str, Any]) -> torch.device | None:
    return next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), None)


class SequenceParallelDataLoader:
    """Turns a data-parallel loader of causal-LM batches into this rank's
    sequence-parallel batches.

    ``dataloader`` gives every rank its own micro-batches, as data-parallel
    training does (``Trainer``, ``Accelerator.prepare`` or a
    ``DistributedSampler`` over all ranks): dicts of ``input_ids``,
    ``labels``, and optionally ``position_ids`` (packed documents),
    ``cu_seq_lens_q``/``_k``, a right-padding ``attention_mask``, ... as
    transformers' collators build them. The ranks that share a sequence
    (those of :func:`~ring_attention.hf.register_transformers`: a ring, a
    Ulysses group or their grid) exchange their
    micro-batches, and each micro-batch becomes one step in which every one of
    them holds its piece of the sequence
    (:func:`~ring_attention.hf.shard_causal_lm_batch`: global position ids,
    labels shifted over the whole sequence, global document boundaries). So
    one pass yields ``len(dataloader) * size`` batches, in the order of the
    ranks' shards, and every sample is trained on once, as in DeepSpeed's
    Ulysses adapter for transformers.

    ``num_items_in_batch`` of every batch is the number of scored tokens of
    the step over all ranks (one all-reduce over the default process group),
    divided by the number of ranks: each rank's loss is then its share of the
    step's mean loss, scaled so that the gradients that DDP or FSDP average
    over all ranks (the whole data x sequence mesh) are the gradients of that
    mean. ``Trainer`` counts the same tokens itself (``shift_labels``) and
    passes its own count with the same result.

    Without sequence parallelism (``register_transformers()`` with no group)
    every batch passes through :func:`shard_causal_lm_batch` whole.

    Args:
        dataloader: any iterable of batch dicts; its ``len`` (if any),
            ``set_epoch`` and other attributes are forwarded.
        ignore_index: the label of unscored tokens (-100).
    """

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
                    f"...), got {type(batch).__name__}"
                )
            yield from self._steps(batch)

    def _steps(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The batches of the sequence group's micro-batches, this rank's pieces."""
        sp = sequence_parallel()
        device = _device(batch)
        if sp is None or sp.size == 1:
            batches = [dict(batch)]
        else:
            batches = [_to(b, device) for b in sp.gather_object(_to(batch, None))]
        steps = [shard_causal_lm_batch(**b, ignore_index=self.ignore_index) for b in batches]
        if all("shift_labels" in s for s in steps) and dist.is_initialized():
            world = dist.get_world_size()
            counts = torch.tensor(
                [int((s["shift_labels"] != self.ignore_index).sum()) for s in steps],
                dtype=torch.float64,
                device=control_device(None),
            )
            dist.all_reduce(counts)
            for s, count in zip(steps, counts.tolist(), strict=True):
                s["num_items_in_batch"] = count / world
        return steps
