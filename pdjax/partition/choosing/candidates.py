"""Pricing a plan by the simulator, as :func:`~pdjax.partition.plan_auto` ranks it: the
:class:`Candidate` it records, the host costs a run may be bound by (:class:`HostCosts`),
and :func:`evaluate_candidate` (a plan run with a schedule, chunks, recomputation,
in-flight depth and ``pipedream``'s ``in_flight`` count, simulated).

The simulator plays the schedule the runtime would run, generated with these options, so
a candidate under ``in_flight="paper"`` is priced exactly (its time, peak memory and peak
in flight per stage), where the dynamic program's round-trip bound is not
(:func:`~pdjax.partition.plan_pipedream`).

Memory policies in the costs (:mod:`pdjax._memory_policy`, one per plan stage):

* ``"full"`` (recomputation): the stage's backward also runs its forward again (added to
  the input-gradient part, which the previous stage waits for), and a microbatch in flight
  keeps only the stage's input instead of its saved activations;
* a named policy (``"dots"``, ``"dots-no-batch"``, ``"offload"``): each layer keeps its
  input and the residuals the policy saves (:class:`~pdjax.profile.PolicyCost`'s
  ``residual_bytes``, the device's share: offloaded bytes are not counted against the
  device), and the backward recomputes ``recompute`` of each layer's forward seconds,
  added to the input-gradient part. The transfers of offloaded residuals to and from the
  host are not priced. Named policies are priced per plan stage, so only where each plan
  stage is one simulated stage (not ``interleaved``'s chunks or ``zb-v``'s V); the
  profile must price them (``profile(..., memory_policies=True)``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdjax._memory_policy import memory_policies, policy_name
from pdjax.errors import PlanError
from pdjax.partition.choosing.simulator_costs import costs_from_plan
from pdjax.plan.plan import Plan
from pdjax.profile import Profile
from pdjax.schedules import (
    ROUND_ROBIN,
    SCHEDULE_KINDS,
    STALE,
    STREAMING,
    Schedule,
    ScheduleSpec,
    generate,
    stage_groups,
    validate,
)
from pdjax.simulator import simulate, stream_length

__all__ = [
    "Candidate",
    "HostCosts",
    "costs_under",
    "evaluate_candidate",
    "policy_arrays",
    "policy_deltas",
    "policy_letters",
    "price",
    "stage_specs",
]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration :func:`plan_auto` simulated.

    Attributes:
      schedule: the schedule's name.
      microbatches: ``M`` per step (``pipedream``: the microbatch count of a step's batch).
      chunks: ``v`` (``interleaved``; 1 otherwise).
      extra_in_flight: ``pipedream``'s extra depth (0 otherwise).
      remat: per plan stage, whether its memory policy is other than ``"none"`` (it
        saves memory by recomputing some or all of its forward).
      policies: per plan stage, its memory policy (``"none"``, ``"full"``, or a named
        policy, :data:`pdjax._memory_policy.MEMORY_POLICIES`); what ``Pipeline(remat=)``
        takes.
      stages: per plan stage, ``(first_layer, last_layer, replicas)``.
      time_per_sample: simulated seconds per sample.
      peak_memory: simulated bytes on the fullest device.
      fits: whether every device fits the memory limit.
      group_peak_memory: simulated bytes on one device of each plan stage's group.
      in_flight: simulated peak microbatches in flight per (virtual) stage: one per plan
        stage, ``P v`` under ``interleaved`` (virtual stage ``k`` on group ``k mod P``),
        ``2 P`` under ``zb-v`` (the V's halves; ``k`` and ``2 P - 1 - k`` share a group).
      in_flight_option: ``pipedream``'s ``in_flight`` option, the groups in flight of
        round-robin stages: ``"full-rate"`` (the default, and that of every schedule
        without the option) or ``"paper"`` (PipeDream's NOAM at the input stage). Named
        apart from ``in_flight``, the simulated counts.
      call_memory: per plan stage, bytes per device of one call of the caller's length by
        the ``pdjax`` memory model (``plan_auto``'s ``samples_per_call``; empty without it):
        what the runtime places up front for the call, which the simulated stream leaves
        out. ``fits`` holds the larger of it and ``group_peak_memory``.
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
    in_flight_option: str = "full-rate"
    call_memory: tuple[float, ...] = ()
    policies: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # a candidate made with remat flags only: True is "full", False "none"
        if not self.policies:
            object.__setattr__(self, "policies", tuple(policy_name(r) for r in self.remat))

    @property
    def spec(self) -> ScheduleSpec:
        """What the candidate runs: its schedule, ``M``, chunks, extra depth, in-flight
        mode and memory policy per plan stage."""
        return ScheduleSpec(
            self.schedule,
            microbatches=self.microbatches,
            chunks=SCHEDULE_KINDS[self.schedule].chunks_for(self.chunks),
            extra_in_flight=self.extra_in_flight,
            in_flight=self.in_flight_option,
            remat=self.policies or False,
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["remat"] = list(self.remat)
        out["policies"] = list(self.policies)
        out["stages"] = [list(s) for s in self.stages]
        out["group_peak_memory"] = list(self.group_peak_memory)
        out["in_flight"] = list(self.in_flight)
        out["call_memory"] = list(self.call_memory)
        return out

    @property
    def held_memory(self) -> float:
        """The bytes the memory limit is held to: the simulated peak, or the call's
        ``pdjax`` memory where larger."""
        return max((self.peak_memory, *self.call_memory))

    @property
    def label(self) -> str:
        extra = f" v={self.chunks}" if self.chunks > 1 else ""
        extra += f" +{self.extra_in_flight}" if self.extra_in_flight else ""
        extra += (
            f" in_flight={self.in_flight_option}" if self.in_flight_option != "full-rate" else ""
        )
        remat = policy_letters(self.policies)
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
      devices_per_replica: the devices behind each of a simulated stage's replicas (a
        mesh search's unit: :mod:`pdjax.partition.choosing.meshes`), each of which runs
        its share of every action on the pool.
    """

    seconds_per_action: float = 0.0
    concurrency: float | None = None
    devices_per_replica: int = 1

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
        work = self.devices_per_replica * math.fsum(
            (sp.end - sp.start) * replicas[sp.group] for sp in sim.timeline.spans
        )
        # the driver's thread takes its turn on the same cores as the devices' programs
        return max(driver, (work + driver) / self.concurrency)


