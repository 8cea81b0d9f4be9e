"""Calibration: what the cost model needs, measured on the devices that will run the plan.

A per-layer profile times each layer alone; a stage runs its layers as one compiled
program, with the runtime's transfers between stages and its all-reduce inside a
replicated stage. :func:`calibrate` measures those directly and writes them as plain data
(:class:`Calibration`, JSON) that ``plan`` and ``simulate`` take next to the profile:

- **stages**: each candidate stage (a layer range, its replica count and replication mode)
  as the runtime's own compiled programs (:class:`~pdjax.pipeline.stage.Stage`: the
  forward that keeps its residuals, the backward from them, and the update timed right
  after that backward on the gradient it made, writing new weights beside older versions
  kept alive, as a schedule that stashes versions runs it) at the size one
  of its devices runs, each the median of several timed runs after warm-up. A split stage
  on ``r`` devices runs ``b / r`` rows of a ``b``-sample microbatch on each device; a
  round-robin stage runs whole microbatches, ``r`` at a time, so its time per microbatch
  is the whole microbatch's over ``r``. The last stage's forward includes the loss; the
  first stage's backward computes no input gradient (the runtime's programs do the same);
- **links**: for each ordered pair of devices, one direction at a time, seconds to move
  arrays of several sizes through the transport the runtime uses (``jax.device_put``
  within a process; across processes the pipeline's own transport, both sides taking
  part), fitted to ``latency + bytes / bandwidth``. Across processes each send is
  acknowledged by a 4-byte message back, and the fit's intercept is taken as two
  latencies; the host seconds of the sender's call are recorded too (``send_seconds``);
- **all-reduces**: a sum over a device group of ``[r, ...]`` arrays, one part per device,
  as a replicated stage's update does it, for several sizes (fitted as above), and for the
  exact gradient tree of every calibrated replicated stage (``StageMeasure.allreduce``).

A calibration records what it was measured for: the model (layer names and parameter bytes
per layer), the microbatch size, the devices (ids, platform, kind) and the optimizer.
:meth:`Calibration.check` refuses a calibration for another model, plan or device set and
says what differs. Ranges the calibration does not hold are priced from the profile times
the calibration's *profile ratio* (the whole model measured as one program over the
profile's sum, when both are known), so the planner can search every range and the
refinement loop (:func:`refine`) measures only the best plans and their neighbours.

The package's modules: :mod:`~pdjax.calibrate.calibration` (the data and its JSON),
:mod:`~pdjax.calibrate.stages`, :mod:`~pdjax.calibrate.links` (links and all-reduces),
:mod:`~pdjax.calibrate.timing` (timed runs, timeouts, the fit),
:mod:`~pdjax.calibrate.measure` (:func:`calibrate`) and
:mod:`~pdjax.calibrate.refinement` (the refinement loop).
"""

from pdjax.calibrate.calibration import FORMAT as FORMAT
from pdjax.calibrate.calibration import VERSION as VERSION
from pdjax.calibrate.calibration import (
    AllReduceMeasure,
    Calibration,
    LinkMeasure,
    StageMeasure,
)
from pdjax.calibrate.links import SIZES as SIZES
from pdjax.calibrate.links import measure_allreduce, measure_link
from pdjax.calibrate.measure import calibrate
from pdjax.calibrate.refinement import (
    Ranked,
    candidate_plans,
    neighbours,
    plan_stages,
    rank_plans,
    refine,
)
from pdjax.calibrate.stages import measure_stages, model_fingerprint
from pdjax.calibrate.timing import fit_latency_bandwidth
from pdjax.calibrate.timing import with_timeout as with_timeout  # tests time out with it

__all__ = [
    "AllReduceMeasure",
    "Calibration",
    "LinkMeasure",
    "Ranked",
    "StageMeasure",
    "calibrate",
    "candidate_plans",
    "fit_latency_bandwidth",
    "measure_allreduce",
    "measure_link",
    "measure_stages",
    "model_fingerprint",
    "neighbours",
    "plan_stages",
    "rank_plans",
    "refine",
]
