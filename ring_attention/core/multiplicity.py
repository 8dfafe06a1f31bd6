"""Dense matrices of a pattern (docs/design.md §1): the multiplicity ``M[h, t, u]`` and its log,
the score bias of the exact dense path of the MHA module (O(heads * seq**2))."""

import torch

from .cache import LRUCache
from .pattern import Pattern

__all__ = ["PATTERN_CACHE", "log_multiplicity", "multiplicity"]

#: Cache of the dense ``log(multiplicity)`` bias, keyed by ``(pattern, seq_len, heads, device,
#: dtype)``, bounded in entries and in bytes (``PATTERN_CACHE.max_bytes``, default 256 MiB; a
#: matrix larger than the bound is built for the call and not kept).
PATTERN_CACHE: LRUCache[torch.Tensor] = LRUCache(
    32, name="pattern matrices", max_bytes=256 * 2**20, size_of=lambda t: t.nbytes
)


def multiplicity(
    pattern: Pattern, seq_len: int, heads: int, *, device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    """``M[h, t, u]``, ``(heads, seq_len, seq_len)``: the number of branches in which query ``t``
    reaches key ``u`` for head ``h`` (not cached)."""
    pattern.check_length(seq_len)
    t = torch.arange(seq_len, device=device)
    cu = pattern.documents_tensor(t.device)  # each position's document and place in it
    doc = torch.zeros_like(t) if cu is None else torch.searchsorted(cu, t, right=True) - 1
    rel = t if cu is None else t - cu[doc]
    same_doc = doc[:, None] == doc[None, :]
    m = torch.zeros(heads, seq_len, seq_len, dtype=dtype, device=device)
    for (w, r), classes in zip(pattern.branches, pattern.offset_classes(heads), strict=True):
        seg = rel // w
        same = same_doc & (seg[:, None] == seg[None, :])  # (L, L)
        for offset, heads_o in classes.items():
            act = (rel % w) % r == offset  # (L,)
            m[heads_o] += (act[:, None] & act[None, :] & same).to(dtype)
    if pattern.causal:
        m = m.tril()
    if pattern.windowed:
        diff, (left, right) = t[None, :] - t[:, None], pattern.window  # u - t
        m *= ((diff >= -left) | (left < 0)) & ((diff <= right) | (right < 0))
    return m


def log_multiplicity(
    pattern: Pattern, seq_len: int, heads: int, *, device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    """``log(M)`` (``-inf`` where not reached), from :data:`PATTERN_CACHE`; shared by every
    caller: do not modify it in place."""
    device = torch.device("cpu") if device is None else torch.device(device)

    def build() -> torch.Tensor:
        with torch.no_grad():
            m = multiplicity(pattern, seq_len, heads, device=device, dtype=torch.float64)
            return torch.log(m).to(dtype)

    if torch.compiler.is_compiling():  # built inside the graph: the locked cache would break it
        return build()
    return PATTERN_CACHE.get((pattern, int(seq_len), int(heads), str(device), dtype), build)
