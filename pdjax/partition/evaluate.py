"""A partition priced and made a :class:`~pdjax.partition.Plan`: the planner's options
checked (:func:`check_options`), the period of given stages (:func:`pipeline_time`), and
the plan with exact in-flight counts and memory (:func:`build_plan`). Shared by
:func:`~pdjax.partition.plan_pipedream` and :func:`~pdjax.partition.evaluate_partition`.
"""

from __future__ import annotations

import math
from typing import Any

from pdjax.errors import PlanError
from pdjax.partition import cost
from pdjax.partition.plan import Plan, StagePlan
from pdjax.partition.topology import Topology
from pdjax.profile import Profile
from pdjax.schedules import SCHEDULE_KINDS, SEMANTICS

__all__ = ["build_plan", "calibrated_options", "check_options", "pipeline_time"]

#: Pipeline stages ``(first, last, device positions)``.
Flat = list[tuple[int, int, list[int]]]


def check_options(
    topology: Topology,
    *,
    schedule: str,
    cost_model: str,
    num_microbatches: int | None,
    optimizer_state_factor: float,
    memory_limit: float | None,
) -> tuple[int, float | None]:
    """Validates the planner's options; returns ``M`` and the memory limit in force."""
    cost.check_cost_model(cost_model)
    cost.schedule_traits(schedule)
    if not isinstance(topology, Topology):
        raise PlanError(f"topology must be a pdjax Topology, got {type(topology).__name__}")
    if num_microbatches is None:
        num_microbatches = topology.num_devices
    if num_microbatches < 1:
        raise PlanError(f"num_microbatches must be at least 1, got {num_microbatches}")
    if not optimizer_state_factor >= 0 or not math.isfinite(optimizer_state_factor):
        raise PlanError(
            f"optimizer_state_factor must be >= 0 (Adam: 2, SGD: 0), got {optimizer_state_factor}"
        )
    limit = memory_limit if memory_limit is not None else topology.memory_per_device
    if limit is not None and (not limit > 0 or not math.isfinite(limit)):
        raise PlanError(f"memory_limit must be positive bytes, got {limit!r}")
    return int(num_microbatches), None if limit is None else float(limit)


def pipeline_time(
    arrays: cost.ModelArrays,
    topology: Topology,
    flat: Flat,
    modes: list[str] | tuple[str, ...],
    *,
    cost_model: str,
    schedule: str,
    num_microbatches: int,
    stage_seconds: cost.StageSeconds | None = None,
    allreduce_seconds: cost.AllreduceSeconds | None = None,
) -> tuple[float, float]:
    """``(slowest term, round-trip bound)`` of the stages ``(first, last, positions)``
    with their replication modes (:func:`pdjax.partition.cost.partition_terms`,
    :func:`~pdjax.partition.cost.round_trip_time`; the bound is 0 where the model and
    schedule have none)."""
    stage_terms, cut_terms = cost.partition_terms(
        arrays,
        topology,
        flat,
        modes,
        model=cost_model,
        schedule=schedule,
        num_microbatches=num_microbatches,
        stage_seconds=stage_seconds,
        allreduce_seconds=allreduce_seconds,
    )
    slowest = max(stage_terms + cut_terms)
    if not cost.has_round_trip(schedule, cost_model):
        return slowest, 0.0
    replicas = [len(pos) for _, _, pos in flat]
    counts = cost.exact_in_flight(schedule, replicas, modes, num_microbatches)
    units = cost.stage_units(replicas, modes)
    return slowest, cost.round_trip_time(stage_terms, cut_terms, [c for c, _ in counts], units)


def calibrated_options(stage_seconds: Any, allreduce_seconds: Any) -> dict[str, list[str]]:
    """``{"calibrated": [hooks given]}`` for a plan's options, or ``{}`` without hooks."""
    given = [
        name
        for name, fn in (("stage_seconds", stage_seconds), ("allreduce_seconds", allreduce_seconds))
        if fn is not None
    ]
    return {"calibrated": given} if given else {}


