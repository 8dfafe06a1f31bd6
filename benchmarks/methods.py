"""What the benchmarks measure: ours and the baselines, and the pattern's exact work.

* ``ours`` — ``ring_attention.dilated_attention`` (and the ring, for
  ``bench.py ring-run``);
* ``gather`` — :func:`gather_sdpa_dilated`: for every branch and head-offset
  class ``o = h mod r`` the active rows of each segment are compacted, PyTorch's
  fused SDPA runs on the compacted segments, the results are scattered back and
  merged by their log-sum-exp. Exact (the multiset softmax of
  ``ra.dilated_attention``) and differentiable: its backward runs SDPA's fused
  backward per chunk with the *final* merged ``out`` and ``lse``, as ring and
  flash attention do;
* ``fa4`` — the same gather and merge with flash-attn-4 (``flash_attn.cute``,
  the CuTe-DSL FlashAttention for Hopper and Blackwell) in place of SDPA, on
  CUDA where it is installed (:func:`fa4_interface`);
* ``flex`` — :class:`FlexDilated`: one FlexAttention call with a ``mask_mod``
  for reachability and a ``score_mod`` adding ``log(multiplicity)`` (how many
  branches reach the pair), under which an ordinary softmax is the multiset
  softmax: exact. Its ``BlockMask`` is built from the pattern's block structure
  (:func:`flex_block_mask`, checked against ``create_block_mask``);
* ``dense`` — plain SDPA over all n² pairs. The same function only for the
  dense pattern ``[(w >= n, 1)]``: otherwise a cost reference.

Every ``ring_attention`` name the benchmarks use is imported here, lazily, so
that the baselines still run when the extension failed to build.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

LONGNET_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
LONGNET_DILATIONS = (1, 2, 4, 6, 12)
METHODS = ("ours", "gather", "fa4", "flex", "dense")
SAME_FUNCTION = ("ours", "gather", "fa4", "flex")  # compute ra.dilated_attention exactly
SDPA_BACKENDS = ("flash", "cudnn", "efficient")  # CUDA kernels tried for gather / dense
FLEX_BLOCK = 128


# --------------------------------------------------------------------------- #
# ring_attention, imported lazily
# --------------------------------------------------------------------------- #
def ring_attention() -> Any:
    """The ``ring_attention`` package (raises ImportError when the extension is missing)."""
    import ring_attention as ra

    return ra


def head_group_bounds(heads: int, n_branches: int) -> list[tuple[int, int]]:
    from ring_attention.pattern import head_group_bounds as bounds

    return bounds(heads, n_branches)


def layout_pieces(n: int, world: int, rank: int, layout: str) -> list[tuple[int, int]]:
    """``(start, length)`` of the runs of global positions rank ``rank`` holds."""
    from ring_attention.sharding import layout_pieces as pieces

    return [(p.start, p.length) for p in pieces(n, world, rank, layout)]


def ring_call(q, k, v, segs, dils, *, causal: bool, head_groups: bool, layout: str):
    """``ring_dilated_attention`` on the default process group."""
    ra = ring_attention()
    return ra.ring_dilated_attention(
        q, k, v, segs, dils, causal=causal, head_groups=head_groups, layout=layout
    )


def exchange_counters() -> dict[str, Any]:
    """Bytes the last ring call on this rank handed to torch.distributed, and
    the transport buffers it allocated (``ring_attention.exchange``)."""
    from ring_attention.exchange import last_exchange_stats as s

    return {
        "sent_fwd": s.bytes_sent("forward_kv"),
        "sent_all": s.bytes_sent(),
        "buffers": max(s.buffer_bytes.values(), default=0),
    }


def plan_bytes_sent(
    n: int, heads: int, segs, dils, *, causal: bool, head_groups: bool, layout: str,
    batch: int, head_dim: int, itemsize: int, world: int | None = None, rank: int | None = None,
) -> tuple[int, int]:  # fmt: skip
    """Bytes a rank sends per layer from its exchange plan: (forward, forward + backward).

    With ``world``/``rank`` the plan of that rank is built without processes;
    otherwise this rank's plan in the default process group.
    """
    if world is None:
        from ring_attention.ring import exchange_plan

        plan = exchange_plan(
            n, heads, segs, dils, causal=causal, head_groups=head_groups, layout=layout
        )
    else:
        from ring_attention.pattern import Pattern
        from ring_attention.plan import build_plan

        pattern = Pattern(segs, dils, causal=causal, head_groups=head_groups)
        plan = build_plan(pattern, n, heads, heads, world, rank, layout)
    fwd = plan.bytes_sent(batch, head_dim, itemsize)
    return fwd, plan.bytes_sent(batch, head_dim, itemsize, backward=True)


# --------------------------------------------------------------------------- #
# the pattern's work, counted exactly
# --------------------------------------------------------------------------- #
def branch_classes(heads: int, segs, dils, head_groups: bool = False):
    """Yield ``(w, r, o, heads_of_class)`` for every branch and head-offset class."""
    groups = head_group_bounds(heads, len(segs)) if head_groups else None
    for i, (w, r) in enumerate(zip(segs, dils, strict=True)):
        lo, hi = groups[i] if groups is not None else (0, heads)
        for o in range(r):
            hs = [h for h in range(lo, hi) if h % r == o]
            if hs:
                yield w, r, o, hs


def _active_below(x: int, o: int, r: int) -> int:
    """Number of offsets ``j`` in ``[0, x)`` with ``j mod r == o``."""
    return 0 if x <= o else (x - 1 - o) // r + 1


def _class_pairs(n: int, w: int, r: int, o: int, causal: bool, lo: int, hi: int) -> int:
    """Reached pairs of the queries in ``[lo, hi)`` for one branch and offset class.

    In a segment with ``a`` active rows, the ``j``-th active query reaches all
    ``a`` active keys, or ``j + 1`` of them when causal.
    """

    def seg_pairs(s: int) -> int:
        s0 = s * w
        a = _active_below(min(w, n - s0), o, r)
        j0 = _active_below(max(lo - s0, 0), o, r)
        j1 = _active_below(min(hi - s0, w, n - s0), o, r)
        return (j1 * (j1 + 1) - j0 * (j0 + 1)) // 2 if causal else (j1 - j0) * a

    if hi <= lo:
        return 0
    first, last = lo // w, (hi - 1) // w
    edges = {first, last, (n - 1) // w} & set(range(first, last + 1))
    total = sum(seg_pairs(s) for s in edges)
    inner = last - first + 1 - len(edges)  # whole segments strictly inside: all alike
    if inner > 0:
        total += inner * seg_pairs(next(s for s in range(first, last + 1) if s not in edges))
    return total


def pattern_pairs(
    n: int,
    heads: int,
    segs: Sequence[int],
    dils: Sequence[int],
    causal: bool,
    head_groups: bool = False,
    batch: int = 1,
    rows: Sequence[tuple[int, int]] | None = None,
) -> int:
    """Exact number of reached (query, key) pairs, branches counted with multiplicity.

    Summed over batch and heads; ``rows``: only the queries in these
    ``(start, length)`` runs (a rank's shard), default the whole sequence.
    Pattern FLOPs are ``4 * head_dim`` per pair forward, 2.5x that backward.
    """
    runs = [(0, n)] if rows is None else list(rows)
    total = 0
    for w, r, o, hs in branch_classes(heads, list(segs), list(dils), head_groups):
        total += len(hs) * sum(_class_pairs(n, w, r, o, causal, s, s + ln) for s, ln in runs)
    return batch * total


def flops(pairs: int, head_dim: int, backward: bool) -> float:
    """Pattern FLOPs: 4·d per pair forward; forward + backward is 3.5x that."""
    return 4.0 * head_dim * pairs * (3.5 if backward else 1.0)


def dense_pairs(n: int, heads: int, causal: bool, batch: int = 1) -> int:
    return batch * heads * (n * (n + 1) // 2 if causal else n * n)


# --------------------------------------------------------------------------- #
# fused SDPA returning its LSE, per device
# --------------------------------------------------------------------------- #
def _math_fwd(q, k, v, causal, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.float())
    return out.to(q.dtype), lse


def _math_bwd(do, q, k, v, out, lse, causal, scale):
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    delta = (dof * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    return torch.matmul(ds, kf), torch.matmul(ds.transpose(-1, -2), qf), dv


def _lse_rows(lse: torch.Tensor, length: int) -> torch.Tensor:
    """Any backend's LSE ((B, H, L), padded (B, H, Lpad) or (B, H, L, 1)) -> (B, H, L)."""
    return lse.reshape(lse.shape[0], lse.shape[1], -1)[..., :length]


def _cuda_sdpa_fwd(backend: str, q, k, v, causal: bool, scale: float):
    """One CUDA SDPA backend's aten op, which (unlike F.sdpa) returns the LSE."""
    aten = torch.ops.aten
    if backend == "flash":
        out, lse, cq, ck, mq, mk, rng, unused, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        extra = (cq, ck, mq, mk, rng, unused)
    elif backend == "cudnn":
        out, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        extra = (cq, ck, mq, mk, seed, off)
    elif backend == "efficient":
        out, lse, seed, off = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        extra = (seed, off)
    else:
        raise ValueError(f"unknown SDPA backend {backend!r}")
    return out, _lse_rows(lse, q.shape[-2]), (backend, tuple(lse.shape), extra)


def _cuda_sdpa_bwd(do, q, k, v, out, lse, state, causal: bool, scale: float):
    aten = torch.ops.aten
    backend, lse_shape, extra = state
    buf = torch.zeros(lse_shape, dtype=torch.float32, device=q.device)
    _lse_rows(buf, lse.shape[-1]).copy_(lse)
    if backend == "flash":
        cq, ck, mq, mk, rng, unused = extra
        return aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, buf, cq, ck, mq, mk, 0.0, causal, rng, unused, scale=scale
        )
    if backend == "cudnn":
        cq, ck, mq, mk, seed, off = extra
        return aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, out, buf, seed, off, None, cq, ck, mq, mk, 0.0, causal, scale=scale
        )
    seed, off = extra
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        do, q, k, v, None, out, buf, seed, off, 0.0, [True, True, True, False], causal,
        scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def fa4_interface() -> Any:
    """flash-attn-4's ``flash_attn.cute.interface``: ``flash_attn_func`` (the
    forward, with ``return_lse``) and ``_flash_attn_bwd`` (the backward from a
    given ``out`` and ``lse``, as SDPA's aten backward ops take them). Raises
    ImportError where flash-attn-4 is not installed."""
    from flash_attn.cute import interface

    return interface


