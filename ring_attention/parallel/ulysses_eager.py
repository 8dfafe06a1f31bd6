"""Ulysses and the hybrid under ``torch.compile``: run eagerly (one graph break;
``fullgraph=True`` raises :data:`REASON`). Imported only while compiling."""

import torch

#: Why the call is not traced (Dynamo's message under ``fullgraph=True``).
REASON = ("ring_attention: Ulysses and the ring x Ulysses hybrid (ulysses_group= or mesh=) run "
          "their all-to-alls eagerly, outside the compiled graph: compile with fullgraph=False "
          "(one graph break at this call), or use the ring alone (group=, no ulysses_group or "
          "mesh), which compiles with fullgraph=True")  # fmt: skip


@torch.compiler.disable(reason=REASON)
def ulysses_eagerly(run, *args, **kwargs):
    """``run(*args, **kwargs)`` (the Ulysses call), never traced."""
    return run(*args, **kwargs)
