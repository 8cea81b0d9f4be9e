"""Pipeline schedules as data: actions, generators, a validator, and text forms.

A :class:`Schedule` lists, for each device group, the ordered actions it runs:

- ``F(stage, mb)``: forward of microbatch ``mb`` through ``stage``;
- ``B(stage, mb)``: its whole backward (input gradient and weight gradient);
- ``I(stage, mb)`` / ``W(stage, mb)``: the backward split into the input gradient (what the
  previous stage waits for) and the weight gradient (which can be deferred);
- ``U(stage, step)``: the optimizer update of ``stage`` with the gradients of update ``step``.

Every action carries the weight *version* it must use (the number of optimizer updates the
stage's weights have received; for ``U`` the version it reads, producing ``version + 1``).
Transfers are not listed: activations flow ``F(s, k) -> F(s + 1, k)`` and gradients
``B/I(s + 1, k) -> B/I(s, k)`` whenever the two stages live on different device groups.

The modules:

- :mod:`~pdjax.schedules.actions`: :class:`Action`, :class:`Schedule`, their
  text, grid and JSON forms;
- :mod:`~pdjax.schedules.semantics`: what a schedule computes, as a row of the table
  (:class:`ScheduleSemantics`: whether it streams, flushes, is stale, chunked, round-robin
  or splits the backward, with its in-flight and versions formulas);
- :mod:`~pdjax.schedules.kind`: a schedule as one object (:class:`ScheduleKind`: its
  row, generator, placement, chunk rule and what the planner and applications read);
- :mod:`~pdjax.schedules.registry`: every schedule's kind by name
  (:data:`SCHEDULE_KINDS`), and the table :data:`SEMANTICS` and name lists derived
  from it;
- :mod:`~pdjax.schedules.inflight`: groups in flight under round-robin
  replication;
- :mod:`~pdjax.schedules.flush`, :mod:`~pdjax.schedules.streaming`,
  :mod:`~pdjax.schedules.interleaved_1f1b`, :mod:`~pdjax.schedules.zero_bubble`:
  the families, each schedule's generator next to its kind; :func:`generate` looks
  one up by name;
- :mod:`~pdjax.schedules.validate`: the validator, with its own recomputation of
  the bounds and versions;
- :mod:`~pdjax.schedules.play`: the event player (the unit clock, the deadlock
  check, the simulator's engine).

Compact strings name one action as ``<stage><kind><mb>[v<version>]``, the version shown only
when it is not 0: ``"2F0"`` is the forward of microbatch 0 at stage 2 with version 0,
``"1B7v3"`` the backward of microbatch 7 at stage 1 with version 3, ``"0U2v2"`` the third
update of stage 0. :meth:`Schedule.grid` prints the unit-time clock (every action one tick,
each as early as its dependencies allow) with one column per device group; :func:`parse_grid`
reads it back.

>>> s = one_f_one_b(2, 2)
>>> print(s.grid())
t  g0   g1
0  0F0  .
1  0F1  1F0
2  .    1B0
3  0B0  1F1
4  .    1B1
5  0B1  1U0
6  0U0  .
>>> parse_grid(s.grid()) == s.actions
True
>>> validate(s)
"""

from pdjax.schedules.actions import (
    KINDS,
    Action,
    Schedule,
    format_actions,
    parse_actions,
    parse_grid,
)
from pdjax.schedules.arguments import REPLICATION
from pdjax.schedules.flush import gpipe, one_f_one_b
from pdjax.schedules.generate import generate
from pdjax.schedules.inflight import IN_FLIGHT, group_sizes, paper_in_flight, round_robin_in_flight
from pdjax.schedules.interleaved_1f1b import interleaved
from pdjax.schedules.kind import MODULO, V_SHAPE, GenerateArgs, ScheduleKind, StagePlacement
from pdjax.schedules.play import live_versions, play
from pdjax.schedules.registry import (
    CHUNKED,
    FLUSHING,
    ROUND_ROBIN,
    SCHEDULE_KINDS,
    SCHEDULES,
    SEMANTICS,
    SPLIT_BACKWARD,
    STALE,
    STREAMING,
    schedule_kind,
    semantics,
    stage_groups,
)
from pdjax.schedules.semantics import ScheduleSemantics, Shape
from pdjax.schedules.spec import ScheduleSpec
from pdjax.schedules.streaming import pipedream, pipedream_2bw
from pdjax.schedules.validate import validate
from pdjax.schedules.zero_bubble import zb_h1, zb_h2, zb_v

__all__ = [
    "CHUNKED",
    "FLUSHING",
    "IN_FLIGHT",
    "KINDS",
    "MODULO",
    "REPLICATION",
    "ROUND_ROBIN",
    "SCHEDULES",
    "SCHEDULE_KINDS",
    "SEMANTICS",
    "SPLIT_BACKWARD",
    "STALE",
    "STREAMING",
    "V_SHAPE",
    "Action",
    "GenerateArgs",
    "Schedule",
    "ScheduleKind",
    "ScheduleSemantics",
    "ScheduleSpec",
    "Shape",
    "StagePlacement",
    "format_actions",
    "generate",
    "gpipe",
    "group_sizes",
    "interleaved",
    "live_versions",
    "one_f_one_b",
    "paper_in_flight",
    "parse_actions",
    "parse_grid",
    "pipedream",
    "pipedream_2bw",
    "play",
    "round_robin_in_flight",
    "schedule_kind",
    "semantics",
    "stage_groups",
    "validate",
    "zb_h1",
    "zb_h2",
    "zb_v",
]
