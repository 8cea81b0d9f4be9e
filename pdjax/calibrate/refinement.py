"""The refinement loop (:func:`refine`): plan from the per-layer profile, calibrate the
best few plans and their neighbours (:func:`candidate_plans`), and re-rank them by the
simulator on calibrated costs (:func:`rank_plans`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pdjax.calibrate.calibration import AllReduceMeasure, Calibration, LinkMeasure, StageMeasure
from pdjax.calibrate.links import measure_allreduce, measure_link
from pdjax.calibrate.measure import calibrate
from pdjax.errors import CalibrationError, PlanError
from pdjax.partition import costs_from_plan, evaluate_partition, plan_pipedream
from pdjax.schedules import generate, semantics
from pdjax.simulator import simulate, stream_length

__all__ = ["Ranked", "candidate_plans", "neighbours", "plan_stages", "rank_plans", "refine"]


def plan_stages(plans: Iterable[Any]) -> list[tuple[int, int, int, str]]:
    """The distinct stages ``(first, last, replicas, replication)`` of ``plans``."""
    out = []
    for plan in plans:
        for st in plan.stages:
            mode = "split" if st.replicas == 1 else st.replication
            out.append((st.first_layer, st.last_layer, st.replicas, mode))
    return list(dict.fromkeys(out))


def neighbours(plan: Any) -> list[list[tuple[int, int, int]]]:
    """Layouts ``[(first, last, replicas), ...]`` next to ``plan``'s: each cut moved by one
    layer either way (replicas kept)."""
    stages = [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages]
    out = []
    for k in range(len(stages) - 1):
        for step in (-1, 1):
            a, b = list(stages[k]), list(stages[k + 1])
            a[1] += step
            b[0] += step
            if a[0] <= a[1] and b[0] <= b[1]:
                new = list(stages)
                new[k], new[k + 1] = tuple(a), tuple(b)
                out.append(new)
    return out


def candidate_plans(
    profile: Any,
    topology: Any,
    *,
    schedule: str = "pipedream",
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    neighbour_steps: bool = True,
) -> list[Any]:
    """The planner's best few plans from the profile alone, and their neighbours.

    The dynamic program's choice, its straight (unreplicated) choice, the choice when
    devices may stay idle, and, for each, every plan with one cut moved by one layer
    (:func:`neighbours`); distinct layouts only.
    """
    common: dict[str, Any] = {"schedule": schedule, "num_microbatches": num_microbatches,
                              "microbatch_size": microbatch_size}  # fmt: skip
    seeds = []
    for straight, fewer in ((False, False), (True, False), (False, True)):
        try:
            seeds.append(
                plan_pipedream(profile, topology, straight=straight, fewer_machines=fewer, **common)
            )
        except PlanError:  # a variant may have no plan (memory): skip it
            continue
    if not seeds:
        raise CalibrationError("the planner found no plan to refine")
    out: dict[tuple[Any, ...], Any] = {}
    for plan in seeds:
        out.setdefault(_layout_key(plan), plan)
    if neighbour_steps:
        for plan in list(out.values()):
            modes = [st.replication for st in plan.stages]
            for layout in neighbours(plan):
                try:
                    q = evaluate_partition(profile, topology, layout, replication=modes,
                                           partitioner="neighbour", **common)  # fmt: skip
                except PlanError:  # a neighbour may be invalid (a forbidden cut)
                    continue
                out.setdefault(_layout_key(q), q)
    return list(out.values())


def _layout_key(plan: Any) -> tuple[Any, ...]:
    return tuple((s.first_layer, s.last_layer, s.devices, s.replication) for s in plan.stages)


@dataclasses.dataclass(frozen=True)
class Ranked:
    """One candidate plan after calibration.

    Attributes:
      plan: the plan re-evaluated with calibrated stage costs (its ``time_per_microbatch``
        is the planner's calibrated prediction).
      simulated: the simulator's seconds per microbatch for a stream of the schedule, from
        calibrated costs.
      uncalibrated: the plan's prediction from the profile alone.
    """

    plan: Any
    simulated: float
    uncalibrated: float


def rank_plans(
    plans: Sequence[Any],
    profile: Any,
    calibration: Calibration,
    *,
    microbatches: int | None = None,
) -> list[Ranked]:
    """Re-ranks ``plans`` by the simulator on calibrated costs (fastest first).

    Each plan is re-evaluated with the calibration's stage seconds and all-reduces and
    simulated for its own schedule over a stream long enough for its steady state.
    """
    out = []
    for plan in plans:
        layout = [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages]
        M = plan.num_microbatches
        again = evaluate_partition(
            profile, plan.topology, layout, schedule=plan.schedule.kind, num_microbatches=M,
            microbatch_size=plan.microbatch_size, partitioner=plan.partitioner,
            replication=[s.replication for s in plan.stages],
            stage_seconds=calibration.stage_seconds(plan.schedule.kind, M),
            allreduce_seconds=calibration.allreduce_function(),
        )  # fmt: skip
        costs = costs_from_plan(again, profile, calibration=calibration, partial=True)
        replicas, modes = plan.replicas, plan.replication
        if semantics(plan.schedule.kind).updates_per_microbatch:  # a step is one microbatch
            n = microbatches or stream_length(
                plan.schedule.kind, len(layout), replicas=replicas, replication=modes
            )
            sched = generate(
                plan.schedule.kind, len(layout), n, replicas=replicas, replication=modes
            )
        else:
            steps = max(1, (microbatches or 4 * M) // M)
            n = steps * M
            sched = generate(plan.schedule.kind, len(layout), M, steps=steps, replicas=replicas,
                             replication=modes)  # fmt: skip
        sim = simulate(sched, costs).makespan / n
        out.append(Ranked(again, sim, plan.time_per_microbatch))
    return sorted(out, key=lambda r: r.simulated)


def refine(
    profile: Any,
    topology: Any,
    layers: Any,
    sample: Any,
    loss: Callable[[Any, Any], Any],
    optimizer: Any,
    *,
    schedule: str = "pipedream",
    num_microbatches: int | None = None,
    devices: Sequence[Any] | None = None,
    calibration: Calibration | None = None,
    repeats: int = 5,
    log: Callable[[str], None] = lambda s: None,
) -> tuple[list[Ranked], Calibration]:
    """The refinement loop: plan from the per-layer profile, calibrate the best few plans
    and their neighbours on ``devices``, re-rank them by the simulator on calibrated costs.

    ``topology`` must describe ``devices`` (``Topology.from_devices(devices)``: its device
    ids are theirs); ``sample`` is one microbatch. Measurements already in ``calibration``
    are kept, the missing ones added. Returns the ranked plans (fastest first) and the
    calibration.
    """
    import jax

    devices = list(devices or jax.devices())
    by_id = {int(d.id): d for d in devices}
    b = int(jax.tree.leaves(sample[0])[0].shape[0])
    plans = candidate_plans(profile, topology, schedule=schedule,
                            num_microbatches=num_microbatches, microbatch_size=b)  # fmt: skip
    log(f"{len(plans)} candidate plans: " + ", ".join(p.config for p in plans))
    stages = plan_stages(plans)
    if calibration is not None:
        calibration.check(layers=list(layers.names), microbatch_size=b)
        stages = [st for st in stages if calibration.stage(*st) is None]
    ids = sorted({d for p in plans for s in p.stages for d in s.devices})
    missing = [d for d in ids if d not in by_id]
    if missing:
        raise CalibrationError(
            f"the plans use device ids {missing} that are not among the devices given "
            f"({sorted(by_id)}); build the topology with Topology.from_devices(devices)"
        )
    new = calibrate(layers, sample, loss, optimizer, stages, devices=[by_id[d] for d in ids],
                    links=False, allreduces=False, repeats=repeats, profile=profile,
                    log=log)  # fmt: skip
    link_list = _plan_links(plans, by_id, calibration, repeats)
    ar_list, measured = _plan_allreduces(plans, layers, sample[0], by_id, new, repeats=repeats)
    new = dataclasses.replace(new, stages=measured, links=tuple(link_list),
                              allreduces=tuple(ar_list))  # fmt: skip
    cal = new if calibration is None else calibration.merge(new)
    return rank_plans(plans, profile, cal, microbatches=None), cal


def _plan_links(
    plans: Sequence[Any], by_id: dict[int, Any], calibration: Calibration | None, repeats: int
) -> list[LinkMeasure]:
    """Both directions between the first devices of neighbouring stages of ``plans``,
    measured where ``calibration`` does not hold them already."""
    link_list = []
    pairs = {(p.stages[k].devices[0], p.stages[k + 1].devices[0])
             for p in plans for k in range(len(p.stages) - 1)}  # fmt: skip
    for a, c in sorted(pairs | {(c, a) for a, c in pairs}):
        if calibration is None or calibration.link(a, c) is None:
            m = measure_link(by_id[a], by_id[c], repeats=repeats)
            if m is not None:
                link_list.append(m)
    return link_list


def _plan_allreduces(
    plans: Sequence[Any],
    layers: Any,
    x: Any,
    by_id: dict[int, Any],
    new: Calibration,
    *,
    repeats: int,
) -> tuple[list[AllReduceMeasure], tuple[StageMeasure, ...]]:
    """The all-reduce over each device group of a replicated stage of ``plans``, with that
    stage's own gradient tree: ``(fits, new's stages with their all-reduce seconds)``."""
    import jax

    shapes = jax.eval_shape(layers.init, jax.random.key(0), x)
    groups: dict[tuple[int, ...], dict[Any, Any]] = {}
    for p in plans:
        for s in p.stages:
            if s.replicas > 1:
                key = (s.first_layer, s.last_layer, s.replicas, s.replication)
                tree = [v.get("params", {}) for v in shapes[s.first_layer : s.last_layer + 1]]
                groups.setdefault(tuple(s.devices), {})[key] = tree
    ar_list = []
    measured = {m.key: m for m in new.stages}
    for group, trees in groups.items():
        fit, exact = measure_allreduce([by_id[d] for d in group], trees=trees, repeats=repeats)
        ar_list.append(fit)
        for key, secs in exact.items():
            if key in measured:
                measured[key] = dataclasses.replace(measured[key], allreduce=secs)
    return ar_list, tuple(measured.values())
