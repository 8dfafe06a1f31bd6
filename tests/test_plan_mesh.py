"""The mode chosen for you: ``ra.plan_mesh`` and ``register_transformers(mesh="auto")``.

The choice agrees with the planner's ``--mode compare`` on the same shape and
links; on gloo every rank builds the same 2-D mesh, the attention over it
equals one process, a sliding window takes the ring, and a transformers model
trained with ``mesh="auto"`` equals one process, sliding and full layers on
their own grids.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
import transformers as tr
from test_hf import VOCAB, causal_lm_step

import ring_attention as ra
from ring_attention.core.pattern import Pattern
from ring_attention.hf.setting import sequence_parallel
from ring_attention.parallel.auto import choose_grid
from ring_attention.parallel.testing import run_distributed
from ring_attention.planner.cli import main as planner

K = 1024
#: (world, gpus per node, n, heads, kv heads, head dim, causal)
SHAPES = [
    (16, 8, 256 * K, 16, 4, 128, True),
    (8, 8, 64 * K, 16, 16, 128, False),
    (32, 8, 1024 * K, 32, 8, 128, True),
    (4, 4, 8 * K, 12, 4, 64, True),
]


def _advice(argv: list[str], capsys) -> tuple[dict[str, tuple[int, int, float]], str]:
    """``--mode compare``'s modes ``{name: (R, U, fwd+bwd ms)}`` and its advised mode."""
    assert planner(["--mode", "compare", *argv]) == 0
    text = capsys.readouterr().out
    modes = {}
    for name, R, U in re.findall(r"^(ring|ulysses|hybrid): (\d+) ring\(s\) x (\d+) Ulysses", text,
                                 re.M):  # fmt: skip
        block = text.split(f"\n{name}: {R} ring(s)")[1]
        ms = re.search(r"forward\+backward ([\d.]+) (ms|us|s)\b", block)
        scale = {"ms": 1.0, "us": 1e-3, "s": 1e3}[ms[2]]
        modes[name] = (int(R), int(U), float(ms[1]) * scale)
    advised = re.search(r"^Advice: fastest that fits: (\w+)", text, re.M)
    assert advised, text
    return modes, advised[1]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[2] // K}K")
def test_choice_agrees_with_the_planners_comparison(shape, capsys) -> None:
    """plan_mesh's grid is the fastest of every grid, so never slower than
    the comparison's advice; where it is one of the compared grids it is the
    advised one, and each compared grid's time is the comparison's."""
    world, per_node, n, heads, kv, d, causal = shape
    argv = ["--gpus", str(world), "--gpus-per-node", str(per_node), "--seq-len", str(n),
            "--heads", str(heads), "--kv-heads", str(kv), "--head-dim", str(d), "--dtype", "bf16",
            "--segments", str(n), "--dilations", "1"]  # fmt: skip
    modes, advised = _advice(argv + ["--causal"] * causal, capsys)
    pattern = Pattern([n], [1], causal=causal)
    best = choose_grid(n, heads, kv, d, pattern, world=world, gpus_per_node=per_node)
    R, U, ms = modes[advised]
    assert best.seconds * 1e3 <= ms * 1.005, (best, modes)
    compared = {(r, u): t for r, u, t in modes.values()}
    if (best.ring, best.ulysses) in compared:
        assert (best.ring, best.ulysses) == (R, U), (best, modes)
    weighed = {(int(r), int(u)): float(t) for r, u, t in
               re.findall(r"(\d+)x(\d+) ([\d.e+-]+) ms", best.why)}  # fmt: skip
    weighed[best.ring, best.ulysses] = best.seconds * 1e3
    for grid, t in compared.items():  # the times the choice weighed are the comparison's
        assert abs(weighed[grid] - t) <= 0.01 * t, (grid, best.why, modes)


def test_a_window_takes_the_ring() -> None:
    """A sliding window bounds the ring's bytes, not Ulysses': the ring."""
    pattern = Pattern([1 << 20], [1], causal=True, window=(4095, 0))
    best = choose_grid(1 << 20, 16, 16, 128, pattern, world=8, gpus_per_node=8)
    assert (best.ring, best.ulysses) == (8, 1), best


