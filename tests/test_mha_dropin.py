"""MultiheadDilatedAttention as a drop-in for nn.MultiheadAttention, side by side.

A seeded random sweep of constructor and ``forward`` arguments runs
``nn.MultiheadAttention`` and ``MultiheadDilatedAttention`` (same state dict,
same RNG seed) and compares everything a caller can observe: outputs and
weights (values, dtype, shape, strides, contiguity, nestedness), warnings,
exception types and messages, gradients of the inputs and of every parameter,
and the dropout random stream. Our module runs in three variants:

- ``plain``: no pattern, group or compute_dtype. Everything must be identical
  (bitwise, NaNs included); only the exception class is ours
  (``MultiheadAttentionError``, also a ``ValueError``) where PyTorch raises
  ``AssertionError``.
- ``pattern``: a one-branch pattern longer than any sequence, so dense
  attention through the module's own path (checks, projections, C++ op or
  dense path, output layout): equal up to rounding, same strides, same errors,
  same dropout stream; rows that reach no key give zeros where PyTorch gives
  NaN.
- ``compute_dtype``: no pattern but ``compute_dtype`` set (the own path too,
  cross-attention of any length included).

Then the misuse cases ``nn.MultiheadAttention`` rejects, and whole models
(``nn.TransformerEncoderLayer`` / ``DecoderLayer`` / ``Transformer`` /
``TransformerEncoder`` with nested tensors) with every attention swapped.
"""

from __future__ import annotations

import copy
import itertools
import random
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from ring_attention.nn.multihead import MultiheadAttentionError, MultiheadDilatedAttention

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "pattern": {"segment_lengths": [1 << 20], "dilation_rates": [1]},
    "compute_dtype": {"compute_dtype": torch.float32},
}


def ours_like(ref: nn.MultiheadAttention, **extra) -> MultiheadDilatedAttention:
    """A MultiheadDilatedAttention with ``ref``'s constructor arguments and state."""
    p = ref.out_proj.weight
    m = MultiheadDilatedAttention(
        ref.embed_dim,
        ref.num_heads,
        dropout=ref.dropout,
        bias=ref.in_proj_bias is not None,
        add_bias_kv=ref.bias_k is not None,
        add_zero_attn=ref.add_zero_attn,
        kdim=ref.kdim,
        vdim=ref.vdim,
        batch_first=ref.batch_first,
        device=p.device,
        dtype=p.dtype,
        **extra,
    )
    m.load_state_dict(ref.state_dict())
    return m.train(ref.training)


# ---------------------------------------------------------------------------
# The random sweep.


@dataclass
class Case:
    """One constructor + forward call, drawn from a seed."""

    seed: int
    ctor: dict
    dtype: torch.dtype
    batched: bool
    B: int
    L: int
    S: int
    attention: str  # "self" (q is k is v), "kv" (k is v) or "cross"
    kpm: str | None  # None, "bool", "float"
    attn_mask: str | None  # None, "bool", "float", "bool3", "float3"
    is_causal: bool
    need_weights: bool
    average: bool
    train: bool
    grad: bool
    input_grad: bool
    nested: bool
    empty_rows: bool  # some queries reach no key
    input_dtype: torch.dtype
    mask_dtype: torch.dtype
    notes: list = field(default_factory=list)


def draw_case(seed: int) -> Case:
    rng = random.Random(seed)
    # A third of the cases meet nn.MultiheadAttention's fused-path conditions
    # (but for the odd one with an odd number of heads or no bias).
    fast = rng.random() < 0.35
    heads = rng.choice([2, 4, 2, 4, 3] if fast else [1, 2, 3, 4])
    E = heads * rng.choice([2, 3, 4])
    ctor: dict[str, Any] = {
        "embed_dim": E,
        "num_heads": heads,
        "dropout": rng.choice([0.0, 0.0, 0.3]),
        "bias": rng.random() < (0.9 if fast else 0.8),
        "add_bias_kv": not fast and rng.random() < 0.2,
        "add_zero_attn": not fast and rng.random() < 0.2,
        "batch_first": fast or rng.random() < 0.5,
    }
    if not fast and rng.random() < 0.25:
        ctor["kdim"], ctor["vdim"] = rng.choice([(3, 3), (5, 7), (E, 5)])
    same_dims = ctor.get("kdim", E) == E and ctor.get("vdim", E) == E
    kv_dims = ctor.get("kdim", E) == ctor.get("vdim", E)
    if fast:
        attention = "self"
    else:
        options = (["self"] if same_dims else []) + (["kv"] if kv_dims else []) + ["cross"]
        attention = rng.choice(options)
    L = rng.randint(1, 6)
    S = L if attention == "self" or rng.random() < 0.5 else rng.randint(1, 6)
    is_causal = rng.random() < 0.15
    masks = [None, "bool"] if fast else [None, "bool", "float"]
    kpm = rng.choice(masks)
    if is_causal:
        attn_mask = rng.choice(["bool", "float"])
    else:
        attn_mask = rng.choice(masks + ([] if fast else ["bool3", "float3"]))
    nested = fast and rng.random() < 0.3
    if nested:
        kpm = attn_mask = None
        is_causal = False
    dtype = rng.choice([torch.float32, torch.float64])
    odd_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    grad = not fast and rng.random() < 0.7
    return Case(
        seed=seed,
        ctor=ctor,
        dtype=dtype,
        batched=fast or rng.random() < 0.8,
        B=rng.randint(1, 3),
        L=L,
        S=S,
        attention=attention,
        kpm=kpm,
        attn_mask=attn_mask,
        is_causal=is_causal,
        need_weights=rng.random() < 0.5,
        average=rng.random() < 0.5,
        train=not fast and rng.random() < 0.6,
        grad=grad,
        input_grad=grad and rng.random() < 0.6,
        nested=nested,
        empty_rows=rng.random() < 0.15,
        input_dtype=odd_dtype if rng.random() < 0.04 else dtype,
        mask_dtype=odd_dtype if rng.random() < 0.06 else dtype,
    )


