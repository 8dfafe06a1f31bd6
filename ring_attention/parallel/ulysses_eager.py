"""Ulysses and the ring x Ulysses hybrid under ``torch.compile``: their
all-to-alls and the grid's agreement rounds cannot be traced, so such a call
runs eagerly, as one call (``fullgraph=False``: one graph break;
``fullgraph=True``: Dynamo raises, naming :data:`REASON`). The ring alone
compiles with ``fullgraph=True``. Imported only while compiling:
``torch.compiler.disable`` imports ``torch._dynamo``, which a plain
``import ring_attention`` does not pay for."""

from __future__ import annotations

import torch

__all__ = ["REASON", "ulysses_eagerly"]

#: Why the call is not traced (Dynamo's message under ``fullgraph=True``).
REASON = (
    "ring_attention: Ulysses and the ring x Ulysses hybrid (ulysses_group= or mesh=) run "
    "their all-to-alls eagerly, outside the compiled graph: compile with fullgraph=False "
    "(one graph break at this call), or use the ring alone (group=, no ulysses_group or "
    "mesh), which compiles with fullgraph=True"
)


@torch.compiler.disable(reason=REASON)
def ulysses_eagerly(run, *args, **kwargs):
    """``run(*args, **kwargs)`` (the Ulysses call), never traced."""
    return run(*args, **kwargs)
