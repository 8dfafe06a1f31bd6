"""Keys the definition excludes never reach the output (docs/design.md §1, §5).

A NaN or an infinity in ``k`` or ``v`` at a padded key (``key_padding_mask``),
at a future key under causal attention, or at a key of another segment must
not change any row that does not reach that key: a kernel that multiplies a
zero weight by that row (0 · NaN = NaN) would. Rows that do reach it still get
NaN: inputs that are used are not hidden.
"""

from __future__ import annotations

import pytest
import torch
from oracle import multiplicity

import ring_attention as ra
from ring_attention.core import config

SEGS, DILS = [8, 16, 32], [1, 2, 4]


@pytest.fixture(autouse=True)
def _kernels_both_ways(monkeypatch):
    """The clean and the non-finite call take the same path, our kernels: a
    non-finite K/V always does (ring_attention/local/dispatch.py), and on CUDA the
    clean call would otherwise take the dense backends per branch, whose
    rounding differs from the kernel's."""
    monkeypatch.setenv(config.FORWARD, "kernel")
    monkeypatch.setenv(config.BACKWARD, "kernel")


def _inputs(n: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int, device: str):
    """q, k, v, grad_out (the same values on every device)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n, heads, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, n, kv_heads, 8, generator=g, dtype=torch.float64) for _ in range(2))
    go = torch.randn(2, n, heads, 8, generator=g, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v, go))


def _run(q, k, v, go, segs=SEGS, dils=DILS, **kw):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = ra.dilated_attention(q, k, v, segs, dils, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    return out.detach(), dq, dk, dv


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_never_reach_any_row(bad: float, dtype, causal: bool, device: str) -> None:
    n, heads, kv_heads = 45, 4, 2
    q, k, v, go = _inputs(n, heads, kv_heads, dtype, seed=3, device=device)
    mask = torch.zeros(2, n, dtype=torch.bool, device=device)
    padded = [0, 5, 17, 30, 44]
    mask[:, padded] = True
    kw = dict(causal=causal, key_padding_mask=mask)
    want = _run(q, k, v, go, **kw)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, padded] = bad
    v_bad[:, padded] = bad
    got = _run(q, k_bad, v_bad, go, **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.isfinite(a).all(), f"{name}: a padded key's {bad} reached it"
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
    assert (got[2][:, padded] == 0).all() and (got[3][:, padded] == 0).all()


# u = 16 starts a segment of the first two branches: under causal attention
# row 16 reaches key 16 alone there, so its scores in that tile are NaN and
# -inf only (no finite maximum to shift by).
@pytest.mark.parametrize("u", [20, 16])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unreached_keys_leave_other_rows_alone(u: int, where: str, causal: bool, dtype, device):
    """NaN at key u: rows reaching u become NaN, every other row (earlier
    queries under causal, other segments, other offsets) is unchanged, forward
    and dq."""
    n, heads = 45, 3
    q, k, v, go = _inputs(n, heads, heads, dtype, seed=5, device=device)
    want = _run(q, k, v, go, causal=causal)
    k_bad, v_bad = k.clone(), v.clone()
    (k_bad if where == "k" else v_bad)[:, u] = float("nan")
    got = _run(q, k_bad, v_bad, go, causal=causal)
    reaches = multiplicity(n, heads, SEGS, DILS, causal)[:, :, u] > 0  # (heads, n)
    rows = reaches.t()[None, :, :].expand(2, n, heads).to(device)  # (batch, n, heads)
    assert rows.any() and (~rows).any()
    out, dq = got[0], got[1]
    assert torch.isnan(out[rows]).any(dim=-1).all(), "a row that reaches the NaN key hid it"
    torch.testing.assert_close(out[~rows], want[0][~rows])
    torch.testing.assert_close(dq[~rows], want[1][~rows])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_unreached_keys_leave_other_keys_gradients_alone(bad, where, causal, dtype, device):
    """A non-finite key u: dk and dv of every key that no row reaching u also
    reaches stay what they were (a row whose lse is NaN must not turn the
    zero weights of its masked keys into NaN: exp(-inf - NaN))."""
    n, heads, u = 45, 3, 20
    q, k, v, go = _inputs(n, heads, heads, dtype, seed=6, device=device)
    want = _run(q, k, v, go, causal=causal)
    k_bad, v_bad = k.clone(), v.clone()
    (k_bad if where == "k" else v_bad)[:, u] = bad
    got = _run(q, k_bad, v_bad, go, causal=causal)
    reach = multiplicity(n, heads, SEGS, DILS, causal) > 0  # (heads, query, key)
    shares_a_row = (reach & reach[:, :, u : u + 1]).any(dim=1).t().to(device)  # (key, head)
    assert (~shares_a_row).any() and shares_a_row.any()
    for name, a, b in (("dk", got[2], want[2]), ("dv", got[3], want[3])):
        a, b = a[:, ~shares_a_row], b[:, ~shares_a_row]
        assert torch.isfinite(a).all(), f"{name}: the non-finite key reached an unrelated key"
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bad_key_in_whole_tiles_reaches_exactly_its_rows(bad, causal, dtype, device) -> None:
    """A segment of 256 rows: on CUDA (bf16) tiles that every row of a thread
    block reaches whole, where the kernels skip zeroing bad rows. A
    non-finite K and V row u makes every row reaching it non-finite (out and
    dq) and leaves every other row exactly as it was: causal, the rows
    before u; the next segment."""
    n, heads, u, w = 300, 2, 150, 256
    g = torch.Generator().manual_seed(9)
    q, k, v, go = (
        torch.randn(1, n, heads, 64, generator=g).to(device=device, dtype=dtype) for _ in range(4)
    )
    kw = dict(segs=[w], dils=[1], causal=causal)
    out_c, dq_c, _, _ = _run(q, k, v, go, **kw)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, u] = bad
    v_bad[:, u] = bad
    out, dq, _, _ = _run(q, k_bad, v_bad, go, **kw)
    first = u if causal else 0  # the rows that reach key u
    assert not torch.isfinite(out[0, first:w]).any(dim=-1).any()
    assert not torch.isfinite(dq[0, first:w]).all(dim=-1).any()
    for rows in (slice(0, first), slice(w, n)):
        torch.testing.assert_close(out[0, rows], out_c[0, rows], rtol=0, atol=0)
        torch.testing.assert_close(dq[0, rows], dq_c[0, rows], rtol=0, atol=0)


# ---------------------------------------------------------------- CUDA kernels
# The same properties for the CUDA kernels, run by the CPU emulator
# (tests/cuda_emulator; the ``emu`` fixture is in conftest.py), through the block operators.

EMU_PATHS = {  # name: (dtype, head_dim, compute capability)
    "mma64-bf16": (torch.bfloat16, 64, 90),
    "mma128-fp16": (torch.float16, 128, 80),
    "simt-f32": (torch.float32, 32, 90),
    "simt-f64": (torch.float64, 16, 90),
    "simt-fp16-sm75": (torch.float16, 24, 75),
}


def _emu_run(emu, cfg, q, k, v, go, mask):
    from op_helpers import acc_dtype, block_backward, block_forward, fresh_acc

    out, lse = fresh_acc(q)
    block_forward(cfg, q, k, v, out, lse, 0, 0, mask, ops=emu)
    grads = tuple(torch.zeros(x.shape, dtype=acc_dtype(q.dtype)) for x in (q, k, v))
    block_backward(cfg, go, q, k, v, out.to(q.dtype), lse, *grads, 0, 0, mask, ops=emu)
    return (out, *grads)


@pytest.mark.parametrize("path", list(EMU_PATHS))
def test_emulated_cuda_kernels_keep_excluded_keys_out(emu, path: str) -> None:
    """NaN in k and v at padded keys and at key u (causal): rows that do not
    reach them are unchanged (out, dq; dk and dv of the other keys), rows
    that reach u get NaN, padded keys get zero gradients."""
    from op_helpers import Cfg

    dtype, d, cc = EMU_PATHS[path]
    emu.configure(0, cc)
    n, heads = 70, 2
    cfg = Cfg(1, n, heads, d, [32, 64], [1, 2], causal=True, mask=True)
    g = torch.Generator().manual_seed(11)
    q, k, v, go = (torch.randn(1, n, heads, d, generator=g).to(dtype) for _ in range(4))
    mask = torch.zeros(1, n, dtype=torch.bool)
    padded = [3, 40, 41]
    mask[:, padded] = True
    u = 50
    want = _emu_run(emu, cfg, q, k, v, go, mask)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, padded] = float("nan")
    v_bad[:, padded] = float("inf")
    v_bad[:, u] = float("nan")
    got = _emu_run(emu, cfg, q, k_bad, v_bad, go, mask)
    keep = ~mask[0]
    reach = multiplicity(n, heads, cfg.segment_lengths, cfg.dilation_rates, True)
    reach = reach * keep.double()  # the mask removes keys from every branch
    rows_u = (reach[:, :, u] > 0).t()[None]  # (1, n, heads): rows reaching u
    assert rows_u.any() and (~rows_u).any()
    out, dq, dk, dv = got
    assert torch.isnan(out[rows_u]).all(dim=-1).all(), path
    torch.testing.assert_close(out[~rows_u], want[0][~rows_u], msg=lambda m: f"{path} out: {m}")
    torch.testing.assert_close(dq[~rows_u], want[1][~rows_u], msg=lambda m: f"{path} dq: {m}")
    assert (dk[:, padded] == 0).all() and (dv[:, padded] == 0).all(), path
    # keys that no row reaching u reaches keep their gradients
    tainted = (reach * rows_u[0].t()[:, :, None].double()).sum(dim=1) > 0  # (heads, keys)
    clean = ~tainted.t()[None]  # (1, n, heads) over keys
    clean[:, u] = False
    torch.testing.assert_close(dk[clean], want[2][clean], msg=lambda m: f"{path} dk: {m}")
    torch.testing.assert_close(dv[clean], want[3][clean], msg=lambda m: f"{path} dv: {m}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("path", ["mma64-bf16", "mma128-fp16"])
def test_emulated_tensor_core_kernels_on_whole_key_tiles(emu, path: str, causal: bool) -> None:
    """Tiles every row of a block reaches whole skip the zeroing of
    non-finite K / V rows. Not causal, every tile of a 128-row segment is
    such a tile: a NaN (or inf) K / V row there reaches every row of the
    segment through the products. Causal, the tiles on the diagonal are not:
    rows before the bad key stay exactly as they were, the rows from it on
    become non-finite. The next segment's rows never change."""
    from op_helpers import Cfg

    dtype, d, cc = EMU_PATHS[path]
    emu.configure(0, cc)
    n, heads, u = 150, 1, 70
    cfg = Cfg(1, n, heads, d, [128], [1], causal=causal)  # rows 0-127: one block
    g = torch.Generator().manual_seed(5)
    q, k, v, go = (torch.randn(1, n, heads, d, generator=g).to(dtype) for _ in range(4))
    want = _emu_run(emu, cfg, q, k, v, go, None)
    first = u if causal else 0  # the rows that reach key u
    for bad in (float("nan"), float("inf")):
        k_bad, v_bad = k.clone(), v.clone()
        k_bad[:, u] = bad
        v_bad[:, u] = bad
        out, dq, dk, dv = _emu_run(emu, cfg, q, k_bad, v_bad, go, None)
        assert not torch.isfinite(out[0, first:128]).any(dim=-1).any(), (path, bad)
        assert not torch.isfinite(dq[0, first:128]).all(dim=-1).any(), (path, bad)
        for rows in (slice(0, first), slice(128, n)):
            torch.testing.assert_close(out[0, rows], want[0][0, rows], rtol=0, atol=0)
            torch.testing.assert_close(dq[0, rows], want[1][0, rows], rtol=0, atol=0)
        torch.testing.assert_close(dk[0, 128:], want[2][0, 128:], rtol=0, atol=0)
        torch.testing.assert_close(dv[0, 128:], want[3][0, 128:], rtol=0, atol=0)
