"""ring_attention: exact LongNet-style dilated attention, sharded across
processes with a dilation-aware ring exchange of K/V rows."""

from typing import Any

import torch  # noqa: F401  (loads libtorch before the extension)

__all__ = [
    "DilatedAttention",
    "MultiheadAttentionError",
    "MultiheadDilatedAttention",
    "Pattern",
    "RingDilatedAttention",
    "cache_info",
    "clear_caches",
    "dilated_attention",
    "gather_sequence",
    "plan_mesh",
    "register_transformers",
    "ring_dilated_attention",
    "select_dtype",
    "shard_sequence",
]
__version__ = "0.1.0"

from .core.cache import cache_info, clear_caches

try:
    from . import _C  # noqa: F401  (registers torch.ops.ring_attention)
except ImportError as error:
    # Without the compiled extension only the pure-Python parts import (the
    # planner, ring_attention.planner); the public names raise on first use.
    _EXTENSION_ERROR: ImportError | None = error
else:
    _EXTENSION_ERROR = None
    from .core.dtypes import select_dtype
    from .core.pattern import Pattern
    from .local.functional import dilated_attention
    from .nn.modules import DilatedAttention, RingDilatedAttention
    from .nn.multihead import MultiheadAttentionError, MultiheadDilatedAttention
    from .parallel.api import ring_dilated_attention
    from .parallel.auto import plan_mesh
    from .parallel.exchange_plan import build_plan as _build_plan
    from .parallel.sharding import gather_sequence, shard_sequence
    from .planner import traffic as _traffic

    _traffic.exact_plans = _build_plan  # the planner's exact source: the ring's own plans


def __getattr__(name: str) -> Any:
    if name == "register_transformers" and _EXTENSION_ERROR is None:
        # imported on first use: ring_attention.hf's torch.compiler.disable
        # imports torch._dynamo, seconds that a plain import need not pay
        from .hf.attention import register_transformers

        return register_transformers
    if _EXTENSION_ERROR is not None and name in __all__:
        raise ImportError(
            f"ring_attention.{name} needs the compiled extension ring_attention._C, which did "
            f"not load ({_EXTENSION_ERROR}); build it with scripts/setup.sh or "
            "`python setup.py build_ext --inplace`"
        ) from _EXTENSION_ERROR
    raise AttributeError(f"module 'ring_attention' has no attribute {name!r}")
