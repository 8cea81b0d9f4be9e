"""The schedules as the planner sees them: each schedule's row of the semantics table and
the cost model's own knobs, and what the cost terms take from them (microbatches in flight,
weight versions, all-reduces per microbatch, replication modes).

What a schedule computes (whether it streams or flushes, updates once per microbatch or
per step, takes round-robin replication, how many weight versions it keeps) is read from
its row of :data:`pdjax.schedules.SEMANTICS`, and how the cost model prices it (see
:mod:`pdjax.partition.pricing.cost`) from the planner's own knobs here (:data:`_PRICING`): a new
schedule needs a row there only where the defaults (1F1B's depth ``P - s``, the round-trip
bound, priced as itself) do not hold.

>>> bw, pd = SCHEDULE_TRAITS["2bw"], SCHEDULE_TRAITS["pipedream"]
>>> bw.flush, bw.versions, pd.versions
(False, 2, 'in_flight')
>>> in_flight("pipedream", 4, 0, 8), in_flight("1f1b", 4, 0, 2), in_flight("gpipe", 4, 3, 8)
(4, 2, 8)
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdjax.errors import PlanError, ScheduleError
from pdjax.schedules import (
    IN_FLIGHT,
    ROUND_ROBIN,
    SCHEDULE_KINDS,
    SEMANTICS,
    ScheduleKind,
    ScheduleSemantics,
    Shape,
    group_sizes,
    round_robin_in_flight,
)
from pdjax.schedules.kind import stages_from

__all__ = [
    "REPLICATION_OPTIONS",
    "SCHEDULE_TRAITS",
    "ScheduleTraits",
    "check_in_flight",
    "in_flight",
    "versions_kept",
]

REPLICATION_OPTIONS: tuple[str, ...] = ("auto", "split", "round-robin")
"""The planner's ``replication`` option: ``"auto"`` (the cheaper mode), ``"split"`` or
``"round-robin"`` for every replicated stage."""


@dataclasses.dataclass(frozen=True)
class ScheduleTraits:
    """What the planner knows of a schedule: its row of the semantics table and the cost
    model's knobs.

    Attributes:
      semantics: the schedule's row of :data:`~pdjax.schedules.SEMANTICS`, read
        for every fact of what the schedule computes.
      depth: ``(P, s) -> count``, the microbatches the memory model charges stage ``s`` of
        ``P`` (at most ``M`` under a flushing schedule), or None for all ``M`` of a step
        (``gpipe``). ``P - s`` by default, also for ``zb-h1`` (the table counts its
        microbatches until the deferred ``W``: ``min(P, M)``). It is also the kind's
        in-flight count in the ``pdjax`` round trip (:func:`exact_in_flight` of split
        stages), which the planner's round-trip search reads for every pipeline length
        (:func:`pdjax.partition.search.round_trip.round_trip_passes`).
      round_trip: whether the ``pdjax`` objective has the round-trip bound: not for
        ``gpipe`` (``M`` in flight, its flush bubble is outside every model) nor for
        ``interleaved`` (its in-flight count depends on the chunks, which the planner does
        not know).
      priced_as: the schedule the dynamic program prices in its place (None: itself); the
        simulator then picks among the program's partitions.
    """

    semantics: ScheduleSemantics
    depth: Callable[[int, int], int] | None = stages_from
    round_trip: bool = True
    priced_as: str | None = None

    @classmethod
    def of(cls, kind: ScheduleKind) -> ScheduleTraits:
        """The traits of schedule ``kind``: its row and the planner's knobs for it."""
        return cls(kind.semantics, **_PRICING.get(kind.name, {}))

    @property
    def priced(self) -> str:
        """The schedule the dynamic program prices for this one (:attr:`priced_as`)."""
        return self.priced_as or self.name

    @property
    def name(self) -> str:
        return self.semantics.name

    @property
    def pipelined_in_flight(self) -> bool:
        """Stage ``s`` holds a depth of microbatches (1F1B-style), not all ``M`` (GPipe)."""
        return self.depth is not None

    @property
    def flush(self) -> bool:
        """The pipeline drains every ``M`` microbatches."""
        return self.semantics.flushes

    @property
    def update_per_microbatch(self) -> bool:
        """Every microbatch (group under round-robin) ends in an optimizer update and an
        all-reduce of a replicated stage; else one per step of ``M``."""
        return self.semantics.updates_per_microbatch

    @property
    def versions(self) -> str | int:
        """Weight versions kept per stage: ``"in_flight"`` with weight stashing (one per
        microbatch in flight: the table's ``P - s + e``, ``e = 0``), else the table's
        number."""
        if "weight_stashing" in self.semantics.options:
            return "in_flight"
        return self.semantics.versions(Shape(groups=1, microbatches=1, stream=1), 0)