@functools.cache
def fa4_missing() -> str | None:
    """Why flash-attn-4 does not import here (None when it does)."""
    try:
        fa4_interface()
    except Exception as exc:  # ImportError, or a broken install of its CUDA libraries
        return f"{type(exc).__name__}: {exc}"
    return None


def _fa4_fwd(q, k, v, causal: bool, scale: float):
    """flash-attn-4 on ``(B, H, L, D)`` (it takes ``(B, L, H, D)``; the
    compacted chunks are contiguous in that layout): ``(out, lse, state)``."""
    out, lse = fa4_interface().flash_attn_func(
        *(t.transpose(1, 2) for t in (q, k, v)), softmax_scale=scale, causal=causal,
        return_lse=True,
    )  # fmt: skip
    return out.transpose(1, 2), lse, ("fa4",)


def _fa4_bwd(do, q, k, v, out, lse, causal: bool, scale: float):
    dq, dk, dv = fa4_interface()._flash_attn_bwd(
        *(t.transpose(1, 2) for t in (q, k, v, out, do)), lse.float().contiguous(), scale, causal
    )
    return tuple(t.transpose(1, 2) for t in (dq, dk, dv))


def sdpa_with_lse(q, k, v, causal: bool, scale: float, backend: str | None = None):
    """Fused SDPA on ``(B, H, L, D)`` returning ``(out, lse, state)``; ``lse``
    float32 ``(B, H, L)``. ``backend`` picks the CUDA kernel (default efficient),
    or ``"fa4"``: flash-attn-4 (on whatever device its interface runs)."""
    if backend == "fa4":
        return _fa4_fwd(q, k, v, causal, scale)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse, None
    if q.device.type == "cuda" and q.dtype != torch.float64:
        return _cuda_sdpa_fwd(backend or "efficient", q, k, v, causal, scale)
    out, lse = _math_fwd(q, k, v, causal, scale)
    return out, lse, None


