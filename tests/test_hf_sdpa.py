"""The transformers backend without a pattern against transformers' own
``"sdpa"``: packed sequences exactly as transformers decides them, 4-D and
float masks, attention dropout, ``output_attentions``; with a pattern, what
the kernels cannot express raises. And config entries of NumPy values."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import torch
from test_hf import VOCAB, build, tiny_config
from transformers import DynamicCache
from transformers.utils import logging as hf_logging

import ring_attention as ra
from ring_attention import hf

PATTERN = {"segment_lengths": [4, 8], "dilation_rates": [1, 2]}


@pytest.fixture(autouse=True)
def registered():
    ra.register_transformers()
    yield


ARCHS = {  # Mistral's window shorter than the sequences below
    "llama": dict(arch="llama", kv_heads=2),
    "mistral": dict(arch="mistral", kv_heads=1, sliding_window=5),
    "qwen2": dict(arch="qwen2", kv_heads=4),
}


@functools.cache
def _models(arch: str) -> tuple:
    """(sdpa, ring_dilated) of ``arch`` with the same weights."""
    ra.register_transformers()
    cfg = tiny_config(**ARCHS[arch])
    sdpa = build(cfg, "sdpa")
    return sdpa, build(cfg, "ring_dilated", state=sdpa.state_dict())


@pytest.fixture(scope="module")
def models():
    """(sdpa, ring_dilated) with the same weights: Llama, 4 heads over 2 K/V heads."""
    return _models("llama")


def _positions(kind: str) -> torch.Tensor:
    restart = torch.cat([torch.arange(10), torch.arange(14)])
    if kind == "restart":
        return restart[None]
    if kind == "gaps":
        return torch.arange(0, 48, 2)[None]
    if kind == "rows":  # different documents per row, one row not packed
        return torch.stack([restart, torch.cat([torch.arange(3), torch.arange(21)]),
                            torch.arange(24)])  # fmt: skip
    return torch.arange(24)[None]


@pytest.mark.parametrize("kind", ["restart", "gaps", "rows", "plain"])
@pytest.mark.parametrize(
    ("use_cache", "ones_mask", "mode"),
    [(None, False, "eval"), (False, False, "eval"), (True, False, "eval"),
     (None, True, "eval"), (False, True, "eval"), (None, False, "train"),
     (False, False, "train")],
)  # fmt: skip
def test_packed_sequences_as_transformers_decides(models, kind, use_cache, ones_mask, mode):
    """transformers finds packed sequences in position_ids only without a
    mask and without a cache (use_cache defaults to True, in training too):
    "ring_dilated" splits documents exactly where "sdpa" does."""
    sdpa, ring = models
    ids = torch.randint(1, VOCAB, (3, 24), generator=torch.Generator().manual_seed(11))
    kwargs = {"position_ids": _positions(kind)}
    if use_cache is not None:
        kwargs["use_cache"] = use_cache
    if ones_mask:
        kwargs["attention_mask"] = torch.ones_like(ids)
    with torch.no_grad():
        want = getattr(sdpa, mode)()(ids, **kwargs).logits
        got = getattr(ring, mode)()(ids, **kwargs).logits
    sdpa.eval(), ring.eval()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def custom_4d_inputs():
    """transformers' test_custom_4d_attention_mask: three sequences sharing
    prefixes, packed into one row with a 4-D mask, against them as a batch."""
    gen = torch.Generator().manual_seed(12)
    base = torch.randint(1, VOCAB, (6,), generator=gen)
    tails = torch.randint(1, VOCAB, (3,), generator=gen)
    batch = torch.stack([torch.cat([base[:5], tails[i : i + 1]]) for i in range(3)])
    packed = torch.cat([base[:5], tails])[None]  # prefix, then the three last tokens
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 5, 5]])
    allowed = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    allowed[6, 5] = allowed[7, 5] = allowed[7, 6] = False  # the tails do not see each other
    return batch, packed, positions, allowed


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_4d_mask_without_pattern_equals_sdpa(arch, kind):
    sdpa, ring = _models(arch)
    batch, packed, positions, allowed = custom_4d_inputs()
    if kind == "bool":
        mask = allowed[None, None]
    else:
        mask = torch.zeros(1, 1, 8, 8).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = sdpa(packed, attention_mask=mask, position_ids=positions).logits
        got = ring(packed, attention_mask=mask, position_ids=positions).logits
        separate = ring(batch).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    if arch == "mistral":  # the 4-D mask replaces its window (shorter than the sequences)
        return
    # what the 4-D mask means: the packed tails equal the separate sequences
    torch.testing.assert_close(got[0, 5:], separate[:, -1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # (a sliding cache drops keys)
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_4d_mask_of_one_query_row_equals_sdpa(arch, kind, monkeypatch):
    """A decode step after a cached prefix with a 4-D mask of its one query
    row hiding some keys: a bool row is key padding for the kernels, a float
    row is sdpa's to apply; both equal sdpa."""
    sdpa, ring = _models(arch)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(14))
    keep = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    keep[0, ..., 3] = keep[1, ..., 7:9] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, -1e30)
    calls = []
    one_query = hf.attention._one_query
    monkeypatch.setattr(hf.attention, "_one_query",
                        lambda *a: calls.append(1) or one_query(*a))  # fmt: skip
    logits = []
    for model in (sdpa, ring):
        past = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :11], cache=past, use_cache=True)
            logits.append(model(ids[:, 11:], attention_mask=mask, cache=past).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=2e-6)
    assert len(calls) == (ring.config.num_hidden_layers if kind == "bool" else 0)


