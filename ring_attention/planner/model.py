"""Whole-model memory and time per rank for sequence-parallel training (the
assumptions: docs/planner.md)."""

from typing import Any

from .memory import LayerMemory, acc_bytes
from .presets import ModelShape


def activation_bytes_per_token(shape: ModelShape, itemsize: int) -> int:
    """Bytes one block stores per token for its backward (no checkpointing)."""
    h, H, Hkv, d, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn
    values = 4 * h + (2 * H + 2 * Hkv) * d + (3 if shape.gated else 2) * f
    return values * itemsize + H * acc_bytes(itemsize)


def model_memory(setup: Any, layer: LayerMemory, tokens: int, world_size: int) -> dict[str, int]:
    """Peak bytes of one rank training the whole model of a :class:`~.capacity.Setup`, per
    item (``tokens``: the rank's tokens; ``layer``: its attention layer memory)."""
    shape, itemsize, checkpointing = setup.model, setup.itemsize, setup.checkpointing
    states = 16 * shape.params() // (world_size if setup.shard_params else 1)  # AdamW, mixed
    per_token = activation_bytes_per_token(shape, itemsize)
    attention_backward = sum(v for k, v in layer.backward.items() if k != "out, lse (saved)")
    gathered = 2 * shape.layer_params() * itemsize if setup.shard_params and world_size > 1 else 0
    stored = shape.hidden * itemsize if checkpointing else per_token
    backward = attention_backward + layer.inputs["grad_out"] + layer.inputs["plan indices (cached)"]
    return {
        "parameters, gradients, AdamW state": states,
        "gathered block weights + gradients (FSDP)": gathered,
        "stored activations (all blocks)": shape.layers * tokens * stored,
        "recomputed block (checkpointing)": tokens * per_token if checkpointing else 0,
        "attention backward (one block)": backward,
        "residual-stream gradients": 2 * tokens * shape.hidden * itemsize,
    }


def model_step_seconds(
    setup: Any, tokens: int, attention_forward: float, attention_forward_backward: float,
    matmul_flops: float,
) -> dict[str, float]:  # fmt: skip
    """Seconds of one training step of one rank of a :class:`~.capacity.Setup`, per item
    (``tokens``: the rank's tokens; attention times of one layer from :mod:`.timing`)."""
    shape, checkpointing = setup.model, setup.checkpointing
    matmul_params = shape.layer_params() - 2 * shape.hidden
    per_token = (8 if checkpointing else 6) * matmul_params * shape.layers
    head = 6 * shape.vocab * shape.hidden
    attention = attention_forward_backward + (attention_forward if checkpointing else 0.0)
    return {
        "attention (all blocks)": shape.layers * attention,
        "matmuls (projections, MLP, output head)": tokens * (per_token + head) / matmul_flops,
    }
