"""Fine-tune a tiny random-init Hugging Face Llama with a dilated attention
pattern, the sequence sharded across processes (sequence parallelism).

Task (synthetic long-range recall, causal LM): a sequence of ``--seq-len``
(256) random filler tokens; a VALUE token (one of ``VALUES`` classes) stands
at ``COPIES`` random positions of the first quarter; QUERY tokens stand at
every 4th position of the second half, and at each the model must predict
the value (only these answers are scored; chance is ``1 / VALUES``, loss
``ln VALUES``). Between a query and the values lie more than 64 positions,
so of the pattern ``segment_lengths=[16, 64, 256]``,
``dilation_rates=[1, 2, 4]`` only the 256-branch connects them: with it the
loss falls to about 0 within ~100 steps; ``--local`` drops that branch, and
the model stays at chance.

The model has 4 query heads and 2 K/V heads (``--kv-heads``); the K/V
heads reach the kernels, and travel between ranks, unrepeated. Every rank
builds the same model (same seed) and the same global batch,
keeps its shard of the tokens (``ring_attention.hf.shard_causal_lm_batch``:
input ids, global position ids, labels shifted over the whole sequence) and
runs the model on it; the attention is ring attention across the ranks. DDP
averages the ranks' gradients (each rank's loss, scaled by the batch's
``num_items_in_batch``, is its share of the global mean times the number of
ranks), so every rank takes the same optimizer step as a single process
would. ``examples/hf_trainer_sp.py`` does the same with transformers'
``Trainer``.

Run: ``python examples/hf_llama_finetune.py [--steps 300] [--world-size 2]``
(spawns gloo processes on the CPU), or
``torchrun --nproc-per-node=2 examples/hf_llama_finetune.py``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, LlamaConfig

import ring_attention as ra
from ring_attention.hf import shard_causal_lm_batch

FILLER = 16  # filler tokens 0..15
VALUES = 8  # value tokens 16..23
QUERY = FILLER + VALUES
VOCAB = QUERY + 1
QUERY_EVERY = 4
COPIES = 8
PATTERN = {"segment_lengths": [16, 64, 256], "dilation_rates": [1, 2, 4]}
LOCAL_PATTERN = {"segment_lengths": [16, 64], "dilation_rates": [1, 2]}


def make_batch(batch: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels ``(batch, n)``: the label of the token after each
    QUERY is the value (what the model predicts at the QUERY; the token
    itself is filler), everything else is unscored (-100)."""
    ids = torch.randint(0, FILLER, (batch, n), generator=gen)
    value = torch.randint(0, VALUES, (batch,), generator=gen)
    # COPIES distinct random positions in the first quarter hold the value.
    slots = torch.rand(batch, n // 4, generator=gen).argsort(dim=1)[:, :COPIES]
    ids.scatter_(1, slots, (FILLER + value)[:, None].expand(-1, COPIES))
    queries = torch.arange(n // 2 + 1, n - 1, QUERY_EVERY)
    ids[:, queries] = QUERY
    labels = torch.full_like(ids, -100)
    labels[:, queries + 1] = (FILLER + value)[:, None]
    return ids, labels


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    group = dist.group.WORLD if world > 1 else None
    ra.register_transformers(group=group)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, attention_dropout=0.0,
    )  # fmt: skip
    pattern = LOCAL_PATTERN if args.local else PATTERN
    config.dilated_attention = pattern
    torch.manual_seed(args.seed)  # the same weights on every rank
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    trained = DistributedDataParallel(model) if world > 1 else model
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches on every rank

    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"Llama, {params} parameters, 4 heads reading {args.kv_heads} K/V heads, "
              f"pattern {pattern}, {world} process(es), "
              f"sequence {args.seq_len} ({args.seq_len // world} tokens per rank)")  # fmt: skip
        print(f"recall: chance accuracy {1 / VALUES:.0%}, loss ln({VALUES}) = "
              f"{torch.log(torch.tensor(float(VALUES))):.2f}")  # fmt: skip
        print(" step |   loss | recall")
    start = time.perf_counter()
    for step in range(args.steps + 1):
        ids, labels = make_batch(args.batch, args.seq_len, gen)
        batch = shard_causal_lm_batch(ids, labels)
        out = trained(**batch, use_cache=False)
        # Averaged over the ranks: the loss of the whole batch (DDP averages
        # its gradient); summed: the correct answers and the answers.
        answers = batch["shift_labels"] != -100
        correct = (out.logits.argmax(-1)[answers] == batch["shift_labels"][answers]).sum()
        stats = torch.stack([out.loss.detach() / world, correct.float(), answers.sum().float()])
        if world > 1:
            dist.all_reduce(stats)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            accuracy = stats[1].item() / stats[2].item()
            print(f"{step:5d} | {stats[0].item():6.3f} | {accuracy:6.1%}", flush=True)
        if step == args.steps:
            break
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    if rank == 0:
        print(f"runtime {time.perf_counter() - start:.1f} s")


def _spawned(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        train(rank, world, args)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2, help="K/V heads (of 4 query heads)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2, help="processes to spawn")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--local", action="store_true", help="drop the 256-branch (contrast)")
    args = parser.parse_args(argv)
    if args.seq_len < 4 * COPIES + 8:
        parser.error(f"--seq-len must be at least {4 * COPIES + 8}")
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
    elif args.world_size == 1:
        train(0, 1, args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            init_file = os.path.join(tmp, "store")
            mp.spawn(_spawned, args=(args.world_size, init_file, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
