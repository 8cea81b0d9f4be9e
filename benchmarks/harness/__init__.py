"""The benchmark harness: what the cluster benchmarks of docs/results.md run on, kept out of
the installed ``pdjax``.

- :mod:`benchmarks.harness.cluster`: a cluster on one machine, pinned single-core worker
  processes joined by ``jax.distributed``, PipeDream against data parallelism, measured next
  to the planner's and the simulator's predictions;
- :mod:`benchmarks.harness.cluster_tta`: time to accuracy on that cluster (the module path
  its runs' configs name and its workers start with);
- :mod:`benchmarks.harness.netem`: emulated links (network namespaces, veth pairs, a bridge
  and ``tc``).

It imports ``pdjax`` (a few private helpers too: it is pdjax's own harness); nothing in
``pdjax`` imports it (tests/test_structure.py checks).
"""