def _sdpa_bwd(do, q, k, v, out, lse, state, causal: bool, scale: float):
    """Gradient of one SDPA call given the FINAL ``out`` / ``lse`` of its rows."""
    if state is not None and state[0] == "fa4":
        return _fa4_bwd(do, q, k, v, out, lse, causal, scale)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale
        )
    if q.device.type == "cuda" and q.dtype != torch.float64:
        return _cuda_sdpa_bwd(do, q, k, v, out, lse, state, causal, scale)
    return _math_bwd(do, q, k, v, out, lse, causal, scale)


# --------------------------------------------------------------------------- #
# gather + SDPA + LSE merge
# --------------------------------------------------------------------------- #
def _chunks(n: int, heads: int, segs, dils, head_groups: bool, device):
    """Flat row indices ``pos * heads + h`` of every compacted SDPA call:
    ``(n_segments, a, heads_of_class)`` per chunk; full segments form one
    chunk, the ragged last segment another."""
    out = []
    for w, r, o, hs in branch_classes(heads, segs, dils, head_groups):
        h_idx = torch.tensor(hs, dtype=torch.long)
        nfull, rem = divmod(n, w)
        parts = []
        if nfull:
            parts.append((torch.arange(nfull) * w)[:, None] + torch.arange(o, w, r)[None, :])
        if rem > o:
            parts.append(nfull * w + torch.arange(o, rem, r)[None, :])
        for pos in parts:
            out.append((pos[:, :, None] * heads + h_idx[None, None, :]).to(device))
    return out


