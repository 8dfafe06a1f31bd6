"""Argument fuzz of every public entry and every ``torch.ops.ring_attention``
operator (docs/design.md §6): bad, extreme and odd arguments must be
answered, never crash the process or hang, and an error must name the
argument it is about.

Each case starts from a valid call and replaces one argument with one value
of a pool chosen by the argument's kind: integers near 2**31, 2**53, 2**61,
2**63 and beyond, NaN and infinite floats, wrong types, non-bool flags,
tensors of other dtypes, ranks, devices and empty or huge (but empty)
shapes, malformed sequences. A case passes when the call returns (what it
returns is checked elsewhere) or raises ``ValueError``/``RuntimeError`` whose
message names the argument (``MultiheadDilatedAttention.forward``: or raises
exactly what ``nn.MultiheadAttention`` raises for the same call, its drop-in
contract). It fails on a crash, on a hang (``CASE_TIMEOUT``), on another
exception type, or on a message that does not name the argument.

The operators' arguments come from their registered schemas
(``torch.ops.ring_attention.<op>.default._schema``), so arguments appended
to a schema are fuzzed too: a defaulted one starts at its default (a None
default is fuzzed by its schema type), one without a default needs a
baseline in ``_op_base()`` (the test says which). Public names neither
fuzzed nor listed in ``NOT_FUZZED`` with a reason fail
``test_every_public_entry_is_fuzzed_or_said_why_not``.

The cases run in worker subprocesses (one import of torch for many cases)
under an address-space limit; the parent reads each case's start and end
and, when a worker dies or a case overruns, records that case and starts a
new worker after it. About 3000 cases; ``RA_FUZZ_CASES=N`` runs the first N
only. ``python tests/test_fuzz_arguments.py`` prints the failures.
"""

from __future__ import annotations

import functools
import os
import re
import select
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from child_env import with_path

from ring_attention.parallel.testing import run_distributed

CASE_TIMEOUT = 30.0  # seconds one case may take (the machine is shared)
TOTAL_TIMEOUT = 900.0
MEMORY_HEADROOM = 3 * 2**30  # bytes a worker may allocate beyond its start

NAN, INF = float("nan"), float("inf")
# (label, value) pools by kind
INTS = [
    ("0", 0), ("-1", -1), ("2**31-1", 2**31 - 1), ("2**31", 2**31), ("2**53+1", 2**53 + 1),
    ("2**61-1", 2**61 - 1), ("2**61", 2**61), ("2**62", 2**62), ("2**63-1", 2**63 - 1),
    ("2**63", 2**63), ("-2**63", -(2**63)), ("10**30", 10**30), ("True", True), ("1.5", 1.5),
    ("nan", NAN), ("'x'", "x"), ("None", None),
]  # fmt: skip
FLOATS = [
    ("nan", NAN), ("inf", INF), ("-inf", -INF), ("0.0", 0.0), ("-1.0", -1.0),
    ("1e-320", 1e-320), ("1e308", 1e308), ("2**63", 2**63), ("10**400", 10**400), ("True", True),
    ("'x'", "x"),
    ("None", None),
]  # fmt: skip
FLAGS = [("'no'", "no"), ("0", 0), ("1", 1), ("None", None), ("nan", NAN), ("[True]", [True])]
STRS = [("''", ""), ("'x'", "x"), ("0", 0), ("None", None), ("b'x'", b"x")]
SEQS = [
    ("[]", []), ("[0]", [0]), ("[-1]", [-1]), ("[2**31]", [2**31]), ("[2**53+1]", [2**53 + 1]),
    ("[2**61]", [2**61]), ("[2**62]", [2**62]), ("[2**63-1]", [2**63 - 1]),
    ("[2**63]", [2**63]), ("[1.5]", [1.5]), ("[nan]", [NAN]), ("[[4]]", [[4]]), ("'x'", "x"),
    ("None", None), ("[True]", [True]), ("[4, 4, 4]", [4, 4, 4]),
]  # fmt: skip
GROUPS = [("'x'", "x"), ("0", 0), ("object()", object())]


def _windows() -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """``window`` values: (accepted, refused). A window is a tuple or list of
    two integers >= -1 (Python/NumPy integers or 0-d integer tensors); a set
    (``{255, 0}`` iterates as 0, 255), a dict, a string, a tensor or an array
    holds no order of its own and is refused."""
    import numpy as np
    import torch

    good = [
        ("(3, 0)", (3, 0)), ("[3, 0]", [3, 0]), ("(-1, -1)", (-1, -1)), ("(0, 2)", (0, 2)),
        ("(np.int64(3), 0)", (np.int64(3), 0)), ("(tensor(3), tensor(0))",
                                                 (torch.tensor(3), torch.tensor(0))),
    ]  # fmt: skip
    bad = [
        ("{255, 0}", {255, 0}), ("{3: 0, 0: 3}", {3: 0, 0: 3}), ("'ab'", "ab"), ("b'ab'", b"ab"),
        ("(3,)", (3,)), ("(3, 0, 0)", (3, 0, 0)), ("()", ()), ("3", 3), ("(-2, 0)", (-2, 0)),
        ("(0, -5)", (0, -5)), ("(3.0, 0)", (3.0, 0)), ("(True, 0)", (True, 0)),
        ("(2**63, 0)", (2**63, 0)), ("(nan, 0)", (NAN, 0)), ("(None, 0)", (None, 0)),
        ("tensor([3, 0])", torch.tensor([3, 0])), ("array([3, 0])", np.array([3, 0])),
        ("range(3, 5)", range(3, 5)), ("frozenset({0, 3})", frozenset({0, 3})),
        ("((3, 0), (3, 0))", ((3, 0), (3, 0))), ("(tensor([3]), 0)", (torch.tensor([3]), 0)),
    ]  # fmt: skip
    return good, bad


