"""The options :class:`~ring_attention.nn.multihead.MultiheadDilatedAttention`
adds to ``nn.MultiheadAttention``: its pattern and its ``compute_dtype``,
checked once in the constructor (:func:`check_options`) and resolved for each
call (:func:`call_pattern`, :func:`compute_dtype`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..core.dtypes import select_dtype, supported_dtypes
from ..core.pattern import Pattern

if TYPE_CHECKING:
    from .multihead_call import Call

__all__ = ["DENSE", "call_pattern", "check_options", "compute_dtype", "module_pattern"]

#: A pattern whose one segment is longer than any sequence: dense attention.
DENSE = Pattern((2**62,), (1,))


def check_options(
    num_heads, segment_lengths, dilation_rates, head_groups, head_offsets, sharded, add_bias_kv,
    add_zero_attn, compute_dtype, window,
) -> Pattern | None:  # fmt: skip
    """The checks of the constructor's own arguments; the pattern (``None``:
    dense)."""
    if (segment_lengths is None) != (dilation_rates is None):
        raise ValueError(
            "segment_lengths and dilation_rates must be given together (or both None for "
            f"dense attention), got segment_lengths={segment_lengths!r} and "
            f"dilation_rates={dilation_rates!r}"
        )
    pattern = None
    if segment_lengths is not None:
        pattern = Pattern(
            segment_lengths, dilation_rates, head_groups=head_groups, head_offsets=head_offsets,
            window=window,
        )  # fmt: skip
        pattern.check_heads(num_heads)
    elif window is not None:  # a sliding window on dense attention
        pattern = replace(DENSE, window=window)
        if not pattern.windowed:
            pattern = None
    kernels = supported_dtypes(torch.device("cpu"))  # the same on every device
    if not (
        compute_dtype is None
        or (isinstance(compute_dtype, str) and compute_dtype == "auto")
        or (isinstance(compute_dtype, torch.dtype) and compute_dtype in kernels)
    ):
        allowed = ", ".join(str(d) for d in kernels)
        raise ValueError(
            f'compute_dtype must be None, "auto" or one of {allowed}, got {compute_dtype!r}'
        )
    if sharded and (add_bias_kv or add_zero_attn):
        which = "add_bias_kv" if add_bias_kv else "add_zero_attn"
        raise ValueError(f"{which}=True is not supported with group= (sequence sharding)")
    return pattern


def module_pattern(m: nn.MultiheadAttention, causal: bool) -> Pattern:
    """The module's pattern (dense when it has none), causal per the call's
    ``is_causal`` hint (the sharded path builds it in the ring's spec, from
    these two constants of a compiled graph)."""
    pattern = m.pattern if m.pattern is not None else DENSE
    return pattern if causal == pattern.causal else replace(pattern, causal=causal)


def call_pattern(m: nn.MultiheadAttention, call: Call, cu_seqlens) -> Pattern:
    """The pattern of one call: :func:`module_pattern` with the call's
    documents."""
    pattern = module_pattern(m, call.causal)
    if cu_seqlens is not None and call.q.shape[1] != call.k.shape[1]:
        raise ValueError(
            "cu_seqlens needs query and key of the same sequence length (self-attention), "
            f"got {call.q.shape[1]} and {call.k.shape[1]}"
        )
    return pattern.with_documents(cu_seqlens)


def compute_dtype(m: nn.MultiheadAttention, x: torch.Tensor) -> torch.dtype:
    """The attention core's dtype for projections ``x``: the module's
    ``compute_dtype`` resolved (``None``: ``x``'s; ``"auto"``:
    ``ra.select_dtype(x.device)``)."""
    if m.compute_dtype is None:
        return x.dtype
    if m.compute_dtype == "auto":
        return select_dtype(x.device)
    return m.compute_dtype
