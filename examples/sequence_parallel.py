"""Sequence parallelism three ways: the ring, Ulysses (all-to-all) and the
ring x Ulysses hybrid, each checked against one process.

    torchrun --nproc-per-node=4 examples/sequence_parallel.py --mode ring
    torchrun --nproc-per-node=4 examples/sequence_parallel.py --mode ulysses
    torchrun --nproc-per-node=4 examples/sequence_parallel.py --mode hybrid   # 2 rings x 2
    torchrun --nproc-per-node=4 examples/sequence_parallel.py --mode all

Every rank builds the same global q, k, v (grouped K/V heads, packed
documents, causal LongNet pattern), takes its shard with
``ra.shard_sequence`` (the same group/mesh arguments as the attention),
runs the forward and the backward, and rank 0 compares the gathered output
and gradients with ``ra.dilated_attention`` on the whole sequence. NCCL with
one GPU per rank when there are enough GPUs, else gloo on the CPU.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ring_attention as ra
from ring_attention.parallel.exchange import register_exchange_hook
from ring_attention.parallel.ulysses import last_all_to_all_stats


def sharding(mode: str, world: int, ulysses: int, device: str) -> dict:
    """The group/mesh arguments of ``mode`` (the same for shard, attention, gather)."""
    if mode == "ring":
        return {"group": dist.group.WORLD}  # the ring over every rank
    if mode == "ulysses":
        return {"ulysses_group": dist.group.WORLD}  # all-to-all over every rank, no ring
    # the hybrid: Ulysses inside groups of `ulysses` ranks (a node), a ring between them
    mesh = init_device_mesh(device, (world // ulysses, ulysses), mesh_dim_names=("ring", "ulysses"))
    return {"mesh": mesh}


def run(mode: str, args: argparse.Namespace, device: torch.device) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    kw = sharding(mode, world, args.ulysses, device.type)
    g = torch.Generator().manual_seed(0)  # the same global tensors on every rank
    q = torch.randn(1, args.seq_len, args.heads, 64, generator=g)
    k, v = (torch.randn(1, args.seq_len, args.kv_heads, 64, generator=g) for _ in range(2))
    go = torch.randn(q.shape, generator=g)
    docs = [0, args.seq_len // 3, args.seq_len]  # two packed documents (global boundaries)
    pattern = dict(segment_lengths=[512, 4096], dilation_rates=[1, 4], causal=True, cu_seqlens=docs)

    q_l, k_l, v_l = (ra.shard_sequence(t, 1, **kw).to(device).requires_grad_() for t in (q, k, v))
    ring_bytes = [0]
    with register_exchange_hook(lambda e: ring_bytes.__setitem__(0, ring_bytes[0] + e.bytes_sent)):
        out_l = ra.ring_dilated_attention(q_l, k_l, v_l, **pattern, **kw)
        out_l.backward(ra.shard_sequence(go, 1, **kw).to(device))
    a2a = last_all_to_all_stats.bytes_sent() if mode != "ring" else 0
    full = [
        ra.gather_sequence(t.detach(), 1, **kw).cpu() for t in (out_l, q_l.grad, k_l.grad, v_l.grad)
    ]
    if rank == 0:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = ra.dilated_attention(*leaves, **pattern)
        ref.backward(go)
        err = max(
            (a - b).abs().max().item()
            for a, b in zip(full, [ref, *(t.grad for t in leaves)], strict=True)
        )
        print(
            f"{mode:>8}: {world} ranks, shard {q_l.shape[1]} of {args.seq_len} tokens; "
            f"max |sharded - one process| = {err:.1e} (output and gradients); rank 0 sent "
            f"{(a2a + ring_bytes[0]) / 2**20:.2f} MiB (all-to-all {a2a / 2**20:.2f}, "
            f"ring {ring_bytes[0] / 2**20:.2f})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mode", choices=["ring", "ulysses", "hybrid", "all"], default="hybrid")
    ap.add_argument("--ulysses", type=int, default=2, help="Ulysses ranks per ring rank (hybrid)")
    ap.add_argument("--seq-len", type=int, default=4099)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    for mode in ("ring", "ulysses", "hybrid") if args.mode == "all" else (args.mode,):
        run(mode, args, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
