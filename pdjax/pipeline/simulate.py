"""Plays a schedule against per-stage costs: step time, bubble fraction, peak memory.

The cost model (DESIGN.md's ``pdjax`` model):

- a device group runs its actions in order, one at a time; an action starts when the group
  is free and its inputs have arrived, and takes its stage's ``forward``, ``backward``
  (``= input_grad + weight_grad``), ``input_grad``, ``weight_grad`` seconds; costs are per
  replica (a stage on ``r`` devices already counts compute / ``r``), which is what one
  action costs when the group *splits* each microbatch across its devices. A group that
  replicates *round-robin* (``Schedule.replication``) runs ``n = r`` microbatches at once,
  one per device, in each action (``Schedule.covers``): the action takes ``n`` times the
  per-replica cost, the whole microbatch's compute on one device;
- ``U`` takes ``update`` seconds plus, for a stage on ``r > 1`` devices, a ring all-reduce of
  its weight gradients, ``2 (r - 1) / r * param_bytes / allreduce_bandwidth``; the schedule
  has one ``U`` per update, so the all-reduce is paid once per step for flush schedules and
  ``2bw``, and under ``pipedream`` once per microbatch at a split stage and once per group of
  ``r`` microbatches at a round-robin one;
- an activation crossing the cut after stage ``s`` (and its gradient, coming back) takes
  ``activation_bytes / link_bandwidth + link_latency`` seconds when the two stages are on
  different device groups; each direction between two groups is one link carrying one
  tensor at a time; transfers overlap compute;
- memory of a device in a group: for each of the group's stages, ``param_bytes`` times the
  weight versions alive + ``optimizer_bytes`` + ``stash_bytes`` times the microbatches in
  flight (forward run, backward - ``B`` or ``W`` - not yet), counted over the whole group:
  ``stash_bytes`` is one replica's share of a microbatch's stash (``1 / r`` of it), so a
  round-robin group holding ``q`` groups of ``r`` microbatches holds ``q`` whole stashes per
  device.

:class:`PipelineCosts` is the seam to the planner: a Plan and its Profile become one
(``pdjax.commands.simulate.costs_from_plan``); :func:`unit_costs` makes one from numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from pdjax.errors import ScheduleError
from pdjax.pipeline.schedule import (
    Action,
    Schedule,
    _live_versions,
    _play,
    group_sizes,
    round_robin_in_flight,
    validate,
)
from pdjax.pipeline.timeline import Span, Timeline, Transfer

__all__ = [
    "PipelineCosts",
    "Simulation",
    "StageCosts",
    "simulate",
    "stream_length",
    "unit_costs",
]


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """What one (virtual) stage costs, per microbatch and per device of its group.

    Attributes:
        forward: seconds of the forward.
        input_grad: seconds of the backward's input-gradient part (``I``).
        weight_grad: seconds of the backward's weight-gradient part (``W``).
        update: seconds of the optimizer update, without the all-reduce.
        activation_bytes: bytes sent to the next stage per microbatch (the gradient that
            comes back has the same size).
        param_bytes: bytes of one copy of the stage's weights.
        stash_bytes: bytes kept per microbatch in flight (saved activations).
        optimizer_bytes: bytes of optimizer state.
    """

    forward: float
    input_grad: float
    weight_grad: float
    update: float = 0.0
    activation_bytes: int = 0
    param_bytes: int = 0
    stash_bytes: int = 0
    optimizer_bytes: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int | float) or not value >= 0 or math.isinf(value):
                raise ScheduleError(
                    f"StageCosts.{field.name} must be a finite number >= 0; got {value!r}"
                )

    @property
    def backward(self) -> float:
        """Seconds of the whole backward, ``input_grad + weight_grad``."""
        return self.input_grad + self.weight_grad


@dataclasses.dataclass(frozen=True)
class PipelineCosts:
    """Per-stage costs and the links between stages.

    Build it with :meth:`build` (which accepts scalars) or :func:`unit_costs`.

    Attributes:
        stages: one entry per (virtual) stage.
        link_bandwidth: bytes/s across each cut, ``link_bandwidth[s]`` between stages
            ``s`` and ``s + 1`` (``num_stages - 1`` entries); ``math.inf`` makes it free.
        allreduce_bandwidth: bytes/s of each stage's gradient all-reduce among its replicas.
        link_latency: seconds added to every transfer between device groups.
    """

    stages: tuple[StageCosts, ...]
    link_bandwidth: tuple[float, ...]
    allreduce_bandwidth: tuple[float, ...]
    link_latency: float = 0.0

    def __post_init__(self) -> None:
        if not self.stages:
            raise ScheduleError("PipelineCosts needs at least one stage")
        for label, values, size in [
            ("link_bandwidth", self.link_bandwidth, len(self.stages) - 1),
            ("allreduce_bandwidth", self.allreduce_bandwidth, len(self.stages)),
        ]:
            if len(values) != size:
                raise ScheduleError(
                    f"PipelineCosts.{label} has {len(values)} entries; expected {size} for "
                    f"{len(self.stages)} stages"
                )
            if any(not b > 0 for b in values):
                raise ScheduleError(f"PipelineCosts.{label} must be > 0 bytes/s; got {values}")
        if not self.link_latency >= 0:
            raise ScheduleError(f"link_latency must be >= 0 s; got {self.link_latency!r}")

    @classmethod
    def build(
        cls,
        stages: Sequence[StageCosts],
        *,
        link_bandwidth: float | Sequence[float] = math.inf,
        allreduce_bandwidth: float | Sequence[float] = math.inf,
        link_latency: float = 0.0,
    ) -> PipelineCosts:
        """Like the constructor, with one bandwidth (bytes/s) allowed for all links.

        >>> costs = PipelineCosts.build([StageCosts(1.0, 1.0, 1.0)] * 3, link_bandwidth=1e9)
        >>> costs.link_bandwidth
        (1000000000.0, 1000000000.0)
        """
        stages = tuple(stages)

        def spread(value: float | Sequence[float], size: int) -> tuple[float, ...]:
            if isinstance(value, int | float):
                return (float(value),) * size
            return tuple(float(v) for v in value)

        return cls(
            stages=stages,
            link_bandwidth=spread(link_bandwidth, len(stages) - 1),
            allreduce_bandwidth=spread(allreduce_bandwidth, len(stages)),
            link_latency=link_latency,
        )

    def interleave(self, chunks: int) -> PipelineCosts:
        """Costs of ``P * chunks`` virtual stages, each stage cut into equal chunks.

        Virtual stage ``d + c P`` gets ``1 / chunks`` of stage ``d``'s compute, weights,
        optimizer state and stash, and stage ``d``'s activation bytes; the cut from the last
        group back to the first (between chunks) carries the largest activation of any cut
        and uses the slowest link: a what-if approximation for when no plan partitions the
        layers into ``P * chunks`` stages.

        Raises:
            ScheduleError: if ``chunks < 1``.
        """
        if not isinstance(chunks, int) or chunks < 1:
            raise ScheduleError(f"chunks must be an integer >= 1; got {chunks!r}")
        if chunks == 1:
            return self
        P = len(self.stages)
        widest = max((st.activation_bytes for st in self.stages), default=0)
        slowest = min(self.link_bandwidth, default=math.inf)
        stages, links = [], []
        for c in range(chunks):
            for d, st in enumerate(self.stages):
                stages.append(
                    StageCosts(
                        forward=st.forward / chunks,
                        input_grad=st.input_grad / chunks,
                        weight_grad=st.weight_grad / chunks,
                        update=st.update / chunks,
                        activation_bytes=st.activation_bytes if d < P - 1 else widest,
                        param_bytes=st.param_bytes // chunks,
                        stash_bytes=st.stash_bytes // chunks,
                        optimizer_bytes=st.optimizer_bytes // chunks,
                    )
                )
                if d < P - 1:
                    links.append(self.link_bandwidth[d])
                elif c < chunks - 1:
                    links.append(slowest)
        return PipelineCosts(
            stages=tuple(stages),
            link_bandwidth=tuple(links),
            allreduce_bandwidth=self.allreduce_bandwidth * chunks,
            link_latency=self.link_latency,
        )


def unit_costs(
    num_stages: int,
    forward: float = 1.0,
    input_grad: float = 1.0,
    weight_grad: float = 1.0,
    *,
    update: float = 0.0,
    chunks: int = 1,
) -> PipelineCosts:
    """Identical stages with the given seconds, free transfers, no memory.

    Args:
        num_stages: ``P``, stages (device groups).
        forward: seconds of ``F``.
        input_grad: seconds of ``I``.
        weight_grad: seconds of ``W`` (``B = I + W``).
        update: seconds of ``U``.
        chunks: for ``interleaved``: ``P * chunks`` virtual stages, each ``1 / chunks`` of
            the costs, so that a device group does the same work as with one chunk.

    Returns:
        The costs.

    >>> unit_costs(2).stages[0].backward
    2.0
    """
    stage = StageCosts(float(forward), float(input_grad), float(weight_grad), float(update))
    return PipelineCosts.build([stage] * num_stages).interleave(chunks)


def stream_length(
    name: str,
    num_stages: int,
    microbatches_per_step: int = 1,
    *,
    replicas: Sequence[int] | None = None,
    replication: Sequence[str] | str | None = None,
) -> int:
    """A stream length ``N`` for ``pipedream`` or ``2bw`` long enough for a steady state.

    ``N`` is a multiple of ``M`` (``2bw``) and of every round-robin stage's group size
    (as the generators require). Without round-robin stages it is ``M`` times
    ``max(4, ceil(2 P / M))`` (``M = 1`` for ``pipedream``); with them, long enough to hold
    the fill and the drain (the microbatches the stages keep in flight,
    :func:`~pdjax.pipeline.schedule.round_robin_in_flight`, twice over, and
    ``4 (n_0 + ... + n_{P-1})``) and four periods of ``lcm(M, n_0, ..., n_{P-1})``
    microbatches between them.

    Args:
        name: ``"pipedream"`` or ``"2bw"`` (any other name is treated as ``pipedream``).
        num_stages: ``P``.
        microbatches_per_step: ``M`` (``2bw``; ignored for ``pipedream``).
        replicas: devices per stage (default 1 each).
        replication: per stage ``"split"`` or ``"round-robin"`` (or one word for all).

    >>> stream_length("pipedream", 4), stream_length("2bw", 4, 3)
    (8, 12)
    >>> stream_length("pipedream", 2, replicas=(15, 1), replication="round-robin")
    195
    """
    M = microbatches_per_step if name == "2bw" else 1
    reps = tuple(replicas) if replicas is not None else (1,) * num_stages
    modes = (replication,) * len(reps) if isinstance(replication, str) else replication
    modes = tuple(modes or ("split",) * len(reps))
    units = group_sizes(reps, modes)
    if all(n == 1 for n in units):
        return M * max(4, -(-2 * num_stages // M))
    period = math.lcm(M, *units)
    held = sum(q * n for q, n in zip(round_robin_in_flight(units), units, strict=True))
    need = max(4 * M, 4 * sum(units) + 2 * held + 4 * period)
    return period * -(-need // period)


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The result of :func:`simulate`.

    Attributes:
        schedule: the schedule that was played.
        timeline: every action and transfer with its start and end, seconds.
        makespan: seconds from the first action to the last.
        step_time: seconds per optimizer step: for flush schedules, the makespan divided by
            the steps; for ``pipedream`` (a step is one microbatch) and ``2bw``, the steady
            state's.
        time_per_microbatch: ``step_time / microbatches_per_step``.
        bubble_fraction: idle share of device-group time: over the whole run for flush
            schedules, over the steady state for ``pipedream`` and ``2bw``.
        peak_memory: per device group, the most bytes one of its devices holds.
        peak_in_flight: per stage, the most microbatches in flight (over the stage's whole
            group: a round-robin group's ``q`` groups of ``r`` count ``q r``).
        steady_state: whether ``step_time`` and ``bubble_fraction`` come from a steady-state
            window (only ``pipedream`` and ``2bw`` with a stream long enough to have one:
            about ``2 P`` microbatches, more with round-robin stages, see
            :func:`stream_length`; otherwise they describe the whole run).
    """

    schedule: Schedule
    timeline: Timeline
    makespan: float
    step_time: float
    time_per_microbatch: float
    bubble_fraction: float
    peak_memory: tuple[int, ...]
    peak_in_flight: tuple[int, ...]
    steady_state: bool

    def summary(self) -> dict[str, Any]:
        """The numbers as plain JSON-able data."""
        s = self.schedule
        return {
            "schedule": s.name,
            "num_stages": s.num_stages,
            "num_groups": s.num_groups,
            "num_microbatches": s.num_microbatches,
            "microbatches_per_step": s.microbatches_per_step,
            "replicas": list(s.replicas),
            "replication": list(s.replication) or ["split"] * s.num_groups,
            "makespan": self.makespan,
            "step_time": self.step_time,
            "time_per_microbatch": self.time_per_microbatch,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory": list(self.peak_memory),
            "peak_in_flight": list(self.peak_in_flight),
            "steady_state": self.steady_state,
        }


