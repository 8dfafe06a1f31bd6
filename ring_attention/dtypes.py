"""Dtype policy (DESIGN.md §5)."""

from __future__ import annotations

import torch

__all__ = ["select_dtype", "supported_dtypes"]

_CPU_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_CUDA_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def select_dtype(device: torch.device | str | int | None = None) -> torch.dtype:
    """The compute dtype to use on ``device``.

    bfloat16 on CUDA compute capability >= 8.0 (Ampere and newer), float16 on
    7.x (Volta, Turing), float32 below 7.0 (Pascal and older) and on the CPU.
    ``None`` means the current CUDA device when CUDA is available, else the CPU.
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    else:
        device = torch.device(device)
    if device.type != "cuda":
        return torch.float32
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 8:
        return torch.bfloat16
    if major == 7:
        return torch.float16
    return torch.float32


def supported_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """Input dtypes the kernels accept on ``device``'s type."""
    return _CUDA_DTYPES if device.type == "cuda" else _CPU_DTYPES