def _gather(x_flat, idx, bsz):
    """``(B, N*H, D)`` -> ``(B*S, Hc, a, D)`` of the compacted rows."""
    s, a, hc = idx.shape
    g = x_flat.index_select(1, idx.reshape(-1))
    return g.view(bsz * s, a, hc, x_flat.shape[-1]).transpose(1, 2)


def _flat_rows(x, bsz):
    """``(B*S, Hc, a, D)`` -> ``(B, S*a*Hc, D)``, matching the index order."""
    return x.transpose(1, 2).reshape(bsz, -1, x.shape[-1])


class _GatherSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segs, dils, causal, scale, head_groups, backend):
        bsz, n, heads, d = q.shape
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf, kf, vf = (t.reshape(bsz, n * heads, d) for t in (q, k, v))
        acc_out = torch.zeros(bsz, n * heads, d, dtype=acc_dtype, device=q.device)
        acc_lse = torch.full((bsz, n * heads), float("-inf"), dtype=acc_dtype, device=q.device)
        states = []
        for idx in _chunks(n, heads, segs, dils, head_groups, q.device):
            flat = idx.reshape(-1)
            o_c, l_c, st = sdpa_with_lse(
                _gather(qf, idx, bsz), _gather(kf, idx, bsz), _gather(vf, idx, bsz),
                causal, scale, backend,
            )  # fmt: skip
            states.append(st)
            o_c = _flat_rows(o_c, bsz).to(acc_dtype)
            l_c = l_c.transpose(1, 2).reshape(bsz, -1).to(acc_dtype)
            cur_lse = acc_lse.index_select(1, flat)
            new_lse = torch.logaddexp(cur_lse, l_c)
            safe = torch.where(torch.isneginf(new_lse), 0.0, new_lse)
            merged = acc_out.index_select(1, flat) * torch.exp(cur_lse - safe)[..., None]
            merged += o_c * torch.exp(l_c - safe)[..., None]
            acc_out.index_copy_(1, flat, merged)
            acc_lse.index_copy_(1, flat, new_lse)
            del o_c, l_c, cur_lse, new_lse, safe, merged
        out = acc_out.to(q.dtype).view(bsz, n, heads, d)
        del acc_out
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.cfg = (segs, dils, causal, scale, head_groups, states)
        lse = acc_lse.view(bsz, n, heads).permute(0, 2, 1).contiguous()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse_flat = ctx.saved_tensors
        segs, dils, causal, scale, head_groups, states = ctx.cfg
        bsz, n, heads, d = q.shape
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        flats = [t.reshape(bsz, n * heads, d) for t in (q, k, v, out)]
        do_f = grad_out.to(q.dtype).contiguous().view(bsz, n * heads, d)
        grads = [torch.zeros(bsz, n * heads, d, dtype=acc_dtype, device=q.device) for _ in range(3)]
        chunks = _chunks(n, heads, segs, dils, head_groups, q.device)
        for idx, st in zip(chunks, states, strict=True):
            flat = idx.reshape(-1)
            s, a, hc = idx.shape
            qc, kc, vc, oc = (_gather(t, idx, bsz) for t in flats)
            doc = _gather(do_f, idx, bsz)
            lc = lse_flat.index_select(1, flat).view(bsz * s, a, hc).transpose(1, 2)
            dq, dk, dv = _sdpa_bwd(doc, qc, kc, vc, oc, lc.to(acc_dtype), st, causal, scale)
            for acc, g in zip(grads, (dq, dk, dv), strict=True):
                acc.index_add_(1, flat, _flat_rows(g, bsz).to(acc_dtype))
        dq, dk, dv = (g.view(bsz, n, heads, d).to(q.dtype) for g in grads)
        return dq, dk, dv, None, None, None, None, None, None


