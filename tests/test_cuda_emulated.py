"""The CUDA block kernels, run on the CPU by the emulator in tests/cuda_emulator.

``csrc/cuda/block_{forward,backward}.cu`` are compiled for the CPU against
``tests/cuda_emulator/runtime.h`` (each thread block runs as 128 cooperative
fibers; shuffles, votes, barriers and ``mma.sync`` are done in software, with
the PTX fragment layouts) and checked like the CPU kernels (test_local_op.py, test_block_ops.py):
against the float64 oracle, forward and backward, on every kernel path (the
tensor-core kernels for each padded head dim, aligned or not; the SIMT kernels
for float32, float64, fp16/bf16 before sm_80 and head_dim > 128), ragged
lengths, causal, ``head_groups`` with odd head counts, ``key_padding_mask``,
query/key blocks at offsets, rows that are never reached. Results must not
depend on the order in which threads and blocks run (a missing barrier or two
blocks writing one row would make them), and shared memory is poisoned with
NaN and bounded exactly.

This verifies the kernels' logic, not the hardware: speed, occupancy and the
real memory system are measured by ``scripts/gpu_check.sh`` on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from op_helpers import (
    GRAD_TOL,
    LSE_TOL,
    OUT_TOL,
    UNREACHED_CASES,
    Cfg,
    acc_dtype,
    block_backward,
    block_forward,
    close,
    close_grads,
    fresh_acc,
    lse_grad,
    make_inputs,
    reached_rows,
    run_oracle,
    splits,
)
from oracle import reference_attention

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16


# Kernel paths: (dtype, head_dim, compute capability). The dispatch in
# csrc/cuda/*.cu picks the tensor-core kernels for fp16/bf16 on sm_80+ (the
# forward up to head_dim 256, the backward up to 128; padded head dim 64, 96,
# 128, 192 or 256; 16-byte loads when head_dim % 8 == 0), else the SIMT
# kernels (lanes per row: head_dim <= 64, <= 128, more).
PATHS = {
    "mma64-bf16": (BF16, 64, 90),
    "mma64-fp16-unvectorised": (F16, 20, 80),
    "mma96-fp16": (F16, 80, 90),
    "mma128-bf16": (BF16, 128, 90),
    "simt-f32-d32": (F32, 32, 90),
    "simt-f32-d72": (F32, 72, 90),
    "simt-f32-d136": (F32, 136, 90),
    "simt-f64": (F64, 16, 90),
    "simt-fp16-sm75": (F16, 24, 75),
    # head_dim > 128: the forward on tensor cores, the backward SIMT
    "mma192-bf16-d160": (BF16, 160, 90),
    "mma256-fp16": (F16, 256, 80),
}

# (segment_lengths, dilation_rates, heads, head_groups, mask, batch): segments
# of more than 64 active rows (several query and key tiles), lengths that
# divide nothing, odd head counts, every branch active at once. Two batch rows
# (each its own mask row) in one pattern per path: the batch strides need no
# more, and a second row doubles an emulated case's time.
PATTERNS = {
    "two-branches": ([40, 150], [1, 2], 3, False, False, 1),
    "longnet-groups-mask": ([16, 32, 64, 128], [1, 2, 4, 2], 5, True, True, 2),
    "dense-mask": ([256], [1], 1, False, True, 1),
    # values far beyond the sequence (the kernels see them clamped, pattern.h)
    "huge-values": ([2**63 - 1, 2**40], [2**63 - 1, 3], 3, False, True, 1),
}


def alternating(paths, cases) -> list:
    """(path, case, causal) for every path and case, ``causal`` alternating
    along both: each pair runs once, and each path and each case runs both
    causal and not (the full product doubles the emulated time and adds no
    pair that this leaves out)."""
    return [
        pytest.param(p, c, bool((i + j) % 2), id=f"{p}-{c}-{'causal' if (i + j) % 2 else 'full'}")
        for i, p in enumerate(paths)
        for j, c in enumerate(cases)
    ]


def _cfg(path: str, pattern: str, causal: bool, n: int = 150, batch: int | None = None) -> Cfg:
    _, d, _ = PATHS[path]
    ws, rs, heads, hg, mask, rows = PATTERNS[pattern]
    if batch is None:
        batch = rows
    if d > 128 or PATHS[path][0] == F64:
        batch = 1  # the emulated SIMT kernels are slow; one batch row suffices
    return Cfg(batch, n, heads, d, ws, rs, causal, hg, None, mask)


def _forward(emu, cfg: Cfg, q, k, v, kpm, q_start=0, k_start=0, acc=None):
    out, lse = acc if acc is not None else fresh_acc(q)
    block_forward(cfg, q, k, v, out, lse, q_start, k_start, kpm, ops=emu)
    return out, lse


def _backward(
    emu, cfg: Cfg, go, q, k, v, out, lse, kpm, q_start=0, k_start=0, grads=None, glse=None
):
    if grads is None:
        grads = tuple(torch.zeros(x.shape, dtype=acc_dtype(q.dtype)) for x in (q, k, v))
    block_backward(cfg, go, q, k, v, out, lse, *grads, q_start, k_start, kpm, ops=emu, glse=glse)
    return grads


def _forward_backward(emu, cfg: Cfg, q, k, v, go, kpm, glse=None):
    out, lse = _forward(emu, cfg, q, k, v, kpm)
    dq, dk, dv = _backward(emu, cfg, go, q, k, v, out.to(q.dtype), lse, kpm, glse=glse)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize(("path", "pattern", "causal"), alternating(PATHS, PATTERNS))
def test_kernels_match_oracle(emu, path, pattern, causal) -> None:
    dtype, _, cc = PATHS[path]
    emu.configure(0, cc)
    cfg = _cfg(path, pattern, causal)
    seed = 7 * list(PATHS).index(path) + 2 * list(PATTERNS).index(pattern) + causal
    q, k, v, go, kpm = make_inputs(cfg, dtype, "cpu", seed)
    out, lse, dq, dk, dv = _forward_backward(emu, cfg, q, k, v, go, kpm)
    r_out, r_lse, r_dq, r_dk, r_dv = run_oracle(cfg, q, k, v, go, kpm)
    ctx = f"{path} {pattern} causal={causal} seed={seed}"
    launches, blocks = emu.take_stats()[:2]
    assert launches > 0 and blocks > 0, ctx
    close(out, r_out, OUT_TOL[dtype], "out", ctx)
    close(lse, r_lse, LSE_TOL[dtype], "lse", ctx)
    close_grads((dq, dk, dv), (r_dq, r_dk, r_dv), dtype, ctx)


SPLIT_PATHS = ["mma64-bf16", "mma128-bf16", "simt-f32-d32", "simt-f64"]


def _check_blocks_at_offsets(emu, cfg: Cfg, dtype, seed: int, path: str, with_glse=False) -> None:
    """Query blocks x key blocks at offsets (a ring's calls; forward merged in
    random order, backward accumulated in place), with an lse gradient when
    ``with_glse``, against the float64 oracle."""
    rng = random.Random(seed)
    q, k, v, go, kpm = make_inputs(cfg, dtype, "cpu", seed)
    glse = lse_grad(cfg, "cpu", seed + 1) if with_glse else None
    r_out, r_lse, r_dq, r_dk, r_dv = run_oracle(cfg, q, k, v, go, kpm, glse)
    q_blocks, k_blocks = splits(cfg.n, 2, rng), splits(cfg.n, 3, rng)
    ctx = f"{path} causal={cfg.causal} q={q_blocks} k={k_blocks}"

    out, lse = fresh_acc(q)
    for qa, qb in q_blocks:
        acc = fresh_acc(q[:, qa:qb])
        for ka, kb in rng.sample(k_blocks, len(k_blocks)):
            _forward(emu, cfg, q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], kpm[:, ka:kb], qa, ka, acc)
        out[:, qa:qb], lse[:, :, qa:qb] = acc
    close(out, r_out, OUT_TOL[dtype], "out", ctx)
    close(lse, r_lse, LSE_TOL[dtype], "lse", ctx)

    final = out.to(dtype)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc_dtype(dtype)) for x in (q, k, v))
    for qa, qb in q_blocks:
        glse_b = None if glse is None else glse[:, :, qa:qb].contiguous()
        for ka, kb in k_blocks:
            grads = (dq[:, qa:qb], dk[:, ka:kb], dv[:, ka:kb])
            args = (go[:, qa:qb], q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], final[:, qa:qb])
            args = tuple(a.contiguous() for a in args)
            parts = tuple(g.clone() for g in grads)
            lse_b, mask_b = lse[:, :, qa:qb].contiguous(), kpm[:, ka:kb].contiguous()
            _backward(emu, cfg, *args, lse_b, mask_b, qa, ka, parts, glse_b)
            for g, p in zip(grads, parts, strict=True):
                g.copy_(p)
    close_grads((dq, dk, dv), (r_dq, r_dk, r_dv), dtype, ctx)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("path", SPLIT_PATHS)
def test_blocks_at_offsets_match_oracle(emu, path, causal) -> None:
    """Query blocks x key blocks at offsets (a ring's calls), merged in random order."""
    dtype, _, cc = PATHS[path]
    emu.configure(0, cc)
    cfg = _cfg(path, "longnet-groups-mask", causal, n=170, batch=1)
    seed = 40 + SPLIT_PATHS.index(path) * 2 + causal
    _check_blocks_at_offsets(emu, cfg, dtype, seed, path)


@pytest.mark.parametrize("path", ["mma64-bf16", "mma96-fp16", "simt-f32-d32", "simt-fp16-sm75"])
def test_results_do_not_depend_on_the_schedule(emu, path) -> None:
    """Fibers and blocks in other orders give bitwise the same results (dense
    causal, 200 rows: several query tiles and up to four key tiles in flight)."""
    dtype, _, cc = PATHS[path]
    cfg = _cfg(path, "dense-mask", True, n=200)
    q, k, v, go, kpm = make_inputs(cfg, dtype, "cpu", seed=61)
    results = []
    for seed in (0, 1, 2):
        emu.configure(seed, cc)
        results.append(_forward_backward(emu, cfg, q, k, v, go, kpm))
    names = ("out", "lse", "dq", "dk", "dv")
    for other in results[1:]:
        for name, a, b in zip(names, results[0], other, strict=True):
            assert torch.equal(a, b), f"{path}: {name} changed with the schedule"


def _check_unreached_rows_are_never_read(emu, cfg, dtype, seed, qr, kr, ctx) -> None:
    """Query block qr against key block kr, with NaN in every key row of kr
    that no query of qr reaches: bitwise the results of the clean rows."""
    (qa, qb), (ka, kb) = qr, kr
    q, k, v, go, _ = make_inputs(cfg, dtype, "cpu", seed=seed)
    reached = reached_rows(cfg, qr, kr)
    assert reached.any() and not reached.all(), ctx
    qb_, go_b = q[:, qa:qb].contiguous(), go[:, qa:qb].contiguous()
    kc, vc = k[:, ka:kb].contiguous(), v[:, ka:kb].contiguous()
    kn, vn = kc.clone(), vc.clone()
    kn[:, ~reached] = float("nan")
    vn[:, ~reached] = float("nan")
    whole_out, whole_lse = _forward(emu, cfg, q, k, v, None)
    out_f = whole_out[:, qa:qb].to(dtype).contiguous()
    lse_f = whole_lse[:, :, qa:qb].contiguous()
    res = []
    for kk, vv in ((kc, vc), (kn, vn)):
        out, lse = _forward(emu, cfg, qb_, kk, vv, None, qa, ka)
        grads = _backward(emu, cfg, go_b, qb_, kk, vv, out_f, lse_f, None, qa, ka)
        res.append((out, lse, *grads))
    (out_c, lse_c, dq_c, dk_c, dv_c), (out_n, lse_n, dq_n, dk_n, dv_n) = res
    assert torch.isfinite(out_n).all() and torch.isfinite(dq_n).all(), ctx
    close(out_n, out_c, 0.0, "out", ctx)
    close(lse_n, lse_c, 0.0, "lse", ctx)
    close(dq_n, dq_c, 0.0, "dq", ctx)
    close(dk_n[:, reached], dk_c[:, reached], 0.0, "dk", ctx)
    close(dv_n[:, reached], dv_c[:, reached], 0.0, "dv", ctx)


@pytest.mark.parametrize("path", ["mma64-bf16", "simt-f32-d32"])
@pytest.mark.parametrize("case", range(len(UNREACHED_CASES)))
def test_never_read_unreached_rows(emu, case, path) -> None:
    """NaN in key/value rows no query of the block reaches changes nothing."""
    dtype, d, cc = PATHS[path]
    emu.configure(0, cc)
    ws, rs, causal, hg, (qa, qb), (ka, kb) = UNREACHED_CASES[case]
    cfg = Cfg(1, 48, 5, d, ws, rs, causal, hg, 0.3)
    _check_unreached_rows_are_never_read(
        emu, cfg, dtype, 300 + case, (qa, qb), (ka, kb), f"{path} case={case}"
    )


@pytest.mark.parametrize("path", ["mma64-bf16", "simt-f32-d32"])
def test_fully_masked_batch_reaches_nothing(emu, path) -> None:
    """A batch row whose keys are all padding: out 0, lse -inf, no gradient, no NaN."""
    dtype, d, cc = PATHS[path]
    emu.configure(0, cc)
    cfg = Cfg(2, 90, 3, d, [30, 90], [1, 3], True, False, None, True)
    q, k, v, go, _ = make_inputs(cfg, dtype, "cpu", seed=71)
    kpm = torch.zeros(2, 90, dtype=torch.bool)
    kpm[0] = True
    out, lse, dq, dk, dv = _forward_backward(emu, cfg, q, k, v, go, kpm)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isneginf(lse[0]).all()
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all() and torch.equal(g[0], torch.zeros_like(g[0]))
    r_out, r_lse, *_ = run_oracle(cfg, q, k, v, go, kpm)
    close(out[1], r_out[1], OUT_TOL[dtype], "out", path)
    close(lse[1], r_lse[1], LSE_TOL[dtype], "lse", path)


@pytest.mark.parametrize("path", ["mma64-bf16", "simt-f32-d32"])
def test_backward_computes_only_the_gradients_asked_for(emu, path) -> None:
    """dq alone (one launch per branch) or dk with dv alone give the same bits."""
    dtype, _, cc = PATHS[path]
    emu.configure(0, cc)
    cfg = _cfg(path, "longnet-groups-mask", True, n=100, batch=1)
    q, k, v, go, kpm = make_inputs(cfg, dtype, "cpu", seed=75)
    out, lse = _forward(emu, cfg, q, k, v, kpm)
    out = out.to(dtype)
    full = _backward(emu, cfg, go, q, k, v, out, lse, kpm)
    emu.take_stats()
    acc = acc_dtype(dtype)
    dq = torch.zeros(q.shape, dtype=acc)
    block_backward(cfg, go, q, k, v, out, lse, dq, None, None, 0, 0, kpm, ops=emu)
    dq_launches = emu.take_stats()[0]
    dk, dv = torch.zeros(k.shape, dtype=acc), torch.zeros(v.shape, dtype=acc)
    block_backward(cfg, go, q, k, v, out, lse, None, dk, dv, 0, 0, kpm, ops=emu)
    dkdv_launches = emu.take_stats()[0]
    # delta pre-kernel + one launch per branch each
    assert dq_launches == dkdv_launches == 1 + len(cfg.segment_lengths)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), full, strict=True):
        assert torch.equal(got, want), name


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of x whose data pointer is 2 bytes past 16-byte alignment."""
    flat = torch.empty(x.numel() + 8, dtype=x.dtype)
    base = (16 - flat.data_ptr() % 16) % 16 // x.element_size()
    y = flat[base + 1 : base + 1 + x.numel()].view(x.shape)
    y.copy_(x)
    assert y.is_contiguous() and y.data_ptr() % 16 != 0
    return y


def test_misaligned_inputs_take_the_scalar_loads(emu) -> None:
    """Unaligned q/k/v/grad_out (16-byte loads impossible) give the same bits."""
    emu.configure(0, 90)
    cfg = _cfg("mma64-bf16", "longnet-groups-mask", True, n=100, batch=1)
    q, k, v, go, kpm = make_inputs(cfg, BF16, "cpu", seed=81)
    aligned = _forward_backward(emu, cfg, q, k, v, go, kpm)
    shifted = _forward_backward(emu, cfg, *(_misaligned(x) for x in (q, k, v, go)), kpm)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), aligned, shifted, strict=True):
        assert torch.equal(a, b), name


def test_empty_key_block_is_a_noop(emu) -> None:
    emu.configure(0, 90)
    cfg = Cfg(1, 40, 2, 64, [8, 16], [1, 2], False)
    q, k, v, _, _ = make_inputs(cfg, BF16, "cpu", seed=91)
    out, lse = _forward(emu, cfg, q, k, v, None)
    before = (out.clone(), lse.clone())
    _forward(emu, cfg, q, k[:, :0], v[:, :0], None, 0, 40, (out, lse))
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])


def test_compute_capability_selects_the_kernel(emu) -> None:
    """fp16 runs the tensor-core kernel on sm_80 and the SIMT one on sm_75; both exact."""
    cfg = Cfg(1, 70, 3, 32, [20, 70], [1, 2], True)
    q, k, v, _, _ = make_inputs(cfg, F16, "cpu", seed=101)
    ref, ref_lse = reference_attention(
        *(x.to(F64) for x in (q, k, v)), cfg.segment_lengths, cfg.dilation_rates, causal=True
    )
    blocks = []
    for cc in (80, 75):
        emu.configure(0, cc)
        emu.take_stats()
        out, lse = _forward(emu, cfg, q, k, v, None)
        blocks.append(emu.take_stats()[1])
        close(out, ref, OUT_TOL[F16], "out", f"sm_{cc}")
        close(lse, ref_lse, LSE_TOL[F16], "lse", f"sm_{cc}")
    # 128-row tiles (tensor cores, head_dim 32) against 8-row tiles (SIMT, head_dim 32 fp16)
    assert blocks[0] < blocks[1], blocks


# ------------------------------------------- grouped K/V heads, documents, grouped offsets

# Cfg fields past the path's head_dim: (segment_lengths, dilation_rates, heads,
# kv_heads, head_groups, grouped_offsets, mask, cu_seqlens). Documents with
# empty and length-1 ones, one of 67 tokens (two 64-row tiles), boundaries
# that are not multiples of any tile.
FEATURES = {
    "gqa-documents": ([40, 150], [1, 3], 6, 2, False, False, True, [0, 1, 1, 50, 53, 120, 150]),
    # 4 query heads per K/V head: tiles of 4 (r = 1) and 2 (r = 2) heads.
    "mqa-packed-tiles": ([24, 150], [1, 2], 4, 1, False, False, True, [0, 70, 71, 150]),
    "mqa-groups-grouped-offsets": (
        [16, 64, 128],
        [1, 2, 4],
        5,
        1,
        True,
        True,
        False,
        [0, 100, 100, 150],
    ),
}


def _feature_cfg(path: str, feature: str, causal: bool, n: int = 150) -> Cfg:
    _, d, _ = PATHS[path]
    ws, rs, heads, kv_heads, hg, grouped, mask, bounds = FEATURES[feature]
    return Cfg(1, n, heads, d, ws, rs, causal, hg, None, mask, kv_heads, grouped, bounds)


@pytest.mark.parametrize(("path", "feature", "causal"), alternating(PATHS, FEATURES))
def test_features_match_oracle(emu, path, feature, causal) -> None:
    """Grouped K/V heads, documents, grouped offsets and grad_lse on every kernel path."""
    dtype, _, cc = PATHS[path]
    emu.configure(0, cc)
    cfg = _feature_cfg(path, feature, causal)
    seed = 900 + 7 * list(PATHS).index(path) + 2 * list(FEATURES).index(feature) + causal
    q, k, v, go, kpm = make_inputs(cfg, dtype, "cpu", seed)
    glse = lse_grad(cfg, "cpu", seed + 1)
    out, lse, dq, dk, dv = _forward_backward(emu, cfg, q, k, v, go, kpm, glse)
    r_out, r_lse, r_dq, r_dk, r_dv = run_oracle(cfg, q, k, v, go, kpm, glse)
    ctx = f"{path} {feature} causal={causal} seed={seed}"
    assert dk.shape == k.shape and dv.shape == v.shape, ctx
    close(out, r_out, OUT_TOL[dtype], "out", ctx)
    close(lse, r_lse, LSE_TOL[dtype], "lse", ctx)
    close_grads((dq, dk, dv), (r_dq, r_dk, r_dv), dtype, ctx)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("path", SPLIT_PATHS)
def test_blocks_with_features_at_offsets(emu, path, causal) -> None:
    """Query x key blocks whose boundaries share nothing with the documents,
    with grouped K/V heads and an lse gradient, against the oracle."""
    dtype, _, cc = PATHS[path]
    emu.configure(0, cc)
    cfg = _feature_cfg(path, "gqa-documents", causal)
    seed = 960 + SPLIT_PATHS.index(path) * 2 + causal
    _check_blocks_at_offsets(emu, cfg, dtype, seed, path, with_glse=True)


@pytest.mark.parametrize("path", ["mma64-bf16", "simt-f32-d32"])
def test_heads_sharing_keys_share_tiles(emu, path) -> None:
    """With 4 query heads per K/V head a query tile holds 4 heads x a quarter
    of the positions: 4 times the windows, 3 in 4 head blocks idle."""
    dtype, d, cc = PATHS[path]
    emu.configure(0, cc)
    blocks = []
    for kv_heads in (8, 2):
        cfg = Cfg(1, 128, 8, d, [128], [1], False, False, None, False, kv_heads)
        q, k, v, _, _ = make_inputs(cfg, dtype, "cpu", seed=970)
        emu.take_stats()
        _forward(emu, cfg, q, k, v, None)
        blocks.append(emu.take_stats()[1])
    assert blocks[1] == 4 * blocks[0], blocks


@pytest.mark.parametrize("path", ["mma64-bf16", "simt-f32-d32"])
def test_features_do_not_depend_on_the_schedule(emu, path) -> None:
    """The dk/dv block of a key-sharing head set sums over its query heads:
    bitwise the same results in any block and fiber order."""
    dtype, _, cc = PATHS[path]
    cfg = _feature_cfg(path, "mqa-packed-tiles", True)
    q, k, v, go, kpm = make_inputs(cfg, dtype, "cpu", seed=980)
    glse = lse_grad(cfg, "cpu", seed=981)
    results = []
    for seed in (0, 1, 2):
        emu.configure(seed, cc)
        results.append(_forward_backward(emu, cfg, q, k, v, go, kpm, glse))
    for other in results[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[0], other, strict=True):
            assert torch.equal(a, b), f"{path}: {name} changed with the schedule"


@pytest.mark.parametrize("path", ["mma64-bf16", "simt-f32-d32"])
@pytest.mark.parametrize("case", range(len(UNREACHED_CASES)))
def test_features_never_read_unreached_rows(emu, case, path) -> None:
    """Grouped K/V heads and documents: NaN in key rows no query of the block
    reaches (for any query head of the K/V head) changes nothing."""
    dtype, d, cc = PATHS[path]
    emu.configure(0, cc)
    ws, rs, causal, hg, (qa, qb), (ka, kb) = UNREACHED_CASES[case]
    cfg = Cfg(1, 48, 6, d, ws, rs, causal, hg, 0.3, False, 2, case % 2 == 1)
    cfg.cu_seqlens = [0, 5, 5, 19, 20, 33, 48]
    _check_unreached_rows_are_never_read(
        emu, cfg, dtype, 990 + case, (qa, qb), (ka, kb), f"{path} case={case}"
    )


# Opt-in shared memory per block of each architecture (KiB; the emulator's
# configure() uses the same table) and the launches that exceed it: the SIMT
# kernels' widest tier (head_dim > 128: 32 lanes x 8 values per row) needs
# 64.2 KiB (fp32 accumulators) or 128.3 KiB (fp64); fp64 at head_dim <= 128
# needs 64.3 KiB.
SMEM_KIB = {70: 96, 75: 64, 80: 163, 86: 99, 89: 99, 90: 227}


def _refused(cc: int, dtype: torch.dtype, d: int) -> bool:
    if dtype == F64:
        need_kib = 33 if d <= 64 else 65 if d <= 128 else 130
    elif d > 128:
        need_kib = 65
    else:
        return False  # tensor-core or narrower SIMT tiers: at most 85 KiB, within every limit
    return need_kib > SMEM_KIB[cc]


@pytest.mark.parametrize("cc", list(SMEM_KIB))
def test_every_launch_fits_the_architecture_or_is_refused_before_it(emu, cc) -> None:
    """Every kernel the dispatch can choose (dtype x head_dim tier x forward /
    backward) on each architecture: it runs and matches the oracle, or it is
    refused with a clear error naming the shared memory (never launched past
    the limit). The dtype select_dtype picks there runs at every head_dim up to 128."""
    refused = set()
    for dtype in (F16, BF16, F32, F64):
        for d in (64, 96, 128, 160):
            emu.configure(0, cc)
            cfg = Cfg(1, 9, 2, d, [4, 8], [1, 2], True)
            q, k, v, go, kpm = make_inputs(cfg, dtype, "cpu", seed=d)
            try:
                got = _forward_backward(emu, cfg, q, k, v, go, kpm)
            except RuntimeError as e:
                assert "shared memory" in str(e), (cc, dtype, d, e)
                refused.add((dtype, d))
                continue
            want = run_oracle(cfg, q, k, v, go, kpm)
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
                tol = (
                    LSE_TOL[dtype]
                    if name == "lse"
                    else OUT_TOL[dtype]
                    if name == "out"
                    else GRAD_TOL[dtype]
                )
                close(a, b, tol, name, (cc, dtype, d))
    expected = {
        (t, d) for t in (F16, BF16, F32, F64) for d in (64, 96, 128, 160) if _refused(cc, t, d)
    }
    assert refused == expected, (cc, sorted(map(str, refused)))
    chosen = BF16 if cc >= 80 else F16  # select_dtype's choice on that architecture
    assert not any(t == chosen and d <= 128 for t, d in refused)


def test_kernel_counts_script_reports_the_instruction_mix(emu) -> None:
    """tests/kernel_counts.py runs the tensor-core kernels in the emulator
    and reports their whole-warp instructions: the forward's every K/V
    fragment serves two m-tiles (fewer ldmatrix than mma), the backward
    runs more products than the forward."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "tests" / "kernel_counts.py"), "--n", "256",
         "--head-dims", "64"], capture_output=True, text=True, timeout=600, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 64 ")]
    assert len(rows) == 4, proc.stdout
    mma = {(r[1].strip(), r[2].strip()): int(r[3]) for r in rows}
    ratio = {(r[1].strip(), r[2].strip()): float(r[4]) for r in rows}
    for causal in ("False", "True"):
        assert 0 < mma[causal, "fwd"] < mma[causal, "bwd"]
        assert 0 < ratio[causal, "fwd"] < 1


