"""Argument checks of ``MultiheadDilatedAttention``'s own path in PyTorch's
order and words (:class:`MultiheadAttentionError` where it asserts)."""

import warnings

import torch
from torch import nn


class MultiheadAttentionError(AssertionError, ValueError):
    """A bad argument that ``nn.MultiheadAttention`` reports with an
    ``AssertionError``, with its message: catchable as ``AssertionError`` and
    as ``ValueError`` (this project's error for bad arguments)."""


def canonical_mask(
    mask: torch.Tensor | None, name: str, other: torch.Tensor | None, other_name: str,
    dtype: torch.dtype,
) -> torch.Tensor | None:  # fmt: skip
    """``F._canonical_mask``: a bool (``True`` = masked) or float mask as an
    additive float mask of ``dtype``."""
    if other is not None and not isinstance(other, torch.Tensor):
        raise RuntimeError("input to _none_or_dtype() must be None or torch.Tensor")
    if mask is None:
        return None
    if mask.dtype != torch.bool and not torch.is_floating_point(mask):
        raise MultiheadAttentionError(f"only bool and floating types of {name} are supported")
    if other is not None and mask.dtype != other.dtype:
        warnings.warn(f"Support for mismatched {name} and {other_name} is deprecated. "
                      "Use same type for both instead.", stacklevel=4)  # fmt: skip
    if torch.is_floating_point(mask):
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def fast_path_reason(
    m: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None, float_masks: bool,
) -> str:  # fmt: skip
    """Why ``nn.MultiheadAttention.forward`` would not run its fused kernel
    (``""``: it would); ``float_masks``: a mask was a float tensor."""
    if not torch.backends.mha.get_fastpath_enabled():
        return "torch.backends.mha.get_fastpath_enabled() was not True"
    if query.dim() != 3:
        return f"input not batched; expected query.dim() of 3 but got {query.dim()}"
    if query is not key or key is not value:
        return "non-self attention was used (query, key, and value are not the same Tensor)"
    b, w = m.in_proj_bias, m.in_proj_weight
    if b is not None and query.dtype != b.dtype:
        return f"dtypes of query ({query.dtype}) and self.in_proj_bias ({b.dtype}) don't match"
    if w is None:
        return "in_proj_weight was None"
    if query.dtype != w.dtype:
        return f"dtypes of query ({query.dtype}) and self.in_proj_weight ({w.dtype}) don't match"
    for bad, why in (
        (m.training, "training is enabled"),
        (m.num_heads % 2 != 0, "self.num_heads is not even"),
        (not m.batch_first, "batch_first was not True"),
        (m.bias_k is not None, "self.bias_k was not None"),
        (m.bias_v is not None, "self.bias_v was not None"),
        (m.add_zero_attn, "add_zero_attn was enabled"),
        (not m._qkv_same_embed_dim, "_qkv_same_embed_dim was not True"),
    ):
        if bad:
            return why
    if query.is_nested and (key_padding_mask is not None or attn_mask is not None):
        # PyTorch's message, line-continuation spaces included.
        return ("supplying both src_key_padding_mask and src_mask at the same time "
                + " " * 33 + "is not supported with NestedTensor input")  # fmt: skip
    if torch.is_autocast_enabled():
        return "autocast is enabled"
    if float_masks:
        return "floating-point masks are not supported for fast path."
    tensors = (query, key, value, w, b, m.out_proj.weight, m.out_proj.bias)
    if torch.overrides.has_torch_function(tensors):
        return "some Tensor argument has_torch_function"
    devices = ("cpu", "cuda", torch.utils.backend_registration._privateuse1_backend_name)
    if not all(t is None or t.device.type in devices for t in tensors):
        return f"some Tensor argument's device is neither one of cpu, cuda or {devices[2]}"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return (
            "grad is enabled and at least one of query or the input/output projection "
            "weights or biases requires_grad")  # fmt: skip
    return ""


