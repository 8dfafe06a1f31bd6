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
    """The :class:`RankTime` of every rank."""
    kv_row = 2 * batch * head_dim * itemsize  # one K and one V vector
    grad_row = 2 * batch * head_dim * acc_bytes(itemsize)
    f_pair = FWD_FLOPS_PER_PAIR * head_dim * batch / rates.forward
    b_pair = BWD_FLOPS_PER_PAIR * head_dim * batch / rates.backward
    out = []
    for j in range(tr.world_size):
        steps = tr.steps(j)
        send = [int(tr.send_rows[j, d]) for d in steps]
        recv = [int(tr.recv_rows[j, d]) for d in steps]
        pairs = [int(tr.step_pairs[j, d]) for d in steps]
        local = int(tr.local_pairs[j])
        x = [link.seconds(kv_row * max(s, r)) for s, r in zip(send, recv, strict=True)] + [0.0]
        g = [0.0] + [link.seconds(grad_row * max(s, r)) for s, r in zip(send, recv, strict=True)]
        c = [p * f_pair for p in pairs]
        b = [p * b_pair for p in pairs]
        fwd = max(local * f_pair, x[0]) + sum(max(c[k], x[k + 1]) for k in range(len(steps)))
        bwd = (
            max(local * b_pair, x[0])
            + sum(max(b[k], x[k + 1] + g[k]) for k in range(len(steps)))
            + g[-1]
        )
        cf = (local + sum(pairs)) * f_pair
        cb = (local + sum(pairs)) * b_pair
        out.append(RankTime(j, fwd, fwd + bwd, cf, cf + cb, len(steps)))
    return out
