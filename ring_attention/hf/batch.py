"""Sequence-parallel batches: :func:`shard_causal_lm_batch`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .setting import sequence_parallel, spread_of

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


def _right_padding(attention_mask: Any, shape: tuple[int, int]) -> torch.Tensor | None:
    """The padded positions ``(batch, seq)`` (``True`` = padding) of a 2-D
    right-padding ``attention_mask``, ``None`` without padding.

    Raises:
        ValueError: a mask of another shape, or padding that is not on the
            right (a token after a padded position).
    """
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else None
        raise ValueError(
            f"attention_mask must be a 2-D padding mask of input_ids' shape {shape} (1 = token, "
            f"0 = padding), got {got or attention_mask!r}"
        )
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
    """``(position_ids, cu_seq_lens int32)`` of the whole sequence, from
    whichever of the two is given (both: they must agree)."""
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[1] != n:
            raise ValueError(
                f"position_ids must have shape (batch, seq) or (1, seq) with seq = {n}, got "
                f"{tuple(position_ids.shape)}"
            )
        cu = documents_from_position_ids(position_ids)
        cu = torch.tensor([0, n]) if cu is None else cu
        if cu_seq_lens is not None and cu_seq_lens.tolist() != cu.tolist():
            raise ValueError(
                f"cu_seq_lens_q {cu_seq_lens.tolist()} disagrees with the documents of "
                f"position_ids {cu.tolist()}"
            )
    elif cu_seq_lens is not None:
        cu = cu_seq_lens.to("cpu", torch.int64)
        if cu.dim() != 1 or cu.numel() < 2 or cu[0] != 0 or cu[-1] != n or (cu.diff() < 0).any():
            raise ValueError(
                f"cu_seq_lens_q must be the document boundaries [0, ..., {n}] (1-D, "
                f"non-decreasing), got {cu.tolist()}"
            )
        lengths = cu.diff()
        position_ids = torch.arange(n) - torch.repeat_interleave(cu[:-1], lengths)
        position_ids = position_ids[None].to(device)
    else:
        position_ids = torch.arange(n, device=device)[None]
        cu = torch.tensor([0, n])
    return position_ids, cu.to(device=device, dtype=torch.int32)


def shard_causal_lm_batch(
    input_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    ignore_index: int = _IGNORE_INDEX,
    group: dist.ProcessGroup | None = None,
    ulysses_group: dist.ProcessGroup | None = None,
    mesh: Any = None,
    layout: str | None = None,
    **other: Any,
) -> dict[str, Any]:
    """This rank's causal-LM batch (``model(**batch)``) from the full one.

    Every rank of a sequence-parallel group passes the same full batch (a
    collator's dict unpacks into the arguments: ``shard_causal_lm_batch(
    **batch)``); nothing is communicated. The ranks are those of
    :func:`register_transformers`; without sequence parallelism the batch is
    the whole sequence, in the same format (so one training loop serves both).

    Args:
        input_ids: ``(batch, seq)`` token ids (or ``inputs_embeds``
            ``(batch, seq, hidden)``).
        labels: ``(batch, seq)`` or ``None``; as transformers' causal-LM
            labels (unshifted, ``ignore_index`` = not scored).
        position_ids: ``(batch, seq)`` or ``(1, seq)``; default ``0 ..
            seq-1``. Positions restarting per document mark packed documents
            (batch size 1, as ``DataCollatorWithFlattening`` packs them, or
            the same boundaries in every row).
        attention_mask: a 2-D right-padding mask (1 = token) or ``None``.
            It is dropped (with causal attention no token attends to the
            padding after it) and the padded positions are not scored.
        cu_seq_lens_q, cu_seq_lens_k: the global document boundaries, as
            ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
            gives them; used when ``position_ids`` is not given.
        ignore_index: the label of unscored tokens (-100).
        group, ulysses_group, mesh, layout: the ranks sharing the sequence,
            as :func:`~ring_attention.register_transformers` takes them
            (the ring, Ulysses or their hybrid: shard ``i * U + j`` for ring
            index ``i`` and Ulysses index ``j``); by default those of the
            last ``register_transformers``.
        **other: further entries of the batch: tensors of shape ``(batch,
            seq, ...)`` are sharded along the sequence, anything else is
            passed on unchanged.

    Returns:
        A dict with this rank's ``input_ids`` (or ``inputs_embeds``) and
        ``position_ids`` (global positions), ``cu_seq_lens_q`` =
        ``cu_seq_lens_k`` (global document boundaries, int32), the sharded
        ``other`` entries and, with ``labels``: ``labels`` (this rank's
        shard), ``shift_labels`` (this rank's shard of the labels shifted by
        one over the WHOLE sequence: the model's loss uses them instead of
        shifting inside the shard) and ``num_items_in_batch``: the scored
        tokens of the whole batch divided by the number of ranks sharing it,
        so that the ranks' losses average to the batch's mean loss and the
        gradients that DDP or FSDP average over the ranks are the
        single-process gradients (no all-reduce of one's own).

    Raises:
        ValueError: bad shapes, padding that is not on the right, packed
            rows with different documents, boundaries that disagree.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    ids = input_ids is not None
    tokens = input_ids if ids else inputs_embeds
    if ids:
        _check_ids(input_ids, "input_ids")
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dim() != (2 if ids else 3)
        or tokens.shape[0] < 1
    ):
        name, dims = ("input_ids", "seq") if ids else ("inputs_embeds", "seq, hidden")
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else tokens
        raise ValueError(f"{name} must be a (batch >= 1, {dims}) tensor, got {got!r}")
    for name, t in (("labels", labels), ("position_ids", position_ids)):
        if t is not None:
            _check_ids(t, name)
    batch, n = tokens.shape[:2]
    rows = None if position_ids is None or position_ids.dim() != 2 else position_ids.shape[0]
    if rows not in (None, 1, batch):
        raise ValueError(
            f"position_ids must have shape (batch, seq) = {(batch, n)} or (1, seq), got "
            f"{tuple(position_ids.shape)}"
        )
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

    out: dict[str, Any] = {}
    for key, value in other.items():
        sharded = (
            isinstance(value, torch.Tensor)
            and value.dim() >= 2
            and value.shape[:2]
            == (
                batch,
                n,
            )
        )
        out[key] = shard(value) if sharded else value
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
