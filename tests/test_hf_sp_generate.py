"""Generation over the sequence-parallel group (docs/design.md §2): every
rank of the group calls ``model.generate()`` with the same prompt and returns
the tokens one process would (greedy tokens identical, logits within
tolerance), on 2 and 3 gloo ranks (the ring) and 4 (the 2 x 2 hybrid), for
Llama (GQA, a dilated pattern), Qwen2 and Mistral (sliding windows) and
gpt-oss (sinks) configs, with left padding in a batch of 2; with the cache
sharded by sequence (``ShardedCache``) each rank's full-attention layers hold
only their share of the positions."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from test_hf import VOCAB, build, tiny_config
from transformers import DynamicCache

import ring_attention as ra
from ring_attention.hf.sharded_cache import ShardedCache, ShardedLayer
from ring_attention.parallel.testing import run_distributed

PATTERN = {"segment_lengths": [4, 8, 16], "dilation_rates": [1, 2, 4]}


def _configs() -> dict:
    import transformers as tr

    gptoss = tr.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128,
        pad_token_id=0,
    )  # fmt: skip
    return {
        "llama-pattern": tiny_config("llama", 2, PATTERN),
        "qwen2-window": tiny_config("qwen2", 2, None, use_sliding_window=True, sliding_window=5,
                                    num_hidden_layers=2,
                                    layer_types=["sliding_attention", "full_attention"]),
        "mistral-window": tiny_config("mistral", 2, None, sliding_window=6),
        "gpt-oss": gptoss,
    }  # fmt: skip


def _prompt():
    ids = torch.randint(1, VOCAB, (2, 19), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    ids[1, :3] = 0
    return ids, mask


def one_process_models() -> tuple:
    """The prompt ``(ids, mask)`` and each config's ``(config, model)`` in one
    process (gpt-oss's sinks far from zero: they must matter)."""
    ra.register_transformers()
    models = []
    for name, cfg in _configs().items():
        model = build(copy.deepcopy(cfg), "ring_dilated")
        if name == "gpt-oss":
            for m in model.modules():
                if hasattr(m, "sinks"):
                    torch.nn.init.normal_(m.sinks, std=2.0)
        models.append((cfg, model))
    return _prompt(), models


def _generate(model, ids, mask, cache=None):
    given = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        res = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, **given)  # fmt: skip
    return res.sequences, torch.stack(res.logits)


def _worker(rank: int, world: int, spread: str, cases: list, sharded: bool) -> list:
    if spread == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        group = {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))}
    else:
        group = {"group": dist.group.WORLD}
    ra.register_transformers(**group)
    ids, mask = _prompt()
    out = []
    for cfg, state in cases:
        model = build(cfg, "ring_dilated", state=state)
        cache = ShardedCache(model.config, block=3) if sharded else None
        out.append((*_generate(model, ids, mask, cache), _held(cache)))
    ra.register_transformers()
    return out


def _held(cache) -> list[int] | None:
    """The positions each full-attention layer of a sharded cache holds here."""
    if cache is None:
        return None
    return [layer.keys.shape[-2] for layer in cache.layers if isinstance(layer, ShardedLayer)]