# Sliding windows (band [t - left, t + right]) on every kernel path: smaller
# than a tile, crossing tiles, one-sided; with documents, grouped K/V heads
# and grad_lse; and query x key blocks at offsets.
WINDOWS = {
    "dense-narrow-gqa-documents": ([150], [1], 4, 2, [0, 1, 1, 50, 53, 150], (7, 5)),
    "dilated-wide-left": ([40, 150], [1, 3], 3, 3, None, (70, -1)),
    "dense-right": ([150], [1], 2, 1, None, (-1, 20)),
}
WINDOW_PATHS = [
    "mma64-bf16",
    "mma64-fp16-unvectorised",
    "mma128-bf16",
    "simt-f32-d32",
    "simt-f64",
    "simt-fp16-sm75",
    "mma192-bf16-d160",
]


def _window_cfg(path: str, name: str, causal: bool) -> Cfg:
    _, d, _ = PATHS[path]
    ws, rs, heads, kv_heads, bounds, window = WINDOWS[name]
    cfg = Cfg(1, 150, heads, d, ws, rs, causal, False, None, True, kv_heads, False, bounds)
    cfg.window = window
    return cfg


@pytest.mark.parametrize(("path", "name", "causal"), alternating(WINDOW_PATHS, WINDOWS))
def test_windows_match_oracle(emu, path, name, causal) -> None:
    dtype, _, cc = PATHS[path]
    emu.configure(3, cc)  # an odd seed: warps run ahead, blocks in a shuffled order
    cfg = _window_cfg(path, name, causal)
    seed = 1100 + 7 * WINDOW_PATHS.index(path) + 2 * list(WINDOWS).index(name) + causal
    q, k, v, go, kpm = make_inputs(cfg, dtype, "cpu", seed)
    glse = lse_grad(cfg, "cpu", seed + 1)
    got = _forward_backward(emu, cfg, q, k, v, go, kpm, glse)
    want = run_oracle(cfg, q, k, v, go, kpm, glse)
    ctx = f"{path} {name} causal={causal} seed={seed}"
    for what, g, r, tol in zip(
        ("out", "lse", "dq", "dk", "dv"), got, want,
        (OUT_TOL[dtype], LSE_TOL[dtype], *(GRAD_TOL[dtype],) * 3), strict=True,
    ):  # fmt: skip
        close(g, r, tol, what, ctx)


