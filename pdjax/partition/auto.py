"""``plan_auto``: the planner chooses everything a pipeline run needs.

For one model (a profile), devices (a topology) and a batch of ``B`` samples per optimizer
step, :func:`plan_auto` searches

* the **schedule**: ``gpipe``, ``1f1b``, ``interleaved`` (``v`` chunks), ``zb-h1`` and the
  other flush schedules pdjax generates; ``pipedream`` and ``2bw`` (stale weights) only
  when the caller allows them;
* the **microbatches** per step ``M`` (divisors of ``B``; the microbatch size is ``B / M``);
* the **stages and replication**: every configuration on all the devices when there are
  few (``exhaustive``: contiguous layers, replica counts summing to the devices); else
  PipeDream's dynamic program for each (schedule, M), with and without the memory limit,
  each partition then improved by moving one stage boundary at a time while the simulator
  says it is faster (the program prices stages apart, the simulator the whole schedule:
  its optimum may not be the simulator's, chiefly in how many replicas a stage gets);
* per-stage **recomputation** (remat): a stage recomputes its forward in its backward
  only if its device group would not fit the memory limit otherwise;
* for ``pipedream``, the **in-flight depth** (``extra_in_flight``);

and ranks every candidate by the simulator (:func:`pdjax.pipeline.simulate` over
:func:`pdjax.pipeline.costs_from_plan`): predicted seconds per sample (a flush step's
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

Recomputation in the costs: the stage's backward also runs its forward again (added to the
input-gradient part, which the previous stage waits for), and a microbatch in flight keeps
only the stage's input instead of its saved activations.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

from pdjax.errors import PlanError, ScheduleError
from pdjax.partition.partitioners import evaluate_partition
from pdjax.partition.pipedream import plan_pipedream
from pdjax.partition.plan import Plan
from pdjax.partition.topology import Topology
from pdjax.profile import Profile

__all__ = [
    "Candidate",
    "HostCosts",
    "evaluate_candidate",
    "plan_auto",
]

_NO_LIMIT = 1e30  # bytes: "no memory limit" for the dynamic program


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration :func:`plan_auto` simulated.

    Attributes:
      schedule: the schedule's name.
      microbatches: ``M`` per step (``pipedream``: the microbatch count of a step's batch).
      chunks: ``v`` (``interleaved``; 1 otherwise).
      extra_in_flight: ``pipedream``'s extra depth (0 otherwise).
      remat: per plan stage, whether it recomputes its forward in the backward.
      stages: per plan stage, ``(first_layer, last_layer, replicas)``.
      time_per_sample: simulated seconds per sample.
      peak_memory: simulated bytes on the fullest device.
      fits: whether every device fits the memory limit.
      group_peak_memory: simulated bytes on one device of each plan stage's group.
      in_flight: simulated peak microbatches in flight per (virtual) stage: one per plan
        stage, ``P v`` under ``interleaved`` (virtual stage ``k`` on group ``k mod P``),
        ``2 P`` under ``zb-v`` (the V's halves; ``k`` and ``2 P - 1 - k`` share a group).
    """

    schedule: str
    microbatches: int
    chunks: int
    extra_in_flight: int
    remat: tuple[bool, ...]
    stages: tuple[tuple[int, int, int], ...]
    time_per_sample: float
    peak_memory: float
    fits: bool
    group_peak_memory: tuple[float, ...] = ()
    in_flight: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["remat"] = list(self.remat)
        out["stages"] = [list(s) for s in self.stages]
        out["group_peak_memory"] = list(self.group_peak_memory)
        out["in_flight"] = list(self.in_flight)
        return out

    @property
    def label(self) -> str:
        extra = f" v={self.chunks}" if self.chunks > 1 else ""
        extra += f" +{self.extra_in_flight}" if self.extra_in_flight else ""
        remat = "".join("r" if r else "-" for r in self.remat)
        config = "-".join(str(r) for _, _, r in self.stages)
        return f"{self.schedule}{extra} M={self.microbatches} {config} remat={remat}"


