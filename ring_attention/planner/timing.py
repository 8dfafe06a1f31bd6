"""Predicted time per attention layer, from the ring's schedule.

The model (docs/design.md §4.3-§4.4), per rank, over its active steps
``d_1 < d_2 < ... < d_m``:

* compute of a step = its reached pairs x FLOPs per pair / kernel rate
  (``4 d`` per pair forward at the forward rate, ``10 d`` backward at the
  backward rate of :class:`~.throughput.Rates`); ``c_0`` = the pairs among
  the rank's own pieces;
* a transfer = latency + max(bytes sent, bytes received) / link bandwidth
  (a step's send and receive run at once on a full-duplex link);
* forward: K/V of step ``k+1`` travel while step ``k`` is computed (and
  step 1 while the local pairs are), so

      T_fwd = max(c_0, x_1) + sum_k max(c_k, x_{k+1})          (x_{m+1} = 0)

* backward: K/V are exchanged again in the same way and the dK/dV of step
  ``k-1`` go back during the compute of step ``k`` on the same link, the last
  return after the last compute:

      T_bwd = max(b_0, x_1) + sum_k max(b_k, x_{k+1} + g_{k-1}) + g_m

The layer takes as long as its slowest rank (the ring waits for it). Not
modelled: packing and unpacking copies, waiting for a late peer beyond the
slowest rank, kernel launch overheads, contention between links.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .memory import acc_bytes
from .pairs import BWD_FLOPS_PER_PAIR, FWD_FLOPS_PER_PAIR
from .throughput import Rates
from .traffic import Traffic

__all__ = ["Link", "RankTime", "layer_times"]


@dataclass(frozen=True)
class Link:
    """A rank's link: ``gbps`` gigabits per second each way, ``latency_us``
    per transfer."""

    gbps: float
    latency_us: float

    def seconds(self, nbytes: int) -> float:
        """Time of one transfer of ``nbytes`` (0 for nothing)."""
        return 0.0 if nbytes <= 0 else self.latency_us * 1e-6 + 8 * nbytes / (self.gbps * 1e9)


@dataclass(frozen=True)
class RankTime:
    """Predicted seconds of one rank for one layer.

    Attributes:
        rank: the rank.
        forward: forward time.
        forward_backward: forward + backward time.
        compute_forward, compute_forward_backward: the kernel time alone.
        steps: active ring steps.
    """

    rank: int
    forward: float
    forward_backward: float
    compute_forward: float
    compute_forward_backward: float
    steps: int

    @property
    def exposed_forward(self) -> float:
        """Forward communication not hidden behind compute."""
        return self.forward - self.compute_forward

    @property
    def exposed_forward_backward(self) -> float:
        """Forward + backward communication not hidden behind compute."""
        return self.forward_backward - self.compute_forward_backward


def layer_times(
    tr: Traffic, batch: int, head_dim: int, itemsize: int, rates: Rates, link: Link
) -> list[RankTime]:
    """The :class:`RankTime` of every rank (all ranks at once: ``(p, p)``
    tensors by distance, inactive steps skipped by looking up each active
    step's next and previous active step)."""
    p = tr.world_size
    act = tr.active
    f_pair = FWD_FLOPS_PER_PAIR * head_dim * batch / rates.forward
    b_pair = BWD_FLOPS_PER_PAIR * head_dim * batch / rates.backward
    rows = torch.maximum(tr.send_rows, tr.recv_rows).double()

    def transfer(nbytes: torch.Tensor) -> torch.Tensor:
        t = link.latency_us * 1e-6 + 8 * nbytes / (link.gbps * 1e9)
        return torch.where(act & (nbytes > 0), t, 0.0)

    x = transfer(rows * 2 * batch * head_dim * itemsize)  # K/V of a step
    g = transfer(rows * 2 * batch * head_dim * acc_bytes(itemsize))  # its dK/dV
    c = tr.step_pairs.double() * f_pair
    b = tr.step_pairs.double() * b_pair
    c0 = tr.local_pairs.double() * f_pair
    b0 = tr.local_pairs.double() * b_pair
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
    pairs = (tr.local_pairs + tr.step_pairs.sum(1)).double()
    cf, cb = pairs * f_pair, pairs * b_pair
    steps = act.sum(1)
    return [
        RankTime(
            j,
            float(fwd[j]),
            float(fwd[j] + bwd[j]),
            float(cf[j]),
            float(cf[j] + cb[j]),
            int(steps[j]),
        )
        for j in range(p)
    ]