def case_inputs(case: Case) -> tuple[tuple, dict]:
    """Fresh ``(query, key, value)`` and forward kwargs (the same values on
    every call; ``key is query`` etc. as the case says)."""
    g = torch.Generator().manual_seed(case.seed)
    E = case.ctor["embed_dim"]
    kd, vd = case.ctor.get("kdim", E), case.ctor.get("vdim", E)
    B, L, S = case.B, case.L, case.S
    bf = case.ctor["batch_first"]

    def seq(n: int, e: int) -> torch.Tensor:
        shape = ((B, n, e) if bf else (n, B, e)) if case.batched else (n, e)
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(case.input_dtype)
        return x.requires_grad_(case.input_grad)

    q = seq(L, E)
    if case.attention == "self":
        k = v = q
    elif case.attention == "kv":
        k = v = seq(S, kd)
    else:
        k, v = seq(S, kd), seq(S, vd)

    if case.nested:
        lengths = torch.randint(1, L + 1, (B,), generator=g)
        lengths[0] = L
        keep = torch.arange(L)[None, :] < lengths[:, None]
        q = k = v = torch._nested_tensor_from_mask(q, keep, mask_check=False)

    kw: dict[str, Any] = {"need_weights": case.need_weights, "average_attn_weights": case.average}
    kpm_shape = (B, S) if case.batched else (S,)
    if case.kpm is not None:
        drop = torch.rand(kpm_shape, generator=g) < 0.3
        drop[..., 0] = False  # every query keeps a key, except for empty_rows
        if case.empty_rows:
            drop[0] = True  # every key of the first batch row (unbatched: the first key)
        kw["key_padding_mask"] = (
            drop if case.kpm == "bool" else torch.zeros(kpm_shape).masked_fill(drop, -torch.inf)
        )
        if case.kpm == "float":
            kw["key_padding_mask"] += torch.rand(kpm_shape, generator=g)
    heads = case.ctor["num_heads"]
    if case.attn_mask is not None:
        shape = (L, S) if not case.attn_mask.endswith("3") else (B * heads, L, S)
        if not case.batched and case.attn_mask.endswith("3"):
            shape = (heads, L, S)
        if case.is_causal:
            drop = torch.ones(L, S, dtype=torch.bool).triu(1)
        else:
            drop = torch.rand(shape, generator=g) < 0.25
            drop[..., 0] = False
            if case.empty_rows:
                drop[..., 0, :] = True
        if case.attn_mask.startswith("bool"):
            kw["attn_mask"] = drop
        else:
            noise = torch.randn(drop.shape, generator=g)
            kw["attn_mask"] = noise.masked_fill(drop, -torch.inf)
    for name in ("key_padding_mask", "attn_mask"):
        m = kw.get(name)
        if m is not None and m.is_floating_point():
            kw[name] = m.to(case.mask_dtype)
    if case.is_causal:
        kw["is_causal"] = True
    return (q, k, v), kw


@dataclass
class Result:
    out: Any = None
    weights: Any = None
    grads: list | None = None
    error: BaseException | None = None
    warnings: list = field(default_factory=list)


