"""The benchmarks' command line (benchmarks/cli.py), runnable both ways:

    python benchmarks/bench.py SUBCOMMAND ...      # as a file (torchrun launches it so)
    python -m benchmarks.bench SUBCOMMAND ...      # as a module, from the repository's root

Run as a file, Python puts this folder, not its parent, first on the module
path, so the package cannot be imported by name: it is imported from this
folder (the module path is left as it is, so that ``PYTHONPATH`` still chooses
which ``ring_attention`` is timed: ``scripts/prev_tree.sh``).
"""

import importlib.util
import os
import sys

if __package__:
    from .cli import main
else:
    _here = os.path.dirname(os.path.abspath(__file__))
    _spec = importlib.util.spec_from_file_location(
        "benchmarks", os.path.join(_here, "__init__.py"), submodule_search_locations=[_here]
    )
    sys.modules["benchmarks"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["benchmarks"])
    from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main())
