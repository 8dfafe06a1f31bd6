"""Every flag of every public entry is a ``bool`` (docs/design.md §6).

A flag given as ``"no"`` is truthy in Python and ``0`` falsy; taking either
as a boolean is a silent wrong answer (``return_lse="no"`` used to return
``(out, lse)``). So every parameter annotated ``bool`` of every public
function, constructor and ``forward`` raises ``ValueError`` naming it for
anything but ``True``, ``False`` or a NumPy ``bool_``.

The entries are found by walking the public modules' ``__all__``: a new
public entry with a ``bool`` parameter and no call here fails
``test_every_flag_is_covered`` until it is added to ``CALLS``.
"""

from __future__ import annotations

import inspect
import types

import numpy as np
import pytest
import torch

import ring_attention as ra
from ring_attention import hf, planner
from ring_attention.core.pattern import Pattern
from ring_attention.parallel import api, ring

MODULES = {"ra": ra, "ring": ring, "hf": hf, "planner": planner}
BAD = ["no", "False", 0, 1, None, 1.0, torch.tensor(True), [True]]
GOOD = [True, False, np.bool_(True)]

_q = torch.randn(1, 8, 2, 4)
_x = torch.randn(8, 1, 16)


def _mha(**kw):
    return ra.MultiheadDilatedAttention(16, 4, **kw)


def _setup(**kw):
    base = dict(ranks=2, device="cpu", memory=2**30, reserve=0, heads=4, kv_heads=4, head_dim=8,
                batch=1, dtype="float32")  # fmt: skip
    return planner.Setup(**{**base, **kw})


#: "module.name" or "module.Class.forward" -> a call taking the flag as a keyword.
CALLS = {
    "ra.dilated_attention": lambda **kw: ra.dilated_attention(_q, _q, _q, [4], [2], **kw),
    "ra.ring_dilated_attention": lambda **kw: ra.ring_dilated_attention(_q, _q, _q, [4], [2], **kw),
    "ring.ring_attention": lambda **kw: api.ring_attention(_q, _q, _q, Pattern([4], [2]), **kw),
    "ring.ring_dilated_attention": lambda **kw: api.ring_dilated_attention(
        _q, _q, _q, [4], [2], **kw
    ),
    "ring.ring_call": lambda **kw: ring.ring_call(
        _q, _q, _q, ring.ring_call_spec(Pattern, [4], [2]), **kw
    ),
    "ring.exchange_plan": lambda **kw: ring.exchange_plan(8, 2, [4], [2], **kw),
    "ra.shard_sequence": lambda **kw: ra.shard_sequence(_q, 1, layout="balanced", **kw),
    "ra.gather_sequence": lambda **kw: ra.gather_sequence(_q, 1, layout="balanced", **kw),
    "ra.Pattern": lambda **kw: Pattern([4], [2], **kw),
    "ra.DilatedAttention": lambda **kw: ra.DilatedAttention([4], [2], **kw),
    "ra.RingDilatedAttention": lambda **kw: ra.RingDilatedAttention([4], [2], **kw),
    "ra.MultiheadDilatedAttention": _mha,
    # (the causal attn_mask that the is_causal hint requires)
    "ra.MultiheadDilatedAttention.forward": lambda **kw: _mha()(
        _x, _x, _x, attn_mask=torch.ones(8, 8, dtype=torch.bool).triu(1), **kw
    ),
    "hf.pattern_from_config": lambda **kw: hf.pattern_from_config(
        types.SimpleNamespace(dilated_attention={"segment_lengths": [4], "dilation_rates": [2]}),
        **kw,
    ),
    "planner.Setup": _setup,
    "planner.ModelShape": lambda **kw: planner.ModelShape(1, 16, 4, 4, 4, 32, **kw),
    "planner.pattern_flops": lambda **kw: planner.pattern_flops(10, 4, **kw),
}


def _flags(fn) -> list[str]:
    """The parameters of ``fn`` annotated exactly ``bool``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.annotation in ("bool", bool)]


def _public_flags() -> dict[str, list[str]]:
    """Every public function, constructor and ``forward`` with a flag."""
    found = {}
    for prefix, module in MODULES.items():
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                if issubclass(obj, BaseException):
                    continue
                found[f"{prefix}.{name}"] = _flags(obj)
                if issubclass(obj, torch.nn.Module) and "forward" in obj.__dict__:
                    found[f"{prefix}.{name}.forward"] = _flags(obj.forward)
            elif callable(obj):
                found[f"{prefix}.{name}"] = _flags(obj)
    return {k: v for k, v in found.items() if v}


def test_every_flag_is_covered() -> None:
    missing = sorted(set(_public_flags()) - set(CALLS))
    assert not missing, f"public entries with bool flags and no call in CALLS: {missing}"


CASES = [(entry, flag) for entry, flags in sorted(_public_flags().items()) for flag in flags]


@pytest.mark.parametrize("entry,flag", CASES, ids=[f"{e}-{f}" for e, f in CASES])
def test_flags_are_bools(entry: str, flag: str) -> None:
    call = CALLS[entry]
    for good in GOOD:
        call(**{flag: good})
    for bad in BAD:
        with pytest.raises(ValueError, match=rf"\b{flag} must be a bool"):
            call(**{flag: bad})


def test_config_head_groups_is_a_bool_whatever_was_cached() -> None:
    """The transformers backend caches patterns by their config entry, whose
    key takes 1 for True: the flag is checked before the cache."""
    for value in (True, 1, "yes"):
        config = types.SimpleNamespace(
            dilated_attention={"segment_lengths": [4], "dilation_rates": [2],
                               "head_groups": value}
        )  # fmt: skip
        if value is True:
            assert hf.pattern_from_config(config, True).head_groups
        else:
            with pytest.raises(ValueError, match=r"\['head_groups'\] must be a bool"):
                hf.pattern_from_config(config, True)


def test_cu_seqlens_on_the_meta_device_is_named() -> None:
    """Its values cannot be read: a ValueError naming cu_seqlens (was
    NotImplementedError: "Cannot copy out of meta tensor")."""
    cu = torch.tensor([0, 8], device="meta")
    with pytest.raises(ValueError, match="cu_seqlens must hold values"):
        ra.dilated_attention(_q, _q, _q, [4], [2], cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens must hold values"):
        ra.ring_dilated_attention(_q, _q, _q, [4], [2], cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens must hold values"):
        ra.DilatedAttention([4], [2])(_q, _q, _q, cu_seqlens=cu)
