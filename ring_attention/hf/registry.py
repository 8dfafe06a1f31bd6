"""``register_transformers``: the ``"ring_dilated"`` entries of transformers'
attention and mask interfaces, and the sequence-parallel setting they read."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from .._comm import world_info
from ..layout import check_layout
from ..sharding import shard_sequence

__all__ = ["ATTN_IMPLEMENTATION", "SequenceParallel", "register_transformers", "sequence_parallel"]

#: The name to pass as ``attn_implementation``.
ATTN_IMPLEMENTATION = "ring_dilated"


class SequenceParallel:
    """The sequence-parallel ranks of ``register_transformers(group=...)``:
    the attention's group and layout, and what the batch sharding needs
    (:attr:`size`, :attr:`rank`, :meth:`shard`, :attr:`sequence_group`), so
    that every mode of spreading a sequence plugs in here.

    The group is held by a weak reference: a strong one would keep a group that
    destroy_process_group released alive, with its gloo worker threads, into
    the interpreter's shutdown, where a thread still releasing a finished
    collective's tensors needs the GIL and aborts the process."""

    def __init__(self, group: dist.ProcessGroup, layout: str) -> None:
        self._group = weakref.ref(group)
        self.layout = layout

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError(
                "the process group given to register_transformers(group=...) no longer exists "
                "(destroy_process_group released it): register again with a live group, or "
                "with group=None"
            )
        return group

    @property
    def sequence_group(self) -> dist.ProcessGroup:
        """The ranks that hold pieces of one sequence (they share a batch)."""
        return self.group

    @property
    def size(self) -> int:
        """How many ranks share a sequence."""
        return world_info(self.sequence_group)[0]

    @property
    def rank(self) -> int:
        """This rank's index among them (which piece it holds)."""
        return world_info(self.sequence_group)[1]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's piece of ``x`` along ``dim`` (contiguous)."""
        return shard_sequence(x, dim, self.group, layout=self.layout).contiguous()


_state: dict[str, SequenceParallel | None] = {"sp": None}


def sequence_parallel() -> SequenceParallel | None:
    """The sequence-parallel setting of the last :func:`register_transformers`
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


def register_transformers(
    group: dist.ProcessGroup | None = None, *, layout: str = "contiguous"
) -> None:
    """Register ``"ring_dilated"`` with transformers' attention and
    attention-mask interfaces, so that ``from_config(config,
    attn_implementation="ring_dilated")`` (or ``from_pretrained``) uses
    exact dilated attention with the pattern of ``config.dilated_attention``.

    Idempotent; every call replaces the sequence-parallel setting.

    Args:
        group: ``None`` (default): every process attends over the whole
            sequence it is given. A process group (e.g. ``dist.group.WORLD``):
            sequence parallelism over it; every ``"ring_dilated"`` call of
            this process is then ring attention over ``group``, each rank
            passing its shard of the tokens (see
            :func:`ring_attention.hf.shard_causal_lm_batch`). Held by a weak
            reference, so that ``destroy_process_group`` releases it; a
            sharded call after that raises ``RuntimeError``.
        layout: the sharding layout of the sequence-parallel ranks,
            ``"contiguous"`` (default) or ``"zigzag"`` (docs/design.md §3).

    Raises:
        ImportError: transformers is not installed (the ``hf`` extra).
        ValueError: an unknown ``layout``, or a ``group`` that is not a
            process group.
    """
    import_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .attention import dilated_attention_forward
    from .masks import dilated_attention_mask

    check_layout(layout)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup or None, got {group!r}")
    AttentionInterface.register(ATTN_IMPLEMENTATION, dilated_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, dilated_attention_mask)
    _state["sp"] = None if group is None else SequenceParallel(group, layout)
