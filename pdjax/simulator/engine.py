"""Plays a schedule against per-stage costs: step time, bubble fraction, peak memory.

The cost model (the ``pdjax`` model of ``docs/semantics.md#the-pdjax-model``):

- a device group runs its actions in order, one at a time; an action starts when the group
  is free and its inputs have arrived, and takes its stage's ``forward``, ``backward``
  (``= input_grad + weight_grad``), ``input_grad``, ``weight_grad`` seconds; costs are per
  replica (a stage on ``r`` devices already counts compute / ``r``), which is what one
  action costs when the group *splits* each microbatch across its devices. A group that
  replicates *round-robin* (``Schedule.replication``) runs ``n = r`` microbatches at once,
  one per device, in each action (``Schedule.covers``): the action takes ``n`` times the
  per-replica cost, the whole microbatch's compute on one device;
- ``U`` takes ``update`` seconds plus, for a stage on ``r > 1`` devices, a ring all-reduce of
  its weight gradients, ``2 (r - 1) / r * param_bytes / allreduce_bandwidth``, or, where
  ``PipelineCosts.allreduce_seconds`` gives the stage a number (a measured all-reduce), that
  many seconds instead of the ring formula; the schedule has one ``U`` per update, so the
  all-reduce is paid once per step for flush schedules and ``2bw``, and under ``pipedream``
  once per microbatch at a split stage and once per group of ``r`` microbatches at a
  round-robin one;
- an activation crossing the cut after stage ``s`` takes ``activation_bytes /
  link_bandwidth[s] + link_latency[s]`` seconds when the two stages are on different device
  groups, and its gradient, coming back, ``activation_bytes / link_bandwidth_back[s] +
  link_latency[s]`` (``link_bandwidth_back`` defaults to ``link_bandwidth``; a scalar
  ``link_latency`` is every cut's); each direction between two groups is one link carrying
  one tensor at a time; transfers overlap compute;
- posting a transfer costs the sending group ``send_seconds`` of host time per microbatch
  sent (its stage's :attr:`StageCosts.send_seconds`): the group is busy for it, after the
  ``F`` (or ``B``/``I``) that made the tensor and before the transfer starts. The event model
  folds it into that action, whose span then ends when the transfer starts;
- memory of a device in a group: summed over the group's stages (its chunks: ``v`` under
  ``interleaved``, the two arms of the V under ``zb-v``, each with its own costs; see
  :meth:`PipelineCosts.interleave` and :meth:`PipelineCosts.v_shape`), ``param_bytes``
  times the weight versions alive + ``optimizer_bytes`` + ``stash_bytes`` times the
  microbatches in flight (forward run, backward - ``B`` or ``W`` - not yet), counted over
  the whole group:
  ``stash_bytes`` is one replica's share of a microbatch's stash (``1 / r`` of it), so a
  round-robin group holding ``q`` groups of ``r`` microbatches holds ``q`` whole stashes per
  device. Memory is counted while each action runs: what it reads and what it makes are
  both alive (a backward's stash, the gradient that came in and the weight version it read
  for the last time, next to its results). That is the planner's memory model
  (:mod:`pdjax.partition.pricing.cost`), and the simulator's by default
  (``PipelineCosts.memory_model = "planner"``). With ``memory_model = "runtime"`` it also
  counts what pdjax's runtime (:mod:`pdjax.pipeline.lowering.program`) holds besides, for one call
  of the schedule:

  ======================  ==============================================================
  the gradient sum        ``param_bytes`` from the first ``B`` (or ``W``) after an update
                          up to and including the ``U`` that applies it (slot ``g``). The
                          ``U`` donates it and the optimizer state: the new weights take the
                          sum's buffers, the new state the old state's, so the update's
                          transient (new weights next to the old) is this term. Under
                          ``pipedream`` (``B`` then ``U`` per microbatch) it is alive during
                          the ``B`` and the ``U``; a fused ``BU`` that gets no sum holds
                          the new weights next to the old ones instead, the same bytes (its
                          fresh gradient is one of XLA's temporaries)
  the call's weights      version 0, the weights the call starts from, stays alive until
                          the call returns (the caller's state holds it, and the runtime
                          never donates it): one more ``param_bytes`` once the stage has
                          replaced it
  inputs placed up front  ``input_bytes / r`` per microbatch of the call (the caller's
                          inputs at the first stage, its targets at the last, both placed
                          before the first action, batch-sharded over the ``r`` devices),
                          until the stage's ``F`` of that microbatch: from there the input
                          is part of ``stash_bytes``, and targets are dropped
  zero bubble's ``c``     ``cotangent_bytes`` (one replica's share, like ``stash_bytes``)
                          per microbatch from its ``I`` to its ``W``: the cotangents at
                          each layer's output that ``I`` keeps for ``W``
  activations in transit  ``activation_bytes / r`` per microbatch (a round-robin group's
                          devices hold one whole microbatch each): the sent copy on the
                          sender from the ``F`` (or ``B``/``I``) that made it until its
                          transfer ends, the received copy on the receiver from its
                          arrival until the ``F`` that reads it (an activation; from there
                          it is stash) or up to the ``B``/``I`` that reads it (a gradient)
  ======================  ==============================================================

  Not counted: the losses the call returns (a scalar per microbatch), the per-microbatch
  PRNG keys (8 bytes each), model state (BatchNorm statistics) and XLA's temporaries inside
  a program. The runtime's peak live bytes per device group (``RunMetrics.peak_bytes``, from
  ``Pipeline.run(..., timeline=True)``) is measured after each operation, once it has
  dropped the inputs it read for the last time: below this count where a backward frees a
  weight version (``pipedream``) or a whole stash (``gpipe``).
  ``benchmarks/bench_runtime.py --memory-only`` measures both ways and compares.

Microbatches of other sizes (sequence-length buckets) take their compute from their own
costs (``simulate(..., microbatch_costs=)``, one :class:`PipelineCosts` per microbatch);
updates, transfers and memory stay those of ``costs``
(:func:`pdjax.partition.simulate_buckets` passes the longest bucket's).

:class:`PipelineCosts` is the seam to the planner: a Plan and its Profile become one
(:func:`pdjax.partition.costs_from_plan`); :func:`unit_costs` makes one from numbers.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from pdjax.errors import ScheduleError
from pdjax.schedules import (
    SCHEDULE_KINDS,
    STREAMING,
    Action,
    Schedule,
    group_sizes,
    play,
    round_robin_in_flight,
    semantics,
    validate,
)
from pdjax.schedules.play import kept_live_versions
from pdjax.schedules.timeline import Span, Timeline, Transfer
from pdjax.simulator.costs import PipelineCosts, StageCosts, unit_costs

__all__ = [
    "PipelineCosts",
    "Simulation",
    "StageCosts",
    "simulate",
    "stream_length",
    "unit_costs",
]


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
    :func:`~pdjax.schedules.round_robin_in_flight`, twice over, and
    ``4 (n_0 + ... + n_{P-1})``) and four periods of ``lcm(M, n_0, ..., n_{P-1})``
    microbatches between them.

    Args:
        name: a streaming schedule (``"pipedream"`` or ``"2bw"``; any other name counts
            steps of one microbatch, as ``pipedream``).
        num_stages: ``P``.
        microbatches_per_step: ``M`` (``2bw``; ignored for ``pipedream``).
        replicas: devices per stage (default 1 each).
        replication: per stage ``"split"`` or ``"round-robin"`` (or one word for all).

    >>> stream_length("pipedream", 4), stream_length("2bw", 4, 3)
    (8, 12)
    >>> stream_length("pipedream", 2, replicas=(15, 1), replication="round-robin")
    195
    """
    kind = SCHEDULE_KINDS.get(name)
    M = microbatches_per_step if kind is not None and kind.stream_in_steps else 1
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
        memory_by_action: per device group, the bytes one of its devices holds during each
            of its actions (parallel to ``schedule.actions[g]``; ``peak_memory`` is the
            largest).
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
    memory_by_action: tuple[tuple[int, ...], ...] = ()

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
            if semantics(schedule.name).v_shaped:
                hint = "; use costs.v_shape() for zb-v (its 2P stages in a V)"
        raise ScheduleError(
            f"the costs describe {len(costs.stages)} stages but the {schedule.name} schedule "
            f"has num_stages={schedule.num_stages} ({schedule.num_groups} device groups x "
            f"{schedule.chunks} chunks){hint}; build both from the same plan"
        )


