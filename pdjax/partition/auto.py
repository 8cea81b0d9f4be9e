"""``plan_auto``: the planner chooses everything a pipeline run needs.

For one model (a profile), devices (a topology) and a batch of ``B`` samples per optimizer
step, :func:`plan_auto` searches

* the **schedule**: ``gpipe``, ``1f1b``, ``interleaved`` (``v`` chunks), ``zb-h1`` and the
  other flush schedules pdjax generates; ``pipedream`` and ``2bw`` (stale weights) only
  when the caller allows them;
* the **microbatches** per step ``M`` (divisors of ``B``; the microbatch size is ``B / M``);
* the **stages and replication**: every configuration on all the ``P`` devices when there
  are few (at most ``exhaustive``; contiguous layers, replica counts summing to ``P``; with
  ``straight``, one stage per device: ``sum_k C(L - 1, k - 1) C(P - 1, k - 1)``
  configurations with ``k`` stages, ``C(L - 1, P - 1)`` straight); else
  PipeDream's dynamic program for each (schedule, M), with and without the memory limit,
  each partition then improved by moving one stage boundary at a time while the simulator
  says it is faster (the program prices stages apart, the simulator the whole schedule:
  its optimum may not be the simulator's, chiefly in how many replicas a stage gets);
* per-stage **recomputation** (remat): a stage recomputes its forward in its backward
  only if its device group would not fit the memory limit otherwise;
* for ``pipedream``, the **in-flight depth** (``extra_in_flight``);

and ranks every candidate by the simulator (:func:`pdjax.simulator.simulate` over
:func:`pdjax.partition.costs_from_plan`): predicted seconds per sample (a flush step's
makespan, fill and drain included, over its ``B`` samples; the steady-state period of the
asynchronous schedules), among those whose simulated peak memory fits. The dynamic program
prunes; the simulator decides.

The returned :class:`~pdjax.partition.Plan` records the choice in ``plan.options["auto"]``
(schedule, M, chunks, remat per stage, in-flight depth, predicted time per sample, peak
memory overall and per device group, peak microbatches in flight per stage, the memory
limit held to: the simulator's figures; the plan's own per-stage ``in_flight`` and
``memory_bytes`` are the dynamic program's, priced for another schedule) and, under
``"alternatives"``, the best candidate of every other schedule (or why none fits), so a
user sees why.

The simulator's pricing of one candidate is in :mod:`pdjax.partition.candidates`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from pdjax.errors import PlanError, ScheduleError
from pdjax.partition.candidates import (
    Candidate,
    HostCosts,
    evaluate_candidate,
    price,
    stage_specs,
)
from pdjax.partition.partitioners import evaluate_partition
from pdjax.partition.pipedream import plan_pipedream
from pdjax.partition.plan import Plan
from pdjax.partition.topology import Topology
from pdjax.profile import Profile
from pdjax.schedules import SCHEDULE_KINDS, SCHEDULES, STALE

__all__ = [
    "Candidate",
    "HostCosts",
    "evaluate_candidate",
    "plan_auto",
]

_NO_LIMIT = 1e30  # bytes: "no memory limit" for the dynamic program


@dataclasses.dataclass(frozen=True)
class _Space:
    """What every candidate of one :func:`plan_auto` call shares, and the search's knobs."""

    profile: Profile
    topology: Topology
    limit: float | None
    remat: bool
    batch: int
    straight: bool
    cost_model: str
    factor: float
    host: HostCosts | None
    calibration: Any
    chunks: Sequence[int]
    extra_in_flight: Sequence[int]
    exhaustive: int


class _Found(NamedTuple):
    """The best fitting plan found for one (schedule, M, v, e), with the candidate that
    priced it and whether its partitions were searched exhaustively (nothing to refine)."""

    plan: Plan
    candidate: Candidate
    complete: bool


