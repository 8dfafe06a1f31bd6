"""The boundary between Python and the C++ operators (docs/design.md §2.5, §8): the operator
calls, their pattern arguments (:class:`OpArgs`), the local operator's registered autograd,
:class:`Attention` (the per-branch path's autograd) and the ring's operators with
:class:`RingFunction`. Nothing outside ring_attention/local/ imports it."""

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .. import _C  # noqa: F401  (loads the extension: registers torch.ops.ring_attention)

Tensor = torch.Tensor
_OPS = torch.ops.ring_attention

DOUBLE_BACKWARD_ERROR = (
    "ring_attention: double backward is not supported (the gradients of q, k, v are not "
    "differentiable)"
)


class OpArgs(NamedTuple):
    """The pattern arguments of the attention operators, in schema order
    (``RA_PATTERN_ARGS`` in ``csrc/schemas.h``)."""

    segment_lengths: list[int]
    dilation_rates: list[int]
    causal: bool
    scale: float
    head_groups: bool
    grouped_offsets: bool
    key_padding_mask: Tensor | None
    cu_seqlens: Tensor | None
    window_left: int
    window_right: int
    head_start: int = 0
    total_heads: int = 0
    total_kv_heads: int = 0


def op_args(call: Any, device: torch.device | str) -> OpArgs:
    """The operators' pattern arguments of a checked ``call`` (documents as an int64 tensor on
    ``device``). Typed loosely: ops.py imports nothing of the package."""
    pattern = call.pattern
    return OpArgs(
        list(pattern.segment_lengths),
        list(pattern.dilation_rates),
        pattern.causal,
        float(call.scale),
        pattern.head_groups,
        pattern.head_offsets == "grouped",
        call.key_padding_mask,
        pattern.documents_tensor(device) if call.documents is None else call.documents,
        *pattern.window,
        call.head_start,
        call.total_heads,
        call.total_kv_heads,
    )


class Rows(NamedTuple):
    """The local operator's rows (``RA_ROWS_ARGS``): queries at ``q_start`` (or ``q_starts[b]``),
    keys at ``k_start``."""

    q_start: int = 0
    k_start: int = 0
    q_starts: Tensor | None = None


#: One sequence from position 0.
WHOLE = Rows()

# The operator calls.


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, args: OpArgs, rows: Rows = WHOLE
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the local operator, both differentiable."""
    return _OPS.dilated_attention(q, k, v, *args, *rows)


def local_attention_backward(
    grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, args: OpArgs, rows: Rows = WHOLE,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dv)`` of the local operator, from its final ``out`` and ``lse``."""
    return _OPS.dilated_attention_backward(grad_out, grad_lse, q, k, v, out, lse, *args, *rows)


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_start: int, k_start: int,
    args: OpArgs, k_rows: Tensor | None = None,
) -> None:  # fmt: skip
    """Merge the block (queries at ``q_start``, keys at ``k_start``) into ``out``/``lse``;
    ``k_rows``: the int32 row map of packed K/V rows, or ``None``."""
    _OPS.block_forward(q, k, v, out, lse, int(q_start), int(k_start), *args, k_rows=k_rows)


def block_backward(
    grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None, q_start: int,
    k_start: int, args: OpArgs, k_rows: Tensor | None = None,
) -> None:  # fmt: skip
    """Accumulate the block's gradients into ``dq``/``dk``/``dv`` (``k_rows`` as for
    :func:`block_forward`)."""
    _OPS.block_backward(
        grad_out, grad_lse, q, k, v, out, lse, dq, dk, dv, int(q_start), int(k_start), *args,
        k_rows=k_rows,
    )  # fmt: skip


def merge_branches(
    parts: Tensor, part_lse: Tensor, index: Tensor, out: Tensor, lse: Tensor,
    first_in_out: bool = False,
) -> None:  # fmt: skip
    """Write ``out`` and ``lse`` of a span from the per-call ``parts`` merged by log-sum-exp;
    ``first_in_out``: slot 0's parts are in ``out`` already."""
    _OPS.merge_branches(parts, part_lse, index, out, lse, first_in_out)


def sum_branches(parts: Tensor, index: Tensor, grad: Tensor) -> None:
    """Write into ``grad`` the sum of the per-call gradient ``parts`` (``index``
    as for :func:`merge_branches`)."""
    _OPS.sum_branches(parts, index, grad)


