"""The model families with sinks, sliding and chunked layers under
``"ring_dilated"``: gpt-oss (attention sinks ``s_aux``, sliding and full
layers), Gemma 3 (sliding and global layers, ``query_pre_attn_scalar``),
Gemma 4 (global layers with their own head size and keys as values, layers
sharing earlier layers' keys),
OLMo 3 and Cohere 2 (mixed sliding layers), Llama 4 text (chunked attention:
the pattern ``[(chunk, 1)]``). Each equals the attention the model itself
uses (``"eager"`` for gpt-oss, whose sinks ``"sdpa"`` does not take;
``"sdpa"`` for the others), logits and every gradient in float64, with right
padding, and greedy generation with a cache; sequence-parallel training on
4 gloo ranks (the 2 x 2 hybrid and one of the ring and Ulysses per family;
3 AdamW steps on packed documents that cross the ranks) equals one process,
sinks included."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import transformers as tr
from test_hf import VOCAB, causal_lm_step

import ring_attention as ra
from ring_attention.parallel.testing import run_distributed

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=128, pad_token_id=0)  # fmt: skip
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]


def config(family: str):
    """A tiny config of ``family`` whose layers mix sliding (or chunked) and
    full attention over sequences longer than the window."""
    if family == "gpt-oss":
        return tr.GptOssConfig(sliding_window=6, layer_types=MIXED, num_local_experts=4,
                               num_experts_per_tok=2, **COMMON)  # fmt: skip
    if family == "gemma3":
        return tr.Gemma3TextConfig(sliding_window=6, sliding_window_pattern=2,
                                   query_pre_attn_scalar=24, **COMMON)  # fmt: skip
    if family == "gemma4":  # global layers of their own head size, keys as values; the
        # last two layers reuse earlier layers' keys (a prefill computes their last query only)
        return tr.Gemma4TextConfig(
            sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
            global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
            num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
            initializer_range=0.1,  # at 0.02 AdamW takes float32's rounding past the tolerance
            **{**COMMON, "num_hidden_layers": 4},
        )  # fmt: skip
    if family == "olmo3":
        return tr.Olmo3Config(sliding_window=6, layer_types=MIXED, **COMMON)
    if family == "cohere2":
        return tr.Cohere2Config(sliding_window=6, layer_types=MIXED, **COMMON)
    assert family == "llama4"
    return tr.Llama4TextConfig(
        attention_chunk_size=8, layer_types=["chunked_attention", "full_attention"] * 2,
        num_local_experts=2, intermediate_size_mlp=64, **{**COMMON, "num_hidden_layers": 4},
    )  # fmt: skip


FAMILIES = ["gpt-oss", "gemma3", "llama4", "olmo3", "cohere2", "gemma4"]
#: float64 where the model runs in it (its experts' grouped matmul does not)
DTYPE = {"gpt-oss": torch.float32, "llama4": torch.float32}
#: (logits, gradients) tolerance, relative and absolute
TOL = {torch.float32: (2e-5, 2e-4), torch.float64: (1e-9, 1e-7)}


def build(family: str, attn: str, state: dict | None = None):
    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(copy.deepcopy(config(family)),
                                                attn_implementation=attn)  # fmt: skip
    if state is None:
        for m in model.modules():  # sinks far from zero: they must matter
            if hasattr(m, "sinks"):
                torch.nn.init.normal_(m.sinks, std=2.0)
    else:
        model.load_state_dict(state)
    return model.to(DTYPE.get(family, torch.float64)).eval()


def reference(family: str) -> str:
    return "eager" if family == "gpt-oss" else "sdpa"


@pytest.fixture(autouse=True)
def registered():
    ra.register_transformers()
    yield
    ra.register_transformers()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_equals_the_models_own_attention(family: str, side: str) -> None:
    ref = build(family, reference(family))
    ring = build(family, "ring_dilated", ref.state_dict())
    ids = torch.randint(1, VOCAB, (3, 23), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # 6 padded (Llama 4's chunks of 8 move on by 2 and 5 on the left)
    mask[2, 20:] = 0
    if side == "left":
        mask = mask.flip(1)
    keep = mask.bool()
    got, want = [], []
    for model, out in ((ref, want), (ring, got)):
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits[keep] ** 2).sum().backward()
        out += [logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                  if p.grad is not None}]  # fmt: skip
    tol, gtol = TOL[DTYPE.get(family, torch.float64)]
    torch.testing.assert_close(got[0][keep], want[0][keep], rtol=tol, atol=tol)
    assert got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        scale = float(g.abs().max())
        torch.testing.assert_close(got[1][name], g, rtol=gtol, atol=gtol * scale, msg=name)
    if family == "gpt-oss":
        assert any(n.endswith("sinks") for n in got[1]), "no gradient reached the sinks"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_the_models_own(family: str, cache: str) -> None:
    """Left padding (Llama 4: its chunked layers' window cache, each row's
    chunks moved on), transformers' dynamic or static cache."""
    ref = build(family, reference(family))
    ring = build(family, "ring_dilated", ref.state_dict())
    ids = torch.randint(1, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    kw["cache_implementation"] = cache
    assert torch.equal(ring.generate(ids, **kw), ref.generate(ids, **kw))


#: optimizer steps of the sequence-parallel training tests
STEPS = 3


def _train(model, batches: list) -> list:
    """(loss, gradients) of each of ``len(batches)`` AdamW steps on this
    rank's shards; each step's loss and gradients are summed over the ranks
    (each rank's share of the whole batch's) before the step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sharded = dist.is_initialized()
    out = []
    for ids, labels, positions in batches:
        loss, grads = causal_lm_step(model, ids, labels, positions)
        if sharded:
            for t in (loss, *grads.values()):
                dist.all_reduce(t)
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        opt.step()
        out.append((loss, grads))
    return out


def _sp_worker(rank: int, world: int, cases: list) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    results = []
    for spread, family, state, batches in cases:
        group = {"mesh": mesh} if spread == "hybrid" else {spread: dist.group.WORLD}
        ra.register_transformers(**group)
        results.append(_train(build(family, "ring_dilated", state).train(), batches))
    ra.register_transformers()
    return results


def _sp_cases(modes: list[tuple[str, str]]) -> tuple[list, dict]:
    """The ``(spread, family, state, batches)`` cases of ``modes`` and each
    family's one-process results."""
    gen = torch.Generator().manual_seed(7)
    data, wants, states = {}, {}, {}
    # one generator, family after family: a new family goes last, leaving the
    # others' batches as they were (AdamW's first step amplifies float32's
    # rounding: the tolerance is met on these batches)
    for family in FAMILIES:
        batches = data.setdefault(family, [])
        for _ in range(STEPS):
            lengths = [10, 1, 7, 9, 12]  # packed documents crossing the shard boundaries
            ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=gen)
            positions = torch.cat([torch.arange(n) for n in lengths])[None]
            labels = ids.clone()
            labels[positions == 0] = -100
            if family == "llama4":  # chunks start at 0: no packed documents, one sequence
                positions = None
            batches.append((ids, labels, positions))
    for family in dict.fromkeys(f for _, f in modes):
        model = build(family, "ring_dilated").train()
        states[family] = copy.deepcopy(model.state_dict())
        wants[family] = _train(model, data[family])
    return [(s, f, states[f], data[f]) for s, f in modes], wants


