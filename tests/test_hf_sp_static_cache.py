"""A static ``ShardedCache`` (``max_cache_len``) over 2 and 3 gloo ranks:
every rank returns one process's tokens (Llama with a pattern, Qwen2 and
gpt-oss mixing sliding-window and full layers, Mistral all sliding; left
padding in a batch of 2); each full layer's storage is preallocated for
``ceil(max_cache_len / p) + block`` positions and written in place;
beam search reorders it in place; generation past ``max_cache_len`` and a
caller's 4-D mask raise ``ValueError`` on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_hf import VOCAB, build, tiny_config
from test_hf_sp_generate import PATTERN, _configs, _generate, _held, _prompt, one_process_models

import ring_attention as ra
from ring_attention.hf.sharded_cache import ShardedCache, ShardedLayer
from ring_attention.parallel.testing import run_distributed

FILLED = 19 + 8 - 1  # the prompt and the new tokens but the last: the positions cached
BLOCK = 3


def _static(rank: int, world: int, cases: list, max_cache_len: int) -> list:
    """Each case's tokens, logits, positions held per full layer, and the
    bytes of its full layers' storage (keys and values) with whether the
    keys handed out are views of it."""
    ra.register_transformers(group=dist.group.WORLD)
    ids, mask = _prompt()
    out = []
    try:
        for cfg, state in cases:
            model = build(cfg, "ring_dilated", state=state)
            cache = ShardedCache(model.config, block=BLOCK, max_cache_len=max_cache_len)
            full = [layer for layer in cache.layers if isinstance(layer, ShardedLayer)]
            tokens, logits = _generate(model, ids, mask, cache)
            stored = sum(t.untyped_storage().nbytes() for layer in full
                         for t in (layer.keys, layer.values))  # fmt: skip
            views = all(layer.keys.data_ptr() == layer.storage[0].data_ptr() for layer in full)
            out.append((tokens, logits, _held(cache), stored, views))
    finally:
        ra.register_transformers()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_static_sharded_cache_generates_one_process_tokens_in_its_share(world: int) -> None:
    (ids, mask), models = one_process_models()
    cases, wants = [], []
    for cfg, model in models:
        cases.append((cfg, model.state_dict()))
        with torch.no_grad():  # one process's static cache: the same tokens
            static = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                    pad_token_id=0, cache_implementation="static")  # fmt: skip
        wants.append((*_generate(model, ids, mask), static))
    got_all = run_distributed(_static, world, cases, FILLED, timeout=400)
    room = -(-FILLED // world) + BLOCK  # positions a rank's layer can hold
    for i, name in enumerate(_configs()):
        want_tokens, want_logits, static = wants[i]
        assert torch.equal(static, want_tokens), name
        for rank, got in enumerate(got_all):
            tokens, logits, held, stored, views = got[i]
            assert torch.equal(tokens, want_tokens), (rank, name)
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4, msg=name)
            # batch 2 x 2 K/V heads x 16 dims x fp32, keys and values, each full layer
            assert stored == len(held) * 2 * (2 * 2 * room * 16 * 4), (rank, name, stored)
            assert views and max(held, default=0) <= room, (rank, name, held)
        per_layer = list(zip(*(got[i][2] for got in got_all), strict=True))
        assert bool(per_layer) == (name != "mistral-window"), name  # all its layers slide
        assert all(sum(counts) == FILLED for counts in per_layer), (name, per_layer)


def _overflows(rank: int, world: int, states: list) -> list:
    """The errors of generating past ``max_cache_len`` (in a decode step and
    in the prefill) and of cropping into the prompt (Qwen2: its first layer
    slides), the positions each layer holds then, and after a crop of 7."""
    ra.register_transformers(group=dist.group.WORLD)
    ids, mask = _prompt()
    llama, qwen2 = (build(cfg, "ring_dilated", state=state)
                    for cfg, state in zip(_crop_configs(), states, strict=True))  # fmt: skip
    said: list = []
    try:
        for max_cache_len in (FILLED - 1, 10):
            try:
                cache = ShardedCache(llama.config, block=BLOCK, max_cache_len=max_cache_len)
                _generate(llama, ids, mask, cache)
                said.append("no error")
            except ValueError as exc:
                said.append(str(exc))
        cache = ShardedCache(qwen2.config, block=BLOCK, max_cache_len=FILLED)
        cache.activate_past_recording()  # transformers' window layers need it to crop
        _generate(qwen2, ids, mask, cache)
        try:
            cache.crop(-FILLED + 5)
            said.append("no error")
        except ValueError as exc:
            said.append(str(exc))
        said.append([layer.get_seq_length() for layer in cache.layers])
        cache.crop(-7)  # the generated positions: allowed
        said.append([layer.get_seq_length() for layer in cache.layers])
    finally:
        ra.register_transformers()
    return said


def _crop_configs() -> list:
    return [tiny_config("llama", 2, PATTERN), _configs()["qwen2-window"]]


def test_generating_past_max_cache_len_raises_on_every_rank() -> None:
    """3 ranks: one position past ``max_cache_len`` in the last decode step,
    a prompt longer than it, and a crop into the prompt raise ``ValueError``
    on every rank, before the step's exchange (no hang) and before any layer
    is cropped."""
    ra.register_transformers()
    states = [build(cfg, "ring_dilated").state_dict() for cfg in _crop_configs()]
    for rank, said in enumerate(run_distributed(_overflows, 3, states, timeout=300)):
        assert f"ShardedCache(max_cache_len={FILLED - 1})" in said[0], (rank, said[0])
        assert f"need max_cache_len >= {FILLED}" in said[0], (rank, said[0])
        assert "max_cache_len >= 19" in said[1], (rank, said[1])
        assert "crops generated positions only" in said[2], (rank, said[2])
        assert said[3:] == [[FILLED, FILLED], [19, 19]], (rank, said[3:])


def _four_d(rank: int, world: int) -> list[str]:
    """A caller's 4-D mask with a dynamic and a static ShardedCache."""
    ra.register_transformers(group=dist.group.WORLD)
    model = build(tiny_config("llama", 2, None), "ring_dilated")
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    said = []
    try:
        for max_cache_len in (None, 20):
            cache = ShardedCache(model.config, block=BLOCK, max_cache_len=max_cache_len)
            try:
                with torch.no_grad():
                    model(ids, attention_mask=causal, cache=cache, use_cache=True)
                said.append("no error")
            except ValueError as exc:
                said.append(str(exc))
        for bad in (0, True, 2.0):
            try:
                ShardedCache(model.config, max_cache_len=bad)
                said.append("no error")
            except ValueError as exc:
                said.append(str(exc))
    finally:
        ra.register_transformers()
    dist.barrier()  # no rank leaves while another is still at work
    return said


