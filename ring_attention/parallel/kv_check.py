"""The ring's K/V finiteness check, once a pass: each rank's own pieces, the ranks' flags met in
one all-reduce posted without waiting, read on the host at the pass's end (docs/design.md §5,
the ring's per-step blocks: why, and the pass rerun where it says non-finite)."""

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..local.backends import HostFlag, kv_flag
from ..local.dispatch import block_shape, may_be_dense
from .comm import comm_device

_SIDE: dict[torch.device, torch.cuda.Stream] = {}  # per CUDA device: the flag's copy stream


class PassCheck:
    """The K/V check of one ring pass over this rank's pieces ``ks``, ``vs``, agreed over ``group``
    (``world`` ranks; 1: this rank's alone); queued on construction, read by :meth:`finite`."""

    def __init__(self, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                 group: dist.ProcessGroup | None, world: int) -> None:  # fmt: skip
        flag = kv_flag(ks[0], vs[0])
        for k, v in zip(ks[1:], vs[1:], strict=True):
            flag = flag & kv_flag(k, v)
        self._work = self._host = None
        if world == 1:
            self._host = HostFlag(flag)
            return
        # (CUDA over gloo: this copy waits for the check; the K/V transfers go through the host)
        self._flag = flag.to(comm_device(group, flag.device), torch.int32)
        work = dist.all_reduce(self._flag, dist.ReduceOp.MIN, group=group, async_op=True)
        if self._flag.device.type != "cuda":
            self._work = work
            return
        dev = self._flag.device
        side = _SIDE.get(dev) or _SIDE.setdefault(dev, torch.cuda.Stream(dev))
        with torch.cuda.stream(side):  # the pass's stream never waits for the all-reduce
            work.wait()
            self._host = HostFlag(self._flag)  # (self._flag kept alive until read)

    def finite(self) -> bool:
        """Whether every rank's K/V pieces are finite (the pass's one host read)."""
        if self._work is not None:
            self._work.wait()
            self._work, self._host = None, HostFlag(self._flag)
        return bool(self._host)


def pass_check(ring, pass_: str, blocks, q: torch.Tensor, ks: Sequence[torch.Tensor],
               vs: Sequence[torch.Tensor],
               bounds: tuple[int, ...]) -> PassCheck | None:  # fmt: skip
    """The one check of a pass of the ``RingCall`` ``ring`` with ``Blocks`` ``blocks`` (``bounds``:
    where every rank's pieces start and end), ``None`` where no block is dense; every rank checks
    where received blocks may be dense."""
    plan, call = ring.plan, ring.call
    if not call.every_head:  # (no dense block)
        return None
    shape = block_shape(call.pattern, plan.seq_len, bounds)[0]
    if plan.world_size > 1 and shape in ("dense", "dilated"):
        dense = may_be_dense(pass_, q.dtype, q.shape[3], plan.seq_len, shape)
        return PassCheck(ks, vs, ring.group, plan.world_size) if dense else None
    own = not plan.steps and blocks.dense is not None  # this rank's own pieces alone
    return PassCheck(ks, vs, None, 1) if own else None