@functools.cache
def _named_pools() -> dict[str, tuple[list[tuple[str, Any]], set[str]]]:
    """Parameters whose pool is their own (not their baseline's kind), and the
    labels of their pool that must be refused: a call that returns fails."""
    good, bad = _windows()
    return {
        "window": (good + bad, {label for label, _ in bad}),
        "return_lse": (FLAGS, {label for label, _ in FLAGS}),
    }


def _tensor_pool(t) -> list[tuple[str, Any]]:
    """Variants of a baseline tensor: dtypes, ranks, devices, empty and huge
    empty shapes, non-finite values, wrong types."""
    import torch

    shape = tuple(t.shape)
    out = [
        ("int64", t.to(torch.int64)), ("bool", t.to(torch.bool)),
        ("float16", t.to(torch.float16)), ("float64", t.to(torch.float64)),
        ("complex", t.to(torch.complex64)), ("meta", t.to("meta")),
        ("rank-1 less", t[0] if t.dim() else t), ("rank+1", t[None]),
        ("nan", torch.full_like(t, NAN) if t.is_floating_point() else t),
        ("inf", torch.full_like(t, INF) if t.is_floating_point() else t),
        ("'x'", "x"), ("None", None), ("list", t.tolist()),
    ]  # fmt: skip
    if t.dim():
        out += [(f"dim {i} = 0", t.new_zeros(shape[:i] + (0,) + shape[i + 1 :]))
                for i in range(t.dim())]  # fmt: skip
        for i in range(t.dim() if t.dim() > 1 else 0):  # huge, but empty: no memory
            huge = list(shape)
            huge[i], huge[(i + 1) % t.dim()] = 2**40, 0
            out.append((f"dim {i} = 2**40, dim {(i + 1) % t.dim()} = 0", t.new_zeros(huge)))
        out.append(("non-contiguous", t.transpose(0, -1)))
        out.append(("2x longer", torch.cat([t, t], dim=min(1, t.dim() - 1))))
    return out


# ---------------------------------------------------------------------------
# Public entries: a valid call each, every parameter fuzzed by its kind.


