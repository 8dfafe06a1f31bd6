"""ring_attention: exact LongNet-style dilated attention, sharded across
processes with a dilation-aware ring exchange of K/V rows."""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers torch.ops.ring_attention)
from .dtypes import select_dtype
from .functional import dilated_attention

__all__ = ["dilated_attention", "select_dtype"]
__version__ = "0.1.0"