def run(module: nn.Module, case: Case) -> Result:
    """One forward (and backward when there is a graph) with the case's seed."""
    (q, k, v), kw = case_inputs(case)
    res = Result()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(case.seed)
        with torch.set_grad_enabled(case.grad):
            try:
                res.out, res.weights = module(q, k, v, **kw)
            except Exception as e:  # compared with the other module's
                res.error = e
    res.warnings = [str(w.message) for w in caught if "prototype stage" not in str(w.message)]
    if res.error is not None or not (case.grad and res.out.requires_grad):
        return res
    g = torch.Generator().manual_seed(case.seed + 1)
    loss = (res.out * torch.randn(res.out.shape, generator=g, dtype=res.out.dtype)).sum()
    if res.weights is not None:
        w = res.weights
        loss = loss + (w * torch.randn(w.shape, generator=g, dtype=w.dtype)).nan_to_num().sum()
    wrt = [t for t in {id(t): t for t in (q, k, v)}.values() if t.requires_grad]
    wrt += list(module.parameters())
    res.grads = list(torch.autograd.grad(loss, wrt, allow_unused=True))
    return res


def check_error(theirs: BaseException, ours: BaseException, exact: bool) -> None:
    if type(theirs) is AssertionError:
        assert isinstance(ours, MultiheadAttentionError), (type(ours), ours)
        assert isinstance(ours, ValueError)
    else:
        assert isinstance(ours, type(theirs)), (type(theirs), theirs, type(ours), ours)
    if exact:
        assert str(ours) == str(theirs)
    else:
        assert str(ours).startswith(str(theirs)), (str(theirs), str(ours))


def layout(t: torch.Tensor | None):
    if t is None:
        return None
    if t.is_nested:
        return ("nested", t.dtype, [tuple(x.shape) for x in t.unbind()])
    return (t.dtype, tuple(t.shape), t.stride(), t.is_contiguous())


def assert_values(theirs, ours, tol: float, what: str) -> None:
    """Equal values (``tol=0``: bitwise, NaNs included). Otherwise, where
    PyTorch gives NaN (a head whose query reaches no key) ours is finite:
    that head contributes zeros (tests/test_multihead.py checks the values)."""
    if theirs is None:
        assert ours is None, what
        return
    if theirs.is_nested:
        theirs, ours = theirs.to_padded_tensor(0.0), ours.to_padded_tensor(0.0)
    if tol == 0:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True, msg=what)
        return
    nan = theirs.isnan()
    assert ours[nan].isfinite().all(), what + ": not finite where PyTorch gives NaN"
    torch.testing.assert_close(ours[~nan], theirs[~nan], rtol=tol, atol=tol, msg=what)


def compare(case: Case, variant: str) -> None:
    torch.manual_seed(case.seed)
    ref = nn.MultiheadAttention(**case.ctor, dtype=case.dtype).train(case.train)
    mine = ours_like(ref, **VARIANTS[variant])
    theirs, ours = run(ref, case), run(mine, case)
    exact = variant == "plain"
    if theirs.error is not None:
        assert ours.error is not None, f"nn.MultiheadAttention raised {theirs.error!r}"
        check_error(theirs.error, ours.error, exact)
        return
    if variant == "pattern" and case.L != case.S:
        assert isinstance(ours.error, ValueError) and "same sequence length" in str(ours.error)
        return
    if ours.error is not None:
        raise ours.error
    assert ours.warnings == theirs.warnings
    assert layout(ours.out) == layout(theirs.out), "output layout"
    assert layout(ours.weights) == layout(theirs.weights), "weights layout"
    if exact:
        tol = 0.0
    elif case.dtype == torch.float64 and variant != "compute_dtype":  # that computes in float32
        tol = 1e-10
    else:
        tol = 2e-5
    assert_values(theirs.out, ours.out, tol, "output")
    assert_values(theirs.weights, ours.weights, tol, "weights")
    if theirs.grads is None:
        assert ours.grads is None
        return
    if theirs.out.isnan().any():
        return  # NaN gradients from PyTorch's empty rows (ours are finite)
    assert len(ours.grads) == len(theirs.grads)
    for i, (a, b) in enumerate(zip(theirs.grads, ours.grads, strict=True)):
        assert_values(a, b, tol, f"gradient {i}")


SWEEP = range(300)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("block", range(6))
def test_random_calls_match_nn_mha(variant: str, block: int) -> None:
    """300 random calls per variant (in 6 blocks of 50)."""
    for seed in SWEEP[block::6]:
        case = draw_case(seed)
        try:
            compare(case, variant)
        except BaseException as e:
            raise AssertionError(f"seed {seed}: {case}") from e


