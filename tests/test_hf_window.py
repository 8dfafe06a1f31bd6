"""Sliding windows in the transformers backend: each layer's
``sliding_window`` (Mistral: every layer; Qwen2/Qwen3 with ``layer_types``
mixing full and sliding layers; Gemma's alternation) equals transformers'
own ``"sdpa"`` on the same model, forward and backward, with padding, packed
batches, KV-cache generation (sliding caches hold only the last keys) and
sequence parallelism (ring and Ulysses, real gloo processes). References:
``"sdpa"`` (its functions under another name for Gemma2), the float64 oracle
for dilated patterns with a window, the single-process model for sequence
parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from oracle import reference_attention
from test_hf import (
    VOCAB,
    assert_same_logits,
    build,
    causal_lm_step,
    padding_mask,
    tiny_config,
)
from transformers import (
    AttentionInterface,
    DynamicCache,
    Gemma2Config,
    Gemma3TextConfig,
    StaticCache,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

import ring_attention as ra
from ring_attention import hf
from ring_attention.hf.attention import dilated_attention_forward
from ring_attention.hf.config import layer_window
from ring_attention.parallel.testing import run_distributed

W = 5  # shorter than every sequence below
PATTERN = {"segment_lengths": [3, 8], "dilation_rates": [1, 2]}


def window_config(arch: str, kv_heads: int = 2, pattern: dict | None = None, window: int = W):
    """A tiny config whose layers slide over ``window`` keys: Mistral every
    layer, Qwen2/Qwen3/Gemma some (``layer_types``)."""
    if arch == "mistral":
        return tiny_config("mistral", kv_heads, pattern, sliding_window=window)
    if arch in ("qwen2", "qwen3"):
        types = ["sliding_attention", "full_attention", "sliding_attention"]
        if arch == "qwen3":
            types = types[::-1]
        return tiny_config(arch, kv_heads, pattern, use_sliding_window=True,
                           sliding_window=window, num_hidden_layers=3,
                           layer_types=types)  # fmt: skip
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
        max_position_embeddings=256, pad_token_id=0, sliding_window=window,
    )  # fmt: skip
    if arch == "gemma3":  # sliding, full, sliding
        cfg = Gemma3TextConfig(sliding_window_pattern=2, **common)
    elif arch == "gemma2":  # no soft-capping in attention (the kernels do not apply it)
        cfg = Gemma2Config(attn_logit_softcapping=None, **common)
    else:
        raise AssertionError(arch)
    if pattern is not None:
        cfg.dilated_attention = pattern
    return cfg


def _layers(model):
    return [layer.self_attn for layer in model.model.layers]


@pytest.fixture(autouse=True)
def registered():
    ra.register_transformers()
    yield
    ra.register_transformers()


# ---------------------------------------------------------------------------
# What sliding_window = W means: transformers' own mask, exactly.


@pytest.mark.parametrize("width", [1, 2, 5, 40])
def test_layer_window_is_transformers_sliding_mask(width) -> None:
    """``window=(W - 1, 0)`` reaches exactly the keys of transformers'
    sliding-window causal mask (``kv_idx > q_idx - W``), and only the
    sliding layers of a mixed model have it."""
    n = 12
    want = sdpa_mask(batch_size=1, q_length=n, kv_length=n, allow_is_causal_skip=False,
                     mask_function=sliding_window_causal_mask_function(width))[0, 0]  # fmt: skip
    mistral = build(window_config("mistral", window=width), "ring_dilated")
    left, right = layer_window(_layers(mistral)[0], True)
    t, u = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal((t - left <= u) & (u <= t) & (u <= t + right), want)
    qwen2 = build(window_config("qwen2", window=width), "ring_dilated")
    assert [layer_window(m, True) for m in _layers(qwen2)] == [(width - 1, 0), None,
                                                               (width - 1, 0)]  # fmt: skip


# ---------------------------------------------------------------------------
# Forward and backward against sdpa.


@pytest.mark.parametrize(
    ("arch", "kv_heads", "padding"),
    [("mistral", 2, "none"), ("mistral", 4, "left"), ("qwen2", 1, "right"),
     ("qwen2", 2, "left"), ("qwen3", 2, "none"), ("gemma3", 2, "left")],
)  # fmt: skip
def test_equals_sdpa(arch, kv_heads, padding) -> None:
    cfg = window_config(arch, kv_heads)
    sdpa = build(cfg, "sdpa", torch.float64)
    ring = build(cfg, "ring_dilated", torch.float64, state=sdpa.state_dict())
    ids = torch.randint(1, VOCAB, (2, 23), generator=torch.Generator().manual_seed(1))
    mask = padding_mask(padding, 2, 23)
    got, keep = assert_same_logits(sdpa, ring, ids, mask, (1e-10, 1e-10), (1e-9, 1e-10))
    # The window matters: without it the same weights give other logits.
    wide = build(window_config(arch, kv_heads, window=64), "ring_dilated", torch.float64,
                 state=sdpa.state_dict())  # fmt: skip
    assert (wide(ids, attention_mask=mask).logits.detach()[keep] - got[keep]).abs().max() > 1e-3


def test_gemma2_equals_sdpa() -> None:
    """Gemma2 refuses "sdpa" by name: transformers' sdpa attention and mask
    functions registered under another name are the reference."""
    AttentionInterface.register("reference_attention", sdpa_attention_forward)
    AttentionMaskInterface.register("reference_attention", sdpa_mask)
    cfg = window_config("gemma2")
    sdpa = build(cfg, "reference_attention", torch.float64)
    ring = build(cfg, "ring_dilated", torch.float64, state=sdpa.state_dict())
    ids = torch.randint(1, VOCAB, (2, 19), generator=torch.Generator().manual_seed(2))
    mask = padding_mask("right", 2, 19)
    assert_same_logits(sdpa, ring, ids, mask, (1e-10, 1e-10), (1e-9, 1e-10))


@pytest.mark.parametrize(("arch", "kv_heads"), [("mistral", 2), ("qwen2", 1), ("gemma3", 4)])
def test_packed_batch_equals_sdpa(arch, kv_heads) -> None:
    """Position ids restarting per document (longer and shorter than the
    window): transformers slides within each document, as do the kernels."""
    cfg = window_config(arch, kv_heads)
    sdpa = build(cfg, "sdpa", torch.float64)
    ring = build(cfg, "ring_dilated", torch.float64, state=sdpa.state_dict())
    lengths = [9, 3, 11, 2]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].expand(2, -1)
    ids = torch.randint(1, VOCAB, (2, sum(lengths)), generator=torch.Generator().manual_seed(3))
    results = []
    for model in (sdpa, ring):
        model.zero_grad()
        logits = model(ids, position_ids=positions).logits
        logits.pow(2).sum().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-9, atol=1e-10, msg=name)


def oracle_window_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The float64 oracle with the layer's dilated pattern and its window,
    ``(W - 1, 0)`` of the ``sliding_window`` transformers passes."""
    entry = module.config.dilated_attention
    width = kwargs.get("sliding_window")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    kpm = None if attention_mask is None else ~attention_mask.bool()
    out, _ = reference_attention(
        q, k, v, entry["segment_lengths"], entry["dilation_rates"], causal=True, scale=scaling,
        key_padding_mask=kpm, window=None if width is None else (width - 1, 0),
    )  # fmt: skip
    return out.to(query.dtype), None


