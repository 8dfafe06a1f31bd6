"""``python -m ring_attention.doctor --model qwen2 --world 3``: one training step of a
transformers model sharded over gloo ranks against one process (docs/transformers.md). It checks
each rank's documents, labels and positions, each layer's attention against a float64 oracle,
the loss, gradients and an AdamW update, prints each rank's peak tensor bytes and bytes sent, and
exits 1 naming the first failure and its likely cause. ``--inject`` plants faults (tests)."""

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .core.multiplicity import log_multiplicity
from .hf.attention import dilated_attention_forward, register_transformers
from .hf.config import layer_pattern
from .hf.setting import ATTN_IMPLEMENTATION, sequence_parallel, shard_causal_lm_batch
from .parallel.testing import run_distributed, tensor_peak

__all__ = ["diagnose", "main"]

#: a model type's tiny config, and what some types need besides
TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=64, head_dim=16)
TINY |= dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
EXTRA = {"mistral": dict(sliding_window=8), "gpt_oss": dict(sliding_window=8, **MOE, **ROPE)}
#: relative tolerances: attention (float32 against float64), loss, gradients, update
TOL = {"attention": 1e-4, "loss": 1e-5, "gradients": 1e-4, "update": 1e-3}
LR = 1e-3
#: the likely cause of each check's failure
CAUSE = {
    "documents": "document boundary dropped (cu_seq_lens_q / position ids' resets lost)",
    "labels": "labels shifted at shard edge (shift the whole sequence, then shard)",
    "positions": "position ids restart at shard edge (shard the whole position_ids)",
    "attention": "sharded attention differs from the oracle (pattern, window or exchange)",
    "loss": "loss not scaled by tokens across ranks (num_items_in_batch: all ranks' labels)",
    "gradients": "gradients not averaged across ranks",
    "update": "optimizer step differs (parameters or gradients differ between ranks)",
}
FAULTS = ("labels", "documents", "positions", "loss")


def build_model(model: str, seed: int) -> torch.nn.Module:
    """A model type's tiny config or a checkpoint (config) directory; float32, no dropout."""
    import transformers as tr

    tr.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)  # the same weights in every process
    kw, found = {"attn_implementation": ATTN_IMPLEMENTATION}, os.path.isdir(model)
    if found and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(model)):
        return tr.AutoModelForCausalLM.from_pretrained(model, **kw).float().eval()
    config = tr.AutoConfig.from_pretrained(model) if found else None
    config = config or tr.AutoConfig.for_model(model, **TINY, **EXTRA.get(model, {}))
    return tr.AutoModelForCausalLM.from_config(config, **kw).float().eval()


def _step(model: torch.nn.Module, batch: dict) -> dict[str, Any]:
    """Loss, gradients and AdamW update of one step averaged over the ranks (as data
    parallelism averages them); this rank's loss, per-token losses and peak tensor bytes."""
    params, out = list(model.parameters()), {}
    out["peak"] = tensor_peak(lambda: out.setdefault("o", model(**batch)).loss.backward())
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = torch.cat([out["o"].loss.detach().view(1), *(g.flatten() for g in grads)])
    out["own"] = float(flat[0])
    if dist.is_initialized():
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
    before = torch.nn.utils.parameters_to_vector(params).detach()
    for p, g in zip(params, flat[1:].split([p.numel() for p in params]), strict=True):
        p.grad = g.view_as(p)
    torch.optim.AdamW(params, lr=LR).step()
    update = torch.nn.utils.parameters_to_vector(params).detach() - before
    logits = out.pop("o").logits[0].detach()
    out["tokens"] = F.cross_entropy(logits, batch["shift_labels"][0], reduction="none")
    return {**out, "loss": float(flat[0]), "grads": flat[1:], "update": update}