def test_the_sweep_covers_the_arguments() -> None:
    """The sweep draws every kind of argument often enough (so that the
    comparisons above see them)."""
    cases = [draw_case(s) for s in SWEEP]

    def count(pred) -> int:
        return sum(1 for c in cases if pred(c))

    fast = count(lambda c: not c.train and not c.grad and c.ctor["batch_first"] and c.batched
                 and c.attention == "self")  # fmt: skip
    assert fast >= 60
    assert count(lambda c: c.nested) >= 15
    for kind in ("bool", "float"):
        assert count(lambda c, k=kind: c.kpm == k) >= 30
        assert count(lambda c, k=kind: c.attn_mask == k) >= 30
        assert count(lambda c, k=kind: c.attn_mask == k + "3") >= 15
    assert count(lambda c: c.kpm and c.attn_mask) >= 30
    assert count(lambda c: c.is_causal) >= 20
    assert count(lambda c: not c.batched) >= 30
    assert count(lambda c: "kdim" in c.ctor) >= 30
    assert count(lambda c: c.ctor["add_bias_kv"]) >= 20
    assert count(lambda c: c.ctor["add_zero_attn"]) >= 20
    assert count(lambda c: not c.ctor["bias"]) >= 20
    assert count(lambda c: c.ctor["dropout"] > 0 and c.train) >= 40
    assert count(lambda c: c.input_grad) >= 50
    assert count(lambda c: c.empty_rows and (c.kpm or c.attn_mask)) >= 15
    assert count(lambda c: c.input_dtype != c.dtype) >= 5
    assert count(lambda c: c.attention == "cross" and c.L != c.S) >= 30


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_is_causal_hint_reads_the_mask_where_nn_mha_does(variant) -> None:
    """is_causal is a hint: with no key_padding_mask and need_weights=False
    nn.MultiheadAttention runs causal attention without reading attn_mask,
    otherwise it applies the mask. A mask that is not causal shows which."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, batch_first=True)
    mine = ours_like(ref, **VARIANTS[variant])
    B, L = 2, 8
    x = torch.randn(B, L, 16)
    junk = torch.randn(L, L)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 5:] = True
    outs = {}
    for kp, nw in itertools.product([None, kpm], [False, True]):
        o1, w1 = ref(x, x, x, attn_mask=junk, key_padding_mask=kp, need_weights=nw, is_causal=True)
        o2, w2 = mine(x, x, x, attn_mask=junk, key_padding_mask=kp, need_weights=nw, is_causal=True)
        torch.testing.assert_close(o2, o1)
        if nw:
            torch.testing.assert_close(w2, w1)
        outs[kp is None, nw] = o2
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    torch.testing.assert_close(outs[True, False], ref(x, x, x, attn_mask=causal)[0])
    assert (outs[True, True] - outs[True, False]).abs().max() > 1e-3


# ---------------------------------------------------------------------------
# Misuse: what nn.MultiheadAttention rejects, ours rejects alike.

E, H = 8, 2


def _misuse_cases() -> list[tuple[str, dict, Any]]:
    """(name, constructor kwargs, call(module) -> None)."""
    x = torch.randn(5, 2, E)
    u = torch.randn(5, E)
    m5 = torch.zeros(5, 5)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    return [
        ("query 1-D", {}, lambda m: m(torch.randn(E), torch.randn(E), torch.randn(E))),
        ("query 4-D", {}, lambda m: m(x[None], x[None], x[None])),
        ("batched query, 2-D key", {}, lambda m: m(x, u, x)),
        ("batched query, 2-D value", {}, lambda m: m(x, x, u)),
        ("unbatched query, 3-D key", {}, lambda m: m(u, x, u)),
        ("key_padding_mask 1-D for batched", {}, lambda m: m(x, x, x, key_padding_mask=kpm[0])),
        ("key_padding_mask 2-D for unbatched", {}, lambda m: m(u, u, u, key_padding_mask=kpm)),
        ("attn_mask 1-D", {}, lambda m: m(x, x, x, attn_mask=m5[0])),
        ("attn_mask 4-D", {}, lambda m: m(x, x, x, attn_mask=m5[None, None])),
        ("unbatched attn_mask 1-D", {}, lambda m: m(u, u, u, attn_mask=m5[0])),
        ("unbatched 3-D attn_mask shape", {}, lambda m: m(u, u, u, attn_mask=torch.zeros(3, 5, 5))),
        ("query embedding", {}, lambda m: m(torch.randn(5, 2, E + 1), x, x)),
        ("key vs value shape", {}, lambda m: m(x, x, torch.randn(6, 2, E))),
        (
            "key vs value shape, kdim",
            {"kdim": 4, "vdim": 4},
            lambda m: m(x, torch.randn(5, 2, 4), torch.randn(6, 2, 4)),
        ),
        ("key features", {}, lambda m: m(x, torch.randn(5, 2, E + 2), torch.randn(5, 2, E + 2))),
        (
            "key features, kdim",
            {"kdim": 4, "vdim": 4},
            lambda m: m(x, torch.randn(5, 2, 3), torch.randn(5, 2, 4)),
        ),
        (
            "value features, vdim",
            {"kdim": 4, "vdim": 6},
            lambda m: m(x, torch.randn(5, 2, 4), torch.randn(5, 2, 4)),
        ),
        ("key_padding_mask dtype", {}, lambda m: m(x, x, x, key_padding_mask=kpm.long())),
        ("attn_mask dtype", {}, lambda m: m(x, x, x, attn_mask=m5.int())),
        ("attn_mask 2-D shape", {}, lambda m: m(x, x, x, attn_mask=torch.zeros(5, 4))),
        ("attn_mask 3-D shape", {}, lambda m: m(x, x, x, attn_mask=torch.zeros(3, 5, 5))),
        ("key_padding_mask length", {}, lambda m: m(x, x, x, key_padding_mask=kpm[:, :4])),
        ("key_padding_mask batch", {}, lambda m: m(x, x, x, key_padding_mask=kpm[:1])),
        (
            "key_padding_mask length, bias_kv",
            {"add_bias_kv": True, "add_zero_attn": True},
            lambda m: m(x, x, x, key_padding_mask=kpm[:, :4]),
        ),
        ("is_causal without attn_mask", {}, lambda m: m(x, x, x, is_causal=True)),
        (
            "is_causal with key_padding_mask, no attn_mask",
            {},
            lambda m: m(x, x, x, key_padding_mask=kpm, is_causal=True),
        ),
        ("input dtype", {}, lambda m: m(x.double(), x.double(), x.double())),
        ("attn_mask not a tensor", {}, lambda m: m(x, x, x, attn_mask=[[0.0]])),
        ("batch_first query 4-D", {"batch_first": True}, lambda m: m(x[None], x[None], x[None])),
        ("batch_first key 2-D", {"batch_first": True}, lambda m: m(x, u, u)),
        (
            "causal mask with weights, 2-D shape",
            {},
            lambda m: m(x, x, x, attn_mask=causal[:4], is_causal=True),
        ),
    ]


MISUSE = _misuse_cases()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", ["train", "eval_no_grad"])
@pytest.mark.parametrize("name,ctor,call", MISUSE, ids=[c[0] for c in MISUSE])
def test_misuse_raises_like_nn_mha(name, ctor, call, mode, variant) -> None:
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, **ctor).train(mode == "train")
    mine = ours_like(ref, **VARIANTS[variant])
    errors = []
    for m in (ref, mine):
        with torch.set_grad_enabled(mode == "train"), pytest.raises(Exception) as info:
            call(m)
        errors.append(info.value)
    theirs, ours = errors
    check_error(theirs, ours, exact=variant == "plain")


def _fused_misuse_cases() -> list[tuple[str, Any]]:
    """Bad self-attention calls under the conditions of nn.MultiheadAttention's
    fused inference kernel (batch_first, eval, no grad)."""
    x = torch.randn(2, 5, E)
    y = torch.randn(2, 5, E + 1)
    return [
        ("query embedding", lambda m: m(y, y, y)),
        ("key_padding_mask length", lambda m: m(x, x, x, key_padding_mask=torch.zeros(2, 4) > 0)),
        ("key_padding_mask 1-D", lambda m: m(x, x, x, key_padding_mask=torch.zeros(5) > 0)),
        ("attn_mask 2-D shape", lambda m: m(x, x, x, attn_mask=torch.zeros(5, 4) > 0)),
        ("attn_mask 3-D shape", lambda m: m(x, x, x, attn_mask=torch.zeros(3, 5, 5) > 0)),
        ("attn_mask 4-D", lambda m: m(x, x, x, attn_mask=torch.zeros(1, 1, 5, 5) > 0)),
    ]


FUSED_MISUSE = _fused_misuse_cases()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name,call", FUSED_MISUSE, ids=[c[0] for c in FUSED_MISUSE])
def test_misuse_on_the_fused_path(name, call, variant) -> None:
    """The fused kernel checks shapes in C++ with its own words (and takes a
    4-D attn_mask). A plain module runs it too: the same outcome. The own path
    never runs it: it raises what nn.MultiheadAttention raises on its other
    path (torch.backends.mha fast path disabled)."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True).eval()
    mine = ours_like(ref, **VARIANTS[variant])
    fastpath = variant == "plain"
    outcomes = []
    for m, enabled in ((ref, fastpath), (mine, True)):
        torch.backends.mha.set_fastpath_enabled(enabled)
        try:
            with torch.no_grad():
                call(m)
            outcomes.append(None)
        except Exception as e:  # compared below
            outcomes.append(e)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    theirs, ours = outcomes
    if theirs is None:
        assert ours is None and name == "attn_mask 4-D", ours
    else:
        check_error(theirs, ours, exact=True)