@pytest.mark.parametrize(("arch", "padding"), [("mistral", "left"), ("qwen2", "right")])
def test_dilated_pattern_with_window_matches_oracle(arch, padding) -> None:
    AttentionInterface.register("oracle_window", oracle_window_attention)
    AttentionMaskInterface.register("oracle_window", hf.dilated_attention_mask)
    cfg = window_config(arch, 2, PATTERN)
    oracle = build(cfg, "oracle_window", torch.float64)
    ring = build(cfg, "ring_dilated", torch.float64, state=oracle.state_dict())
    ids = torch.randint(1, VOCAB, (2, 27), generator=torch.Generator().manual_seed(4))
    mask = padding_mask(padding, 2, 27)
    assert_same_logits(oracle, ring, ids, mask, (1e-9, 1e-9), (1e-8, 1e-9))


# ---------------------------------------------------------------------------
# KV caches: sliding caches keep only the last keys.


def _generate(model, prompt, **kwargs):
    model.generation_config.eos_token_id = None
    return model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, **kwargs)


PROMPT = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
PROMPT_MASK = torch.ones_like(PROMPT)
PROMPT_MASK[1, :4] = 0  # left padding


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_equals_sdpa(arch, cache) -> None:
    """A left-padded prompt longer than the window: with a cache equals
    without one, and equals sdpa's."""
    cfg = window_config(arch)
    ring = build(cfg, "ring_dilated", torch.float64)
    sdpa = build(cfg, "sdpa", torch.float64, state=ring.state_dict())
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    want = _generate(ring, PROMPT, attention_mask=PROMPT_MASK, use_cache=False)
    assert torch.equal(_generate(ring, PROMPT, attention_mask=PROMPT_MASK, **extra), want)
    assert torch.equal(_generate(sdpa, PROMPT, attention_mask=PROMPT_MASK, **extra), want)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_dilated_generation_with_sliding_cache(arch, cache) -> None:
    """A dilated pattern with a window depends on the keys' global
    positions: a sliding cache's last keys stand at theirs."""
    model = build(window_config(arch, pattern=PATTERN), "ring_dilated", torch.float64)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    want = _generate(model, PROMPT, attention_mask=PROMPT_MASK, use_cache=False)
    assert torch.equal(_generate(model, PROMPT, attention_mask=PROMPT_MASK, **extra), want)


