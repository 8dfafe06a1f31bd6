"""Sequence-parallel batches: :func:`shard_causal_lm_batch`."""

from __future__ import annotations

from typing import Any

import torch

from .._comm import world_info
from ..sharding import shard_sequence
from .registry import sequence_parallel

__all__ = ["documents_from_position_ids", "shard_causal_lm_batch"]

_IGNORE_INDEX = -100


def _check_ids(t: Any, name: str) -> None:
    """Token ids, labels or positions: an integer tensor holding values."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be an integer tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")
    if t.is_meta:
        raise ValueError(f"{name} must hold values: got a tensor on the meta device")


def documents_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document boundaries ``[0, e_1, ..., n]`` (int64) of a packed sequence
    whose ``position_ids`` ``(batch, n)`` restart per document, as
    transformers' packed-sequence detection
    (``masking_utils.find_packed_sequence_indices``) splits them: a document
    starts wherever a position does not follow its predecessor by one.
    ``None`` for one document per row.

    Raises:
        ValueError: rows with different boundaries (the ring takes one
            ``cu_seqlens`` for the whole batch: flatten the batch to one row,
            as ``DataCollatorWithFlattening`` does).
    """
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
            "(DataCollatorWithFlattening) or pass cu_seq_lens_q"
        )
    inner = torch.nonzero(starts[0]).flatten() + 1
    zero = inner.new_zeros(1)
    return torch.cat([zero, inner, zero + n]).to(torch.int64)


def shard_causal_lm_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    ignore_index: int = _IGNORE_INDEX,
) -> dict[str, Any]:
    """This rank's causal-LM batch (``model(**batch)``) from the full one.

    Every rank passes the same full tensors; nothing is communicated. The
    group and layout are those of :func:`register_transformers`; without a
    group the batch is the whole sequence, in the same format (so one
    training loop serves both).

    Args:
        input_ids: ``(batch, seq)`` token ids.
        labels: ``(batch, seq)`` or ``None``; as transformers' causal-LM
            labels (unshifted, ``ignore_index`` = not scored).
        position_ids: ``(batch, seq)`` or ``(1, seq)``; default
            ``0 .. seq-1``. Positions restarting per document mark packed
            documents (batch size 1 or the same boundaries in every row).
        ignore_index: the label of unscored tokens (-100).

    Returns:
        A dict with this rank's ``input_ids`` and ``position_ids`` (global
        positions), ``cu_seq_lens_q`` = ``cu_seq_lens_k`` (global document
        boundaries, int32) and, with ``labels``: ``labels`` (this rank's
        shard), ``shift_labels`` (this rank's shard of the labels shifted by
        one over the WHOLE sequence: the model's loss uses them instead of
        shifting inside the shard) and ``num_items_in_batch`` (scored tokens
        of the whole batch, so that the ranks' losses sum to the global mean).
    """
    _check_ids(input_ids, "input_ids")
    if input_ids.dim() != 2 or input_ids.shape[0] < 1:
        raise ValueError(
            f"input_ids must be a 2-D tensor (batch >= 1, seq), got {tuple(input_ids.shape)}"
        )
    for name, t in (("labels", labels), ("position_ids", position_ids)):
        if t is not None:
            _check_ids(t, name)
    batch, n = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(n, device=input_ids.device)[None]
    if (
        position_ids.dim() != 2
        or position_ids.shape[1] != n
        or position_ids.shape[0] not in (1, batch)
    ):
        raise ValueError(
            f"position_ids must have shape (batch, seq) = {(batch, n)} or (1, seq), got "
            f"{tuple(position_ids.shape)}"
        )
    cu = documents_from_position_ids(position_ids)
    if cu is None:
        cu = torch.tensor([0, n])
    cu = cu.to(device=input_ids.device, dtype=torch.int32)

    sp = sequence_parallel()
    group, layout = (None, "contiguous") if sp is None else (sp.group, sp.layout)
    world, _ = world_info(group)

    def shard(x: torch.Tensor) -> torch.Tensor:  # contiguous: the loss views it flat
        return x if world == 1 else shard_sequence(x, 1, group, layout=layout).contiguous()

    out: dict[str, Any] = {
        "input_ids": shard(input_ids),
        "position_ids": shard(position_ids),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
    }
    if labels is not None:
        if tuple(labels.shape) != (batch, n):
            raise ValueError(
                f"labels must have input_ids' shape {(batch, n)}, got {tuple(labels.shape)}"
            )
        shifted = torch.cat([labels[:, 1:], labels.new_full((batch, 1), ignore_index)], dim=1)
        out["labels"] = shard(labels)
        out["shift_labels"] = shard(shifted)
        out["num_items_in_batch"] = int((shifted != ignore_index).sum())
    return out