@dataclasses.dataclass(frozen=True)
class HostCosts:
    """What the simulator leaves out and a run may be bound by instead: the driver and
    devices that share one thread pool.

    The simulator prices each device group's actions and transfers; a single-controller
    driver also dispatches every action from one host thread, and in-process CPU devices
    run their programs on one shared pool of cores, the driver's among them. A candidate's
    seconds are then the largest of the simulated time, the driver's ``actions x
    seconds_per_action`` and (with ``concurrency``) the devices' summed busy seconds plus
    the driver's, over ``concurrency``.

    Attributes:
      seconds_per_action: host seconds the driver spends per dispatched action (measured:
        ``RunMetrics.host_seconds / RunMetrics.actions`` on a model with negligible compute;
        ``pdjax bench`` reports it).
      concurrency: how many programs the devices' shared pool runs at once
        (:func:`pdjax.apps.bench.pool_concurrency`); None where every device computes apart.
    """

    seconds_per_action: float = 0.0
    concurrency: float | None = None

    def __post_init__(self) -> None:
        spa, conc = self.seconds_per_action, self.concurrency
        if not (math.isfinite(spa) and spa >= 0):
            raise PlanError(f"seconds_per_action must be finite and >= 0, got {spa}")
        if conc is not None and not (math.isfinite(conc) and conc > 0):
            raise PlanError(f"concurrency must be finite and > 0 (or None), got {conc}")

    def bound(self, sim: Any) -> float:
        """Seconds the host and the shared pool need for the whole simulated run."""
        actions = sum(len(group) for group in sim.schedule.actions)
        driver = actions * self.seconds_per_action
        if self.concurrency is None:
            return driver
        replicas = sim.schedule.replicas
        work = math.fsum((sp.end - sp.start) * replicas[sp.group] for sp in sim.timeline.spans)
        # the driver's thread takes its turn on the same cores as the devices' programs
        return max(driver, (work + driver) / self.concurrency)


def _stage_specs(plan: Plan) -> tuple[tuple[int, int, int], ...]:
    return tuple((st.first_layer, st.last_layer, st.replicas) for st in plan.stages)


def _schedule_stages(name: str, chunks: int) -> int:
    """Virtual stages per device group (``interleaved``; ``zb-v`` is priced apart)."""
    return chunks if name == "interleaved" else 1


def evaluate_candidate(
    plan: Plan,
    profile: Profile,
    schedule: str,
    *,
    chunks: int = 1,
    remat: Sequence[bool] | None = None,
    extra_in_flight: int = 0,
    batch_size: int | None = None,
    host: HostCosts | None = None,
    calibration: Any = None,
) -> tuple[float, tuple[float, ...]]:
    """Simulated ``(seconds per sample, peak bytes per device group)`` of ``plan`` run
    with ``schedule`` and the given recomputation per plan stage; with ``host``, no less
    than what the driver and a shared pool need (:class:`HostCosts`). With a
    ``calibration`` (:class:`pdjax.calibrate.Calibration`), the stages, links and
    all-reduces it measured replace the profile's (stages it lacks are priced from the
    profile times its profile ratio); ``interleaved`` cannot be calibrated.

    Raises:
      ScheduleError / PlanError: a configuration the schedule or the costs cannot take.
    """
    seconds, peaks, _ = _price(
        plan,
        profile,
        schedule,
        chunks=chunks,
        remat=remat,
        extra_in_flight=extra_in_flight,
        batch_size=batch_size,
        host=host,
        calibration=calibration,
    )
    return seconds, peaks