@pytest.mark.parametrize("pattern", [None, PATTERN])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_continuing_a_sliding_cache_equals_recomputing(pattern, cache) -> None:
    """A prefix longer than the window in the cache, then several tokens at
    once: logits and (dynamic cache) gradients equal the whole sequence's."""
    model = build(window_config("mistral", pattern=pattern), "ring_dilated", torch.float64)
    ids = torch.randint(1, VOCAB, (2, 26), generator=torch.Generator().manual_seed(6))
    split = 17
    model.zero_grad()
    full = model(ids, use_cache=False).logits[:, split:]
    full.pow(2).sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    if cache == "dynamic":
        past = DynamicCache(config=model.config)
    else:
        past = StaticCache(config=model.config, max_cache_len=40)
    with torch.set_grad_enabled(cache == "dynamic"):
        model(ids[:, :split], cache=past, use_cache=True)
        assert past.layers[0].keys.shape[2] < split  # the cache dropped early keys
        got = model(ids[:, split:], cache=past, use_cache=True).logits
    torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-10)
    if cache == "dynamic":
        got.pow(2).sum().backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-8, atol=1e-10, msg=name)


# ---------------------------------------------------------------------------
# What the kernels cannot take raises.


def test_refusals() -> None:
    model = build(window_config("mistral"), "ring_dilated")
    attn = _layers(model)[0]
    q = torch.randn(1, 4, 6, 16)
    k = v = torch.randn(1, 2, 6, 16)
    # the layer's sliding_window kwarg must be the config's
    with pytest.raises(ValueError, match=r"sliding_window=6.*mask is 5"):
        dilated_attention_forward(attn, q, k, v, None, sliding_window=6)
    # a window on a non-causal call
    with pytest.raises(ValueError, match="causal attention only"):
        dilated_attention_forward(attn, q, k, v, None, is_causal=False)
    # dropout: sdpa would need transformers' 4-D mask
    for key_map in (None, torch.ones(1, 6, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"sliding window.*attention dropout"):
            dilated_attention_forward(attn, q, k, v, key_map, dropout=0.1)
    # keys that start after position 0 (a cache that dropped some) need a
    # window no wider than the cache keeps
    mask = torch.ones(1, 9, dtype=torch.bool)
    dilated_attention_forward(attn, q[:, :, :1], k[:, :, :5], v[:, :, :5], mask)
    with pytest.raises(ValueError, match=r"keys from position 5 on.*reach keys from position 4"):
        dilated_attention_forward(attn, q[:, :, :1], k[:, :, :4], v[:, :, :4], mask)
    full = _layers(build(tiny_config("mistral"), "ring_dilated"))[0]
    with pytest.raises(ValueError, match="reach every earlier key"):
        dilated_attention_forward(full, q[:, :, :1], k, v, mask)
    # config values
    model.config.sliding_window = 0
    with pytest.raises(ValueError, match=r"config.sliding_window must be an integer >= 1"):
        dilated_attention_forward(attn, q, k, v, None)
    # a bidirectional sliding mask
    cfg = window_config("mistral")
    cfg.is_causal = False
    with pytest.raises(ValueError, match="bidirectional sliding window"):
        build(cfg, "ring_dilated")(torch.randint(1, VOCAB, (1, 8)))


# ---------------------------------------------------------------------------
# Sequence parallelism: real gloo processes against the single process.


def sp_case(arch: str, window: int, packed: bool, pattern: dict | None):
    gen = torch.Generator().manual_seed(7)
    cfg = window_config(arch, 2, pattern, window=window)
    if packed:  # documents crossing the shard boundaries
        lengths = [10, 1, 7, 9, 12]
        ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=gen)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.clone()
        labels[positions == 0] = -100
    else:
        ids = torch.randint(1, VOCAB, (2, 31), generator=gen)
        positions, labels = None, ids.clone()
        labels[1, 25:] = -100
    return cfg, ids, labels, positions


