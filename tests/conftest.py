"""Shared pytest fixtures for the ring_attention test suite.

``device`` parametrises a test over ``"cpu"`` and ``"cuda"``; the CUDA variant
is skipped (with a reason saying there is no GPU) when
``torch.cuda.is_available()`` is false. The only other skip: the CUDA
emulator tests (test_cuda_emulated.py) where the CUDA toolkit's headers are
missing, and never under CI (there they fail instead).

Every test process runs on one intra-op thread (``OMP_NUM_THREADS`` when set,
else 1, for the subprocesses too): the suite's parallelism is pytest-xdist's
one worker per core, and threads on top of it only stall in their barriers
(tiny ops 10-30 times slower on a loaded 2-core machine). The kernels'
split of work over threads is checked on purpose, with several threads, by
``test_local_op.py::test_results_do_not_depend_on_the_thread_count``.
"""

from __future__ import annotations

import os

import pytest
import torch

if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

NO_GPU_REASON = "no GPU: torch.cuda.is_available() is False"

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU_REASON),
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device a test runs on: ``"cpu"``, and ``"cuda"`` when a GPU exists."""
    return request.param


@pytest.fixture(scope="module")
def emu():
    """torch.ops.ring_attention_emulated (the CUDA kernels run on the CPU by
    tests/cuda_emulator), built on first use, configured as sm_90 with seed 0
    before and after the module's tests."""
    from cuda_emulator import build

    ops = build.load()
    if ops is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the CUDA emulator: {build.MISSING}")
        pytest.skip(build.MISSING)
    ops.configure(0, 90)
    yield ops
    ops.configure(0, 90)
