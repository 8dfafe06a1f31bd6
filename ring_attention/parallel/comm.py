"""Process-group helpers: a group's global ranks and the device a tensor
travels on for its backend."""

import types

import torch
import torch.distributed as dist


def _unpin_default_group() -> None:
    """Drop the default group that ``torch.distributed.nn.functional`` holds."""
    if not dist.is_available():
        return
    import torch.distributed.nn.functional as functional

    for fn in vars(functional).values():
        if isinstance(fn, types.FunctionType) and fn.__defaults__:
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d
                                    for d in fn.__defaults__)  # fmt: skip


_unpin_default_group()


def global_ranks(group: dist.ProcessGroup | None, world: int) -> tuple[int, ...]:
    """The global rank of every rank of ``group`` (group-rank order)."""
    if world == 1 and not dist.is_initialized():
        return (0,)
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(world))
    return tuple(dist.get_global_rank(group, r) for r in range(world))


def comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """The device a tensor living on ``device`` is sent from/received into
    (``ValueError`` for a CPU tensor on an NCCL-only group)."""
    backend = str(dist.get_backend(group)).lower()  # e.g. "cpu:gloo,cuda:nccl"
    if device.type == "cuda":
        return device if "nccl" in backend else torch.device("cpu")
    if device.type == "cpu":
        if "nccl" in backend and "gloo" not in backend and "mpi" not in backend:
            raise ValueError(f"CPU tensors cannot travel over a {backend!r} process group; "
                             "use a gloo group (or move the tensors to the GPU)")  # fmt: skip
        return device
    raise ValueError(f"tensors on {device.type!r} are not supported by the ring transport")
