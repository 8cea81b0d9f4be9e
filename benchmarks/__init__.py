"""pdjax's benchmarks: the scripts behind docs/results.md and, in :mod:`benchmarks.harness`,
the harness some of them run on (a cluster of worker processes on one machine, emulated
links). Not part of the installed ``pdjax`` (its wheel ships ``pdjax/`` only, and no module
of ``pdjax`` imports this package): run them from the repository's root, e.g.
``python benchmarks/cluster/run.py``.
"""