def stage_specs(plan: Plan) -> tuple[tuple[int, int, int], ...]:
    """Per plan stage ``(first_layer, last_layer, replicas)``."""
    return tuple((st.first_layer, st.last_layer, st.replicas) for st in plan.stages)


def evaluate_candidate(
    plan: Plan,
    profile: Profile,
    schedule: str,
    *,
    chunks: int = 1,
    remat: Sequence[bool | str] | None = None,
    extra_in_flight: int = 0,
    batch_size: int | None = None,
    host: HostCosts | None = None,
    calibration: Any = None,
    in_flight: str = "full-rate",
) -> tuple[float, tuple[float, ...]]:
    """Simulated ``(seconds per sample, peak bytes per device group)`` of ``plan`` run
    with ``schedule`` and the given memory policy per plan stage (``remat``: a bool, ``True``
    for ``"full"``, or a policy name each; see the module doc); with ``host``, no less
    than what the driver and a shared pool need (:class:`HostCosts`). With a
    ``calibration`` (:class:`pdjax.calibrate.Calibration`), the stages, links and
    all-reduces it measured replace the profile's (stages it lacks are priced from the
    profile times its profile ratio); ``interleaved`` cannot be calibrated.
    ``in_flight``: ``pipedream``'s option (``"full-rate"`` or ``"paper"``), the schedule
    generated with it; ignored by a schedule that does not take it, as ``extra_in_flight``.

    Raises:
      ScheduleError / PlanError: a configuration the schedule or the costs cannot take.
    """
    seconds, peaks, _ = price(
        plan,
        profile,
        schedule,
        chunks=chunks,
        remat=remat,
        extra_in_flight=extra_in_flight,
        batch_size=batch_size,
        host=host,
        calibration=calibration,
        in_flight=in_flight,
    )
    return seconds, peaks


