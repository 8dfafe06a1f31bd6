"""Dense attention backends behind one interface, for the per-branch path
(ring_attention/local/branches.py): each call is an ordinary dense attention
(causal or not) on strided views, grouped K/V heads as FlashAttention takes
them (query head ``i`` reads K/V head ``i // (hq // hk)``).

Interface (every tensor a view; stride 1 along the head dim):

* ``forward(q, k, v, causal, scale, out, lse)``: ``q`` ``(N, L, hq, d)``,
  ``k``, ``v`` ``(N, Lk, hk, d)`` (``Lk == L`` where ``causal``); writes
  ``out`` ``(N, hq, L, d)`` (q's dtype) and ``lse`` ``(N, hq, L)`` (float32,
  float64 for float64), the caller's part buffers: in place where the
  backend takes output buffers, else copied.
* ``backward(do, q, k, v, out, lse, causal, scale, dq, dk, dv)``: the
  gradients of the call given the *merged* ``out`` and ``lse`` of its rows
  (``do``, ``out`` like ``q``; ``lse`` ``(N, hq, L)``): with them the
  call's ``P = exp(S - lse)`` is the multiset softmax's probability and its
  ``D = rowsum(dO * out)`` the merged one, so the branches' gradients add up
  exactly. Writes ``dq`` ``(N, hq, L, d)`` and ``dk``, ``dv`` ``(N, hk, Lk,
  d)``.

Backends: ``cpu`` (PyTorch's CPU flash attention: the stand-in that runs the
whole path on the CPU, against the float64 oracle in the tests), ``flash``
(PyTorch's FlashAttention-2 on CUDA), ``cudnn`` (cuDNN through ATen, forward
and backward, no new dependency) and ``fa4`` (flash-attn-4,
``flash_attn.cute``, where it imports). Which one a call takes is
ring_attention/local/dispatch.py's table; :func:`fa4_missing` and
:func:`cudnn_missing` say why the optional ones cannot run here.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.cache import cached

__all__ = ["BACKENDS", "KvFinite", "aligned", "backend", "cudnn_missing", "fa4_missing"]

aten = torch.ops.aten


def _t(x: torch.Tensor) -> torch.Tensor:
    """``(N, L, h, d)`` <-> ``(N, h, L, d)`` (a view)."""
    return x.transpose(1, 2)


class CpuFlash:
    """PyTorch's CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``
    and its backward): strided inputs, grouped K/V heads, an explicit LSE."""

    name = "cpu"

    @staticmethod
    def forward(q, k, v, causal, scale, out, lse) -> None:
        o, lse_ = aten._scaled_dot_product_flash_attention_for_cpu(
            _t(q), _t(k), _t(v), 0.0, causal, scale=scale
        )
        out.copy_(o)
        lse.copy_(lse_)

    @staticmethod
    def backward(do, q, k, v, out, lse, causal, scale, dq, dk, dv) -> None:
        gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _t(do), _t(q), _t(k), _t(v), _t(out), lse, 0.0, causal, scale=scale
        )
        dq.copy_(gq)
        dk.copy_(gk)
        dv.copy_(gv)


@cached("flash backward arguments")
def _flash_side(device: str, dtype: torch.dtype, d: int) -> tuple[Any, ...]:
    """What the flash backward takes from its forward besides out and lse
    (sequence offsets, RNG state): with no dropout and no nesting they do not
    depend on the shapes, so one tiny forward per (device, dtype, head_dim)."""
    x = torch.zeros(1, 1, 8, d, dtype=dtype, device=device)
    res = aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
    return res[2], res[3], res[6], res[7]


class AtenFlash:
    """PyTorch's FlashAttention-2 (``_scaled_dot_product_flash_attention``
    and its backward); its outputs are copied into the part buffers."""

    name = "flash"

    @staticmethod
    def forward(q, k, v, causal, scale, out, lse) -> None:
        res = aten._scaled_dot_product_flash_attention(
            _t(q), _t(k), _t(v), 0.0, causal, False, scale=scale
        )
        out.copy_(res[0])
        lse.copy_(res[1])

    @staticmethod
    def backward(do, q, k, v, out, lse, causal, scale, dq, dk, dv) -> None:
        cq, ck, rng, unused = _flash_side(str(q.device), q.dtype, q.shape[-1])
        lq, lk = q.shape[1], k.shape[1]
        gq, gk, gv = aten._scaled_dot_product_flash_attention_backward(
            _t(do), _t(q), _t(k), _t(v), _t(out), lse.float().contiguous(), cq, ck, lq, lk,
            0.0, causal, rng, unused, scale=scale,
        )  # fmt: skip
        dq.copy_(gq)
        dk.copy_(gk)
        dv.copy_(gv)


#: The oldest cuDNN whose attention graphs ATen's cuDNN backend builds
#: forward and backward (9.0; the GPU runs had 9.19).
CUDNN_MIN_VERSION = 90000


def cudnn_missing() -> str | None:
    """Why cuDNN attention through ATen cannot run here (None when it can):
    PyTorch built without cuDNN, cuDNN turned off (``torch.backends.cudnn
    .enabled``, read on every call: it can change), or older than
    :data:`CUDNN_MIN_VERSION`."""
    if not torch.backends.cudnn.is_available():
        return "torch.backends.cudnn is not available (PyTorch built without cuDNN)"
    if not torch.backends.cudnn.enabled:
        return "torch.backends.cudnn.enabled is False"
    version = torch.backends.cudnn.version() or 0
    if version < CUDNN_MIN_VERSION:
        return f"cuDNN {version} older than {CUDNN_MIN_VERSION}"
    return None


@cached("cudnn backward arguments")
def _cudnn_side(device: str, dtype: torch.dtype, d: int) -> tuple[int, Any, Any]:
    """What the cuDNN backward takes from its forward besides out and lse:
    the rank of the forward's logsumexp (the backward takes it in the same
    form, as autograd hands it over) and the philox seed and offset tensors
    (unread with no dropout, but ``.to``-converted on some GPUs, so they
    must be the forward's). Shape-independent: one tiny forward per
    (device, dtype, head_dim)."""
    x = torch.zeros(1, 1, 128, d, dtype=dtype, device=device)
    res = aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)
    return res[1].dim(), res[6], res[7]


class AtenCudnn:
    """cuDNN attention through ATen (``_scaled_dot_product_cudnn_attention``
    and its backward, equal query and K/V heads); its outputs are copied
    into the part buffers. The backward's arguments follow ATen's schema
    (torch 2.13): no bias, no cumulative lengths (``None``: the dense path),
    ``max_q``/``max_k`` the call's rows, the forward's philox tensors, and
    the logsumexp as the forward returns it, ``(N, h, L, 1)`` float32, laid
    out ``(N, L, h)`` in memory: cuDNN reads it through its strides, and in
    its ragged mode (q, k, v in this ``(N, L, h, d)`` memory order) offsets
    each batch entry by ``L * stride(-2)``, which only this layout satisfies
    for every mode."""

    name = "cudnn"

    @staticmethod
    def forward(q, k, v, causal, scale, out, lse) -> None:
        res = aten._scaled_dot_product_cudnn_attention(
            _t(q), _t(k), _t(v), None, True, 0.0, causal, False, scale=scale
        )
        out.copy_(res[0])
        lse.copy_(res[1].reshape(lse.shape))

    @staticmethod
    def backward(do, q, k, v, out, lse, causal, scale, dq, dk, dv) -> None:
        rank, seed, offset = _cudnn_side(str(q.device), q.dtype, q.shape[-1])
        n, lq, h, _ = q.shape
        stats = torch.empty(n, lq, h, dtype=torch.float32, device=q.device).transpose(1, 2)
        stats.copy_(lse)
        if rank == 4:
            stats = stats.unsqueeze(-1)
        gq, gk, gv = aten._scaled_dot_product_cudnn_attention_backward(
            _t(do), _t(q), _t(k), _t(v), _t(out), stats, seed, offset, None, None, None,
            lq, k.shape[1], 0.0, causal, scale=scale,
        )  # fmt: skip
        dq.copy_(gq)
        dk.copy_(gk)
        dv.copy_(gv)


def fa4_interface() -> Any:
    """flash-attn-4's ``flash_attn.cute.interface`` (ImportError where it is
    not installed)."""
    from flash_attn.cute import interface

    return interface


@cached("flash-attn-4 import")
def fa4_missing() -> str | None:
    """Why flash-attn-4 does not import here (None when it does)."""
    try:
        fa4_interface()
    except Exception as exc:  # ImportError, or a broken install of its CUDA libraries
        return f"{type(exc).__name__}: {exc}"
    return None


class KvFinite:
    """Whether K and V hold no NaN and no infinity, asked without waiting for
    the device: the constructor queues the check (their sums, accumulated in
    fp32, fp64 for fp64, without a temporary, are NaN or infinite when an
    element is) and, on CUDA, a non-blocking copy of its answer to pinned host
    memory and an event after it; ``bool()`` reads it, waiting at most for
    that event, which the device passes before any work queued after the
    check. The dense paths queue their calls first and read it after, so the
    read never drains the queue: the host has stayed ahead of the device by
    then. A sum of finite values beyond fp32's range (about 3e38) reads as
    non-finite too, which only sends the call to our kernels; the dense
    backends cannot exclude non-finite keys (they multiply the zero weights
    of masked keys by their values)."""

    __slots__ = ("_event", "_flag", "_value")

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        acc = torch.float64 if k.dtype == torch.float64 else torch.float32
        flag = torch.isfinite(torch.stack([k.sum(dtype=acc), v.sum(dtype=acc)])).all()
        self._event = None
        self._value: bool | None = None
        if flag.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            flag = host
        self._flag = flag

    @property
    def known(self) -> bool | None:
        """The answer where it was read already, else None (no wait)."""
        return self._value

    def __bool__(self) -> bool:
        if self._value is None:
            if self._event is not None:
                self._event.synchronize()
            self._value = bool(self._flag)
        return self._value


class FlashAttn4:
    """flash-attn-4 (``flash_attn.cute``, CuTe DSL; Hopper and Blackwell): it
    takes strided ``(N, L, h, d)`` views and writes into the caller's ``out``,
    ``lse``, ``dq``, ``dk`` and ``dv``."""

    name = "fa4"

    @staticmethod
    def forward(q, k, v, causal, scale, out, lse) -> None:
        fa4_interface()._flash_attn_fwd(
            q, k, v, softmax_scale=scale, causal=causal, return_lse=True, out=_t(out), lse=lse
        )

    @staticmethod
    def backward(do, q, k, v, out, lse, causal, scale, dq, dk, dv) -> None:
        # lse as it is: the part buffers' views are aligned (strided, no copy)
        fa4_interface()._flash_attn_bwd(
            q, k, v, out, do, lse.float(), softmax_scale=scale, causal=causal,
            dq=_t(dq), dk=_t(dk), dv=_t(dv),
        )  # fmt: skip


BACKENDS = {b.name: b for b in (FlashAttn4(), AtenCudnn(), AtenFlash(), CpuFlash())}


def backend(name: str):
    """The backend called ``name`` (:data:`BACKENDS`)."""
    return BACKENDS[name]


def aligned(t: torch.Tensor) -> bool:
    """Whether the dense CUDA backends take ``t`` without a copy (flash-attn-4
    silently copies anything else): its start 16-byte aligned (its storage
    offset: storages start aligned), and it contiguous or its strides, but
    the last and those of dimensions of one, multiples of 8 elements. The
    views of the per-branch calls of aligned q, k, v are too (their offsets
    and strides are sums of multiples of the tensor's), and so are the
    calls' part buffers (ring_attention/local/spans.py)."""
    if t.storage_offset() * t.element_size() % 16:
        return False
    if t.is_contiguous():
        return True
    return all(s % 8 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1], strict=True) if n > 1)
