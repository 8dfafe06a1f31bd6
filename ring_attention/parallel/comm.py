"""Process-group helpers shared by the ring, its handshake and the sharding
functions: who we are in a group, which device a tensor travels on for the
group's backend, and the one small collective that carries control messages.

NCCL moves CUDA tensors directly; gloo moves CPU tensors, and CUDA tensors on
a gloo group are staged through host memory (so several processes can share
one GPU in tests).

Importing this module also releases the default group that PyTorch's
``torch.distributed.nn.functional`` would otherwise keep alive
(:func:`_unpin_default_group`).
"""

from __future__ import annotations

import os
import types

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_ints",
    "backend_name",
    "comm_device",
    "control_device",
    "global_ranks",
    "world_info",
]


def _unpin_default_group() -> None:
    """Import ``torch.distributed.nn.functional`` now and make its functions'
    default ``group`` ``None`` (the default group, looked up at each call).

    PyTorch evaluates ``group=group.WORLD`` in those functions' signatures
    when the module is first imported. Imported after
    ``init_process_group``, as the first call of any ``torch.library``
    custom operator does (it imports ``torch._dynamo``, which imports FSDP,
    which imports this module), the defaults hold the default group, and
    ``destroy_process_group`` cannot release it: its gloo worker threads live
    on into the interpreter's shutdown, where one still releasing a finished
    collective's tensors needs the GIL and aborts the process ("terminate
    called without an active exception", SIGABRT). The ring's operators are
    such custom operators. Imported here, with the package, the defaults are
    ``None`` when no group exists yet, and a group already held is replaced
    by ``None``, which means the same group."""
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


def _launched_world_size() -> int:
    """``WORLD_SIZE`` from the environment (a launcher's, e.g. torchrun's);
    1 when unset or not an integer."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def world_info(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group``; ``(1, 0)`` when torch.distributed is
    unavailable or not initialised and ``group`` is None.

    Raises ``RuntimeError`` when ``group`` is None, torch.distributed is not
    initialised and the environment says this process is one of several
    (``WORLD_SIZE`` > 1, as torchrun sets): each process would otherwise
    compute the whole sequence alone, silently."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError(
                "group was given but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group first (or pass group=None)"
            )
        launched = _launched_world_size()
        if launched > 1:
            raise RuntimeError(
                f"WORLD_SIZE={launched} is set (a launcher such as torchrun started "
                f"{launched} processes) but torch.distributed is not initialised, so each "
                "process would compute the whole sequence alone: call "
                "torch.distributed.init_process_group first (or unset WORLD_SIZE to run "
                "one process)"
            )
        return 1, 0
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return world, rank


def global_ranks(group: dist.ProcessGroup | None, world: int) -> tuple[int, ...]:
    """The global rank of every rank of ``group`` (group-rank order)."""
    if world == 1 and not dist.is_initialized():
        return (0,)
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(world))
    return tuple(dist.get_global_rank(group, r) for r in range(world))


def backend_name(group: dist.ProcessGroup | None) -> str:
    """The backend string of ``group``, lower case (e.g. ``"gloo"``, ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``)."""
    return str(dist.get_backend(group)).lower()


def comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """The device a tensor living on ``device`` is sent from/received into.

    NCCL moves CUDA tensors directly. A CUDA tensor on a group without NCCL
    (gloo) is staged through host memory. A CPU tensor needs a backend that
    handles CPU tensors (gloo, mpi); an NCCL-only group raises ``ValueError``.
    """
    backend = backend_name(group)
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


def control_device(group: dist.ProcessGroup | None) -> torch.device:
    """Device of the small int64 control messages."""
    backend = backend_name(group)
    if "gloo" in backend or "mpi" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def all_gather_ints(values: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    """All-gather a list of int64 from every rank (one small collective). Every
    rank must pass the same number of values: the library sends only
    fixed-size messages (``ring_attention.parallel.handshake``)."""
    device = control_device(group)
    world = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [t.cpu().tolist() for t in out]