def exchange_rows(
    q_starts: Sequence[int], q_lens: Sequence[int], k_start: int, k_len: int, heads: int,
    kv_heads: int, args: OpArgs,
) -> Tensor:  # fmt: skip
    """Sorted flat indices ``row * kv_heads + g`` of the key rows of ``[k_start, k_start +
    k_len)`` some query of the ranges reaches (``csrc/plan.cpp``)."""
    idx = _OPS.exchange_rows(
        [int(s) for s in q_starts], [int(n) for n in q_lens], int(k_start), int(k_len),
        int(heads), int(kv_heads), args.segment_lengths, args.dilation_rates, args.causal,
        args.head_groups, args.grouped_offsets, args.cu_seqlens, args.window_left,
        args.window_right, args.head_start, args.total_heads, args.total_kv_heads,
    )  # fmt: skip
    return idx.to(torch.int64)


# Autograd of the local operator.

_N_ARGS = len(OpArgs._fields)


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args, ctx.rows = OpArgs(*rest[:_N_ARGS]), Rows(*rest[_N_ARGS:])
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None


def _backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    none = (None,) * (len(ctx.args) + len(ctx.rows))
    if grad_out is None and grad_lse is None:
        return (None, None, None, *none)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = local_attention_backward(grad_out, grad_lse, q, k, v, out, lse, ctx.args, ctx.rows)
    return (*grads, *none)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD_ERROR)


torch.library.register_autograd(
    "ring_attention::dilated_attention", _backward, setup_context=_setup_context
)
# The gradients are not differentiable: differentiating them raises (never silent zeros).
torch.library.register_autograd("ring_attention::dilated_attention_backward", _no_double_backward)


# Every other attention's autograd.


class Attention(torch.autograd.Function):
    """The autograd of an attention ``impl`` with ``impl.forward(q, k, v) -> (out, lse)`` and
    ``impl.backward(grad_out, grad_lse, q, k, v, out, lse) -> (dq, dk, dv)`` from the final
    ``out`` and ``lse``: both outputs differentiable, double backward raises."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, impl: Any):  # type: ignore[override]
        out, lse = impl.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.impl = impl
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):  # type: ignore[override]
        if grad_out is None and grad_lse is None:
            return None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grads = ctx.impl.backward(grad_out, grad_lse, q, k, v, out, lse)
        return (*_DoubleBackwardError.guard(grads, q, k, v, grad_out, grad_lse), None)


# The ring's operators (ring_attention/parallel/ring.py) and their autograd.


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, spec: str, needs_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, lse, global length)`` of the ring call registered as ``spec``."""
    return _OPS.ring_forward(q, k, v, documents, spec, needs_grad)


def ring_backward(
    grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, documents: Tensor | None, seq_len: Tensor, spec: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dv)`` of the ring call ``spec`` (its plan is the forward's)."""
    return _OPS.ring_backward(grad_out, grad_lse, q, k, v, out, lse, documents, seq_len, spec)


class RingFunction(torch.autograd.Function):
    """The ring's autograd over :func:`ring_forward` and :func:`ring_backward`; double backward
    raises."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, spec: str,
                needs_grad: bool) -> tuple[Tensor, Tensor]:  # type: ignore[override]  # fmt: skip
        out, lse, seq_len = ring_forward(q, k, v, documents, spec, needs_grad)
        ctx.save_for_backward(q, k, v, out, lse, documents, seq_len)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):  # type: ignore[override]
        q, k, v, out, lse, documents, seq_len = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grads = ring_backward(grad_out, grad_lse, q, k, v, out, lse, documents, seq_len, ctx.spec)
        return (*_DoubleBackwardError.guard(grads, q, k, v, grad_out, grad_lse), None, None, None)


class _DoubleBackwardError(torch.autograd.Function):
    """Passes gradients through; differentiating them raises."""

    @staticmethod
    def guard(grads: tuple, *inputs: Tensor | None) -> tuple:
        """``grads``, under ``create_graph=True`` through an error node hanging off the ``inputs``
        they depend on, so differentiating a gradient with respect to any of them reaches it."""
        if not torch.is_grad_enabled():
            return grads
        return _DoubleBackwardError.apply(len(grads), *grads, *inputs)

    @staticmethod
    def forward(ctx, n: int, *tensors: Tensor | None) -> tuple[Tensor, ...]:  # type: ignore[override]
        """The first ``n`` tensors, passed through."""
        return tuple(g.view_as(g) for g in tensors[:n])

    @staticmethod
    def backward(ctx, *_: Tensor):  # type: ignore[override]
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)