def _public() -> dict[str, tuple[Callable, dict[str, Any], dict[str, Any]]]:
    """name -> (call(**args), baseline args, values whose kind stands for a
    parameter whose baseline is None)."""
    import torch

    import ring_attention as ra
    from ring_attention import hf, planner
    from ring_attention.core.pattern import Pattern
    from ring_attention.parallel import api, ring

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 2, 4, generator=g)
    kv = torch.randn(1, 8, 1, 4, generator=g)
    x = torch.randn(8, 1, 16, generator=g)
    cu = torch.tensor([0, 3, 8])
    mask = torch.zeros(1, 8, dtype=torch.bool)
    like_none = {"scale": 0.5, "cu_seqlens": cu, "key_padding_mask": mask, "kdim": 16,
                 "vdim": 16, "group": None, "kv_heads": 2, "attn_mask": mask,
                 "compute_dtype": torch.float32, "labels": torch.zeros(1, 8, dtype=torch.long),
                 "position_ids": torch.arange(8)[None], "q_ranges": [(0, 8)],
                 "segment_lengths": [4], "dilation_rates": [2], "device": "cpu",
                 "dtype": torch.float32, "window": (3, 0), "sinks": torch.zeros(2),
                 "gpus_per_node": 2, "device_type": "cpu", "memory": 1 << 30}  # fmt: skip
    attn = dict(q=q, k=kv, v=kv, segment_lengths=[4, 8], dilation_rates=[1, 2], causal=False,
                scale=None, head_groups=False, key_padding_mask=None, cu_seqlens=None,
                head_offsets="modulo", window=None, return_lse=False, sinks=None)  # fmt: skip
    ring_args = {
        ("q_local" if k == "q" else "k_local" if k == "k" else "v_local" if k == "v" else k): v
        for k, v in attn.items()
        if k != "key_padding_mask"
    }
    ring_args.update(layout="contiguous", group=None)
    mha = dict(embed_dim=16, num_heads=4, dropout=0.0, bias=True, add_bias_kv=False,
               add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
               dtype=None, segment_lengths=None, dilation_rates=None, head_groups=False,
               head_offsets="modulo", group=None, compute_dtype=None, window=None)  # fmt: skip
    mha_fwd = dict(query=x, key=x, value=x, key_padding_mask=None, need_weights=True,
                   attn_mask=None, average_attn_weights=True, is_causal=False,
                   cu_seqlens=None)  # fmt: skip
    dil = dict(segment_lengths=[4, 8], dilation_rates=[1, 2], causal=False, scale=None,
               head_groups=False, head_offsets="modulo", window=None)  # fmt: skip
    pattern = Pattern([4, 8], [1, 2])

    entries = {
        "dilated_attention": (lambda **kw: ra.dilated_attention(**kw), attn),
        "ring_dilated_attention": (lambda **kw: ra.ring_dilated_attention(**kw), ring_args),
        "plan_mesh": (
            lambda **kw: ra.plan_mesh(**kw),
            dict(
                seq_len=64,
                heads=2,
                kv_heads=1,
                head_dim=4,
                pattern=pattern,
                group=None,
                gpus_per_node=None,
                device_type=None,
                dtype=None,
                batch=1,
                memory=None,
                layout="contiguous",
            ),
        ),
        "ring.ring_attention": (
            lambda **kw: api.ring_attention(**kw),
            dict(
                q_local=q,
                k_local=kv,
                v_local=kv,
                pattern=pattern,
                scale=None,
                group=None,
                layout="contiguous",
                return_lse=False,
            ),
        ),
        "ring.exchange_plan": (
            lambda **kw: ring.exchange_plan(**kw),
            dict(
                seq_len=64,
                heads=4,
                segment_lengths=[4, 8],
                dilation_rates=[1, 2],
                causal=False,
                head_groups=False,
                kv_heads=None,
                cu_seqlens=None,
                head_offsets="modulo",
                window=None,
                group=None,
                layout="contiguous",
            ),
        ),
        "Pattern": (
            lambda **kw: Pattern(**kw),
            dict(
                segment_lengths=[4, 8],
                dilation_rates=[1, 2],
                causal=False,
                head_groups=False,
                head_offsets="modulo",
                documents=None,
                window=None,
            ),
        ),
        "DilatedAttention": (lambda **kw: ra.DilatedAttention(**kw), dil),
        "DilatedAttention.forward": (
            lambda **kw: ra.DilatedAttention([4, 8], [1, 2])(**kw),
            dict(q=q, k=kv, v=kv, key_padding_mask=None, cu_seqlens=None),
        ),
        "RingDilatedAttention": (
            lambda **kw: ra.RingDilatedAttention(**kw),
            {**dil, "group": None, "layout": "contiguous"},
        ),
        "RingDilatedAttention.forward": (
            lambda **kw: ra.RingDilatedAttention([4, 8], [1, 2])(**kw),
            dict(q=q, k=kv, v=kv, cu_seqlens=None),
        ),
        "MultiheadDilatedAttention": (lambda **kw: ra.MultiheadDilatedAttention(**kw), mha),
        "MultiheadDilatedAttention.forward": (
            lambda **kw: ra.MultiheadDilatedAttention(16, 4)(**kw),
            mha_fwd,
        ),
        "MultiheadDilatedAttention.forward (pattern)": (
            lambda **kw: ra.MultiheadDilatedAttention(
                16, 4, segment_lengths=[4], dilation_rates=[2]
            )(**kw),
            mha_fwd,
        ),
        "shard_sequence": (
            lambda **kw: ra.shard_sequence(**kw),
            dict(x=q, dim=1, group=None, layout="contiguous"),
        ),
        "gather_sequence": (
            lambda **kw: ra.gather_sequence(**kw),
            dict(x_local=q, dim=1, group=None, layout="contiguous"),
        ),
        "select_dtype": (lambda **kw: ra.select_dtype(**kw), dict(device="cpu")),
        "register_transformers": (
            lambda **kw: ra.register_transformers(**kw),
            dict(group=None, layout="contiguous"),
        ),
        "hf.documents_from_position_ids": (
            lambda **kw: hf.documents_from_position_ids(**kw),
            dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])),
        ),
        "hf.shard_causal_lm_batch": (
            lambda **kw: hf.shard_causal_lm_batch(**kw),
            dict(
                input_ids=torch.arange(8)[None], labels=None, position_ids=None, ignore_index=-100
            ),
        ),
        "hf.pattern_from_config": (
            lambda **kw: hf.pattern_from_config(**kw),
            dict(
                config=types.SimpleNamespace(
                    dilated_attention={"segment_lengths": [4], "dilation_rates": [2]}
                ),
                causal=True,
            ),
        ),
        "planner.predict_traffic": (
            lambda **kw: planner.predict_traffic(**kw),
            dict(
                pattern=pattern,
                seq_len=64,
                heads=4,
                kv_heads=2,
                world_size=3,
                layout="contiguous",
                source="auto",
            ),
        ),
        "planner.evaluate": (
            lambda **kw: planner.evaluate(**kw),
            dict(
                setup=planner.Setup(
                    ranks=2,
                    device="cpu",
                    memory=2**34,
                    reserve=0,
                    heads=4,
                    kv_heads=4,
                    head_dim=16,
                    batch=1,
                    dtype="float32",
                ),
                seq_len=4096,
            ),
        ),
        "planner.longnet_pattern": (
            lambda **kw: planner.longnet_pattern(**kw),
            dict(seq_len=4096, base=2048, factor=4),
        ),
        "planner.pattern_flops": (
            lambda **kw: planner.pattern_flops(**kw),
            dict(pairs=100, head_dim=64, batch=1, backward=False),
        ),
        "planner.reached_pairs": (
            lambda **kw: planner.reached_pairs(**kw),
            dict(pattern=pattern, seq_len=64, heads=4, q_ranges=None),
        ),
    }
    return {name: (call, base, like_none) for name, (call, base) in entries.items()}