def _durations(schedule: Schedule, costs: PipelineCosts) -> dict[tuple[str, int], float]:
    """Seconds of each kind of action at each stage (see the module doc)."""
    table = {}
    where, S = schedule.stage_device, schedule.num_stages
    for s, st in enumerate(costs.stages):
        g = where[s]
        allreduce = costs.allreduce(s, schedule.replicas[g])
        # A round-robin action runs n whole microbatches side by side, one per device: the
        # time of n per-replica shares. The update is per device either way.
        n = schedule.group_size(s)
        # posting each transfer to another group occupies this group (one per microbatch)
        sends_forward = n * st.send_seconds if s + 1 < S and where[s + 1] != g else 0.0
        sends_back = n * st.send_seconds if s > 0 and where[s - 1] != g else 0.0
        table.update(
            {
                ("F", s): n * st.forward + sends_forward,
                ("B", s): n * st.backward + sends_back,
                ("I", s): n * st.input_grad + sends_back,
                ("W", s): n * st.weight_grad,
                ("U", s): st.update + allreduce,
            }
        )
    return table


def _microbatch_tables(
    schedule: Schedule, microbatch_costs: Sequence[PipelineCosts] | None
) -> list[dict[tuple[str, int], float]] | None:
    """Per microbatch, the :func:`_durations` table of its costs (one table per distinct
    costs object: a bucket's, shared by its microbatches)."""
    if microbatch_costs is None:
        return None
    N = schedule.num_microbatches
    if len(microbatch_costs) != N:
        raise ScheduleError(
            f"microbatch_costs has {len(microbatch_costs)} entries, the schedule has {N} "
            "microbatches: give one PipelineCosts per microbatch"
        )
    tables: dict[int, dict[tuple[str, int], float]] = {}
    out = []
    for c in microbatch_costs:
        if id(c) not in tables:
            _check_match(schedule, c)
            tables[id(c)] = _durations(schedule, c)
        out.append(tables[id(c)])
    return out