#: every family on the ring (windows and chunks crossing the ranks), Ulysses
#: (the sinks split by heads) and the hybrid, in one world
SP_MODES = [(spread, f) for f in FAMILIES for spread in ("group", "ulysses_group", "hybrid")]


def test_sequence_parallel_training_equals_one_process() -> None:
    """STEPS AdamW steps on 4 ranks: every step's loss and every parameter's
    gradient (the sinks' included) equal one process's."""
    cases, wants = _sp_cases(SP_MODES)
    out = run_distributed(_sp_worker, 4, cases, timeout=400)
    for rank_results in out:
        for steps, (spread, family) in zip(rank_results, SP_MODES, strict=True):
            want_steps = wants[family]
            assert len(steps) == STEPS
            for step, ((loss, grads), (want_loss, want_grads)) in enumerate(
                zip(steps, want_steps, strict=True)
            ):
                # transformers computes the loss in float32 whatever the model's dtype,
                # so its value and the gradients are float32's (the issue's tolerance)
                gtol = TOL[torch.float32][1]
                where = f"{family} on {spread}, step {step}"
                torch.testing.assert_close(loss, want_loss, rtol=2e-6, atol=2e-6, msg=where)
                for name, g in want_grads.items():
                    scale = float(g.abs().max())
                    torch.testing.assert_close(grads[name], g, rtol=gtol, atol=gtol * scale,
                                               msg=f"{where} {name}")  # fmt: skip
            if family == "gpt-oss":
                sinks = [g for n, g in steps[0][1].items() if n.endswith("sinks")]
                assert sinks and all(bool(g.abs().sum() > 0) for g in sinks), "sinks' gradient"


def _gemma4_generates(rank: int, world: int, state: dict) -> str:
    ra.register_transformers(group=dist.group.WORLD)
    model = build("gemma4", "ring_dilated", state)
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    try:
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    except ValueError as exc:
        return str(exc)
    finally:
        ra.register_transformers()
    return "no error"


def test_gemma4_generation_over_the_group_raises_on_every_rank() -> None:
    """Gemma 4's layers receive no ``use_cache``: generation over the group is
    refused on every rank (docs/transformers.md), not computed as a shard."""
    state = build("gemma4", "ring_dilated").state_dict()
    for message in run_distributed(_gemma4_generates, 2, state, timeout=120):
        assert "cu_seq_lens_q" in message, message