def _price(
    plan: Plan,
    profile: Profile,
    schedule: str,
    *,
    chunks: int = 1,
    remat: Sequence[bool] | None = None,
    extra_in_flight: int = 0,
    batch_size: int | None = None,
    host: HostCosts | None = None,
    calibration: Any = None,
) -> tuple[float, tuple[float, ...], tuple[int, ...]]:
    """:func:`evaluate_candidate`'s figures and the simulated peak microbatches in flight
    per (virtual) stage."""
    from pdjax.pipeline import costs_from_plan, generate, simulate
    from pdjax.pipeline.schedules import ROUND_ROBIN, STALE
    from pdjax.pipeline.simulate import stream_length

    P = plan.num_stages
    v = _schedule_stages(schedule, chunks)
    measured: dict[str, Any] = (
        {} if calibration is None else {"calibration": calibration, "partial": True}
    )
    if schedule == "zb-v":  # each plan stage cut into two halves placed in a V
        costs = costs_from_plan(plan, profile, **measured).v_shape()
    else:
        costs = costs_from_plan(plan, profile, chunks=v, **measured)
    flags = tuple(remat) if remat is not None else (False,) * P
    if any(flags):
        costs = _with_remat(costs, flags, schedule, plan.replicas)
    M = plan.num_microbatches
    kwargs: dict[str, Any] = {"replicas": plan.replicas}
    if schedule in ROUND_ROBIN:
        kwargs["replication"] = plan.replication
    if schedule == "pipedream":
        n = stream_length("pipedream", P, replicas=plan.replicas, replication=plan.replication)
        sched = generate("pipedream", P, n, extra_in_flight=extra_in_flight, **kwargs)
    elif schedule == "2bw":
        n = stream_length("2bw", P, M, replicas=plan.replicas, replication=plan.replication)
        sched = generate("2bw", P, M, stream=n, **kwargs)
    else:
        sched = generate(
            schedule, P, M, chunks=chunks if schedule == "interleaved" else 2, **kwargs
        )
    sim = simulate(sched, costs)
    samples = batch_size if batch_size is not None else M * plan.microbatch_size
    if schedule in STALE:
        seconds = sim.time_per_microbatch / plan.microbatch_size
    else:
        seconds = sim.step_time / samples
    if host is not None:  # the whole run's bound over the samples the run covers
        covered = sim.schedule.num_microbatches * plan.microbatch_size
        seconds = max(seconds, host.bound(sim) / covered)
    return seconds, tuple(float(b) for b in sim.peak_memory), tuple(sim.peak_in_flight)