def test_a_four_d_mask_and_bad_max_cache_len_raise_on_every_rank() -> None:
    for rank, said in enumerate(run_distributed(_four_d, 3, timeout=120)):
        assert all("takes a 2-D padding mask" in s for s in said[:2]), (rank, said)
        assert all("max_cache_len must be a positive int" in s for s in said[2:]), (rank, said)


def _beams(rank: int, world: int, state: dict) -> list:
    """Beam search's tokens with a dynamic and a static ShardedCache."""
    ra.register_transformers(group=dist.group.WORLD)
    model = build(tiny_config("llama", 2, None), "ring_dilated", state=state)
    try:
        return [_beam_search(model, ShardedCache(model.config, block=2, max_cache_len=room))
                for room in (None, FILLED)]  # fmt: skip
    finally:
        ra.register_transformers()


def _beam_search(model, cache=None):
    ids, mask = _prompt()
    given = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              num_beams=3, pad_token_id=0, **given)  # fmt: skip


def test_beam_search_reorders_a_static_sharded_cache_in_place() -> None:
    """3 ranks, 3 beams: the reordered rows stay in the static layers'
    storage; every rank returns one process's tokens."""
    ra.register_transformers()
    model = build(tiny_config("llama", 2, None), "ring_dilated")
    want = _beam_search(model)
    for rank, got in enumerate(run_distributed(_beams, 3, model.state_dict(), timeout=300)):
        assert all(torch.equal(tokens, want) for tokens in got), rank