@pytest.mark.parametrize(
    ("world", "spread", "sharded"),
    [(2, "group", False), (3, "group", False), (4, "hybrid", False), (2, "group", True),
     (3, "group", True), (4, "hybrid", True)],
)  # fmt: skip
def test_every_rank_generates_one_process_tokens(world: int, spread: str, sharded: bool) -> None:
    (ids, mask), models = one_process_models()
    cases = [(cfg, model.state_dict()) for cfg, model in models]
    wants = [_generate(model, ids, mask) for _, model in models]
    got_all = run_distributed(_worker, world, spread, cases, sharded, timeout=400)
    for rank, got in enumerate(got_all):
        for (tokens, logits, _), (want_tokens, want_logits), name in zip(got, wants, _configs(),
                                                                         strict=True):  # fmt: skip
            assert torch.equal(tokens, want_tokens), (rank, name)
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4, msg=name)
    if sharded:  # each full layer's positions, 19 + 8 - 1 cached, split over the ranks
        for i, name in enumerate(_configs()):
            held = [got[i][2] for got in got_all]
            per_layer = list(zip(*held, strict=True))
            # Mistral's layers all slide: transformers' window cache, not sharded
            assert bool(per_layer) == (name != "mistral-window"), name
            for counts in per_layer:
                assert sum(counts) == 19 + 8 - 1, (name, counts)
                assert max(counts) <= -(-19 // world) + 3 * -(-3 // world), (name, counts)


def _one_rank_generates(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from ring_attention import hf

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    ra.register_transformers(mesh=mesh)
    ids = torch.randint(1, VOCAB, (2, 23), generator=torch.Generator().manual_seed(3))
    model = build(tiny_config("llama", 2, PATTERN), "ring_dilated")
    batch = hf.shard_causal_lm_batch(ids, ids)
    if rank == world - 1:  # a generation step beside the others' training step
        del batch["cu_seq_lens_q"], batch["cu_seq_lens_k"]
    try:
        model(**batch, use_cache=rank == world - 1)
    except ValueError as exc:
        return str(exc)
    finally:
        ra.register_transformers()
    return "no error"


def test_generation_beside_training_raises_on_every_rank_of_the_hybrid() -> None:
    for rank, message in enumerate(run_distributed(_one_rank_generates, 4, timeout=120,
                                                   pg_timeout=1800)):  # fmt: skip
        assert "out of step" in message or "rank 3 failed" in message, (rank, message)
        assert "generation over the group" in message or "out of step" in message, message


def _bad_blocks(rank: int, world: int) -> list[str]:
    ra.register_transformers(group=dist.group.WORLD)
    cfg = tiny_config("llama", 2, PATTERN)
    said = []
    for block in (0, -3, True, 2.0):
        try:
            ShardedCache(cfg, block=block)
            said.append("no error")
        except ValueError as exc:
            said.append(str(exc))
    ra.register_transformers()
    dist.barrier()  # no rank leaves while another is still joining the group
    return said


def test_sharded_cache_checks_its_arguments() -> None:
    ra.register_transformers()
    with pytest.raises(ValueError, match="register_transformers"):
        ShardedCache(tiny_config("llama", 2, PATTERN))
    for said in run_distributed(_bad_blocks, 2, timeout=120):
        assert all("block must be a positive int" in s for s in said), said


def _counted(rank: int, world: int, cases: list) -> list:
    """Each case's tokens and this rank's attention calls per layer and step."""
    from ring_attention.hf import attention
    from ring_attention.local import engine

    ra.register_transformers(group=dist.group.WORLD)
    attend, step, counts = engine.attend, attention.generation_step, []

    def counted_attend(*args, **kwargs):
        counts[-1] += 1
        return attend(*args, **kwargs)

    def counted_step(*args, **kwargs):
        counts.append(0)
        return step(*args, **kwargs)

    engine.attend, attention.generation_step = counted_attend, counted_step
    ids, mask, out = *_prompt(), []
    try:
        for cfg, state, sharded in cases:
            model = build(cfg, "ring_dilated", state=state)
            cache = ShardedCache(model.config, block=3) if sharded else DynamicCache()
            out.append((_generate(model, ids, mask, cache)[0], counts[:]))
            counts.clear()
    finally:
        engine.attend, attention.generation_step = attend, step
        ra.register_transformers()
    return out


def test_a_rank_out_of_reach_attends_nothing_and_still_merges() -> None:
    """3 ranks, 19 + 8 positions: a Mistral sliding window of 4 over a full
    cache (every rank holds every position, each attends its third of them)
    and a Llama segment of 8 over a ShardedCache. A rank whose keys the step's
    queries cannot reach runs no attention, yet joins the merge: the tokens
    are one process's."""
    ra.register_transformers()
    ids, mask = _prompt()
    segment = {"segment_lengths": [8], "dilation_rates": [1]}
    configs = [tiny_config("mistral", 2, None, sliding_window=4), tiny_config("llama", 2, segment)]
    cases, wants = [], []
    for cfg, sharded in zip(configs, (False, True), strict=True):
        model = build(copy.deepcopy(cfg), "ring_dilated")
        cases.append((cfg, model.state_dict(), sharded))
        wants.append(_generate(model, ids, mask)[0])
    got = run_distributed(_counted, 3, cases, timeout=300)
    for rank, results in enumerate(got):
        for (tokens, _), want in zip(results, wants, strict=True):
            assert torch.equal(tokens, want), rank
    # (prefill + 7 steps) x 2 layers; from 20 keys on ranks 0 and 1 hold
    # positions < 16, out of the window of the queries at 19 and later
    window, segment = [r[0][1] for r in got], [r[1][1] for r in got]
    assert [c[:2] for c in window] == [[1, 1]] * 3
    assert window[0][2:] == window[1][2:] == [0] * 14 and window[2][2:] == [1] * 14
    # rank 1 holds [7, 13) and, from the query at 22, blocks of 3 positions:
    # the queries at 19-21 reach [16, 22) only
    assert segment[1][2:8] == [0] * 6 and all(segment[1][8:12]), segment[1]
    assert all(segment[0][2:8]) and all(segment[2][2:8]), segment


def _static_and_cropped(rank: int, world: int, cases: list) -> list:
    """Each case's tokens with a static cache, then 8 tokens over a
    ShardedCache cropped by 5 and 8 more; a positive crop's error."""
    ra.register_transformers(group=dist.group.WORLD)
    ids, mask, out, caches = *_prompt(), [], []
    try:
        for cfg, state in cases:
            model = build(cfg, "ring_dilated", state=state)
            static = _generate_with(model, ids, mask, 8, cache_implementation="static")
            caches.append(ShardedCache(model.config, block=2))
            out.append((static, _cropped(model, ids, mask, caches[-1])))
        try:
            caches[0].crop(1)  # Llama's: its layers are sharded
        except ValueError as exc:
            out.append(str(exc))
    finally:
        ra.register_transformers()
    return out


def _cropped(model, ids, mask, cache):
    """8 tokens, the cache cropped by the last 5, 8 more."""
    cache.activate_past_recording()  # transformers' window layers need it to crop
    first = _generate_with(model, ids, mask, 8, cache=cache)[:, :-5]
    cache.crop(-5)  # the cache holds the positions before the last token
    grown = torch.cat([mask, torch.ones_like(first[:, ids.shape[1] :])], dim=1)
    return _generate_with(model, first, grown, 8, cache=cache)


def _generate_with(model, ids, mask, new, **kwargs):
    with torch.no_grad():
        greedy = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
        return model.generate(ids, attention_mask=mask, **greedy, **kwargs)


def test_static_cache_and_cropping_over_the_group() -> None:
    """3 ranks: ``cache_implementation="static"`` (every rank holds every
    slot and attends its third of the filled ones) and a ShardedCache cropped
    (``crop`` drops the last positions on every rank) give one process's
    tokens (a DynamicCache cropped alike), dense, dilated and sliding."""
    ra.register_transformers()
    ids, mask = _prompt()
    configs = [tiny_config("llama", 2, None), tiny_config("llama", 2, PATTERN)]
    configs.append(tiny_config("mistral", 2, None, sliding_window=6))
    cases, wants = [], []
    for cfg in configs:
        model = build(copy.deepcopy(cfg), "ring_dilated")
        cases.append((cfg, model.state_dict()))
        static = _generate_with(model, ids, mask, 8)
        wants.append((static, _cropped(model, ids, mask, DynamicCache())))
    for rank, out in enumerate(run_distributed(_static_and_cropped, 3, cases, timeout=300)):
        for (static, cropped), (want, want_cropped) in zip(out[:-1], wants, strict=True):
            assert torch.equal(static, want) and torch.equal(cropped, want_cropped), rank
        assert "tokens_to_remove <= 0" in out[-1], out[-1]
