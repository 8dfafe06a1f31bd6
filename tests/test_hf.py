"""The Hugging Face transformers integration (ring_attention/hf.py).

Models are built from tiny configs with random weights (nothing is
downloaded). References: transformers' own ``"sdpa"`` for dense attention,
an attention function computing the float64 oracle (tests/oracle.py) for
dilated patterns, the documents run one by one for packed batches, and the
single-process model for sequence parallelism (real gloo processes).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import transformers
from oracle import reference_attention
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    DynamicCache,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    StaticCache,
)
from transformers.masking_utils import AttentionMaskInterface, create_causal_mask

import ring_attention as ra
from ring_attention import hf
from ring_attention.parallel.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 61


def tiny_config(arch: str = "llama", kv_heads: int = 4, pattern: dict | None = None, **extra):
    """A 2-layer, hidden-64, 4-head config of ``arch`` (head_dim 16)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    common.update(extra)
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "mistral":
        cfg = MistralConfig(**{"sliding_window": None, **common})
    elif arch == "qwen2":
        cfg = Qwen2Config(**{"use_sliding_window": False, **common})
    elif arch == "qwen3":
        cfg = Qwen3Config(**{"head_dim": 16, "use_sliding_window": False, **common})
    else:
        raise AssertionError(arch)
    if pattern is not None:
        cfg.dilated_attention = pattern
    return cfg


def build(cfg, attn: str = "sdpa", dtype: torch.dtype = torch.float32, state: dict | None = None):
    """A model of ``cfg`` (copied: from_config writes the implementation into
    its config) with ``state`` or the seed-0 weights, in eval mode."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn)
    if state is not None:
        model.load_state_dict(state)
    return model.to(dtype).eval()


def padding_mask(kind: str, batch: int, n: int) -> torch.Tensor | None:
    """transformers' 2-D attention mask (1 = token): none, right or left padding."""
    if kind == "none":
        return None
    mask = torch.ones(batch, n, dtype=torch.long)
    for b in range(batch):
        pad = 3 + 5 * b
        if kind == "right":
            mask[b, n - pad :] = 0
        else:
            mask[b, :pad] = 0
    return mask


def logits_and_grads(model, ids, mask, keep):
    """Logits at the kept positions, and the parameter gradients of their sum
    of squares."""
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits[keep] ** 2).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return logits.detach(), grads


def assert_same_logits(ref, ring, ids, mask, tol, grad_tol):
    """``ring``'s logits and parameter gradients equal ``ref``'s at the
    positions ``mask`` keeps (all without one), to ``tol`` and ``grad_tol``
    (rtol, atol); returns ``ring``'s logits and those positions."""
    keep = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    want, want_grads = logits_and_grads(ref, ids, mask, keep)
    got, got_grads = logits_and_grads(ring, ids, mask, keep)
    rtol, atol = tol
    torch.testing.assert_close(got[keep], want[keep], rtol=rtol, atol=atol)
    rtol, atol = grad_tol
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=rtol, atol=atol, msg=name)
    return got, keep


@pytest.fixture(autouse=True)
def registered():
    """Every test starts registered, without sequence parallelism."""
    ra.register_transformers()
    yield
    ra.register_transformers()


# ---------------------------------------------------------------------------
# Registration and the optional dependency.


