"""Sequence parallelism in the transformers backend: a call that one rank
refuses raises ``ValueError`` on every rank (through the ring's handshake),
promptly, and so does a generation step on one rank beside a training step
on the others. Real gloo processes; the process group's timeout is far longer
than the whole run is given, so a peer left waiting fails the run instead of
raising."""

from __future__ import annotations

import torch
import torch.distributed as dist
from test_hf import VOCAB, build, tiny_config

import ring_attention as ra
from ring_attention import hf
from ring_attention.parallel.testing import run_distributed

FAULTS = ["padding mask", "dropout", "config entry", "no cu_seq_lens", "4-D mask", "generating"]
PATTERN = {"segment_lengths": [4, 8], "dilation_rates": [1, 2]}


def _worker(rank: int, world: int) -> list[tuple[str, int, str]]:
    ra.register_transformers(group=dist.group.WORLD)
    ids = torch.randint(1, VOCAB, (2, 23), generator=torch.Generator().manual_seed(31))
    seen = []
    for i, fault in enumerate(FAULTS):
        faulty = i % world
        mine = rank == faulty
        cfg = tiny_config(pattern=PATTERN)
        if mine and fault == "dropout":
            cfg.attention_dropout = 0.2
        if mine and fault == "config entry":
            cfg.dilated_attention = {"segment_lengths": [8], "dilation_rates": [9]}
        model = build(cfg, "ring_dilated")
        if mine and fault == "dropout":
            model.train()
        batch = hf.shard_causal_lm_batch(ids, ids)
        if mine and fault == "padding mask":
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
            batch["attention_mask"][0, -1] = 0
        if mine and fault in ("no cu_seq_lens", "generating"):
            del batch["cu_seq_lens_q"], batch["cu_seq_lens_k"]
        # without documents and with use_cache (the default) a call is a
        # generation step: the ranks in a training step raise with it
        batch["use_cache"] = fault == "generating"
        if mine and fault == "4-D mask":
            n = batch["input_ids"].shape[1]
            batch["attention_mask"] = torch.ones(2, 1, n, n, dtype=torch.bool).tril()
        try:
            model(**batch)
            seen.append((fault, faulty, "no error"))
        except ValueError as exc:
            seen.append((fault, faulty, str(exc)))
    # the ranks are still in step: a good call works everywhere
    model = build(tiny_config(pattern=PATTERN), "ring_dilated")
    loss = model(**hf.shard_causal_lm_batch(ids, ids)).loss.detach()
    dist.all_reduce(loss)  # the ranks' shares sum to the whole batch's loss
    seen.append(("after", -1, f"{loss.item():.6f}"))
    return seen


def test_a_refused_call_raises_on_every_rank() -> None:
    world = 3
    out = run_distributed(_worker, world, timeout=240, pg_timeout=1800)
    own = {
        "padding mask": "takes no padding mask",
        "dropout": "attention dropout",
        "config entry": r"config.dilated_attention",
        "no cu_seq_lens": "cu_seq_lens_q",
        "4-D mask": "4-D attention mask",
        "generating": "ranks are out of step",
    }
    for rank, seen in enumerate(out):
        assert [s[0] for s in seen] == [*FAULTS, "after"]
        for fault, faulty, message in seen[:-1]:
            if fault == "generating":  # every rank names the calls
                assert own[fault] in message and "cu_seq_lens_q" in message, (rank, message)
                assert f"rank {faulty}: generation over the group" in message, (rank, message)
            elif rank == faulty:
                assert own[fault] in message, (rank, fault, message)
            else:
                # the others name the rank and its error
                assert f"rank {faulty} failed: " in message, (rank, message)
                assert own[fault] in message, (rank, fault, message)
    assert len({seen[-1][2] for seen in out}) == 1  # one loss on every rank afterwards