def _recorder(records: list) -> Any:
    """The ``"ring_dilated"`` attention entry, recording each call's pattern, inputs, output."""

    def forward(module, query, key, value, attention_mask, **kw):
        out, weights = dilated_attention_forward(module, query, key, value, attention_mask, **kw)
        causal = bool(kw.get("is_causal", getattr(module, "is_causal", True)))
        sinks = None if kw.get("s_aux") is None else kw["s_aux"].detach().clone()
        qkvo = [t.detach().clone() for t in (query, key, value, out)]
        pattern = layer_pattern(module, causal, kw.get("sliding_window"))
        records.append((pattern, kw.get("scaling"), sinks, qkvo))
        return out, weights

    return forward


def _inject(batch: dict, fault: str | None, index: torch.Tensor, n: int) -> None:
    """Break this rank's batch as a faulty training script would (tests)."""
    if fault == "labels":  # the shard's labels shifted in the shard: each edge's label is lost
        batch["shift_labels"] = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    elif fault == "documents":  # one document: the boundaries and the position resets lost
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, n], dtype=torch.int32)
        batch["position_ids"] = index[None]
    elif fault == "positions":  # every shard's positions start at 0
        batch["position_ids"] = torch.arange(index.numel())[None]
    elif fault == "loss":  # each rank's mean over its own tokens
        batch["num_items_in_batch"] = int((batch["shift_labels"] != -100).sum())


def _sharded(spec: dict, fault: str | None) -> dict[str, Any]:
    """This rank's step, its batch as the loss sees it, its attention calls and bytes sent."""
    import transformers

    records, sent, post = [], [], dist.batch_isend_irecv
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, _recorder(records))
    model = build_model(spec["model"], spec["seed"])
    ids, labels, positions = spec["batch"]
    batch = shard_causal_lm_batch(ids, labels, position_ids=positions)
    sp = sequence_parallel()
    index = sp.shard(torch.arange(ids.shape[1])[None])[0]
    _inject(batch, fault, index, ids.shape[1])

    def counting(ops: list) -> Any:
        sent.append(sum(o.tensor.nbytes for o in ops if o.op is dist.isend))
        return post(ops)

    dist.batch_isend_irecv = counting
    try:
        out = _step(model, batch)
    finally:
        dist.batch_isend_irecv = post
    out.update(shard=sp.rank, index=index, labels=batch["shift_labels"][0], sent=sum(sent))
    out.update(positions=batch["position_ids"][0], documents=batch["cu_seq_lens_q"].tolist())
    return {**out, "records": records}


