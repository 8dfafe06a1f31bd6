"""A small LongNet-style encoder trained on a synthetic long-range recall task.

Task: a sequence of ``--seq-len`` random tokens from a vocabulary of ``V``
"plain" tokens; one position ``p`` (uniform over the whole sequence) holds a
*marked* token ``V + c``; position 0 holds a query token. The model must
predict ``c`` from its output at position 0. Chance is ``1 / V``.

Two encoders with the same architecture (embedding, ``--layers`` pre-LN
blocks of ``ring_attention.MultiheadDilatedAttention`` + MLP, batch_first) and about the
same attention cost are trained side by side:

- **dilated**: the LongNet pattern ``segment_lengths=[16, 64, 256]``,
  ``dilation_rates=[1, 4, 16]`` — position 0 reaches every 16th position
  directly and, one layer earlier, those positions reach their whole
  16-block, so two layers connect the query to every position;
- **local**: block attention ``segment_lengths=[w]``, ``dilation_rates=[1]``,
  ``w`` chosen so that its pattern FLOPs match the dilated pattern's — the
  query only ever sees its own block, however many layers there are.

The script prints the exact pattern FLOPs of both (4 * head_dim per reached
(query, key) pair and head, forward), the fraction of positions the query can
reach after all layers, and a table of loss / accuracy on held-out data.

Run: ``python examples/longnet_encoder.py [--steps 300] [--seed 0]``
(CPU; one intra-op thread, since the model is tiny: about 40 s of CPU time).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from ring_attention import MultiheadDilatedAttention
from ring_attention.core.multiplicity import multiplicity
from ring_attention.core.pattern import Pattern

VOCAB = 8  # plain tokens 0..7, marked tokens 8..15, query token 16
QUERY_EVERY = 16  # a query token at every 16th position


def query_positions(n: int) -> torch.Tensor:
    return torch.arange(0, n, QUERY_EVERY)


def make_batch(batch: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``(batch, n)`` and targets ``(batch,)``: random plain tokens,
    query tokens at every ``QUERY_EVERY``-th position and one marked token
    ``VOCAB + target`` at a random other position."""
    tokens = torch.randint(0, VOCAB, (batch, n), generator=gen)
    target = torch.randint(0, VOCAB, (batch,), generator=gen)
    # A uniformly random position that is not a query position.
    slot = torch.randint(0, n - len(query_positions(n)), (batch,), generator=gen)
    pos = slot + slot // (QUERY_EVERY - 1) + 1
    tokens[torch.arange(batch), pos] = VOCAB + target
    tokens[:, query_positions(n)] = 2 * VOCAB
    return tokens, target


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, segs, dils, mlp_ratio: int = 2) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = MultiheadDilatedAttention(
            dim, heads, batch_first=True, segment_lengths=segs, dilation_rates=dils
        )
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Encoder(nn.Module):
    def __init__(self, dim: int, heads: int, layers: int, segs, dils) -> None:
        super().__init__()
        self.embed = nn.Embedding(2 * VOCAB + 1, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, segs, dils) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        # Read out at the query positions: (batch, queries, VOCAB).
        return self.head(self.norm(x[:, query_positions(tokens.shape[1])]))


def pattern_stats(n: int, heads: int, head_dim: int, layers: int, segs, dils) -> tuple[int, float]:
    """(forward attention FLOPs of all layers, the fraction of positions whose
    token can reach a query position through ``layers`` layers, averaged over
    the query positions)."""
    m = multiplicity(Pattern(segs, dils), n, heads, dtype=torch.float64)
    flops = int(4 * head_dim * m.sum().item()) * layers
    reach = (m > 0).any(dim=0).double() + torch.eye(n, dtype=torch.float64)  # + residual
    # seen[i, u] = 1 when what is at position u reaches query i through the
    # layers so far: walk backwards from the queries.
    seen = torch.eye(n, dtype=torch.float64)[query_positions(n)]
    for _ in range(layers):
        seen = ((seen @ reach) > 0).double()
    return flops, seen.mean().item()


def loss_and_accuracy(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Cross-entropy and accuracy over every query position."""
    target = target[:, None].expand(logits.shape[:2])
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return loss, (logits.argmax(-1) == target).float().mean().item()


def matched_window(n: int, target_pairs: float) -> int:
    """The block size ``w`` whose pattern reaches the number of pairs closest
    to ``target_pairs`` (per head)."""
    best, best_err = 1, math.inf
    for w in range(1, n + 1):
        full, rest = divmod(n, w)
        pairs = full * w * w + rest * rest
        if abs(pairs - target_pairs) < best_err:
            best, best_err = w, abs(pairs - target_pairs)
    return best


@torch.no_grad()
def evaluate(model: nn.Module, data) -> tuple[float, float]:
    model.eval()
    tokens, target = data
    loss, acc = loss_and_accuracy(model(tokens), target)
    model.train()
    return loss.item(), acc


def main(argv: list[str] | None = None) -> dict[str, list[tuple[int, float, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    n, hd = args.seq_len, args.dim // args.heads
    dil_segs, dil_rates = [16, 64, 256], [1, 4, 16]
    dil_pairs = multiplicity(Pattern(dil_segs, dil_rates), n, 1).sum().item()
    w = matched_window(n, dil_pairs)
    configs = {"dilated": (dil_segs, dil_rates), "local": ([w], [1])}

    print(f"seq_len={n} dim={args.dim} heads={args.heads} layers={args.layers} "
          f"batch={args.batch} steps={args.steps} seed={args.seed}")  # fmt: skip
    print(f"{'model':8s} {'pattern':42s} {'attn GFLOP/seq (fwd)':>21s} {'query reach':>12s}")
    for name, (segs, dils) in configs.items():
        flops, reach = pattern_stats(n, args.heads, hd, args.layers, segs, dils)
        pattern = f"segments={segs} dilations={dils}"
        print(f"{name:8s} {pattern:42s} {flops / 1e9:21.4f} {reach:12.1%}")

    eval_data = make_batch(512, n, torch.Generator().manual_seed(args.seed + 12345))
    models, opts, gens = {}, {}, {}
    for name, (segs, dils) in configs.items():
        torch.manual_seed(args.seed)
        models[name] = Encoder(args.dim, args.heads, args.layers, segs, dils)
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=args.lr, weight_decay=0.01)
        gens[name] = torch.Generator().manual_seed(args.seed)  # same batches for both

    history: dict[str, list[tuple[int, float, float]]] = {name: [] for name in configs}
    header = f"{'step':>6s} | {'dilated loss':>12s} {'acc':>6s} | {'local loss':>10s} {'acc':>6s}"
    print(header)
    print("-" * len(header))

    def report(step: int) -> None:
        row = []
        for name in configs:
            loss, acc = evaluate(models[name], eval_data)
            history[name].append((step, loss, acc))
            row.append((loss, acc))
        (dl, da), (ll, la) = row
        print(f"{step:6d} | {dl:12.4f} {da:6.1%} | {ll:10.4f} {la:6.1%}", flush=True)

    report(0)
    for step in range(1, args.steps + 1):
        for name, model in models.items():
            tokens, target = make_batch(args.batch, n, gens[name])
            loss, _ = loss_and_accuracy(model(tokens), target)
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            opts[name].step()
        if step % args.eval_every == 0 or step == args.steps:
            report(step)
    print(f"chance accuracy {1 / VOCAB:.1%}; runtime {time.perf_counter() - t0:.1f} s "
          f"({args.threads} threads)")  # fmt: skip
    return history


if __name__ == "__main__":
    main()
