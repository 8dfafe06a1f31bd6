"""One call of :class:`~ring_attention.nn.multihead.MultiheadDilatedAttention`'s
own path, checked and projected (:func:`checked_call` -> :class:`Call`).

The steps of ``nn.MultiheadAttention.forward`` and
``F.multi_head_attention_forward`` up to the attention itself, in their order
(the checks' words are ``multihead_checks.py``'s), the input projections split
as PyTorch splits them (:func:`project`), then the module's own checks (a
pattern needs query and key of one length; the ``group=`` restrictions) and the
choice of path (:attr:`Call.kernels`). When the module is sharded a failure
here makes every rank raise, through the ring's handshake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.ulysses import reject_sharded
from .multihead_checks import (
    canonical_mask,
    check_attn_mask_shape,
    check_dims,
    check_key_padding_mask_shape,
    check_key_value,
    check_mask_dtype,
    check_separate_weights,
    fast_path_reason,
    nested_error,
)

__all__ = ["Call", "checked_call", "project"]

_CAUSAL_HINT_ERROR = (
    "Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
    "method `generate_square_subsequent_mask` to create this mask."
)


def _views(
    fn: Callable[[torch.Tensor], torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fn`` applied to ``q``, ``k``, ``v``, keeping which of them are the
    same tensor (the projections, as PyTorch's, depend on it)."""
    q2 = fn(q)
    k2 = q2 if k is q else fn(k)
    v2 = k2 if v is k else (q2 if v is q else fn(v))
    return q2, k2, v2


class Call(NamedTuple):
    """One checked call of the module's own path."""

    q: torch.Tensor  # projections, (batch, seq, embed)
    k: torch.Tensor
    v: torch.Tensor
    bool_kpm: torch.Tensor | None  # the key_padding_mask when bool (the kernels take it)
    kpm: torch.Tensor | None  # additive key_padding_mask (the dense path)
    attn_mask: torch.Tensor | None  # additive; None when the is_causal hint replaces it
    batched: bool
    causal: bool
    kernels: bool  # the C++ operators apply (else: the dense path)
    batch_major: bool  # nn.MultiheadAttention would return a contiguous (N, L, E) output
    lengths: list[int] | None  # the sequence lengths of a nested-tensor input


def checked_call(
    m: nn.MultiheadAttention,
    query,
    key,
    value,
    key_padding_mask,
    need_weights,
    attn_mask,
    is_causal,
) -> Call:
    """Check and project one call; when sharded, a failure here makes
    every rank raise (it is reported through the ring's handshake)."""
    try:
        return _check_call(
            m, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
        )
    except Exception as exc:
        if m._sharded:
            reject_sharded(m.group, m.ulysses_group, m.mesh, exc)
        raise


