"""Predicted time per attention layer of every rank, from the ring's schedule
(the formulas: docs/planner.md)."""

from dataclasses import dataclass
from typing import Any

import torch

from ..core.links import Link
from ..core.pairs import BWD_FLOPS_PER_PAIR, FWD_FLOPS_PER_PAIR
from .throughput import Rates, acc_bytes


@dataclass(frozen=True)
class RankTime:
    """Predicted seconds of one rank for one layer (``compute_*``: the
    kernel time alone)."""

    rank: int
    forward: float
    forward_backward: float
    compute_forward: float
    compute_forward_backward: float
    steps: int  # active ring steps (near steps with a far group)
    far_messages: int = 0  # its transfers in the far group of a pass (sent or received, more)

    @property
    def exposed_forward(self) -> float:
        """Forward communication not hidden behind compute."""
        return self.forward - self.compute_forward

    @property
    def exposed_forward_backward(self) -> float:
        """Forward + backward communication not hidden behind compute."""
        return self.forward_backward - self.compute_forward_backward


def _ring(
    act: torch.Tensor, x: torch.Tensor, g: torch.Tensor, c: torch.Tensor, b: torch.Tensor,
    c0: torch.Tensor, b0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(T_fwd, T_bwd)`` per rank of the ring over the active steps ``act``."""
    p = act.shape[0]
    cols = torch.arange(p)
    none = torch.zeros(p, 1, dtype=torch.float64)
    # the next active step after d (p: none) and the previous one (-1: none)
    nxt = torch.where(act, cols, p).flip(1).cummin(1).values.flip(1)
    nxt = torch.cat([nxt[:, 1:], torch.full((p, 1), p)], 1)
    prv = torch.where(act, cols, -1).cummax(1).values
    prv = torch.cat([torch.full((p, 1), -1), prv[:, :-1]], 1)
    x_pad, g_pad = torch.cat([x, none], 1), torch.cat([none, g], 1)
    x_next = torch.gather(x_pad, 1, nxt)
    g_prev = torch.gather(g_pad, 1, prv + 1)
    first = torch.where(act, cols, p).min(1).values
    last = torch.where(act, cols, -1).max(1).values
    x_first = torch.gather(x_pad, 1, first[:, None])[:, 0]
    g_last = torch.gather(g_pad, 1, (last + 1)[:, None])[:, 0]
    fwd = torch.maximum(c0, x_first) + torch.where(act, torch.maximum(c, x_next), 0.0).sum(1)
    bwd = (
        torch.maximum(b0, x_first)
        + torch.where(act, torch.maximum(b, x_next + g_prev), 0.0).sum(1)
        + g_last
    )
    return fwd, bwd


def layer_times(
    tr: Any, batch: int, head_dim: int, itemsize: int, rates: Rates, link: Link,
    far_bytes: int = 0, groups: int = 1,
) -> list[RankTime]:  # fmt: skip
    """The :class:`RankTime` of every rank from the ring's schedule and the
    far group; ``tr``: a :class:`~.traffic.Traffic`; ``groups``: the backward's head groups,
    one ring pass each on its share of the rows and pairs."""
    f_pair = FWD_FLOPS_PER_PAIR * head_dim * batch / rates.forward
    b_pair = BWD_FLOPS_PER_PAIR * head_dim * batch / rates.backward
    kv_row = 2 * batch * head_dim * itemsize  # bytes of a (row, K/V head): K and V
    grad_row = 2 * batch * head_dim * acc_bytes(itemsize)
    send, recv, far_s, far_r = tr.far(kv_row, far_bytes)
    act = (send > 0) | (recv > 0)
    wire = 8 / (link.gbps * 1e9)
    # the far group: one batch each way per pass
    m = torch.maximum(far_s.sum(1), far_r.sum(1))
    far_sent, far_received = (tr.send_rows - send).sum(1), (tr.recv_rows - recv).sum(1)
    far_rows = torch.maximum(far_sent, far_received).double()
    far_latency = (link.latency_us + link.message_us * m.double()) * 1e-6
    # bytes each way after the far blocks: the near K/V after the first near step (posted at
    # the start), the near dK/dV; then the far dK/dV
    later = act & (torch.arange(act.shape[1]) > act.long().argmax(1)[:, None])
    near_out = (torch.where(later, send, 0) * kv_row + recv * grad_row).sum(1)
    near_in = (torch.where(later, recv, 0) * kv_row + send * grad_row).sum(1)
    far_out, far_in = far_received * grad_row, far_sent * grad_row

    def schedule(share: float, prev: torch.Tensor | float = 0.0, defer: bool = False) -> tuple:
        """``(T_fwd, T_bwd, X_G)`` of a pass over ``share`` of the heads; ``prev``: the previous
        group's far dK/dV, travelling behind these local blocks; ``defer``: this one's too."""
        rows = torch.maximum(send, recv).double() * share

        def transfer(nbytes: torch.Tensor) -> torch.Tensor:
            return torch.where(act & (nbytes > 0), link.latency_us * 1e-6 + nbytes * wire, 0.0)

        x = transfer(rows * kv_row)  # K/V of a near step
        g = transfer(rows * grad_row)  # its dK/dV
        pairs = tr.step_pairs.double() * share
        c = torch.where(far_r, 0.0, pairs) * f_pair
        b = torch.where(far_r, 0.0, pairs) * b_pair
        c0 = tr.local_pairs.double() * share * f_pair
        b0 = tr.local_pairs.double() * share * b_pair
        far_pairs = torch.where(far_r, pairs, 0.0).sum(1)

        def batch_time(row_bytes: int) -> torch.Tensor:
            return torch.where(m > 0, far_latency + far_rows * share * row_bytes * wire, 0.0)

        x_far, g_far = batch_time(kv_row), batch_time(grad_row)
        x_in = x_far + prev  # the previous group's far dK/dV share the link with this K/V
        c0_far = torch.maximum(c0, x_far) + far_pairs * f_pair
        b0_far = torch.maximum(b0, x_in) + far_pairs * b_pair
        fwd, bwd = _ring(act, x, g, c, b, c0_far, b0_far)
        w_fwd = (rows * kv_row * wire).sum(1)
        w_bwd = w_fwd + (rows * grad_row * wire).sum(1)
        fwd = torch.maximum(fwd, torch.where(m > 0, x_far + w_fwd, 0.0))
        # after the far blocks the far dK/dV (unless deferred) and every near transfer still
        # to go share the link, each way
        far = 0 if defer else 1
        late = torch.maximum(near_out + far * far_out, near_in + far * far_in).double()
        after = torch.maximum(g_far * far, link.latency_us * 1e-6 + late * share * wire)
        bwd = torch.maximum(bwd, torch.where(m > 0, b0_far + after, 0.0))
        bwd = torch.maximum(bwd, torch.where(m > 0, x_in + g_far * far + w_bwd, 0.0))
        return fwd, bwd, g_far

    fwd, bwd, _ = schedule(1.0)
    if groups > 1:  # a group's far dK/dV travel behind the next group's local blocks
        first, g_far = schedule(1 / groups, defer=True)[1:]
        mid, last = schedule(1 / groups, g_far, True)[1], schedule(1 / groups, g_far)[1]
        bwd = first + (groups - 2) * mid + last
    total = (tr.local_pairs + tr.step_pairs.sum(1)).double()
    cf, cb = total * f_pair, total * b_pair
    steps = act.sum(1)
    return [
        RankTime(j, float(fwd[j]), float(fwd[j] + bwd[j]), float(cf[j]), float(cf[j] + cb[j]),
                 int(steps[j]), int(m[j]))
        for j in range(tr.world_size)
    ]  # fmt: skip
