"""The ring's two custom operators, ``torch.ops.ring_attention.ring_forward``
and ``ring_backward`` (docs/design.md §4): opaque to ``torch.compile`` (they
communicate), with fake kernels; called and differentiated by
:class:`ring_attention.local.ops.RingFunction`. The call's configuration is named
by a :class:`~ring_attention.parallel.ring_spec.RingSpec` key.

Each operator checks its call once, then runs the schedule
(:mod:`ring_attention.parallel.schedule`). The forward's check is a handshake:
one fixed-size control message per rank (local length, batch, heads, K/V
heads, head_dim, dtype, the pattern's digest, scale, layout, grad mode, and
an error flag), so ranks that disagree raise ``ValueError`` on every rank
instead of hanging. The backward takes the forward's plan from the plan
cache.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.cache import PerBatch
from ..core.call import Call
from ..core.checks import check_qkv, check_sinks_meta, resolve_scale
from ..core.config import far_bytes
from ..core.dtypes import acc_dtype
from ..core.layout import resolve_layout
from ..core.pattern import Pattern
from .comm import comm_device, global_ranks, world_info
from .exchange import last_exchange_stats
from .exchange_plan import get_plan
from .handshake import reject, ring_handshake, ring_message
from .mesh import check_ring, report_grid_error
from .ring_spec import GroupError, get_spec
from .schedule import RingCall, schedule_backward, schedule_forward

Tensor = torch.Tensor


_documents = PerBatch("ring documents")


def _with_documents(key: str, base: Pattern, documents: Tensor | None) -> Pattern:
    """The spec's pattern with the documents of ``documents``: the layers of a
    model pass the same tensor, so its boundaries are read (device -> host)
    once per batch, not once per layer and pass."""
    if documents is None:
        return base
    return _documents.get(documents, key, lambda: base.with_documents(documents))


def _call_of(
    key: str, q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, needs_grad: bool,
    n: int | None = None,
) -> RingCall:  # fmt: skip
    """The checked call. Forward (``n`` is None): the ranks agree through the
    handshake on everything, the global length included, and a rank whose
    call fails makes every rank raise. Backward: the forward's ``n``."""
    spec = get_spec(key)
    group = spec.group
    world, rank = world_info(group)
    order = None
    if spec.ranks is not None and world > 1:  # ring indices: a mesh's coordinates
        order = tuple(dist.get_group_rank(group or dist.group.WORLD, r) for r in spec.ranks)
        rank = spec.ranks.index(dist.get_rank())
        if order == tuple(range(world)):
            order = None
    message, pattern, error, far, layout = None, None, spec.error, 0, spec.layout
    if error is None:
        try:
            pattern = _with_documents(key, spec.pattern, documents)
            layout = resolve_layout(spec.layout, pattern)
            heads = spec.head_range if spec.head_range[1] else None
            shape = check_qkv(q, k, v, head_range=heads)
            far = far_bytes(q.device.type)
            pattern.check_heads(shape.heads if heads is None else heads[1])
            check_sinks_meta(spec.sinks, shape.heads, q.device)
            scale = resolve_scale(spec.scale, shape.head_dim)
            if n is None:
                if world > 1:
                    comm_device(group, q.device)  # raises for unsupported transports
                message = ring_message(q, shape.kv_heads, pattern, scale=scale,
                                       layout=layout, needs_grad=needs_grad,
                                       far_bytes=far)  # fmt: skip
        except Exception as exc:  # every rank must hear of it: reported in the handshake
            error = exc
    if n is None:
        if world > 1:
            if isinstance(error, GroupError):  # which ring? the peers must hear of it
                topo = report_grid_error("not a group", None, None, error, "ring")
                if topo is not None:
                    reject(topo.ring_group, "ring_dilated_attention", error, topo.ring_order)
                raise error
            if spec.ranks is None:  # (ranks: a call of the grid's, which checked it)
                check_ring(group)
            n = ring_handshake(group, world, message, pattern, layout, spec.fold, error, order)
        else:
            n = q.shape[1] if error is None else -1
    if error is not None:
        raise error
    pattern.check_length(n)
    plan = get_plan(pattern, n, shape.heads, shape.kv_heads, world, rank, layout, spec.fold,
                    spec.head_range)  # fmt: skip
    return RingCall(
        plan=plan,
        group=group,
        peers=spec.ranks if order is not None else global_ranks(group, world),
        call=Call(pattern, scale).with_heads(*spec.head_range),
        far_bytes=far,
    )


@torch.library.custom_op("ring_attention::ring_forward", mutates_args=())
def _ring_forward_op(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, spec: str, needs_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's ``(out, lse, global length)`` of the ring call ``spec``."""
    call = _call_of(spec, q, k, v, documents, needs_grad)
    last_exchange_stats.reset()
    out, lse = schedule_forward(call, q, k, v)
    return out, lse, torch.tensor(call.plan.seq_len, dtype=torch.int64)


@_ring_forward_op.register_fake
def _(q, k, v, documents, spec, needs_grad):
    B, L, H, _ = q.shape
    lse = q.new_empty((B, H, L), dtype=acc_dtype(q.dtype))
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        lse,
        q.new_empty((), dtype=torch.int64, device="cpu"),
    )


@torch.library.custom_op("ring_attention::ring_backward", mutates_args=())
def _ring_backward_op(
    grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, documents: Tensor | None, seq_len: Tensor, spec: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """This rank's ``(dq, dk, dv)`` of the ring call ``spec`` (its plan is
    the forward's, from the plan cache)."""
    if not isinstance(seq_len, Tensor) or seq_len.dim() != 0 or seq_len.is_floating_point():
        raise ValueError(f"seq_len must be a 0-d integer tensor (the forward's), got {seq_len!r}")
    call = _call_of(spec, q, k, v, documents, True, int(seq_len))
    B, L, H, _ = q.shape
    for name, t, shape in (("grad_out", grad_out, q.shape), ("out", out, q.shape),
                           ("lse", lse, (B, H, L)), ("grad_lse", grad_lse, (B, H, L))):  # fmt: skip
        if (t is not None or name != "grad_lse") and (
            not isinstance(t, Tensor) or tuple(t.shape) != tuple(shape)
        ):
            got = tuple(t.shape) if isinstance(t, Tensor) else t
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {got!r}")
    return schedule_backward(call, grad_out, grad_lse, q, k, v, out, lse)


@_ring_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, documents, seq_len, spec):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