def _pool(param: str, value: Any, like: Any = None) -> list[tuple[str, Any]]:
    import torch

    if param in (named := _named_pools()):
        return named[param][0]
    v = like if value is None and like is not None else value
    pool: list[tuple[str, Any]]
    if isinstance(v, bool):
        pool = FLAGS
    elif isinstance(v, int):
        pool = INTS
    elif isinstance(v, float):
        pool = FLOATS
    elif isinstance(v, str):
        pool = STRS
    elif isinstance(v, torch.Tensor):
        pool = _tensor_pool(v)
    elif isinstance(v, (list, tuple)):
        pool = SEQS
    elif v is None:
        pool = GROUPS
    else:
        pool = [("'x'", "x"), ("None", None), ("0", 0)]
    if value is None:  # an optional argument: also its typical value (valid)
        pool = [("typical", v), *pool] if like is not None else pool
    return pool


# ---------------------------------------------------------------------------
# Operators: arguments from their schemas.


def _op_base() -> dict[str, Any]:
    """Baselines of the operators' arguments by name (consistent shapes:
    batch 1, 8 positions, 2 query heads on 1 K/V head, head_dim 4)."""
    import torch

    from ring_attention.core.pattern import Pattern
    from ring_attention.parallel.ring import ring_call_spec

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, 2, 4, generator=g)
    kv = torch.randn(1, 8, 1, 4, generator=g)
    return dict(
        q=q, k=kv, v=kv, out=torch.zeros(1, 8, 2, 4), lse=torch.zeros(1, 2, 8),
        grad_out=torch.randn(1, 8, 2, 4, generator=g), grad_lse=None,
        dq=torch.zeros(1, 8, 2, 4), dk=torch.zeros(1, 8, 1, 4), dv=torch.zeros(1, 8, 1, 4),
        q_start=0, k_start=0, segment_lengths=[4, 8], dilation_rates=[1, 2], causal=False,
        scale=0.5, head_groups=False, grouped_offsets=False, key_padding_mask=None,
        cu_seqlens=None, q_starts=[0], q_lens=[8], k_len=8, heads=2, kv_heads=1,
        # merge_branches / sum_branches: 2 slots over (batch 1, 8 positions, 2 heads)
        parts=torch.randn(32, 4, generator=g), part_lse=torch.randn(32, generator=g),
        index=torch.arange(32, dtype=torch.int32).view(2, 1, 8, 2),
        # ring_forward / ring_backward: a registered ring call of 8 positions
        documents=None, needs_grad=False, seq_len=torch.tensor(8),
        spec=ring_call_spec(Pattern, [4, 8], [1, 2]),
    )  # fmt: skip


def _op_overrides() -> dict[str, dict[str, Any]]:
    """Per operator, baselines that differ from ``_op_base``'s: the running
    lse of block_forward (-inf), the (batch, position, head) lse of
    merge_branches, the local op's ``q_starts`` (a tensor; exchange_rows'
    is a list)."""
    import torch

    return {"block_forward": {"lse": torch.full((1, 2, 8), -INF)},
            "merge_branches": {"lse": torch.zeros(1, 8, 2)},
            # the local op's q_starts is a tensor, exchange_rows' a list
            "dilated_attention": {"q_starts": None},
            "dilated_attention_backward": {"q_starts": None}}  # fmt: skip


#: a typical value per schema type, for optional arguments appended later
_TYPICAL = {"Optional[List[int]]": [4, 4], "Optional[int]": 4, "Optional[float]": 0.5,
            "Optional[bool]": False}  # fmt: skip


def op_names() -> list[str]:
    """The operators registered under ``torch.ops.ring_attention``."""
    import torch

    import ring_attention  # noqa: F401  (registers the operators)

    names = torch._C._dispatch_get_all_op_names()
    return sorted(
        {n.split("::")[1].split(".")[0] for n in names if n.startswith("ring_attention::")}
    )


def _ops() -> dict[str, tuple[Callable, dict[str, Any], dict[str, Any]]]:
    import torch

    import ring_attention  # noqa: F401  (registers the operators)

    base, overrides = _op_base(), _op_overrides()
    like = {"grad_lse": torch.zeros(1, 2, 8), "key_padding_mask": torch.zeros(1, 8, dtype=bool),
            "cu_seqlens": torch.tensor([0, 3, 8]),
            "documents": torch.tensor([0, 3, 8])}  # fmt: skip
    ops = {}
    for name in op_names():
        packet = getattr(torch.ops.ring_attention, name)
        schema = packet.default._schema
        args = {}
        op_like = dict(like)
        for a in schema.arguments:
            if a.name in base:
                value = base[a.name]
            elif a.has_default_value():
                value = a.default_value
                if value is None and str(a.type) in _TYPICAL:  # fuzzed as its type
                    op_like.setdefault(a.name, _TYPICAL[str(a.type)])
            else:
                raise KeyError(
                    f"no baseline for argument {a.name!r} of {schema}: add it to _op_base()"
                )
            args[a.name] = overrides.get(name, {}).get(a.name, value)

        def call(packet=packet, **kw):
            kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
            return packet(**kw)

        ops[f"torch.ops.ring_attention.{name}"] = (call, args, op_like)
    return ops


# ---------------------------------------------------------------------------
# The cases and one worker.

#: message words that also name a parameter (the checks say q for q_local)
ALIASES = {
    "q_local": ["q"], "k_local": ["k", "kv_heads"], "v_local": ["v"], "x": ["dim", "x"],
    "x_local": ["dim", "x_local"], "documents": ["cu_seqlens"],
}  # fmt: skip