def check_dims(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None, num_heads: int,
) -> bool:  # fmt: skip
    """Numbers of dimensions (``F._mha_shape_check``); whether batched."""
    n = query.dim()
    if n not in (2, 3):
        raise MultiheadAttentionError(
            f"query should be unbatched 2D or batched 3D tensor but received {n}-D query tensor"
        )
    what = "batched (3-D) `query`" if n == 3 else "unbatched (2-D) `query`"
    if key.dim() != n or value.dim() != n:
        raise MultiheadAttentionError(
            f"For {what}, expected `key` and `value` to be {n}-D but found {key.dim()}-D and "
            f"{value.dim()}-D tensors respectively")  # fmt: skip
    if key_padding_mask is not None and key_padding_mask.dim() != n - 1:
        raise MultiheadAttentionError(
            f"For {what}, expected `key_padding_mask` to be `None` or {n - 1}-D but found "
            f"{key_padding_mask.dim()}-D tensor instead")  # fmt: skip
    if attn_mask is not None:
        if attn_mask.dim() not in (2, 3):
            raise MultiheadAttentionError(
                f"For {what}, expected `attn_mask` to be `None`, 2-D or 3-D but found "
                f"{attn_mask.dim()}-D tensor instead")  # fmt: skip
        expected = (num_heads, query.shape[0], key.shape[0])
        if n == 2 and attn_mask.dim() == 3 and attn_mask.shape != expected:
            raise MultiheadAttentionError(
                f"Expected `attn_mask` shape to be {expected} but got {attn_mask.shape}"
            )
    return n == 3


def check_key_value(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, m: nn.MultiheadAttention
) -> None:
    """Embedding size of ``query``; ``key`` against ``value`` (``(L, N, E)``) and
    the ``kdim``/``vdim`` projections."""
    if query.shape[-1] != m.embed_dim:
        raise MultiheadAttentionError(
            f"was expecting embedding dimension of {m.embed_dim}, but got {query.shape[-1]}"
        )
    if not m._qkv_same_embed_dim:
        if key.shape[:2] != value.shape[:2]:
            raise MultiheadAttentionError(
                f"key's sequence and batch dims {key.shape[:2]} do not match value's "
                f"{value.shape[:2]}")  # fmt: skip
        for name, w, t in (("key", m.k_proj_weight, key), ("value", m.v_proj_weight, value)):
            if w.shape != (m.embed_dim, t.shape[-1]):
                raise MultiheadAttentionError(
                    f"expecting {name} weights shape of {(m.embed_dim, t.shape[-1])}, but got "
                    f"{w.shape}")  # fmt: skip
    elif key.shape != value.shape:
        raise MultiheadAttentionError(
            f"key shape {key.shape} does not match value shape {value.shape}")  # fmt: skip


def check_attn_mask_shape(attn_mask: torch.Tensor, batch: int, heads: int, L: int, S: int) -> None:
    """``(L, S)`` or ``(batch * heads, L, S)``."""
    want = (L, S) if attn_mask.dim() == 2 else (batch * heads, L, S)
    if attn_mask.shape != want:
        raise RuntimeError(
            f"The shape of the {attn_mask.dim()}D attn_mask is {attn_mask.shape}, but should be "
            f"{want}.")  # fmt: skip


def check_key_padding_mask_shape(kpm: torch.Tensor, batch: int, S: int, extra_keys: int) -> None:
    """``(batch, S)``; PyTorch's message counts the ``extra_keys``."""
    if kpm.shape[0] != batch:
        raise MultiheadAttentionError(
            f"Expected key_padded_mask.shape[0] to be {batch}, but got {kpm.shape[0]}")  # fmt: skip
    if kpm.shape[1] != S:
        raise MultiheadAttentionError(
            f"Expected key_padded_mask.shape[1] to be {S + extra_keys}, but got "
            f"{kpm.shape[1] + extra_keys}")  # fmt: skip


#: How ATen names dtypes in its messages.
_ATEN_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
               torch.bfloat16: "c10::BFloat16"}  # fmt: skip


def check_mask_dtype(
    key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None, dtype: torch.dtype,
    need_weights: bool,
) -> None:  # fmt: skip
    """Float masks of another dtype than the query, as ``torch.baddbmm`` or
    ``F.scaled_dot_product_attention`` (which also takes float32) refuse them."""
    dtypes = [t.dtype for t in (attn_mask, key_padding_mask) if t is not None]
    if not dtypes:
        return
    merged = torch.promote_types(*dtypes) if len(dtypes) == 2 else dtypes[0]
    m, q = (_ATEN_NAMES.get(d, str(d)) for d in (merged, dtype))
    if need_weights and merged != dtype:
        raise RuntimeError(
            f"Input dtypes must be the same, got: input {m}, batch1: {q}, batch2: {q}")  # fmt: skip
    if not need_weights and merged not in (torch.float32, dtype):
        raise RuntimeError(
            "Expected attn_mask dtype to be bool or float or to match query dtype, but got "
            f"attn_mask.dtype: {m} and  query.dtype: {q} instead.")  # fmt: skip