def gather_sdpa_dilated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segs: Sequence[int],
    dils: Sequence[int],
    causal: bool = False,
    scale: float | None = None,
    head_groups: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Dilated attention by gather + fused SDPA per branch and offset class,
    merged by LSE: ``(B, N, H, D)`` in and out, the semantics of
    ``ra.dilated_attention`` (no key padding mask). ``backend``: the CUDA SDPA
    kernel (:data:`SDPA_BACKENDS`, default efficient; ignored elsewhere), or
    ``"fa4"`` for flash-attn-4."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, lse = _GatherSDPA.apply(
        q, k, v, tuple(int(s) for s in segs), tuple(int(r) for r in dils),
        bool(causal), scale, bool(head_groups), backend,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def dense_sdpa(q, k, v, causal: bool = False, backend: str | None = None):
    """``F.scaled_dot_product_attention`` over the whole sequence, ``(B, N, H, D)``
    in and out; ``backend`` pins one CUDA kernel (:data:`SDPA_BACKENDS`)."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if backend is None:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[backend]
    with sdpa_kernel([kernel]):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


# --------------------------------------------------------------------------- #
# FlexAttention: reachability mask + log(multiplicity) score bias
# --------------------------------------------------------------------------- #
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


# --------------------------------------------------------------------------- #
# the dispatch
# --------------------------------------------------------------------------- #
def default_methods(device: torch.device) -> list[str]:
    """What ``bench.py local`` and ``check`` run unless told: every method,
    flash-attn-4 only on CUDA (where it is reported unsupported unless it
    imports)."""
    return [m for m in METHODS if m != "fa4" or device.type == "cuda"]


class Methods:
    """Calls every method on ``(B, N, H, D)`` inputs with one pattern."""

    def __init__(self, segs, dils, causal: bool, device: torch.device, flex_compiled: bool = True):
        self.segs, self.dils, self.causal, self.device = list(segs), list(dils), causal, device
        self.flex_compiled = flex_compiled
        self._flex: FlexDilated | None = None
        try:
            self.ra, self.ra_error = ring_attention(), None
        except Exception as exc:  # the extension may have failed to build: baselines still run
            self.ra, self.ra_error = None, f"{type(exc).__name__}: {exc}"

    def backends(self, method: str, sdpa_backends: Sequence[str]) -> list[str | None]:
        """The kernels tried for ``method``: each CUDA SDPA backend for gather
        and dense (the fastest is kept), else one (``None``)."""
        if method in ("gather", "dense") and self.device.type == "cuda":
            return list(sdpa_backends)
        if method == "fa4":
            return ["fa4"]
        return [None]

    def unsupported(self, method: str, backward: bool) -> str | None:
        """Why ``method`` cannot run this case (None when it can)."""
        if method == "flex" and self.device.type == "cpu" and backward:
            return "FlexAttention has no backward on the CPU (torch raises NotImplementedError)"
        if method == "fa4":
            if self.device.type != "cuda":
                return "flash-attn-4 runs on CUDA GPUs only"
            missing = fa4_missing()
            if missing:
                return f"flash-attn-4 not importable ({missing})"
        return None

    def dense_is_pattern(self, n: int) -> bool:
        return len(self.segs) == 1 and self.dils[0] == 1 and self.segs[0] >= n

    def ours_paths(self, q, k, v) -> dict[str, str | None]:
        """Which path ``ours`` takes on these inputs (ring_attention/dispatch.py):
        ``{"forward": "kernel" | "dense", "backward": ... | None}`` (None: no
        backward; K/V assumed finite)."""
        from ring_attention.dispatch import route

        pattern = self.ra.Pattern(self.segs, self.dils, causal=self.causal)
        grad = q.requires_grad or k.requires_grad or v.requires_grad
        paths: dict[str, str | None] = {"forward": None, "backward": None}
        for p in ("forward", "backward") if grad else ("forward",):
            paths[p] = "dense" if route(p, q, k, v, pattern, None).dense else "kernel"
        return paths

    def call(self, method: str, backend: str | None, q, k, v, return_lse: bool = False):
        if method == "ours":
            if self.ra is None:
                raise RuntimeError(f"ring_attention not importable: {self.ra_error}")
            return self.ra.dilated_attention(
                q, k, v, self.segs, self.dils, causal=self.causal, return_lse=return_lse
            )
        if method in ("gather", "fa4"):
            return gather_sdpa_dilated(
                q, k, v, self.segs, self.dils, self.causal, return_lse=return_lse, backend=backend
            )
        if method == "flex":
            if self._flex is None:
                self._flex = FlexDilated(self.segs, self.dils, self.causal, self.flex_compiled)
            # compiled flex on the CPU returns no LSE
            lse_ok = self.device.type != "cpu" or not self.flex_compiled
            if return_lse and not lse_ok:
                return self._flex(q, k, v), None
            return self._flex(q, k, v, return_lse=return_lse)
        if method == "dense":
            out = dense_sdpa(q, k, v, self.causal, backend)
            return (out, None) if return_lse else out
        raise ValueError(f"unknown method {method!r}")
