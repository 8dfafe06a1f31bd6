"""Helpers shared by the operator tests (test_local_op, test_block_ops,
test_opcheck, test_exchange_rows, test_cuda_emulated): configurations, inputs,
calls of the operators and of the float64 oracle, tolerances.

Tolerances (inputs are unit-variance ``randn``; ``out`` is compared absolutely
and relatively, ``atol = rtol``):

==========  ========  =========================  ==========
dtype       out       dq, dk, dv                 lse (fp32)
==========  ========  =========================  ==========
float64     1e-10     1e-10                      1e-10 [1]_
float32     1e-5      1e-4                       1e-5
float16     2e-3      1e-2                       1e-3
bfloat16    2e-2      5e-2                       1e-3
==========  ========  =========================  ==========

.. [1] float64 inputs accumulate in float64 (the accumulators and ``lse`` are
   float64); every other dtype accumulates in float32 and returns a float32
   ``lse`` (docs/design.md section 2).

Block accumulators: float64 for float64 inputs, float32 otherwise (the dtype
``csrc/checks.h:acc_dtype`` requires).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from oracle import multiplicity, reference_attention
from torch.utils._python_dispatch import TorchDispatchMode

import ring_attention as ra
from ring_attention.parallel.testing import run_distributed

OPS = torch.ops.ring_attention
F64 = torch.float64

OUT_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
LSE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}


@dataclass
class Cfg:
    """One test configuration of the operators.

    ``kv_heads``: heads of k and v (``None``: as many as q). ``cu_seqlens``:
    document boundaries ``[0, ..., n]`` (``None``: no documents). ``window``:
    ``(left, right)``, the sliding window (``None``: none).
    """

    batch: int
    n: int
    heads: int
    head_dim: int
    segment_lengths: list[int]
    dilation_rates: list[int]
    causal: bool = False
    head_groups: bool = False
    scale: float | None = None
    mask: bool = False
    kv_heads: int | None = None
    grouped_offsets: bool = False
    cu_seqlens: list[int] | None = None
    window: tuple[int, int] | None = None

    def kwargs(self) -> dict:
        """Keyword arguments of ``ra.dilated_attention``."""
        return {
            "causal": self.causal,
            "scale": self.scale,
            "head_groups": self.head_groups,
            "window": self.window,
        }

    def oracle_kwargs(self) -> dict:
        return {
            **self.kwargs(),
            "grouped_offsets": self.grouped_offsets,
            "cu_seqlens": self.cu_seqlens,
        }

    def resolved_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale

    def resolved_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    def documents(self, device: str | torch.device) -> torch.Tensor | None:
        """cu_seqlens as an int32 tensor on ``device``, or None."""
        if self.cu_seqlens is None:
            return None
        return torch.tensor(self.cu_seqlens, dtype=torch.int32, device=device)

    def pattern(self, kpm: torch.Tensor | None, device: str | torch.device) -> tuple:
        """The pattern arguments of the operators (schema RA_PATTERN_ARGS)."""
        return (
            self.segment_lengths,
            self.dilation_rates,
            self.causal,
            self.resolved_scale(),
            self.head_groups,
            self.grouped_offsets,
            kpm,
            self.documents(device),
            *((-1, -1) if self.window is None else self.window),
        )


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return F64 if dtype == F64 else torch.float32


def make_inputs(
    cfg: Cfg, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q, k, v, grad_out (unit variance) and an optional key_padding_mask."""
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.batch, cfg.n, cfg.heads, cfg.head_dim)
    kv_shape = (cfg.batch, cfg.n, cfg.resolved_kv_heads(), cfg.head_dim)
    q, k, v, go = (
        torch.randn(s, generator=g, dtype=F64) for s in (shape, kv_shape, kv_shape, shape)
    )
    mask = None
    if cfg.mask:
        mask = torch.rand(cfg.batch, cfg.n, generator=g) < 0.25
        if cfg.n >= 8:  # a masked run of keys, possibly a whole segment
            a = int(torch.randint(0, cfg.n - 4, (1,), generator=g))
            mask[-1, a : a + min(cfg.n // 3, 32)] = True
        mask = mask.to(device)
    return (*(x.to(device=device, dtype=dtype) for x in (q, k, v, go)), mask)


def lse_grad(cfg: Cfg, device: str, seed: int) -> torch.Tensor:
    """A unit-variance gradient of lse, (batch, heads, n), float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(cfg.batch, cfg.heads, cfg.n, generator=g).to(device)


def run_op(cfg: Cfg, q, k, v, go, mask):
    """ra.dilated_attention forward + backward: out, lse, dq, dk, dv."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = ra.dilated_attention(
        q,
        k,
        v,
        cfg.segment_lengths,
        cfg.dilation_rates,
        key_padding_mask=mask,
        return_lse=True,
        **cfg.kwargs(),
    )
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    return out, lse, dq, dk, dv


def _grads(outputs, inputs, go, glse):
    """Gradients of (out, lse) with (go, glse); lse not differentiated when glse is None."""
    if glse is None:
        return torch.autograd.grad(outputs[0], inputs, go)
    return torch.autograd.grad(outputs, inputs, (go, glse.to(outputs[1].dtype)))


def run_local(cfg: Cfg, q, k, v, go, mask, glse=None, ops=OPS):
    """The local op (torch.ops.ring_attention.dilated_attention, its C++
    autograd) forward + backward through out (and lse when glse is given):
    out, lse, dq, dk, dv."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = ops.dilated_attention(q, k, v, *cfg.pattern(mask, q.device))
    return (out, lse, *_grads((out, lse), (q, k, v), go, glse))


def run_oracle(cfg: Cfg, q, k, v, go, mask, glse=None):
    """The oracle on the same (upcast) inputs: out, lse, dq, dk, dv in float64
    (out and lse alone when ``go`` is None)."""
    q, k, v = (x.detach().to(F64).requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(
        q,
        k,
        v,
        cfg.segment_lengths,
        cfg.dilation_rates,
        key_padding_mask=mask,
        **cfg.oracle_kwargs(),
    )
    if go is None:
        return out, lse
    return (out, lse, *_grads((out, lse), (q, k, v), go.to(F64), glse))


def close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: float,
    what: str,
    ctx: object,
    rtol: float | None = None,
) -> None:
    """assert_close in float64 on CPU (atol = tol, rtol = tol unless given)."""
    a = actual.detach().to(device="cpu", dtype=F64)
    e = expected.detach().to(device="cpu", dtype=F64)
    torch.testing.assert_close(
        a,
        e,
        rtol=tol if rtol is None else rtol,
        atol=tol,
        msg=lambda m: f"{what} mismatch [{ctx}]\n{m}",
    )


def assert_max_abs(a, b, tol: float = 1e-5, what: str = "") -> None:
    """``a`` and ``b`` (tensors, or both None) have one shape and differ by at
    most ``tol`` anywhere."""
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err}"


def close_grads(got, want, dtype: torch.dtype, ctx: object, prefix: str = "") -> None:
    """(dq, dk, dv) against the oracle's with the dtype's gradient tolerance;
    ``prefix`` goes before each name in a failure."""
    for name, g, r in zip(("dq", "dk", "dv"), got, want, strict=True):
        close(g, r, GRAD_TOL[dtype], prefix + name, ctx)


def check_results(cfg: Cfg, dtype: torch.dtype, got, want, ctx: object) -> None:
    """(out, lse, dq, dk, dv) of an operator against the oracle's, with the
    dtype's tolerances; shapes and dtypes too."""
    out, lse, dq, dk, dv = got
    r_out, r_lse, r_dq, r_dk, r_dv = want
    assert out.dtype == dtype and out.shape == r_out.shape, ctx
    assert lse.shape == (cfg.batch, cfg.heads, cfg.n), ctx
    assert lse.dtype == acc_dtype(dtype), ctx
    for g, r in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert g.dtype == dtype and g.shape == r.shape, ctx
    close(out, r_out, OUT_TOL[dtype], "out", ctx)
    close(lse, r_lse, LSE_TOL[dtype], "lse", ctx)
    close_grads((dq, dk, dv), (r_dq, r_dk, r_dv), dtype, ctx)


def check_against_oracle(cfg: Cfg, dtype: torch.dtype, device: str, seed: int) -> None:
    """ra.dilated_attention against the oracle, forward and backward."""
    q, k, v, go, mask = make_inputs(cfg, dtype, device, seed)
    got = run_op(cfg, q, k, v, go, mask)
    want = run_oracle(cfg, q, k, v, go, mask)
    check_results(cfg, dtype, got, want, f"seed={seed} dtype={dtype} device={device} {cfg}")


def sdpa(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """torch SDPA in the (B, N, H, D) layout."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
    )
    return out.transpose(1, 2)


# ------------------------------------------------------------------ block operators


def splits(n: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    """``parts`` contiguous non-empty ranges covering [0, n)."""
    cuts = sorted(rng.sample(range(1, n), parts - 1))
    edges = [0, *cuts, n]
    return list(itertools.pairwise(edges))


def fresh_acc(q: torch.Tensor, lq: int | None = None):
    """Empty block accumulators (out 0, lse -inf) for lq rows of q."""
    b, n, h, d = q.shape
    lq = n if lq is None else lq
    acc = acc_dtype(q.dtype)
    out = torch.zeros(b, lq, h, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, lq), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def block_forward(cfg: Cfg, q, k, v, out, lse, q_start, k_start, kpm, ops=OPS) -> None:
    ops.block_forward(q, k, v, out, lse, q_start, k_start, *cfg.pattern(kpm, q.device))


def block_backward(
    cfg: Cfg, go, q, k, v, out, lse, dq, dk, dv, q_start, k_start, kpm, ops=OPS, glse=None
) -> None:
    """block_backward; glse (the gradient of lse) is cast to the accumulator dtype."""
    if glse is not None:
        glse = glse.to(acc_dtype(q.dtype))
    ops.block_backward(
        go, glse, q, k, v, out, lse, dq, dk, dv, q_start, k_start, *cfg.pattern(kpm, q.device)
    )


def kslice(kpm, a, b):
    """Columns [a, b) of a key padding mask (or None)."""
    return None if kpm is None else kpm[:, a:b].contiguous()


# Query block, key block and pattern of the "never reads unreached rows" tests:
# queries [qa, qb), keys [ka, kb) with qa >= kb (an earlier rank's keys) or
# overlapping, so only some key rows of the block are reached.
UNREACHED_CASES = [
    # (segment_lengths, dilation_rates, causal, head_groups, (qa, qb), (ka, kb))
    ([16, 32, 64], [2, 4, 8], False, False, (24, 40), (0, 24)),
    ([16, 32, 64], [2, 4, 8], True, False, (24, 40), (8, 30)),
    ([12, 40], [3, 5], True, True, (20, 37), (10, 32)),
    ([64], [4], True, False, (30, 44), (0, 30)),
    ([10, 20], [1, 2], False, False, (0, 15), (15, 45)),
]


def reached_rows(cfg: Cfg, qr: tuple[int, int], kr: tuple[int, int]) -> torch.Tensor:
    """Bool (Lk, kv_heads): key row u (relative to kr) of a K/V head is reached
    by some query of qr of a query head reading it."""
    m = multiplicity(
        cfg.n,
        cfg.heads,
        cfg.segment_lengths,
        cfg.dilation_rates,
        cfg.causal,
        cfg.head_groups,
        cfg.grouped_offsets,
        cfg.cu_seqlens,
        cfg.window,
    )
    per_head = (m[:, qr[0] : qr[1], kr[0] : kr[1]] > 0).any(dim=1)  # (H, Lk)
    group = cfg.heads // cfg.resolved_kv_heads()
    return per_head.view(cfg.resolved_kv_heads(), group, -1).any(dim=1).T


class OpLog(TorchDispatchMode):
    """The ATen operators run while active, in order (short names)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class CountingBackend:
    """A dense backend (``inner``, the CPU stand-in), counting its calls per pass."""

    name = "cpu"

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = {"forward": 0, "backward": 0}

    def forward(self, *args) -> None:
        self.calls["forward"] += 1
        self.inner.forward(*args)

    def backward(self, *args) -> None:
        self.calls["backward"] += 1
        self.inner.backward(*args)


def _run_cases(rank: int, world: int, run_case, cases: dict) -> dict:
    return {name: run_case(rank, world, name, case) for name, case in cases.items()}


class CaseRuns:
    """Every case of ``cases`` run by ``run_case(rank, world, name, case)`` (a module-level
    function) on real gloo ranks, once per world size: ``runs(world)`` is each rank's
    ``{name: result}``; ``@runs.each`` parametrizes a test by ``world`` and case ``name``."""

    def __init__(self, run_case, cases: dict, worlds=(2, 3), timeout: float = 300) -> None:
        self.run_case, self.cases, self.timeout, self.done = run_case, cases, timeout, {}
        self.worlds = list(worlds)

    def each(self, test):
        by_world = pytest.mark.parametrize("world", self.worlds)
        return by_world(pytest.mark.parametrize("name", list(self.cases))(test))

    def __call__(self, world: int) -> list[dict]:
        if world not in self.done:
            self.done[world] = run_distributed(_run_cases, world, self.run_case, self.cases,
                                               timeout=self.timeout)  # fmt: skip
        return self.done[world]

    def of(self, world: int, name: str) -> list:
        """Each rank's result of case ``name``."""
        return [results[name] for results in self(world)]
