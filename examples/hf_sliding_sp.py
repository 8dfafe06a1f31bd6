"""Train a tiny gpt-oss-style model (attention sinks, sliding and full layers)
with transformers' ``Trainer`` over the ring x Ulysses hybrid, and check that
its loss curve is one process's.

The model is transformers' ``GptOssConfig`` made tiny: 2 layers, a sliding
one (window ``WINDOW``) and a full one, 4 query heads over 2 K/V heads, a
learned sink per head (``s_aux``, started far from zero so that it matters)
and 4 experts. 4 gloo processes on the CPU share each sequence as a 2 x 2
mesh, a ring of 2 Ulysses groups of 2 (``mesh_dim_names=("ring",
"ulysses")``), each rank holding a quarter of the tokens; what the package
adds to an ordinary ``Trainer`` script is the mesh,
``ra.register_transformers(mesh=...)`` and ``SequenceParallelTrainer`` in
place of ``Trainer``. The same model, data and seed then train in one
process with the plain ``Trainer`` (``"ring_dilated"`` without sequence
parallelism: exact attention, sinks and windows included). Both loss curves
are printed with their largest difference; the script exits 1 if that
exceeds float32 rounding (``--rtol``; the experts' grouped matmul runs in
float32, so the whole model does).

Task: counting with a stride: each token is the one before plus the sample's
stride (1 to 3); the model reads the stride off the tokens before, which the
sliding window reaches.

Run: ``python examples/hf_sliding_sp.py [--steps 12]`` (spawns 4 gloo
processes with ``ring_attention.parallel.testing.run_distributed``; ~15 s on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, GptOssConfig, Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

import ring_attention as ra
from ring_attention.hf import SequenceParallelTrainer
from ring_attention.parallel.testing import run_distributed

VOCAB, WINDOW, WORLD = 32, 8, 4


def samples(count: int, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` samples ``{"input_ids", "labels"}`` of ``n`` tokens: from a
    random start, each token the one before plus the sample's stride (1 to 3,
    modulo ``VOCAB``)."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (count, 1), generator=gen)
    stride = torch.randint(1, 4, (count, 1), generator=gen)
    ids = (start + stride * torch.arange(n)) % VOCAB
    return [{"input_ids": i, "labels": i.clone()} for i in ids]


def model() -> torch.nn.Module:
    """The tiny gpt-oss model, the same weights in every process."""
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, sliding_window=WINDOW,
                          layer_types=["sliding_attention", "full_attention"],
                          num_local_experts=4, num_experts_per_tok=2,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    out = AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated")
    for layer in out.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
    return out


def train(trainer_class: type, args: argparse.Namespace, out: str) -> list[float]:
    """The logged loss of every step."""
    training = TrainingArguments(
        output_dir=out, use_cpu=True, per_device_train_batch_size=args.batch,
        max_steps=args.steps, learning_rate=args.lr, weight_decay=0.0, lr_scheduler_type="constant",
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        train_sampling_strategy="sequential", ddp_find_unused_parameters=False, seed=0,
    )  # fmt: skip
    # step k trains on samples [k * batch, (k + 1) * batch) in both runs: the
    # ranks' sharded samplers each take every WORLD-th batch, and
    # SequenceParallelTrainer gives each to all of them in turn
    data = samples(-(-args.steps // WORLD) * WORLD * args.batch, args.seq_len, seed=1)
    trainer = trainer_class(model=model(), args=training, train_dataset=data)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def sharded(rank: int, world: int, args: argparse.Namespace, out: str) -> list[float]:
    """One rank of the hybrid (``run_distributed`` has joined the gloo group)."""
    from torch.distributed.device_mesh import init_device_mesh

    # what a launcher sets, so that the Trainer (Accelerate) joins this group
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    ra.register_transformers(mesh=mesh)
    try:
        return train(SequenceParallelTrainer, args, out)
    finally:
        ra.register_transformers()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=61, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=4, help="samples per step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rtol", type=float, default=1e-5,
                        help="largest relative loss difference accepted (float32)")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ra.register_transformers()
        one = train(Trainer, args, os.path.join(tmp, "one"))
        ranks = run_distributed(sharded, WORLD, args, os.path.join(tmp, "sp"), timeout=300)
    hybrid = ranks[0]
    print(f"gpt-oss (sinks, window {WINDOW} and full layers), {args.seq_len} tokens: one "
          f"process against {WORLD} ranks, ring 2 x Ulysses 2 "
          f"({-(-args.seq_len // WORLD)} tokens each)")  # fmt: skip
    print(" step | one process |  ring x Ulysses")
    for step, (a, b) in enumerate(zip(one, hybrid, strict=True), 1):
        print(f"{step:5d} | {a:11.6f} | {b:15.6f}")
    diff = max(abs(a - b) for a, b in zip(one, hybrid, strict=True))
    worst = max(abs(a - b) / abs(a) for a, b in zip(one, hybrid, strict=True))
    same = len(one) == args.steps and all(r == hybrid for r in ranks)
    print(f"max difference {diff:.2e}, relative {worst:.2e} (tolerance {args.rtol:.0e}); "
          f"loss {one[0]:.3f} -> {one[-1]:.3f}")  # fmt: skip
    if not same or worst > args.rtol:
        print("FAILED: the sharded loss curve is not one process's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
