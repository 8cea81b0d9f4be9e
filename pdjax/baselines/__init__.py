"""Baselines pdjax's pipelines are measured against.

``DataParallel`` is the "pjit DP" baseline: the whole model as one jitted train step,
the batch sharded over a device mesh with ``NamedSharding``, parameters replicated.
"""

from pdjax.baselines.dp import DataParallel, DPMetrics, DPState

__all__ = ["DPMetrics", "DPState", "DataParallel"]
