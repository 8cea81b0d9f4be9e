"""Simpler partitioners, and the evaluation of any partition under a cost model.

* :func:`plan_uniform`: equal layer counts per stage;
* :func:`plan_balanced_time`: the contiguous split that minimises the slowest stage's
  compute (exact, a min-max dynamic program);
* :func:`plan_balanced_params`: the same over parameter bytes (balances weight memory);
* :func:`evaluate_partition`: a hand-made partition, as a :class:`~pdjax.partition.Plan`.

All make pipelines with the same number of replicas per stage (1 by default), placed on
the devices in order. They are for comparison with :func:`~pdjax.partition.plan_pipedream`
and for users who know what they want.

Evaluation places stage ``t`` on the next ``r_t`` devices of the topology. A replicated
stage all-reduces at the bandwidth of the innermost level whose group holds all its
devices; a cut transfers at the bandwidth of the innermost level holding both stages. On a
one-level topology this is exactly the cost model of the dynamic program (round-trip bound
included), so ``evaluate_partition`` of a plan's stages gives back its
``time_per_microbatch``. A
round-robin stage on ``r`` devices all-reduces once per group of ``r`` microbatches under
``pipedream`` (see :mod:`pdjax.partition.pricing.cost`), a flat ring at that level's bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pdjax.errors import PlanError
from pdjax.partition.pricing import cost
from pdjax.partition.search.evaluate import (
    Flat,
    Meshes,
    build_plan,
    calibrated_options,
    check_options,
    pipeline_time,
    sharded_stages,
)
from pdjax.plan.plan import Plan
from pdjax.plan.topology import Topology
from pdjax.profile import Profile

__all__ = [
    "balanced_split",
    "evaluate_partition",
    "plan_balanced_params",
    "plan_balanced_time",
    "plan_uniform",
    "uniform_split",
]


def uniform_split(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Layer ranges ``(first, last)`` with equal counts; the first stages take the remainder.

    >>> uniform_split(10, 3)
    ((0, 3), (4, 6), (7, 9))
    """
    _check_stage_count(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    out, first = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append((first, first + size - 1))
        first += size
    return tuple(out)


def balanced_split(
    weights: Sequence[float] | np.ndarray, num_stages: int
) -> tuple[tuple[int, int], ...]:
    """The contiguous split of ``weights`` into ``num_stages`` nonempty ranges that
    minimises the largest range sum (exact; ties go to the earliest cuts).

    >>> balanced_split([1, 1, 1, 3, 1, 1], 2)
    ((0, 2), (3, 5))
    """
    w = np.asarray(weights, dtype=np.float64)
    L = len(w)
    _check_stage_count(L, num_stages)
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    sums = prefix[None, 1:] - prefix[:-1, None]  # [i, j] = sum w[i..j]
    sums = np.where(np.triu(np.ones((L, L), dtype=bool)), sums, np.inf)
    # after[k, j]: the last range is k+1..j.
    after = np.full((L, L), np.inf)
    after[:-1] = sums[1:]
    best = [sums[0]]  # best[p][j]: layers 0..j in p+1 ranges
    choice = []
    for _ in range(1, num_stages):
        cand = np.maximum(best[-1][:, None], after)
        k = cand.argmin(axis=0)
        choice.append(k)
        best.append(cand[k, np.arange(L)])
    out, j = [], L - 1
    for p in range(num_stages - 1, 0, -1):
        k = int(choice[p - 1][j])
        out.append((k + 1, j))
        j = k
    out.append((0, j))
    return tuple(out[::-1])


def _check_stage_count(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise PlanError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise PlanError(
            f"{num_stages} stages requested but the profile has only {num_layers} layers"
        )


def evaluate_partition(
    profile: Profile,
    topology: Topology,
    stages: Sequence[tuple[int, int, int]],
    *,
    cost_model: str = "pdjax",
    schedule: str = "pipedream",
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    optimizer_state_factor: float = 2.0,
    memory_limit: float | None = None,
    partitioner: str = "manual",
    replication: str | Sequence[str] = "auto",
    stage_seconds: cost.StageSeconds | None = None,
    allreduce_seconds: cost.AllreduceSeconds | None = None,
    microbatches_per_call: int | None = None,
    in_flight: str = "full-rate",
    meshes: Meshes = None,
) -> Plan:
    """A plan for the given stages, with the cost model's predictions.

    Args:
      profile: per-layer costs.
      topology: workers and bandwidths.
      stages: ``(first_layer, last_layer, replicas)`` per stage, contiguous from layer 0 to
        the last; stage ``t`` gets the next ``replicas`` devices in the topology's order.
      cost_model, schedule, num_microbatches, microbatch_size, optimizer_state_factor:
        as for :func:`~pdjax.partition.plan_pipedream`.
      memory_limit: recorded in the plan (``plan.fits_memory`` says whether it fits); the
        partition is not changed. None: ``topology.memory_per_device``.
      partitioner: the name recorded in the plan.
      replication: per stage (or one word for all) ``"split"``, ``"round-robin"`` or
        ``"auto"`` (round-robin where it is cheaper: replicated stages under ``pipedream``
        with the ``pdjax`` cost model; see :func:`~pdjax.partition.plan_pipedream`). A
        one-device stage is always recorded ``"split"``.
      stage_seconds, allreduce_seconds: calibration (``pdjax`` only), as for
        :func:`~pdjax.partition.plan_pipedream`; ``allreduce_seconds`` gets the tuple of
        the stage's device positions.
      microbatches_per_call: ``pdjax``'s memory terms: the microbatches of one
        ``Pipeline.run`` call, as for :func:`~pdjax.partition.plan_pipedream`.
      in_flight: ``pipedream``'s option (``"full-rate"`` or ``"paper"``): the groups in
        flight of round-robin stages, which set the plan's in-flight counts, versions and
        memory exactly; under ``"paper"`` the round-trip bound is a lower bound only
        (:func:`~pdjax.partition.search.evaluate.pipeline_time`; the plan records
        ``options["round_trip"] = "lower bound"`` where paper's counts differ from full
        rate's).
      meshes: per stage its mesh (``{"fsdp": 2, "tensor": 2}``, ``((axis, size), ...)``
        or None: replicated), recorded in the plan's stages; a sharded stage's memory is
        priced per device of its mesh (:func:`~pdjax.partition.pricing.cost.mesh_ways`),
        its time as the replicated stage's.

    Returns:
      The plan; its ``time_per_microbatch`` is the slowest stage or cut term, and at least
      the round-trip bound where the model has one (:mod:`pdjax.partition.pricing.cost`).

    Raises:
      PlanError: stages that do not cover the layers contiguously, fewer than one replica,
        more replicas in total than the topology's devices, or a replication mode the
        schedule has no form for.
    """
    M, limit = check_options(
        topology,
        schedule=schedule,
        cost_model=cost_model,
        num_microbatches=num_microbatches,
        optimizer_state_factor=optimizer_state_factor,
        memory_limit=memory_limit,
    )
    cost.check_calibration(stage_seconds, allreduce_seconds, cost_model)
    cost.check_in_flight(schedule, in_flight)
    modes = _replication_modes(replication, stages, schedule, cost_model, meshes)
    arrays = cost.model_arrays(profile, microbatch_size)
    stages = [(int(a), int(b), int(r)) for a, b, r in stages]
    _check_stages(stages, arrays.num_layers, topology.num_devices)
    flat = _placed(stages)
    plan = _priced_plan(
        profile,
        topology,
        arrays,
        flat,
        modes,
        cost_model=cost_model,
        schedule=schedule,
        partitioner=partitioner,
        num_microbatches=M,
        memory_limit=limit,
        optimizer_state_factor=optimizer_state_factor,
        microbatch_size=microbatch_size,
        stage_seconds=stage_seconds,
        allreduce_seconds=allreduce_seconds,
        microbatches_per_call=microbatches_per_call,
        in_flight=in_flight,
        meshes=meshes,
    )
    # Record which profile priced the plan, so a later use with another model's profile of
    # the same layer count is refused (Plan.check_profile).
    return plan.with_profile_hash(profile)


def _priced_plan(
    profile: Profile,
    topology: Topology,
    arrays: cost.ModelArrays,
    flat: Flat,
    modes: list[str] | tuple[str, ...],
    *,
    cost_model: str,
    schedule: str,
    partitioner: str,
    num_microbatches: int,
    memory_limit: float | None,
    optimizer_state_factor: float,
    microbatch_size: int | None,
    stage_seconds: cost.StageSeconds | None,
    allreduce_seconds: cost.AllreduceSeconds | None,
    microbatches_per_call: int | None = None,
    in_flight: str = "full-rate",
    meshes: Meshes = None,
) -> Plan:
    """The plan of the placed stages ``flat`` with the cost model's predictions: the
    slowest stage or cut term (at least the round-trip bound) per microbatch, and the
    data-parallel time to compare it with."""
    calibration: dict[str, Any] = dict(
        stage_seconds=stage_seconds, allreduce_seconds=allreduce_seconds
    )
    slowest, trip = pipeline_time(
        arrays,
        topology,
        flat,
        modes,
        cost_model=cost_model,
        schedule=schedule,
        num_microbatches=num_microbatches,
        in_flight=in_flight,
        **calibration,
    )
    options: dict[str, Any] = dict(calibrated_options(stage_seconds, allreduce_seconds))
    if in_flight == "paper" and "round-robin" in modes:
        replicas = [len(pos) for _, _, pos in flat]
        units = cost.stage_units(replicas, modes)
        if cost.groups_in_flight(units, "paper") != cost.groups_in_flight(units):
            # Little's law over paper's counts: its groups serialise beyond it
            options["round_trip"] = "lower bound"
    return build_plan(
        profile,
        topology,
        arrays,
        flat,
        cost_model=cost_model,
        schedule=schedule,
        partitioner=partitioner,
        num_microbatches=num_microbatches,
        time_per_microbatch=max(slowest, trip),
        data_parallel_time=cost.data_parallel_time(
            arrays,
            topology,
            cost_model,
            cost.updates_per_microbatch(schedule, num_microbatches),
            per_round=cost.schedule_traits(schedule).update_per_microbatch,
            **calibration,
        ),
        memory_limit=memory_limit,
        optimizer_state_factor=float(optimizer_state_factor),
        options=options,
        microbatch_size=microbatch_size,
        replication=modes,
        microbatches_per_call=microbatches_per_call,
        in_flight=in_flight,
        meshes=meshes,
    )


def _placed(stages: list[tuple[int, int, int]]) -> list[tuple[int, int, list[int]]]:
    """Stage ``t`` on the next ``r_t`` device positions."""
    offsets = np.concatenate([[0], np.cumsum([r for _, _, r in stages])]).astype(int)
    return [
        (a, b, list(range(int(offsets[t]), int(offsets[t + 1]))))
        for t, (a, b, _) in enumerate(stages)
    ]


def _replication_modes(
    replication: str | Sequence[str],
    stages: Sequence[tuple[int, int, int]],
    schedule: str,
    cost_model: str,
    meshes: Meshes = None,
) -> list[str]:
    """Each stage's mode: ``replication`` per stage (or one word for all), ``"auto"``
    resolved (``"split"`` for a stage ``meshes`` shards), a one-device stage ``"split"``."""
    if isinstance(replication, str):
        replication = [replication] * len(stages)
    replication = list(replication)
    if len(replication) != len(stages):
        raise PlanError(
            f"replication has {len(replication)} entries for {len(stages)} stages; give one "
            "per stage, or one word for all"
        )
    cost.check_replication(replication, schedule, cost_model)
    sharded = sharded_stages(meshes, len(stages))
    return [
        "split"
        if int(r) == 1 or (mode == "auto" and shards)
        else cost.resolve_replication(mode, schedule, cost_model)
        for mode, (_, _, r), shards in zip(replication, stages, sharded, strict=True)
    ]


def _check_stages(stages: list[tuple[int, int, int]], num_layers: int, devices: int) -> None:
    """Raises PlanError for stages that do not cover the layers contiguously, with fewer
    than one replica, or more stages or replicas than ``devices``."""
    if not stages:
        raise PlanError("no stages given")
    if len(stages) > devices:
        raise PlanError(
            f"{len(stages)} stages requested but the topology has only {devices} "
            "devices; use fewer stages or a bigger topology"
        )
    expected = 0
    for a, b, r in stages:
        if a != expected or b < a:
            raise PlanError(
                f"stage {a}-{b} does not continue the partition at layer {expected}: stages "
                "must cover layers 0..L-1 contiguously, in order"
            )
        if r < 1:
            raise PlanError(f"stage {a}-{b} has {r} replicas; each stage needs at least one")
        expected = b + 1
    if expected != num_layers:
        raise PlanError(
            f"the stages end at layer {expected - 1}; the profile has {num_layers} layers"
        )
    total = sum(r for _, _, r in stages)
    if total > devices:
        raise PlanError(
            f"the stages need {total} devices but the topology has {devices}; "
            "use fewer replicas or stages"
        )


def _straight(
    profile: Profile,
    topology: Topology,
    *,
    num_stages: int | None,
    replicas: int,
    split: Callable[[cost.ModelArrays, int], tuple[tuple[int, int], ...]],
    name: str,
    kwargs: dict[str, Any],
) -> Plan:
    if replicas < 1:
        raise PlanError(f"replicas must be at least 1, got {replicas}")
    if num_stages is None:
        num_stages = topology.num_devices // replicas
        if num_stages < 1:
            raise PlanError(
                f"{replicas} replicas per stage but the topology has {topology.num_devices} devices"
            )
    if num_stages * replicas > topology.num_devices:
        raise PlanError(
            f"{num_stages} stages x {replicas} replicas need {num_stages * replicas} devices but "
            f"the topology has {topology.num_devices}; use fewer stages or replicas"
        )
    arrays = cost.model_arrays(profile, kwargs.get("microbatch_size"))
    ranges = split(arrays, num_stages)
    return evaluate_partition(
        profile,
        topology,
        [(a, b, replicas) for a, b in ranges],
        partitioner=name,
        **kwargs,
    )


def plan_uniform(
    profile: Profile,
    topology: Topology,
    num_stages: int | None = None,
    *,
    replicas: int = 1,
    **kwargs: Any,
) -> Plan:
    """Equal layer counts per stage.

    Args:
      profile: per-layer costs.
      topology: workers and bandwidths.
      num_stages: stages; None: as many as the devices allow (``devices // replicas``).
      replicas: devices per stage.
      **kwargs: ``cost_model``, ``schedule``, ... as for :func:`evaluate_partition`.

    Raises:
      PlanError: more stages than layers, or more stages x replicas than devices.
    """
    return _straight(
        profile,
        topology,
        num_stages=num_stages,
        replicas=replicas,
        split=lambda arrays, p: uniform_split(arrays.num_layers, p),
        name="uniform",
        kwargs=kwargs,
    )


def plan_balanced_time(
    profile: Profile,
    topology: Topology,
    num_stages: int | None = None,
    *,
    replicas: int = 1,
    **kwargs: Any,
) -> Plan:
    """The contiguous split minimising the slowest stage's compute (exact). Arguments as
    for :func:`plan_uniform`."""
    return _straight(
        profile,
        topology,
        num_stages=num_stages,
        replicas=replicas,
        split=lambda arrays, p: balanced_split(arrays.compute, p),
        name="balanced-time",
        kwargs=kwargs,
    )


def plan_balanced_params(
    profile: Profile,
    topology: Topology,
    num_stages: int | None = None,
    *,
    replicas: int = 1,
    **kwargs: Any,
) -> Plan:
    """The contiguous split minimising the largest stage's parameter bytes (exact).
    Arguments as for :func:`plan_uniform`."""
    return _straight(
        profile,
        topology,
        num_stages=num_stages,
        replicas=replicas,
        split=lambda arrays, p: balanced_split(arrays.params, p),
        name="balanced-params",
        kwargs=kwargs,
    )
