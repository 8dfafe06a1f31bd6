"""The ``flex`` baseline: one FlexAttention call with a ``mask_mod`` for
reachability and a ``score_mod`` adding ``log(multiplicity)``, under which an
ordinary softmax is the multiset softmax (exact); its ``BlockMask`` built from
the pattern's block structure, checked against ``create_block_mask``; and the
pairs it computes.
"""

from __future__ import annotations

from typing import Any

import torch

FLEX_BLOCK = 128


def _multiplicity(segs, dils, causal: bool):
    """``count(b, h, q, kv)``: how many branches let query q reach key kv (head h)."""

    def count(b, h, q_idx, kv_idx):
        total = None
        for w, r in zip(segs, dils, strict=True):
            o = h % r
            hit = (q_idx // w) == (kv_idx // w)
            hit = hit & ((q_idx % w) % r == o) & ((kv_idx % w) % r == o)
            hit = hit.to(torch.int32)
            total = hit if total is None else total + hit
        if causal:
            total = torch.where(kv_idx <= q_idx, total, 0)
        return total

    return count


def flex_mods(segs, dils, causal: bool):
    """``(mask_mod, score_mod)`` of the pattern: reachable, and ``+ log(count)``."""
    count = _multiplicity(list(segs), list(dils), causal)

    def mask_mod(b, h, q_idx, kv_idx):
        return count(b, h, q_idx, kv_idx) > 0

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + torch.log(count(b, h, q_idx, kv_idx).to(score.dtype))

    return mask_mod, score_mod


def flex_block_state(n: int, segs, dils, causal: bool, device) -> torch.Tensor:
    """``(nb, nb)`` int8 per (query block, key block): 0 skipped, 1 partial
    (mask_mod evaluated), 2 full, for blocks of :data:`FLEX_BLOCK` rows.

    A block pair is visited when a segment of some branch holds rows of both
    (and, causal, a key row precedes a query row); it is full when a branch
    with ``r == 1`` reaches all of it (one segment, below the diagonal when
    causal, no ragged block). Visited may over-approximate (a partial block
    whose mask is all false costs time, not correctness); full never does.
    """
    bs = FLEX_BLOCK
    nb = -(-n // bs)
    i = torch.arange(nb, device=device)
    lo, hi = i * bs, torch.clamp((i + 1) * bs, max=n) - 1
    whole = (hi - lo + 1) == bs
    qlo, qhi, qwhole = lo[:, None], hi[:, None], whole[:, None]
    klo, khi, kwhole = lo[None, :], hi[None, :], whole[None, :]
    state = torch.zeros(nb, nb, dtype=torch.int8, device=device)
    for w, r in zip(segs, dils, strict=True):
        visited = (qlo // w <= khi // w) & (klo // w <= qhi // w)
        if causal:
            visited &= klo <= qhi
        state = torch.maximum(state, visited.to(torch.int8))
        if r == 1:
            full = (qlo // w == qhi // w) & (klo // w == qlo // w) & (khi // w == qlo // w)
            full &= qwhole & kwhole
            if causal:
                full &= khi <= qlo
            state = torch.where(full, torch.full_like(state, 2), state)
    return state


def flex_block_mask(n: int, segs, dils, causal: bool, device):
    """The pattern's FlexAttention ``BlockMask`` from :func:`flex_block_state`
    (no n² evaluation of the mask)."""
    from torch.nn.attention import flex_attention as fa

    state = flex_block_state(n, segs, dils, causal, device)
    mask_mod, _ = flex_mods(segs, dils, causal)

    def ordered(sel: torch.Tensor):
        # selected block indices first, in ascending order; entries past the count are ignored
        idx = torch.sort(sel.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return sel.sum(-1).to(torch.int32)[None, None], idx.to(torch.int32)[None, None]

    part_num, part_idx = ordered(state == 1)
    full_num, full_idx = ordered(state == 2)
    return fa.BlockMask.from_kv_blocks(
        part_num, part_idx, full_num, full_idx,
        BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(n, n),
    )  # fmt: skip


def reference_block_state(n: int, heads: int, segs, dils, causal: bool, device) -> torch.Tensor:
    """:func:`flex_block_state` as ``create_block_mask`` finds it (n² mask evaluations)."""
    from torch.nn.attention import flex_attention as fa

    mask_mod, _ = flex_mods(segs, dils, causal)
    ref = fa.create_block_mask(mask_mod, None, heads, n, n, device=device)
    nb = -(-n // FLEX_BLOCK)

    def dense(num, idx):
        valid = torch.arange(idx.shape[-1], device=device) < num[..., None]
        out = torch.zeros(*num.shape, nb, dtype=torch.int32, device=device)
        out.scatter_add_(-1, torch.where(valid, idx.long(), 0), valid.to(torch.int32))
        return (out > 0).any(dim=(0, 1))  # union over batch and heads

    part = dense(ref.kv_num_blocks, ref.kv_indices)
    full = dense(ref.full_kv_num_blocks, ref.full_kv_indices)
    return torch.where(full, 2, torch.where(part, 1, 0)).to(torch.int8)


class FlexDilated:
    """FlexAttention computing the multiset pattern in one call, ``(B, N, H, D)`` in and out.

    ``compiled``: through ``torch.compile`` (the fast path; on the CPU it
    supports inference only and no LSE). Eager FlexAttention is a reference
    implementation that materialises the scores.
    """

    def __init__(self, segs, dils, causal: bool, compiled: bool = True):
        from torch.nn.attention import flex_attention as fa

        self.segs, self.dils, self.causal = list(segs), list(dils), causal
        self._mask: tuple[tuple, Any] | None = None
        _, self.score_mod = flex_mods(self.segs, self.dils, causal)
        self.fn = fa.flex_attention
        if compiled:
            # every (n, heads, head_dim, pass, causal) of a sweep may recompile
            import torch._dynamo.config as dynamo_config

            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(dynamo_config, name):
                    setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
            self.fn = torch.compile(fa.flex_attention)

    def block_mask(self, n: int, device):
        key = (n, str(device))
        if self._mask is None or self._mask[0] != key:
            self._mask = None  # one length at a time (the masks can be large)
            self._mask = (key, flex_block_mask(n, self.segs, self.dils, self.causal, device))
        return self._mask[1]

    def __call__(self, q, k, v, return_lse: bool = False):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        bm = self.block_mask(q.shape[1], q.device)
        if not return_lse:
            return self.fn(qt, kt, vt, score_mod=self.score_mod, block_mask=bm).transpose(1, 2)
        try:  # torch >= 2.9 asks for the LSE this way; older versions take return_lse
            from torch.nn.attention.flex_attention import AuxRequest

            out, aux = self.fn(
                qt, kt, vt, score_mod=self.score_mod, block_mask=bm,
                return_aux=AuxRequest(lse=True),
            )  # fmt: skip
            lse = aux.lse
        except ImportError:
            out, lse = self.fn(qt, kt, vt, score_mod=self.score_mod, block_mask=bm, return_lse=True)
        return out.transpose(1, 2), lse


def flex_visited_pairs(n: int, heads: int, segs, dils, causal: bool, batch: int = 1) -> int:
    """(query, key) pairs FlexAttention computes: every visited block in full."""
    state = flex_block_state(n, segs, dils, causal, "cpu")
    return batch * heads * int((state > 0).sum()) * FLEX_BLOCK * FLEX_BLOCK