_PRICING: Mapping[str, Mapping[str, Any]] = {
    # all M of a step in flight; its flush bubble is outside every cost model
    "gpipe": {"depth": None, "round_trip": False},
    # its in-flight count depends on chunks the planner does not know
    "interleaved": {"round_trip": False},
    # 2 (P - s) - 1 warm-up forwards with W deferred: 2P - 1 at every stage
    "zb-h2": {"depth": lambda P, s: 2 * P - 1, "priced_as": "zb-h1"},
    # P stage-microbatches (2P half-stage chunks) on every group
    "zb-v": {"depth": lambda P, s: P, "priced_as": "zb-h1"},
    # zb-h1: 1F1B's P - s (the table counts its microbatches until the deferred W, min(P, M))
}
"""The cost model's knobs per schedule, where they differ from :class:`ScheduleTraits`'
defaults (planner facts, kept apart from the schedules' own definitions)."""

SCHEDULE_TRAITS: Mapping[str, ScheduleTraits] = types.MappingProxyType(
    {name: ScheduleTraits.of(kind) for name, kind in SCHEDULE_KINDS.items()}
)
"""Every schedule's :class:`ScheduleTraits`, by name (the table's names)."""


def schedule_traits(name: str) -> ScheduleTraits:
    """The traits of schedule ``name``. Raises PlanError for an unknown name."""
    if name not in SCHEDULE_TRAITS:
        raise PlanError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_TRAITS)}")
    return SCHEDULE_TRAITS[name]