def price(
    plan: Plan,
    profile: Profile,
    schedule: str,
    *,
    chunks: int = 1,
    remat: Sequence[bool | str] | None = None,
    extra_in_flight: int = 0,
    batch_size: int | None = None,
    host: HostCosts | None = None,
    calibration: Any = None,
    in_flight: str = "full-rate",
) -> tuple[float, tuple[float, ...], tuple[int, ...]]:
    """:func:`evaluate_candidate`'s figures and the simulated peak microbatches in flight
    per (virtual) stage."""
    P = plan.num_stages
    kind = SCHEDULE_KINDS.get(schedule)  # an unknown name: generate() refuses it below
    v = 1 if kind is None else kind.chunks_for(chunks)
    measured: dict[str, Any] = (
        {} if calibration is None else {"calibration": calibration, "partial": True}
    )
    if kind is not None and kind.semantics.v_shaped:  # plan stages halved, placed in a V
        costs = costs_from_plan(plan, profile, **measured).v_shape()
    else:  # the chunks the caller chose (interleaved), else one per device group
        costs = costs_from_plan(plan, profile, chunks=v, **measured)
    policies = memory_policies(remat if remat is not None else False, P, PlanError)
    if any(p != "none" for p in policies):
        costs = costs_under(costs, plan, profile, policies, schedule)
    M = plan.num_microbatches
    takes = kind.takes if kind is not None else (lambda option: False)
    sched = _validated_schedule(
        schedule,
        P,
        M,
        v,
        extra_in_flight if takes("extra_in_flight") else 0,
        plan.replicas,
        plan.replication,
        in_flight if takes("in_flight") else "full-rate",
    )
    sim = simulate(sched, costs, check=False)  # validated above
    samples = batch_size if batch_size is not None else M * plan.microbatch_size
    if schedule in STALE:
        seconds = sim.time_per_microbatch / plan.microbatch_size
    else:
        seconds = sim.step_time / samples
    if host is not None:  # the whole run's bound over the samples the run covers
        covered = sim.schedule.num_microbatches * plan.microbatch_size
        seconds = max(seconds, host.bound(sim) / covered)
    return seconds, tuple(float(b) for b in sim.peak_memory), tuple(sim.peak_in_flight)


@functools.lru_cache(maxsize=256)
def _validated_schedule(
    schedule: str,
    P: int,
    M: int,
    chunks: int,
    extra_in_flight: int,
    replicas: tuple[int, ...],
    replication: tuple[str, ...],
    in_flight: str = "full-rate",
) -> Schedule:
    """The schedule :func:`price` simulates, generated and validated.

    Kept (least recently used first out): the planner prices thousands of partitions with
    a few hundred distinct schedules between them, and a schedule depends on these
    arguments only (the generators are pure, and a :class:`Schedule` is immutable), so one
    validated object serves every partition of the same shape; the player's index of its
    actions (``Schedule._derived``) is then built once too. A generator's or the
    validator's error is not kept: it is raised again on each call.
    """
    kwargs: dict[str, Any] = {"replicas": replicas}
    if schedule in ROUND_ROBIN:
        kwargs["replication"] = replication
    if extra_in_flight:
        kwargs["extra_in_flight"] = extra_in_flight
    if in_flight != "full-rate":
        kwargs["in_flight"] = in_flight
    if schedule in STREAMING:  # a stream long enough for a steady state
        # (full rate's counts, at least paper's: long enough for either)
        n = stream_length(schedule, P, M, replicas=replicas, replication=replication)
        sched = generate(schedule, P, M, stream=n, **kwargs)
    else:
        sched = generate(schedule, P, M, chunks=chunks, **kwargs)
    validate(sched)
    return sched


def policy_letters(policies: Sequence[str]) -> str:
    """One letter per stage's memory policy: ``-`` none, ``r`` full recomputation, ``d``
    dots, ``b`` dots-no-batch, ``o`` offload."""
    letters = {"none": "-", "full": "r", "dots": "d", "dots-no-batch": "b", "offload": "o"}
    return "".join(letters.get(p, "?") for p in policies)


def policy_deltas(
    plan: Plan, profile: Profile, policies: Sequence[str], chunks: int = 1
) -> list[tuple[float, float]]:
    """Per plan stage under a named memory policy, ``(stash bytes saved, extra backward
    seconds)`` per microbatch, for the whole stage (not yet per replica): each layer keeps
    :class:`~pdjax.profile.PolicyCost`'s residuals instead of its own, and recomputes its
    share of the forward (``(0, 0)`` for ``"none"`` and ``"full"``, priced apart).

    Raises:
      PlanError: a named policy the profile does not price, or named policies with
        several simulated stages per plan stage (``chunks > 1``, ``zb-v``).
    """
    scale = plan.microbatch_size / profile.batch_size
    out = []
    for st, policy in zip(plan.stages, policies, strict=True):
        if policy in ("none", "full"):
            out.append((0.0, 0.0))
            continue
        if chunks != 1:
            raise PlanError(
                f"memory policy {policy!r} is priced per plan stage: a schedule of several "
                "simulated stages per plan stage (interleaved, zb-v) takes 'none' or 'full'"
            )
        saved = extra = 0.0
        for i in range(st.first_layer, st.last_layer + 1):
            layer = profile.layers[i]
            cost = _priced(layer, policy)
            saved += max(layer.residual_bytes - cost.residual_bytes, 0) * scale
            extra += cost.recompute * (layer.forward_seconds or 0.0) * scale
        out.append((saved, extra))
    return out


