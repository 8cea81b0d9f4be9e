"""The cluster benchmarks of docs/results.md, run as scripts from the repository's root:
``python benchmarks/cluster/run.py`` (the cluster), ``tta.py`` (time to accuracy on it) and
``auto.py`` (``plan_auto``'s choice on it); the harness they run on is
:mod:`benchmarks.harness`."""
