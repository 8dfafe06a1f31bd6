"""Per-layer overhead of the transformers backend ("ring_dilated") over its
kernels. transformers prepares a batch's mask once and then calls the
attention function once per layer with the same tensors; this times that
call (``hf.dilated_attention_forward``) against the bare kernel call on a
pattern built once (``ring_attention.local.functional.attend``), on a short packed
sequence so that the work around the kernels shows: ``--batches`` batches
(new tensors each) of ``--layers`` calls, round-robin, the median of the
repeats.

    python benchmarks/hf_overhead.py [--layers 16] [--seq 64] [--docs 4]

Prints per case (documents from ``cu_seq_lens_q``, from ``position_ids``
as transformers' mask preparation decides them, none) the time per layer
call of both and the difference. Runs on any checkout that has
``ring_attention.hf.dilated_attention_forward`` (to compare revisions).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.masking_utils import create_causal_mask

import ring_attention as ra
from ring_attention import hf
from ring_attention.core.pattern import Pattern
from ring_attention.local.functional import attend

PATTERN = {"segment_lengths": [8, 32], "dilation_rates": [1, 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--docs", type=int, default=4, help="packed documents (equal lengths)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ra.register_transformers()
    n, docs = args.seq, args.docs
    bounds = [round(i * n / docs) for i in range(docs + 1)]
    config = LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4 * n)  # fmt: skip
    config.dilated_attention = PATTERN
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated")
    module = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n, 16, generator=gen)
    k, v = torch.randn(1, 2, n, 16, generator=gen), torch.randn(1, 2, n, 16, generator=gen)
    positions = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(bounds)])[None]
    embeds = torch.zeros(1, n, 64)
    base = Pattern(PATTERN["segment_lengths"], PATTERN["dilation_rates"], causal=True)

    def batches(case: str):
        """Per batch: the mask and kwargs transformers passes to every layer."""
        for _ in range(args.batches):
            if case == "cu_seq_lens_q":
                cu = torch.tensor(bounds, dtype=torch.int32)
                yield None, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "position_ids": positions}
            elif case == "position_ids":
                pos = positions.clone()
                mask = create_causal_mask(config, embeds, None, None, position_ids=pos)
                yield mask, {"position_ids": pos}
            else:
                yield None, {"position_ids": torch.arange(n)[None]}

    def run_backend(case: str) -> None:
        for mask, kwargs in batches(case):
            for _ in range(args.layers):
                hf.dilated_attention_forward(module, q, k, v, mask, scaling=0.25, **kwargs)

    def run_kernels(case: str) -> None:
        pattern = base.with_documents(None if case == "one document" else bounds)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        for _ in batches(case):
            for _ in range(args.layers):
                attend(qt, kt, vt, pattern, scale=0.25)

    calls = args.batches * args.layers
    print(f"{n} tokens, {docs} documents, {args.batches} batches x {args.layers} layers, "
          f"{args.repeats} repeats")  # fmt: skip
    print(f"{'case':>14} | {'backend us':>10} | {'kernels us':>10} | overhead per layer us")
    with torch.no_grad():
        for case in ("cu_seq_lens_q", "position_ids", "one document"):
            times: dict[str, list[float]] = {"backend": [], "kernels": []}
            run_backend(case), run_kernels(case)  # warm up
            for _ in range(args.repeats):
                for key, fn in (("backend", run_backend), ("kernels", run_kernels)):
                    start = time.perf_counter()
                    fn(case)
                    times[key].append((time.perf_counter() - start) / calls)
            b, kern = statistics.median(times["backend"]), statistics.median(times["kernels"])
            print(f"{case:>14} | {b * 1e6:10.1f} | {kern * 1e6:10.1f} | {(b - kern) * 1e6:8.1f}")


if __name__ == "__main__":
    main()
