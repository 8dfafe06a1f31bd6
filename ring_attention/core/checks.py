"""Argument checks of the public functions (docs/design.md §6): ``ValueError`` naming the
argument, before any kernel runs or rank communicates."""

import math
import operator
from typing import NamedTuple

import torch

_KERNEL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def supported_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """Input dtypes the kernels accept on ``device``'s type."""
    return _KERNEL_DTYPES


class Shape(NamedTuple):
    """Sizes of a checked ``(q, k, v)`` triple."""

    batch: int
    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    head_dim: int


def check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_length: bool = True,
    head_range: tuple[int, int, int] | None = None,
) -> Shape:  # fmt: skip
    """Check ``q`` ``(batch, seq, heads, head_dim)`` and ``k``, ``v`` ``(batch, seq_k, kv_heads,
    head_dim)``: one supported dtype, one device (``head_range``: a slice of the heads).
    Returns the sizes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seq, heads, head_dim), got shape {tuple(t.shape)}"
            )
    B, L, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    Bk, S, Hkv, Dk = k.shape
    if Bk != B or Dk != D or (same_length and S != L):
        what = "batch, seq and head_dim" if same_length else "batch and head_dim"
        raise ValueError(
            f"k and v must match q in {what}, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if D < 1:
        raise ValueError(f"head_dim (q.shape[3]) must be >= 1, got {D}")
    if H < 1:
        raise ValueError(f"heads (q.shape[2]) must be >= 1, got {H}")
    if head_range is not None:
        _check_head_range(H, Hkv, *head_range)
    elif Hkv < 1 or H % Hkv:
        raise ValueError(
            f"kv_heads (k.shape[2] = {Hkv}) must divide heads (q.shape[2] = {H}): query head h "
            "reads K/V head h // (heads // kv_heads)"
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
    return Shape(B, L, S, H, Hkv, D)


def _check_head_range(heads: int, kv_heads: int, start: int, total: int, total_kv: int) -> None:
    if total_kv < 1 or total % total_kv or not 0 <= start <= total - heads:
        raise ValueError(
            f"a head range needs query heads [head_start, head_start + {heads}) of total_heads "
            f"with total_kv_heads dividing total_heads, got head_start = {start}, total_heads = "
            f"{total}, total_kv_heads = {total_kv}"
        )
    group = total // total_kv
    want = (start + heads - 1) // group - start // group + 1
    if kv_heads != want:
        raise ValueError(
            f"k and v must hold the {want} K/V heads that query heads [{start}, "
            f"{start + heads}) read ({group} query heads per K/V head), got {kv_heads}"
        )


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``head_dim ** -0.5`` by default; otherwise a finite positive float."""
    if scale is None:
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float or None, got {scale!r}")
    try:
        scale = float(scale)
    except OverflowError:  # an int beyond the float range
        raise ValueError(
            f"scale must be a finite positive number, got an integer of {scale.bit_length()} "
            "bits, beyond the float range"
        ) from None
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    return scale


def check_key_padding_mask(
    mask: torch.Tensor | None, batch: int, seq: int, device: torch.device
) -> None:
    """A bool ``(batch, seq)`` mask on the inputs' device, ``True`` = ignore that key."""
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


def sinks_meta(sinks: object) -> tuple | None:
    """What :func:`check_sinks` reads of ``sinks`` (hashable), or ``None``."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        return ("not a tensor", type(sinks).__name__)
    return (tuple(sinks.shape), str(sinks.dtype), sinks.is_floating_point(), str(sinks.device))


def check_sinks(sinks: object, heads: int, device: torch.device) -> None:
    """Sinks: a floating ``(heads,)`` tensor on the inputs' device, or ``None``."""
    check_sinks_meta(sinks_meta(sinks), heads, device)


def check_sinks_meta(meta: tuple | None, heads: int, device: torch.device) -> None:
    """:func:`check_sinks` from :func:`sinks_meta`'s value."""
    if meta is None:
        return
    if meta[0] == "not a tensor":
        raise ValueError(f"sinks must be a tensor of shape (heads,), got {meta[1]}")
    shape, dtype, floating, where = meta
    if not floating:
        raise ValueError(f"sinks must have a floating dtype, got {dtype}")
    if shape != (heads,):
        raise ValueError(f"sinks must have shape (heads,) = ({heads},), got {shape}")
    if where != str(device):
        raise ValueError(f"sinks must be on {device}, got {where}")


def check_int(value: object, name: str, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]`` (not ``bool``), else ``ValueError`` naming
    ``name``."""
    try:
        if isinstance(value, bool) or getattr(value, "dtype", None) is torch.bool:
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer, got {value!r} ({type(value).__name__})"
        ) from None
    if not low <= n <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {n}")
    return n