def test_batch_mismatch_raises_runtime_error() -> None:
    """Query and key of different batch sizes: PyTorch fails in a reshape
    (RuntimeError); the own path raises RuntimeError naming the sizes."""
    x, y = torch.randn(5, 2, E), torch.randn(5, 3, E)
    for variant in VARIANTS:
        torch.manual_seed(0)
        m = ours_like(nn.MultiheadAttention(E, H), **VARIANTS[variant])
        with pytest.raises(RuntimeError):
            m(x, y, y)
    with pytest.raises(RuntimeError, match="batch size of query"):
        m(x, y, y)


CTOR_MISUSE = [
    {"embed_dim": 0, "num_heads": 2},
    {"embed_dim": 8, "num_heads": 0},
    {"embed_dim": -8, "num_heads": 2},
    {"embed_dim": 10, "num_heads": 4},
    {"embed_dim": 9, "num_heads": 2, "kdim": 4},
]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kw", CTOR_MISUSE)
def test_constructor_misuse_raises_like_nn_mha(kw, variant) -> None:
    with pytest.raises(Exception) as theirs:
        nn.MultiheadAttention(**kw)
    with pytest.raises(Exception) as ours:
        MultiheadDilatedAttention(**kw, **VARIANTS[variant])
    check_error(theirs.value, ours.value, exact=True)


