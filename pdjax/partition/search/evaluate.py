"""A partition priced and made a :class:`~pdjax.partition.Plan`: the planner's options
checked (:func:`check_options`), the period of given stages (:func:`pipeline_time`), and
the plan with exact in-flight counts and memory (:func:`build_plan`). Shared by
:func:`~pdjax.partition.plan_pipedream` and :func:`~pdjax.partition.evaluate_partition`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pdjax.errors import PlanError
from pdjax.mesh import MeshAxes, is_sharded, mesh_axes, stage_mesh
from pdjax.partition.pricing import cost
from pdjax.plan.plan import Plan, StagePlan
from pdjax.plan.topology import Topology
from pdjax.profile import Profile
from pdjax.schedules import SCHEDULE_KINDS, SEMANTICS, ScheduleSpec

__all__ = [
    "Meshes",
    "build_plan",
    "calibrated_options",
    "check_meshes",
    "check_options",
    "pipeline_time",
    "sharded_stages",
    "stage_memory_bytes",
]

#: Pipeline stages ``(first, last, device positions)``.
Flat = list[tuple[int, int, list[int]]]

#: Per stage its mesh (``((axis, size), ...)`` or ``{axis: size}``; None: replicated), or
#: None for every stage replicated (:attr:`pdjax.plan.StagePlan.mesh`).
Meshes = Sequence[MeshAxes | Mapping[str, int] | None] | None


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
    in_flight: str = "full-rate",
) -> tuple[float, float]:
    """``(slowest term, round-trip bound)`` of the stages ``(first, last, positions)``
    with their replication modes (:func:`pdjax.partition.pricing.cost.partition_terms`,
    :func:`~pdjax.partition.pricing.cost.round_trip_time`; the bound is 0 where the model and
    schedule have none), with the in-flight counts of ``pipedream``'s ``in_flight``.

    Under ``in_flight="paper"`` with round-robin stages the bound is Little's law over
    paper's counts, a lower bound only: a group moves all at once, and where a stage holds
    few groups each group's round trip serialises (1-3-1 with unit costs: 4 here, 7
    simulated). Only the simulator prices that schedule exactly
    (:func:`~pdjax.partition.choosing.candidates.evaluate_candidate`)."""
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
    counts = cost.exact_in_flight(schedule, replicas, modes, num_microbatches, in_flight)
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
    microbatches_per_call: int | None = None,
    in_flight: str = "full-rate",
    meshes: Meshes = None,
) -> Plan:
    """Builds a :class:`Plan` from flattened stages, with exact in-flight and memory.

    ``replication``: per stage ``"split"`` or ``"round-robin"`` (None: all split); the
    in-flight counts and versions are those of the schedule with these modes and
    ``pipedream``'s ``in_flight`` (:func:`pdjax.partition.pricing.cost.exact_in_flight`; recorded
    in the plan's :class:`~pdjax.schedules.ScheduleSpec`).
    ``microbatches_per_call``: ``N``, the microbatches of one runtime call the ``pdjax``
    memory charges (None: a steady call;
    :func:`pdjax.partition.pricing.cost.microbatches_per_call`),
    recorded in the plan's options.
    ``meshes``: per stage its mesh (:data:`Meshes`), recorded in its
    :class:`~pdjax.plan.StagePlan` and priced per device by :func:`stage_memory_bytes`; a
    sharded stage's ``compute_seconds`` stays the replicated stage's (compute over its
    devices: the collectives its sharding adds are not priced)."""
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
    stage_meshes = check_meshes(meshes, flat, modes)
    calls = cost.microbatches_per_call(schedule, num_microbatches, microbatches_per_call)
    memory = stage_memory_bytes(
        arrays,
        flat,
        modes,
        topology=topology,
        cost_model=cost_model,
        schedule=schedule,
        num_microbatches=num_microbatches,
        optimizer_state_factor=optimizer_state_factor,
        microbatches_per_call=calls,
        in_flight=in_flight,
        meshes=stage_meshes,
    )
    counts = cost.exact_in_flight(schedule, replicas, modes, num_microbatches, in_flight)
    stages = tuple(
        StagePlan(
            first_layer=first,
            last_layer=last,
            devices=tuple(topology.device_id(p) for p in positions),
            in_flight=counts[s][0],
            compute_seconds=math.fsum(arrays.compute[first : last + 1]) / len(positions),
            memory_bytes=memory[s],
            replication=modes[s],
            mesh=stage_meshes[s],
        )
        for s, (first, last, positions) in enumerate(flat)
    )
    if cost_model == "pdjax":
        options = {**options, "microbatches_per_call": calls}
    options = {k: v for k, v in options.items() if k != "in_flight"}  # the spec's
    used = sum(len(p) for _, _, p in flat)
    source = profile.meta.get("source", "") if hasattr(profile, "meta") else ""
    return Plan(
        stages=stages,
        num_layers=arrays.num_layers,
        topology=topology,
        cost_model=cost_model,
        schedule=ScheduleSpec(schedule, microbatches=num_microbatches, in_flight=in_flight),
        partitioner=partitioner,
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


def _check_count(meshes: Sequence[Any] | Mapping[str, int], count: int) -> None:
    if isinstance(meshes, Mapping) or len(meshes) != count:
        given = "a mapping" if isinstance(meshes, Mapping) else f"{len(meshes)} meshes"
        raise PlanError(
            f"meshes has {given} for {count} stages; give one per stage (None: replicated)"
        )


def sharded_stages(meshes: Meshes, count: int) -> list[bool]:
    """Per stage of ``count`` whether ``meshes`` shards it (an axis besides ``data``):
    ``replication="auto"`` keeps such a stage split.

    Raises:
      PlanError: a count of meshes other than ``count``, or a mesh pdjax cannot read.
    """
    if meshes is None:
        return [False] * count
    _check_count(meshes, count)
    return [mesh is not None and is_sharded(mesh_axes(mesh)) for mesh in meshes]


def check_meshes(meshes: Meshes, flat: Flat, modes: Sequence[str]) -> list[MeshAxes | None]:
    """Per stage ``(first, last, positions)`` its mesh in pdjax's order
    (:func:`pdjax.mesh.mesh_axes`), or None where it is replicated (no axis but
    ``data``), from ``meshes`` (None: all replicated).

    Raises:
      PlanError: a count of meshes other than the stages', a mesh pdjax cannot read
        (:class:`~pdjax.mesh.MeshError`), one whose sizes do not multiply to its
        stage's devices, or a sharded round-robin stage.
    """
    if meshes is None:
        return [None] * len(flat)
    _check_count(meshes, len(flat))
    return [
        stage_mesh(mesh, len(positions), mode == "round-robin", f"stage {first}-{last}")
        for (first, last, positions), mode, mesh in zip(flat, modes, meshes, strict=True)
    ]


def stage_memory_bytes(
    arrays: cost.ModelArrays,
    flat: Flat,
    modes: list[str] | tuple[str, ...],
    *,
    topology: Topology,
    cost_model: str,
    schedule: str,
    num_microbatches: int,
    optimizer_state_factor: float,
    microbatches_per_call: int | None = None,
    in_flight: str = "full-rate",
    meshes: Meshes = None,
) -> list[float]:
    """Bytes per device of each stage ``(first, last, device positions)`` with its
    replication mode: the ``pdjax`` memory model under ``pdjax`` (weights x versions,
    optimizer state, the gradient sum and the call's starting weights, stash and zero
    bubble's cotangents x the semantics table's in-flight count, the call's inputs placed
    up front and the values in transit, more of them behind a link slower than the stage
    that feeds it, at the bandwidth and latency of the innermost level holding both
    stages of ``topology``: :mod:`pdjax.partition.pricing.cost`), the ``paper`` one under the
    other models. ``microbatches_per_call``: ``N`` (None: a steady call,
    :func:`pdjax.partition.pricing.cost.microbatches_per_call`). ``in_flight``: ``pipedream``'s
    option, the groups in flight of round-robin stages
    (:func:`pdjax.partition.pricing.cost.exact_in_flight`). ``meshes``: per stage its mesh
    (:data:`Meshes`): a sharded stage holds its parameter-sized terms divided by its
    weight ways and its per-microbatch terms (stash, cotangents, placed inputs, values in
    transit) divided by its batch ways instead of its devices
    (:func:`pdjax.partition.pricing.cost.mesh_ways`)."""
    P = len(flat)
    replicas = [len(positions) for _, _, positions in flat]
    ways = [
        cost.mesh_ways(mesh, r)
        for mesh, r in zip(check_meshes(meshes, flat, modes), replicas, strict=True)
    ]
    counts = cost.exact_in_flight(schedule, replicas, modes, num_microbatches, in_flight)
    calls = cost.microbatches_per_call(schedule, num_microbatches, microbatches_per_call)
    inputs, targets = getattr(arrays, "inputs", 0.0), getattr(arrays, "targets", 0.0)
    # a round-robin group sends (and takes) a whole group of microbatches at once
    units = [1, *cost.stage_units(replicas, modes), 1]
    seconds = _cut_seconds(arrays, topology, flat)
    forward, gradient = _intervals(arrays, schedule, flat, seconds)
    out = []
    for s, (first, last, _) in enumerate(flat):
        inflight, versions = counts[s]
        sl = slice(first, last + 1)
        weights, stash = math.fsum(arrays.params[sl]), math.fsum(arrays.stash[sl])
        act = math.fsum(arrays.act[sl])
        weight_ways, batch_ways = ways[s]
        if cost_model != "pdjax":
            memory = cost.stage_memory(
                "paper",
                weights=weights,
                stash=stash,
                act=act,
                replicas=batch_ways,
                in_flight_count=inflight,
                versions=versions,
                optimizer_state_factor=optimizer_state_factor,
                weight_ways=weight_ways,
            )
            out.append(float(memory))
            continue
        if "round-robin" not in modes:  # (with round-robin the counts are the table's)
            inflight = cost.memory_in_flight(schedule, P, s, num_microbatches)
            versions = cost.versions_kept(schedule, inflight)
        call = cost.RuntimeCall(
            calls=calls,
            placed=(inputs if s == 0 else 0.0) + (targets if s == P - 1 else 0.0),
            cut_before=float(arrays.cut[first - 1]) * max(units[s : s + 2]) if s > 0 else 0.0,
            cut_after=float(arrays.cut[last]) * max(units[s + 1 : s + 3]) if s < P - 1 else 0.0,
            slow_before=s > 0 and seconds[s - 1] > gradient[s],
            slow_after=s < P - 1 and seconds[s] > forward[s],
            update_microbatches=cost.update_microbatches(schedule, num_microbatches),
        )
        memory = cost.stage_memory(
            "pdjax",
            weights=weights,
            stash=cost.waiting_bytes(schedule, stash, act),
            act=act,
            replicas=batch_ways,
            in_flight_count=inflight,
            versions=versions,
            optimizer_state_factor=optimizer_state_factor,
            weight_copies=cost.weight_copies(schedule, num_microbatches, calls),
            call=call,
            weight_ways=weight_ways,
        )
        out.append(float(memory))
    return out


def _cut_seconds(arrays: cost.ModelArrays, topology: Topology, flat: Flat) -> list[float]:
    """Seconds of each cut's transfer, at the bandwidth and latency of the innermost level
    holding both stages (as the planner's cut term)."""
    out = []
    for (_, last, here), (_, _, there) in itertools.pairwise(flat):
        both = [*here, *there]
        level = topology.levels[topology.link_level(min(both), max(both))]
        seconds = cost.cut_time(
            "pdjax", float(arrays.cut[last]), 0.0, 1, level.bandwidth, level.latency
        )
        out.append(float(seconds))
    return out


def _intervals(
    arrays: cost.ModelArrays, schedule: str, flat: Flat, seconds: list[float]
) -> tuple[list[float], list[float]]:
    """Per stage, the least seconds between two activations it sends on and between two
    gradients it sends back: no less than its own forward (backward; zero bubble's ``I``,
    taken as no longer than the forward or the backward) on its devices, nor than any
    stage or cut before it (after it, for gradients) takes per microbatch."""
    own_forward, own_gradient = [], []
    for first, last, positions in flat:
        sl = slice(first, last + 1)
        f = getattr(arrays, "forward", None)
        b = getattr(arrays, "backward", None)
        if f is None or b is None:  # a plain ModelArrays: the whole compute
            f = b = arrays.compute
        fwd, bwd = math.fsum(f[sl]), math.fsum(b[sl])
        if cost.schedule_traits(schedule).semantics.split_backward:
            bwd = min(fwd, bwd)
        own_forward.append(fwd / len(positions))
        own_gradient.append(bwd / len(positions))
    P = len(flat)
    forward = [max(own_forward[: s + 1] + seconds[:s]) for s in range(P)]
    gradient = [max(own_gradient[s:] + seconds[s:]) for s in range(P)]
    return forward, gradient
