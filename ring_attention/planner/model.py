"""Whole-model memory and time per rank, for sequence-parallel training.

Assumptions (printed by the command line with every whole-model figure):

* every rank holds ``batch * n / p`` tokens of every layer (the ring shards
  the sequence; everything outside attention is per token);
* mixed-precision AdamW: 16 bytes per parameter (2-byte weights and
  gradients, fp32 master weights, two fp32 moments; float32 training: 4 + 4
  + 8), sharded over the ``p`` ranks (FSDP / ZeRO-3) unless replicated, plus
  one block's gathered weights and gradients in the compute dtype;
* stored activations per token of a block, without checkpointing: the
  input and output of both norms (``4 h``), q, k, v and the attention output
  (``(2 H + 2 H_kv) d``), the MLP's hidden activations (``2 f``, gated
  ``3 f``), in the compute dtype, and the fp32 ``lse`` (``4 H`` bytes); no
  dropout masks;
* with full activation checkpointing, only each block's input (``h`` per
  token) is kept, and one block is recomputed at a time during the backward;
* the attention backward of one block (the ring: fp32 dq, dk, dv, gradient
  of its output, transport buffers, kernel workspace; :mod:`.memory`) and
  two residual-stream gradients (``2 h`` per token) live on top;
* the loss is computed in chunks: full-sequence logits are never stored;
* time: attention from :mod:`.timing` (forward + backward; forward again when
  checkpointing), everything else as dense matmuls, ``2`` FLOPs per
  parameter and token forward, ``6`` for forward + backward (``8`` with
  recomputation; the output head ``6``), at the matmul rate; the
  optimizer step and the data-parallel / FSDP collectives are not modelled.
"""

from __future__ import annotations

from .memory import LayerMemory, acc_bytes
from .presets import ModelShape

__all__ = ["activation_bytes_per_token", "model_memory", "model_step_seconds"]


def activation_bytes_per_token(shape: ModelShape, itemsize: int) -> int:
    """Bytes one block stores per token for its backward (no checkpointing)."""
    h, H, Hkv, d, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn
    values = 4 * h + (2 * H + 2 * Hkv) * d + (3 if shape.gated else 2) * f
    return values * itemsize + H * acc_bytes(itemsize)


def model_memory(
    shape: ModelShape,
    layer: LayerMemory,
    tokens: int,
    itemsize: int,
    world_size: int,
    *,
    checkpointing: bool,
    shard_params: bool,
) -> dict[str, int]:
    """Peak bytes of one rank training the whole model, per item (``tokens``:
    the rank's tokens, ``batch * n / p``; ``layer``: the rank's attention
    layer memory)."""
    params = shape.params()
    per_param = 16
    per_token = activation_bytes_per_token(shape, itemsize)
    attention_backward = sum(v for k, v in layer.backward.items() if k != "out, lse (saved)")
    items = {
        "parameters, gradients, AdamW state": per_param
        * params
        // (world_size if shard_params else 1),
        "gathered block weights + gradients (FSDP)": (
            2 * shape.layer_params() * itemsize if shard_params and world_size > 1 else 0
        ),
        "stored activations (all blocks)": shape.layers
        * tokens
        * (shape.hidden * itemsize if checkpointing else per_token),
        "recomputed block (checkpointing)": tokens * per_token if checkpointing else 0,
        "attention backward (one block)": attention_backward
        + layer.inputs["grad_out"]
        + layer.inputs["plan indices (cached)"],
        "residual-stream gradients": 2 * tokens * shape.hidden * itemsize,
    }
    return items


def model_step_seconds(
    shape: ModelShape,
    tokens: int,
    attention_forward: float,
    attention_forward_backward: float,
    matmul_flops: float,
    *,
    checkpointing: bool,
) -> dict[str, float]:
    """Seconds of one training step of one rank, per item (``tokens``: the
    rank's tokens; attention times of one layer from :mod:`.timing`)."""
    matmul_params = shape.layer_params() - 2 * shape.hidden
    per_token = (8 if checkpointing else 6) * matmul_params * shape.layers
    head = 6 * shape.vocab * shape.hidden
    return {
        "attention (all blocks)": shape.layers
        * (attention_forward_backward + (attention_forward if checkpointing else 0.0)),
        "matmuls (projections, MLP, output head)": tokens * (per_token + head) / matmul_flops,
    }
