"""Generation with a KV cache under ``"ring_dilated"``: a decode step attends
its queries at their global positions to the cached keys
(the one engine's rows at an offset, ring_attention/local/engine.py), so
generating with a cache equals generating without one (recomputing the
whole sequence per token), token for token, and equals ``"sdpa"`` without a
pattern. References: the float64 oracle for the offset block, the uncached
model for generation."""

from __future__ import annotations

import pytest
import torch
from oracle import reference_attention
from test_hf import VOCAB, build, tiny_config
from transformers import Cache, DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

import ring_attention as ra
from ring_attention import Pattern
from ring_attention.core.call import prepare
from ring_attention.hf.decode import decode_attention
from ring_attention.local import engine

PATTERN = {"segment_lengths": [3, 8, 20], "dilation_rates": [1, 2, 4]}


@pytest.fixture(autouse=True)
def registered():
    ra.register_transformers()
    yield


# ---------------------------------------------------------------------------
# The offset block against the oracle.


@pytest.mark.parametrize(
    ("heads", "kv_heads", "causal", "head_groups", "padded", "q_start"),
    [
        (4, 2, True, False, False, 17),
        (3, 1, True, True, True, 22),
        (4, 4, False, False, True, 9),
        (2, 2, True, False, True, 0),
        (5, 5, True, False, False, 25),
    ],
)
def test_offset_attention_matches_oracle(heads, kv_heads, causal, head_groups, padded, q_start):
    """Queries ``q_start ..`` of a sequence against all its keys equal those
    rows of the whole sequence's attention, forward and backward."""
    gen = torch.Generator().manual_seed(21)
    n, d = 26, 8
    q = torch.randn(2, n, heads, d, generator=gen, dtype=torch.float64)
    k = torch.randn(2, n, kv_heads, d, generator=gen, dtype=torch.float64)
    v = torch.randn(2, n, kv_heads, d, generator=gen, dtype=torch.float64)
    kpm = (torch.rand(2, n, generator=gen) < 0.2) if padded else None
    segs, dils = [3, 8, 20], [1, 2, 4]
    pattern = Pattern(segs, dils, causal=causal, head_groups=head_groups)
    grad = torch.randn(2, n - q_start, heads, d, generator=gen, dtype=torch.float64)

    q_tail = q[:, q_start:].clone().requires_grad_()
    k1, v1 = k.clone().requires_grad_(), v.clone().requires_grad_()
    call, _ = prepare(q_tail, k1, v1, pattern, scale=0.3, key_padding_mask=kpm, q_start=q_start)
    got = engine.attend(call, q_tail, k1, v1)[0]
    got.backward(grad)

    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    want, _ = reference_attention(q2, k2, v2, segs, dils, causal=causal, scale=0.3,
                                  head_groups=head_groups, key_padding_mask=kpm)  # fmt: skip
    want = want[:, q_start:]
    want.backward(grad)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(q_tail.grad, q2.grad[:, q_start:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(k1.grad, k2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(v1.grad, v2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_groups", "offsets", "window", "padded", "p", "queries"),
    [
        (4, 2, False, "modulo", None, True, 33, 1),
        (5, 5, True, "modulo", None, False, 37, 4),
        (6, 3, False, "grouped", (6, 0), True, 29, 3),
        (3, 1, False, "modulo", (9, 0), False, 0, 1),
        (4, 4, False, "modulo", None, True, 19, 1),
        (4, 2, False, "modulo", (7, 0), True, 40, 5),
    ],
)
def test_decode_attention_matches_oracle(
    heads, kv_heads, head_groups, offsets, window, padded, p, queries
):
    """Queries continuing a static cache (ring_attention/hf/decode.py): the
    ``queries`` queries ending at position ``p`` against every slot of a
    41-slot cache (those past ``p`` unwritten) equal those rows of the whole
    sequence's attention, forward and backward."""
    gen = torch.Generator().manual_seed(24)
    n, d, segs, dils = 41, 8, [3, 8, 20], [1, 2, 4]
    q = torch.randn(2, n, heads, d, generator=gen, dtype=torch.float64)
    k = torch.randn(2, n, kv_heads, d, generator=gen, dtype=torch.float64)
    v = torch.randn(2, n, kv_heads, d, generator=gen, dtype=torch.float64)
    kpm = (torch.rand(2, n, generator=gen) < 0.25) if padded else torch.zeros(2, n, dtype=bool)
    grad = torch.randn(2, queries, heads, d, generator=gen, dtype=torch.float64)
    pattern = Pattern(segs, dils, causal=True, head_groups=head_groups, head_offsets=offsets,
                      window=window)  # fmt: skip
    positions = torch.where(~kpm & (torch.arange(n) <= p), p + 1, 0)
    first = p + 1 - queries

    q1, k1, v1 = q[:, first : p + 1].clone().requires_grad_(), k.clone(), v.clone()
    k1.requires_grad_(), v1.requires_grad_()
    call, _ = prepare(q1, k1, v1, pattern, scale=0.3, q_start=n - queries)
    got = decode_attention(q1, k1, v1, positions, call)
    got.backward(grad)

    q2, k2, v2 = (t[:, : p + 1].clone().requires_grad_() for t in (q, k, v))
    want, _ = reference_attention(q2, k2, v2, segs, dils, causal=True, scale=0.3,
                                  head_groups=head_groups, key_padding_mask=kpm[:, : p + 1],
                                  grouped_offsets=offsets == "grouped", window=window)  # fmt: skip
    want = want[:, first:]
    want.backward(grad)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(q1.grad, q2.grad[:, first:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(k1.grad[:, : p + 1], k2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(v1.grad[:, : p + 1], v2.grad, rtol=1e-10, atol=1e-12)
    assert not k1.grad[:, p + 1 :].any() and not v1.grad[:, p + 1 :].any()


# ---------------------------------------------------------------------------
# Models: continuing a cache equals recomputing.


def _full_static_cache(config, max_cache_len):
    """A static cache of full layers (a position tensor for every layer),
    also for a sliding-window model, whose layers then slide by the mask."""
    return Cache(layers=[StaticLayer(max_cache_len) for _ in range(config.num_hidden_layers)])


WINDOWED = dict(arch="mistral", sliding_window=5)


def graph_counter():
    """``(graphs, backend)``: a ``torch.compile`` backend that records the
    graphs it is given in ``graphs`` and runs them eagerly (cheap: no
    inductor). A function, so that ``generate``'s copies of its compile
    config keep it."""
    graphs = []

    def backend(gm, example_inputs, **options):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def graph_targets(graphs) -> set[str]:
    """The functions the recorded graphs call."""
    return {
        str(node.target)
        for gm in graphs
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function"
    }


@pytest.mark.parametrize(
    ("pattern", "extra", "cache", "chunk", "compiled"),
    [
        (None, {}, "dynamic", None, False),
        (None, {}, "static", None, False),
        (PATTERN, {}, "dynamic", None, False),
        (PATTERN, {}, "static", None, False),
        (PATTERN, {}, "dynamic", 1, False),
        (PATTERN, {}, "static", 1, False),
        (PATTERN, WINDOWED, "full-static", 1, False),
        (PATTERN, {}, "static", 4, True),
        (PATTERN, WINDOWED, "full-static", 3, True),
    ],
)
def test_continuing_a_cache_equals_recomputing(pattern, extra, cache, chunk, compiled):
    """A prefix in the cache, then the other tokens at once (``chunk``
    ``None``) or ``chunk`` at a time (1: decode steps; more: chunked prefill,
    the candidates of assisted decoding): their logits and (dynamic cache: it
    holds the prefix's graph; a static cache writes in place) the parameter
    gradients through them equal the whole sequence's. Compiled
    (``fullgraph=True, dynamic=False``; a left-padded batch, its 2-D mask as
    long as the cache): one graph for every chunk, attending with the
    kernels."""
    cfg = tiny_config(**{"kv_heads": 2, "pattern": pattern, **extra})
    model = build(cfg, "ring_dilated", torch.float64)
    ids = torch.randint(1, VOCAB, (2, 29), generator=torch.Generator().manual_seed(22))
    split, slots = 17, 40
    mask = {}
    if compiled:
        mask = {"attention_mask": torch.ones(2, slots, dtype=torch.long)}
        mask["attention_mask"][1, :3] = 0

    model.zero_grad()
    full = model(ids, use_cache=False, **{k: m[:, :29] for k, m in mask.items()}).logits
    full = full[:, split:]
    full.pow(2).sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    if cache == "dynamic":
        past = DynamicCache(config=model.config)
    elif cache == "static":
        past = StaticCache(config=model.config, max_cache_len=slots)
    else:
        past = _full_static_cache(model.config, slots)
    graphs, backend = graph_counter()
    step = model.forward
    if compiled:
        torch.compiler.reset()
        step = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=backend)
    chunks = ids[:, split:].split(chunk or ids.shape[1], dim=1)
    with torch.set_grad_enabled(cache == "dynamic"):
        model(ids[:, :split], cache=past, use_cache=True, **mask)
        got = torch.cat([step(c, cache=past, use_cache=True, **mask).logits for c in chunks], 1)
    torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-10)
    if compiled:
        targets = graph_targets(graphs)
        assert len(graphs) == 1
        assert "ring_attention.dilated_attention" in targets, targets
        assert not any("scaled_dot_product" in t for t in targets), targets
    if cache != "dynamic":
        return
    got.pow(2).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-8, atol=1e-10, msg=name)


# ---------------------------------------------------------------------------
# generate(): with a cache equals without one.

PROMPT = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(23))


def _generate(model, *, prompt=PROMPT, **kwargs):
    """model.generate, 14 new tokens, greedy by default, no early stop."""
    model.generation_config.eos_token_id = None
    kwargs.setdefault("max_new_tokens", 14)
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("pad_token_id", 0)
    if kwargs.get("do_sample"):
        torch.manual_seed(7)
    return model.generate(prompt, **kwargs)


@pytest.mark.parametrize(
    ("arch", "kv_heads", "pattern"),
    [("llama", 4, PATTERN), ("llama", 2, None), ("qwen2", 1, PATTERN), ("qwen2", 2, None)],
)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_with_cache_equals_without(arch, kv_heads, pattern, cache):
    model = build(tiny_config(arch, kv_heads=kv_heads, pattern=pattern), "ring_dilated")
    want = _generate(model, use_cache=False)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    assert torch.equal(_generate(model, **extra), want)
    if pattern is None:  # and equals sdpa
        sdpa = build(tiny_config(arch, kv_heads=kv_heads), "sdpa", state=model.state_dict())
        assert torch.equal(_generate(sdpa, **extra), want)


@pytest.mark.parametrize("pattern", [None, PATTERN])
@pytest.mark.parametrize(
    "kwargs",
    [{"num_beams": 3}, {"do_sample": True, "top_k": 5}, {"num_beams": 2, "do_sample": True}],
)
def test_beam_search_and_sampling_with_cache_equal_without(pattern, kwargs):
    model = build(tiny_config(kv_heads=2, pattern=pattern), "ring_dilated", torch.float64)
    want = _generate(model, use_cache=False, **kwargs)
    assert torch.equal(_generate(model, **kwargs), want)
    assert torch.equal(_generate(model, cache_implementation="static", **kwargs), want)


@pytest.mark.parametrize("pattern", [None, PATTERN])
def test_inputs_embeds_and_continuing_from_past_key_values(pattern):
    model = build(tiny_config(kv_heads=2, pattern=pattern), "ring_dilated", torch.float64)
    want = _generate(model, use_cache=False)
    embeds = model.get_input_embeddings()(PROMPT)
    model.generation_config.eos_token_id = None
    got = model.generate(inputs_embeds=embeds, max_new_tokens=14, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want[:, PROMPT.shape[1] :])  # generate returns the new tokens only
    # half of it, then continue from the returned cache
    first = model.generate(PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True)  # fmt: skip
    rest = model.generate(first.sequences, cache=first.past_key_values, max_new_tokens=8,
                          attention_mask=torch.ones_like(first.sequences), do_sample=False,
                          pad_token_id=0)  # fmt: skip
    assert torch.equal(rest, want)


@pytest.mark.parametrize("pattern", [None, PATTERN])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_left_padded_batch(pattern, cache):
    """Left-padded prompts of different lengths: with a cache equals without,
    and equals sdpa without a pattern."""
    model = build(tiny_config(kv_heads=2, pattern=pattern), "ring_dilated", torch.float64)
    prompt = PROMPT.clone()
    mask = torch.ones_like(prompt)
    prompt[1, :3], mask[1, :3] = 0, 0
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    want = _generate(model, prompt=prompt, attention_mask=mask, use_cache=False)
    assert torch.equal(_generate(model, prompt=prompt, attention_mask=mask, **extra), want)
    if pattern is None:
        sdpa = build(tiny_config(kv_heads=2), "sdpa", torch.float64, state=model.state_dict())
        assert torch.equal(_generate(sdpa, prompt=prompt, attention_mask=mask, **extra), want)


# ---------------------------------------------------------------------------
# Against "sdpa" on Llama, Mistral (a sliding window shorter than the
# sequences) and Qwen2, with a left-padded prompt: the same tokens, the same
# logits (float64) at every step.

ARCHS = {
    "llama": dict(arch="llama", kv_heads=2),
    "mistral": dict(arch="mistral", kv_heads=1, sliding_window=5),
    "qwen2": dict(arch="qwen2", kv_heads=4),
}
MASK = torch.ones_like(PROMPT)
MASK[1, :3] = 0  # left padding
PROMPT_PADDED = PROMPT.masked_fill(MASK == 0, 0)


def _pair(arch, dtype=torch.float64):
    """(ring_dilated, sdpa) models of ``arch`` with the same weights."""
    cfg = tiny_config(**ARCHS[arch])
    ring = build(cfg, "ring_dilated", dtype)
    return ring, build(cfg, "sdpa", dtype, state=ring.state_dict())


def _assert_same_generation(got, want):
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits)
    for g, w in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"cache_implementation": "static"},
        {"num_beams": 3},
        {"num_beams": 2, "cache_implementation": "static"},
        {"do_sample": True, "top_k": 5},
        {"num_beams": 2, "do_sample": True, "cache_implementation": "static"},
    ],
    ids=["greedy", "greedy-static", "beam", "beam-static", "sample", "beam-sample-static"],
)
def test_generate_equals_sdpa(arch, kwargs):
    """Dynamic and static caches (the static cache's prefill included),
    beam search, and sampling with the same seed."""
    ring, sdpa = _pair(arch)
    common = dict(prompt=PROMPT_PADDED, attention_mask=MASK, max_new_tokens=8,
                  return_dict_in_generate=True, output_logits=True, **kwargs)  # fmt: skip
    _assert_same_generation(_generate(ring, **common), _generate(sdpa, **common))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_inputs_embeds_and_continuing_equal_sdpa(arch, cache):
    """Generating from ``inputs_embeds``, and continuing from the returned
    cache (``past_key_values``) with more tokens."""
    ring, sdpa = _pair(arch)
    outs = []
    for model in (ring, sdpa):
        model.generation_config.eos_token_id = None
        greedy = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                      output_logits=True)  # fmt: skip
        if cache == "dynamic":
            past = DynamicCache(config=model.config)
        else:
            past = StaticCache(config=model.config, max_cache_len=32)
        embeds = model.get_input_embeddings()(PROMPT_PADDED)
        from_embeds = model.generate(inputs_embeds=embeds, attention_mask=MASK, max_new_tokens=6,
                                     cache_implementation=cache, **greedy)  # fmt: skip
        first = model.generate(PROMPT_PADDED, attention_mask=MASK, cache=past, max_new_tokens=4,
                               **greedy)  # fmt: skip
        mask = torch.cat([MASK, torch.ones(2, 4, dtype=MASK.dtype)], dim=1)
        rest = model.generate(first.sequences, attention_mask=mask, cache=first.past_key_values,
                              max_new_tokens=5, **greedy)  # fmt: skip
        outs.append((from_embeds, first, rest))
    for got, want in zip(*outs, strict=True):
        _assert_same_generation(got, want)