def _mesh_worker(rank: int, world: int, n: int, per_node: int) -> dict:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    segs, dils = [8, 16], [1, 2]
    plan = ra.plan_mesh(n, 6, 6, 8, (segs, dils), gpus_per_node=per_node)
    mesh = plan.mesh
    out = ra.ring_dilated_attention(*(ra.shard_sequence(t, 1, mesh=mesh) for t in (q, k, v)),
                                    segs, dils, mesh=mesh)  # fmt: skip
    full = ra.gather_sequence(out, 1, mesh=mesh)
    want = ra.dilated_attention(q, k, v, segs, dils)
    window = ra.plan_mesh(n, 6, 6, 8, Pattern([n], [1], window=(7, 7)), gpus_per_node=per_node)
    return {"names": mesh.mesh_dim_names, "grid": mesh.mesh.tolist(),
            "prediction": plan.prediction, "err": float((full - want).abs().max()),
            "window": window.mesh.mesh.shape}  # fmt: skip


@pytest.mark.parametrize("world, per_node", [(4, 4), (4, 2), (3, 3)])
def test_every_rank_builds_the_same_mesh_and_it_is_exact(world: int, per_node: int) -> None:
    """Every rank decides the same grid (its prediction too) without a round
    of messages; the mesh is (ring, ulysses) over the ranks in row-major
    order, and attention sharded over it equals one process."""
    res = run_distributed(_mesh_worker, world, 60, per_node, timeout=240)
    first = res[0]
    R, U = first["prediction"].ring, first["prediction"].ulysses
    assert R * U == world
    assert first["names"] == ("ring", "ulysses")
    assert first["grid"] == [[i * U + j for j in range(U)] for i in range(R)]
    if world > per_node:  # a Ulysses group stays inside a node
        assert per_node % U == 0 or U % per_node == 0
    for r in res:
        assert r["grid"] == first["grid"] and r["prediction"] == first["prediction"]
        assert r["err"] < 1e-12, r["err"]
        assert tuple(r["window"]) == (world, 1)


MIXED = ["sliding_attention", "full_attention", "sliding_attention"]


def _model(state: dict | None = None):
    torch.manual_seed(0)
    cfg = tr.Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, use_sliding_window=True, sliding_window=6,
                         max_window_layers=0, layer_types=MIXED, pad_token_id=0)  # fmt: skip
    model = tr.AutoModelForCausalLM.from_config(cfg, attn_implementation="ring_dilated")
    if state is not None:
        model.load_state_dict(state)
    return model.to(torch.float64).train()


def _batch():
    gen = torch.Generator().manual_seed(11)
    lengths = [9, 14, 1, 16]  # packed documents crossing the shard boundaries
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[positions == 0] = -100
    return ids, labels, positions


def _auto_worker(rank: int, world: int, state: dict) -> tuple:
    ra.register_transformers(mesh="auto")
    try:
        loss, grads = causal_lm_step(_model(state), *_batch())
        for t in (loss, *grads.values()):
            dist.all_reduce(t)
        grids = {key[0].windowed: (spread["group"] is not None, spread["mesh"] is not None)
                 for key, spread in sequence_parallel()._meshes.items()}  # fmt: skip
    finally:
        ra.register_transformers()
    return loss, grads, grids


def test_auto_mesh_training_equals_one_process() -> None:
    """``register_transformers(mesh="auto")`` on 4 ranks: the loss and every
    gradient equal one process's; the sliding layers run on the ring."""
    ra.register_transformers()
    model = _model()
    state = copy.deepcopy(model.state_dict())
    want_loss, want_grads = causal_lm_step(model, *_batch())
    for loss, grads, grids in run_distributed(_auto_worker, 4, state, timeout=300):
        torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-9)
        for name, g in want_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-7, atol=1e-9, msg=name)
        assert grids[True] == (True, False), grids  # the window's layers: the ring alone
        assert set(grids) == {True, False}, grids
