"""Process-group helpers: a group's global ranks and the device a tensor
travels on for the group's backend (NCCL moves CUDA tensors; on gloo, CUDA
tensors are staged through host memory, so several processes can share one
GPU in tests).

Importing this module also releases the default group that PyTorch's
``torch.distributed.nn.functional`` would otherwise keep alive
(:func:`_unpin_default_group`).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

__all__ = ["comm_device", "global_ranks"]


def _unpin_default_group() -> None:
    """Import ``torch.distributed.nn.functional`` now and make its functions'
    default ``group`` ``None`` (the default group, looked up at each call).

    PyTorch evaluates ``group=group.WORLD`` in those signatures when the
    module is first imported. Imported after ``init_process_group`` (as the
    first call of any ``torch.library`` custom operator, the ring's
    included, does through ``torch._dynamo``), the defaults hold the default
    group and ``destroy_process_group`` cannot release it: its gloo threads
    live on into the interpreter's shutdown and abort the process (SIGABRT,
    tests/test_clean_exit.py)."""
    if not dist.is_available():
        return
    import torch.distributed.nn.functional as functional

    for fn in vars(functional).values():
        if not isinstance(fn, types.FunctionType) or not fn.__defaults__:
            continue
        if any(isinstance(d, dist.ProcessGroup) for d in fn.__defaults__):
            fn.__defaults__ = tuple(
                None if isinstance(d, dist.ProcessGroup) else d for d in fn.__defaults__
            )


_unpin_default_group()


def global_ranks(group: dist.ProcessGroup | None, world: int) -> tuple[int, ...]:
    """The global rank of every rank of ``group`` (group-rank order)."""
    if world == 1 and not dist.is_initialized():
        return (0,)
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(world))
    return tuple(dist.get_global_rank(group, r) for r in range(world))


def comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """The device a tensor living on ``device`` is sent from/received into:
    a CUDA tensor travels as it is on NCCL, through host memory otherwise; a
    CPU tensor needs gloo or mpi (``ValueError`` on an NCCL-only group)."""
    backend = str(dist.get_backend(group)).lower()  # e.g. "cpu:gloo,cuda:nccl"
    if device.type == "cuda":
        return device if "nccl" in backend else torch.device("cpu")
    if device.type == "cpu":
        if "nccl" in backend and "gloo" not in backend and "mpi" not in backend:
            raise ValueError(
                f"CPU tensors cannot travel over a {backend!r} process group; "
                "use a gloo group (or move the tensors to the GPU)"
            )
        return device
    raise ValueError(f"tensors on {device.type!r} are not supported by the ring transport")
