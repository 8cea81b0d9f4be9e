"""Pipeline schedules as data, their simulator and their pictures.

>>> from pdjax.pipeline import one_f_one_b, simulate, unit_costs, validate
>>> schedule = one_f_one_b(4, 8)
>>> validate(schedule)
>>> round(simulate(schedule, unit_costs(4)).bubble_fraction, 3)
0.273
"""

from pdjax.pipeline.schedule import (
    KINDS,
    SCHEDULES,
    Action,
    Schedule,
    format_actions,
    generate,
    gpipe,
    interleaved,
    one_f_one_b,
    parse_actions,
    parse_grid,
    pipedream,
    pipedream_2bw,
    validate,
    zb_h1,
)
from pdjax.pipeline.simulate import PipelineCosts, Simulation, StageCosts, simulate, unit_costs
from pdjax.pipeline.timeline import Span, Timeline, Transfer
from pdjax.pipeline.trace import chrome_trace, plot_gantt, write_chrome_trace

__all__ = [
    "KINDS",
    "SCHEDULES",
    "Action",
    "PipelineCosts",
    "Schedule",
    "Simulation",
    "Span",
    "StageCosts",
    "Timeline",
    "Transfer",
    "chrome_trace",
    "format_actions",
    "generate",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "parse_actions",
    "parse_grid",
    "pipedream",
    "pipedream_2bw",
    "plot_gantt",
    "simulate",
    "unit_costs",
    "validate",
    "write_chrome_trace",
    "zb_h1",
]