@pytest.mark.parametrize("path", ["mma64-bf16", "simt-f32-d32"])
def test_windows_in_blocks_at_offsets(emu, path) -> None:
    """A window narrower than the blocks: most query x key blocks reach
    nothing; the merged blocks equal the oracle, forward and backward."""
    dtype, _, cc = PATHS[path]
    emu.configure(0, cc)
    cfg = _window_cfg(path, "dense-narrow-gqa-documents", True)
    rng = random.Random(1200)
    q, k, v, go, kpm = make_inputs(cfg, dtype, "cpu", 1200)
    r_out, r_lse, r_dq, r_dk, r_dv = run_oracle(cfg, q, k, v, go, kpm)
    blocks = splits(cfg.n, 4, rng)
    out, lse = fresh_acc(q)
    for qa, qb in blocks:
        acc = fresh_acc(q[:, qa:qb])
        for ka, kb in blocks:
            _forward(emu, cfg, q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], kpm[:, ka:kb], qa, ka, acc)
        out[:, qa:qb], lse[:, :, qa:qb] = acc
    ctx = f"{path} blocks={blocks}"
    close(out, r_out, OUT_TOL[dtype], "out", ctx)
    close(lse, r_lse, LSE_TOL[dtype], "lse", ctx)
    final = out.to(dtype)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc_dtype(dtype)) for x in (q, k, v))
    for qa, qb in blocks:
        for ka, kb in blocks:
            args = (go[:, qa:qb], q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], final[:, qa:qb])
            args = tuple(a.contiguous() for a in args)
            parts = tuple(g.clone() for g in (dq[:, qa:qb], dk[:, ka:kb], dv[:, ka:kb]))
            _backward(emu, cfg, *args, lse[:, :, qa:qb].contiguous(),
                      kpm[:, ka:kb].contiguous(), qa, ka, parts)  # fmt: skip
            dq[:, qa:qb], dk[:, ka:kb], dv[:, ka:kb] = parts
    close_grads((dq, dk, dv), (r_dq, r_dk, r_dv), dtype, ctx)


