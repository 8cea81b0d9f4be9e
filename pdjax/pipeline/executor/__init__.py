"""The runtime: a pipeline of stages on devices, run as lowered programs.

A call (:meth:`Pipeline.step`, :meth:`Pipeline.run`) takes the validated schedule for its
number of microbatches, lowers it once (:func:`pdjax.pipeline.lowering.lower`, cached) into
this process's flat list of operations, binds each operation to a function once (a stage
program, a transfer of the pipeline's :mod:`~pdjax.pipeline.transport`, a wait), and then
the interpreter only calls them in order on a register file: every weight version,
activation, residual and gradient was given its slot, its producer, its readers and the
point where it is dropped at lowering time. Dispatch is asynchronous, so the device
groups overlap: the driver runs ahead, and each device works as soon as its inputs are
ready.

Semantics (``docs/semantics.md#weight-versions-and-updates``) come from the schedule:
every ``F``/``B``/``I``/``W`` reads the weight version its action names, ``U`` applies the
summed gradients to the newest version and makes the next one. Flush schedules and ``2bw``
scale the summed gradients of a step by ``1 / M`` (the mean over microbatches);
``pipedream`` applies each microbatch's gradient alone, except at a round-robin stage on
``r`` devices, which applies the mean gradient of each group of ``r`` microbatches (its
sum scaled by ``1 / r``).

Per microbatch ``k`` (counted over the pipeline's life), layer ``i`` draws dropout from
``fold_in(fold_in(rng, k), i)``. BatchNorm statistics are updated by each microbatch's
forward, in the order the stage runs the forwards (microbatch order in every schedule),
so statistics are microbatch statistics, as in gradient accumulation.

Modules: :mod:`.pipeline` (:class:`Pipeline`, made of the parts below, which it holds),
:mod:`.state` (:class:`PipelineState`, :class:`RunMetrics`), :mod:`.config` (the plan's
stages, :func:`even_stages`, the constructor's checks), :mod:`.stages` (the immutable stage
set), :mod:`.decisions` (what the pipeline decides once), :mod:`.checks` (what a call is
given), :mod:`.programs` (the cache: schedule, lowered program, bound code),
:mod:`.interpreter` (binding a program, and the pure interpreter), :mod:`.calls` (one
training call: the caller's values in, the state and metrics out), :mod:`.forward`
(evaluation, prediction, the weights read out), :mod:`.layout` (the parameters' and
optimizer state's layout per stage, :class:`ParamLayout`), :mod:`.trees` (pytree helpers).
"""

from pdjax.pipeline.executor.config import even_stages
from pdjax.pipeline.executor.layout import ParamLayout, TiedGroup
from pdjax.pipeline.executor.pipeline import Pipeline
from pdjax.pipeline.executor.state import PipelineState, RunMetrics

__all__ = ["ParamLayout", "Pipeline", "PipelineState", "RunMetrics", "TiedGroup", "even_stages"]
