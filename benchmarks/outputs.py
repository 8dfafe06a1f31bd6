"""What a resumable sweep (``bench.py local``, ``bench.py ring``) measures,
what it reuses from its result file, and which of its files it may write.

A sweep skips the points already in its result file (their key says what was
measured, not where or when), so a command run again, or run on another
machine against a published result folder, may measure nothing at all. It
says so plainly, with the runs the reused points came from. Files tracked by
git (published results, e.g. ``benchmarks/results/``) are not touched unless
``--write-tracked`` asks for it: a sweep that would measure into them refuses
before measuring, and one that measured nothing leaves their reports as they
are.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from collections.abc import Iterable

from . import measure

__all__ = ["announce", "kept_line", "tracked", "tracked_to_keep"]


def tracked(paths: Iterable[str]) -> list[str]:
    """The ``paths`` that git tracks (in whichever repository holds each);
    none outside a repository or without git."""
    found = []
    for path in paths:
        folder, name = os.path.split(os.path.abspath(path))
        if not os.path.isdir(folder):
            continue
        try:
            res = subprocess.run(
                ["git", "-C", folder, "ls-files", "--error-unmatch", "--", name],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            continue
        if res.returncode == 0:
            found.append(path)
    return found


def _runs_of(store: measure.ResultFile, keys: Iterable[str]) -> str:
    """The runs that measured ``keys``: date, device and commit of each."""
    runs: dict[str, str] = {}
    for key in keys:
        run = store.run_of(store.records[key])
        if run is not None and run["run_id"] not in runs:
            runs[run["run_id"]] = (
                f"{run['date'][:10]} on {run['device_name']}, commit {run['commit']}"
            )
    if not runs:
        return "runs not recorded"
    shown = list(runs.values())
    more = f" and {len(shown) - 3} more runs" if len(shown) > 3 else ""
    return "; ".join(shown[:3]) + more


def announce(store: measure.ResultFile, keys: list[str], todo: list[str], what: str) -> None:
    """Say how many of the sweep's points (``keys``) will be measured now
    (``todo``) and how many are reused from ``store``, and from which runs."""
    reused = [k for k in keys if k not in set(todo)]
    if not reused:
        print(f"{len(keys)} {what} to measure, into {store.path}")
        return
    origin = f"measured earlier ({_runs_of(store, reused)})"
    if todo:
        print(
            textwrap.fill(
                f"{len(keys)} {what}: {len(reused)} reused from {store.path}, {origin}; "
                f"{len(todo)} to measure now (--redo measures every point again)",
                width=100,
            )
        )
        return
    print(
        textwrap.fill(
            f"nothing measured: all {len(keys)} {what} are already in {store.path}, {origin}. "
            "The tables below are those results. To measure them on this machine, add "
            "--redo --out-dir NEW_DIR (--redo alone replaces them in that file).",
            width=100,
        )
    )


def tracked_to_keep(
    store: measure.ResultFile, reports: list[str], measuring: bool, write_tracked: bool
) -> list[str]:
    """The files of the sweep (its result file ``store`` and its ``reports``)
    that git tracks and that it must leave as they are: none with
    ``write_tracked``. Raises ``SystemExit``, before anything is measured,
    when the sweep would measure into such files (``measuring``)."""
    if write_tracked:
        return []
    mine = tracked(f for f in [store.path, *reports] if os.path.exists(f))
    if mine and measuring:
        raise SystemExit(
            f"{_names(mine)}: tracked by git (published results); measure into another "
            "--out-dir, or add --write-tracked to add to them"
        )
    return mine


def _names(paths: list[str]) -> str:
    """``paths``, their common folder said once."""
    folders = {os.path.dirname(p) for p in paths}
    if len(folders) == 1:
        return f"{', '.join(os.path.basename(p) for p in paths)} in {folders.pop() or '.'}"
    return ", ".join(paths)


def kept_line(kept: list[str]) -> str:
    """What a sweep that wrote nothing says about ``kept``."""
    return textwrap.fill(
        f"left {_names(kept)} as they are (tracked by git; --write-tracked rewrites them)",
        width=100,
    )
