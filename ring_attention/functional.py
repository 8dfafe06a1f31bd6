"""Single-process dilated attention: argument checks, pattern normalisation,
and the call into ``torch.ops.ring_attention``."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from .dtypes import supported_dtypes

__all__ = [
    "check_head_groups",
    "check_key_padding_mask",
    "check_qkv",
    "dilated_attention",
    "normalize_pattern",
    "resolve_scale",
]

Pattern = tuple[tuple[int, ...], tuple[int, ...]]


def _as_int_list(values: Sequence[int] | int, name: str) -> tuple[int, ...]:
    if isinstance(values, int) and not isinstance(values, bool):
        values = (values,)
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    try:
        items = list(values)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {values!r}") from None
    out = []
    for i, v in enumerate(items):
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise ValueError(f"{name}[{i}] must be an int, got {v!r}")
        out.append(operator.index(v))
    return tuple(out)


def normalize_pattern(
    segment_lengths: Sequence[int] | int, dilation_rates: Sequence[int] | int
) -> Pattern:
    """Check a pattern and return it as two tuples of ints.

    Raises ``ValueError`` naming ``segment_lengths`` / ``dilation_rates`` for an
    empty pattern, mismatched lengths, ``w < 1``, ``r < 1`` or ``r > w``.
    """
    segs = _as_int_list(segment_lengths, "segment_lengths")
    dils = _as_int_list(dilation_rates, "dilation_rates")
    if not segs:
        raise ValueError("segment_lengths must not be empty: a pattern needs at least one branch")
    if len(segs) != len(dils):
        raise ValueError(
            f"segment_lengths and dilation_rates must have the same length, got "
            f"{len(segs)} segment_lengths and {len(dils)} dilation_rates"
        )
    for i, (w, r) in enumerate(zip(segs, dils, strict=True)):
        if w < 1:
            raise ValueError(f"segment_lengths[{i}] must be >= 1, got {w}")
        if r < 1:
            raise ValueError(f"dilation_rates[{i}] must be >= 1, got {r}")
        if r > w:
            raise ValueError(f"dilation_rates[{i}] must be <= segment_lengths[{i}] = {w}, got {r}")
    return segs, dils


def check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_length: bool = True
) -> None:
    """Check q, k, v are (batch, seq, heads, head_dim) tensors that agree in
    shape, dtype and device, with a dtype the kernels support."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seq, heads, head_dim), got shape {tuple(t.shape)}"
            )
    if same_length and not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k and v must have the same shape, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not same_length and (
        k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]
    ):
        raise ValueError(
            f"k and v must match q in batch, heads and head_dim, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on the same device, got {q.device}, {k.device}, {v.device}"
        )
    if q.dtype not in supported_dtypes(q.device):
        allowed = ", ".join(str(d) for d in supported_dtypes(q.device))
        raise ValueError(
            f"dtype {q.dtype} is not supported on {q.device.type}; use one of {allowed}"
        )


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``head_dim ** -0.5`` by default; otherwise a finite positive float."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float or None, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    return scale


def check_head_groups(heads: int, n_branches: int, head_groups: bool) -> None:
    """``head_groups=True`` needs at least one head per branch."""
    if head_groups and heads < n_branches:
        raise ValueError(
            f"head_groups=True needs at least as many heads as branches: "
            f"got {heads} heads and {n_branches} branches"
        )


def check_key_padding_mask(mask: torch.Tensor | None, batch: int, seq: int, device) -> None:
    """A bool (batch, seq) mask on the inputs' device, True = ignore that key."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"key_padding_mask must be a bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(f"key_padding_mask must have dtype torch.bool, got {mask.dtype}")
    if tuple(mask.shape) != (batch, seq):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq) = {(batch, seq)}, "
            f"got {tuple(mask.shape)}"
        )
    if mask.device != device:
        raise ValueError(f"key_padding_mask must be on {device}, got {mask.device}")


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    scale: float | None = None,
    head_groups: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact LongNet-style dilated attention (DESIGN.md §1) on one process.

    Args:
        q, k, v: ``(batch, seq, heads, head_dim)`` tensors of one dtype
            (float32, float64, float16 or bfloat16) on one device.
        segment_lengths, dilation_rates: the pattern, one ``(w, r)`` per branch
            with ``1 <= r <= w``. Any sequence length works: the last segment
            of a branch may be short.
        causal: keys only at or before the query.
        scale: score scale, default ``head_dim ** -0.5``.
        head_groups: split heads into ``len(pattern)`` contiguous groups, branch
            ``i`` applying only to group ``i``.
        key_padding_mask: bool ``(batch, seq)``, ``True`` = ignore that key.
        return_lse: also return the log-sum-exp ``(batch, heads, seq)``
            (float32; float64 for float64 inputs).

    Returns:
        ``out`` of q's shape and dtype, or ``(out, lse)``. A query that reaches
        no key gets ``out = 0`` and ``lse = -inf``.
    """
    check_qkv(q, k, v)
    segs, dils = normalize_pattern(segment_lengths, dilation_rates)
    check_head_groups(q.shape[2], len(segs), head_groups)
    check_key_padding_mask(key_padding_mask, q.shape[0], q.shape[1], q.device)
    scale = resolve_scale(scale, q.shape[-1])
    out, lse = torch.ops.ring_attention.dilated_attention(
        q,
        k,
        v,
        list(segs),
        list(dils),
        bool(causal),
        scale,
        bool(head_groups),
        False,
        key_padding_mask,
        None,
    )
    return (out, lse) if return_lse else out
