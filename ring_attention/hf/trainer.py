"""``transformers.Trainer`` with sequence parallelism:
:class:`SequenceParallelTrainer` (imports transformers)."""

from __future__ import annotations

from typing import Any

from transformers import Trainer

from .loader import SequenceParallelDataLoader

__all__ = ["SequenceParallelMixin", "SequenceParallelTrainer"]


class SequenceParallelMixin:
    """Puts the training and evaluation loaders of a ``Trainer`` (or of a
    subclass such as TRL's ``SFTTrainer``: ``class MyTrainer(
    SequenceParallelMixin, SFTTrainer)``) behind
    :class:`~ring_attention.hf.SequenceParallelDataLoader`.

    Everything else is the Trainer's own: it wraps the model in DDP, or in
    FSDP2 with ``fsdp`` set, over all ranks (the whole data x sequence mesh),
    counts the scored tokens of every step from the batches'
    ``shift_labels``, and checkpoints activations with
    ``gradient_checkpointing=True``.
    """

    def get_train_dataloader(self) -> Any:
        return SequenceParallelDataLoader(super().get_train_dataloader())  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return SequenceParallelDataLoader(super().get_eval_dataloader(eval_dataset))  # type: ignore[misc]

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return SequenceParallelDataLoader(super().get_test_dataloader(test_dataset))  # type: ignore[misc]


class SequenceParallelTrainer(SequenceParallelMixin, Trainer):
    """``transformers.Trainer`` whose batches are sharded across the
    sequence-parallel ranks of :func:`~ring_attention.register_transformers`
    (see :class:`SequenceParallelMixin`)."""
