"""The runtime: :class:`Pipeline` runs a schedule's stages on devices as jitted programs.

Schedules as data live in :mod:`pdjax.schedules`, the simulator and its pictures in
:mod:`pdjax.simulator`, the planner in :mod:`pdjax.partition`; this package runs them.
Its parts: :mod:`.lowering` (a schedule and a placement become per-process programs),
:mod:`.stage` (a stage's jitted programs), :mod:`.transport` (values between stages and
processes), :mod:`.optim` (optimizers across stages) and :mod:`.executor`
(:class:`Pipeline`, the interpreter of the lowered programs).
"""

from pdjax.pipeline.executor import Pipeline, PipelineState, RunMetrics, even_stages
from pdjax.pipeline.stage import Stage

__all__ = ["Pipeline", "PipelineState", "RunMetrics", "Stage", "even_stages"]