def test_constructor_accepts_what_nn_mha_accepts() -> None:
    """nn.MultiheadAttention takes any dropout at construction (F.dropout
    checks it when used); so does ours."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, dropout=1.5)
    mine = ours_like(ref)
    x = torch.randn(5, 2, E)
    with pytest.raises(ValueError) as theirs:
        ref(x, x, x)
    with pytest.raises(ValueError) as ours:
        mine(x, x, x)
    assert str(ours.value) == str(theirs.value)


# ---------------------------------------------------------------------------
# Whole models with every nn.MultiheadAttention swapped.


def swapped(model: nn.Module, **extra) -> nn.Module:
    """A deep copy of ``model`` whose nn.MultiheadAttention modules are
    MultiheadDilatedAttention modules with the same arguments and state."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.MultiheadAttention:
                setattr(parent, name, ours_like(child, **extra))
    assert any(isinstance(m, MultiheadDilatedAttention) for m in model.modules())
    return model


def run_model(model: nn.Module, args: tuple, kwargs: dict, *, train: bool, grad: bool, seed: int):
    model.train(train)
    args = tuple(a.detach().requires_grad_(grad) if a.is_floating_point() else a for a in args)
    torch.manual_seed(seed)
    with torch.set_grad_enabled(grad):
        out = model(*args, **kwargs)
    grads = None
    if grad:
        w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad((out * w).sum(), [args[0], *params])
    return out, grads


def assert_models_match(ref: nn.Module, args, kwargs, *, train, grad, exact=True, **extra):
    mine = swapped(ref, **extra)
    for seed in (0, 1):
        o1, g1 = run_model(ref, args, kwargs, train=train, grad=grad, seed=seed)
        o2, g2 = run_model(mine, args, kwargs, train=train, grad=grad, seed=seed)
        assert layout(o2) == layout(o1)
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}
        if o1.is_nested:
            o1, o2 = o1.to_padded_tensor(0.0), o2.to_padded_tensor(0.0)
        torch.testing.assert_close(o2, o1, **tol)
        if grad:
            for a, b in zip(g1, g2, strict=True):
                torch.testing.assert_close(b, a, **tol)


MODES = [  # (train, grad): dropout in training; eval with autograd; inference (fused paths)
    (True, True),
    (False, True),
    (False, False),
]
MODEL_VARIANTS = [("plain", True), ("pattern", False), ("compute_dtype", False)]


def _masks(B: int, n: int):
    kpm = torch.zeros(B, n, dtype=torch.bool)
    kpm[0, n - 3 :] = True  # left-aligned padding, as nested tensors need it
    return kpm, nn.Transformer.generate_square_subsequent_mask(n)


@pytest.mark.parametrize("variant,exact", MODEL_VARIANTS)
@pytest.mark.parametrize("train,grad", MODES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_swap(variant, exact, train, grad, batch_first, norm_first) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        16, 4, dim_feedforward=32, dropout=0.1, batch_first=batch_first, norm_first=norm_first
    )
    B, n = 3, 9
    x = torch.randn((B, n, 16) if batch_first else (n, B, 16))
    kpm, causal = _masks(B, n)
    for kwargs in ({}, {"src_key_padding_mask": kpm}, {"src_mask": causal, "is_causal": True}):
        assert_models_match(layer, (x,), kwargs, train=train, grad=grad, exact=exact,
                            **VARIANTS[variant])  # fmt: skip


