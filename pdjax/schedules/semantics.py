"""What each schedule computes, in one table: the one place that says which schedules
stream, flush, update with stale weights, hold several stages per device group, take
round-robin replication or split the backward, and how many microbatches and weight
versions each keeps.

It mirrors the table in ``docs/semantics.md#the-schedules-at-a-glance``. The generators
read their bounds from it (:attr:`ScheduleSemantics.in_flight`,
:attr:`ScheduleSemantics.versions`); the validator recomputes them on its own and
``tests/test_schedule_semantics.py`` checks that the two agree.

Notation: ``P`` device groups, ``s`` a stage (or ``d`` a device group), ``M`` microbatches
per step, ``N`` the stream length, ``v`` chunks per group, ``e`` pipedream's
``extra_in_flight`` and ``e_s`` its part at stage ``s`` (``e`` for ``s < P - 1``, 0 at the
last stage), ``n_s`` the microbatches one action of stage ``s`` covers (its replicas
under round-robin, else 1) and ``q_s`` the groups in flight there
(:func:`~pdjax.schedules.inflight.round_robin_in_flight`; ``P - s + e_s`` when
every ``n_s = 1``).

>>> semantics("2bw").streams, semantics("2bw").versions(Shape(4, 4, 8), 0)
(True, 2)
>>> STREAMING, CHUNKED
(('pipedream', '2bw'), ('interleaved', 'zb-v'))
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from pdjax.errors import ScheduleError
from pdjax.schedules.inflight import group_sizes, round_robin_in_flight

if TYPE_CHECKING:
    from pdjax.schedules.actions import Schedule

__all__ = [
    "CHUNKED",
    "FLUSHING",
    "ROUND_ROBIN",
    "SCHEDULES",
    "SEMANTICS",
    "SPLIT_BACKWARD",
    "STALE",
    "STREAMING",
    "ScheduleSemantics",
    "Shape",
    "semantics",
    "stage_groups",
]


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes and options a schedule's bounds depend on.

    Attributes:
        groups: ``P``, device groups.
        microbatches: ``M``, microbatches per step (1 for ``pipedream``).
        stream: ``N``, all microbatches the schedule runs.
        chunks: ``v``, stages per device group.
        units: per device group, ``n_d`` (``()``: every 1).
        extra_in_flight: ``e``, pipedream's latency hiding.
        vertical_sync: pipedream's option.
        weight_stashing: pipedream's option.
    """

    groups: int
    microbatches: int
    stream: int
    chunks: int = 1
    units: tuple[int, ...] = ()
    extra_in_flight: int = 0
    vertical_sync: bool = False
    weight_stashing: bool = True

    @classmethod
    def of(cls, schedule: Schedule) -> Shape:
        """The shape of ``schedule``."""
        return cls(
            groups=schedule.num_groups,
            microbatches=schedule.microbatches_per_step,
            stream=schedule.num_microbatches,
            chunks=schedule.chunks,
            units=group_sizes(schedule.replicas, schedule.replication),
            extra_in_flight=schedule.extra_in_flight,
            vertical_sync=schedule.vertical_sync,
            weight_stashing=schedule.weight_stashing,
        )

    def unit(self, group: int) -> int:
        """``n_d``: microbatches one action of ``group`` covers."""
        return self.units[group] if self.units else 1

    def extra(self, stage: int) -> int:
        """``e`` at ``stage``: none at the last stage (it has no round trip to hide)."""
        return self.extra_in_flight if stage < self.groups - 1 else 0

    def groups_in_flight(self, extra: int = 0) -> tuple[int, ...]:
        """``q_s`` per stage (with ``extra`` latency hiding)."""
        return round_robin_in_flight(self.units or (1,) * self.groups, extra)


@dataclasses.dataclass(frozen=True)
class ScheduleSemantics:
    """One row of the table: what schedule ``name`` computes and keeps.

    Attributes:
        name: as :func:`~pdjax.schedules.generate.generate` takes it.
        streams: one stream of microbatches, no flush (``pipedream``, ``2bw``); else the
            pipeline drains every step of ``M``.
        stale: an update applies gradients computed with older weights than the ones it
            updates (the result is not sequential training).
        chunked: several stages per device group.
        v_shaped: the stages go down the groups and back up (``zb-v``: two per group).
        round_robin: takes round-robin replication (a stage's devices run whole
            microbatches, ``n_s`` at once).
        split_backward: the backward runs as ``I`` (input gradient) and ``W`` (weight
            gradient).
        updates_per_microbatch: one update per microbatch (per group of ``n_s`` under
            round-robin), not one per step of ``M``.
        options: the generator options only this schedule takes.
        in_flight: ``(shape, d)``: the most microbatches in flight on device group ``d``
            (forward run, backward or ``W`` not yet), over its stages.
        versions: ``(shape, s)``: the most weight versions stage ``s`` keeps.
        in_flight_formula: :attr:`in_flight` as text.
        versions_formula: :attr:`versions` as text.
        update_rule: the update each stage applies, as in
            ``docs/semantics.md#weight-versions-and-updates``.
        weights: the weights microbatch ``k`` uses at stage ``s``.
    """

    name: str
    streams: bool
    stale: bool
    chunked: bool
    v_shaped: bool
    round_robin: bool
    split_backward: bool
    updates_per_microbatch: bool
    options: tuple[str, ...]
    in_flight: Callable[[Shape, int], int]
    versions: Callable[[Shape, int], int]
    in_flight_formula: str
    versions_formula: str
    update_rule: str
    weights: str

    @property
    def flushes(self) -> bool:
        """The pipeline drains every step of ``M`` microbatches."""
        return not self.streams


