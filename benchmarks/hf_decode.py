"""One decode step of a small Llama (``"ring_dilated"`` with a dilated
pattern, and ``"sdpa"``) with a dynamic and a static cache, eager and
compiled (``torch.compile(fullgraph=True, dynamic=False)``, the static cache
only), at a few cache lengths, float32 on CPU; with ``--chunk N``, a step of
``N`` queries continuing the cache (chunked prefill, assisted decoding).

Each cache holds ``length - 64`` random keys (written by ``cache.update``:
the step's cost does not depend on their values); every variant then takes
one step in turn (round-robin), ``--repeats`` times, each step's keys cropped
from the cache afterwards (untimed) so that every step starts at the same
position, and the medians of the wall and the thread CPU time of a step are
printed. Compilation (inductor) is timed apart; a variant whose compilation
fails is reported as such.

    python benchmarks/hf_decode.py [--lengths 1024 8192 32768] [--repeats 24] [--chunk 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo.testing

SEGMENTS, DILATIONS = [128, 512, 2048], [1, 2, 4]


def _model(attn: str, args: argparse.Namespace, length: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                         max_position_embeddings=length)  # fmt: skip
    if attn == "ring_dilated":
        config.dilated_attention = {"segment_lengths": SEGMENTS, "dilation_rates": DILATIONS}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def _cache(model, kind: str, length: int):
    from transformers import DynamicCache, StaticCache

    config = model.config
    cache = (DynamicCache(config=config) if kind == "dynamic"
             else StaticCache(config=config, max_cache_len=length))  # fmt: skip
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (1, config.num_key_value_heads, length - 64, head_dim)
    gen = torch.Generator().manual_seed(1)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), layer)
    return cache


class Variant:
    def __init__(self, attn, kind, compiled, args, length):
        self.name = f"{attn:12s} {kind:7s} {'compiled' if compiled else 'eager':8s}"
        self.model = _model(attn, args, length)
        self.cache = _cache(self.model, kind, length)
        self.tokens = torch.full((1, args.chunk), 7)
        self.step, self.compiled = self.model.forward, compiled
        self.wall, self.cpu, self.error, self.compile_s, self.frames = [], [], None, 0.0, 0
        if compiled:
            self.counter = torch._dynamo.testing.CompileCounterWithBackend(args.backend)
            self.step = torch.compile(self.model.forward, backend=self.counter, fullgraph=True,
                                      dynamic=False)  # fmt: skip
            start = time.perf_counter()
            try:
                for _ in range(2):
                    self.run()
                    self.rewind()
            except Exception as exc:  # reported: what a user of this variant gets
                self.error = f"{type(exc).__name__}"
            self.compile_s = time.perf_counter() - start
            self.frames = self.counter.frame_count
        else:
            self.run()  # warm-up
            self.rewind()

    def run(self) -> None:
        with torch.no_grad():
            self.step(input_ids=self.tokens, cache=self.cache, use_cache=True)

    def rewind(self) -> None:
        """Drop the step's keys: the next step at the same position."""
        self.cache.crop(-self.tokens.shape[1])

    def timed(self) -> None:
        if self.error:
            return
        wall, cpu = time.perf_counter(), time.thread_time()
        self.run()
        self.cpu.append(time.thread_time() - cpu)
        self.wall.append(time.perf_counter() - wall)
        self.rewind()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=24)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=1, help="queries per step (at most 64)")
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    args = parser.parse_args()
    import ring_attention as ra

    ra.register_transformers()
    torch.set_num_threads(args.threads)
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
          f"({args.heads // 2} K/V), float32, {args.threads} thread(s); ring_dilated pattern "
          f"{SEGMENTS} / {DILATIONS}; backend {args.backend}, fullgraph=True, dynamic=False; "
          f"median of {args.repeats} round-robin steps of {args.chunk} quer"
          f"{'y' if args.chunk == 1 else 'ies'} at position length - 64 ..")  # fmt: skip
    for length in args.lengths:
        torch._dynamo.reset()
        variants = []
        for attn in ("sdpa", "ring_dilated"):
            for kind, compiled in (("dynamic", False), ("static", False), ("static", True)):
                if compiled and args.no_compile:
                    continue
                variants.append(Variant(attn, kind, compiled, args, length))
        for _ in range(args.repeats):
            for v in variants:
                v.timed()
        for v in variants:
            what = f"length {length:6d} {v.name}"
            if v.error:
                print(f"{what}: compiled step fails ({v.error}) after {v.compile_s:.1f} s")
                continue
            compiled = (f"; compile {v.compile_s:.1f} s, {v.frames} frame(s), "
                        f"{v.counter.frame_count - v.frames} recompiled after"
                        if v.compiled else "")  # fmt: skip
            print(f"{what}: wall {statistics.median(v.wall) * 1e3:7.2f} ms, cpu "
                  f"{statistics.median(v.cpu) * 1e3:7.2f} ms{compiled}")  # fmt: skip


if __name__ == "__main__":
    main()