def _entries() -> dict[str, tuple[Callable, dict[str, Any], dict[str, Any]]]:
    return {**_public(), **_ops()}


def cases() -> list[tuple[str, str, str]]:
    """(entry, parameter, value label) of every case, in order; a baseline
    call (parameter "") first for each entry."""
    out = []
    for entry, (_, base, like) in _entries().items():
        out.append((entry, "", "baseline"))
        for param, value in base.items():
            out += [(entry, param, label) for label, _ in _pool(param, value, like.get(param))]
    return out


def _names(message: str, param: str) -> bool:
    words = [param, *ALIASES.get(param, [])]
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(w)}(?![A-Za-z0-9_])", message)
               for w in words)  # fmt: skip


#: nn.MultiheadAttention's own parameters (the rest are this module's extras)
_MHA_PARAMS = ("embed_dim", "num_heads", "dropout", "bias", "add_bias_kv", "add_zero_attn",
               "kdim", "vdim", "batch_first", "device", "dtype")  # fmt: skip


def _torch_mha_outcome(entry: str, kw: dict[str, Any]) -> tuple[str, str] | None:
    """What nn.MultiheadAttention raises for the same call (its type name
    and message), or None."""
    import torch

    torch.manual_seed(0)
    try:
        if entry == "MultiheadDilatedAttention":
            torch.nn.MultiheadAttention(**{k: v for k, v in kw.items() if k in _MHA_PARAMS})
        else:
            torch.nn.MultiheadAttention(16, 4)(**{k: v for k, v in kw.items() if k != "cu_seqlens"})
    except Exception as e:  # the reference's outcome, compared below
        return type(e).__name__, str(e)
    return None


def _is_tensor_shape(label: str) -> bool:
    return label.startswith(("dim ", "rank", "2x longer", "non-contiguous"))


def run_case(entry: str, param: str, label: str, table) -> str:
    """One case: "ok", "named" or a failure description."""
    call, base, like = table[entry]
    kw = dict(base)
    if param:
        kw[param] = dict(_pool(param, base[param], like.get(param)))[label]
    try:
        call(**kw)
    except Exception as e:  # judged below
        if not param:
            return f"BASELINE FAILED: {type(e).__name__}: {e}"
        if entry.startswith("MultiheadDilatedAttention"):
            # the drop-in raises what nn.MultiheadAttention raises (its
            # AssertionError as MultiheadAttentionError, also a ValueError)
            theirs = _torch_mha_outcome(entry, kw)
            first = str(e).split("\n")[0]  # (a C++ error's backtrace follows)
            if theirs is not None and theirs[1].split("\n")[0] == first:
                same = theirs[0] == type(e).__name__ or (
                    theirs[0] == "AssertionError" and type(e).__name__ == "MultiheadAttentionError"
                )
                if same:
                    return "as nn.MultiheadAttention"
        if not isinstance(e, (ValueError, RuntimeError)):
            return f"TYPE {type(e).__name__}: {str(e)[:300]}"
        if _names(str(e), param):
            return "named"
        # a tensor whose shape no longer matches another's: either may be named
        tensors = [k for k, v in base.items() if _is_tensor(v)]
        if _is_tensor_shape(label) and any(_names(str(e), t) for t in tensors):
            return "named"
        return f"UNNAMED {type(e).__name__}: {str(e)[:300]}"
    if param in (named := _named_pools()) and label in named[param][1]:
        return f"ACCEPTED: {param}={label} must raise ValueError naming {param}"
    return "ok"


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def worker(start: int, kind: str = "api") -> None:
    """Run cases of ``kind`` (``"api"``: the entries and operators;
    ``"cli"``: the command lines' options) from ``start`` on, printing
    ``S i`` before and ``E i result`` after each (the parent's record of
    where a crash or hang was)."""
    import resource

    import torch  # noqa: F401

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + MEMORY_HEADROOM, hard))
    if kind == "cli":
        all_cases, run = cli_cases(), run_cli_case
    else:
        table = _entries()
        all_cases, run = cases(), lambda *case: run_case(*case, table)
    for i in range(start, len(all_cases)):
        print(f"S {i}", flush=True)
        result = run(*all_cases[i])
        print(f"E {i} {result}".replace("\n", " "), flush=True)


