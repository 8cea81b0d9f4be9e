"""The flush schedules with one backward: GPipe, 1F1B (PipeDream-Flush) and interleaved
1F1B. Every step of ``M`` microbatches runs at one weight version and ends in an update of
every stage."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdjax.errors import ScheduleError
from pdjax.schedules.actions import Action, Schedule
from pdjax.schedules.arguments import (
    check_multiple,
    positive,
    replicas_of,
    replication_of,
)
from pdjax.schedules.inflight import group_order, group_sizes, round_robin_in_flight
from pdjax.schedules.semantics import Shape, semantics, stage_groups

__all__ = ["flush_schedule", "gpipe", "interleaved", "one_f_one_b", "one_f_one_b_order"]


def flush_schedule(
    name: str,
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
    (each of the group's stages, in increasing order); the bounds are the table's."""
    stages = groups * chunks
    where = stage_groups(name, groups, chunks)
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
    row = semantics(name)
    return Schedule(
        name=name,
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
    P = positive("num_stages (P)", num_stages)
    M = positive("num_microbatches (M)", num_microbatches)
    positive("steps", steps)
    reps = replicas_of(replicas, P)
    mode = replication_of(replication, reps, "gpipe")
    units = group_sizes(reps, mode)
    check_multiple("num_microbatches (M)", M, units)

    def order(s: int) -> list[tuple[str, int, int]]:
        ks = range(0, M, units[s])
        return [("F", s, k) for k in ks] + [("B", s, k) for k in reversed(ks)]

    return flush_schedule(
        "gpipe", P, 1, M, steps, step_order=order, replicas=replicas, replication=mode
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
    P = positive("num_stages (P)", num_stages)
    M = positive("num_microbatches (M)", num_microbatches)
    positive("steps", steps)
    reps = replicas_of(replicas, P)
    mode = replication_of(replication, reps, "1f1b")
    units = group_sizes(reps, mode)
    check_multiple("num_microbatches (M)", M, units)

    q = round_robin_in_flight(units)

    def order(s: int) -> list[tuple[str, int, int]]:
        n = units[s]
        return [(kind, s, g * n) for kind, g in group_order(M // n, q[s] - 1)]

    return flush_schedule(
        "1f1b", P, 1, M, steps, step_order=order, replicas=replicas, replication=mode
    )


def interleaved(
    num_stages: int,
    num_microbatches: int,
    chunks: int = 2,
    *,
    steps: int = 1,
    num_layers: int | None = None,
    replicas: Sequence[int] | None = None,
) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): ``v`` model chunks per device group.

    Device group ``d`` holds the virtual stages ``d, d + P, ..., d + (v - 1) P``. Forwards
    go through microbatches in groups of ``P``, chunk by chunk; backwards likewise with the
    chunks reversed. Group ``d`` warms up with ``2 (P - d - 1) + (v - 1) P`` forwards, then
    alternates. With per-chunk costs ``F / v`` and ``B / v`` the bubble is 1F1B's divided
    by ``v``. ``chunks=1`` is :func:`one_f_one_b`'s order.

    Versions: every action of step ``t`` uses version ``t``; each virtual stage's
    ``U(s, t)`` makes ``t + 1``. In flight at group ``d`` (over its chunks): at most
    ``min(2 (P - d - 1) + (v - 1) P + 1, M v)``. Versions kept: 1.

    Args:
        num_stages: ``P``, device groups (the schedule has ``P * chunks`` virtual stages).
        num_microbatches: ``M``, microbatches per step; a multiple of ``P`` when
            ``chunks > 1``.
        chunks: ``v``, model chunks per device group.
        steps: optimizer steps to lay out.
        num_layers: if given, the layer count to split into ``P * chunks`` equal stages.
        replicas: devices per device group (default 1 each).

    Raises:
        ScheduleError: for a parameter out of range, ``M`` not a multiple of ``P``, or a
            layer count that ``P * chunks`` does not divide.
    """
    P = positive("num_stages (P)", num_stages)
    M = positive("num_microbatches (M)", num_microbatches)
    v = positive("chunks (v)", chunks)
    positive("steps", steps)
    if num_layers is not None:
        positive("num_layers", num_layers)
        if num_layers % (P * v):
            fits = [c for c in range(1, num_layers // P + 1) if num_layers % (P * c) == 0]
            raise ScheduleError(
                f"interleaved: chunks={v} over P={P} device groups needs a layer count divisible "
                f"by P * chunks = {P * v}; got num_layers={num_layers}. Accepted chunks for "
                f"{num_layers} layers and P={P}: {fits or 'none (use fewer device groups)'}"
            )
    if v > 1 and M % P:
        raise ScheduleError(
            f"interleaved with chunks={v} needs num_microbatches (M) a multiple of "
            f"num_stages (P={P}); got M={M}. Accepted: M in {{{P}, {2 * P}, {3 * P}, ...}}"
        )
    total = M * v

    def position(i: int, backward: bool) -> tuple[int, int]:
        group, rest = divmod(i, P * v)
        chunk = rest // P
        return (v - 1 - chunk if backward else chunk), group * P + rest % P

    def warmup(d: int) -> int:
        return min(2 * (P - d - 1) + (v - 1) * P, total)

    def order(d: int) -> list[tuple[str, int, int]]:
        if v == 1:
            return [(kind, d, k) for kind, k in one_f_one_b_order(P, M, d)]
        out = []
        for i in range(warmup(d)):
            chunk, k = position(i, False)
            out.append(("F", d + chunk * P, k))
        for i in range(total - warmup(d)):
            chunk, k = position(warmup(d) + i, False)
            out.append(("F", d + chunk * P, k))
            chunk, k = position(i, True)
            out.append(("B", d + chunk * P, k))
        for i in range(total - warmup(d), total):
            chunk, k = position(i, True)
            out.append(("B", d + chunk * P, k))
        return out

    return flush_schedule("interleaved", P, v, M, steps, step_order=order, replicas=replicas)
