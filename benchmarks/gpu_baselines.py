"""The GPU benchmark's baselines and the dispatch over every measured method.

* FlexAttention over the multiset pattern (:class:`FlexDilated`): one call per
  branch with that branch's ``mask_mod`` and ``return_lse=True``, merged by
  LSE; each branch's ``BlockMask`` is built analytically
  (:func:`branch_block_mask`, checked against ``create_block_mask`` by
  :func:`gpu_check.check_block_masks`);
* :class:`Methods`: ``ours`` (``ra.dilated_attention``), ``gather``
  (``baselines.gather_sdpa_dilated`` with an explicit CUDA SDPA ``backend=``),
  ``flex`` and ``dense`` (``F.scaled_dot_product_attention`` under
  ``sdpa_kernel``).
"""

from __future__ import annotations

import torch
from baselines import dense_sdpa, gather_sdpa_dilated
from gpu_plan import FLEX_BLOCK


def flex_module():
    from torch.nn.attention import flex_attention as fa

    return fa


def make_mask_mod(w: int, r: int, causal: bool, device):
    # w and r are captured as tensors: one compiled graph serves every branch
    # (Python ints in the closure would be guarded on: one recompile per branch).
    w_t = torch.tensor(w, dtype=torch.int64, device=device)
    r_t = torch.tensor(r, dtype=torch.int64, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        o = h % r_t
        m = (q_idx // w_t) == (kv_idx // w_t)
        m = m & ((q_idx % w_t) % r_t == o) & ((kv_idx % w_t) % r_t == o)
        if causal:
            m = m & (kv_idx <= q_idx)
        return m

    return mask_mod


def branch_block_mask(n: int, heads: int, w: int, r: int, causal: bool, device):
    """The BlockMask of one branch, built from the pattern's block structure.

    Query block i visits the key blocks of its own segment (up to the diagonal
    when causal). With r > 1 every visited block is partial (the mask_mod
    decides per head); with r == 1 blocks are full except, causal, the
    diagonal. Needs n and w to be multiples of the block size; otherwise
    ``create_block_mask`` is used (evaluates the mask on all n² pairs).
    """
    fa = flex_module()
    mask_mod = make_mask_mod(w, r, causal, device)
    bs = FLEX_BLOCK
    if n % bs or w % bs:
        return fa.create_block_mask(mask_mod, None, heads, n, n, device=device, _compile=True)
    nb, wb = n // bs, w // bs
    width = nb  # BlockMask wants (B, H, q_blocks, kv_blocks) index tensors
    i = torch.arange(nb, device=device, dtype=torch.int32)
    lo = (i // wb) * wb
    hi = torch.clamp(lo + wb, max=nb)
    if causal:
        hi = torch.minimum(hi, i + 1)
    cols = lo[:, None] + torch.arange(width, device=device, dtype=torch.int32)[None, :]
    zeros = torch.zeros(nb, dtype=torch.int32, device=device)
    zcols = torch.zeros_like(cols)
    if r > 1:
        part_num, part_idx = hi - lo, cols
        full_num, full_idx = zeros, zcols
    elif not causal:
        part_num, part_idx = zeros, zcols
        full_num, full_idx = hi - lo, cols
    else:
        part_num = torch.ones_like(zeros)
        part_idx = zcols.clone()
        part_idx[:, 0] = i
        full_num, full_idx = i - lo, cols
    # entries past the count are ignored; keep them in range
    part_idx = torch.where(part_idx < nb, part_idx, 0)
    full_idx = torch.where(full_idx < nb, full_idx, 0)

    def b4(x):
        return x.reshape(1, 1, *x.shape).contiguous()

    return fa.BlockMask.from_kv_blocks(
        b4(part_num), b4(part_idx), b4(full_num), b4(full_idx),
        BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(n, n),
    )  # fmt: skip


def dense_blocks(num: torch.Tensor, idx: torch.Tensor, nk: int) -> torch.Tensor:
    """(..., nq) counts + (..., nq, m) indices -> (..., nq, nk) 0/1 block matrix."""
    out = torch.zeros(*num.shape, nk, dtype=torch.int32, device=num.device)
    m = idx.shape[-1]
    valid = torch.arange(m, device=num.device) < num[..., None]
    src = valid.to(torch.int32)
    out.scatter_add_(-1, torch.where(valid, idx.long(), 0), src)
    return (out > 0).to(torch.int32)


class FlexDilated:
    """FlexAttention over the multiset pattern: one call per branch, LSE merge."""

    def __init__(self, segs, dils, causal: bool, compile_mode: str, dynamic: str):
        self.segs, self.dils, self.causal = list(segs), list(dils), causal
        self._masks: dict = {}
        fa = flex_module()
        if compile_mode == "eager":
            self.fn = fa.flex_attention
        else:
            dyn = {"auto": None, "on": True, "off": False}[dynamic]
            self.fn = torch.compile(fa.flex_attention, dynamic=dyn)

    def masks(self, n: int, heads: int, device):
        key = (n, heads, str(device))
        if key not in self._masks:
            self._masks.clear()  # one sequence length at a time (they can be large)
            self._masks[key] = [
                branch_block_mask(n, heads, w, r, self.causal, device)
                for w, r in zip(self.segs, self.dils, strict=True)
            ]
        return self._masks[key]

    def __call__(self, q, k, v, scale=None, return_lse=False):
        """(B, N, H, D) in and out, like ra.dilated_attention."""
        n, heads = q.shape[1], q.shape[2]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        outs, lses = [], []
        for bm in self.masks(n, heads, q.device):
            o, lse = self.fn(qt, kt, vt, block_mask=bm, scale=scale, return_lse=True)
            outs.append(o)
            lses.append(lse)
        lse = torch.logsumexp(torch.stack(lses), dim=0)
        safe = torch.where(torch.isneginf(lse), 0.0, lse)
        acc = None
        for o, lb in zip(outs, lses, strict=True):
            term = o.float() * torch.exp(lb - safe)[..., None]
            acc = term if acc is None else acc + term
        out = acc.to(q.dtype).transpose(1, 2)
        return (out, lse) if return_lse else out


def configure_dynamo():
    try:
        import torch._dynamo as dynamo

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))
        if hasattr(dynamo.config, "accumulated_recompile_limit"):
            dynamo.config.accumulated_recompile_limit = max(
                1024, dynamo.config.accumulated_recompile_limit
            )
    except Exception as exc:  # pragma: no cover - best effort
        print(f"note: could not raise dynamo's recompile limit: {exc}")


# --------------------------------------------------------------------------- #
# the calls being measured
# --------------------------------------------------------------------------- #
class Methods:
    def __init__(self, args, device):
        self.args, self.device = args, device
        self.segs, self.dils, self.causal = list(args.segments), list(args.dilations), args.causal
        self.ra = None
        self.ra_error = None
        try:
            import ring_attention as ra

            self.ra = ra
        except Exception as exc:  # the extension may have failed to build
            self.ra_error = f"{type(exc).__name__}: {exc}"
        self._flex = None

    def backends(self, method: str) -> list[str]:
        if method == "gather":
            return list(self.args.sdpa_backends) if self.device.type == "cuda" else ["default"]
        if method == "dense":
            return list(self.args.sdpa_backends) if self.device.type == "cuda" else ["default"]
        return [""]

    @property
    def flex(self) -> FlexDilated:
        if self._flex is None:
            mode = "eager" if (self.args.flex_eager or self.device.type != "cuda") else "compile"
            self._flex = FlexDilated(
                self.segs, self.dils, self.causal, mode, self.args.flex_dynamic
            )
        return self._flex

    def call(self, method: str, backend: str, q, k, v, return_lse=False):
        segs, dils, causal = self.segs, self.dils, self.causal
        if method == "ours":
            if self.ra is None:
                raise RuntimeError(f"ring_attention not importable: {self.ra_error}")
            return self.ra.dilated_attention(
                q, k, v, segs, dils, causal=causal, return_lse=return_lse
            )
        if method == "gather":
            return gather_sdpa_dilated(
                q, k, v, segs, dils, causal=causal, return_lse=return_lse,
                backend=None if backend == "default" else backend,
            )  # fmt: skip
        if method == "flex":
            return self.flex(q, k, v, return_lse=return_lse)
        if method == "dense":
            if backend == "default":
                return dense_sdpa(q, k, v, causal=causal)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            sdp = {
                "flash": SDPBackend.FLASH_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
            }[backend]
            with sdpa_kernel([sdp]):
                return dense_sdpa(q, k, v, causal=causal)
        raise ValueError(f"unknown method {method!r}")
