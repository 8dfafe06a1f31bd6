"""The links the package assumes between ranks when nothing measured is
given: the planner's defaults, and what ``RING_ATTENTION_FAR_BYTES=auto``
takes latency x bandwidth of (ring_attention/core/config.py)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A rank's link: ``gbps`` each way, ``latency_us`` per transfer, ``message_us`` per further
    message of a batch."""

    gbps: float
    latency_us: float
    message_us: float = 1.0

    def seconds(self, nbytes: int) -> float:
        """Time of one transfer of ``nbytes`` (0 for nothing)."""
        return 0.0 if nbytes <= 0 else self.latency_us * 1e-6 + 8 * nbytes / (self.gbps * 1e9)

    @property
    def far_bytes(self) -> int:
        """Latency x bandwidth: the transfer size whose wire time equals the latency."""
        return int(self.latency_us * 1e-6 * self.gbps * 1e9 / 8)


#: The assumed link per device type, with why (the planner's defaults, and
#: what ``RING_ATTENTION_FAR_BYTES=auto`` takes latency x bandwidth of).
LINKS = {
    "cuda": (
        Link(400.0, 10.0, 1.0),
        "assumed: one 400 Gbit/s NIC per GPU (InfiniBand NDR class), 10 us per transfer, "
        "1 us per further message of a batch (NCCL grouped send/recv)",
    ),
    "cpu": (
        Link(10.0, 100.0, 20.0),
        "assumed: gloo over TCP loopback, ~12 Gbit/s measured on 16 MB messages, 100 us per "
        "transfer, 20 us per further message of a batch",
    ),
}


#: The link inside a node per device type: (Gbit/s, latency in us, why).
INTRA_DEFAULTS = {
    "cuda": (3600.0, 5.0, "assumed: NVLink 4, 450 GB/s each way per GPU (H100 SXM)"),
    "cpu": (10.0, 100.0, "assumed: gloo over TCP loopback (as --link-gbps on the CPU)"),
}
