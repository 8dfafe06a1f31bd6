"""``transformers.Trainer`` with sequence parallelism (imports transformers)."""

from typing import Any

from transformers import Trainer

from .setting import SequenceParallelDataLoader


class SequenceParallelMixin:
    """Puts a ``Trainer``'s (or a subclass's) loaders behind ``SequenceParallelDataLoader``."""

    def get_train_dataloader(self) -> Any:
        return SequenceParallelDataLoader(super().get_train_dataloader())  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return SequenceParallelDataLoader(super().get_eval_dataloader(eval_dataset))  # type: ignore[misc]

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return SequenceParallelDataLoader(super().get_test_dataloader(test_dataset))  # type: ignore[misc]


class SequenceParallelTrainer(SequenceParallelMixin, Trainer):
    """``transformers.Trainer`` with sequence-parallel batches."""
