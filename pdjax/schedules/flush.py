"""The flush schedules with one backward and one stage per device group: GPipe and 1F1B
(PipeDream-Flush), with their :class:`~pdjax.schedules.kind.ScheduleKind`. Every step of
``M`` microbatches runs at one weight version and ends in an update of every stage;
:func:`flush_schedule` lays such steps out for every flush schedule (also interleaved 1F1B
and the zero-bubble ones)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdjax.schedules.actions import Action, Schedule
from pdjax.schedules.arguments import (
    check_multiple,
    positive,
    replicas_of,
    replication_of,
)
from pdjax.schedules.inflight import group_order, group_sizes, round_robin_in_flight
from pdjax.schedules.kind import GenerateArgs, ScheduleKind
from pdjax.schedules.semantics import Shape, flush_semantics

__all__ = ["FAMILY", "GPIPE", "ONE_F_ONE_B", "flush_schedule", "gpipe", "one_f_one_b",
           "one_f_one_b_order"]  # fmt: skip


def flush_schedule(
    kind: ScheduleKind,
    groups: int,
    chunks: int,
    per_step: int,
    steps: int,
    *,
    step_order: Callable[[int], list[tuple[str, int, int]]],
    replicas: Sequence[int] | None,
    replication: tuple[str, ...] = (),
) -> Schedule:
    """Repeats one step's order ``steps`` times, step ``t`` at version ``t``, then updates
    (each of the group's stages, in increasing order), as schedule ``kind``: its placement
    and its row's bounds."""
    stages = groups * chunks
    where = kind.stage_groups(groups, chunks)
    actions = []
    for d in range(groups):
        order = step_order(d)
        mine = [s for s in range(stages) if where[s] == d]
        acts = []
        for t in range(steps):
            acts += [Action(kind, s, t * per_step + k, t) for kind, s, k in order]
            acts += [Action("U", s, t, t) for s in mine]
        actions.append(tuple(acts))
    reps = replicas_of(replicas, groups)
    shape = Shape(groups, per_step, per_step * steps, chunks, group_sizes(reps, replication))
    row = kind.semantics
    return Schedule(
        name=kind.name,
        num_stages=stages,
        num_microbatches=per_step * steps,
        microbatches_per_step=per_step,
        actions=tuple(actions),
        stage_device=where,
        replicas=reps,
        in_flight_bound=tuple(row.in_flight(shape, d) for d in range(groups)),
        version_bound=tuple(row.versions(shape, s) for s in range(stages)),
        replication=replication,
    )


def one_f_one_b_order(
    num_stages: int, count: int, stage: int, extra: int = 0
) -> list[tuple[str, int]]:
    """1F1B order at ``stage``: warm-up forwards (``extra`` more than ``P - s - 1``), then
    forward/backward pairs, then drain."""
    warmup = min(num_stages - stage - 1 + extra, count)
    order = [("F", k) for k in range(warmup)]
    for k in range(count - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(count - warmup, count)]
    return order


def _checked_sizes(
    num_stages: int,
    num_microbatches: int,
    steps: int,
    replicas: Sequence[int] | None,
    replication: Sequence[str] | str | None,
) -> tuple[int, int, tuple[str, ...], tuple[int, ...]]:
    """A one-stage-per-group flush schedule's arguments, checked: ``P``, ``M``, the
    replication modes and each group's microbatches per action (``M`` a multiple of each).

    Raises:
        ScheduleError: for a parameter out of range.
    """
    P = positive("num_stages (P)", num_stages)
    M = positive("num_microbatches (M)", num_microbatches)
    positive("steps", steps)
    reps = replicas_of(replicas, P)
    mode = replication_of(replication, reps)
    units = group_sizes(reps, mode)
    check_multiple("num_microbatches (M)", M, units)
    return P, M, mode, units


def gpipe(
    num_stages: int,
    num_microbatches: int,
    *,
    steps: int = 1,
    replicas: Sequence[int] | None = None,
    replication: Sequence[str] | str | None = None,
) -> Schedule:
    """GPipe: all forwards of a step, then all backwards (last microbatch first), then update.

    Versions: every action of step ``t`` uses version ``t``; ``U(s, t)`` makes ``t + 1``.
    In flight: ``M`` at every stage. Versions kept: 1.

    Args:
        num_stages: ``P``, stages (one device group each).
        num_microbatches: ``M``, microbatches per step.
        steps: optimizer steps to lay out.
        replicas: devices per stage (default 1 each).

    Raises:
        ScheduleError: for a parameter out of range.

    >>> from pdjax.schedules import format_actions
    >>> print(format_actions(gpipe(2, 2).actions))
    g0: 0F0 0F1 0B1 0B0 0U0
    g1: 1F0 1F1 1B1 1B0 1U0
    """
    P, M, mode, units = _checked_sizes(num_stages, num_microbatches, steps, replicas, replication)

    def order(s: int) -> list[tuple[str, int, int]]:
        ks = range(0, M, units[s])
        return [("F", s, k) for k in ks] + [("B", s, k) for k in reversed(ks)]

    return flush_schedule(
        GPIPE, P, 1, M, steps, step_order=order, replicas=replicas, replication=mode
    )


def one_f_one_b(
    num_stages: int,
    num_microbatches: int,
    *,
    steps: int = 1,
    replicas: Sequence[int] | None = None,
    replication: Sequence[str] | str | None = None,
) -> Schedule:
    """1F1B with a flush (PipeDream-Flush): ``P - s - 1`` warm-up forwards, then F/B pairs.

    Versions: every action of step ``t`` uses version ``t``; ``U(s, t)`` makes ``t + 1``.
    In flight at stage ``s``: at most ``min(P - s, M)``. Versions kept: 1.

    With round-robin stages (``replication``) every stage runs 1F1B over its groups of
    ``n_s`` microbatches (``n_s``: its replicas if round-robin, else 1) with ``q_s``
    groups in flight (:func:`~pdjax.schedules.inflight.round_robin_in_flight`:
    at least ``ceil(W_s / n_s)``, ``W_s = n_s + ... + n_{P-1}``, and more where groups of
    unequal sizes need it to meet without a deadlock and to run at full rate): at most
    ``min(q_s n_s, M)`` microbatches. ``M`` must be a multiple of every ``n_s``.

    Args:
        num_stages: ``P``, stages (one device group each).
        num_microbatches: ``M``, microbatches per step.
        steps: optimizer steps to lay out.
        replicas: devices per stage (default 1 each).

    Raises:
        ScheduleError: for a parameter out of range.
    """
    P, M, mode, units = _checked_sizes(num_stages, num_microbatches, steps, replicas, replication)

    q = round_robin_in_flight(units)

    def order(s: int) -> list[tuple[str, int, int]]:
        n = units[s]
        return [(kind, s, g * n) for kind, g in group_order(M // n, q[s] - 1)]

    return flush_schedule(
        ONE_F_ONE_B, P, 1, M, steps, step_order=order, replicas=replicas, replication=mode
    )


def _gpipe_in_flight(shape: Shape, group: int) -> int:
    return shape.microbatches


def _1f1b_in_flight(shape: Shape, group: int) -> int:
    q = shape.groups_in_flight()
    return min(q[group] * shape.unit(group), shape.microbatches)


def _build_gpipe(a: GenerateArgs) -> Schedule:
    return gpipe(
        a.num_stages, a.num_microbatches, steps=a.steps, replicas=a.replicas,
        replication=a.replication,
    )  # fmt: skip


def _build_1f1b(a: GenerateArgs) -> Schedule:
    return one_f_one_b(
        a.num_stages, a.num_microbatches, steps=a.steps, replicas=a.replicas,
        replication=a.replication,
    )  # fmt: skip


GPIPE = ScheduleKind(
    semantics=flush_semantics("gpipe", _gpipe_in_flight, "M", round_robin=True),
    build=_build_gpipe,
)
"""GPipe."""
ONE_F_ONE_B = ScheduleKind(
    semantics=flush_semantics(
        "1f1b",
        _1f1b_in_flight,
        "min(q_s n_s, M) (min(P - s, M) without round-robin)",
        round_robin=True,
    ),
    build=_build_1f1b,
)
"""1F1B with a flush (PipeDream-Flush)."""

FAMILY = (GPIPE, ONE_F_ONE_B)
"""This module's schedules, in the order they are listed."""
