"""The event simulator: a schedule and per-stage costs become a timeline, with its times,
bubble and memory; and the pictures of timelines (Chrome traces, Gantt charts).

It reads schedules (:mod:`pdjax.schedules`) and nothing above them: the planner
(:mod:`pdjax.partition`) turns a plan and a profile into costs
(:func:`pdjax.partition.costs_from_plan`) and prices candidates here; the runtime
(:mod:`pdjax.pipeline`) records its measured runs as the same :class:`Timeline`.

>>> from pdjax.schedules import one_f_one_b, validate
>>> from pdjax.simulator import simulate, unit_costs
>>> schedule = one_f_one_b(4, 8)
>>> validate(schedule)
>>> round(simulate(schedule, unit_costs(4)).bubble_fraction, 3)
0.273

Modules: :mod:`.engine` (:func:`simulate`, :class:`Simulation`), :mod:`.costs`
(:class:`StageCosts`, :class:`PipelineCosts`, :func:`unit_costs`), :mod:`.timeline`
(:class:`Timeline`, :class:`Span`, :class:`Transfer`) and :mod:`.trace` (Chrome traces,
Gantt charts).
"""

from pdjax.schedules.timeline import Span, Timeline, Transfer
from pdjax.simulator.costs import PipelineCosts, StageCosts, unit_costs
from pdjax.simulator.engine import Simulation, simulate, stream_length
from pdjax.simulator.trace import chrome_trace, plot_gantt, write_chrome_trace

__all__ = [
    "PipelineCosts",
    "Simulation",
    "Span",
    "StageCosts",
    "Timeline",
    "Transfer",
    "chrome_trace",
    "plot_gantt",
    "simulate",
    "stream_length",
    "unit_costs",
    "write_chrome_trace",
]