def sp_worker(rank: int, world: int, spread: str, cases: list) -> list:
    if spread == "mesh":  # the ring x Ulysses hybrid, 2 x 2
        from torch.distributed.device_mesh import init_device_mesh

        group = {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))}
    else:
        group = {spread: dist.group.WORLD}
    results = []
    for cfg, state, ids, labels, positions in cases:
        ra.register_transformers(**group)
        model = build(cfg, "ring_dilated", torch.float64, state=state)
        loss, grads = causal_lm_step(model, ids, labels, positions)
        for t in (loss, *grads.values()):
            dist.all_reduce(t)
        results.append((loss, grads))
    return results


# (arch, window, packed, pattern): windows smaller and larger than a shard
SP_CASES = [
    ("mistral", 4, False, None),
    ("qwen2", 20, False, None),
    ("qwen2", 5, True, None),
    ("mistral", 6, True, PATTERN),
]


@pytest.mark.parametrize(
    ("world", "spread"), [(2, "group"), (3, "group"), (2, "ulysses_group"), (4, "mesh")]
)
def test_sequence_parallel_equals_one_process(world, spread) -> None:
    built, wants = [], []
    for arch, window, packed, pattern in SP_CASES:
        cfg, ids, labels, positions = sp_case(arch, window, packed, pattern)
        model = build(cfg, "ring_dilated", torch.float64)
        want = causal_lm_step(model, ids, labels, positions)
        if pattern is None:  # the single process is sdpa's
            sdpa = build(cfg, "sdpa", torch.float64, state=model.state_dict())
            sdpa.config.use_cache = False  # else transformers does not look for packed sequences
            loss, grads = causal_lm_step(sdpa, ids, labels, positions)
            torch.testing.assert_close(want[0], loss, rtol=1e-6, atol=1e-6, msg=arch)
            for name, g in grads.items():
                torch.testing.assert_close(want[1][name], g, rtol=1e-9, atol=1e-11, msg=name)
        wants.append(want)
        built.append((cfg, model.state_dict(), ids, labels, positions))
    out = run_distributed(sp_worker, world, spread, built, timeout=300)
    for rank_results in out:
        for (loss, grads), (want_loss, want_grads), case in zip(
            rank_results, wants, SP_CASES, strict=True
        ):
            torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6, msg=str(case))
            for name, g in want_grads.items():
                torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=name)


# ---------------------------------------------------------------------------
# torch.compile: a sliding layer compiles whole.


@pytest.mark.parametrize("padding", [False, True])
def test_sliding_decoder_layer_compiles_fullgraph(padding) -> None:
    from test_compile_ring import check_layer_compiles_whole
    from transformers.masking_utils import create_sliding_window_causal_mask

    model = build(window_config("mistral"), "ring_dilated", torch.float64)
    layer = model.model.layers[0]
    n = 19
    x = torch.randn(2, n, 64, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(n)[None]
    rope = model.model.rotary_emb(x, positions)
    pad = padding_mask("right", 2, n) if padding else None
    mask = create_sliding_window_causal_mask(model.config, x, pad, None, position_ids=positions)
    check_layer_compiles_whole(layer, x, mask, positions, rope, grad_tol=0)