def _memory(
    schedule: Schedule,
    costs: PipelineCosts,
    starts: list[list[float]],
    ends: list[list[float]],
    moves: list[tuple[int, int, float, float, Action]],
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Bytes per device of each group during each of its actions, and the peak
    microbatches in flight per stage (see the module doc for both memory models)."""
    runtime = costs.memory_model == "runtime"
    N = schedule.num_microbatches
    peak_in_flight = [0] * schedule.num_stages
    totals = [[0.0] * len(acts) for acts in schedule.actions]
    for g in range(len(schedule.actions)):
        r = schedule.replicas[g]
        for s in schedule.stages_of(g):
            st = costs.stages[s]
            terms = _memory_terms(schedule, g, s, runtime)
            peak_in_flight[s] = max(peak_in_flight[s], terms.peak_in_flight)
            param, optimizer, stash = st.param_bytes, st.optimizer_bytes, st.stash_bytes
            totals[g] = [
                total + (param * versions + optimizer + stash * in_flight)
                for total, versions, in_flight in zip(
                    totals[g], terms.versions, terms.in_flight, strict=True
                )
            ]
            if runtime:
                inputs, cotangents = st.input_bytes, st.cotangent_bytes
                totals[g] = [
                    total + (param * summing + inputs * (N - forwarded) / r + cotangents * waiting)
                    for total, summing, forwarded, waiting in zip(
                        totals[g], terms.summing, terms.forwarded, terms.waiting_for_w, strict=True
                    )
                ]
    if runtime:
        _add_transit(schedule, costs, starts=starts, ends=ends, moves=moves, totals=totals)
    memory = tuple(tuple(round(x) for x in total) for total in totals)
    return memory, tuple(peak_in_flight)


class _MemoryTerms(NamedTuple):
    """What one stage holds during each action of its group's list, in counts that the
    costs then weigh (bytes per weight version, per microbatch in flight, ...): each
    list has one entry per action (the last three: under the ``runtime`` memory model
    only, else empty)."""

    versions: list[int]
    """Weight versions alive (with the call's starting weights under ``runtime``)."""
    in_flight: list[int]
    """Microbatches forwarded and not yet through ``B`` (or ``W``)."""
    peak_in_flight: int
    """The most microbatches in flight, 0 for none."""
    forwarded: list[int]
    """Microbatches forwarded so far (their inputs no longer wait, placed up front)."""
    waiting_for_w: list[int]
    """Zero bubble: microbatches through ``I`` and not yet ``W``."""
    summing: list[bool]
    """Whether a gradient sum is alive (from the first ``B``/``W`` after an update up to
    and including the ``U`` that applies it)."""


def _memory_terms(schedule: Schedule, g: int, s: int, runtime: bool) -> _MemoryTerms:
    """:class:`_MemoryTerms` of stage ``s`` on group ``g``. They depend on the schedule
    alone, not on the costs, so they are kept on it (``Schedule._derived``): the planner
    simulates one schedule under the costs of many partitions."""
    kept: dict[tuple[int, int, bool], _MemoryTerms] = schedule._derived.setdefault("memory", {})
    terms = kept.get((g, s, runtime))
    if terms is not None:
        return terms
    acts = schedule.actions[g]
    versions = kept_live_versions(schedule, g, s)  # live_versions(acts, s), not to be changed
    if runtime:
        versions = _with_call_weights(acts, s, versions)
    in_flight_at = []
    in_flight = 0
    peak = 0
    for a in acts:
        mine = a.stage == s
        if mine and a.kind == "F":
            in_flight += len(schedule.covers(a))
            peak = max(peak, in_flight)  # (it grows only here)
        in_flight_at.append(in_flight)
        if mine and a.kind in "BW":
            in_flight -= len(schedule.covers(a))
    forwarded_at: list[int] = []
    waiting_at: list[int] = []
    summing_at: list[bool] = []
    if runtime:
        waiting_for_w = 0  # zero bubble: I done, W not yet
        forwarded = 0
        summing = False  # a gradient sum is alive
        for a in acts:
            mine = a.stage == s
            if mine and a.kind == "F":
                forwarded += len(schedule.covers(a))
            if mine and a.kind == "I":
                waiting_for_w += len(schedule.covers(a))
            if mine and a.kind in "BW":
                summing = True
            forwarded_at.append(forwarded)
            waiting_at.append(waiting_for_w)
            summing_at.append(summing)
            if mine and a.kind == "W":
                waiting_for_w -= len(schedule.covers(a))
            if mine and a.kind == "U":
                summing = False
    terms = _MemoryTerms(versions, in_flight_at, peak, forwarded_at, waiting_at, summing_at)
    kept[g, s, runtime] = terms
    return terms


def _with_call_weights(acts: Sequence[Action], stage: int, versions: list[int]) -> list[int]:
    """``versions`` plus version 0 from where it would die to the end: the weights a call
    starts from stay alive until it returns."""
    first_update = next(
        (pos for pos, a in enumerate(acts) if a.stage == stage and a.kind == "U"), None
    )
    if first_update is None:
        return versions
    last_use = max(
        (pos for pos, a in enumerate(acts) if a.stage == stage and a.version == 0), default=-1
    )
    end = max(last_use, first_update)
    return [v + (pos > end) for pos, v in enumerate(versions)]


def _add_transit(
    schedule: Schedule,
    costs: PipelineCosts,
    *,
    starts: list[list[float]],
    ends: list[list[float]],
    moves: list[tuple[int, int, float, float, Action]],
    totals: list[list[float]],
) -> None:
    """Adds to ``totals`` the activations and gradients in transit: the sender's copy from
    the action that made it until its transfer ends, the receiver's from its arrival until
    the action that reads it (an activation: before its ``F``, which stashes it; a
    gradient: up to its ``B``/``I``)."""
    S, where = schedule.num_stages, schedule.stage_device
    reader = _readers(schedule)
    timed: dict[Action, list[tuple[float, float]]] = {}
    for _src, _dst, start, end, a in moves:
        timed.setdefault(a, []).append((start, end))
    deltas = [[0.0] * (len(acts) + 1) for acts in schedule.actions]
    for g, acts in enumerate(schedule.actions):
        for pos, a in enumerate(acts):
            if a.kind == "F" and a.stage + 1 < S:
                cut, peer, read = a.stage, a.stage + 1, "F"
            elif a.kind in "BI" and a.stage > 0:
                cut, peer, read = a.stage - 1, a.stage - 1, "G"
            else:
                continue
            h = where[peer]
            size = costs.stages[cut].activation_bytes
            spans = timed.get(a, [])
            for j, k in enumerate(schedule.covers(a)):
                arrival = spans[j][1] if j < len(spans) else ends[g][pos]
                if h != g:  # the sender's copy, until the transfer ends
                    last = max(pos, bisect.bisect_left(starts[g], arrival) - 1)
                    deltas[g][pos] += size / schedule.replicas[g]
                    deltas[g][last + 1] -= size / schedule.replicas[g]
                # the receiver's copy, from the first of its actions that ends after it arrives
                until = reader[read, peer, k] + (read == "G")  # exclusive
                first = bisect.bisect_right(ends[h], arrival)
                if first < until:
                    deltas[h][first] += size / schedule.replicas[h]
                    deltas[h][until] -= size / schedule.replicas[h]
    for g, delta in enumerate(deltas):
        alive = 0.0
        for pos in range(len(totals[g])):
            alive += delta[pos]
            totals[g][pos] += alive


def _readers(schedule: Schedule) -> dict[tuple[str, int, int], int]:
    """Where each microbatch's ``F`` (``("F", stage, k)``), and ``B`` or ``I`` (what reads a
    gradient, ``("G", stage, k)``), sits in its group's list; kept on the schedule
    (``Schedule._derived``), which it depends on alone."""
    derived = schedule._derived
    reader: dict[tuple[str, int, int], int] | None = derived.get("readers")
    if reader is None:
        reader = {}
        for acts in schedule.actions:
            for pos, a in enumerate(acts):
                kind = "F" if a.kind == "F" else "G" if a.kind in "BI" else None
                if kind is not None:
                    for k in schedule.covers(a):
                        reader.setdefault((kind, a.stage, k), pos)
        derived["readers"] = reader
    return reader


def simulate(
    schedule: Schedule,
    costs: PipelineCosts,
    *,
    check: bool = True,
    microbatch_costs: Sequence[PipelineCosts] | None = None,
) -> Simulation:
    """Plays ``schedule`` against ``costs``.

    Args:
        schedule: the schedule; validated first unless ``check`` is false.
        costs: per-stage costs, one entry per (virtual) stage of ``schedule``.
        check: run :func:`~pdjax.schedules.validate` first. Turn it off only for a
            schedule validated already: an invalid one then fails in no specified way
            (a ``KeyError`` or ``IndexError`` from deep inside), or plays wrongly.
        microbatch_costs: per microbatch of the schedule, the costs its ``F``, ``B``,
            ``I`` and ``W`` take (microbatches of other sequence lengths: one
            :class:`PipelineCosts` per bucket, repeated; a round-robin action is priced
            by its group's first microbatch). ``U``, the transfers and memory are
            priced by ``costs`` (give the largest bucket's for a bound on memory).
            None: every microbatch costs ``costs``.

    Returns:
        Timelines, step time, bubble fraction, peak memory (see :class:`Simulation`).

    Raises:
        ScheduleError: if the schedule is invalid or the costs describe a different number
            of stages.

    >>> from pdjax.schedules import one_f_one_b
    >>> sim = simulate(one_f_one_b(4, 8), unit_costs(4))
    >>> sim.step_time, round(sim.bubble_fraction, 4)  # 3 (M + P - 1); (P - 1) / (M + P - 1)
    (33.0, 0.2727)
    """
    if check:
        validate(schedule)
    _check_match(schedule, costs)
    table = _durations(schedule, costs)
    per_mb = _microbatch_tables(schedule, microbatch_costs)

    def duration(a: Action) -> float:
        if per_mb is not None and a.kind != "U":
            return per_mb[a.mb][a.kind, a.stage]
        return table[a.kind, a.stage]

    link_seconds: dict[tuple[int, int, int], float] = {}  # each link's, once per play

    def transfer(cut: int, src: int, dst: int) -> float:
        seconds = link_seconds.get((cut, src, dst))
        if seconds is None:
            backward = src != schedule.stage_device[cut]  # a gradient, from stage cut + 1
            seconds = costs.stages[cut].activation_bytes / costs.bandwidth(cut, backward=backward)
            seconds = link_seconds[cut, src, dst] = seconds + costs.latency(cut)
        return seconds

    starts, ends, moves = play(schedule, duration, transfer, costs.posted_receives)
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
    window = _steady_window(schedule, ends) if schedule.name in STREAMING else None
    if window is None:
        step_time = makespan / schedule.num_steps
        lo, hi = 0.0, makespan
    else:
        lo, hi, microbatches = window
        step_time = (hi - lo) / microbatches * M
    busy = timeline.total_busy(lo, hi)
    bubble = 1.0 - busy / (G * (hi - lo)) if hi > lo else 0.0
    memory, peak_in_flight = _memory(schedule, costs, starts, ends, moves)
    return Simulation(
        schedule=schedule,
        timeline=timeline,
        makespan=makespan,
        step_time=step_time,
        time_per_microbatch=step_time / M,
        bubble_fraction=max(0.0, bubble),
        peak_memory=tuple(max(m, default=0) for m in memory),
        peak_in_flight=peak_in_flight,
        steady_state=window is not None,
        memory_by_action=memory,
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