def _one(shape: Shape, stage: int) -> int:
    return 1


def _two(shape: Shape, stage: int) -> int:
    return 2


def _gpipe_in_flight(shape: Shape, group: int) -> int:
    return shape.microbatches


def _1f1b_in_flight(shape: Shape, group: int) -> int:
    q = shape.groups_in_flight()
    return min(q[group] * shape.unit(group), shape.microbatches)


def _pipedream_in_flight(shape: Shape, group: int) -> int:
    if not any(n > 1 for n in shape.units):
        return min(shape.groups - group + shape.extra(group), shape.stream)
    q = shape.groups_in_flight(shape.extra_in_flight)
    return min(q[group] * shape.unit(group), shape.stream)


def _pipedream_versions(shape: Shape, stage: int) -> int:
    if any(n > 1 for n in shape.units):
        q = shape.groups_in_flight(shape.extra_in_flight)
        return min(q[stage], shape.stream // shape.unit(stage))
    if shape.vertical_sync:
        return shape.groups + shape.extra_in_flight
    return shape.groups - stage + shape.extra(stage) if shape.weight_stashing else 1


def _2bw_in_flight(shape: Shape, group: int) -> int:
    q = shape.groups_in_flight()
    return min(q[group] * shape.unit(group), shape.stream)


def _interleaved_in_flight(shape: Shape, group: int) -> int:
    P, M, v = shape.groups, shape.microbatches, shape.chunks
    if v == 1:
        return min(P - group, M)
    return min(2 * (P - group - 1) + (v - 1) * P + 1, M * v)


def _zb_h1_in_flight(shape: Shape, group: int) -> int:
    return min(shape.groups, shape.microbatches)


def _zb_h2_in_flight(shape: Shape, group: int) -> int:
    return min(2 * shape.groups - 1, shape.microbatches)


def _zb_v_in_flight(shape: Shape, group: int) -> int:
    return min(2 * shape.groups, 2 * shape.microbatches)


_SEQUENTIAL = "W(t+1) = W(t) - lr * mean_k g_s(k; W(t)), once per step of M microbatches"
_STEP_WEIGHTS = "W(t), the step's weights, forward and backward"


def _flush_row(
    name: str,
    in_flight: Callable[[Shape, int], int],
    in_flight_formula: str,
    *,
    chunked: bool = False,
    v_shaped: bool = False,
    round_robin: bool = False,
    split_backward: bool = False,
) -> ScheduleSemantics:
    """A flush schedule: sequential training, one weight version."""
    return ScheduleSemantics(
        name=name,
        streams=False,
        stale=False,
        chunked=chunked,
        v_shaped=v_shaped,
        round_robin=round_robin,
        split_backward=split_backward,
        updates_per_microbatch=False,
        options=(),
        in_flight=in_flight,
        versions=_one,
        in_flight_formula=in_flight_formula,
        versions_formula="1",
        update_rule=_SEQUENTIAL,
        weights=_STEP_WEIGHTS,
    )


_PIPEDREAM = ScheduleSemantics(
    name="pipedream",
    streams=True,
    stale=True,
    chunked=False,
    v_shaped=False,
    round_robin=True,
    split_backward=False,
    updates_per_microbatch=True,
    options=("vertical_sync", "weight_stashing", "extra_in_flight"),
    in_flight=_pipedream_in_flight,
    versions=_pipedream_versions,
    in_flight_formula="min(P - s + e_s, N); round-robin: min(q_s n_s, N)",
    versions_formula=(
        "P - s + e_s (weight stashing); P + e (vertical sync); 1 (no weight stashing); "
        "round-robin: min(q_s, N / n_s)"
    ),
    update_rule=(
        "W_s(k+1) = W_s(k) - lr * g_s(k; W(max(0, k - (P - s + e_s) + 1))), after every "
        "microbatch's backward; vertical sync: g_s(k; W(max(0, k - (P + e) + 1))); without "
        "weight stashing the backward uses the newest weights, version k; round-robin: "
        "W_s(u+1) = W_s(u) - lr * mean over group u (microbatches u n_s .. u n_s + n_s - 1) "
        "of g_s(k; W(max(0, u - q_s + 1))), once per group"
    ),
    weights=(
        "version max(0, k - (P - s + e_s) + 1), forward and backward; vertical sync: "
        "max(0, k - (P + e) + 1); without weight stashing the backward uses the newest, "
        "version k; round-robin: max(0, k // n_s - q_s + 1)"
    ),
)

_2BW = ScheduleSemantics(
    name="2bw",
    streams=True,
    stale=True,
    chunked=False,
    v_shaped=False,
    round_robin=True,
    split_backward=False,
    updates_per_microbatch=False,
    options=(),
    in_flight=_2bw_in_flight,
    versions=_two,
    in_flight_formula="min(q_s n_s, N) (min(P - s, N) without round-robin)",
    versions_formula="2",
    update_rule="W(t+1) = W(t) - lr * mean_k g_s(k; W(t-1)), W(-1) = W(0), per step of M",
    weights="W(t-1), version max(0, t - 1), for every microbatch of step t at every stage",
)

_TABLE = (
    _flush_row("gpipe", _gpipe_in_flight, "M", round_robin=True),
    _flush_row(
        "1f1b",
        _1f1b_in_flight,
        "min(q_s n_s, M) (min(P - s, M) without round-robin)",
        round_robin=True,
    ),
    _PIPEDREAM,
    _2BW,
    _flush_row(
        "interleaved",
        _interleaved_in_flight,
        "min(2 (P - d - 1) + (v - 1) P + 1, M v) (min(P - d, M) for v = 1)",
        chunked=True,
    ),
    _flush_row("zb-h1", _zb_h1_in_flight, "min(P, M)", split_backward=True),
    _flush_row("zb-h2", _zb_h2_in_flight, "min(2P - 1, M)", split_backward=True),
    _flush_row(
        "zb-v",
        _zb_v_in_flight,
        "min(2P, 2M) over the group's two stages",
        chunked=True,
        v_shaped=True,
        split_backward=True,
    ),
)

SEMANTICS: Mapping[str, ScheduleSemantics] = types.MappingProxyType({r.name: r for r in _TABLE})
"""Every schedule's :class:`ScheduleSemantics`, by name."""

SCHEDULES = tuple(SEMANTICS)
"""Schedule names, as :func:`~pdjax.schedules.generate.generate` and the
``pdjax simulate`` command accept them."""
STREAMING = tuple(r.name for r in _TABLE if r.streams)
"""One stream, no flush."""
FLUSHING = tuple(r.name for r in _TABLE if r.flushes)
"""A flush every step of ``M``: updates equal sequential training."""
STALE = tuple(r.name for r in _TABLE if r.stale)
"""Updates with gradients of older weights."""
CHUNKED = tuple(r.name for r in _TABLE if r.chunked)
"""Several stages per device group."""
ROUND_ROBIN = tuple(r.name for r in _TABLE if r.round_robin)
"""With a round-robin form."""
SPLIT_BACKWARD = tuple(r.name for r in _TABLE if r.split_backward)
"""The backward split into ``I`` and ``W``."""


def semantics(name: str) -> ScheduleSemantics:
    """The row of schedule ``name``.

    Raises:
        ScheduleError: for an unknown name.
    """
    row = SEMANTICS.get(name)
    if row is None:
        raise ScheduleError(f"unknown schedule {name!r}; accepted: {', '.join(SCHEDULES)}")
    return row


def stage_groups(name: str, groups: int, chunks: int = 1) -> tuple[int, ...]:
    """The device group of each (virtual) stage of schedule ``name`` over ``groups``
    device groups with ``chunks`` stages each: ``s % P`` (``interleaved`` and every
    one-stage-per-group schedule), or the V of ``zb-v`` (``chunks`` must be 2): stages
    ``0 .. P - 1`` on groups ``0 .. P - 1``, then stages ``P .. 2P - 1`` back on groups
    ``P - 1 .. 0``.

    >>> stage_groups("interleaved", 3, 2), stage_groups("zb-v", 3, 2)
    ((0, 1, 2, 0, 1, 2), (0, 1, 2, 2, 1, 0))
    """
    stages = groups * chunks
    row = SEMANTICS.get(name)
    if row is not None and row.v_shaped:
        return tuple(min(s, stages - 1 - s) for s in range(stages))
    return tuple(s % groups for s in range(stages))
