"""Dense matrices of a dilated pattern: the multiplicity ``M[h, t, u]`` of
DESIGN.md §1 (how many branches let query ``t`` reach key ``u``) and its log,
an additive score bias under which an ordinary softmax is the pattern's
multiset softmax. Used by the exact dense path of
:class:`ring_attention.MultiheadDilatedAttention` (attention weights, masks,
dropout); O(seq**2) memory, so never on the kernels' path."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cache import LRUCache
from .functional import check_head_groups, normalize_pattern

__all__ = [
    "PATTERN_CACHE",
    "head_group_bounds",
    "pattern_log_multiplicity",
    "pattern_multiplicity",
]

#: Cache of the dense ``log(multiplicity)`` bias of a pattern, keyed by
#: ``(seq_len, heads, pattern, causal, head_groups, device, dtype)``; used by
#: the dense path of :class:`MultiheadDilatedAttention` (attention weights,
#: masks, dropout). Same LRU class as the exchange-plan cache.
PATTERN_CACHE: LRUCache[torch.Tensor] = LRUCache(maxsize=32)


def head_group_bounds(heads: int, n_branches: int) -> list[tuple[int, int]]:
    base, extra = divmod(heads, n_branches)
    bounds, begin = [], 0
    for i in range(n_branches):
        size = base + (1 if i < extra else 0)
        bounds.append((begin, begin + size))
        begin += size
    return bounds


def pattern_multiplicity(
    seq_len: int,
    heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    head_groups: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``M[h, t, u]``, ``(heads, seq_len, seq_len)``: the number of branches in
    which query ``t`` reaches key ``u`` for head ``h`` (DESIGN.md §1).

    Built fresh (not cached); O(heads * seq_len**2) memory.
    """
    segs, dils = normalize_pattern(segment_lengths, dilation_rates)
    check_head_groups(heads, len(segs), head_groups)
    t = torch.arange(seq_len, device=device)
    h = torch.arange(heads, device=device)
    groups = head_group_bounds(heads, len(segs))
    m = torch.zeros(heads, seq_len, seq_len, dtype=dtype, device=device)
    for i, (w, r) in enumerate(zip(segs, dils, strict=True)):
        act = ((t % w) % r)[None, :] == (h % r)[:, None]  # (H, L)
        if head_groups:
            lo, hi = groups[i]
            act = act & ((h >= lo) & (h < hi))[:, None]
        seg = t // w
        same = seg[:, None] == seg[None, :]  # (L, L)
        m += (act[:, :, None] & act[:, None, :] & same).to(dtype)
    if causal:
        m = m.tril()
    return m


def pattern_log_multiplicity(
    seq_len: int,
    heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    head_groups: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``log(M)`` of :func:`pattern_multiplicity` (``-inf`` where a key is not
    reached), ``(heads, seq_len, seq_len)``, from :data:`PATTERN_CACHE`
    (built in the graph instead when called under ``torch.compile``).

    Adding it to the scores makes an ordinary softmax the multiset softmax of
    the pattern. The returned tensor is shared by every caller: do not modify
    it in place.
    """
    segs, dils = normalize_pattern(segment_lengths, dilation_rates)
    device = torch.device("cpu") if device is None else torch.device(device)
    key = (
        "log_multiplicity",
        int(seq_len),
        int(heads),
        segs,
        dils,
        bool(causal),
        bool(head_groups),
        str(device),
        dtype,
    )

    def build() -> torch.Tensor:
        with torch.no_grad():
            m = pattern_multiplicity(
                seq_len, heads, segs, dils, causal=causal, head_groups=head_groups,
                device=device, dtype=torch.float64,
            )  # fmt: skip
            return torch.log(m).to(dtype)

    if torch.compiler.is_compiling():
        # Under torch.compile the matrix is built inside the graph (a lock-
        # protected cache would be a graph break).
        return build()
    return PATTERN_CACHE.get(key, build)