def test_import_without_transformers_and_clear_import_error() -> None:
    code = (
        "import sys\n"
        "import ring_attention as ra\n"
        "assert 'transformers' not in sys.modules, 'import ring_attention imported transformers'\n"
        "sys.modules['transformers'] = None  # as if it were not installed\n"
        "try:\n"
        "    ra.register_transformers()\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ImportError:" in res.stdout and "ring_attention[hf]" in res.stdout, res.stdout


def test_register_is_idempotent_and_checks_arguments() -> None:
    ra.register_transformers()
    ra.register_transformers()
    assert AttentionInterface._global_mapping["ring_dilated"] is hf.dilated_attention_forward
    assert AttentionMaskInterface._global_mapping["ring_dilated"] is hf.dilated_attention_mask
    assert "ring_dilated" in transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS.valid_keys()
    model = build(tiny_config(), "ring_dilated")
    assert model.config._attn_implementation == "ring_dilated"
    with pytest.raises(ValueError, match="layout"):
        ra.register_transformers(layout="spiral")
    with pytest.raises(ValueError, match="group"):
        ra.register_transformers(group="world")
    assert hf.sequence_parallel() is None


# ---------------------------------------------------------------------------
# Dense: equal to "sdpa".


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_dense_equals_sdpa(arch: str, padding: str) -> None:
    cfg = tiny_config(arch)
    sdpa = build(cfg, "sdpa")
    ring = build(cfg, "ring_dilated", state=sdpa.state_dict())
    gen = torch.Generator().manual_seed(1)
    batch, n = 3, 37
    ids = torch.randint(1, VOCAB, (batch, n), generator=gen)
    mask = padding_mask(padding, batch, n)
    got = assert_same_logits(sdpa, ring, ids, mask, (0, 1e-5), (1e-4, 1e-5))[0]
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_kv_heads_equal_sdpa_without_repeating(kv_heads: int, monkeypatch) -> None:
    cfg = tiny_config("llama", kv_heads=kv_heads)
    sdpa = build(cfg, "sdpa")
    ring = build(cfg, "ring_dilated", state=sdpa.state_dict())
    seen: list[tuple[int, int]] = []

    def spy(call, q, k, v):
        seen.append((q.shape[2], k.shape[2]))
        return attend(call, q, k, v)

    attend = hf.attention.engine.attend
    monkeypatch.setattr(hf.attention.engine, "attend", spy)
    ids = torch.randint(1, VOCAB, (2, 29), generator=torch.Generator().manual_seed(2))
    mask = padding_mask("right", 2, 29)
    assert_same_logits(sdpa, ring, ids, mask, (0, 1e-5), (1e-4, 1e-5))
    assert seen == [(4, kv_heads)] * cfg.num_hidden_layers


# ---------------------------------------------------------------------------
# Dilated patterns: equal to the float64 oracle.


def oracle_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Dilated attention by the float64 oracle, the pattern read from the
    config as the integration reads it."""
    entry = module.config.dilated_attention
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    kpm = None if attention_mask is None else ~attention_mask.bool()
    out, _ = reference_attention(
        q, k, v, entry["segment_lengths"], entry["dilation_rates"], causal=True, scale=scaling,
        head_groups=entry.get("head_groups", False), key_padding_mask=kpm,
        grouped_offsets=entry.get("head_offsets") == "grouped",
    )  # fmt: skip
    return out.to(query.dtype), None


@pytest.mark.parametrize(
    ("arch", "kv_heads", "pattern", "padding"),
    [
        ("llama", 4, {"segment_lengths": [8, 16, 40], "dilation_rates": [1, 2, 4]}, "none"),
        ("qwen2", 4, {"segment_lengths": [6, 20], "dilation_rates": [2, 3]}, "right"),
        ("mistral", 4, {"segment_lengths": [5, 12], "dilation_rates": [1, 3],
                        "head_groups": True}, "right"),
        ("llama", 2, {"segment_lengths": [8, 32], "dilation_rates": [1, 4]}, "none"),
        ("qwen3", 1, {"segment_lengths": [7, 16], "dilation_rates": [1, 2]}, "right"),
        ("llama", 2, {"segment_lengths": [12, 43], "dilation_rates": [3, 4],
                      "head_offsets": "grouped"}, "right"),
    ],
)  # fmt: skip
def test_dilated_pattern_matches_oracle(arch, kv_heads, pattern, padding) -> None:
    AttentionInterface.register("oracle_dilated", oracle_attention)
    AttentionMaskInterface.register("oracle_dilated", hf.dilated_attention_mask)
    cfg = tiny_config(arch, kv_heads=kv_heads, pattern=pattern)
    oracle = build(cfg, "oracle_dilated", torch.float64)
    ring = build(cfg, "ring_dilated", torch.float64, state=oracle.state_dict())
    ids = torch.randint(1, VOCAB, (2, 43), generator=torch.Generator().manual_seed(3))
    mask = padding_mask(padding, 2, 43)
    got, keep = assert_same_logits(oracle, ring, ids, mask, (1e-9, 1e-9), (1e-8, 1e-9))
    # The pattern matters: a dense model with the same weights differs.
    dense = build(tiny_config(arch, kv_heads=kv_heads), "ring_dilated", torch.float64,
                  state=oracle.state_dict())  # fmt: skip
    assert (dense(ids, attention_mask=mask).logits.detach()[keep] - got[keep]).abs().max() > 1e-3


def test_pattern_from_config_is_built_once() -> None:
    entry = {"segment_lengths": [8, 16], "dilation_rates": [1, 2], "head_offsets": "grouped"}
    cfg = tiny_config(pattern=entry)
    pattern = hf.pattern_from_config(cfg, causal=True)
    assert pattern == ra.Pattern([8, 16], [1, 2], causal=True, head_offsets="grouped")
    assert hf.pattern_from_config(copy.deepcopy(cfg), causal=True) is pattern
    dense = hf.pattern_from_config(tiny_config(), causal=False)
    assert dense.branches == ((2**62, 1),) and not dense.causal

    hf.config._cached_pattern.cache_clear()
    model = build(tiny_config(pattern={"segment_lengths": [8], "dilation_rates": [2]}),
                  "ring_dilated")  # fmt: skip
    ids = torch.randint(1, VOCAB, (1, 20))
    with torch.no_grad():
        model(ids)
        model(ids)
    info = hf.config._cached_pattern.cache_info()
    assert (info.misses, info.hits) == (1, 2 * model.config.num_hidden_layers - 1)


def test_config_entry_survives_save_and_load(tmp_path) -> None:
    entry = {"segment_lengths": [16, 64], "dilation_rates": [1, 4], "head_groups": True}
    tiny_config("qwen2", pattern=entry).save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.dilated_attention == entry
    pattern = hf.pattern_from_config(loaded, causal=True)
    assert pattern.branches == ((16, 1), (64, 4)) and pattern.head_groups


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ([8, 16], "must be a dict"),
        ({"segment_lengths": [8]}, r"missing \['dilation_rates'\]"),
        ({"segment_lengths": [8], "dilation_rates": [1], "causal": True}, r"unknown \['causal'\]"),
        ({"segment_lengths": [8], "dilation_rates": [9]}, r"dilation_rates\[0\] must be <="),
        ({"segment_lengths": [8], "dilation_rates": [1], "head_offsets": "x"}, "head_offsets"),
    ],
)
def test_bad_config_entry_raises(entry, match) -> None:
    model = build(tiny_config(pattern=entry), "ring_dilated")
    with pytest.raises(ValueError, match=r"config\.dilated_attention") as info:
        model(torch.randint(1, VOCAB, (1, 9)))
    assert info.match(match)


# ---------------------------------------------------------------------------
# Packed documents.

DOC_LENGTHS = [5, 1, 13, 18, 2]


def documents(gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in DOC_LENGTHS]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_batch_equals_documents_run_separately(kv_heads: int) -> None:
    cfg = tiny_config(
        kv_heads=kv_heads, pattern={"segment_lengths": [4, 8], "dilation_rates": [1, 2]}
    )
    model = build(cfg, "ring_dilated", torch.float64)
    docs = documents(torch.Generator().manual_seed(4))
    with torch.no_grad():
        separate = [model(d[None]).logits[0] for d in docs]
        want = torch.cat(separate)
        ids = torch.cat(docs)[None]
        positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
        # transformers detects packed sequences without a mask and a cache only
        by_positions = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        with_cache = model(input_ids=ids, position_ids=positions).logits[0]
        collated = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
            [{"input_ids": d.tolist()} for d in docs]
        )
        packed = model(**collated)
    torch.testing.assert_close(by_positions, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(packed.logits[0], want, rtol=1e-10, atol=1e-10)
    # The collator's loss is the mean over the documents' next-token losses.
    token_losses = [
        torch.nn.functional.cross_entropy(s[:-1], d[1:], reduction="sum")
        for s, d in zip(separate, docs, strict=True)
    ]
    scored = sum(len(d) - 1 for d in docs)
    want_loss = (sum(token_losses) / scored).float()  # transformers' loss is float32
    torch.testing.assert_close(packed.loss, want_loss, rtol=1e-6, atol=1e-6)
    # Packing is what makes the difference: the same tokens as one document differ.
    with torch.no_grad():
        one_document = model(input_ids=ids).logits[0]
    assert (one_document - want).abs().max() > 1e-3
    assert (with_cache - want).abs().max() > 1e-3  # with a cache: one document (test_hf_sdpa)


def test_packed_rows_with_different_documents() -> None:
    """Every row its own documents (transformers packs per row): equal to the
    rows run one by one; the sequence-parallel batch needs one set of
    boundaries."""
    model = build(tiny_config(pattern={"segment_lengths": [3, 6], "dilation_rates": [1, 2]}),
                  "ring_dilated", torch.float64)  # fmt: skip
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 3]])
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = model(ids, position_ids=positions, use_cache=False).logits
        for row in range(3):
            want = model(ids[row : row + 1], position_ids=positions[row : row + 1],
                         use_cache=False).logits[0]  # fmt: skip
            torch.testing.assert_close(got[row], want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="same document boundaries"):
        hf.documents_from_position_ids(positions)
    same = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)
    assert torch.equal(hf.documents_from_position_ids(same), torch.tensor([0, 3, 6]))
    assert hf.documents_from_position_ids(torch.arange(2, 9)[None]) is None


@pytest.mark.parametrize("source", ["cu_seq_lens_q", "position_ids"])
def test_documents_are_read_once_per_batch(source, monkeypatch) -> None:
    """The boundaries go to the host and the pattern with documents is built
    once per batch, not per layer: as many times for 4 layers as for 1."""
    counts = []
    with_documents = ra.Pattern.with_documents

    def spy(self, cu_seqlens):
        counts[-1] += 1
        return with_documents(self, cu_seqlens)

    monkeypatch.setattr(ra.Pattern, "with_documents", spy)
    positions = torch.cat([torch.arange(n) for n in DOC_LENGTHS])[None]
    ids = torch.randint(1, VOCAB, positions.shape)
    cu = torch.tensor([0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    for layers in (1, 4):
        model = build(tiny_config(num_hidden_layers=layers, pattern={"segment_lengths": [4],
                                                                      "dilation_rates": [2]}),
                      "ring_dilated")  # fmt: skip
        kwargs = {"cu_seq_lens_q": cu.clone(), "cu_seq_lens_k": None}
        if source == "position_ids":
            kwargs = {"position_ids": positions, "use_cache": False}
        counts.append(0)
        with torch.no_grad():
            model(ids, **kwargs)
    assert counts[0] == counts[1] > 0, counts


# ---------------------------------------------------------------------------
# The mask interface: transformers' decision as a key map.


@pytest.mark.parametrize("which", ["and", "or"])
def test_custom_mask_functions_raise(which: str) -> None:
    cfg = tiny_config()
    cfg._attn_implementation = "ring_dilated"
    extra = {f"{which}_mask_function": lambda b, h, q, kv: kv >= 0}
    embeds = torch.zeros(1, 6, 64)
    with pytest.raises(ValueError, match="custom and/or mask functions"):
        create_causal_mask(cfg, embeds, None, None, **extra)
    # The plain causal mask, padded or packed, becomes the key map: 0 =
    # padding, d >= 1 = a key of document d (as transformers decided).
    assert create_causal_mask(cfg, embeds, None, None) is None
    pad = torch.tensor([[1, 1, 1, 1, 0, 0]])
    assert torch.equal(create_causal_mask(cfg, embeds, pad, None), pad.int())
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    doc_map = create_causal_mask(cfg, embeds, None, None, position_ids=packed)
    assert doc_map.tolist() == [[1, 1, 1, 2, 2, 2]] and doc_map.dtype == torch.int32
    # With a cache transformers does not look for packed sequences.
    cache = DynamicCache(config=cfg)
    assert create_causal_mask(cfg, embeds, None, cache, position_ids=packed) is None
    # A static cache: the key map covers the filled keys only.
    static = StaticCache(config=cfg, max_cache_len=16)
    assert create_causal_mask(cfg, embeds, None, static).tolist() == [[1] * 6]


# ---------------------------------------------------------------------------
# Sequence parallelism: real gloo processes against the single-process model.


def causal_lm_step(model, ids, labels, position_ids=None):
    """The loss and parameter gradients of one causal-LM step on this rank's
    batch (the whole batch without sequence parallelism): this rank's share
    of the whole batch's, so that the ranks' sum is exactly the single
    process's (the batch's own num_items_in_batch makes them average to it;
    its 1 / world would round in the loss's float32)."""
    batch = hf.shard_causal_lm_batch(ids, labels, position_ids=position_ids)
    batch["num_items_in_batch"] = int((labels[:, 1:] != -100).sum())
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def sp_case(kind: str, kv_heads: int = 4):
    """(config, input_ids, labels, position_ids) of a test case."""
    gen = torch.Generator().manual_seed(5)
    pattern = {"segment_lengths": [6, 16], "dilation_rates": [1, 3]}
    if kind == "dense":
        cfg, ids = tiny_config(kv_heads=kv_heads), torch.randint(1, VOCAB, (2, 31), generator=gen)
        labels, positions = ids.clone(), None
        labels[1, 20:] = -100  # right padding: unscored, no mask needed (causal)
    elif kind == "dilated":
        cfg, ids = (
            tiny_config(kv_heads=kv_heads, pattern=pattern),
            torch.randint(1, VOCAB, (2, 37), generator=gen),
        )
        labels, positions = ids.clone(), None
        labels[0, :4] = -100
    else:  # packed: documents crossing the shard boundaries, one starting exactly on one
        cfg = tiny_config(kv_heads=kv_heads, pattern=pattern)
        lengths = [10, 1, 7, 9, 12]  # 39 tokens: shards of 20 + 19 (two ranks), 13 (three)
        ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=gen)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.clone()
        labels[positions == 0] = -100  # as DataCollatorWithFlattening
    return cfg, ids, labels, positions