@pytest.mark.parametrize("variant,exact", MODEL_VARIANTS)
@pytest.mark.parametrize("train,grad", MODES)
def test_decoder_layer_swap(variant, exact, train, grad) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(16, 4, dim_feedforward=32, dropout=0.1, batch_first=True)
    B, n = 2, 7
    m = n if variant == "pattern" else 5  # a pattern needs len(query) == len(key)
    tgt, memory = torch.randn(B, n, 16), torch.randn(B, m, 16)
    kpm, _ = _masks(B, m)
    kwargs = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(n), "tgt_is_causal": True,
              "memory_key_padding_mask": kpm}  # fmt: skip
    assert_models_match(layer, (tgt, memory), kwargs, train=train, grad=grad, exact=exact,
                        **VARIANTS[variant])  # fmt: skip


@pytest.mark.parametrize("variant,exact", MODEL_VARIANTS)
@pytest.mark.parametrize("train,grad", MODES)
def test_transformer_swap(variant, exact, train, grad) -> None:
    torch.manual_seed(0)
    model = nn.Transformer(16, 4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32,
                           dropout=0.1, batch_first=True)  # fmt: skip
    B, n = 2, 8
    src, tgt = torch.randn(B, n, 16), torch.randn(B, n, 16)
    kpm, causal = _masks(B, n)
    kwargs = {"tgt_mask": causal, "tgt_is_causal": True, "src_key_padding_mask": kpm,
              "memory_key_padding_mask": kpm}  # fmt: skip
    assert_models_match(model, (src, tgt), kwargs, train=train, grad=grad, exact=exact,
                        **VARIANTS[variant])  # fmt: skip


@pytest.mark.parametrize("variant,exact", MODEL_VARIANTS)
@pytest.mark.parametrize("train,grad", MODES)
def test_encoder_with_nested_tensors_swap(variant, exact, train, grad) -> None:
    """nn.TransformerEncoder (enable_nested_tensor=True, the default) turns
    padded input into a nested tensor in inference; the swapped model gives
    the same output (exactly when plain)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.1, batch_first=True)
    enc = nn.TransformerEncoder(layer, num_layers=2)
    assert enc.use_nested_tensor
    B, n = 3, 10
    x = torch.randn(B, n, 16)
    kpm = torch.zeros(B, n, dtype=torch.bool)
    kpm[0, 6:] = True
    kpm[2, 3:] = True
    assert_models_match(enc, (x,), {"src_key_padding_mask": kpm}, train=train, grad=grad,
                        exact=exact, **VARIANTS[variant])  # fmt: skip


def test_nested_tensors_reach_the_pattern_path() -> None:
    """The nested tensor nn.TransformerEncoder makes in inference goes
    through a patterned module's own path (not PyTorch's dense fused kernel)
    and comes back nested, each sequence attended on its own."""
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(16, 4, batch_first=True, segment_lengths=[4], dilation_rates=[2])
    m.eval()
    lengths = [7, 3, 5]
    seqs = [torch.randn(n, 16) for n in lengths]
    nested = torch.nested.nested_tensor(seqs)
    with torch.no_grad():
        out, w = m(nested, nested, nested, need_weights=True, average_attn_weights=False)
        assert out.is_nested
        for i, s in enumerate(seqs):
            alone, w_alone = m(s[None], s[None], s[None], average_attn_weights=False)
            torch.testing.assert_close(out.unbind()[i], alone[0])
            n = lengths[i]
            torch.testing.assert_close(w[i, :, :n, :n], w_alone[0])
            assert (w[i, :, n:] == 0).all() and (w[i, :, :, n:] == 0).all()
        m.train()
        with pytest.raises(AssertionError, match="does not support NestedTensor outside"):
            m(nested, nested, nested)


def test_encoder_layer_dropout_after_attention_matches() -> None:
    """The output layout decides which elements a seeded dropout drops: in
    training, a TransformerEncoderLayer with a patterned attention equals the
    nn.MultiheadAttention one (the pattern covers every key)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.1)
    x = torch.randn(12, 2, 16)
    mine = swapped(layer, **VARIANTS["pattern"])
    o1, _ = run_model(layer, (x,), {}, train=True, grad=False, seed=3)
    o2, _ = run_model(mine, (x,), {}, train=True, grad=False, seed=3)
    torch.testing.assert_close(o2, o1)
    o3, _ = run_model(mine, (x,), {}, train=True, grad=False, seed=4)
    assert (o3 - o1).abs().max() > 0.1  # the seed matters: dropout is on


