"""Run code in real processes joined by a gloo process group (tests, benchmarks):
:func:`run_distributed`; :func:`tensor_peak`."""

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["WorkerError", "run_distributed"]


class WorkerError(RuntimeError):
    """A worker process raised or died; the message holds its rank and traceback."""


def _entry(
    call: bytes, rank: int, world_size: int, init_file: str, results: mp.Queue, pg_timeout_s: float,
    threads: int, environ: dict[str, str],
) -> None:  # fmt: skip
    try:
        os.environ.clear()  # the caller's, not the fork server's from its start
        os.environ.update(environ)
        fn, args = pickle.loads(call)  # imports fn's module under that environment
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))  # fmt: skip
        try:
            value = fn(rank, world_size, *args)
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including assertion errors
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 150.0,
    pg_timeout: float = 60.0, expect_dead: tuple[int, ...] = (), threads: int = 1,
) -> list[Any]:  # fmt: skip
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; the values in rank order.

    The processes fork from a ``forkserver`` that imported torch once, each with the caller's
    ``sys.path``, working directory and environment, and join through a ``FileStore`` (no ports).
    ``fn`` must be a module-level function, its arguments and value picklable; a worker that
    raises gives :class:`WorkerError` with its traceback. ``timeout``: seconds before the run is
    killed (``TimeoutError``); ``pg_timeout``: the process group's (a hung collective raises in
    the workers); ``expect_dead``: ranks meant to die without reporting (value ``None``);
    ``threads``: intra-op threads per process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])  # its server imports torch once
    results: mp.Queue = ctx.Queue()
    environ = dict(os.environ)
    call = pickle.dumps((fn, args))
    with tempfile.TemporaryDirectory(prefix="ra_dist_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(call, r, world_size, init_file, results, pg_timeout, threads, environ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while len(out) + len(errors) < world_size - len(expect_dead):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if errors:
                        break
                    raise TimeoutError(
                        f"distributed run of {getattr(fn, '__name__', fn)} with world_size="
                        f"{world_size} did not finish in {timeout} s (ranks done: {sorted(out)})"
                    )
                try:
                    rank, ok, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [
                        i
                        for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in out and i not in expect_dead
                    ]
                    if dead and results.empty():
                        time.sleep(0.5)
                        if results.empty():
                            raise WorkerError(
                                f"worker(s) {dead} died with exit codes "
                                f"{[procs[i].exitcode for i in dead]} before reporting"
                            ) from None
                    continue
                if ok:
                    out[rank] = pickle.loads(payload)
                else:
                    errors.append(f"--- rank {rank} ---\n{payload}")
                    # the other ranks may wait in a collective: a moment to report, then stop
                    deadline = min(deadline, time.monotonic() + 5.0)
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 1)
            for p in procs:  # only the processes started above
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
        if errors:
            raise WorkerError(
                f"{len(errors)} worker(s) of {getattr(fn, '__name__', fn)} failed:\n"
                + "\n".join(errors)
            )
        return [out.get(r) for r in range(world_size)]


def tensor_peak(call) -> int:
    """Peak CPU tensor bytes allocated by ``call()`` and not yet freed, from
    the PyTorch profiler's allocation events."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = []

    def walk(evs) -> None:
        for e in evs:
            if e.typed[0] == _EventType.Allocation:
                a = e.typed[1]
                events.append((e.start_time_ns, a.alloc_size, a.ptr))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    live: dict[int, int] = {}
    total = peak = 0
    for _, size, ptr in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live[ptr] = size
            total += size
            peak = max(peak, total)
        elif ptr in live:
            total -= live.pop(ptr)
    return peak
