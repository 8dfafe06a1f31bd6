"""The core layer: the pattern and its geometry, the call checks, configuration,
dtypes, caches and layouts."""
