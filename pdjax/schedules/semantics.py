"""What a schedule computes: the row type of the semantics table
(:class:`ScheduleSemantics`: whether it streams or flushes, updates with stale weights,
holds several stages per device group, takes round-robin replication or splits the
backward, and how many microbatches and weight versions it keeps), the sizes its bounds
depend on (:class:`Shape`) and what the flush schedules share.

Each schedule's row is defined with its generator, in the module of its family, and
:mod:`~pdjax.schedules.registry` gathers them into :data:`~pdjax.schedules.SEMANTICS`,
which mirrors the table in ``docs/semantics.md#the-schedules-at-a-glance``. The
generators read their bounds from their row (:attr:`ScheduleSemantics.in_flight`,
:attr:`ScheduleSemantics.versions`); the validator recomputes them on its own and
``tests/test_schedule_semantics.py`` checks that the two agree.

Notation: ``P`` device groups, ``s`` a stage (or ``d`` a device group), ``M`` microbatches
per step, ``N`` the stream length, ``v`` chunks per group, ``e`` pipedream's
``extra_in_flight`` and ``e_s`` its part at stage ``s`` (``e`` for ``s < P - 1``, 0 at the
last stage), ``n_s`` the microbatches one action of stage ``s`` covers (its replicas
under round-robin, else 1) and ``q_s`` the groups in flight there
(:func:`~pdjax.schedules.inflight.round_robin_in_flight`, or
:func:`~pdjax.schedules.inflight.paper_in_flight` under pipedream's ``in_flight="paper"``;
``P - s + e_s`` when every ``n_s = 1``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdjax.schedules.inflight import group_sizes, round_robin_in_flight

if TYPE_CHECKING:
    from pdjax.schedules.actions import Schedule

__all__ = [
    "SEQUENTIAL",
    "STEP_WEIGHTS",
    "ScheduleSemantics",
    "Shape",
    "flush_semantics",
    "one_version",
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
        in_flight: pipedream's option, ``"full-rate"`` or ``"paper"``: the groups in flight
            at round-robin stages (:data:`~pdjax.schedules.inflight.IN_FLIGHT`).
    """

    groups: int
    microbatches: int
    stream: int
    chunks: int = 1
    units: tuple[int, ...] = ()
    extra_in_flight: int = 0
    vertical_sync: bool = False
    weight_stashing: bool = True
    in_flight: str = "full-rate"

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
            in_flight=schedule.in_flight,
        )

    def unit(self, group: int) -> int:
        """``n_d``: microbatches one action of ``group`` covers."""
        return self.units[group] if self.units else 1

    def extra(self, stage: int) -> int:
        """``e`` at ``stage``: none at the last stage (it has no round trip to hide)."""
        return self.extra_in_flight if stage < self.groups - 1 else 0

    def groups_in_flight(self, extra: int = 0) -> tuple[int, ...]:
        """``q_s`` per stage (with ``extra`` latency hiding), by :attr:`in_flight`."""
        return round_robin_in_flight(self.units or (1,) * self.groups, extra, self.in_flight)


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


def one_version(shape: Shape, stage: int) -> int:
    """One weight version at every stage (the flush schedules)."""
    return 1


SEQUENTIAL = "W(t+1) = W(t) - lr * mean_k g_s(k; W(t)), once per step of M microbatches"
"""The update rule of every flush schedule: sequential training."""
STEP_WEIGHTS = "W(t), the step's weights, forward and backward"
"""The weights every microbatch of a flush schedule uses."""


def flush_semantics(
    name: str,
    in_flight: Callable[[Shape, int], int],
    in_flight_formula: str,
    *,
    chunked: bool = False,
    v_shaped: bool = False,
    round_robin: bool = False,
    split_backward: bool = False,
) -> ScheduleSemantics:
    """The row of a flush schedule: sequential training, one weight version."""
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
        versions=one_version,
        in_flight_formula=in_flight_formula,
        versions_formula="1",
        update_rule=SEQUENTIAL,
        weights=STEP_WEIGHTS,
    )
