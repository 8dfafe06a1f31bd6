"""``torch.compile`` against eager, forward and backward, of (1) the ring call
``ring_dilated_attention`` and (2) one transformers decoder layer (Llama,
``attn_implementation="ring_dilated"``), on ``--world`` gloo processes that
share the sequence (``--world 1``: the local kernels in one process).

Each is compiled with ``fullgraph=True`` (a graph break would be an error);
compilation is timed apart in the warm-up, then eager and compiled steps
alternate (round-robin) and the medians, their ratio and the number of
frames compiled after warm-up (0: no recompilation) are printed per rank.

    python benchmarks/hf_compile.py [--world 2] [--seq 4096] [--backend inductor]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo
import torch._dynamo.testing
import torch.distributed as dist

SEGMENTS, DILATIONS = [128, 512, 2048], [1, 2, 4]


def _time(fn, inputs, params) -> float:
    start = time.perf_counter()
    out = fn(*inputs)
    torch.autograd.grad(out.sum(), params)
    return time.perf_counter() - start


def _compare(fn, inputs, params, args) -> dict:
    """Warm-up (compilation included), then eager and compiled alternately."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(args.backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    start = time.perf_counter()
    for _ in range(args.warmup):
        _time(compiled, inputs, params)
    warm = time.perf_counter() - start
    frames = counter.frame_count
    for _ in range(args.warmup):
        _time(fn, inputs, params)
    eager, comp = [], []
    for _ in range(args.repeats):
        eager.append(_time(fn, inputs, params))
        comp.append(_time(compiled, inputs, params))
    return {"eager": statistics.median(eager), "compiled": statistics.median(comp),
            "warmup": warm, "frames": frames,
            "recompiled": counter.frame_count - frames}  # fmt: skip


def _run(rank: int, world: int, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ring_attention as ra

    torch.set_num_threads(args.threads)
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(0)
    found = {}

    # (1) The ring call: causal, GQA.
    H, D = args.heads, args.hidden // args.heads
    q, k, v = (ra.shard_sequence(torch.randn(1, args.seq, h, D), 1, group).requires_grad_()
               for h in (H, H // 2, H // 2))  # fmt: skip

    def ring(q, k, v):
        return ra.ring_dilated_attention(q, k, v, SEGMENTS, DILATIONS, causal=True, group=group)

    found["ring call"] = _compare(ring, (q, k, v), (q, k, v), args)

    # (2) One decoder layer, its attention the ring over the same ranks.
    ra.register_transformers(group=group)
    config = LlamaConfig(vocab_size=1000, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_hidden_layers=1,
                         num_attention_heads=H, num_key_value_heads=H // 2,
                         max_position_embeddings=args.seq)  # fmt: skip
    config.dilated_attention = {"segment_lengths": SEGMENTS, "dilation_rates": DILATIONS}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated")
    layer = model.model.layers[0]
    x = ra.shard_sequence(torch.randn(1, args.seq, args.hidden), 1, group).requires_grad_()
    positions = ra.shard_sequence(torch.arange(args.seq)[None], 1, group)
    rope = tuple(t.detach() for t in model.model.rotary_emb(x, positions))
    docs = torch.tensor([0, args.seq], dtype=torch.int32)

    def decoder(x):
        return layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope,
                     cu_seq_lens_q=docs, cu_seq_lens_k=docs)  # fmt: skip

    found["decoder layer"] = _compare(decoder, (x,), [x, *layer.parameters()], args)
    ra.register_transformers()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="processes sharing the sequence")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.world > 1:
        from ring_attention.parallel.testing import run_distributed

        results = run_distributed(_run, args.world, args, timeout=3600, pg_timeout=600,
                                  threads=args.threads)  # fmt: skip
    else:
        results = [_run(0, 1, args)]
    print(f"seq {args.seq}, hidden {args.hidden}, {args.heads} heads ({args.heads // 2} K/V), "
          f"pattern {SEGMENTS} / {DILATIONS} causal, float32, {args.world} process(es), "
          f"{args.threads} thread(s) each, backend {args.backend}, fullgraph=True; forward + "
          f"backward, median of {args.repeats} round-robin")  # fmt: skip
    for rank, found in enumerate(results):
        for what, r in found.items():
            ratio = r["eager"] / r["compiled"]
            print(f"rank {rank} {what:13s}: eager {r['eager'] * 1e3:8.1f} ms, compiled "
                  f"{r['compiled'] * 1e3:8.1f} ms, eager / compiled {ratio:.2f}"
                  f"; warm-up {r['warmup']:.1f} s, {r['frames']} frame(s), {r['recompiled']} "
                  "recompiled after")  # fmt: skip


if __name__ == "__main__":
    main()
