"""Llama 4's chunked attention with left padding under ``"ring_dilated"``
beyond one eager process (tests/test_hf_models.py has that): sequence
parallelism refuses the padding mask with ``ValueError`` on every rank,
promptly (the key map does not raise on the padded rank alone, which left
the others waiting at the ring's handshake); a static cache of full layers
refuses a multi-token continuation of left-padded chunked layers, naming
it; ``torch.compile`` of a left-padded forward (each row's chunks moved on,
compiled) equals eager and ``"sdpa"``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from test_hf import VOCAB
from test_hf_generate import _full_static_cache
from test_hf_models import TOL, build

import ring_attention as ra
from ring_attention import hf
from ring_attention.parallel.testing import run_distributed

#: left padding of row 1 (chunks of 8 move on by 5)
PAD = 3


def _left_padded(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of 2 rows of ``n`` tokens, row 1 left-padded by PAD."""
    ids = torch.randint(1, VOCAB, (2, n), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0
    return ids, mask


def _sp_worker(rank: int, world: int) -> str:
    ra.register_transformers(group=dist.group.WORLD)
    ids, mask = _left_padded(8 * world)
    batch = hf.shard_causal_lm_batch(ids, ids)  # this rank's 8 tokens, the documents
    n = batch["input_ids"].shape[1]
    batch["attention_mask"] = mask[:, rank * n : (rank + 1) * n]  # padded on rank 0 only
    model = build("llama4", "ring_dilated")
    try:
        model(**batch)
        return "no error"
    except ValueError as exc:
        return str(exc)
    finally:
        ra.register_transformers()


def test_sequence_parallel_left_padded_chunks_raise_on_every_rank() -> None:
    """3 ranks, the left padding in rank 0's shard only: ValueError on
    every rank (the others name rank 0's), not a wait until the group's
    timeout (far longer than the run is given)."""
    out = run_distributed(_sp_worker, 3, timeout=120, pg_timeout=1800)
    refusal = "with sequence parallelism takes no padding mask"
    assert refusal in out[0], out[0]
    for rank, message in enumerate(out[1:], 1):
        assert "rank 0 failed: " in message and refusal in message, (rank, message)


def test_static_cache_of_full_layers_refuses_left_padded_chunks() -> None:
    """A static cache of full layers gives the chunked layers a position
    map (no key map to move): a continuation of several tokens raises,
    naming the cache; "sdpa" continues it."""
    ra.register_transformers()
    ids, _ = _left_padded(16)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :PAD] = 0
    for attn in ("sdpa", "ring_dilated"):
        model = build("llama4", attn)
        past = _full_static_cache(model.config, 24)
        model(ids[:, :10], cache=past, use_cache=True, attention_mask=mask)  # the prefill
        if attn == "sdpa":
            model(ids[:, 10:], cache=past, use_cache=True, attention_mask=mask)
            continue
        try:
            model(ids[:, 10:], cache=past, use_cache=True, attention_mask=mask)
        except ValueError as exc:
            message = str(exc)
        else:
            raise AssertionError("a static cache of full layers took left-padded chunks")
        assert "chunked attention with left padding" in message, message
        assert "static cache of full layers" in message, message


def test_compiled_left_padded_chunks_equal_eager_and_sdpa() -> None:
    """torch.compile (aot_eager) of a left-padded forward: the compiled
    layers move each row's chunks on by chunk - 1 slots at most; its
    logits equal eager and "sdpa" on the tokens (float32)."""
    ra.register_transformers()
    ids, mask = _left_padded(23)
    mask[0, :6] = 0  # the other row moved on by 2
    sdpa = build("llama4", "sdpa")
    ring = build("llama4", "ring_dilated", sdpa.state_dict())
    keep = mask.bool()
    with torch.no_grad():
        want = sdpa(input_ids=ids, attention_mask=mask).logits
        eager = ring(input_ids=ids, attention_mask=mask).logits
        torch.compiler.reset()
        try:
            got = torch.compile(ring, backend="aot_eager")(input_ids=ids, attention_mask=mask)
        finally:
            torch.compiler.reset()
    tol = TOL[torch.float32][0]
    torch.testing.assert_close(got.logits[keep], eager[keep], rtol=tol, atol=tol)
    torch.testing.assert_close(got.logits[keep], want[keep], rtol=tol, atol=tol)
