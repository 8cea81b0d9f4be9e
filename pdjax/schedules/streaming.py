"""The streaming schedules: PipeDream (asynchronous 1F1B with weight stashing, an update
after every microbatch) and PipeDream-2BW (1F1B without a flush, one update per ``M``
microbatches, two weight versions). Both run one stream of ``N`` microbatches.

Round-robin replication in :func:`pipedream` (PipeDream's own, ``replication``): a stage
``s`` on ``r`` devices takes groups of ``n_s = r`` consecutive microbatches, one per device,
and updates once per group with their mean gradient (``U(s, u)`` applies group ``u``,
microbatches ``u n_s .. u n_s + n_s - 1``, and makes version ``u + 1``); any other stage
has ``n_s = 1``. Stage ``s`` runs 1F1B over its groups with ``q_s`` groups in flight, as
:func:`~pdjax.schedules.inflight.round_robin_in_flight` counts them (with
``e = extra_in_flight`` added at every stage but the last): at least ``ceil(W_s / n_s)``,
``W_s = n_s + ... + n_{P-1}`` (the microbatch slots from ``s`` on; PipeDream's NOAM at
stage 0), and at least what lets groups of unequal sizes meet without a deadlock, then
more, from the last stage back, until a balanced pipeline runs at full rate (replicas
``(1, 2)`` give ``q = (4, 1)``). Microbatch ``k``, in group ``g = k // n_s``, runs ``F``
and ``B`` at version ``max(0, g - q_s + 1)``: the updates of the groups ``0 .. g - q_s``,
whose backwards ran before its forward. Versions kept: ``min(q_s, N / n_s)``; in flight:
``min(q_s n_s, N)`` microbatches. With every ``n_s = 1`` this is the formula of
:func:`pipedream`'s docstring (``q_s = P - s + e``). ``N`` must be a multiple of every
``n_s``; vertical sync and ``weight_stashing=False`` are not defined with round-robin
stages.

``in_flight="paper"`` keeps PipeDream's own count instead
(:func:`~pdjax.schedules.inflight.paper_in_flight`): ``q_0 = NOAM = ceil(W_0 / n_0)`` at the
input stage, and at each later stage PipeDream's ``ceil(W_s / n_s)``, or fewer where the
stage before cannot feed that many whole groups; the same 1F1B order over groups and the
same formulas with these ``q_s``, so stage ``s`` is ``q_s - 1`` updates stale (``NOAM - 1``
at the input stage, against ``q_0 - 1`` at full rate: 1-3-1 gives ``q = (5, 1, 1)``
against ``(9, 2, 1)``). It runs below full rate where the counts differ (a group moves at
once, and fewer of them fill the pipeline), and is refused where the input stage would
need more than NOAM groups not to deadlock. Without round-robin stages the two counts
are the same, ``P - s``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdjax.errors import ScheduleError
from pdjax.schedules.actions import Action, Schedule
from pdjax.schedules.arguments import (
    check_multiple,
    positive,
    replicas_of,
    replication_of,
)
from pdjax.schedules.flush import one_f_one_b_order
from pdjax.schedules.inflight import IN_FLIGHT, group_order, group_sizes, round_robin_in_flight
from pdjax.schedules.kind import GenerateArgs, ScheduleKind
from pdjax.schedules.semantics import ScheduleSemantics, Shape

__all__ = ["FAMILY", "PIPEDREAM", "PIPEDREAM_2BW", "pipedream", "pipedream_2bw"]


def _bounds(kind: ScheduleKind, shape: Shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The in-flight and versions-kept bounds of ``shape`` in ``kind``'s row."""
    row = kind.semantics
    P = shape.groups
    return (
        tuple(row.in_flight(shape, d) for d in range(P)),
        tuple(row.versions(shape, s) for s in range(P)),
    )