def _with_remat(costs: Any, flags: Sequence[bool], schedule: str, replicas: Sequence[int]) -> Any:
    """``costs`` with recomputation at the virtual stages of every plan stage flagged: the
    backward runs the forward again first, and a microbatch in flight keeps only the
    stage's input (its share on one device)."""
    P = len(flags)
    stages = list(costs.stages)
    for k, st in enumerate(stages):
        group = k % P if schedule != "zb-v" else (k if k < P else 2 * P - 1 - k)
        if not flags[group]:
            continue
        kept = stages[k - 1].activation_bytes if k > 0 else 0
        stages[k] = dataclasses.replace(
            st,
            input_grad=st.input_grad + st.forward,
            stash_bytes=min(st.stash_bytes, round(kept / replicas[group])),
        )
    return dataclasses.replace(costs, stages=tuple(stages))


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
      batch_size: ``B``, samples per optimizer step (default: the profile's batch size
        times the topology's devices).
      schedules: the schedules to search (default: every flush schedule pdjax generates,
        plus ``pipedream`` and ``2bw`` with ``allow_stale``).
      allow_stale: search ``pipedream`` and ``2bw`` too (their updates use stale weights:
        not sequential training).
      microbatches: candidate ``M`` (default: every divisor of ``B`` up to ``4 x`` the
        devices).
      memory_limit: bytes per device (default: ``topology.memory_per_device``; None: no
        limit).
      remat: allow per-stage recomputation to fit the limit.
      straight: no replication.
      cost_model: the dynamic program's cost model.
      optimizer_state_factor: optimizer state bytes per parameter byte.
      chunks: ``v`` candidates for ``interleaved``.
      extra_in_flight: candidates for ``pipedream``'s extra depth.
      refine: improve the ``refine_top`` fastest configurations of each schedule by
        moving one stage boundary at a time while the simulator finds them faster.
      host: rank candidates no faster than their driver and shared pool allow
        (:class:`HostCosts`; e.g. in-process CPU devices). Default: the simulator alone.
      calibration: price candidates from measured stages, links and all-reduces
        (:class:`pdjax.calibrate.Calibration` for this model, microbatch size and devices;
        give ``microbatches`` so the microbatch size is the calibrated one). The dynamic
        program still prunes on the profile.
      exhaustive: search every configuration of stages and replicas on all ``P`` devices
        (contiguous layers, replica counts summing to ``P``; with ``straight``, one stage
        per device) when there are at most this many (``sum_k C(L - 1, k - 1) C(P - 1,
        k - 1)`` with ``k`` stages; ``C(L - 1, P - 1)`` straight): small cases are then
        exact; beyond it, the dynamic program's partitions and ``refine``.

    Returns:
      The plan of the best candidate (its ``schedule`` and ``num_microbatches`` set),
      ``plan.options["auto"]`` the choice and ``plan.options["alternatives"]`` the best
      candidate of each other schedule (``Candidate.to_dict`` form) or the reason it has
      none.

    Raises:
      PlanError: for bad options, or a memory limit no candidate fits (the message gives
        the smallest peak memory any candidate reached, and which).
    """
    from pdjax.pipeline.schedules import SCHEDULES, STALE

    devices = topology.num_devices
    B = batch_size if batch_size is not None else profile.batch_size * devices
    if B < 1:
        raise PlanError(f"batch_size must be >= 1, got {batch_size}")
    if schedules is None:
        # updates equal to sequential training by default, stale weights on request
        names = [s for s in SCHEDULES if s not in STALE]
        if allow_stale:
            names += list(STALE)
    else:
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
    limit = topology.memory_per_device if memory_limit is None else memory_limit
    if microbatches is None:
        counts = [d for d in _divisors(B) if d <= 4 * devices] or [B]
    else:
        counts = sorted(set(int(m) for m in microbatches))
        bad = [m for m in counts if m < 1 or B % m]
        if bad:
            raise PlanError(f"microbatches {bad} do not divide the batch of {B} samples")
    best: dict[str, Candidate] = {}
    closest: Candidate | None = None
    reasons: dict[str, str] = {}

    def consider(c: Candidate) -> None:
        nonlocal closest
        if closest is None or c.peak_memory < closest.peak_memory:
            closest = c
        if not c.fits:
            return
        old = best.get(c.schedule)
        if old is None or c.time_per_sample < old.time_per_sample:
            best[c.schedule] = c

    plans: dict[tuple[str, int, int, int], Plan] = {}
    extra: dict[str, Any] = {"host": host, "calibration": calibration}
    for name in names:
        for M in counts:
            try:
                partitions, complete = _partitions(
                    profile,
                    topology,
                    name,
                    M,
                    B // M,
                    limit,
                    straight,
                    cost_model,
                    optimizer_state_factor,
                    exhaustive,
                )
            except (PlanError, ScheduleError) as err:
                reasons.setdefault(name, str(err))
                continue
            for v in chunks if name == "interleaved" else (1,):
                for e in extra_in_flight if name == "pipedream" else (0,):
                    for plan in partitions:
                        c = _evaluate(plan, profile, name, v, e, limit, remat, B, reasons, **extra)
                        if c is None:
                            continue
                        consider(c)
                        key = (name, M, v, e)
                        if c.fits and (key not in plans or _better(c, plans[key])):
                            plans[key] = dataclasses.replace(
                                plan,
                                options={**plan.options, "_candidate": c, "_complete": complete},
                            )
    if refine:  # the simulator moves the boundaries of each schedule's best few only
        for name in names:
            mine = sorted(
                (k for k in plans if k[0] == name),
                key=lambda k: plans[k].options["_candidate"].time_per_sample,
            )
            for key in mine[:refine_top]:
                plan = plans[key]
                if plan.options["_complete"]:
                    continue
                c, better = _refine(
                    plan.options["_candidate"],
                    plan,
                    profile,
                    topology,
                    name,
                    key[2],
                    key[3],
                    limit,
                    remat,
                    B,
                    cost_model,
                    optimizer_state_factor,
                    reasons,
                    **extra,
                )
                consider(c)
                if c.fits and c.time_per_sample < plan.options["_candidate"].time_per_sample:
                    plans[key] = dataclasses.replace(
                        better, options={**better.options, "_candidate": c, "_complete": False}
                    )
    if not best:
        if closest is None:
            raise PlanError(
                "no schedule could be planned for this model and topology: "
                + "; ".join(f"{k}: {v}" for k, v in reasons.items())
            )
        raise PlanError(
            f"no configuration fits {limit:.4g} bytes per device; the smallest peak memory "
            f"found is {closest.peak_memory:.4g} bytes ({closest.label}): raise the limit "
            "to at least that, or use more devices"
        )
    winner = min(best.values(), key=lambda c: (c.time_per_sample, c.peak_memory))
    plan = next(p for (name, M, v, e), p in plans.items() if p.options["_candidate"] == winner)
    options = {k: v for k, v in plan.options.items() if k not in ("_candidate", "_complete")}
    options["auto"] = winner.to_dict()
    if host is not None:
        options["auto"]["host"] = dataclasses.asdict(host)
    options["auto"]["calibrated"] = calibration is not None
    options["auto"]["memory_limit"] = limit  # the limit every candidate was held to
    options["alternatives"] = {
        name: (best[name].to_dict() if name in best else {"none": reasons.get(name, "no fit")})
        for name in names
        if name != winner.schedule
    }
    return dataclasses.replace(plan, schedule=winner.schedule, options=options)


def _better(c: Candidate, plan: Plan) -> bool:
    old: Candidate = plan.options["_candidate"]
    return c.time_per_sample < old.time_per_sample


def _dp_schedule(name: str) -> str:
    """The schedule the dynamic program prices for ``name`` (the newer zero-bubble
    schedules keep 1F1B's or more in flight: price them as ``zb-h1``)."""
    from pdjax.pipeline.schedules import SPLIT_BACKWARD

    return "zb-h1" if name in SPLIT_BACKWARD else name


def _partitions(
    profile: Profile,
    topology: Topology,
    name: str,
    M: int,
    size: int,
    limit: float | None,
    straight: bool,
    cost_model: str,
    factor: float,
    exhaustive: int = 0,
) -> tuple[list[Plan], bool]:
    """The dynamic program's plans for (schedule, M): under the memory limit, and without
    it (recomputation may make it fit), replicated and straight; with at most
    ``exhaustive`` configurations on every device (:func:`_configurations`), every one of
    them instead (then the second value is True: the list is complete)."""
    L = len(profile.layers)
    mode = "auto" if name == "pipedream" else "split"
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
    replication = "auto" if name == "pipedream" else "split"
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
                    replication=replication,
                )
            except PlanError as e:
                error = e
                continue
            if not any(_stage_specs(plan) == _stage_specs(p) for p in out):
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
    plan: Plan,
    profile: Profile,
    name: str,
    v: int,
    e: int,
    limit: float | None,
    remat: bool,
    B: int,
    reasons: dict[str, str],
    *,
    host: HostCosts | None = None,
    calibration: Any = None,
) -> Candidate | None:
    """The candidate of ``plan`` with the least recomputation that fits (or none)."""
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
        return _price(
            plan,
            profile,
            name,
            chunks=v,
            remat=flags,
            extra_in_flight=e,
            batch_size=B,
            host=host,
            calibration=calibration,
        )

    try:
        seconds, peaks, in_flight = run()
        if limit is not None and remat:
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
        stages=_stage_specs(plan),
        time_per_sample=seconds,
        peak_memory=peak,
        fits=limit is None or peak <= limit,
        group_peak_memory=peaks,
        in_flight=in_flight,
    )


