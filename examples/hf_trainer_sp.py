"""Train a tiny random-init Hugging Face Llama with transformers' ``Trainer``
and sequence parallelism: 4 CPU processes as 2 data-parallel groups of 2
ranks that share each sequence (a 2 x 2 ``DeviceMesh``).

What the package adds to an ordinary ``Trainer`` script is three lines: the
mesh, ``ra.register_transformers(...)`` and ``SequenceParallelTrainer`` in
place of ``Trainer``. ``--mode`` picks how a sequence is spread over its
ranks: ``ring`` (``group=mesh.get_group("sp")``: ring attention, the
default), ``ulysses`` (``ulysses_group=mesh.get_group("sp")``: all-to-alls
trade sequence for heads) or ``hybrid`` (a ``("dp", "ring", "ulysses")`` mesh
and ``mesh=mesh["ring", "ulysses"]``; Ulysses groups of 2, so ``--sp 4`` on
4 processes). The Trainer does the rest as usual: DDP over all ranks (FSDP2
with ``fsdp`` set, on GPUs), the token count of every step, activation
checkpointing with ``--checkpointing``. Each rank holds ``1/sp`` of every
sequence.

Task (synthetic long-range recall, causal LM; as in hf_llama_finetune.py): a
sequence of ``--seq-len`` random filler tokens; a VALUE token (one of
``VALUES`` classes) stands at 8 random positions of the first quarter;
QUERY tokens stand at every 4th position of the second half, and at each the
model must predict the value (only these answers are scored; chance is
``ln VALUES`` = 2.08). The pattern ``segment_lengths=[16, 64, 256]``,
``dilation_rates=[1, 2, 4]`` connects them through its 256-branch.

Run: ``python examples/hf_trainer_sp.py`` (spawns 4 gloo processes), or
``torchrun --nproc-per-node=4 examples/hf_trainer_sp.py``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments
from transformers.trainer_callback import PrinterCallback

import ring_attention as ra
from ring_attention.hf import SequenceParallelTrainer

FILLER, VALUES, COPIES, QUERY_EVERY = 16, 8, 8, 4
QUERY = FILLER + VALUES
PATTERN = {"segment_lengths": [16, 64, 256], "dilation_rates": [1, 2, 4]}


def recall_samples(count: int, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` samples ``{"input_ids", "labels"}`` of the recall task; the
    label of the token after each QUERY is the value, the rest is -100."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, FILLER, (count, n), generator=gen)
    value = torch.randint(0, VALUES, (count,), generator=gen)
    slots = torch.rand(count, n // 4, generator=gen).argsort(dim=1)[:, :COPIES]
    ids.scatter_(1, slots, (FILLER + value)[:, None].expand(-1, COPIES))
    queries = torch.arange(n // 2 + 1, n - 1, QUERY_EVERY)
    ids[:, queries] = QUERY
    labels = torch.full_like(ids, -100)
    labels[:, queries + 1] = (FILLER + value)[:, None]
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    training = TrainingArguments(
        output_dir=args.output_dir, use_cpu=True, per_device_train_batch_size=args.batch,
        max_steps=args.steps, learning_rate=3e-3, weight_decay=0.0, lr_scheduler_type="constant",
        logging_steps=args.log_every, report_to=[], save_strategy="no", disable_tqdm=True,
        gradient_checkpointing=args.checkpointing, seed=0,
    )  # fmt: skip
    world = dist.get_world_size()
    if args.mode == "hybrid":
        mesh = init_device_mesh("cpu", (world // args.sp, args.sp // 2, 2),
                                mesh_dim_names=("dp", "ring", "ulysses"))  # fmt: skip
        ra.register_transformers(mesh=mesh["ring", "ulysses"])
    else:
        mesh = init_device_mesh("cpu", (world // args.sp, args.sp), mesh_dim_names=("dp", "sp"))
        if args.mode == "ring":
            ra.register_transformers(group=mesh.get_group("sp"))  # the ring over each "sp" group
        else:
            ra.register_transformers(ulysses_group=mesh.get_group("sp"))
    config = LlamaConfig(vocab_size=QUERY + 1, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len)  # fmt: skip
    config.dilated_attention = PATTERN
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated")
    dataset = recall_samples(args.steps * args.batch * world, args.seq_len, seed=1)
    # (the Trainer's default collator, default_data_collator, stacks the samples)
    trainer = SequenceParallelTrainer(model=model, args=training, train_dataset=dataset)
    trainer.remove_callback(PrinterCallback)  # the table below instead
    result = trainer.train()
    if dist.get_rank() == 0:
        print(f"{world} processes: {world // args.sp} data-parallel group(s) of {args.sp} "
              f"sequence-parallel ranks ({args.mode}); sequence {args.seq_len}, "
              f"{-(-args.seq_len // args.sp)} tokens per rank")  # fmt: skip
        print(f"chance: loss ln({VALUES}) = {torch.log(torch.tensor(float(VALUES))):.2f}")
        print(" step |   loss")
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"{entry['step']:5d} | {entry['loss']:6.3f}")
        print(f"runtime {result.metrics['train_runtime']:.1f} s", flush=True)
    ra.register_transformers()


def _spawned(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    # what a launcher sets, so that the Trainer (Accelerate) joins this group
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=10))  # fmt: skip
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    parser.add_argument("--world-size", type=int, default=4, help="processes to spawn")
    parser.add_argument("--sp", type=int, default=2, help="ranks sharing a sequence")
    parser.add_argument("--mode", choices=("ring", "ulysses", "hybrid"), default="ring",
                        help="how a sequence is spread over its ranks")  # fmt: skip
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)
    if args.mode == "hybrid" and args.sp % 2:
        parser.error(f"--mode hybrid takes Ulysses groups of 2: --sp must be even, got {args.sp}")
    with tempfile.TemporaryDirectory() as tmp:
        args.output_dir = args.output_dir or os.path.join(tmp, "out")
        if "RANK" in os.environ:  # started by torchrun
            try:
                train(args)
            finally:  # the Trainer (Accelerate) joined the group; leave none behind
                if dist.is_initialized():
                    dist.destroy_process_group()
            return
        if args.world_size % args.sp:
            parser.error(f"--sp ({args.sp}) must divide --world-size ({args.world_size})")
        init_file = os.path.join(tmp, "store")
        mp.spawn(_spawned, args=(args.world_size, init_file, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