def pipedream(
    num_stages: int,
    num_microbatches: int,
    *,
    vertical_sync: bool = False,
    weight_stashing: bool = True,
    replicas: Sequence[int] | None = None,
    extra_in_flight: int = 0,
    replication: Sequence[str] | str | None = None,
    in_flight: str = "full-rate",
) -> Schedule:
    """PipeDream: asynchronous 1F1B over a stream, an update after every backward.

    Stage ``s`` warms up with ``P - s - 1`` forwards, then runs ``F``, ``B``, ``U`` for each
    microbatch, no flush. ``U(s, k)`` applies microbatch ``k``'s gradient and makes version
    ``k + 1``.

    Versions, for microbatch ``k`` at stage ``s``:

    - default (weight stashing): ``F`` and ``B`` use ``max(0, k - (P - s) + 1)``;
      versions kept: ``P - s``;
    - ``vertical_sync=True``: ``F`` and ``B`` use ``max(0, k - P + 1)``, the version stage 0
      used; versions kept: up to ``P``;
    - ``weight_stashing=False``: ``F`` as above; ``B`` uses the newest weights, which at
      stage ``s`` is version ``k`` (updates ``0 .. k - 1`` have run), written out in the
      action; versions kept: 1 (``P`` with vertical sync).

    In flight at stage ``s``: at most ``min(P - s, N)``.

    ``extra_in_flight = e`` (latency hiding): every stage but the last warms up with ``e``
    more forwards, so ``P - s + e`` microbatches are in flight there and a delay of up to
    ``e`` periods on the activation/gradient round trip no longer stalls the stage (the
    last stage has no round trip to hide). Each extra microbatch costs one more stashed
    version and one more stashed activation per stage, and one more update of staleness:
    ``P - s`` becomes ``P - s + e`` for ``s < P - 1`` in every formula above (``P`` becomes
    ``P + e`` with vertical sync).

    Round-robin replication (PipeDream's own, ``replication``): a stage on ``r`` devices
    takes whole microbatches, one per device, and updates once per group of ``r`` of them;
    its versions and in-flight bounds are in the module docstring.

    Args:
        num_stages: ``P``, stages (one device group each).
        num_microbatches: ``N``, the stream length.
        vertical_sync: every stage uses stage 0's version for each microbatch.
        weight_stashing: the backward reuses the forward's version.
        replicas: devices per stage (default 1 each).
        extra_in_flight: ``e >= 0``, microbatches in flight beyond 1F1B's ``P - s``.
        replication: per stage ``"split"`` or ``"round-robin"`` (or one word for all).
        in_flight: the groups in flight at round-robin stages: ``"full-rate"`` (enough
            for full rate) or ``"paper"`` (PipeDream's NOAM at the input stage); see the
            module docstring. The same ``P - s`` without round-robin stages.

    Raises:
        ScheduleError: for a parameter out of range, ``in_flight="paper"`` with
            ``extra_in_flight``, or round-robin groups that cannot run with NOAM groups
            at the input stage under ``in_flight="paper"``.
    """
    P = positive("num_stages (P)", num_stages)
    N = positive("num_microbatches (N, the stream length)", num_microbatches)
    e = positive("extra_in_flight", extra_in_flight, minimum=0)
    if in_flight not in IN_FLIGHT:
        raise ScheduleError(f"in_flight must be one of {IN_FLIGHT}; got {in_flight!r}")
    if in_flight == "paper" and e:
        raise ScheduleError(
            f"in_flight='paper' keeps PipeDream's own count, NOAM at the input stage; "
            f"extra_in_flight={e} would add to it: pass extra_in_flight=0, or "
            "in_flight='full-rate' for latency hiding"
        )
    reps = replicas_of(replicas, P)
    mode = replication_of(replication, reps)
    if mode:
        return _pipedream_round_robin(
            P,
            N,
            e,
            reps,
            mode,
            vertical_sync=vertical_sync,
            weight_stashing=weight_stashing,
            in_flight=in_flight,
        )
    shape = Shape(P, 1, N, extra_in_flight=e, vertical_sync=vertical_sync,
                  weight_stashing=weight_stashing, in_flight=in_flight)  # fmt: skip
    bound, versions = _bounds(PIPEDREAM, shape)
    return Schedule(
        name="pipedream",
        num_stages=P,
        num_microbatches=N,
        microbatches_per_step=1,
        actions=_pipedream_actions(P, N, e, vertical_sync, weight_stashing),
        stage_device=tuple(range(P)),
        replicas=reps,
        vertical_sync=vertical_sync,
        weight_stashing=weight_stashing,
        extra_in_flight=e,
        in_flight_bound=bound,
        version_bound=versions,
        in_flight=in_flight,
    )


