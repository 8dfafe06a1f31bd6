"""Ulysses and the ring x Ulysses hybrid under ``torch.compile``.

Their all-to-alls (batched point-to-point sends inside autograd functions)
and the grid's agreement rounds cannot be traced, so a call with
``ulysses_group=`` or ``mesh=`` that ``torch.compile`` meets runs eagerly, as
one call: with ``fullgraph=False`` the graph breaks once there (the code
before and after it compiles), with ``fullgraph=True`` Dynamo raises, naming
:data:`REASON`. The ring alone (``group=``) is one operator forward and one
backward and compiles with ``fullgraph=True``.

Imported by :func:`ring_attention.parallel.api.sharded_attention` only while
compiling: ``torch.compiler.disable`` imports ``torch._dynamo``, which a
plain ``import ring_attention`` does not pay for.
"""

from __future__ import annotations

import torch

from .ulysses import ulysses_call

__all__ = ["REASON", "ulysses_eagerly"]

#: Why the call is not traced (Dynamo's message under ``fullgraph=True``).
REASON = (
    "ring_attention: Ulysses and the ring x Ulysses hybrid (ulysses_group= or mesh=) run "
    "their all-to-alls eagerly, outside the compiled graph: compile with fullgraph=False "
    "(one graph break at this call), or use the ring alone (group=, no ulysses_group or "
    "mesh), which compiles with fullgraph=True"
)

#: :func:`ring_attention.parallel.ulysses.ulysses_call`, never traced.
ulysses_eagerly = torch.compiler.disable(ulysses_call, reason=REASON)
