"""Dense attention backends behind one interface, for the per-branch path (docs/design.md §5):
``cpu`` (PyTorch's CPU flash attention), ``flash`` (FlashAttention-2), ``cudnn`` (cuDNN
through ATen) and ``fa4`` (flash-attn-4).

* ``forward(q, k, v, causal, scale, out, lse)``: ``q`` ``(N, L, hq, d)``, ``k``, ``v``
  ``(N, Lk, hk, d)``; writes ``out`` ``(N, hq, L, d)`` and ``lse`` ``(N, hq, L)``.
* ``backward(do, q, k, v, out, lse, causal, scale, dq, dk, dv)``: the call's gradients
  given the *merged* ``out`` and ``lse``; writes ``dq`` like ``out``, ``dk``, ``dv``
  ``(N, hk, Lk, d)``."""

from typing import Any

import torch

from ..core.cache import cached

aten = torch.ops.aten


def _t(x: torch.Tensor) -> torch.Tensor:
    """``(N, L, h, d)`` <-> ``(N, h, L, d)`` (a view)."""
    return x.transpose(1, 2)


def _copy(dst: tuple[torch.Tensor, ...], src: tuple[torch.Tensor, ...]) -> None:
    """Copy each of ``src`` into the buffer of ``dst`` at its place."""
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


class CpuFlash:
    """PyTorch's CPU flash attention: strided inputs, grouped K/V heads, an explicit LSE."""

    name = "cpu"

    @staticmethod
    def forward(q, k, v, causal, scale, out, lse) -> None:
        o, lse_ = aten._scaled_dot_product_flash_attention_for_cpu(
            _t(q), _t(k), _t(v), 0.0, causal, scale=scale
        )
        _copy((out, lse), (o, lse_))

    @staticmethod
    def backward(do, q, k, v, out, lse, causal, scale, dq, dk, dv) -> None:
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _t(do), _t(q), _t(k), _t(v), _t(out), lse, 0.0, causal, scale=scale
        )
        _copy((dq, dk, dv), grads)


@cached("flash backward arguments")
def _flash_side(device: str, dtype: torch.dtype, d: int) -> tuple[Any, ...]:
    """The flash backward's shape-independent arguments from a tiny forward (sequence offsets,
    RNG state)."""
    x = torch.zeros(1, 1, 8, d, dtype=dtype, device=device)
    res = aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
    return res[2], res[3], res[6], res[7]


class AtenFlash:
    """PyTorch's FlashAttention-2; its outputs are copied into the part buffers."""

    name = "flash"

    @staticmethod
    def forward(q, k, v, causal, scale, out, lse) -> None:
        res = aten._scaled_dot_product_flash_attention(
            _t(q), _t(k), _t(v), 0.0, causal, False, scale=scale
        )
        _copy((out, lse), res[:2])

    @staticmethod
    def backward(do, q, k, v, out, lse, causal, scale, dq, dk, dv) -> None:
        cq, ck, rng, unused = _flash_side(str(q.device), q.dtype, q.shape[-1])
        lq, lk = q.shape[1], k.shape[1]
        grads = aten._scaled_dot_product_flash_attention_backward(
            _t(do), _t(q), _t(k), _t(v), _t(out), lse.float().contiguous(), cq, ck, lq, lk,
            0.0, causal, rng, unused, scale=scale,
        )  # fmt: skip
        _copy((dq, dk, dv), grads)


#: The oldest cuDNN whose attention graphs ATen's cuDNN backend builds
#: forward and backward (9.0; the GPU runs had 9.19).
CUDNN_MIN_VERSION = 90000


def cudnn_missing() -> str | None:
    """Why cuDNN attention through ATen cannot run here (None when it can)."""
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
    """The cuDNN backward's shape-independent arguments from a tiny forward: the logsumexp's rank
    and the philox seed and offset tensors."""
    x = torch.zeros(1, 1, 128, d, dtype=dtype, device=device)
    res = aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)
    return res[1].dim(), res[6], res[7]


class AtenCudnn:
    """cuDNN attention through ATen (equal query and K/V heads). The backward takes the logsumexp
    as the forward returns it, ``(N, h, L, 1)`` float32 laid out ``(N, L, h)`` in memory: the
    only layout its ragged mode offsets right for every mode."""

    name = "cudnn"

    @staticmethod
    def forward(q, k, v, causal, scale, out, lse) -> None:
        res = aten._scaled_dot_product_cudnn_attention(
            _t(q), _t(k), _t(v), None, True, 0.0, causal, False, scale=scale
        )
        _copy((out, lse), (res[0], res[1].reshape(lse.shape)))

    @staticmethod
    def backward(do, q, k, v, out, lse, causal, scale, dq, dk, dv) -> None:
        rank, seed, offset = _cudnn_side(str(q.device), q.dtype, q.shape[-1])
        n, lq, h, _ = q.shape
        stats = torch.empty(n, lq, h, dtype=torch.float32, device=q.device).transpose(1, 2)
        stats.copy_(lse)
        if rank == 4:
            stats = stats.unsqueeze(-1)
        grads = aten._scaled_dot_product_cudnn_attention_backward(
            _t(do), _t(q), _t(k), _t(v), _t(out), stats, seed, offset, None, None, None,
            lq, k.shape[1], 0.0, causal, scale=scale,
        )  # fmt: skip
        _copy((dq, dk, dv), grads)


def fa4_interface() -> Any:
    """flash-attn-4's ``flash_attn.cute.interface`` (ImportError where missing)."""
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


def kv_flag(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on K's device: whether K and V hold no NaN and no infinity (queued, not
    read). A finite sum beyond fp32's range reads as non-finite (the call then takes our
    kernels)."""
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    return torch.isfinite(torch.stack([k.sum(dtype=acc), v.sum(dtype=acc)])).all()


class HostFlag:
    """A device flag read on the host without waiting for the device's later work: the
    constructor queues (on CUDA: on the current stream) a copy to pinned memory and an event,
    ``bool()`` reads it, waiting at most for that event."""

    __slots__ = ("_event", "_flag", "_value")

    def __init__(self, flag: torch.Tensor) -> None:
        self._event = None
        self._value: bool | None = None
        if flag.device.type == "cuda":
            host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
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


class KvFinite(HostFlag):
    """Whether K and V hold no NaN and no infinity (:func:`kv_flag`), asked without waiting for
    the device's later work (:class:`HostFlag`)."""

    __slots__ = ()

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__(kv_flag(k, v))


class FlashAttn4:
    """flash-attn-4 (``flash_attn.cute``): strided views, writes into the caller's buffers."""

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
    """Whether the dense CUDA backends take ``t`` without a copy: start 16-byte aligned, and
    contiguous or strides (but the last) multiples of 8 elements."""
    strides = (s for s, n in zip(t.stride()[:-1], t.shape[:-1], strict=True) if n > 1)
    return t.storage_offset() * t.element_size() % 16 == 0 and (
        t.is_contiguous() or all(s % 8 == 0 for s in strides)
    )
