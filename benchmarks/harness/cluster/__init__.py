"""A cluster on one machine: PipeDream against data parallelism with real workers and links.

Each *worker* is a process of its own, pinned to one core (``taskset``) with one CPU device
and XLA's intra-op threading off, so that it computes alone, as one accelerator would.
Workers join with ``jax.distributed``: pipeline activations and gradients cross between
them with ``jax.device_put`` (:class:`~pdjax.pipeline.Pipeline`), the data-parallel
gradient all-reduce with JAX's CPU collectives (gloo over TCP). With root and ``tc``, every
worker runs in a network namespace of its own on a link of known bandwidth
(:class:`~benchmarks.harness.netem.EmulatedNetwork`: veth pairs through a bridge, a token
bucket each way), so those transfers cross that link; without, the workers share loopback and the
report says so.

:func:`run_cluster` runs, side by side, per model and link rate (:data:`RATES`):

- (a) a compute-bound model (``mlp-512``: 8 dense layers of 512, 8 MB of weights that
  stay in the shared L3 cache, microbatches of 128); on the fast link also
  ``pipedream+1`` (one more microbatch in flight), ``pipedream/coll`` (the collective
  transport) and ``1f1b``;
- (b) a parameter-heavy VGG-style model (``vgg-fc``: a narrow VGG-16 front, then a
  2048 x 2048 fully connected layer, 18 MB of weights) over slow links;
- for both: a 2-stage ``pipedream`` at every cut point, 2-worker data parallelism, and one
  worker alone (one jitted step, and a one-stage pipeline);
- (c) for every run, the measured seconds per microbatch next to the planner's prediction
  (:func:`~pdjax.partition.evaluate_partition`) and the simulator's
  (:func:`~pdjax.simulator.simulate` of exactly the schedule that ran), both from
  *calibrated* costs (:mod:`pdjax.calibrate`): every candidate stage timed as compiled
  programs (forward, backward, SGD update) on worker 0, the link measured both ways
  through ``jax.device_put`` and the gradient all-reduce measured, all in the run's own
  launch before its runners (the launch's workers, allocator and machine state); next to
  them the simulator from the per-layer profile alone, and the simulator under its other
  receive model;
- (f) per run and worker, where the time goes: the CPU time of the driver's thread and of
  the other threads (XLA's programs, transfers) per microbatch, and the idle rest;
- (d) per link, the planner's choice from the calibrated costs
  (:func:`~pdjax.partition.plan_pipedream`: a pipeline, data parallel, or one worker)
  against the measured best;
- (e) the plans ranked: Kendall's tau of the planner's (and the simulator's) order of
  every candidate against the measured order.

What one microbatch is: :data:`MICROBATCH` samples (128 for ``mlp-512``, 32 for
``vgg-fc``). One worker trains on batches of that size; a pipeline streams microbatches of
that size (``pipedream``: an update per microbatch; ``1f1b``: ``M = 4`` per update); data
parallelism gives each worker that many samples per step, so a step is 2 microbatches.
Every number is seconds per microbatch (or samples per second), the median of ``repeats``
rounds that go round-robin over the runners of one launch, after a warm-up round that
compiles.

Link rates are for Ethernet frames; TCP payload gets 1448/1514 of them, and the predictions
use that payload rate.

Run it with ``python benchmarks/cluster/run.py`` (from the repository's root; ``--help``
for its options). Part of the benchmark harness, not of the installed ``pdjax``.

The package: :mod:`~benchmarks.harness.cluster.models` (the benchmark's models),
:mod:`~benchmarks.harness.cluster.experiments` (:func:`run_cluster`: what is launched, predicted
and ranked), :mod:`~benchmarks.harness.cluster.launcher` (starting the workers),
:mod:`~benchmarks.harness.cluster.worker` (what each worker process runs),
:mod:`~benchmarks.harness.cluster.predict` (the predictions, Kendall's tau) and
:mod:`~benchmarks.harness.cluster.report` (the rows, Markdown, plots and files);
:mod:`~benchmarks.harness.cluster.tta` and :mod:`~benchmarks.harness.cluster.tta_report`
(time to accuracy on the same workers, as :mod:`benchmarks.harness.cluster_tta`).
"""

from __future__ import annotations

from benchmarks.harness.cluster.experiments import run_cluster
from benchmarks.harness.cluster.launcher import LAUNCH_TIMEOUT as LAUNCH_TIMEOUT
from benchmarks.harness.cluster.launcher import launch as launch
from benchmarks.harness.cluster.launcher import profile_on_workers as profile_on_workers
from benchmarks.harness.cluster.launcher import run_processes as run_processes
from benchmarks.harness.cluster.models import CLUSTER_MODELS, cluster_model
from benchmarks.harness.cluster.models import MICROBATCH as MICROBATCH
from benchmarks.harness.cluster.models import RATES as RATES
from benchmarks.harness.cluster.predict import PAYLOAD as PAYLOAD
from benchmarks.harness.cluster.predict import bandwidth as bandwidth
from benchmarks.harness.cluster.predict import kendall_tau
from benchmarks.harness.cluster.predict import predict as predict
from benchmarks.harness.cluster.predict import predict_calibrated as predict_calibrated
from benchmarks.harness.cluster.predict import stage_calibration as stage_calibration
from benchmarks.harness.cluster.predict import topology as topology
from benchmarks.harness.cluster.report import (
    ClusterResult,
    Row,
    format_markdown,
    plot_cluster,
    plot_ranking,
    write_results,
)
from benchmarks.harness.cluster.report import link_label as link_label
from benchmarks.harness.cluster.worker import main as main
from pdjax.errors import ClusterError

__all__ = [
    "CLUSTER_MODELS",
    "ClusterError",
    "ClusterResult",
    "Row",
    "cluster_model",
    "format_markdown",
    "kendall_tau",
    "plot_cluster",
    "plot_ranking",
    "run_cluster",
    "write_results",
]
