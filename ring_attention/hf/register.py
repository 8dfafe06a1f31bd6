"""``register_transformers``: the ``"ring_dilated"`` entries of transformers'
attention and mask interfaces, and the sequence-parallel setting they read."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .attention import dilated_attention_forward
from .masks import dilated_attention_mask
from .setting import ATTN_IMPLEMENTATION, import_transformers, set_sequence_parallel, spread_of

__all__ = ["register_transformers"]


def register_transformers(
    group: dist.ProcessGroup | None = None,
    *,
    ulysses_group: dist.ProcessGroup | None = None,
    mesh: Any = None,  # a DeviceMesh, or "auto"
    layout: str = "contiguous",
) -> None:
    """Register ``"ring_dilated"`` with transformers' attention and
    attention-mask interfaces, so that ``from_config(config,
    attn_implementation="ring_dilated")`` (or ``from_pretrained``) uses
    exact dilated attention with the pattern of ``config.dilated_attention``.

    Idempotent; every call replaces the sequence-parallel setting.

    Args:
        group: ``None`` (default, and no ``ulysses_group`` or ``mesh``):
            every process attends over the whole sequence it is given. A
            process group (e.g. ``dist.group.WORLD``): sequence parallelism
            over it; every ``"ring_dilated"`` call of this process is then
            ring attention over ``group``, each rank passing its shard of the
            tokens (see :func:`ring_attention.hf.shard_causal_lm_batch`).
            With ``ulysses_group``: the ring between the ranks holding the
            same heads (``None``: no ring), as in
            :func:`ring_attention.ring_dilated_attention`.
        ulysses_group: head parallelism (Ulysses) inside this group; with
            ``group`` too, the ring x Ulysses hybrid (rank with ring index
            ``i`` and Ulysses index ``j`` holding shard ``i * U + j``).
        mesh: instead of the groups, a ``DeviceMesh``: 1-D = a ring over it,
            2-D with ``mesh_dim_names=("ring", "ulysses")`` = the hybrid; or
            ``"auto"``: each layer type's grid over ``group``'s ranks (the
            default group by default) is the planner's choice
            (:func:`ring_attention.plan_mesh`) at the batch's length: a
            sliding layer the ring (its bytes bounded by the window), a full
            layer the fastest grid predicted. Every rank chooses the same
            without communicating; the batch shards as for the ring.
        layout: the sharding layout of the sequence-parallel ranks,
            ``"contiguous"`` (default) or ``"zigzag"`` (docs/design.md §3;
            in the hybrid, at the ring level). ``"balanced"`` is refused:
            its cuts follow one pattern, the layers' may differ.

    The groups are held by weak references, so that
    ``destroy_process_group`` releases them; a sharded call after that raises
    ``RuntimeError``. The ring alone is one operator forward and one backward
    (``torch.compile(fullgraph=True)`` keeps it whole); Ulysses and the
    hybrid run their all-to-alls eagerly.

    Raises:
        ImportError: transformers is not installed (the ``hf`` extra).
        ValueError: an unknown ``layout`` or ``"balanced"``, a ``group`` or ``ulysses_group``
            that is not a process group, a ``mesh`` that is not a 1-D or 2-D
            ``("ring", "ulysses")`` ``DeviceMesh``, or ``mesh`` together with
            the groups.
    """
    transformers = import_transformers()
    sp = spread_of(group, ulysses_group, mesh, layout)
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, dilated_attention_forward)
    transformers.masking_utils.AttentionMaskInterface.register(
        ATTN_IMPLEMENTATION, dilated_attention_mask
    )
    set_sequence_parallel(sp)
