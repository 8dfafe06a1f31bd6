"""Bad input (docs/design.md §6): every misuse raises ValueError/RuntimeError
whose message names the offending argument.

The public API ``ra.dilated_attention`` is checked in-process. The C++
operators (``torch.ops.ring_attention.*``), which must stay safe when called
directly, are checked in one subprocess so that a crash (e.g. an integer
division by a zero dilation rate) is reported as a failure instead of killing
the test session.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import ring_attention as ra

ERR = (ValueError, RuntimeError)
B, N, H, D = 2, 12, 3, 8


def qkv(dtype: torch.dtype = torch.float32, device: str = "cpu", shape=(B, N, H, D)):
    return tuple(torch.randn(shape, dtype=dtype).to(device) for _ in range(3))


def call(q, k, v, segs=(4, 8), dils=(1, 2), **kw):
    return ra.dilated_attention(q, k, v, list(segs), list(dils), **kw)


def test_valid_call_works() -> None:
    q, k, v = qkv()
    out = call(q, k, v)
    assert out.shape == q.shape
    # tuples are fine too
    out2 = ra.dilated_attention(q, k, v, (4, 8), (1, 2))
    assert torch.equal(out, out2)


# ------------------------------------------------------------------- tensors


def test_q_wrong_rank() -> None:
    q, k, v = qkv()
    with pytest.raises(ERR, match=r"\bq\b"):
        call(q[0], k[0], v[0])
    with pytest.raises(ERR, match=r"\bq\b"):
        call(q[..., None], k[..., None], v[..., None])


@pytest.mark.parametrize(
    ("which", "shape"),
    [
        ("k", (B, N + 1, H, D)),
        ("k", (B, N, H + 1, D)),
        ("v", (B, N, H, D + 1)),
        ("v", (B + 1, N, H, D)),
        ("k", (B, N, H)),
    ],
)
def test_qkv_shape_mismatch(which, shape) -> None:
    q, k, v = qkv()
    bad = torch.randn(shape)
    args = {"q": q, "k": k, "v": v, which: bad}
    with pytest.raises(ERR, match=rf"\b{which}\b"):
        call(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("which", ["k", "v"])
def test_qkv_dtype_mismatch(which) -> None:
    q, k, v = qkv()
    args = {"q": q, "k": k, "v": v, which: qkv(torch.float64)[0]}
    with pytest.raises(ERR, match="dtype"):
        call(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("which", ["k", "v"])
def test_qkv_device_mismatch(which) -> None:
    q, k, v = qkv()
    other = "cuda" if torch.cuda.is_available() else "meta"
    args = {"q": q, "k": k, "v": v, which: qkv(device=other)[0]}
    with pytest.raises(ERR, match="device"):
        call(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.complex64, torch.bool])
def test_unsupported_dtype(dtype) -> None:
    q = torch.ones(B, N, H, D, dtype=dtype)
    with pytest.raises(ERR, match="dtype"):
        call(q, q, q)


# ------------------------------------------------------------------ pattern


@pytest.mark.parametrize(
    ("segs", "dils", "arg"),
    [
        ((), (), "segment_lengths"),
        ((4, 8), (1,), "segment_lengths.*dilation_rates|dilation_rates.*segment_lengths"),
        ((4,), (1, 2), "segment_lengths.*dilation_rates|dilation_rates.*segment_lengths"),
        ((0,), (1,), "segment_lengths"),
        ((-4,), (1,), "segment_lengths"),
        ((4, 0), (1, 1), "segment_lengths"),
        ((4,), (0,), "dilation_rates"),
        ((4,), (-1,), "dilation_rates"),
        ((4,), (5,), "dilation_rates"),
        ((8, 4), (2, 8), "dilation_rates"),
        ((4.5,), (1,), "segment_lengths"),
        ((4,), (1.5,), "dilation_rates"),
    ],
    ids=[
        "empty",
        "more_w",
        "more_r",
        "w0",
        "w_neg",
        "second_w0",
        "r0",
        "r_neg",
        "r_gt_w",
        "second_r_gt_w",
        "w_float",
        "r_float",
    ],
)
def test_bad_pattern(segs, dils, arg) -> None:
    q, k, v = qkv()
    with pytest.raises(ERR, match=arg):
        call(q, k, v, segs, dils)


@pytest.mark.parametrize(
    ("segs", "dils"),
    [((), ()), ((4,), (5,)), ((4,), (0,))],
    ids=["empty", "r_gt_w", "r0"],
)
def test_bad_pattern_on_meta_device(segs, dils) -> None:
    # validation does not depend on where the data is
    q, k, v = qkv(device="meta")
    with pytest.raises(ERR, match=r"segment_lengths|dilation_rates"):
        call(q, k, v, segs, dils)


@pytest.mark.parametrize(
    ("heads", "segs", "dils"), [(2, (4, 8, 12), (1, 2, 3)), (1, (4, 8), (1, 1))]
)
def test_head_groups_needs_enough_heads(heads, segs, dils) -> None:
    q, k, v = qkv(shape=(B, N, heads, D))
    call(q, k, v, segs, dils)  # fine without head groups
    with pytest.raises(ERR, match="head_groups"):
        call(q, k, v, segs, dils, head_groups=True)


# ---------------------------------------------------------------------- mask


@pytest.mark.parametrize(
    "mask",
    [
        torch.zeros(B, N + 1, dtype=torch.bool),
        torch.zeros(B + 1, N, dtype=torch.bool),
        torch.zeros(N, dtype=torch.bool),
        torch.zeros(B, N, 1, dtype=torch.bool),
        torch.zeros(B, N, dtype=torch.float32),
        torch.zeros(B, N, dtype=torch.int64),
        torch.zeros(B, N, dtype=torch.bool, device="meta"),
    ],
    ids=["long", "batch", "1d", "3d", "float", "int", "device"],
)
def test_bad_key_padding_mask(mask) -> None:
    q, k, v = qkv()
    with pytest.raises(ERR, match="key_padding_mask"):
        call(q, k, v, key_padding_mask=mask)


# --------------------------------------------------------------------- scale


@pytest.mark.parametrize(
    "scale", [0.0, -1.0, float("nan"), float("inf"), float("-inf"), 10**400, -(10**400)]
)
def test_bad_scale(scale) -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="scale"):
        call(q, k, v, scale=scale)


# ------------------------------------------------- C++ operators called directly

_OP_SCRIPT = textwrap.dedent(
    """
    import json, torch
    import ring_attention  # noqa: F401  (loads the operators)
    ops = torch.ops.ring_attention
    f32 = torch.float32
    q = torch.randn(2, 12, 3, 8)
    k, v = torch.randn_like(q), torch.randn_like(q)
    P = ([4, 8], [1, 2], False, 0.5, False, False, None, None)

    def acc(lq=12):
        return torch.zeros(2, lq, 3, 8), torch.full((2, 3, lq), float("-inf"))

    def grads(lq=12, lk=12):
        return torch.zeros(2, lq, 3, 8), torch.zeros(2, lk, 3, 8), torch.zeros(2, lk, 3, 8)

    def bf(*args):
        out, lse = acc()
        return ops.block_forward(q, k, v, out, lse, 0, 0, *args)

    def pattern_cases(run):
        return {
            "empty pattern": lambda: run([], [], False, 0.5, False, False, None, None),
            "w = 0": lambda: run([0], [1], False, 0.5, False, False, None, None),
            "r = 0": lambda: run([4], [0], False, 0.5, False, False, None, None),
            "r > w": lambda: run([4], [5], False, 0.5, False, False, None, None),
            "lengths differ": lambda: run([4, 8], [1], False, 0.5, False, False, None, None),
            "head_groups": lambda: run(
                [2, 4, 6, 8], [1, 1, 1, 1], False, 0.5, True, False, None, None),
            "mask shape": lambda: run(
                [4], [1], False, 0.5, False, False, torch.zeros(2, 13) > 0, None),
            "mask dtype": lambda: run(
                [4], [1], False, 0.5, False, False, torch.zeros(2, 12), None),
        }

    cases = {}
    for name, fn in pattern_cases(lambda *a: ops.dilated_attention(q, k, v, *a)).items():
        cases["dilated_attention: " + name] = fn
    for name, fn in pattern_cases(bf).items():
        cases["block_forward: " + name] = fn
    out, lse = ops.dilated_attention(q, k, v, *P)
    for name, fn in pattern_cases(
        lambda *a: ops.dilated_attention_backward(q, None, q, k, v, out, lse, *a)
    ).items():
        cases["dilated_attention_backward: " + name] = fn
    for name, fn in pattern_cases(
        lambda *a: ops.block_backward(q, None, q, k, v, out, lse, *grads(), 0, 0, *a)
    ).items():
        cases["block_backward: " + name] = fn

    o, l = acc()
    cases.update({
        "dilated_attention: 3-D q": lambda: ops.dilated_attention(q[0], k[0], v[0], *P),
        "dilated_attention: k shape": lambda: ops.dilated_attention(q, k[:, :5], v, *P),
        "dilated_attention: dtype": lambda: ops.dilated_attention(q, k.double(), v, *P),
        "dilated_attention: int dtype": lambda: ops.dilated_attention(
            q.int(), k.int(), v.int(), *P),
        "block_forward: negative q_start": lambda: ops.block_forward(q, k, v, o, l, -1, 0, *P),
        "block_forward: out shape": lambda: ops.block_forward(
            q, k, v, torch.zeros(2, 11, 3, 8), l, 0, 0, *P),
        "block_forward: out dtype": lambda: ops.block_forward(q, k, v, o.half(), l, 0, 0, *P),
        "block_forward: lse shape": lambda: ops.block_forward(
            q, k, v, o, torch.zeros(2, 12, 3), 0, 0, *P),
        "block_forward: k/v shape": lambda: ops.block_forward(q, k, v[:, :5], o, l, 0, 0, *P),
        "block_forward: q/k heads": lambda: ops.block_forward(
            q, k[:, :, :2], v[:, :, :2], o, l, 0, 0, *P),
        "block_backward: dk shape": lambda: ops.block_backward(
            q, None, q, k, v, out, lse, *grads(lk=11), 0, 0, *P),
        "block_backward: lse dtype": lambda: ops.block_backward(
            q, None, q, k, v, out, lse.double(), *grads(), 0, 0, *P),
        "block_backward: dk without dv": lambda: ops.block_backward(
            q, None, q, k, v, out, lse, grads()[0], grads()[1], None, 0, 0, *P),
    })

    results = {}
    for name, fn in cases.items():
        try:
            fn()
            results[name] = "no error"
        except (RuntimeError, ValueError) as e:
            results[name] = "ok: " + str(e).splitlines()[0]
        except Exception as e:  # noqa: BLE001
            results[name] = f"wrong type {type(e).__name__}: {e}"
    print(json.dumps(results))
    """
)


# What the message of each operator-level case must name (matched on the case
# name after the "op: " prefix).
_OP_EXPECT = {
    "empty pattern": r"segment_lengths",
    "w = 0": r"segment_lengths",
    "r = 0": r"dilation_rates",
    "r > w": r"dilation_rates",
    "lengths differ": r"segment_lengths.*dilation_rates|dilation_rates.*segment_lengths",
    "head_groups": r"head_groups",
    "mask shape": r"key_padding_mask",
    "mask dtype": r"key_padding_mask",
    "3-D q": r"\bq\b",
    "k shape": r"\bk\b",
    "dtype": r"dtype",
    "int dtype": r"dtype",
    "negative q_start": r"q_start",
    "out shape": r"\bout\b",
    "out dtype": r"\bout\b",
    "lse shape": r"\blse\b",
    "k/v shape": r"\bv\b",
    "q/k heads": r"\bk\b",
    "dk shape": r"\bdk\b",
    "lse dtype": r"\blse\b",
    "dk without dv": r"\bdk\b.*\bdv\b",
}


def test_cpp_ops_reject_bad_input_without_crashing() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _OP_SCRIPT],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"operator checks crashed (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    )
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = {}
    for name, r in results.items():
        expect = _OP_EXPECT[name.split(": ", 1)[1]]
        if not r.startswith("ok: "):
            bad[name] = r
        elif not re.search(expect, r[4:]):
            bad[name] = f"message does not name {expect!r}: {r[4:]}"
    assert not bad, "operators accepted or mishandled bad input:\n" + "\n".join(
        f"  {name}: {r}" for name, r in bad.items()
    )