def _refine(
    c: Candidate,
    plan: Plan,
    profile: Profile,
    topology: Topology,
    name: str,
    v: int,
    e: int,
    limit: float | None,
    remat: bool,
    B: int,
    cost_model: str,
    factor: float,
    reasons: dict[str, str],
    *,
    host: HostCosts | None = None,
    calibration: Any = None,
) -> tuple[Candidate, Plan]:
    """Moves one stage boundary by one layer at a time while the simulator finds the
    result faster (or, not fitting yet, smaller)."""

    def key(x: Candidate) -> tuple[bool, float]:
        return (not x.fits, x.time_per_sample if x.fits else x.peak_memory)

    for _ in range(4 * len(profile.layers)):
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
                        profile,
                        topology,
                        moved,
                        cost_model=cost_model,
                        schedule=_dp_schedule(name),
                        num_microbatches=plan.num_microbatches,
                        microbatch_size=plan.microbatch_size,
                        optimizer_state_factor=factor,
                        memory_limit=limit,
                        partitioner="auto",
                        replication=list(plan.replication),
                    )
                except (PlanError, ScheduleError):
                    continue
                d = _evaluate(
                    other,
                    profile,
                    name,
                    v,
                    e,
                    limit,
                    remat,
                    B,
                    reasons,
                    host=host,
                    calibration=calibration,
                )
                if d is not None and key(d) < key(c):
                    c, plan, improved = d, other, True
                    break
            if improved:
                break
        if not improved:
            break
    return c, plan
