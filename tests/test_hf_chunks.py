"""Llama 4's chunked attention with left padding under ``"ring_dilated"``
beyond one eager process (tests/test_hf_models.py has that): generation
over the sequence-parallel group (2 and 3 ranks; a dynamic, sharded, static
and full static cache) moves each left-padded row's chunks on as one
process does and gives its tokens; sequence-parallel training refuses the
padding mask with ``ValueError`` on every rank, promptly (the key map does
not raise on the padded rank alone, which left the others waiting at the
ring's handshake); a static cache of full layers refuses a multi-token
continuation of left-padded chunked layers in one process, naming it;
``torch.compile`` of a left-padded forward (each row's chunks moved on,
compiled) equals eager and ``"sdpa"``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_hf import VOCAB
from test_hf_generate import _full_static_cache
from test_hf_models import TOL, build

import ring_attention as ra
from ring_attention import hf
from ring_attention.hf.sharded_cache import ShardedCache
from ring_attention.parallel.testing import run_distributed

#: left padding of row 1 (chunks of 8 move on by 5)
PAD = 3


def _left_padded(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of 2 rows of ``n`` tokens, row 1 left-padded by PAD."""
    ids = torch.randint(1, VOCAB, (2, n), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0
    return ids, mask


def _generate(model, cache: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and logits of 8 new tokens after a 19-token prompt whose
    rows are left-padded by 6 and PAD (chunks of 8 move on by 2 and 5)."""
    ids, mask = _left_padded(19)
    mask[0, :6] = 0
    ids[mask == 0] = 0
    given = {}
    if cache == "sharded":
        given = {"cache": ShardedCache(model.config, block=3)}
    elif cache == "static":
        given = {"cache_implementation": "static"}
    elif cache == "full static":
        given = {"cache": _full_static_cache(model.config, 27)}
    with torch.no_grad():
        res = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, **given)  # fmt: skip
    return res.sequences, torch.stack(res.logits)


CACHES = ("dynamic", "sharded", "static", "full static")


def _generate_worker(rank: int, world: int, state: dict) -> list:
    ra.register_transformers(group=dist.group.WORLD)
    try:
        return [_generate(build("llama4", "ring_dilated", state), c) for c in CACHES]
    finally:
        ra.register_transformers()


@pytest.mark.parametrize("world", [2, 3])
def test_generation_over_the_group_moves_left_padded_chunks(world: int) -> None:
    """Every rank's greedy tokens equal one process's (its logits within
    1e-4) with each cache: the chunked layers move each row's keys and
    queries on by ``-padding mod chunk`` on every rank, run by run (before:
    the kernels' chunks started at 0, other tokens)."""
    ra.register_transformers()
    one = build("llama4", "ring_dilated")
    want_tokens, want_logits = _generate(one, "dynamic")
    for rank, got in enumerate(run_distributed(_generate_worker, world, one.state_dict(),
                                               timeout=300)):  # fmt: skip
        for cache, (tokens, logits) in zip(CACHES, got, strict=True):
            assert torch.equal(tokens, want_tokens), (rank, cache)
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4,
                                       msg=f"rank {rank}, {cache}")  # fmt: skip


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