def _pipedream_actions(
    P: int, N: int, e: int, vertical_sync: bool, weight_stashing: bool
) -> tuple[tuple[Action, ...], ...]:
    """Each stage's 1F1B order over the stream with an update after every backward, at
    the versions in :func:`pipedream`'s docstring (no round-robin stage)."""
    actions = []
    for s in range(P):
        es = e if s < P - 1 else 0
        lag = P + e if vertical_sync else P - s + es
        acts = []
        for kind, k in one_f_one_b_order(P, N, s, es):
            forward_version = max(0, k - lag + 1)
            if kind == "F":
                acts.append(Action("F", s, k, forward_version))
            else:
                acts.append(Action("B", s, k, forward_version if weight_stashing else k))
                acts.append(Action("U", s, k, k))
        actions.append(tuple(acts))
    return tuple(actions)


def _pipedream_round_robin(
    P: int,
    N: int,
    e: int,
    replicas: tuple[int, ...],
    replication: tuple[str, ...],
    *,
    vertical_sync: bool,
    weight_stashing: bool,
    in_flight: str,
) -> Schedule:
    """:func:`pipedream` with round-robin stages (the formulas in the module docstring)."""
    if vertical_sync or not weight_stashing:
        raise ScheduleError(
            "pipedream with round-robin replication is defined with weight stashing and "
            "without vertical sync; use replication='split' for those options"
        )
    units = group_sizes(replicas, replication)
    check_multiple("num_microbatches (N, the stream length)", N, units)
    qs = round_robin_in_flight(units, e, in_flight)
    actions = []
    for s in range(P):
        n, q = units[s], qs[s]
        acts = []
        for kind, g in group_order(N // n, q - 1):
            version = max(0, g - q + 1)
            acts.append(Action(kind, s, g * n, version))
            if kind == "B":
                acts.append(Action("U", s, g, g))
        actions.append(tuple(acts))
    shape = Shape(P, 1, N, units=units, extra_in_flight=e, in_flight=in_flight)
    bound, versions = _bounds(PIPEDREAM, shape)
    return Schedule(
        name="pipedream",
        num_stages=P,
        num_microbatches=N,
        microbatches_per_step=1,
        actions=tuple(actions),
        stage_device=tuple(range(P)),
        replicas=replicas,
        extra_in_flight=e,
        replication=replication,
        in_flight_bound=bound,
        version_bound=versions,
        in_flight=in_flight,
    )


def pipedream_2bw(
    num_stages: int,
    microbatches_per_step: int,
    num_microbatches: int,
    *,
    replicas: Sequence[int] | None = None,
    replication: Sequence[str] | str | None = None,
) -> Schedule:
    """PipeDream-2BW: 1F1B without flush, one update per ``M`` microbatches, two versions.

    Stage ``s`` runs the 1F1B order over the whole stream and ``U(s, t)`` right after the
    backward of step ``t``'s last microbatch: ``W(t + 1) = W(t) - lr * g(W(t - 1))``.

    Versions: every ``F`` and ``B`` of step ``t`` (microbatches ``t M .. t M + M - 1``), at
    every stage, uses ``W(t - 1)``, version ``max(0, t - 1)`` (``W(-1) = W(0)``); ``U(s, t)``
    reads version ``t``. Versions kept: 2. In flight at stage ``s``: ``min(P - s, N)``.

    Args:
        num_stages: ``P``, stages (one device group each).
        microbatches_per_step: ``M >= P``, microbatches per update.
        num_microbatches: ``N``, the stream length, a multiple of ``M``.
        replicas: devices per stage (default 1 each).

    Raises:
        ScheduleError: for a parameter out of range, ``M < P``, or ``N`` not a multiple of
            ``M``.
    """
    P = positive("num_stages (P)", num_stages)
    M = positive("microbatches_per_step (M)", microbatches_per_step)
    N = positive("num_microbatches (N, the stream length)", num_microbatches)
    if M < P:
        raise ScheduleError(
            f"2bw needs microbatches_per_step (M) >= num_stages (P) so that step t can use "
            f"W(t-1) at every stage; got M={M}, P={P}. Accepted: M in [{P}, inf)"
        )
    if N % M:
        raise ScheduleError(
            f"2bw needs num_microbatches (N, the stream length) a multiple of "
            f"microbatches_per_step (M={M}); got N={N}. Accepted: N in {{{M}, {2 * M}, ...}}"
        )
    reps = replicas_of(replicas, P)
    mode = replication_of(replication, reps)
    units = group_sizes(reps, mode)
    check_multiple("microbatches_per_step (M)", M, units)
    qs = round_robin_in_flight(units)
    actions = []
    for s in range(P):
        n = units[s]
        acts = []
        for kind, g in group_order(N // n, qs[s] - 1):
            k = g * n
            t = k // M
            acts.append(Action(kind, s, k, max(0, t - 1)))
            if kind == "B" and (k + n) % M == 0:
                acts.append(Action("U", s, t, t))
        actions.append(tuple(acts))
    in_flight, versions = _bounds(PIPEDREAM_2BW, Shape(P, M, N, units=units))
    return Schedule(
        name="2bw",
        num_stages=P,
        num_microbatches=N,
        microbatches_per_step=M,
        actions=tuple(actions),
        stage_device=tuple(range(P)),
        replicas=reps,
        replication=mode,
        in_flight_bound=in_flight,
        version_bound=versions,
    )


def _two(shape: Shape, stage: int) -> int:
    return 2


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


_PIPEDREAM = ScheduleSemantics(
    name="pipedream",
    streams=True,
    stale=True,
    chunked=False,
    v_shaped=False,
    round_robin=True,
    split_backward=False,
    updates_per_microbatch=True,
    options=("vertical_sync", "weight_stashing", "extra_in_flight", "in_flight"),
    in_flight=_pipedream_in_flight,
    versions=_pipedream_versions,
    in_flight_formula=(
        "min(P - s + e_s, N); round-robin: min(q_s n_s, N), q_0 = NOAM = ceil(W_0 / n_0) "
        "under in_flight='paper'"
    ),
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


def _build_pipedream(a: GenerateArgs) -> Schedule:
    return pipedream(
        a.num_stages,
        a.num_microbatches if a.stream is None else a.stream,
        vertical_sync=a.spec.vertical_sync,
        weight_stashing=a.spec.weight_stashing,
        replicas=a.replicas,
        extra_in_flight=a.spec.extra_in_flight,
        replication=a.replication,
        in_flight=a.spec.in_flight,
    )


def _build_2bw(a: GenerateArgs) -> Schedule:
    N = a.num_microbatches * a.steps if a.stream is None else a.stream
    return pipedream_2bw(
        a.num_stages, a.num_microbatches, N, replicas=a.replicas, replication=a.replication
    )


PIPEDREAM = ScheduleKind(semantics=_PIPEDREAM, build=_build_pipedream)
"""PipeDream: the default stream is ``M`` microbatches (a step is one)."""
PIPEDREAM_2BW = ScheduleKind(semantics=_2BW, build=_build_2bw, needs_microbatches_per_stage=True)
"""PipeDream-2BW: the default stream is ``M * steps`` microbatches."""

FAMILY = (PIPEDREAM, PIPEDREAM_2BW)
"""This module's schedules, in the order they are listed."""