def _check_call(
    m: nn.MultiheadAttention,
    query,
    key,
    value,
    key_padding_mask,
    need_weights,
    attn_mask,
    is_causal,
) -> Call:
    """The steps of ``nn.MultiheadAttention.forward`` and
    ``F.multi_head_attention_forward`` up to the attention itself, in
    their order, then this module's own checks."""
    float_masks = (attn_mask is not None and torch.is_floating_point(attn_mask)) or (
        key_padding_mask is not None and torch.is_floating_point(key_padding_mask)
    )
    query.dim()  # read first, as PyTorch does (a non-tensor fails here, with its error)
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if isinstance(mask, torch.Tensor) and mask.is_meta and not query.is_meta:
            raise ValueError(f"{name} must be on query's device {query.device}, got meta")
    kpm = canonical_mask(key_padding_mask, "key_padding_mask", attn_mask, "attn_mask", query.dtype)
    am = canonical_mask(attn_mask, "attn_mask", None, "", query.dtype)
    bool_kpm = None if kpm is None or key_padding_mask.is_floating_point() else key_padding_mask
    reason = fast_path_reason(m, query, key, value, kpm, am, float_masks)
    # Where nn.MultiheadAttention runs its fused kernel (or would, but for
    # make_fx tracing) its output is a contiguous (N, L, E) tensor.
    batch_major = not reason and m.in_proj_bias is not None
    lengths = None
    if query.is_nested or key.is_nested or value.is_nested:
        if not batch_major:
            raise nested_error(reason)
        if m._sharded:
            raise ValueError(
                "nested tensors are not supported with group= (sequence-sharded "
                "MultiheadDilatedAttention)"
            )
        # Self-attention without masks (the fused path's conditions):
        # attend the padded batch with the padding masked.
        lengths = [int(t.shape[0]) for t in query.unbind()]
        query = key = value = torch.nested.to_padded_tensor(query, 0.0)
        bool_kpm = torch.arange(query.shape[1], device=query.device) >= torch.tensor(
            lengths, device=query.device
        ).unsqueeze(1)
        kpm = canonical_mask(bool_kpm, "key_padding_mask", None, "", query.dtype)

    batched = check_dims(query, key, value, kpm, am, m.num_heads)
    if not batched:  # each on its own, as PyTorch (the projections then split three ways)
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        kpm = None if kpm is None else kpm.unsqueeze(0)
        bool_kpm = None if bool_kpm is None else bool_kpm.unsqueeze(0)
    elif m.batch_first:
        query, key, value = _views(lambda t: t.transpose(0, 1), query, key, value)
    # Now (L, N, E) as F.multi_head_attention_forward sees them.
    L, B, _ = query.shape
    S = key.shape[0]
    # F.multi_head_attention_forward canonicalises it again (and may warn again).
    kpm = canonical_mask(kpm, "key_padding_mask", am, "attn_mask", query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError(_CAUSAL_HINT_ERROR)
    # nn.MultiheadAttention: the hint replaces attn_mask only when nothing
    # else needs the explicit mask.
    causal = bool(is_causal and kpm is None and not need_weights)
    if causal:
        am = None
    check_key_value(query, key, value, m)
    if not m._qkv_same_embed_dim:
        check_separate_weights(m, key, value)
    # Projected as PyTorch projects (the same errors), then (N, L, E) views.
    q, k, v = (t.transpose(0, 1) for t in project(m, query, key, value))
    if am is not None:
        check_attn_mask_shape(am, B, m.num_heads, L, S)
    if key.shape[1] != B:  # (PyTorch fails in a reshape here)
        raise RuntimeError(
            f"key and value must have the batch size of query ({B}), got key of shape "
            f"{tuple(key.shape)} in (seq, batch, features) order"
        )
    extra_keys = int(m.bias_k is not None) + int(m.add_zero_attn)
    if kpm is not None:
        check_key_padding_mask_shape(kpm, B, S, extra_keys)
    check_mask_dtype(kpm, am, q.dtype, need_weights)

    # This module's own checks.
    if m.has_pattern and L != S:
        raise ValueError(
            "with a dilated pattern (segment_lengths/dilation_rates), query and key must have "
            f"the same sequence length, got L={L} and S={S}"
        )
    if m._sharded:
        _check_group_call(m, need_weights, am, kpm, L, S)
    kernels = m._sharded or (
        not need_weights
        and am is None
        and not extra_keys
        and L == S
        and (kpm is None or bool_kpm is not None)
        and not (m.training and m.dropout > 0)
    )
    return Call(q, k, v, bool_kpm, kpm, am, batched, causal, kernels, batch_major, lengths)


def _check_group_call(
    m: nn.MultiheadAttention, need_weights, attn_mask, key_padding_mask, L, S
) -> None:
    where = "with group= (sequence-sharded MultiheadDilatedAttention)"
    if need_weights:
        raise ValueError(f"need_weights=True is not supported {where}; pass need_weights=False")
    if attn_mask is not None:
        raise ValueError(
            f"attn_mask is not supported {where} (for causal attention pass is_causal=True "
            "with any attn_mask as the hint)"
        )
    if key_padding_mask is not None:
        raise ValueError(f"key_padding_mask is not supported {where}")
    if m.training and m.dropout > 0:
        raise ValueError(
            f"dropout={m.dropout} in training is not supported {where}; use dropout=0 or eval()"
        )
    if L != S:
        raise ValueError(
            f"key must have the same local sequence length as query {where} (no "
            f"cross-attention), got {L} and {S}"
        )


def project(m: nn.MultiheadAttention, query, key, value):
    """Input projections, split as ``F.multi_head_attention_forward``
    splits them (one, two or three matrix products)."""
    E = m.embed_dim
    b = m.in_proj_bias
    bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
    if not m._qkv_same_embed_dim:
        return (
            F.linear(query, m.q_proj_weight, bq),
            F.linear(key, m.k_proj_weight, bk),
            F.linear(value, m.v_proj_weight, bv),
        )
    w = m.in_proj_weight
    if key is value:
        if query is key:
            return F.linear(query, w, b).chunk(3, dim=-1)
        k, v = F.linear(key, w[E:], None if b is None else b[E:]).chunk(2, dim=-1)
        return F.linear(query, w[:E], bq), k, v
    wq, wk, wv = w.chunk(3)
    return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)