def run_all(
    limit: int | None = None, kind: str = "api"
) -> tuple[list[tuple[int, str]], int, float]:
    """Every case of ``kind`` (:func:`worker`) through workers; (failures,
    cases run, seconds)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    n = len(cli_cases() if kind == "cli" else cases())
    if limit is not None:
        n = min(n, limit)
    failures: list[tuple[int, str]] = []
    start, t0 = 0, time.monotonic()
    while start < n and time.monotonic() - t0 < TOTAL_TIMEOUT:
        script = f"import test_fuzz_arguments as f; f.worker({start}, {kind!r})"
        proc = subprocess.Popen(  # tests/ on the child's path: its helpers
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, env=with_path(tests),
        )  # fmt: skip
        current, last = None, time.monotonic()
        try:
            while True:
                wait = (CASE_TIMEOUT if current is not None else 120.0) - (time.monotonic() - last)
                ready, _, _ = select.select([proc.stdout], [], [], max(wait, 0))
                if not ready:  # the case (or the worker's start) overran
                    failures.append((current if current is not None else start,
                                     f"HANG: more than {CASE_TIMEOUT:.0f} s"))  # fmt: skip
                    start = (current if current is not None else start) + 1
                    break
                line = proc.stdout.readline()
                if not line:  # the worker died
                    proc.wait()
                    if current is None:
                        raise RuntimeError(f"fuzz worker failed to start: {proc.stderr.read()}")
                    failures.append((current, f"CRASH: exit {proc.returncode}"))
                    start = current + 1
                    break
                kind, i, *rest = line.rstrip("\n").split(" ", 2)
                last = time.monotonic()
                if kind == "S":
                    current = int(i)
                    continue
                result = rest[0] if rest else ""
                if result not in ("ok", "named", "as nn.MultiheadAttention"):
                    failures.append((int(i), result))
                current = None
                if int(i) + 1 >= n:
                    start = n
                    break
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return failures, n, time.monotonic() - t0


def test_arguments_fuzz() -> None:
    import torch

    limit = os.environ.get("RA_FUZZ_CASES", "all")
    failures, n, seconds = run_all(None if limit == "all" else int(limit))
    table = cases()
    lines = [f"{table[i][0]}({table[i][1]}={table[i][2]}): {why}" for i, why in failures]
    print(f"{n} cases in {seconds:.0f} s, {len(failures)} failures")
    assert not failures, f"{len(failures)} of {n} cases failed:\n" + "\n".join(lines)
    assert torch.ops.ring_attention  # the extension's ops were fuzzed


# ---------------------------------------------------------------------------
# window and return_lse in every mode, across real processes.

#: label -> whether the value is a valid ``return_lse`` (and the flag it means)
_LSE_GOOD = {"True": True, "False": False, "np.bool_(True)": True}


def _seeded(cls: Callable) -> Callable:
    """``cls`` constructed with the same random weights every time."""
    import torch

    def make(*args, **kw):
        torch.manual_seed(5)
        return cls(*args, **kw)

    return make


def _mode_entries(rank: int, world: int) -> dict[str, dict[str, Callable]]:
    """mode -> entry -> call(**kw) taking ``window`` and/or ``return_lse`` (4
    ranks: the ring over all, Ulysses over all, the 2 x 2 hybrid from groups
    and from a mesh). Every rank builds every group, in the same order."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ring_attention as ra
    from ring_attention.core.pattern import Pattern
    from ring_attention.parallel import api

    segs, dils, n = [4, 8], [1, 2], 23
    pattern = Pattern(segs, dils)
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(1, n, h, 4, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    x_full = torch.randn(1, n, 16, generator=g, dtype=torch.float64)
    i, j = divmod(rank, 2)
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    spreads = {
        "ring": dict(group=dist.group.WORLD),
        "Ulysses": dict(group=None, ulysses_group=dist.group.WORLD),
        "hybrid": dict(group=cols[j], ulysses_group=rows[i]),
        "hybrid (mesh)": dict(mesh=mesh),
    }
    modes: dict[str, dict[str, Callable]] = {
        "local": {
            "dilated_attention": lambda **kw: ra.dilated_attention(*full, segs, dils, **kw),
            "DilatedAttention": lambda window: ra.DilatedAttention(segs, dils, window=window)(
                *full
            ),
            "MultiheadDilatedAttention": lambda window: _seeded(ra.MultiheadDilatedAttention)(
                16, 4, batch_first=True, window=window, dtype=torch.float64
            )(x_full, x_full, x_full, need_weights=False)[0],
        }
    }
    for mode, spread in spreads.items():
        q, k, v = (ra.shard_sequence(t, 1, **spread) for t in full)
        x = ra.shard_sequence(x_full, 1, **spread)

        def mha(window, spread=spread, x=x):
            m = _seeded(ra.MultiheadDilatedAttention)(16, 4, batch_first=True, window=window,
                                                      dtype=torch.float64, **spread)  # fmt: skip
            return m(x, x, x, need_weights=False)[0]

        modes[mode] = {
            "ring_dilated_attention": lambda q=q, k=k, v=v, spread=spread, **kw: (
                ra.ring_dilated_attention(q, k, v, segs, dils, **spread, **kw)
            ),
            "ring.ring_attention": lambda return_lse, q=q, k=k, v=v, spread=spread: (
                api.ring_attention(q, k, v, pattern, return_lse=return_lse, **spread)
            ),
            "RingDilatedAttention": lambda window, q=q, k=k, v=v, spread=spread: (
                ra.RingDilatedAttention(segs, dils, window=window, **spread)(q, k, v)
            ),
            "MultiheadDilatedAttention": mha,
        }
    return modes


def _modes_worker(rank: int, world: int) -> list[str]:
    """Every entry of every mode with every ``window`` and ``return_lse`` of
    the pools, the same value on every rank: a refused value raises
    ValueError naming the argument (on every rank: none waits), an accepted
    window gives what its tuple gives, an accepted return_lse its
    flag's result. The failures, as text."""
    import inspect

    import torch

    good, bad = _windows()
    refused = {label for label, _ in bad}
    canonical = {"(3, 0)": (3, 0), "[3, 0]": (3, 0), "(np.int64(3), 0)": (3, 0),
                 "(tensor(3), tensor(0))": (3, 0), "(-1, -1)": (-1, -1),
                 "(0, 2)": (0, 2)}  # fmt: skip
    failures = []
    for mode, entries in _mode_entries(rank, world).items():
        for entry, call in entries.items():
            params = inspect.signature(call).parameters
            takes = [p for p in ("window", "return_lse") if p in params or "kw" in params]
            for param in takes:
                pool = good + bad if param == "window" else [*FLAGS, ("True", True),
                                                             ("False", False)]  # fmt: skip
                if param == "return_lse":
                    import numpy as np

                    pool.append(("np.bool_(True)", np.bool_(True)))
                for label, value in pool:
                    where = f"{mode} {entry}({param}={label})"
                    try:
                        got = call(**{param: value})
                    except ValueError as e:
                        ok = label in refused or (param == "return_lse" and label not in _LSE_GOOD)
                        if not ok or not re.search(rf"\b{param}\b", str(e)):
                            failures.append(f"{where}: ValueError {str(e)[:200]}")
                        continue
                    except Exception as e:  # judged: a failure
                        failures.append(f"{where}: {type(e).__name__} {str(e)[:200]}")
                        continue
                    if param == "return_lse":
                        if label not in _LSE_GOOD:
                            failures.append(f"{where}: accepted")
                        elif isinstance(got, tuple) != _LSE_GOOD[label]:
                            failures.append(f"{where}: returned {type(got).__name__}")
                    elif label in refused:
                        failures.append(f"{where}: accepted")
                    elif not torch.equal(got, call(window=canonical[label])):
                        failures.append(f"{where}: differs from window={canonical[label]}")
    return failures


def test_window_and_return_lse_in_every_mode() -> None:
    """``window`` of every kind and ``return_lse`` of every flag pool value
    through every entry of every mode (one process; the ring, Ulysses and
    the hybrid of groups and of a mesh on 4 gloo ranks): ``return_lse="no"``
    with ``ulysses_group=``/``mesh=`` used to return ``(out, lse)``, a set
    window ``{255, 0}`` to attend the band ``(0, 255)``."""
    for rank, failures in enumerate(run_distributed(_modes_worker, 4, timeout=600)):
        assert not failures, f"rank {rank}: {len(failures)} failures:\n" + "\n".join(failures)


#: Public names not fuzzed here, and why.
NOT_FUZZED = {
    "ra.MultiheadAttentionError": "an exception class",
    "ra.cache_info": "takes no argument",
    "ra.clear_caches": "takes no argument",
    "ring.ExchangeEvent": "a record the ring builds",
    "ring.ExchangeStats": "a record the ring builds",
    "ring.last_exchange_stats": "a record the ring fills",
    "ring.register_exchange_hook": "takes a callable; a hook's errors are the caller's",
    "hf.ATTN_IMPLEMENTATION": "a constant",
    "hf.CONFIG_KEY": "a constant",
    "hf.dilated_attention_forward": "transformers' attention interface: called by transformers "
    "with its own arguments, exercised through models in tests/test_hf.py",
    "hf.dilated_attention_mask": "transformers' mask interface, as above",
    "hf.ShardedCache": "a transformers cache, built on every rank of a registered group: "
    "its block and the missing group raise in tests/test_hf_sp_generate.py, its max_cache_len "
    "in tests/test_hf_sp_static_cache.py",
    "hf.sequence_parallel": "takes no argument",
    "ring.ring_call": "the ring's operators, fuzzed as torch.ops.ring_attention.ring_forward / "
    "ring_backward",
    "ring.ring_call_spec": "takes a builder callable; what it raises is kept and reported by the "
    "operators (fuzzed)",
    "hf.SequenceParallelDataLoader": "wraps an iterable of batches, each checked by "
    "shard_causal_lm_batch (fuzzed)",
    "hf.SequenceParallelMixin": "a Trainer mixin: transformers' Trainer checks its arguments",
    "hf.SequenceParallelTrainer": "transformers' Trainer with the loader above",
    "planner.MODELS": "a constant",
    "planner.PATTERNS": "a constant",
    "planner.Evaluation": "a result record (evaluate builds it)",
    "planner.LayerMemory": "a result record",
    "planner.RankTime": "a result record",
    "planner.Rates": "a result record",
    "planner.Traffic": "a result record (predict_traffic builds it)",
    "planner.Setup": "a plain record (its flags: tests/test_flags.py); evaluate reads it",
    "planner.ModelShape": "a plain record (its flag: tests/test_flags.py)",
    "planner.Link": "a plain record",
    "planner.largest_length": "a search over evaluate (fuzzed)",
    "planner.fewest_ranks": "a search over evaluate (fuzzed)",
    "planner.layer_memory": "takes a Traffic (fuzzed through predict_traffic)",
    "planner.layer_memories": "takes a Traffic",
    "planner.layer_times": "takes a Traffic",
    "planner.transport_buffers": "takes a Traffic",
    "planner.assumed_rates": "a table lookup",
    "planner.load_records": "reads a benchmark file",
    "planner.rates_from_records": "reads benchmark records",
}  # fmt: skip


def test_every_public_entry_is_fuzzed_or_said_why_not() -> None:
    import ring_attention as ra
    from ring_attention import hf, planner
    from ring_attention.parallel import api, ring

    entries = set(_public())
    missing = []
    for prefix, module in (("ra", ra), ("ring", ring), ("ring", api), ("hf", hf),
                           ("planner", planner)):  # fmt: skip
        for name in module.__all__:
            key = f"{prefix}.{name}"
            fuzzed = {key, name, f"{prefix}.{name}".removeprefix("ra.")}
            if not (fuzzed & entries) and key not in NOT_FUZZED:
                missing.append(key)
    assert not missing, f"public names neither fuzzed nor in NOT_FUZZED: {missing}"


def test_op_schemas_are_fuzzed_from_the_registry() -> None:
    """Every registered operator is among the entries, with every argument
    of its schema."""
    import torch

    ops = _ops()
    assert {"block_forward", "exchange_rows"} <= set(op_names())
    for name in op_names():
        schema = getattr(torch.ops.ring_attention, name).default._schema
        _, base, _ = ops[f"torch.ops.ring_attention.{name}"]
        assert list(base) == [a.name for a in schema.arguments]


# ---------------------------------------------------------------------------
# The command lines: every option of ``python -m ring_attention.planner``
# and ``python -m ring_attention.info``, read from their parsers.

#: What every option is given in turn: zero, negative, fractional, NaN,
#: infinite, a float's smallest and beyond its largest, beyond int64,
#: malformed, empty.
CLI_VALUES = ["0", "-1", "0.5", "nan", "inf", "-inf", "1e-320", "1e30", "1e400", str(2**63),
              "x", ""]  # fmt: skip
#: Valid command lines the options are fuzzed from (quick to answer): the
#: ring at one length, the three modes compared, info's route.
CLI_BASES = {
    "planner": ["--gpus", "4", "--seq-len", "64K", "--heads", "4", "--head-dim", "64"],
    "planner --mode compare": ["--mode", "compare", "--gpus", "4", "--gpus-per-node", "2",
                               "--seq-len", "64K", "--heads", "4", "--head-dim", "64"],
    "info": ["--seq-len", "4096", "--device", "cpu", "--dtype", "float32", "--head-dim", "64"],
}  # fmt: skip


def _cli(program: str):
    """``(parser, main)`` of a command line."""
    if program == "info":
        from ring_attention import info

        return info._parser(), info.main
    from ring_attention.planner.cli import main
    from ring_attention.planner.cli_args import build_parser

    return build_parser(), main


def cli_cases() -> list[tuple[str, str, str]]:
    """(base, option, value) of every case: each base as it is, then every
    option that takes a value, replaced (or added) with each of
    ``CLI_VALUES``."""
    out = []
    for base in CLI_BASES:
        parser, _ = _cli(base.split()[0])
        out.append((base, "", ""))
        for action in parser._actions:
            if action.option_strings and action.nargs != 0:
                out += [(base, action.option_strings[-1], v) for v in CLI_VALUES]
    return out


def run_cli_case(base: str, option: str, value: str) -> str:
    """One case: "ok" (an answer: exit 0, no NaN or infinity in it),
    "named" (exit 2, argparse's error or the planner's "Not possible:"
    naming the option) or a failure description."""
    import contextlib
    import io
    import traceback

    _, main = _cli(base.split()[0])
    argv = list(CLI_BASES[base])
    if option in argv:  # replace the base's value (one value each)
        del argv[argv.index(option) : argv.index(option) + 2]
    if option:
        argv += [option, value]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException as e:  # a traceback is the failure this looks for
        return f"RAISED {type(e).__name__}: {str(e)[:200]} {traceback.format_exc()[-600:]}"
    text = out.getvalue()
    if not option:
        return "ok" if code == 0 else f"BASELINE FAILED: exit {code}: {text[-300:]}"
    if code == 0:
        bad = re.search(r"(?<![A-Za-z_])(nan|inf)(?![A-Za-z_])", text, re.I)
        return "ok" if not bad else f"NOT FINITE: ...{text[max(bad.start() - 150, 0) :][:300]}"
    said = [line for line in err.getvalue().splitlines() if ": error: " in line]
    said += [line for line in text.splitlines() if line.startswith("Not possible:")]
    if code != 2 or not said:
        return f"EXIT {code}: {(err.getvalue() + text)[-300:]}"
    if any(re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", line) for line in said):
        return "named"
    return f"UNNAMED: {said[-1][:300]}"


def test_command_line_options_fuzz() -> None:
    """Every option of the planner's and info's command lines, given zero,
    negative, NaN, infinite, huge or malformed values: an answer, or exit 2
    with a message naming the option; never a traceback, a hang or a
    silent default (issue 46, items 10-11)."""
    failures, n, seconds = run_all(kind="cli")
    table = cli_cases()
    lines = [f"{table[i][0]} {table[i][1]} {table[i][2]!r}: {why}" for i, why in failures]
    print(f"{n} command-line cases in {seconds:.0f} s, {len(failures)} failures")
    assert n > 600 and not failures, f"{len(failures)} of {n} cases failed:\n" + "\n".join(lines)


if __name__ == "__main__":  # python tests/test_fuzz_arguments.py [N]: a report
    fails, total, secs = run_all(int(sys.argv[1]) if len(sys.argv) > 1 else None)
    all_cases = cases()
    for i, why in fails:
        print(f"{all_cases[i]}: {why}")
    print(f"{total} cases in {secs:.0f} s, {len(fails)} failures")
    sys.exit(1 if fails else 0)