# Head ranges (a Ulysses rank's heads): (heads, kv_heads, pattern, head_groups,
# grouped offsets, the range); the oracle runs every head and the range's
# rows, K/V heads and gradients are cut out of it.
HEAD_RANGES = [
    (6, 2, ([16, 48, 96], [1, 2, 4]), False, False, (1, 4)),
    (7, 7, ([16, 48, 96], [1, 3, 4]), True, False, (2, 6)),
    (8, 4, ([32, 96], [2, 4]), False, True, (3, 8)),
]


@pytest.mark.parametrize("path", ["mma64-bf16", "simt-f32-d32"])
@pytest.mark.parametrize("case", range(len(HEAD_RANGES)))
def test_head_ranges_match_oracle(emu, path, case) -> None:
    dtype, d, cc = PATHS[path]
    emu.configure(case + 1, cc)
    heads, kv, (ws, rs), hg, grouped, (h0, h1) = HEAD_RANGES[case]
    cfg = Cfg(1, 120, heads, d, ws, rs, bool(case % 2), hg, kv_heads=kv, grouped_offsets=grouped)
    q, k, v, go, _ = make_inputs(cfg, dtype, "cpu", case)
    group = heads // kv
    kv0, kv1 = h0 // group, (h1 - 1) // group + 1
    go_r = torch.zeros_like(go)
    go_r[:, :, h0:h1] = go[:, :, h0:h1]
    want = run_oracle(cfg, q, k, v, go_r, None)
    qs, ks, vs, gos = (t[:, :, a:b].contiguous() for t, a, b in
                       ((q, h0, h1), (k, kv0, kv1), (v, kv0, kv1), (go, h0, h1)))  # fmt: skip
    heads_args = dict(head_start=h0, total_heads=heads, total_kv_heads=kv)
    pattern = cfg.pattern(None, "cpu")
    out, lse = fresh_acc(qs)
    emu.block_forward(qs, ks, vs, out, lse, 0, 0, *pattern, **heads_args)
    grads = tuple(torch.zeros(x.shape, dtype=acc_dtype(dtype)) for x in (qs, ks, vs))
    emu.block_backward(gos, None, qs, ks, vs, out.to(dtype), lse, *grads, 0, 0, *pattern,
                       **heads_args)  # fmt: skip
    ctx = (path, HEAD_RANGES[case])
    close(out, want[0][:, :, h0:h1], OUT_TOL[dtype], "out", ctx)
    close(lse, want[1][:, h0:h1], LSE_TOL[dtype], "lse", ctx)
    close(grads[0], want[2][:, :, h0:h1], GRAD_TOL[dtype], "dq", ctx)
    close(grads[1], want[3][:, :, kv0:kv1], GRAD_TOL[dtype], "dk", ctx)
    close(grads[2], want[4][:, :, kv0:kv1], GRAD_TOL[dtype], "dv", ctx)
