"""Runners: what trains a model on devices, behind one protocol.

:class:`Runner` (``init``, ``step``, ``run``, ``variables``, ``predict``) and its state,
:class:`RunnerState` (a ``NamedTuple`` of arrays and int counters), are what checkpoints
(:class:`Checkpointer`), the training loop, the benchmarks and the cluster runs are
written against. :class:`Pipeline` (``pdjax.pipeline``) and :class:`DataParallel` (the
``jax.jit`` + ``NamedSharding`` baseline every comparison is against) implement it.
"""

from pdjax.pipeline import Pipeline, PipelineState
from pdjax.runners.checkpoint import Checkpointer
from pdjax.runners.dp import DataParallel, DPMetrics, DPState
from pdjax.runners.protocol import ARRAY_FIELDS, Runner, RunnerState, RunResult, counter_fields

__all__ = [
    "ARRAY_FIELDS",
    "Checkpointer",
    "DPMetrics",
    "DPState",
    "DataParallel",
    "Pipeline",
    "PipelineState",
    "RunResult",
    "Runner",
    "RunnerState",
    "counter_fields",
]