def _check_match(schedule: Schedule, costs: PipelineCosts) -> None:
    if len(costs.stages) != schedule.num_stages:
        hint = ""
        if schedule.chunks > 1 and len(costs.stages) == schedule.num_groups:
            hint = f"; use costs.interleave({schedule.chunks}) for an interleaved schedule"
        raise ScheduleError(
            f"the costs describe {len(costs.stages)} stages but the {schedule.name} schedule "
            f"has num_stages={schedule.num_stages} ({schedule.num_groups} device groups x "
            f"{schedule.chunks} chunks){hint}; build both from the same plan"
        )


def _durations(schedule: Schedule, costs: PipelineCosts) -> dict[tuple[str, int], float]:
    """Seconds of each kind of action at each stage (see the module doc)."""
    table = {}
    for s, st in enumerate(costs.stages):
        r = schedule.replicas[schedule.stage_device[s]]
        allreduce = 2 * (r - 1) / r * st.param_bytes / costs.allreduce_bandwidth[s]
        # A round-robin action runs n whole microbatches side by side, one per device: the
        # time of n per-replica shares. The update is per device either way.
        n = schedule.group_size(s)
        table.update(
            {
                ("F", s): n * st.forward,
                ("B", s): n * st.backward,
                ("I", s): n * st.input_grad,
                ("W", s): n * st.weight_grad,
                ("U", s): st.update + allreduce,
            }
        )
    return table