def sp_worker(rank: int, world: int, cases: list) -> list:
    results = []
    for cfg, state, ids, labels, positions, layout in cases:
        ra.register_transformers(group=dist.group.WORLD, layout=layout)
        model = build(cfg, "ring_dilated", torch.float64, state=state)
        loss, grads = causal_lm_step(model, ids, labels, positions)
        for t in (loss, *grads.values()):
            dist.all_reduce(t)
        results.append((loss, grads))
    # Misuse raises on every rank, before the ring.
    errors = []
    model = build(cases[0][0], "ring_dilated", torch.float64, state=cases[0][1])
    batch = hf.shard_causal_lm_batch(cases[0][2], cases[0][3])
    mask = torch.ones_like(batch["input_ids"])
    mask[:, -1] = 0
    padded = dict(batch, attention_mask=mask)
    for drop in ("cu_seq_lens_q", "cu_seq_lens_k"):
        batch.pop(drop)
    for kwargs in (batch, padded):
        try:
            model(**kwargs)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return [results, errors]


def run_sp(world: int, cases: list[tuple[str, int, str]]) -> None:
    built, wants = [], []
    for kind, kv_heads, layout in cases:
        cfg, ids, labels, positions = sp_case(kind, kv_heads)
        model = build(cfg, "ring_dilated", torch.float64)
        wants.append(causal_lm_step(model, ids, labels, positions))
        built.append((cfg, model.state_dict(), ids, labels, positions, layout))
    out = run_distributed(sp_worker, world, built, timeout=240)
    for rank_results, errors in out:
        for (loss, grads), (want_loss, want_grads), case in zip(
            rank_results, wants, cases, strict=True
        ):
            # transformers computes the loss in float32, the ranks' partial sums round apart
            torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6, msg=str(case))
            for name, g in want_grads.items():
                torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=name)
        assert "cu_seq_lens_q" in errors[0] and "shard_causal_lm_batch" in errors[0], errors
        assert "padding mask" in errors[1], errors