@dataclasses.dataclass
class _Tally:
    """The search's state: per schedule its best fitting candidate, the candidate of least
    peak memory, why schedules have none, and the best plan per (schedule, M, v, e)."""

    best: dict[str, Candidate] = dataclasses.field(default_factory=dict)
    closest: Candidate | None = None
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    plans: dict[tuple[str, int, int, int], _Found] = dataclasses.field(default_factory=dict)

    def consider(self, c: Candidate) -> None:
        if self.closest is None or c.peak_memory < self.closest.peak_memory:
            self.closest = c
        if not c.fits:
            return
        old = self.best.get(c.schedule)
        if old is None or c.time_per_sample < old.time_per_sample:
            self.best[c.schedule] = c


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_auto(
    profile: Profile,
    topology: Topology,
    *,
    batch_size: int | None = None,
    schedules: Sequence[str] | None = None,
    allow_stale: bool = False,
    microbatches: Sequence[int] | None = None,
    memory_limit: float | None = None,
    remat: bool = True,
    straight: bool = False,
    cost_model: str = "pdjax",
    optimizer_state_factor: float = 2.0,
    chunks: Sequence[int] = (2,),
    extra_in_flight: Sequence[int] = (0, 1, 2),
    refine: bool = True,
    exhaustive: int = 256,
    refine_top: int = 3,
    host: HostCosts | None = None,
    calibration: Any = None,
) -> Plan:
    """The fastest configuration the simulator finds that fits the memory limit.

    Args:
      profile: per-layer costs (with times).
      topology: the devices.
      batch_size: ``B``, samples per optimizer step (default: the profile's batch size times the
        topology's devices).
      schedules: the schedules to search (default: every flush schedule pdjax generates, plus
        ``pipedream`` and ``2bw`` with ``allow_stale``).
      allow_stale: also search ``pipedream`` and ``2bw`` (stale weights: not sequential training).
      microbatches: candidate ``M`` (default: every divisor of ``B`` up to ``4 x`` the devices).
      memory_limit: bytes per device (None: ``topology.memory_per_device``; no limit if that is).
      remat: allow per-stage recomputation to fit the limit.
      straight: no replication.
      cost_model: the dynamic program's cost model.
      optimizer_state_factor: optimizer state bytes per parameter byte.
      chunks: ``v`` candidates for ``interleaved``.
      extra_in_flight: candidates for ``pipedream``'s extra depth.
      refine: improve the ``refine_top`` fastest configurations of each schedule by moving one
        stage boundary at a time while the simulator finds them faster.
      host: rank candidates no faster than their driver and shared pool allow (:class:`HostCosts`;
        e.g. in-process CPU devices). Default: the simulator alone.
      calibration: price candidates from measured stages, links and all-reduces
        (:class:`pdjax.calibrate.Calibration` for this model, microbatch size and devices; give
        ``microbatches`` so the microbatch size is the calibrated one). The dynamic program still
        prunes on the profile.
      exhaustive: search every configuration of stages and replicas on all the devices when there
        are at most this many (the module doc counts them): small cases are then exact; beyond it,
        the dynamic program's partitions and ``refine``.

    Returns:
      The plan of the best candidate (its ``schedule`` and ``num_microbatches`` set),
      ``plan.options["auto"]`` the choice and ``plan.options["alternatives"]`` the best
      candidate of each other schedule (``Candidate.to_dict`` form) or why it has none.

    Raises:
      PlanError: for bad options, or a memory limit no candidate fits (the message gives
        the smallest peak memory any candidate reached, and which).
    """
    B = _batch(profile, topology, batch_size)
    names = _schedule_names(schedules, allow_stale)
    space = _Space(
        profile=profile,
        topology=topology,
        limit=topology.memory_per_device if memory_limit is None else memory_limit,
        remat=remat,
        batch=B,
        straight=straight,
        cost_model=cost_model,
        factor=optimizer_state_factor,
        host=host,
        calibration=calibration,
        chunks=chunks,
        extra_in_flight=extra_in_flight,
        exhaustive=exhaustive,
    )
    counts = _microbatch_counts(B, microbatches, topology.num_devices)
    tally = _searched(space, names, counts, refine=refine, refine_top=refine_top)
    return _chosen(space, tally, names)


def _batch(profile: Profile, topology: Topology, batch_size: int | None) -> int:
    """``B``: ``batch_size``, by default the profile's batch size on every device."""
    B = batch_size if batch_size is not None else profile.batch_size * topology.num_devices
    if B < 1:
        raise PlanError(f"batch_size must be >= 1, got {batch_size}")
    return B


