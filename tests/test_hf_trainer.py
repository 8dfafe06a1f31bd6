"""Sequence-parallel training with transformers' Trainer and with FSDP2, in
real gloo processes: 4 ranks as 2 data-parallel groups of 2 sequence-parallel
ranks (the ring, or Ulysses), or as one ring of 2 x Ulysses groups of 2 (the
hybrid), against one process training on the same global batches.

``SequenceParallelTrainer`` (``SequenceParallelDataLoader`` behind the
Trainer's loaders) gives each step's micro-batch of a sequence-parallel group
to all of its ranks, a piece each; the Trainer's own DDP over all 4 ranks
reduces the gradients and its token count (from ``shift_labels``) scales the
loss. The reference is the plain Trainer in one process whose batches are the
same samples (float64 throughout; the loss is transformers' float32 cross
entropy, so the losses agree to float32 and the parameters to float64
rounding, the scales being powers of two). Activation checkpointing
(reentrant and not) recomputes the attention in backward, the ring with the
same exchange plans. Packed documents are checked against ``"sdpa"`` on the
documents as separate padded rows, which cannot leak across documents.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    LlamaConfig,
    Trainer,
    TrainingArguments,
)

import ring_attention as ra
from ring_attention import hf
from ring_attention.parallel.exchange_plan import PLAN_CACHE
from ring_attention.parallel.ring import register_exchange_hook
from ring_attention.parallel.testing import run_distributed

VOCAB = 61
DP, SP, BATCH, STEPS = 2, 2, 2, 3
WORLD = DP * SP
PATTERN = {"segment_lengths": [6, 16], "dilation_rates": [1, 3]}


class Pad:
    """A tokenizer stand-in for transformers' collators (pads with 0, on the right)."""

    pad_token_id = 0
    padding_side = "right"

    def pad(self, features, return_tensors="pt", **_):
        n = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), n, dtype=torch.long)
        mask = torch.zeros(len(features), n, dtype=torch.long)
        for i, f in enumerate(features):
            ids[i, : len(f["input_ids"])] = torch.as_tensor(f["input_ids"])
            mask[i, : len(f["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask}


def samples(count: int, seed: int) -> list[dict]:
    """Token sequences of 9 to 40 tokens (some shorter than the ranks, most
    not dividing anything)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(9, 41, (count,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def collator(kind: str):
    if kind == "packed":
        return DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    return DataCollatorForLanguageModeling(Pad(), mlm=False)  # padded labels are -100


def config(kind: str) -> LlamaConfig:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=0)  # fmt: skip
    if kind != "packed":  # dense for packed documents: "sdpa" is its reference
        cfg.dilated_attention = PATTERN
    return cfg


def model_of(kind: str, attn: str = "ring_dilated") -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = copy.deepcopy(config(kind))
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).double()


def arguments(out: str, batch: int, **extra) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out, use_cpu=True, per_device_train_batch_size=batch, max_steps=STEPS,
        learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, report_to=[],
        save_strategy="no",
        train_sampling_strategy="sequential", disable_tqdm=True, dataloader_drop_last=True,
        **extra,
    )  # fmt: skip


def global_batches(dp: int, sp: int) -> list[list[int]]:
    """The samples of every step of the sequence-parallel run: step ``(i, j)``
    trains every data-parallel group ``g`` on the ``i``-th micro-batch of its
    rank ``j`` (rank ``g * sp + j``), which the Trainer's sharded sampler
    fills with batch ``i * WORLD + rank`` of the sequential order."""
    steps = []
    for i in range(STEPS):
        for j in range(sp):
            ranks = [g * sp + j for g in range(dp)]
            steps.append([(i * WORLD + r) * BATCH + t for r in ranks for t in range(BATCH)])
    return steps[:STEPS]


def losses_of(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _use_accelerate_env(rank: int, world: int) -> None:
    """What a launcher sets, so that Accelerate joins the existing group."""
    for key, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank),
                       ("LOCAL_WORLD_SIZE", world), ("OMP_NUM_THREADS", 1)):  # fmt: skip
        os.environ[key] = str(value)


# ---------------------------------------------------------------------------
# The single-process references.


def _reference(rank: int, world: int, out: str, dp: int) -> dict:
    _use_accelerate_env(rank, world)
    ra.register_transformers()
    found = {}
    data = samples(64, seed=1)
    order = [i for step in global_batches(dp, WORLD // dp) for i in step]
    for kind in ("plain", "packed"):
        attn = "sdpa" if kind == "packed" else "ring_dilated"
        # the packed run's documents as separate rows of "sdpa": no leak possible
        trainer = Trainer(model=model_of(kind, attn), args=arguments(out, dp * BATCH),
                          train_dataset=[data[i] for i in order],
                          data_collator=collator("plain"))  # fmt: skip
        trainer.train()
        found[kind] = (losses_of(trainer), full_state(trainer.model))
    return found


_REFERENCES: dict[int, dict] = {}


def reference(dp: int, tmp_path_factory) -> dict:
    """The single-process run on the global batches of ``dp`` data-parallel
    groups (computed once per module)."""
    if dp not in _REFERENCES:
        out = str(tmp_path_factory.mktemp(f"ref{dp}"))
        _REFERENCES[dp] = run_distributed(_reference, 1, out, dp, timeout=600)[0]
    return _REFERENCES[dp]


# ---------------------------------------------------------------------------
# The sequence-parallel runs.


def _trainer_case(kind: str, out: str, **extra) -> tuple[list[float], dict, int, int]:
    """Losses, parameters, ring forwards per rank and plans built."""
    forwards = []
    PLAN_CACHE.clear()
    hook = register_exchange_hook(
        lambda e: forwards.append(1) if e.phase == "forward_kv" and e.distance == 1 else None
    )
    trainer = hf.SequenceParallelTrainer(model=model_of(kind), args=arguments(out, BATCH, **extra),
                                         train_dataset=samples(64, seed=1),
                                         data_collator=collator(kind))  # fmt: skip
    trainer.train()
    hook.remove()
    model = trainer.accelerator.unwrap_model(trainer.model)
    return losses_of(trainer), full_state(model), len(forwards), PLAN_CACHE.misses


def _fsdp2_case(kind: str, reentrant: bool = False) -> tuple[list[float], dict]:
    """FSDP2 over all ranks (fully_shard per decoder layer and the model)
    with activation checkpointing, the loader of SequenceParallelDataLoader,
    a loop without a Trainer."""
    from torch.distributed.fsdp import fully_shard

    model = model_of(kind)
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    model.train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    data = samples(64, seed=1)
    batches = [data[(i * WORLD + dist.get_rank()) * BATCH :][:BATCH] for i in range(STEPS)]
    loader = hf.SequenceParallelDataLoader([collator(kind)(b) for b in batches])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    return losses, full_state(model)


def _checkpointed(reentrant: bool) -> dict:
    return dict(gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": reentrant})  # fmt: skip


def _worker(rank: int, world: int, out: str, mode: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    _use_accelerate_env(rank, world)
    if mode == "hybrid":  # one ring of 2 x Ulysses groups of 2, shard i * 2 + j = rank
        mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "ring", "ulysses"))
        grid = mesh["ring", "ulysses"]
        ids = torch.arange(2 * 23).view(2, 23)  # 23 tokens: pieces of 6, 6, 6, 5
        for spread in (dict(mesh=grid), dict(group=grid.get_group("ring"),
                                             ulysses_group=grid.get_group("ulysses"))):  # fmt: skip
            batch = hf.shard_causal_lm_batch(ids, ids, **spread)
            assert torch.equal(batch["input_ids"], torch.tensor_split(ids, 4, 1)[rank])
            assert batch["num_items_in_batch"] == 2 * 22 / 4
        with pytest.raises(ValueError, match="mesh"):
            ra.register_transformers(mesh=grid, group=grid.get_group("ring"))
        with pytest.raises(ValueError, match="ulysses_group"):
            ra.register_transformers(ulysses_group="ulysses")
        ra.register_transformers(mesh=grid)
        assert hf.sequence_parallel().size == 4 and hf.sequence_parallel().rank == rank
        found = {
            "ddp": _trainer_case("plain", out),
            "non-reentrant": _trainer_case("plain", out, **_checkpointed(False)),
            "fsdp2": _fsdp2_case("plain", reentrant=True),
            "packed": _trainer_case("packed", out),
        }
    else:
        mesh = init_device_mesh("cpu", (DP, SP), mesh_dim_names=("dp", "sp"))
        spread = "group" if mode == "ring" else "ulysses_group"
        ra.register_transformers(**{spread: mesh.get_group("sp")})
        found = {
            "ddp": _trainer_case("plain", out),
            "reentrant": _trainer_case("plain", out, **_checkpointed(True)),
            "non-reentrant": _trainer_case("plain", out, **_checkpointed(False)),
            "packed": _trainer_case("packed", out),
            "fsdp2": _fsdp2_case("plain"),
        }
    ra.register_transformers()
    return found


@pytest.mark.parametrize("mode", ["ring", "ulysses", "hybrid"])
def test_trainer_on_four_ranks_equals_one_process(mode, tmp_path, tmp_path_factory) -> None:
    """dp 2 x sp 2 (ring or Ulysses), or dp 1 x (ring 2 x Ulysses 2)."""
    want = reference(1 if mode == "hybrid" else DP, tmp_path_factory)
    got = run_distributed(_worker, WORLD, str(tmp_path / "sp"), mode, timeout=900)
    for rank, found in enumerate(got):
        for case, (losses, state, *_) in found.items():
            ref_losses, ref_state = want["packed" if case == "packed" else "plain"]
            assert len(losses) == STEPS, (case, losses)
            # logged as float32 by the Trainer
            torch.testing.assert_close(losses, ref_losses, rtol=2e-6, atol=0, msg=case)
            for name, value in ref_state.items():
                torch.testing.assert_close(state[name], value, rtol=1e-9, atol=1e-12,
                                           msg=f"rank {rank}, {mode} {case}: {name}")  # fmt: skip
        # Checkpointing recomputes every layer's ring forward in backward,
        # with the plans built in the forward (Ulysses alone has no ring).
        forwards, plans = found["ddp"][2:]
        assert (forwards > 0 and plans > 0) == (mode != "ulysses"), found["ddp"][2:]
        for case in ("reentrant", "non-reentrant"):
            if case in found:
                assert found[case][2:] == (2 * forwards, plans), (case, found[case][2:])


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_trainer_example_runs(mode) -> None:
    """The example on 2 processes (4 start slowly on 2 cores; the meshes of
    4 are the test above's)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "examples", "hf_trainer_sp.py"), "--steps", "20",
           "--seq-len", "64", "--batch", "4", "--log-every", "10", "--checkpointing",
           "--world-size", "2", "--mode", mode]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=root)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    out = res.stdout
    assert f"1 data-parallel group(s) of 2 sequence-parallel ranks ({mode})" in out, out
    assert "32 tokens per rank" in out, out
    rows = [line.split("|") for line in out.splitlines() if line.split("|")[0].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [10, 20], out
    losses = [float(r[1]) for r in rows]
    assert losses[1] < losses[0], out


# ---------------------------------------------------------------------------
# A collator's batch, one process (the pieces are the whole sequence).


def test_shard_causal_lm_batch_takes_a_collators_batch() -> None:
    ra.register_transformers()
    features = samples(3, seed=2)
    batch = collator("plain")(features)
    assert "attention_mask" in batch and not bool(batch["attention_mask"].all())
    out = hf.shard_causal_lm_batch(**batch, extra=torch.ones(3, batch["input_ids"].shape[1], 2))
    assert "attention_mask" not in out  # right padding: dropped, the padding unscored
    assert out["extra"].shape[:2] == batch["input_ids"].shape
    padded = batch["attention_mask"] == 0
    assert bool((out["labels"][padded] == -100).all())
    assert out["num_items_in_batch"] == sum(len(f["input_ids"]) - 1 for f in features)
    assert out["cu_seq_lens_q"].tolist() == [0, batch["input_ids"].shape[1]]
    # The model's loss equals its loss on the padded batch with the mask.
    model = model_of("plain").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**out).loss, model(**batch).loss, rtol=1e-12, atol=0)

    packed = collator("packed")(features)
    out = hf.shard_causal_lm_batch(**packed)
    assert out["cu_seq_lens_q"].tolist() == packed["cu_seq_lens_q"].tolist()
    without_positions = {k: v for k, v in packed.items() if k != "position_ids"}
    out = hf.shard_causal_lm_batch(**without_positions)  # documents from cu_seq_lens_q alone
    assert torch.equal(out["position_ids"], packed["position_ids"])


def test_shard_causal_lm_batch_refuses_what_it_cannot_shard() -> None:
    ra.register_transformers()
    ids = torch.randint(1, VOCAB, (2, 9))
    left = torch.ones_like(ids)
    left[1, :3] = 0
    for kwargs, match in (
        (dict(attention_mask=left), "right padding only"),
        (dict(attention_mask=torch.ones(2, 1, 9, 9)), "2-D padding mask"),
        (dict(position_ids=torch.arange(9)[None], cu_seq_lens_q=torch.tensor([0, 4, 9])),
         "disagrees"),
        (dict(cu_seq_lens_q=torch.tensor([0, 5, 4, 9])), "non-decreasing"),
        (dict(inputs_embeds=torch.ones(2, 9, 4)), "exactly one"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            hf.shard_causal_lm_batch(ids, ids, **kwargs)
    with pytest.raises(ValueError, match="exactly one"):
        hf.shard_causal_lm_batch()
    out = hf.shard_causal_lm_batch(inputs_embeds=torch.ones(2, 9, 4), labels=ids)
    assert out["inputs_embeds"].shape == (2, 9, 4) and "input_ids" not in out


def test_data_loader_without_sequence_parallelism_passes_batches_through() -> None:
    ra.register_transformers()
    features = samples(4, seed=3)
    loader = hf.SequenceParallelDataLoader([collator("plain")(features[:2]),
                                            collator("plain")(features[2:])])  # fmt: skip
    batches = list(loader)
    assert len(loader) == 2 and len(batches) == 2
    assert batches[1]["num_items_in_batch"] == sum(len(f["input_ids"]) - 1 for f in features[2:])
    with pytest.raises(ValueError, match="dicts"):
        list(hf.SequenceParallelDataLoader([[1, 2]]))