def build_plan(
    profile: Profile,
    topology: Topology,
    arrays: cost.ModelArrays,
    flat: Flat,
    *,
    cost_model: str,
    schedule: str,
    partitioner: str,
    num_microbatches: int,
    time_per_microbatch: float,
    data_parallel_time: float,
    memory_limit: float | None,
    optimizer_state_factor: float,
    options: dict[str, Any],
    microbatch_size: int | None,
    replication: list[str] | tuple[str, ...] | None = None,
) -> Plan:
    """Builds a :class:`Plan` from flattened stages, with exact in-flight and memory.

    ``replication``: per stage ``"split"`` or ``"round-robin"`` (None: all split); the
    in-flight counts and versions are those of the schedule with these modes
    (:func:`pdjax.partition.cost.exact_in_flight`)."""
    P = len(flat)
    kind = SCHEDULE_KINDS.get(schedule)
    if kind is not None and kind.needs_microbatches_per_stage and num_microbatches < P:
        raise PlanError(
            f"the {schedule} schedule needs at least as many microbatches per step as stages: the "
            f"plan has {P} stages but num_microbatches={num_microbatches}; raise it to {P} or more"
        )
    replicas = [len(positions) for _, _, positions in flat]
    modes = tuple(replication) if replication is not None else ("split",) * P
    modes = tuple("split" if r == 1 else m for m, r in zip(modes, replicas, strict=True))
    _check_groups_fill_steps(schedule, replicas, modes, num_microbatches)
    stages = _stage_plans(
        arrays,
        topology,
        flat,
        modes,
        cost_model=cost_model,
        schedule=schedule,
        num_microbatches=num_microbatches,
        optimizer_state_factor=optimizer_state_factor,
    )
    used = sum(len(p) for _, _, p in flat)
    source = profile.meta.get("source", "") if hasattr(profile, "meta") else ""
    return Plan(
        stages=stages,
        num_layers=arrays.num_layers,
        topology=topology,
        cost_model=cost_model,
        schedule=schedule,
        partitioner=partitioner,
        num_microbatches=num_microbatches,
        microbatch_size=int(microbatch_size or profile.batch_size),
        time_per_microbatch=float(time_per_microbatch),
        single_device_time=cost.single_device_time(arrays),
        data_parallel_time=float(data_parallel_time),
        noam=cost.ceil_div(used, len(flat[0][2])),
        memory_limit=memory_limit,
        options={**options, "optimizer_state_factor": optimizer_state_factor},
        profile_source=str(source),
        profile_hash=profile.content_hash() if hasattr(profile, "content_hash") else None,
    )


def _check_groups_fill_steps(
    schedule: str, replicas: list[int], modes: tuple[str, ...], num_microbatches: int
) -> None:
    """Raises PlanError where a round-robin stage's groups do not divide the step: under a
    schedule that takes round-robin and updates once per step of ``M`` (the table's)."""
    row = SEMANTICS[schedule]
    if not row.round_robin or row.updates_per_microbatch:
        return
    for r, n in zip(replicas, cost.stage_units(replicas, modes), strict=True):
        if num_microbatches % n:
            raise PlanError(
                f"a round-robin stage on {r} devices takes groups of {r} microbatches, "
                f"but the {schedule} step has num_microbatches={num_microbatches}; use a "
                f"multiple of {n} or replication='split'"
            )


def _stage_plans(
    arrays: cost.ModelArrays,
    topology: Topology,
    flat: Flat,
    modes: tuple[str, ...],
    *,
    cost_model: str,
    schedule: str,
    num_microbatches: int,
    optimizer_state_factor: float,
) -> tuple[StagePlan, ...]:
    """Each stage's :class:`StagePlan`: its devices, exact in-flight count and memory (the
    ``pdjax`` formula under ``pdjax``, the ``paper`` one under the other models)."""
    replicas = [len(positions) for _, _, positions in flat]
    counts = cost.exact_in_flight(schedule, replicas, modes, num_microbatches)
    memory_model = "pdjax" if cost_model == "pdjax" else "paper"
    copies = (
        cost.update_copies(schedule, optimizer_state_factor) if memory_model == "pdjax" else 0.0
    )
    stages = []
    for s, (first, last, positions) in enumerate(flat):
        r = len(positions)
        inflight, versions = counts[s]
        sl = slice(first, last + 1)
        memory = cost.stage_memory(
            memory_model,
            weights=math.fsum(arrays.params[sl]),
            stash=math.fsum(arrays.stash[sl]),
            act=math.fsum(arrays.act[sl]),
            replicas=r,
            in_flight_count=inflight,
            versions=versions,
            optimizer_state_factor=optimizer_state_factor,
            update_copies=copies,
        )
        stages.append(
            StagePlan(
                first_layer=first,
                last_layer=last,
                devices=tuple(topology.device_id(p) for p in positions),
                in_flight=inflight,
                compute_seconds=math.fsum(arrays.compute[sl]) / r,
                memory_bytes=float(memory),
                replication=modes[s],
            )
        )
    return tuple(stages)