def _rank(rank: int, world: int, spec: dict) -> list[dict[str, Any]]:
    """One rank: its :func:`_sharded` result per fault (the gradients and update: rank 0's)."""
    grid = {"group" if spec["mode"] == "ring" else "ulysses_group": dist.group.WORLD}
    if spec["mode"] == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        dims = ("ring", "ulysses")
        grid = {"mesh": init_device_mesh("cpu", (2, world // 2), mesh_dim_names=dims)}
    register_transformers(**grid)
    try:
        out = [_sharded(spec, fault) for fault in spec["faults"]]
    finally:
        register_transformers()
    return [{k: v for k, v in r.items() if not rank or k not in ("grads", "update")} for r in out]


def oracle(q, k, v, pattern, documents, scale, sinks) -> torch.Tensor:
    """Float64 attention of ``(batch, heads, n, dim)`` q, k, v: ``(batch, n, heads, dim)``."""
    q, k, v = (t.double() for t in (q, k, v))
    heads, n = q.shape[1], q.shape[2]
    k, v = (t.repeat_interleave(heads // t.shape[1], 1) for t in (k, v))
    bias = log_multiplicity(pattern.with_documents(documents), n, heads, dtype=torch.float64)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale) + bias
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, heads, 1, 1).expand(*s.shape[:3], 1)], -1)
    return (torch.softmax(s, -1)[..., :n].nan_to_num() @ v).transpose(1, 2)


def _alignment(r: dict, want: dict, cu: list[int]) -> tuple[list[tuple[str, str]], str]:
    """A rank's failing batch checks (where) and its row: labels and positions at its edges."""
    i, shard = r["index"], f"shard {r['shard']}"
    bad = [] if r["documents"] == cu else [("documents", shard)]
    for c in ("labels", "positions"):
        wrong = torch.nonzero(r[c] != want[c][i]).flatten().tolist()
        bad += [(c, f"{shard}, token {int(i[wrong[0]])}")] if wrong else []
    cell = [f"{int(r[c][j]):4d}/{int(want[c][i[j]]):<4d}" for c in want for j in (0, -1)]
    docs = "ok" if r["documents"] == cu else f"got {r['documents']}"
    row = f"{r['shard']:5d} {int(i[0]):2d}-{int(i[-1]):<3d}|   {cell[0]} {cell[1]}      "
    return bad, row + f"|   {cell[2]} {cell[3]}    | {docs}"


def _layers(ranks: list[dict], cu: list[int]) -> list[tuple[str, float]]:
    """Each layer's kind and error against the :func:`oracle` on the whole sequence."""
    order, out = torch.argsort(torch.cat([r["index"] for r in ranks])), []
    for calls in zip(*(r["records"] for r in ranks), strict=True):
        pattern, scale, sinks, _ = calls[0]
        q, k, v = (torch.cat([c[3][j] for c in calls], 2)[:, :, order] for j in range(3))
        got = torch.cat([c[3][3] for c in calls], 1)[:, order].double()
        want = oracle(q, k, v, pattern, cu, scale, sinks)
        kind = f"window {pattern.window[0] + 1}" if pattern.windowed else "full"
        out.append((kind, float((got - want).abs().max() / want.abs().max())))
    return out


def _report(one: dict, ranks: list[dict], batch: dict, head: str) -> tuple[int, list[str]]:
    """``(status, lines)`` of one sharded step against the one-process step ``one``."""
    cu, world, failed = batch["cu_seq_lens_q"].tolist(), len(ranks), []
    want = {"labels": batch["shift_labels"][0], "positions": batch["position_ids"][0]}
    out = [head, "shard tokens | shifted label first, last | position first, last | documents"]
    for r in ranks:
        bad, row = _alignment(r, want, cu)
        failed, out = failed + bad, [*out, row]
    out.append("attention against a float64 oracle: max |err| / max |oracle|")
    layers = _layers(ranks, cu)
    first = next((j for j, (_, err) in enumerate(layers) if err > TOL["attention"]), None)
    failed += [] if first is None else [("attention", f"layer {first}")]
    checks = [(f"  layer {j:2d} {kind}", "attention", e) for j, (kind, e) in enumerate(layers)]
    s, total = ranks[0], int((want["labels"] != -100).sum())
    shares = [world * float(one["tokens"][r["index"]].sum()) / total for r in ranks]
    loss = max(abs(r["own"] - x) for r, x in zip(ranks, shares, strict=True))
    loss = max(loss, abs(s["loss"] - one["loss"])) / abs(one["loss"])
    rel = {k: float(torch.dist(s[k], one[k]) / one[k].norm()) for k in ("grads", "update")}
    checks += [
        (f"loss: one process {one['loss']:.6f}, ranks' mean {s['loss']:.6f}", "loss", loss),
        (f"gradients: norm {one['grads'].norm():.4e}", "gradients", rel["grads"]),
        (f"update: one AdamW step, lr {LR:.0e}", "update", rel["update"]),
    ]
    for what, name, err in checks:
        verdict = "ok" if err <= TOL[name] else "MISMATCH"
        failed += [] if err <= TOL[name] or name == "attention" else [(name, f"rel err {err:.1e}")]
        out.append(f"{what:62s} {err:.1e} (<= {TOL[name]:.0e}) {verdict}")
    peaks = " ".join(f"{r['peak'] / 2**20:.2f}" for r in ranks)
    out.append(f"peak tensor MiB of the step: one process {one['peak'] / 2**20:.2f}, ranks {peaks}")
    sent = " ".join(str(r["sent"]) for r in ranks)
    out.append(f"bytes each rank sends (attention, forward and backward): {sent}")
    if not failed:
        out.append(f"doctor: OK, {world} ranks equal one process")
    else:
        check, where = failed[0]
        where += "" if first is None else f"; first failing layer {first}"
        out += [f"doctor: MISMATCH in {check} ({where})", f"likely cause: {CAUSE[check]}"]
    return int(bool(failed)), [line[:100] for line in out]


def diagnose(
    model: str = "llama",
    world: int = 2,
    mode: str = "ring",
    documents: Sequence[int] = (11, 1, 10, 7, 11),
    faults: Sequence[str | None] = (None,),
    seed: int = 0,
) -> list[tuple[int, list[str]]]:
    """``(status, report lines)`` per fault (``None``: none), all in one launch of ``world``
    gloo ranks; status 1 names the first failure. Leaves ``register_transformers()``."""
    if mode == "hybrid" and world != 4:
        raise ValueError(f"mode='hybrid' takes world=4 (a 2 x 2 mesh), got world={world}")
    if any(f not in (None, *FAULTS) for f in faults):
        raise ValueError(f"faults must be None or in {FAULTS}, got {list(faults)}")
    register_transformers()
    one_model = build_model(model, seed)
    n, g = sum(documents), torch.Generator().manual_seed(seed)
    ids = torch.randint(1, one_model.config.vocab_size, (1, n), generator=g)
    positions = torch.cat([torch.arange(d) for d in documents])[None]
    labels = ids.masked_fill(positions == 0, -100)
    batch = shard_causal_lm_batch(ids, labels, position_ids=positions)
    one = _step(one_model, batch)
    spec = dict(model=model, seed=seed, batch=(ids, labels, positions), mode=mode, faults=faults)
    runs = zip(*run_distributed(_rank, world, spec, timeout=300), strict=True)
    head = f"ring_attention doctor: {os.path.basename(model)}, {n} tokens, {len(documents)} "
    head += f"documents, {mode} over {world} gloo ranks"
    heads = [head + (f", fault: {f}" if f else "") for f in faults]
    runs = [sorted(ranks, key=lambda r: r["shard"]) for ranks in runs]
    return [_report(one, ranks, batch, h) for h, ranks in zip(heads, runs, strict=True)]


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 when every check passes, 1 on a mismatch, 2 when it cannot run."""
    parser = argparse.ArgumentParser("python -m ring_attention.doctor", description=__doc__)
    models = "a model type made tiny (llama, qwen2, mistral, gpt_oss, ...) or a checkpoint dir"
    parser.add_argument("--model", default="llama", help=models)
    parser.add_argument("--world", type=int, choices=(2, 3, 4), default=2)
    parser.add_argument("--mode", choices=("ring", "ulysses", "hybrid"), default="ring")
    parser.add_argument("--documents", default="11,1,10,7,11", help="packed document lengths")
    faults = f"tests: break one of {', '.join(FAULTS)} (comma-separated: a report each)"
    parser.add_argument("--inject", default="", help=faults)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    try:
        faults, documents = a.inject.split(","), [int(d) for d in a.documents.split(",")]
        reports = diagnose(a.model, a.world, a.mode, documents, [f or None for f in faults], a.seed)
    except (ValueError, RuntimeError) as exc:
        print(f"doctor: could not run: {exc}", file=sys.stderr)
        return 2
    print("\n\n".join("\n".join(lines) for _, lines in reports))
    return max(status for status, _ in reports)


if __name__ == "__main__":  # by the module's name: the workers' function pickles by reference
    from ring_attention.doctor import main as _main

    sys.exit(_main())