def in_flight(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    """Microbatches stage ``stage`` holds between forward and backward, at most, as the
    memory model charges them (:attr:`ScheduleTraits.depth`).

    ``P - s`` for 1F1B-style schedules (capped at ``M`` when the schedule flushes every
    ``M`` microbatches), ``M`` for GPipe, ``min(2P - 1, M)`` at every stage for ``zb-h2``
    and ``min(P, M)`` per device group for ``zb-v``.

    >>> in_flight("zb-h2", 4, 3, 8), in_flight("2bw", 4, 0, 2)
    (7, 4)
    """
    traits = schedule_traits(schedule)
    if traits.depth is None:
        return num_microbatches
    n = traits.depth(num_stages, stage)
    return min(n, num_microbatches) if traits.flush else n


def versions_kept(schedule: str, in_flight_count: int) -> int:
    """Weight versions a stage keeps: the in-flight count with weight stashing, else 1 or 2."""
    v = schedule_traits(schedule).versions
    return in_flight_count if v == "in_flight" else int(v)


def groups_in_flight(
    units: tuple[int, ...] | list[int], in_flight: str = "full-rate"
) -> tuple[int, ...]:
    """``q_s``: groups in flight at each stage of a 1F1B-style order over groups, as the
    schedule generators keep them (:func:`pdjax.schedules.round_robin_in_flight`,
    without ``pipedream``'s ``extra_in_flight``), by ``pipedream``'s ``in_flight``
    (``"paper"``: PipeDream's NOAM at the input stage, fewer groups where the stage
    before cannot feed more). With every ``n_s = 1`` it is ``P - s`` either way.

    >>> groups_in_flight([15, 1]), groups_in_flight([1, 1, 1]), groups_in_flight([1, 15])
    ((2, 1), (3, 2, 1), (30, 1))
    >>> groups_in_flight([1, 3, 1]), groups_in_flight([1, 3, 1], "paper")
    ((9, 2, 1), (5, 1, 1))

    Raises:
      PlanError: an unknown ``in_flight``, or ``"paper"`` for groups it cannot run without
        a deadlock (replicas 1-5-2: the message names the full-rate counts).
    """
    try:
        return round_robin_in_flight(units, in_flight=in_flight)
    except ScheduleError as err:  # the planner's callers handle PlanError
        raise PlanError(str(err)) from None


def check_in_flight(schedule: str, in_flight: str) -> None:
    """Raises PlanError for an ``in_flight`` the planner cannot price under ``schedule``:
    not one of :data:`pdjax.schedules.IN_FLIGHT`, or ``"paper"`` under a schedule that
    does not take the option (``pipedream`` alone does)."""
    if in_flight not in IN_FLIGHT:
        raise PlanError(f"in_flight must be one of {IN_FLIGHT}; got {in_flight!r}")
    kind = SCHEDULE_KINDS.get(schedule)
    if in_flight != "full-rate" and (kind is None or not kind.takes("in_flight")):
        takes = [n for n, k in SCHEDULE_KINDS.items() if k.takes("in_flight")]
        raise PlanError(
            f"in_flight={in_flight!r} is an option of {', '.join(takes)}, not of {schedule}"
        )


def stage_units(replicas: Sequence[int], replication: Sequence[str]) -> list[int]:
    """``n_s``: a round-robin stage's replicas, 1 for a split one
    (:func:`pdjax.schedules.group_sizes`)."""
    return list(group_sizes(replicas, replication))


def _split_in_flight(schedule: str, P: int, num_microbatches: int) -> list[tuple[int, int]]:
    """:func:`exact_in_flight` without round-robin stages: :func:`in_flight` per stage."""
    out = []
    for s in range(P):
        count = in_flight(schedule, P, s, num_microbatches)
        out.append((count, versions_kept(schedule, count)))
    return out


def exact_in_flight(
    schedule: str,
    replicas: Sequence[int],
    replication: Sequence[str],
    num_microbatches: int,
    in_flight: str = "full-rate",
) -> list[tuple[int, int]]:
    """Per stage ``(in_flight, versions)``: microbatches in flight over the stage's devices
    and weight versions kept, as the schedule ``schedule`` with these replication modes
    holds them (a ``pipedream`` stream of at least ``in_flight`` microbatches). With
    round-robin stages, the semantics table's bounds, with the groups in flight of
    ``pipedream``'s ``in_flight`` option (:func:`groups_in_flight`; the same counts the
    validator recomputes for a ``"paper"`` schedule).

    >>> exact_in_flight("pipedream", [15, 1], ("round-robin", "split"), 16)
    [(30, 2), (1, 1)]
    >>> exact_in_flight("1f1b", [2, 1, 1], ("split",) * 3, 2)
    [(2, 1), (2, 1), (1, 1)]
    >>> rr = ("split", "round-robin", "split")
    >>> exact_in_flight("pipedream", [1, 3, 1], rr, 1, "paper")
    [(5, 5), (3, 1), (1, 1)]

    Raises:
      PlanError: ``in_flight`` the schedule does not take, or ``"paper"`` for groups it
        cannot run (:func:`groups_in_flight`).
    """
    check_in_flight(schedule, in_flight)
    P = len(replicas)
    if "round-robin" not in replication:  # (both counts are P - s without groups)
        return _split_in_flight(schedule, P, num_microbatches)
    _check_round_robin(schedule, "use replication='split'")
    units = tuple(stage_units(replicas, replication))
    # a stream long enough for every stage to reach its bound
    q = groups_in_flight(units, in_flight)
    steady = max(x * n for x, n in zip(q, units, strict=True))
    shape = Shape(
        groups=P, microbatches=num_microbatches, stream=steady, units=units, in_flight=in_flight
    )
    row = SEMANTICS[schedule]
    return [(row.in_flight(shape, s), row.versions(shape, s)) for s in range(P)]


def updates_per_microbatch(schedule: str, num_microbatches: int) -> float:
    """``1/u``: optimizer updates (and all-reduces) per microbatch under ``schedule``."""
    return 1.0 if schedule_traits(schedule).update_per_microbatch else 1.0 / num_microbatches


def allreduces_per_microbatch(
    schedule: str, num_microbatches: int, replication: str, replicas: int
) -> float:
    """``1/u``: all-reduces per microbatch of a stage on ``replicas`` units replicated
    ``replication`` (``"split"`` or ``"round-robin"``) under ``schedule``."""
    if schedule_traits(schedule).update_per_microbatch:
        return 1.0 / replicas if replication == "round-robin" else 1.0
    return 1.0 / num_microbatches


def has_round_trip(schedule: str, model: str = "pdjax") -> bool:
    """Whether the ``model``'s objective has the round-trip bound under ``schedule``
    (:attr:`ScheduleTraits.round_trip`, ``pdjax`` only)."""
    return model == "pdjax" and schedule_traits(schedule).round_trip


def _check_round_robin(schedule: str, hint: str) -> None:
    """Raises PlanError if ``schedule`` has no round-robin form (the table's
    :data:`~pdjax.schedules.ROUND_ROBIN`)."""
    if schedule not in ROUND_ROBIN:
        raise PlanError(
            f"round-robin replication runs with {', '.join(ROUND_ROBIN)}, not {schedule}; {hint}"
        )


def check_replication(
    replication: str | tuple[str, ...] | list[str], schedule: str, cost_model: str
) -> None:
    """Raises PlanError for a replication option the planner cannot honour."""
    modes = [replication] if isinstance(replication, str) else list(replication)
    for mode in modes:
        if mode not in REPLICATION_OPTIONS:
            raise PlanError(
                f"replication must be one of {', '.join(REPLICATION_OPTIONS)}; got {mode!r}"
            )
    if "round-robin" in modes:
        _check_round_robin(schedule, "use replication='split' (or 'auto')")


def resolve_replication(option: str, schedule: str, cost_model: str) -> str:
    """The mode ``"auto"`` stands for: ``"round-robin"`` where it is cheaper (a schedule
    that updates every microbatch, ``pipedream``, under the ``pdjax`` cost model: one
    all-reduce per group instead of per microbatch), else ``"split"`` (the modes cost the
    same all-reduce under the other schedules, and the ``paper`` and ``pipedream-code``
    models price PipeDream's replication whatever pdjax records)."""
    if option != "auto":
        return option
    if cost_model == "pdjax" and schedule_traits(schedule).update_per_microbatch:
        return "round-robin"
    return "split"