def _schedule_names(schedules: Sequence[str] | None, allow_stale: bool) -> list[str]:
    """The schedules to search: the table's, updates equal to sequential training by
    default, stale weights on request."""
    if schedules is None:
        names = [s for s in SCHEDULES if s not in STALE]
        if allow_stale:
            names += list(STALE)
        return names
    names = list(schedules)
    unknown = [s for s in names if s not in SCHEDULES]
    if unknown:
        raise PlanError(f"unknown schedules {unknown}; choose from {SCHEDULES}")
    stale = [s for s in names if s in STALE]
    if stale and not allow_stale:
        raise PlanError(
            f"{stale} update with stale weights (not sequential training); pass "
            "allow_stale=True (CLI: --allow-stale) to search them"
        )
    return names


def _microbatch_counts(B: int, microbatches: Sequence[int] | None, devices: int) -> list[int]:
    """Candidate ``M``: the given ones (dividing ``B``), or every divisor of ``B`` up to
    ``4 x`` the devices."""
    if microbatches is None:
        return [d for d in _divisors(B) if d <= 4 * devices] or [B]
    counts = sorted(set(int(m) for m in microbatches))
    bad = [m for m in counts if m < 1 or B % m]
    if bad:
        raise PlanError(f"microbatches {bad} do not divide the batch of {B} samples")
    return counts


def _searched(
    space: _Space, names: list[str], counts: list[int], *, refine: bool, refine_top: int
) -> _Tally:
    """The tally of every (schedule, ``M``) searched, then (``refine``) refined."""
    tally = _Tally()
    for name, M in itertools.product(names, counts):
        _search(space, tally, name, M)
    if refine:  # the simulator moves the boundaries of each schedule's best few only
        for name in names:
            _refine_best(space, tally, name, refine_top)
    return tally


def _search(space: _Space, tally: _Tally, name: str, M: int) -> None:
    """Simulates every partition of (schedule ``name``, ``M``) with each chunk count and
    in-flight depth the schedule takes, keeping the best fitting plan of each."""
    try:
        partitions, complete = _partitions(space, name, M, exhaustive=space.exhaustive)
    except (PlanError, ScheduleError) as err:
        tally.reasons.setdefault(name, str(err))
        return
    kind = SCHEDULE_KINDS[name]
    for v in space.chunks if kind.chunks is None else (1,):  # the chunks it takes
        for e in space.extra_in_flight if kind.takes("extra_in_flight") else (0,):
            for plan in partitions:
                c = _evaluate(space, plan, name, v=v, e=e, reasons=tally.reasons)
                if c is None:
                    continue
                tally.consider(c)
                key = (name, M, v, e)
                if c.fits and (key not in tally.plans or _better(c, tally.plans[key])):
                    tally.plans[key] = _Found(plan, c, complete)


def _refine_best(space: _Space, tally: _Tally, name: str, refine_top: int) -> None:
    """:func:`_refine` on the ``refine_top`` fastest plans of schedule ``name``."""
    plans = tally.plans
    mine = sorted(
        (k for k in plans if k[0] == name),
        key=lambda k: plans[k].candidate.time_per_sample,
    )
    for key in mine[:refine_top]:
        found = plans[key]
        if found.complete:
            continue
        c, better = _refine(
            space, found.candidate, found.plan, name, v=key[2], e=key[3], reasons=tally.reasons
        )
        tally.consider(c)
        if c.fits and c.time_per_sample < found.candidate.time_per_sample:
            plans[key] = _Found(better, c, False)


def _chosen(space: _Space, tally: _Tally, names: list[str]) -> Plan:
    """The winner's plan, with the choice and the alternatives in its options."""
    best, limit = tally.best, space.limit
    if not best:
        if tally.closest is None:
            raise PlanError(
                "no schedule could be planned for this model and topology: "
                + "; ".join(f"{k}: {v}" for k, v in tally.reasons.items())
            )
        raise PlanError(
            f"no configuration fits {limit:.4g} bytes per device; the smallest peak memory "
            f"found is {tally.closest.peak_memory:.4g} bytes ({tally.closest.label}): raise "
            "the limit to at least that, or use more devices"
        )
    winner = min(best.values(), key=lambda c: (c.time_per_sample, c.peak_memory))
    plan = next(f.plan for f in tally.plans.values() if f.candidate == winner)
    options = dict(plan.options)
    options["auto"] = winner.to_dict()
    if space.host is not None:
        options["auto"]["host"] = dataclasses.asdict(space.host)
    options["auto"]["calibrated"] = space.calibration is not None
    options["auto"]["memory_limit"] = limit  # the limit every candidate was held to
    options["alternatives"] = {
        name: (
            best[name].to_dict() if name in best else {"none": tally.reasons.get(name, "no fit")}
        )
        for name in names
        if name != winner.schedule
    }
    return dataclasses.replace(plan, schedule=winner.schedule, options=options)