def test_4d_mask_with_pattern_raises():
    _, packed, positions, allowed = custom_4d_inputs()
    model = build(tiny_config(pattern=PATTERN), "ring_dilated")
    with pytest.raises(ValueError, match=r"dilated pattern.*4-D attention mask"):
        model(packed, attention_mask=allowed[None, None], position_ids=positions)


def test_dropout_without_pattern_is_sdpas_own():
    cfg = tiny_config(attention_dropout=0.3)
    sdpa = build(cfg, "sdpa").train()
    ring = build(cfg, "ring_dilated", state=sdpa.state_dict()).train()
    ids = torch.randint(1, VOCAB, (2, 17), generator=torch.Generator().manual_seed(13))
    torch.manual_seed(5)
    want = sdpa(ids).logits
    torch.manual_seed(5)
    got = ring(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got - ring.eval()(ids).logits).abs().max() > 1e-3  # dropout was applied
    # a padding mask (left and right), then packed documents: sdpa gets the
    # 4-D mask of the key map (rows with no key give 0, not NaN)
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[0, :4], mask[1, 12:] = 0, 0
    positions = torch.cat([torch.arange(6), torch.arange(11)])[None].expand(2, -1)
    ring.train()
    for extra in (dict(attention_mask=mask), dict(position_ids=positions, use_cache=False)):
        torch.manual_seed(5)
        want = sdpa(ids, **extra).logits
        torch.manual_seed(5)
        got = ring(ids, **extra).logits
        keep = extra["attention_mask"].bool() if "attention_mask" in extra else slice(None)
        torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-6)
        assert not got.isnan().any()
    # with a pattern it cannot be applied exactly
    dilated = build(tiny_config(attention_dropout=0.3, pattern=PATTERN), "ring_dilated").train()
    with pytest.raises(ValueError, match=r"attention dropout.*attention_dropout"):
        dilated(ids)
    dilated.eval()(ids)  # no dropout in eval


@pytest.mark.parametrize("arch", ARCHS)
def test_output_attentions_warns_and_returns_none_as_sdpa(arch, caplog):
    sdpa, ring = _models(arch)
    ids = torch.randint(1, VOCAB, (1, 9))
    hf_logging.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        got = ring(ids, output_attentions=True)
        want = sdpa(ids, output_attentions=True)
    assert got.attentions == want.attentions == ()
    messages = [r.getMessage() for r in caplog.records]
    assert any("ring_dilated" in m and "output_attentions=True" in m for m in messages), messages
    assert any("sdpa" in m and "output_attentions=True" in m for m in messages), messages


@pytest.mark.parametrize(
    "entry",
    [
        {"segment_lengths": np.array([4, 8]), "dilation_rates": np.array([1, 2])},
        {"segment_lengths": [np.int64(4), np.int32(8)], "dilation_rates": (1, np.int16(2))},
        {"segment_lengths": torch.tensor([4, 8]), "dilation_rates": [1, 2],
         "head_groups": np.bool_(False)},
    ],
)  # fmt: skip
def test_config_entry_with_numpy_values(entry):
    want = hf.pattern_from_config(tiny_config(pattern=PATTERN), causal=True)
    assert hf.pattern_from_config(tiny_config(pattern=entry), causal=True) == want
    model = build(tiny_config(pattern=entry), "ring_dilated")
    with torch.no_grad():
        model(torch.randint(1, VOCAB, (1, 11)))


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"segment_lengths": [[4, 8]], "dilation_rates": [1]}, r"segment_lengths\[0\]"),
        ({"segment_lengths": np.array([[4], [8]]), "dilation_rates": [1, 2]},
         r"segment_lengths\[0\]"),
        ({"segment_lengths": [4], "dilation_rates": [{1}]}, r"\['dilation_rates'\]"),
    ],
)  # fmt: skip
def test_config_entry_nested_values_raise(entry, match):
    with pytest.raises(ValueError, match=r"config\.dilated_attention") as info:
        hf.pattern_from_config(tiny_config(pattern=entry), causal=True)
    assert info.match(match)
