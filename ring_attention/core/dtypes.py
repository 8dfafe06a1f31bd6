"""Dtype policy (docs/design.md §5): the compute dtype per device, the accumulation dtype, and the
small integer codes that name a dtype in the ranks' control messages."""

import torch


def select_dtype(device: torch.device | str | int | None = None) -> torch.dtype:
    """The compute dtype on ``device``: bfloat16 on CUDA sm_80+, float16 on 7.x, else float32
    (``None``: the current CUDA device, else the CPU); ``ValueError`` for a non-device."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    else:
        try:
            if isinstance(device, bool):
                raise TypeError("a bool")
            device = (
                torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            )
        except (TypeError, RuntimeError) as e:
            raise ValueError(
                f"device must be a torch.device, a device string or a CUDA index, got {device!r} "
                f"({e})"
            ) from None
    if device.type != "cuda":
        return torch.float32
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {device}: CUDA is not available")
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16 if major == 7 else torch.float32


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of ``dtype``: float64 stays, everything else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)  # fmt: skip
_DTYPE_CODES: dict[torch.dtype, int] = {t: i + 1 for i, t in enumerate(_DTYPES)}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """A small int naming ``dtype`` in control messages (0 for dtypes not listed)."""
    return _DTYPE_CODES.get(dtype, 0)


def dtype_name(code: int) -> str:
    """Inverse of :func:`dtype_code`, for messages."""
    dtype = _CODE_DTYPES.get(int(code))
    return str(dtype) if dtype is not None else f"<dtype code {int(code)}>"
