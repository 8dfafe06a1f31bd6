"""The benchmarks of ring_attention, one package: ``benchmarks/bench.py`` is
its command line (``python benchmarks/bench.py --help``, or
``python -m benchmarks.bench`` from the repository's root); the modules are
importable as ``benchmarks.<name>`` (the tests import them so)."""
