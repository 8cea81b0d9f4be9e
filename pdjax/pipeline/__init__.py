"""Pipelines: schedules as data, their simulator and pictures, and the runtime that runs
them on devices (:class:`Pipeline`).

>>> from pdjax.pipeline import one_f_one_b, simulate, unit_costs, validate
>>> schedule = one_f_one_b(4, 8)
>>> validate(schedule)
>>> round(simulate(schedule, unit_costs(4)).bubble_fraction, 3)
0.273
"""

from pdjax.pipeline.costs import costs_from_plan, weight_grad_fraction
from pdjax.pipeline.executor import Pipeline, PipelineState, RunMetrics, even_stages
from pdjax.pipeline.schedules import (
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
    round_robin_in_flight,
    stage_groups,
    validate,
    zb_h1,
    zb_h2,
    zb_v,
)
from pdjax.pipeline.simulate import PipelineCosts, Simulation, StageCosts, simulate, unit_costs
from pdjax.pipeline.stage import Stage
from pdjax.pipeline.timeline import Span, Timeline, Transfer
from pdjax.pipeline.trace import chrome_trace, plot_gantt, write_chrome_trace

__all__ = [
    "KINDS",
    "SCHEDULES",
    "Action",
    "Pipeline",
    "PipelineCosts",
    "PipelineState",
    "RunMetrics",
    "Schedule",
    "Simulation",
    "Span",
    "Stage",
    "StageCosts",
    "Timeline",
    "Transfer",
    "chrome_trace",
    "costs_from_plan",
    "even_stages",
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
    "round_robin_in_flight",
    "simulate",
    "stage_groups",
    "unit_costs",
    "validate",
    "weight_grad_fraction",
    "write_chrome_trace",
    "zb_h1",
    "zb_h2",
    "zb_v",
]