def costs_under(
    costs: Any, plan: Plan, profile: Profile, policies: Sequence[str], schedule: str
) -> Any:
    """The simulator's ``costs`` of ``plan`` (:func:`~pdjax.partition.costs_from_plan`, one
    virtual stage per plan stage unless every policy is ``"none"`` or ``"full"``) under
    each plan stage's memory policy, run with ``schedule`` (see the module doc)."""
    P = len(policies)
    deltas = policy_deltas(plan, profile, policies, len(costs.stages) // P)
    return _with_remat(costs, policies, schedule, plan.replicas, deltas)


def policy_arrays(arrays: Any, plan: Plan, profile: Profile, policies: Sequence[str]) -> Any:
    """The ``pdjax`` memory model's arrays for one microbatch
    (:func:`pdjax.partition.pricing.cost.model_arrays`) with each plan stage's stash under its
    memory policy: ``"full"`` keeps only the stage's input per microbatch in flight, a
    named policy each layer's input and the residuals it keeps."""
    if all(p == "none" for p in policies):
        return arrays
    stash = np.array(arrays.stash, dtype=np.float64)
    scale = plan.microbatch_size / profile.batch_size
    for st, policy in zip(plan.stages, policies, strict=True):
        if policy not in ("none", "full"):
            for i in range(st.first_layer, st.last_layer + 1):
                layer = profile.layers[i]
                cost_ = _priced(layer, policy)
                less = max(layer.residual_bytes - cost_.residual_bytes, 0) * scale
                stash[i] = max(stash[i] - less, 0.0)
        if policy == "full":
            sl = slice(st.first_layer, st.last_layer + 1)
            before = arrays.cut[st.first_layer - 1] if st.first_layer else arrays.inputs
            kept = min(float(before), float(stash[sl].sum()))
            stash[sl] = 0.0
            stash[st.first_layer] = kept
    return dataclasses.replace(arrays, stash=stash)


def _priced(layer: Any, policy: str) -> Any:
    """The layer's :class:`~pdjax.profile.PolicyCost` under ``policy``; PlanError where the
    profile does not price it."""
    cost = layer.policy(policy)
    if cost is None:
        raise PlanError(
            f"the profile does not price memory policy {policy!r} (layer {layer.name!r}): "
            "profile the model with memory_policies=True, or plan with 'none' and 'full' only"
        )
    return cost


def _with_remat(
    costs: Any,
    policies: Sequence[str],
    schedule: str,
    replicas: Sequence[int],
    deltas: Sequence[tuple[float, float]],
) -> Any:
    """``costs`` under each plan stage's memory policy, at its virtual stages. ``"full"``:
    the backward runs the forward again first, and a microbatch in flight keeps only the
    stage's input (its share on one device). A named policy (one virtual stage per plan
    stage): the stash less what the policy does not keep, the backward longer by what it
    recomputes (``deltas``, :func:`policy_deltas`)."""
    P = len(policies)
    stages = list(costs.stages)
    where = stage_groups(schedule, P, len(stages) // P)
    for k, st in enumerate(stages):
        group = where[k]
        policy, r = policies[group], replicas[group]
        if policy == "full":
            kept = stages[k - 1].activation_bytes if k > 0 else 0
            stages[k] = dataclasses.replace(
                st,
                input_grad=st.input_grad + st.forward,
                stash_bytes=min(st.stash_bytes, round(kept / r)),
            )
        elif policy != "none":
            saved, extra = deltas[group]
            stages[k] = dataclasses.replace(
                st,
                input_grad=st.input_grad + extra / r,
                stash_bytes=max(st.stash_bytes - round(saved / r), 0),
            )
    return dataclasses.replace(costs, stages=tuple(stages))