def _memory(schedule: Schedule, costs: PipelineCosts) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Peak bytes per device group and peak microbatches in flight per stage."""
    peak_bytes = []
    peak_in_flight = [0] * schedule.num_stages
    for g, acts in enumerate(schedule.actions):
        total = [0] * len(acts)
        for s in schedule.stages_of(g):
            st = costs.stages[s]
            versions = _live_versions(acts, s)
            in_flight = 0
            for pos, a in enumerate(acts):
                if a.stage == s and a.kind == "F":
                    in_flight += len(schedule.covers(a))
                peak_in_flight[s] = max(peak_in_flight[s], in_flight)
                total[pos] += (
                    st.param_bytes * versions[pos] + st.optimizer_bytes + st.stash_bytes * in_flight
                )
                if a.stage == s and a.kind in "BW":
                    in_flight -= len(schedule.covers(a))
        peak_bytes.append(max(total, default=0))
    return tuple(peak_bytes), tuple(peak_in_flight)


def simulate(schedule: Schedule, costs: PipelineCosts, *, check: bool = True) -> Simulation:
    """Plays ``schedule`` against ``costs``.

    Args:
        schedule: the schedule; validated first unless ``check`` is false.
        costs: per-stage costs, one entry per (virtual) stage of ``schedule``.
        check: run :func:`~pdjax.pipeline.validate` first.

    Returns:
        Timelines, step time, bubble fraction, peak memory (see :class:`Simulation`).

    Raises:
        ScheduleError: if the schedule is invalid or the costs describe a different number
            of stages.

    >>> from pdjax.pipeline.schedule import one_f_one_b
    >>> sim = simulate(one_f_one_b(4, 8), unit_costs(4))
    >>> sim.step_time, round(sim.bubble_fraction, 4)  # 3 (M + P - 1); (P - 1) / (M + P - 1)
    (33.0, 0.2727)
    """
    if check:
        validate(schedule)
    _check_match(schedule, costs)
    table = _durations(schedule, costs)

    def duration(a: Action) -> float:
        return table[a.kind, a.stage]

    def transfer(cut: int, src: int, dst: int) -> float:
        seconds = costs.stages[cut].activation_bytes / costs.link_bandwidth[cut]
        return seconds + costs.link_latency

    starts, ends, moves = _play(schedule, duration, transfer)
    spans = tuple(
        Span(g, start, end, a)
        for g, acts in enumerate(schedule.actions)
        for a, start, end in zip(acts, starts[g], ends[g], strict=True)
    )
    timeline = Timeline(
        name=schedule.name,
        num_groups=schedule.num_groups,
        spans=spans,
        transfers=tuple(Transfer(*m) for m in moves),
    )
    makespan = timeline.makespan
    G, M = schedule.num_groups, schedule.microbatches_per_step
    window = _steady_window(schedule, ends) if schedule.name in ("pipedream", "2bw") else None
    if window is None:
        step_time = makespan / schedule.num_steps
        lo, hi = 0.0, makespan
    else:
        lo, hi, microbatches = window
        step_time = (hi - lo) / microbatches * M
    busy = sum(timeline.busy(g, lo, hi) for g in range(G))
    bubble = 1.0 - busy / (G * (hi - lo)) if hi > lo else 0.0
    peak_memory, peak_in_flight = _memory(schedule, costs)
    return Simulation(
        schedule=schedule,
        timeline=timeline,
        makespan=makespan,
        step_time=step_time,
        time_per_microbatch=step_time / M,
        bubble_fraction=max(0.0, bubble),
        peak_memory=peak_memory,
        peak_in_flight=peak_in_flight,
        steady_state=window is not None,
    )


def _steady_window(schedule: Schedule, ends: list[list[float]]) -> tuple[float, float, int] | None:
    """The steady state of a stream: from the end of an update of stage 0 to a later one.

    Stage 0 finishes every microbatch last, so its updates time the stream; update ``u``
    applies microbatches ``u k .. u k + k - 1`` (``k``: ``Schedule.per_update(0)``, ``M`` for
    ``2bw``, stage 0's group size for ``pipedream``). The window skips the fill (updates
    ending before stage 0 has held its most microbatches in flight, ``W``) and the drain (the
    last ``W - 1`` microbatches), and spans whole periods of ``lcm(k, n_0, ..., n_{P-1})``
    microbatches, ``n_s`` the stages' group sizes (1 unless round-robin), so that every
    stage does the same work in it.

    Returns:
        ``(start, end, microbatches)`` in seconds, or ``None`` if the stream is too short.
    """
    N = schedule.num_microbatches
    k = schedule.per_update(0)
    fill = schedule.in_flight_bound[0]
    first = -(-fill // k) - 1
    last = (N - fill + 1) // k - 1
    units = [schedule.group_size(s) for s in range(schedule.num_stages)]
    period = math.lcm(k, *units) // k  # updates of stage 0 per period
    span = (last - first) // period * period
    if span <= 0:
        return None
    last = first + span
    update_end = {
        a.mb: end
        for a, end in zip(schedule.actions[0], ends[0], strict=True)
        if a.kind == "U" and a.stage == 0
    }
    return update_end[first], update_end[last], span * k