def _better(c: Candidate, found: _Found) -> bool:
    return c.time_per_sample < found.candidate.time_per_sample


def _dp_schedule(name: str) -> str:
    """The schedule the dynamic program prices for ``name`` (the newer zero-bubble
    schedules keep 1F1B's or more in flight: price them as ``zb-h1``)."""
    return SCHEDULE_KINDS[name].priced_as


def _replication(name: str) -> str:
    """The dynamic program's replication option for ``name``: ``"auto"`` where it prices
    round-robin (a schedule that updates every microbatch), else ``"split"``."""
    return "auto" if SCHEDULE_KINDS[name].semantics.updates_per_microbatch else "split"


def _partitions(
    space: _Space, name: str, M: int, *, exhaustive: int = 0
) -> tuple[list[Plan], bool]:
    """The dynamic program's plans for (schedule, M): under the memory limit, and without
    it (recomputation may make it fit), replicated and straight; with at most
    ``exhaustive`` configurations on every device (:func:`_configurations`), every one of
    them instead (then the second value is True: the list is complete)."""
    profile, topology, limit, straight = space.profile, space.topology, space.limit, space.straight
    cost_model, factor, size = space.cost_model, space.factor, space.batch // M
    L = len(profile.layers)
    mode = _replication(name)
    configs = _configurations(L, topology.num_devices, straight, exhaustive)
    plans = []
    for stages in configs or ():
        try:
            plan = evaluate_partition(
                profile,
                topology,
                stages,
                cost_model=cost_model,
                schedule=_dp_schedule(name),
                num_microbatches=M,
                microbatch_size=size,
                optimizer_state_factor=factor,
                memory_limit=limit,
                partitioner="auto",
                replication=mode,
            )
        except (PlanError, ScheduleError):  # a form the schedule has not: the others
            continue
        # the runtime splits each microbatch evenly over a split stage's devices
        if all(st.replication != "split" or size % st.replicas == 0 for st in plan.stages):
            plans.append(plan)
    if plans:
        return plans, True
    out: list[Plan] = []
    error: Exception | None = None
    # the straight pipeline too (one device per stage): a replicated stage's devices must
    # divide the microbatch, and the program prices neither that nor recomputation
    for mem in [limit, _NO_LIMIT] if limit is not None else [_NO_LIMIT]:
        for pure in (True,) if straight else (False, True):
            try:
                plan = plan_pipedream(
                    profile,
                    topology,
                    memory_limit=mem,
                    cost_model=cost_model,
                    schedule=_dp_schedule(name),
                    straight=pure,
                    num_microbatches=M,
                    microbatch_size=size,
                    optimizer_state_factor=factor,
                    replication=mode,
                )
            except PlanError as e:
                error = e
                continue
            # the program ran without a limit (none, or this cut did not fit it): the plan
            # states the caller's, so that fits_memory and the JSON say what holds
            plan = dataclasses.replace(plan, memory_limit=limit)
            if not any(stage_specs(plan) == stage_specs(p) for p in out):
                out.append(plan)
    if not out and error is not None:
        raise error
    return out, False