def test_sequence_parallel_two_ranks_equals_one_process() -> None:
    run_sp(2, [("dense", 4, "contiguous"), ("dilated", 4, "contiguous"),
               ("dilated", 4, "zigzag")])  # fmt: skip


def test_sequence_parallel_three_ranks_equals_one_process() -> None:
    run_sp(3, [("dilated", 4, "contiguous"), ("dense", 4, "zigzag")])


def test_sequence_parallel_grouped_kv_and_packed_documents() -> None:
    run_sp(3, [("dilated", 2, "contiguous"), ("packed", 4, "contiguous"),
               ("packed", 1, "zigzag")])  # fmt: skip


def test_shard_causal_lm_batch_without_a_group_is_the_whole_batch() -> None:
    ids = torch.randint(1, VOCAB, (2, 7))
    labels = ids.clone()
    labels[0, 3] = -100
    batch = hf.shard_causal_lm_batch(ids, labels)
    assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["labels"], labels)
    assert torch.equal(batch["position_ids"], torch.arange(7)[None])
    assert batch["shift_labels"][0].tolist() == labels[0, 1:].tolist() + [-100]
    assert batch["num_items_in_batch"] == 2 * 6 - 1
    assert batch["cu_seq_lens_q"].tolist() == [0, 7] and batch["cu_seq_lens_q"].dtype == torch.int32
    # The model's own loss on the same tokens is the same.
    model = build(tiny_config(), "ring_dilated")
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).loss, model(ids, labels=labels).loss)