@pytest.mark.parametrize(
    ("arch", "pattern", "cache"),
    [
        ("llama", None, "static"),
        ("mistral", None, "static"),
        ("llama", PATTERN, "static"),
        ("mistral", PATTERN, "static"),
        ("mistral", PATTERN, "full-static"),
    ],
)
def test_compiled_static_cache_decode(arch, pattern, cache):
    """``generate`` compiling the decode step of a static cache with
    ``fullgraph=True, dynamic=False`` (what transformers' own compile test
    asks): the step compiles without a graph break, attends with the
    kernels (not sdpa), and gives sdpa's tokens and logits (without a
    pattern) or the uncached eager ones (with one), float64. A position tensor (Llama's layers, a
    cache of full layers) compiles once for every position; transformers'
    sliding-window layers give their position as an int, which recompiles
    per step, with "sdpa" too."""
    from transformers import CompileConfig

    ring, sdpa = _pair(arch)
    if pattern is not None:
        ring = build(tiny_config(**ARCHS[arch], pattern=pattern), "ring_dilated", torch.float64,
                     state=ring.state_dict())  # fmt: skip
    graphs, backend = graph_counter()
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    compile_config._compile_all_devices = True  # generate compiles on accelerators only otherwise
    sliding = arch == "mistral" and cache == "static"  # a compilation per step: fewer steps
    common = dict(prompt=PROMPT_PADDED, attention_mask=MASK, max_new_tokens=3 if sliding else 5,
                  return_dict_in_generate=True, output_logits=True)  # fmt: skip
    if cache == "static":
        common["cache_implementation"] = "static"

    def past(model):
        return {} if cache == "static" else {"cache": _full_static_cache(model.config, 16)}

    if pattern is None:
        want = _generate(sdpa, **common, **past(sdpa))
    else:
        common_uncached = {k: v for k, v in common.items() if k != "cache_implementation"}
        want = _generate(ring, use_cache=False, **common_uncached)
    torch.compiler.reset()
    got = _generate(ring, compile_config=compile_config, **common, **past(ring))
    assert graphs, "the decode step was not compiled"
    _assert_same_generation(got, want)
    if cache == "full-static" or arch == "llama":
        assert len(graphs) == 1
    targets = graph_targets(graphs)
    assert "ring_attention.dilated_attention" in targets, targets
    assert not any("scaled_dot_product" in t for t in targets), targets