def _configurations(
    L: int, P: int, straight: bool, limit: int
) -> list[list[tuple[int, int, int]]] | None:
    """Every ``(first_layer, last_layer, replicas)`` stage list of ``L`` layers that uses
    the ``P`` devices (``straight``: one stage per device), or None when there are more
    than ``limit``: ``C(L - 1, k - 1) C(P - 1, k - 1)`` with ``k`` stages (contiguous
    layers, replica counts summing to ``P``)."""
    ks = [P] if straight else list(range(1, min(L, P) + 1))
    if straight and (P < 2 or P > L):
        return None
    if sum(math.comb(L - 1, k - 1) * math.comb(P - 1, k - 1) for k in ks) > limit:
        return None
    out = []
    for k in ks:
        for cuts in itertools.combinations(range(1, L), k - 1):
            bounds = (0, *cuts, L)
            for splits in itertools.combinations(range(1, P), k - 1):
                devices = (0, *splits, P)
                out.append(
                    [(bounds[i], bounds[i + 1] - 1, devices[i + 1] - devices[i]) for i in range(k)]
                )
    return out


def _evaluate(
    space: _Space, plan: Plan, name: str, *, v: int, e: int, reasons: dict[str, str]
) -> Candidate | None:
    """The candidate of ``plan`` run with schedule ``name``, ``v`` chunks and in-flight
    depth ``e``, with the least recomputation that fits (or none; ``reasons`` says why)."""
    limit = space.limit
    P = plan.num_stages
    flags = [False] * P
    uneven = [
        st.replicas
        for st in plan.stages
        if st.replication == "split" and plan.microbatch_size % st.replicas
    ]
    if uneven:  # the runtime splits each microbatch evenly over a split stage's devices
        reasons.setdefault(
            name,
            f"microbatches of {plan.microbatch_size} samples do not split over {uneven[0]} devices",
        )
        return None

    def run() -> tuple[float, tuple[float, ...], tuple[int, ...]]:
        return price(
            plan,
            space.profile,
            name,
            chunks=v,
            remat=flags,
            extra_in_flight=e,
            batch_size=space.batch,
            host=space.host,
            calibration=space.calibration,
        )

    try:
        seconds, peaks, in_flight = run()
        if limit is not None and space.remat:
            over = [d for d, b in enumerate(peaks) if b > limit]
            if over:  # recompute only on the device groups over the limit
                for d in over:
                    flags[d] = True
                seconds, peaks, in_flight = run()
    except (PlanError, ScheduleError) as err:
        reasons.setdefault(name, str(err))
        return None
    peak = max(peaks)
    return Candidate(
        schedule=name,
        microbatches=plan.num_microbatches,
        chunks=v,
        extra_in_flight=e,
        remat=tuple(flags),
        stages=stage_specs(plan),
        time_per_sample=seconds,
        peak_memory=peak,
        fits=limit is None or peak <= limit,
        group_peak_memory=peaks,
        in_flight=in_flight,
    )


def _refine(
    space: _Space,
    c: Candidate,
    plan: Plan,
    name: str,
    *,
    v: int,
    e: int,
    reasons: dict[str, str],
) -> tuple[Candidate, Plan]:
    """Moves one stage boundary by one layer at a time while the simulator finds the
    result faster (or, not fitting yet, smaller)."""

    def key(x: Candidate) -> tuple[bool, float]:
        return (not x.fits, x.time_per_sample if x.fits else x.peak_memory)

    for _ in range(4 * len(space.profile.layers)):
        improved = False
        stages = list(c.stages)
        for b in range(len(stages) - 1):
            for delta in (-1, 1):
                first, last, r = stages[b]
                _, nxt_last, nxt_r = stages[b + 1]
                cut = last + delta
                if cut < first or cut + 1 > nxt_last:
                    continue
                moved = list(stages)
                moved[b] = (first, cut, r)
                moved[b + 1] = (cut + 1, nxt_last, nxt_r)
                try:
                    other = evaluate_partition(
                        space.profile,
                        space.topology,
                        moved,
                        cost_model=space.cost_model,
                        schedule=_dp_schedule(name),
                        num_microbatches=plan.num_microbatches,
                        microbatch_size=plan.microbatch_size,
                        optimizer_state_factor=space.factor,
                        memory_limit=space.limit,
                        partitioner="auto",
                        replication=list(plan.replication),
                    )
                except (PlanError, ScheduleError):
                    continue
                d = _evaluate(space, other, name, v=v, e=e, reasons=reasons)
                if d is not None and key(d) < key(c):
                    c, plan, improved = d, other, True
                    break
            if improved:
                break
        if not improved:
            break
    return c, plan
