"""The exchange plan's cost follows what is exchanged, not the sequence length.

A plan lists the (row, K/V head) pairs a rank sends and receives; a rank's
own blocks exchange nothing. Planning at 10**9 tokens must therefore take
memory for the rows that travel (a few hundred thousand here), not for every
position: each case runs in a subprocess whose address space is capped at
1 GiB above what it holds after importing torch. Listing every reached row
of a rank's own block (10**8 positions x 8 K/V heads: 6.4 GB), or a byte per
(row, K/V head) of a block (2.3 GB at 10**9 / 7 x 16), fails there with a
MemoryError instead of passing slowly.

The rows themselves are checked against the planner's closed forms
(:func:`ring_attention.planner.traffic.predict_traffic`, ``source="analytic"``),
which never visit a position: the two agree exactly, step by step.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = """
import resource
import torch
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, hard))

from ring_attention.core.pattern import Pattern
from ring_attention.parallel.exchange_plan import build_plan
from ring_attention.planner.traffic import predict_traffic
from ring_attention.parallel.ring import exchange_plan

# one process: nothing is exchanged, the local block reaches something
plan = exchange_plan(10**8, 8, [2048, 8192], [1, 4])
assert plan.local_pairs == ((0, 0),) and plan.steps == (), plan
assert plan.rows_sent == 0 and plan.nbytes == 0

n, p, cases = 10**9, 7, 0
for layout in ("contiguous", "zigzag"):
    for causal in (False, True):
        for docs in (None, [0, 3 * 10**8 + 17, 3 * 10**8 + 17, n]):
            pattern = Pattern([2048, 8192, 65536], [1, 4, 16], causal=causal).with_documents(docs)
            want = predict_traffic(pattern, n, 32, 16, p, layout, source="analytic").recv_rows
            got = torch.zeros(p, p, dtype=torch.int64)
            for rank in range(p):
                plan = build_plan(pattern, n, 32, 16, p, rank, layout)
                # every own block of a rank reaches itself (position 0 of
                # each segment is active for head 0)
                pieces = len(plan.pieces)
                assert {(i, i) for i in range(pieces)} <= set(plan.local_pairs), plan.local_pairs
                for step in plan.steps:
                    got[rank, step.distance] = step.recv_rows
            assert torch.equal(got, want), (layout, causal, docs, got, want)
            cases += 1
# zigzag pieces of 10**12 / 16 positions, 10**12 apart at most
plan = build_plan(Pattern([2048, 8192], [1, 4]), 10**12, 8, 2, 8, 3, "zigzag")
assert plan.local_pairs == ((0, 0), (1, 1)) and plan.rows_sent > 0
print("ok", cases)
"""


def test_planning_memory_follows_the_rows_exchanged() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.split() == ["ok", "8"], proc.stdout + proc.stderr