# ---------------------------------------------------------------------------
# The fused paths, compile and the README.


def test_plain_module_takes_the_fused_inference_path(monkeypatch) -> None:
    """In inference a plain module runs torch._native_multi_head_attention,
    as nn.MultiheadAttention; a patterned one never does."""
    calls = []
    real = torch._native_multi_head_attention

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(torch, "_native_multi_head_attention", spy)
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 6, 16)
    for variant in VARIANTS:
        calls.clear()
        with torch.no_grad():
            ours_like(ref, **VARIANTS[variant])(x, x, x)
        assert len(calls) == (1 if variant == "plain" else 0), variant


def test_fused_encoder_layer_path_only_when_plain() -> None:
    """nn.TransformerEncoderLayer's fused kernel runs with a plain module (no
    hooks), never with a pattern, group or compute_dtype (the no-op pre-hook)."""
    torch.manual_seed(0)
    for variant in VARIANTS:
        m = MultiheadDilatedAttention(16, 4, **VARIANTS[variant])
        assert bool(m._forward_pre_hooks) == (variant != "plain")


def test_isinstance_and_state_dict() -> None:
    torch.manual_seed(3)
    ref = nn.MultiheadAttention(16, 4, kdim=8, vdim=12, add_bias_kv=True)
    torch.manual_seed(3)
    mine = MultiheadDilatedAttention(16, 4, kdim=8, vdim=12, add_bias_kv=True,
                                     **VARIANTS["pattern"])  # fmt: skip
    assert isinstance(mine, nn.MultiheadAttention)
    a, b = ref.state_dict(), mine.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_plain_module_scripts_as_nn_mha(tmp_path: Path) -> None:
    """torch.jit.script of a plain module (no pattern, group or compute_dtype)
    gives nn.MultiheadAttention's scripted module on the same parameters:
    its results, saved and loaded too; also inside a scripted encoder layer.
    With a pattern it raises saying why."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, kdim=8, vdim=12, batch_first=True)
    mine = ours_like(ref)
    scripted = torch.jit.script(mine)
    x, kv = torch.randn(2, 7, 16), torch.randn(2, 5, 8)
    v = torch.randn(2, 5, 12)
    for got in (scripted, torch.jit.load(_saved(scripted, tmp_path / "m.pt"))):
        for a, b in zip(got(x, kv, v), ref(x, kv, v), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        mine.out_proj.weight.mul_(2)  # the scripted module shares the parameters
    torch.testing.assert_close(scripted(x, kv, v)[0], mine(x, kv, v)[0], rtol=0, atol=0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True).eval()
    want = layer(x)
    layer.self_attn = ours_like(layer.self_attn)
    torch.testing.assert_close(torch.jit.script(layer)(x), want, rtol=0, atol=0)
    for extra in VARIANTS.values():
        if extra:
            with pytest.raises(RuntimeError, match="cannot be scripted"):
                torch.jit.script(ours_like(ref, **extra))


def _saved(module, path: Path) -> str:
    torch.jit.save(module, str(path))
    return str(path)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch_first", [True, False])
def test_compiles_and_exports_like_eager(variant, batch_first) -> None:
    """torch.compile (fullgraph, with AOT autograd) and torch.export give the
    eager results, forward and backward, layouts included."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, batch_first=batch_first)
    mine = ours_like(ref, **VARIANTS[variant])
    x = torch.randn((2, 7, 16) if batch_first else (7, 2, 16))
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    compiled = torch.compile(mine, backend="aot_eager", fullgraph=True)
    for need_weights in (False, True):
        results = []
        for m in (ref, mine, compiled):
            xg = x.clone().requires_grad_(True)
            out, w = m(xg, xg, xg, key_padding_mask=kpm, need_weights=need_weights)
            (gx,) = torch.autograd.grad(out.square().sum(), xg)
            results.append((out, w, gx))
        for out, w, gx in results[1:]:
            assert out.stride() == results[0][0].stride()
            torch.testing.assert_close(out, results[0][0])
            torch.testing.assert_close(w, results[0][1])
            torch.testing.assert_close(gx, results[0][2])
    ep = torch.export.export(mine.eval(), (x, x, x), kwargs={"key_padding_mask": kpm})
    want = ref.eval()(x, x, x, key_padding_mask=kpm)[0]
    torch.testing.assert_close(ep.module()(x, x, x, key_padding_mask=kpm)[0], want)
    torch._dynamo.reset()


def test_readme_dropin_example_runs() -> None:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split("## Drop-in for nn.MultiheadAttention", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the README's drop-in section has no example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
