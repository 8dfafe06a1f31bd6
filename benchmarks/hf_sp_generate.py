"""Generation over a sequence-parallel group against one process: a small
Llama (float32, CPU, dense causal attention) generates ``--new`` tokens
greedily after a prompt of each ``--lengths``, in one process and on
``--world`` gloo ranks with the cache sharded by sequence
(``ring_attention.hf.ShardedCache``; with ``--static`` preallocated for the
prompt and the new tokens, against transformers' static cache in one
process). Printed per prompt length: the time per generated token (from the
first token's logits to the last's, over ``--new`` decode steps, the prefill
left out; median of ``--repeats``), the K/V cache bytes a rank holds at the end (the storage
of the layers' keys and values), and the bytes one decode step all-gathers
per rank (every layer's partial ``(out, lse)``). Tokens are checked equal to
the one-process tokens.

    python benchmarks/hf_sp_generate.py [--lengths 8192 16384] [--world 4] [--new 16] [--static]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _model(args: argparse.Namespace, length: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                         max_position_embeddings=length + args.new + 1)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated").eval()


def _run(
    model, ids: torch.Tensor, new: int, sharded: bool, static: bool
) -> tuple[torch.Tensor, float, int]:
    """Tokens, seconds a decode step and the cache bytes held here after generating ``new``."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from ring_attention.hf import ShardedCache

    class Clock(LogitsProcessor):  # the time each step's logits come out
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            times.append(time.perf_counter())
            return scores

    given: dict = {"cache_implementation": "static"} if static else {}
    if sharded:  # room for the positions cached, as transformers' static cache
        room = ids.shape[1] + new - 1 if static else None
        given = {"cache": ShardedCache(model.config, max_cache_len=room)}
    times: list[float] = []
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList([Clock()]), **given)  # fmt: skip
    cache = out.cache if hasattr(type(out), "cache") or "cache" in out else out.past_key_values
    held = sum(t.untyped_storage().nbytes() for layer in cache.layers
               for t in (layer.keys, layer.values))  # fmt: skip
    return out.sequences, (times[-1] - times[0]) / (len(times) - 1), held


def _per_token(model, ids: torch.Tensor, args: argparse.Namespace, sharded: bool) -> tuple:
    runs = [_run(model, ids, args.new + 1, sharded, args.static) for _ in range(args.repeats)]
    return runs[-1][0], statistics.median(r[1] for r in runs), runs[-1][2]


def _ranks(rank: int, world: int, args: argparse.Namespace, length: int) -> tuple:
    import torch.distributed as dist

    import ring_attention as ra

    torch.set_num_threads(1)
    ra.register_transformers(group=dist.group.WORLD)
    ids = torch.randint(1, 1000, (1, length), generator=torch.Generator().manual_seed(1))
    return _per_token(_model(args, length), ids, args, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--static", action="store_true", help="preallocated caches")
    args = parser.parse_args()

    import ring_attention as ra
    from ring_attention.parallel.testing import run_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
          f"({args.heads // 2} K/V), float32, batch 1, {args.new} new tokens, "
          f"{args.world} gloo ranks, 1 thread each, {'static' if args.static else 'dynamic'} "
          "caches\n")  # fmt: skip
    print(
        "| prompt | one process ms/token | group ms/token | cache MB one | cache MB per rank "
        "(max) | all-gathered KB per step per rank | tokens equal |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        ra.register_transformers()
        ids = torch.randint(1, 1000, (1, length), generator=torch.Generator().manual_seed(1))
        want, one_s, one_held = _per_token(_model(args, length), ids, args, False)
        got = run_distributed(_ranks, args.world, args, length, timeout=3600)
        equal = all(torch.equal(tokens, want) for tokens, _, _ in got)
        group_s = max(s for _, s, _ in got)
        held = max(h for _, _, h in got)
        head_dim = args.hidden // args.heads
        gathered = args.layers * args.world * args.heads * (head_dim + 1) * 4
        print(f"| {length} | {one_s * 1e3:.1f} | {group_s * 1e3:.1f} | {one_held / 1e6:.2f} | "
              f"{held / 1e6:.2f} | {gathered / 1e3:.1f} | {equal} |")  # fmt: skip


if __name__ == "__main__":
    main()
