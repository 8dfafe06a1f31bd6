"""The environment of a Python child process that must import from a folder
(the tests' helpers, this checkout's packages): ``folder`` first on its
``PYTHONPATH``, then the parent's. The child keeps the parent's working
directory, so that a checkout run from its root (scripts/sanitize.sh's copy)
imports its own ``ring_attention``."""

from __future__ import annotations

import os


def with_path(folder: str | os.PathLike) -> dict[str, str]:
    """``os.environ`` with ``folder`` prepended to ``PYTHONPATH``."""
    path = [os.fspath(folder), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
