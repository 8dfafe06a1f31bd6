"""The merge operators (csrc/merge.h): ``merge_branches`` (the forward's
log-sum-exp merge of the per-branch parts) and ``sum_branches`` (the
backward's sum of the per-branch gradients), the CPU kernel and the CUDA
kernel run by the CUDA emulator (tests/cuda_emulator), against a float64
reference of the formula, and against the float64 oracle of the whole op:
the per-branch oracle results of every call, placed into part buffers by the
view planner and merged, give the oracle's multi-branch out and lse."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import reference_attention

import ring_attention  # noqa: F401  (registers torch.ops.ring_attention)
from ring_attention.core.pattern import Pattern
from ring_attention.local.spans import plan_spans

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
TOL = {F64: 1e-12, F32: 1e-5, F16: 2e-3, BF16: 1e-2}
OPS = ("cpu", "emulated")


def _ops(which, request):
    return torch.ops.ring_attention if which == "cpu" else request.getfixturevalue("emu")


def _acc(dtype):
    return F64 if dtype == F64 else F32


def _reference(parts, part_lse, index, merge: bool):
    """float64 out (B, W, H, D) and lse (B, W, H) of the formula."""
    p = parts.double()
    s_, b, w, h = index.shape
    idx = index.long()
    valid = (idx >= 0) & (idx < p.shape[0])
    safe = torch.where(valid, idx, 0)
    rows = p[safe.reshape(-1)].view(s_, b, w, h, -1) * valid[..., None]
    if not merge:
        return rows.sum(0), None
    lse = torch.where(valid, part_lse.double()[safe], -math.inf)
    m = lse.amax(0)
    m_safe = torch.where(torch.isfinite(m), m, 0)
    wgt = torch.exp(lse - m_safe)
    total = wgt.sum(0)
    out = (wgt[..., None] * rows).sum(0) / torch.where(total > 0, total, 1)[..., None]
    lse_out = torch.where(total > 0, m_safe + torch.log(total), -math.inf)
    return out, lse_out


def _problem(dtype, d, slots=3, b=2, w=11, h=5, seed=0, strided=True):
    g = torch.Generator().manual_seed(seed)
    rows = slots * b * w * h // 2
    parts = torch.randn(rows, d, generator=g).to(dtype)
    part_lse = (3 * torch.randn(rows, generator=g)).to(_acc(dtype))
    # each part row named at most once; about a third of the entries name none
    perm = torch.randperm(slots * b * w * h, generator=g)
    index = torch.where(perm < rows, perm, -1).to(torch.int32).view(slots, b, w, h)
    index[0, 0, 0, 0] = rows + 5  # out of range: names no part
    index[:, 1, 2, 3] = -1  # a row with no part at all
    if strided:  # a window of a bigger (B, n, H, D) tensor; lse of a (B, H, n) one
        big = torch.full((b, w + 7, h, d), float("nan"), dtype=dtype)
        out = big[:, 3 : 3 + w]
        big_lse = torch.full((b, h, w + 7), float("nan"), dtype=_acc(dtype))
        lse = big_lse[:, :, 3 : 3 + w].transpose(1, 2)
    else:
        out = torch.full((b, w, h, d), float("nan"), dtype=dtype)
        lse = torch.full((b, w, h), float("nan"), dtype=_acc(dtype))
    return parts, part_lse, index, out, lse


@pytest.mark.parametrize("which", OPS)
@pytest.mark.parametrize("merge", [True, False], ids=["merge", "sum"])
@pytest.mark.parametrize(
    "dtype,d", [(BF16, 64), (F16, 24), (BF16, 20), (F32, 16), (F32, 6), (F64, 8), (F64, 3)]
)
@pytest.mark.parametrize("strided", [True, False])
def test_merge_matches_the_formula(which, merge, dtype, d, strided, request) -> None:
    ops = _ops(which, request)
    parts, part_lse, index, out, lse = _problem(dtype, d, strided=strided)
    if merge:
        ops.merge_branches(parts, part_lse, index, out, lse)
    else:
        ops.sum_branches(parts, index, out)
    want_out, want_lse = _reference(parts, part_lse, index, merge)
    torch.testing.assert_close(out.double(), want_out, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(out[1, 2, 3], torch.zeros_like(out[1, 2, 3]))
    if merge:
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
        assert lse[1, 2, 3] == -math.inf


@pytest.mark.parametrize("which", OPS)
def test_merge_propagates_nan_and_skips_minus_inf(which, request) -> None:
    ops = _ops(which, request)
    parts, part_lse, index, out, lse = _problem(BF16, 16, strided=False)
    index[:, 0, 1, 0] = -1
    index[0, 0, 1, 0], index[2, 0, 1, 0] = 1, 2
    part_lse[1] = float("nan")  # a NaN part beside a finite one: a NaN row
    index[:, 0, 2, 0] = -1
    index[0, 0, 2, 0] = 0
    part_lse[0] = -math.inf  # the only part reaches nothing: 0 and -inf
    ops.merge_branches(parts, part_lse, index, out, lse)
    assert torch.isnan(out[0, 1, 0]).all() and torch.isnan(lse[0, 1, 0])
    assert (out[0, 2, 0] == 0).all() and lse[0, 2, 0] == -math.inf


def _slot0_last(parts, part_lse, index):
    """The problem with the part rows slot 0 names moved after all others
    (the per-branch forward's order: branch 0 last), and how many others."""
    rows = parts.shape[0]
    first = index[0][(index[0] >= 0) & (index[0] < rows)].tolist()
    others = [i for i in range(rows) if i not in set(first)]
    order = torch.tensor(others + first)
    new = torch.empty_like(order)
    new[order] = torch.arange(rows)
    valid = (index >= 0) & (index < rows)
    index = torch.where(valid, new[index.clamp(0, rows - 1).long()].int(), index)
    return parts[order], part_lse[order], index, len(others)


@pytest.mark.parametrize("which", OPS)
@pytest.mark.parametrize("dtype,d", [(BF16, 64), (F16, 24), (F32, 16), (F32, 6), (F64, 3)])
@pytest.mark.parametrize("strided", [True, False])
def test_first_in_out_equals_the_parts_bit_for_bit(which, dtype, d, strided, request) -> None:
    """With ``first_in_out`` slot 0's part is read from the row's own out
    (its LSE from part_lse's rows after parts'): out and lse are exactly the
    merge of the same parts all in the buffer, NaN and -inf rows included."""
    ops = _ops(which, request)
    parts, part_lse, index, out, lse = _problem(dtype, d, strided=strided)
    parts, part_lse, index, others = _slot0_last(parts, part_lse, index)
    named = (index[0] >= 0) & (index[0] < parts.shape[0])
    first = index[0][named].long()
    part_lse[first[3]] = float("nan")  # slot 0's part NaN
    part_lse[first[7]] = -math.inf  # slot 0's part reaching nothing
    ops.merge_branches(parts, part_lse, index, out, lse)
    _, _, _, out_ip, lse_ip = _problem(dtype, d, strided=strided)  # NaN-filled
    out_ip[named] = parts[index[0][named].long()]
    ops.merge_branches(parts[:others], part_lse, index, out_ip, lse_ip, True)
    assert others < parts.shape[0]
    assert torch.equal(out.view(torch.uint8), out_ip.view(torch.uint8))
    assert torch.equal(lse.contiguous().view(torch.uint8), lse_ip.contiguous().view(torch.uint8))
    # the others' rows bound parts: slot 0 is bound by part_lse
    with pytest.raises(RuntimeError, match="part_lse must have shape"):
        ops.merge_branches(parts[:others], part_lse, index, out_ip, lse_ip)


def test_merge_checks_its_arguments() -> None:
    parts, part_lse, index, out, lse = _problem(F32, 8, strided=False)
    ops = torch.ops.ring_attention
    with pytest.raises(RuntimeError, match="index must be int32"):
        ops.merge_branches(parts, part_lse, index.long(), out, lse)
    with pytest.raises(RuntimeError, match="out must have parts' dtype"):
        ops.sum_branches(parts, index, out.double())
    with pytest.raises(RuntimeError, match="index must have shape"):
        ops.sum_branches(parts, index[:, :, :3], out)
    with pytest.raises(RuntimeError, match="lse must have dtype"):
        ops.merge_branches(parts, part_lse, index, out, lse.double())
    with pytest.raises(RuntimeError, match="at least parts' 165 rows"):
        ops.merge_branches(parts, part_lse[:-1], index, out, lse, True)
    with pytest.raises(RuntimeError, match="parts must be contiguous"):
        ops.sum_branches(torch.randn(8, parts.shape[0]).t(), index, out)
    with pytest.raises(RuntimeError, match="stride 1 in head_dim"):
        ops.sum_branches(parts, index, torch.randn(2, 11, 5, 16)[..., ::2])


def test_merge_opcheck() -> None:
    parts, part_lse, index, out, lse = _problem(F32, 8, strided=False)
    ops = torch.ops.ring_attention
    torch.library.opcheck(ops.merge_branches.default, (parts, part_lse, index, out, lse))
    torch.library.opcheck(ops.merge_branches.default, (parts, part_lse, index, out, lse, True))
    torch.library.opcheck(ops.sum_branches.default, (parts, index, out))


CASES = {
    "longnet-tails": ([8, 16, 32], [1, 2, 4], {}, 2, 150, 6, 6),
    "gqa-r6": ([12, 48], [1, 6], {"causal": True}, 1, 100, 24, 6),
    "grouped-groups": (
        [8, 24],
        [2, 3],
        {"head_offsets": "grouped", "head_groups": True},
        2,
        70,
        5,
        5,
    ),
}


@pytest.mark.parametrize("which", OPS)
@pytest.mark.parametrize("dtype", [F64, BF16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("first_in_out", [False, True])
def test_merged_branches_equal_the_oracle(which, dtype, case, first_in_out, request) -> None:
    """Each call's rows of its branch's float64 oracle result, merged by the
    operator, give the oracle's result of the whole pattern; with
    ``first_in_out`` branch 0's rows written into out (as the forward
    does), its LSE after the other parts' (the span's part order)."""
    ops = _ops(which, request)
    segs, dils, kw, batch, n, heads, d = CASES[case]
    pattern = Pattern(segs, dils, **kw)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, n, heads, d, generator=g, dtype=F64)
    kv = torch.randn(2, batch, n, heads, d, generator=g, dtype=F64)
    kwo = {"causal": pattern.causal, "grouped_offsets": pattern.head_offsets == "grouped"}
    want_out, want_lse = reference_attention(q, kv[0], kv[1], segs, dils, **kwo, **_hg(kw))
    per_branch = []
    for w, r in pattern.branches:
        o, lse_b = reference_attention(q, kv[0], kv[1], [w], [r], **kwo)
        per_branch.append((o, lse_b))
    plan = plan_spans(pattern, n, heads, heads, 40)
    out = torch.empty(batch, n, heads, d, dtype=dtype)
    lse = torch.empty(batch, heads, n, dtype=_acc(dtype))
    for i, window in enumerate(plan.spans):
        q_index, q_rows, _, _ = plan.index(i, batch, torch.device("cpu"))
        parts = torch.empty(q_rows, d, dtype=dtype)
        part_lse = torch.empty(q_rows, dtype=_acc(dtype))
        base, others = 0, q_rows
        for call in (window.calls[j] for j in window.part_order()):
            o, lse_b = per_branch[call.branch]
            rows = call.part_rows(batch)
            if first_in_out and call.branch == 0:
                others = min(others, base)
                call.view(out).copy_(call.view(o))
            else:
                view = parts.as_strided(*call.part_geometry(base, batch, False, d))
                view.copy_(call.view(o).permute(0, 1, 3, 2, 4))
            part_lse.as_strided(*call.part_geometry(base, batch, False, None)).copy_(
                call.lse_view(lse_b)
            )
            base += rows
        a, length = window.start, window.length
        ops.merge_branches(
            parts[:others] if first_in_out else parts,
            part_lse,
            q_index,
            out[:, a : a + length],
            lse[:, :, a : a + length].transpose(1, 2),
            first_in_out,
        )
    unreached = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), unreached)
    torch.testing.assert_close(lse[~unreached].double(), want_lse[~unreached], rtol=0, atol=1e-6)
    tol = 1e-12 if dtype == F64 else 1e-2
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)


def _hg(kw):
    return {"head_groups": kw.get("head_groups", False)}
