"""``ours`` in the benchmarks: every ``ring_attention`` name they call,
imported lazily so that the baselines still run when the extension failed to
build (the pattern, its geometry and the planner's exchange plan need no
extension): the package, the ring call, a rank's layout pieces, its exchange
counters and the plan's bytes.
"""

from __future__ import annotations

from typing import Any


def ring_attention() -> Any:
    """The ``ring_attention`` package (raises ImportError when the extension is missing)."""
    import ring_attention as ra
    from ring_attention import dilated_attention  # noqa: F401  (needs the extension)

    return ra


def layout_pieces(n: int, world: int, rank: int, layout: str) -> list[tuple[int, int]]:
    """``(start, length)`` of the runs of global positions rank ``rank`` holds."""
    from ring_attention.parallel.sharding import layout_pieces as pieces

    return [(p.start, p.length) for p in pieces(n, world, rank, layout)]


def ring_call(q, k, v, segs, dils, *, causal: bool, head_groups: bool, layout: str):
    """``ring_dilated_attention`` on the default process group."""
    ra = ring_attention()
    return ra.ring_dilated_attention(
        q, k, v, segs, dils, causal=causal, head_groups=head_groups, layout=layout
    )


def exchange_counters() -> dict[str, Any]:
    """Bytes the last ring call on this rank handed to torch.distributed, and
    the transport buffers it allocated (``ring_attention.parallel.exchange``)."""
    from ring_attention.parallel.exchange import last_exchange_stats as s

    return {
        "sent_fwd": s.bytes_sent("forward_kv"),
        "sent_all": s.bytes_sent(),
        "buffers": max(s.buffer_bytes.values(), default=0),
    }


def plan_bytes_sent(
    n: int, heads: int, segs, dils, *, causal: bool, head_groups: bool, layout: str,
    batch: int, head_dim: int, itemsize: int, world: int | None = None, rank: int | None = None,
) -> tuple[int, int]:  # fmt: skip
    """Bytes a rank sends per layer from its exchange plan: (forward, forward + backward).

    With ``world``/``rank`` the plan of that rank is built without processes;
    otherwise this rank's plan in the default process group.
    """
    if world is None:
        from ring_attention.parallel.ring import exchange_plan

        plan = exchange_plan(
            n, heads, segs, dils, causal=causal, head_groups=head_groups, layout=layout
        )
    else:
        from ring_attention.core.pattern import Pattern
        from ring_attention.parallel.exchange_plan import build_plan

        pattern = Pattern(segs, dils, causal=causal, head_groups=head_groups)
        plan = build_plan(pattern, n, heads, heads, world, rank, layout)
    fwd = plan.bytes_sent(batch, head_dim, itemsize)
    return fwd, plan.bytes_sent(batch, head_dim, itemsize, backward=True)