def test_registered_group_is_released_by_destroy_process_group(tmp_path) -> None:
    """register_transformers holds its group weakly: destroy_process_group
    releases the group (its gloo threads end while the interpreter runs; held
    strongly, they lived into the shutdown, where one still releasing a
    finished collective's tensors aborted the process: the example's
    SIGABRT), and a sharded call after that says what happened."""
    import weakref

    assert not dist.is_initialized()
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        ra.register_transformers(group=dist.group.WORLD)
        alive = weakref.ref(dist.group.WORLD)
        stats = torch.ones(2)
        dist.all_reduce(stats)  # a finished collective on the group's threads
        ids = torch.randint(1, VOCAB, (1, 6))
        assert torch.equal(hf.shard_causal_lm_batch(ids, ids)["input_ids"], ids)
    finally:
        dist.destroy_process_group()
    try:
        assert alive() is None, "the registration kept the destroyed group alive"
        with pytest.raises(RuntimeError, match="no longer exists"):
            hf.shard_causal_lm_batch(ids, ids)
    finally:
        ra.register_transformers()
    assert hf.sequence_parallel() is None


# ---------------------------------------------------------------------------
# The example.


def test_llama_finetune_example_runs_on_two_processes() -> None:
    script = os.path.join(ROOT, "examples", "hf_llama_finetune.py")
    cmd = [sys.executable, script, "--steps", "6", "--seq-len", "64", "--batch", "4",
           "--log-every", "3", "--world-size", "2"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "2 process(es)" in out and "32 tokens per rank" in out, out
    rows = [line.split("|") for line in out.splitlines() if line.split("|")[0].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [0, 3, 6], out
    losses = [float(r[1]) for r in rows]
    assert all(0 < loss < 10 for loss in losses), out
    assert losses[-1] < losses[0], out  # six steps already lower the loss
    assert all(r[2].strip().endswith("%") for r in rows) and "runtime" in out


# ---------------------------------------------------------------------------
# docs/transformers.md's examples, run as written under torchrun (a tiny saved
# model stands in for the checkpoint).

README_CHECKPOINT = "meta-llama/Llama-3.2-1B"

README_REFERENCE = """
import torch
torch.manual_seed(0)
input_ids = torch.randint(1, 61, (2, 45))
labels = input_ids.clone()
labels[1, 30:] = -100
position_ids = None
want = model(input_ids, labels=labels).loss
want.backward()
want_grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
"""

README_CHECK = """
import os
import sys

dist.all_reduce(loss)
loss /= dist.get_world_size()  # the ranks' losses average to the batch's
assert abs(loss.item() - want.item()) < 1e-5, (loss.item(), want.item())
err = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), want_grads))
assert err < 1e-5, err
sys.stdout.write(f"rank {dist.get_rank()} ok {err}\\n")  # one write: lines do not interleave
sys.stdout.flush()
dist.destroy_process_group()
# Leave without interpreter finalization: under load a process very rarely
# aborts there ("terminate called without an active exception", after all of
# the above has completed); that is not what this test checks.
os._exit(0)
"""


def test_readme_section_runs_under_torchrun(tmp_path) -> None:
    text = open(os.path.join(ROOT, "docs", "transformers.md")).read()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    usage = next(b for b in blocks if README_CHECKPOINT in b)
    parallel = next(b for b in blocks if "register_transformers(group=dist" in b)
    trainer = next(b for b in blocks if "SequenceParallelTrainer(" in b)
    assert README_CHECKPOINT in usage and "register_transformers(group=" in parallel
    # the Trainer lines are quoted from the example (in order), which its own test runs
    example = [line.strip() for line in open(os.path.join(ROOT, "examples", "hf_trainer_sp.py"))]
    at = [example.index(line.strip()) for line in trainer.splitlines()]
    assert at == sorted(at), trainer
    build(tiny_config()).save_pretrained(tmp_path / "tiny")
    usage = usage.replace(README_CHECKPOINT, str(tmp_path / "tiny"))
    script = tmp_path / "readme_hf.py"
    script.write_text(usage + README_REFERENCE + parallel + README_CHECK)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    oks = sorted(line.split()[1] for line in proc.stdout.splitlines() if " ok " in line)
    assert oks == ["0", "1"], proc.stdout
