"""ring_attention: exact LongNet-style dilated attention, sharded across
processes with a dilation-aware ring exchange of K/V rows."""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers torch.ops.ring_attention)
from . import ops  # noqa: F401  (the operators' autograd)
from .dtypes import select_dtype
from .functional import dilated_attention
from .hf import register_transformers
from .modules import DilatedAttention, MultiheadDilatedAttention, RingDilatedAttention
from .multihead import MultiheadAttentionError
from .pattern import Pattern
from .ring import ring_dilated_attention
from .sharding import gather_sequence, shard_sequence

__all__ = [
    "DilatedAttention",
    "MultiheadAttentionError",
    "MultiheadDilatedAttention",
    "Pattern",
    "RingDilatedAttention",
    "dilated_attention",
    "gather_sequence",
    "register_transformers",
    "ring_dilated_attention",
    "select_dtype",
    "shard_sequence",
]
__version__ = "0.1.0"
