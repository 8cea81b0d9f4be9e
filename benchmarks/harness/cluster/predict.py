"""The cluster benchmark's predictions: the planner's and the simulator's seconds per
microbatch of a run, from the per-layer profile alone or from calibrated costs, and
Kendall's tau to compare their ranking of the plans with the measured one."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.harness.cluster.models import cluster_model

#: TCP payload per Ethernet frame of a 1500-byte MTU (what a shaped link's rate buys).
PAYLOAD = 1448 / 1514


def bandwidth(rate_mbit: float | None) -> float:
    """Bytes/s of TCP payload on a link of ``rate_mbit`` (None: loopback, taken as 2 GB/s,
    what unshaped veth measured here)."""
    return 2e9 if rate_mbit is None else rate_mbit * 1e6 / 8 * PAYLOAD


def _stage_costs(prof: Any, updates: Sequence[float], plan: Any) -> Any:
    """The simulator's costs for ``plan``, with each stage's measured update seconds."""
    from pdjax.partition import costs_from_plan

    costs = costs_from_plan(plan, prof)
    stages = tuple(
        dataclasses.replace(st, update=float(sum(updates[s.first_layer : s.last_layer + 1])))
        for st, s in zip(costs.stages, plan.stages, strict=True)
    )
    return dataclasses.replace(costs, stages=stages)


def _schedule(runner: str, num_stages: int, units: int, microbatches: int, extra: int = 0) -> Any:
    """The schedule a runner plays: ``units`` microbatches (see :func:`_make_runner`)."""
    from pdjax.schedules import generate, semantics

    if runner == "single":
        return generate("1f1b", 1, 1, steps=units)
    if runner == "dp":  # each worker a whole microbatch per step: round-robin over 2
        return generate("1f1b", 1, 2, steps=units // 2, replicas=(2,),
                        replication=("round-robin",))  # fmt: skip
    if semantics(runner).updates_per_microbatch:  # a stream of units steps of one
        return generate(runner, num_stages, units, extra_in_flight=extra)
    return generate(runner, num_stages, microbatches, steps=units // microbatches)


def _layout(runner: str, stages: Sequence[tuple[int, int]], L: int) -> list[tuple[int, int, int]]:
    if runner == "single":
        return [(0, L - 1, 1)]
    if runner == "dp":
        return [(0, L - 1, 2)]
    return [(f, last, 1) for f, last in stages]


def predict(
    prof: Any,
    updates: Sequence[float],
    rate_mbit: float | None,
    runner: str,
    stages: Sequence[tuple[int, int]],
    *,
    units: int,
    microbatch: int,
    microbatches: int,
    extra: int = 0,
) -> tuple[float, float]:
    """``(planner, simulator)`` seconds per microbatch of one run from the per-layer profile
    alone (no calibration; ``extra``: pipedream's extra microbatches in flight)."""
    from pdjax.partition import Topology, evaluate_partition
    from pdjax.schedules import generate
    from pdjax.simulator import simulate

    L = len(prof.layers)
    bw = bandwidth(rate_mbit)
    layout = _layout(runner, stages, L)
    if runner in ("single", "dp"):
        # one stage on r workers, each taking a microbatch per step: the plan's microbatch
        # is the step's r microbatches (pdjax's cost model splits it over the replicas)
        r = layout[0][2]
        plan = evaluate_partition(prof, Topology.flat(r, bw), layout, schedule="1f1b",
                                  num_microbatches=1, microbatch_size=r * microbatch,
                                  partitioner="manual", replication="split")  # fmt: skip
        sched = generate("1f1b", 1, 1, steps=units // r, replicas=(r,))
        sim = simulate(sched, _stage_costs(prof, updates, plan)).makespan / units
        return plan.time_per_microbatch / r, sim
    plan = evaluate_partition(prof, Topology.flat(len(stages), bw), layout, schedule=runner,
                              num_microbatches=microbatches, microbatch_size=microbatch,
                              partitioner="manual")  # fmt: skip
    sched = _schedule(runner, len(stages), units, microbatches, extra)
    sim = simulate(sched, _stage_costs(prof, updates, plan)).makespan / units
    return plan.time_per_microbatch, sim


def stage_calibration(
    prof: Any, model: str, microbatch: int, stages: Sequence[Mapping[str, Any]],
    links: Mapping[str, Any] | None, optimizer: str = "sgd",
) -> Any:  # fmt: skip
    """The :class:`~pdjax.calibrate.Calibration` of one model (and one launch's links);
    device ids are the workers' positions (0, 1)."""
    from pdjax.calibrate import AllReduceMeasure, Calibration, LinkMeasure, StageMeasure

    spec = cluster_model(model)
    from pdjax.calibrate import model_fingerprint

    x, _ = spec.sample_batch(microbatch, 0)
    measured = [StageMeasure(**st) for st in stages]
    ars: tuple[AllReduceMeasure, ...] = ()
    link_list: tuple[LinkMeasure, ...] = ()
    if links is not None:
        exact = float(links["allreduce_model"])
        measured = [
            dataclasses.replace(m, allreduce=exact) if m.replicas == 2 and m.first == 0
            and m.last == len(prof.layers) - 1 else m
            for m in measured
        ]  # fmt: skip
        a = links["allreduce"]
        ars = (AllReduceMeasure(tuple(a["devices"]), a["latency"], a["bandwidth"],
                                tuple(a["sizes"]), tuple(a["seconds"])),)  # fmt: skip
        link_list = tuple(
            LinkMeasure(**{**ln, "sizes": tuple(ln["sizes"]), "seconds": tuple(ln["seconds"])})
            for ln in links["links"]
        )
    cal = Calibration(
        model=model_fingerprint(spec.layers, x), microbatch_size=microbatch, devices=(0, 1),
        platform="cpu", optimizer=optimizer, stages=tuple(measured), links=link_list,
        allreduces=ars,
    )  # fmt: skip
    return cal.with_profile_ratio(prof)


def topology(cal: Any, workers: int, rate_mbit: float | None) -> Any:
    """A flat topology of ``workers`` with the calibrated link (both directions' mean
    bandwidth and latency), or the configured rate without measured links."""
    from pdjax.partition import Level, Topology

    there, back = cal.link(0, 1), cal.link(1, 0)
    if workers < 2 or there is None or back is None:
        return Topology.flat(max(1, workers), bandwidth(rate_mbit))
    bw = 2.0 / (1.0 / there.bandwidth + 1.0 / back.bandwidth)
    return Topology((Level(workers, bw, "worker", (there.latency + back.latency) / 2),))


def predict_calibrated(
    prof: Any,
    cal: Any,
    rate_mbit: float | None,
    runner: str,
    stages: Sequence[tuple[int, int]],
    *,
    units: int,
    microbatch: int,
    microbatches: int,
    extra: int = 0,
    posted_receives: bool | None = None,
) -> tuple[float, float]:
    """``(planner, simulator)`` seconds per microbatch of one run from calibrated costs:
    the stages' programs measured on a pinned worker, the link and the all-reduce measured
    in the run's own launch. ``posted_receives``: the simulator's receive model
    (:class:`~pdjax.simulator.PipelineCosts`); None: what the calibration implies."""
    from pdjax.partition import costs_from_plan, evaluate_partition
    from pdjax.simulator import simulate

    L = len(prof.layers)
    layout = _layout(runner, stages, L)
    n = sum(r for *_, r in layout)
    schedule = {"single": "1f1b", "dp": "1f1b"}.get(runner, runner)
    M = {"single": 1, "dp": 2}.get(runner, microbatches)
    mode = "round-robin" if runner == "dp" else "split"
    kw = {"stage_seconds": cal.stage_seconds(schedule, M),
          "allreduce_seconds": cal.allreduce_function()}  # fmt: skip
    plan = evaluate_partition(prof, topology(cal, n, rate_mbit), layout, schedule=schedule,
                              num_microbatches=M, microbatch_size=microbatch,
                              partitioner="manual", replication=mode, **kw)  # fmt: skip
    sched = _schedule(runner, len(layout), units, microbatches, extra)
    costs = costs_from_plan(plan, prof, calibration=cal, partial=not cal.links)
    if posted_receives is not None:
        costs = dataclasses.replace(costs, posted_receives=posted_receives)
    sim = simulate(sched, costs).makespan / units
    return plan.time_per_microbatch, sim


def describe_plan(plan: Any) -> tuple[str, str]:
    """``(runner, layout)`` of a planner's choice on 2 workers."""
    if len(plan.stages) == 1:
        return ("dp", "DP x2") if plan.stages[0].replicas == 2 else ("single", "1 worker")
    if all(s.replicas == 1 for s in plan.stages):
        return "pipedream", " / ".join(f"{s.first_layer}-{s.last_layer}" for s in plan.stages)
    return "hybrid", plan.describe().splitlines()[0]


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b of two rankings (ties count for neither side).

    >>> kendall_tau([1, 2, 3], [10, 20, 30]), kendall_tau([1, 2, 3], [3, 2, 1])
    (1.0, -1.0)
    """
    n, conc, disc, ta, tb = len(a), 0, 0, 0, 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            if x == 0 and y == 0:
                continue
            if x == 0:
                ta += 1
            elif y == 0:
                tb += 1
            elif (x > 0) == (y > 0):
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + ta) * (conc + disc + tb))
    return (conc - disc) / denom if denom else math.nan
