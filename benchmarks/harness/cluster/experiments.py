"""The cluster benchmark's experiments: :func:`run_cluster` profiles each model, launches
its runners alone and on 2 workers per link, and predicts, ranks and reports each run (see
:mod:`benchmarks.harness.cluster` for what is measured).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

from benchmarks.harness.cluster.launcher import launch, profile_on_workers
from benchmarks.harness.cluster.models import MICROBATCH, RATES, cluster_model
from benchmarks.harness.cluster.predict import (
    bandwidth,
    describe_plan,
    kendall_tau,
    predict,
    predict_calibrated,
    stage_calibration,
    topology,
)
from benchmarks.harness.cluster.report import ClusterResult, Row
from pdjax.errors import ClusterError

#: Microbatches per update of the flush schedule (experiment (a)'s ``1f1b``).
_M = 4


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What every launch of one :func:`run_cluster` shares (its arguments)."""

    units: int
    dp_units: Mapping[float, int]
    repeats: int
    seed: int
    emulate: bool
    every_cut: bool
    fast_mbit: float
    work: Path
    log: Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class _Model:
    """One model's profile and calibrated stages (measured once, used for every link).

    Attributes:
      cuts: every 2-stage cut, ``((0, c), (c + 1, L - 1))``.
      updates: per layer, the optimizer update's seconds.
      stages: the calibrated candidate stages (:class:`~pdjax.calibrate.StageMeasure`'s
        fields).
      job: the fields every launch's job of this model starts from.
    """

    name: str
    experiment: str
    microbatch: int
    num_layers: int
    cuts: list[tuple[tuple[int, int], tuple[int, int]]]
    prof: Any
    updates: list[float]
    stages: list[dict[str, Any]]
    job: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _Baseline:
    """One worker alone: measured (the faster of its runners), the planner's and the
    simulator's seconds per microbatch, and the calibration without links behind them."""

    measured: float
    planner: float
    simulated: float
    calibration: Any


@dataclasses.dataclass(frozen=True)
class _Link:
    """What one model's launch on one link gave: its rows, the plans ranked, the planner's
    choice, and the calibration it measured (to predict again offline)."""

    rows: list[Row]
    ranking: dict[str, Any]
    choice: dict[str, Any]
    measured: dict[str, Any]


class _Run(TypedDict):
    """One run as :func:`~benchmarks.harness.cluster.predict.predict` and
    :func:`~benchmarks.harness.cluster.predict.predict_calibrated` take it (after the costs)."""

    rate_mbit: float | None
    runner: str
    stages: Sequence[tuple[int, int]]
    units: int
    microbatch: int
    microbatches: int
    extra: int


@dataclasses.dataclass(frozen=True)
class _ModelRun:
    """One model's rows (one worker alone, then every link's), its links and its curve."""

    model: str
    rows: list[Row]
    links: list[_Link]
    curve: dict[str, list[tuple[float, float, float]]]


def run_cluster(
    *,
    rates_mbit: Mapping[str, Sequence[float]] | None = None,
    fast_mbit: float = 10000.0,
    microbatch: Mapping[str, int] | None = None,
    units: int = 24,
    dp_units: Mapping[float, int] | None = None,
    repeats: int = 3,
    seed: int = 0,
    emulate: bool | None = None,
    every_cut: bool = True,
    models: Sequence[str] = ("mlp-512", "vgg-fc"),
    workdir: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> ClusterResult:
    """Runs experiments (a)-(e) of the module doc on 2 pinned workers.

    Args:
      rates_mbit: link rates (Mbit/s each way) per model (default :data:`RATES`).
      fast_mbit: the link of experiment (a)'s extra runners (``pipedream+1``, the collective
        transport, ``1f1b``), on ``mlp-512``.
      microbatch: samples per microbatch, per model (default :data:`MICROBATCH`).
      units: microbatches per timed call (a ``pipedream`` stream, ``1f1b`` steps of 4,
        one worker's steps); data parallelism does ``units / 2`` steps of 2 microbatches.
      dp_units: per rate, fewer microbatches for data parallelism (its steps are long on
        slow links); default: 8 below 1 Gbit/s.
      repeats: timed rounds per launch (medians).
      seed: synthetic data and initialisation.
      emulate: use an emulated network (None: when :func:`~benchmarks.harness.netem.network_support`
        allows; False: loopback, one rate only).
      every_cut: run a 2-stage ``pipedream`` at every cut point (the ranking, (e)); else
        only at the planner's straight cut.
      models: which of :data:`MICROBATCH`'s models.
      workdir: where the workers' files go (default: a temporary directory).
      log: progress lines.

    Raises:
      ClusterError: a worker failed, or ``emulate=True`` where it cannot be.
      pdjax.errors.LaunchInterrupted: on SIGTERM, SIGINT or SIGHUP, after ending the
        workers and deleting the emulated network.
    """
    from pdjax.distributed import ending_on_signals

    t_start = time.monotonic()
    emulate, network = _network(emulate)
    wanted_rates = {**RATES, **(rates_mbit or {})}
    sizes = {**MICROBATCH, **(microbatch or {})}
    # a signal raises here like Ctrl-C does, so the workers are ended and the network is torn
    # down on the way out (the workers run in sessions of their own, out of the terminal's
    # reach, and a launcher killed outright would leave them and the namespaces behind)
    with ending_on_signals(), tempfile.TemporaryDirectory() as tmp:
        work = Path(workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        settings = _Settings(
            units=units,
            dp_units=dict(dp_units or {}),
            repeats=repeats,
            seed=seed,
            emulate=emulate,
            every_cut=every_cut,
            fast_mbit=fast_mbit,
            work=work,
            log=log,
        )
        runs = [
            _run_model(model, wanted_rates[model] if emulate else [None], sizes[model], settings)
            for model in models
        ]
    linked = [ln for run in runs for ln in run.links]
    return ClusterResult(
        rows=tuple(r for run in runs for r in run.rows),
        choices=tuple(ln.choice for ln in linked),
        network=network,
        curves={run.model: run.curve for run in runs},
        microbatch={m: sizes[m] for m in models},
        seconds=time.monotonic() - t_start,
        rankings=tuple(ln.ranking for ln in linked),
        links=tuple(ln.measured for ln in linked),
    )


def _network(emulate: bool | None) -> tuple[bool, str]:
    """Whether the workers run on an emulated network (``emulate``; None: where
    :func:`~benchmarks.harness.netem.network_support` allows), and how they are connected, in one
    line."""
    from benchmarks.harness.netem import network_support

    reason = network_support()
    if emulate and reason:
        raise ClusterError(f"cannot emulate a network here: {reason}")
    emulate = reason is None if emulate is None else emulate
    if emulate:
        network = "2 workers, each in its own network namespace on a veth link through a bridge"
    else:
        why = reason or "emulate=False"
        network = f"2 workers on loopback ({why}): no link emulation, one unshaped link"
    cores = os.cpu_count() or 1
    if cores < 2:
        network += f"; only {cores} core: the workers share it"
    return emulate, network


def _run_model(
    model: str, rates: Sequence[float | None], microbatch: int, s: _Settings
) -> _ModelRun:
    """Everything of one model: its profile, one worker alone, then every link."""
    m = _profile_model(model, microbatch, s)
    baseline, alone = _run_alone(m, s)
    links = [_run_link(m, baseline, rate, s) for rate in rates]
    return _ModelRun(
        model=model,
        rows=alone + [r for ln in links for r in ln.rows],
        links=links,
        curve=_curves(m, baseline, s.units),
    )


def _profile_model(model: str, microbatch: int, s: _Settings) -> _Model:
    """Profiles ``model`` and calibrates its candidate stages (the whole model on one worker
    and on 2, both halves of every 2-stage cut) on one pinned worker."""
    experiment = "a" if model == "mlp-512" else "b"
    L = len(cluster_model(model).layers)
    cuts = [((0, c), (c + 1, L - 1)) for c in range(L - 1)]
    wanted = [(0, L - 1, 1, "split"), (0, L - 1, 2, "round-robin")]
    wanted += [(f, last, 1, "split") for cut in cuts for f, last in cut]
    s.log(f"({experiment}) {model}: profiling and calibrating {len(wanted)} stages on "
          "one pinned worker")  # fmt: skip
    prof, updates, stages = profile_on_workers(model, microbatch, s.seed, s.work, wanted)
    job = {"model": model, "microbatch": microbatch, "seed": s.seed, "repeats": s.repeats}
    return _Model(
        name=model,
        experiment=experiment,
        microbatch=microbatch,
        num_layers=L,
        cuts=cuts,
        prof=prof,
        updates=updates,
        stages=stages,
        job=job,
    )


def _run_alone(m: _Model, s: _Settings) -> tuple[_Baseline, list[Row]]:
    """One worker alone, in a launch of its own: one jitted step, and a one-stage pipeline
    (the faster is the baseline); their rows."""
    s.log(f"({m.experiment}) {m.name}: one worker alone")
    one = [
        {"name": "single", "units": s.units},
        {"name": "pipedream", "label": "single-pipe", "units": s.units,
         "stages": [(0, m.num_layers - 1)]},
    ]  # fmt: skip
    alone = launch({**m.job, "runners": one}, 1, None, False, s.work)
    cpu = alone.pop("_cpu", [])
    times = {k: statistics.median(v) / s.units for k, v in alone.items()}
    single = min(times.values())
    cal0 = stage_calibration(m.prof, m.name, m.microbatch, m.stages, None)
    run = _Run(
        rate_mbit=None,
        runner="single",
        stages=[],
        units=s.units,
        microbatch=m.microbatch,
        microbatches=_M,
        extra=0,
    )
    p_single, s_single, s_prof, _ = _predictions(m, cal0, run)
    rows = [
        Row(
            experiment=m.experiment,
            model=m.name,
            link_mbit=None,
            runner=k,
            stages=how,
            measured=times[k],
            planner=p_single,
            simulated=s_single,
            speedup=single / times[k],
            predicted_speedup=1.0,
            repeats=tuple(t / s.units for t in alone[k]),
            simulated_profile=s_prof,
            simulated_posted=s_single,
            cpu=_per_microbatch(cpu, k, s.units * len(alone[k])),
        )
        for k, how in [("single", "1 worker, one jit"), ("single-pipe", "1 worker, 1 stage")]
    ]
    return _Baseline(measured=single, planner=p_single, simulated=s_single, calibration=cal0), rows


def _per_microbatch(
    cpu: Sequence[Mapping[str, Sequence[float]]], label: str, microbatches: int
) -> tuple[tuple[float, float, float], ...]:
    """Per process, ``(driver, other threads, wall)`` seconds per microbatch of one runner
    (empty where the workers could not read their threads' CPU time)."""
    out = []
    for per_runner in cpu:
        if label not in per_runner:
            return ()
        driver, others, wall = per_runner[label]
        out.append((driver / microbatches, others / microbatches, wall / microbatches))
    return tuple(out)


def _predictions(m: _Model, cal: Any, run: _Run) -> tuple[float, float, float, float]:
    """``(planner, simulator, simulator from the profile alone, simulator with posted
    receives)`` seconds per microbatch of ``run``: all but the third from the calibration
    ``cal``; the last with each receive posted when the receiving stage reaches it."""
    planner, simulated = predict_calibrated(m.prof, cal, **run)
    _, posted = predict_calibrated(m.prof, cal, **run, posted_receives=True)
    _, profile_only = predict(m.prof, m.updates, **run)
    return planner, simulated, profile_only, posted


def _runners(m: _Model, rate: float | None, s: _Settings) -> list[dict[str, Any]]:
    """The runners of one model's launch on one link: a 2-stage ``pipedream`` at every cut
    (or at the planner's straight cut only), data parallelism and, on experiment (a)'s fast
    link, ``pipedream+1``, ``pipedream/coll`` and ``1f1b``."""
    from pdjax.partition import Topology, plan_pipedream

    topo = Topology.flat(2, bandwidth(rate))
    straight = plan_pipedream(m.prof, topo, straight=True, microbatch_size=m.microbatch)
    split = [(st.first_layer, st.last_layer) for st in straight.stages]
    dpu = 8 if rate is not None and rate < 1000 else s.units
    dpu = dpu if rate is None else s.dp_units.get(rate, dpu)
    chosen_cuts = m.cuts if s.every_cut else [tuple(split)]
    runners: list[dict[str, Any]] = [
        {"name": "pipedream", "label": f"pipedream@{a[1]}", "units": s.units, "stages": [a, b]}
        for a, b in chosen_cuts
    ]
    runners.append({"name": "dp", "units": dpu})
    if m.experiment == "a" and rate == s.fast_mbit:
        runners += [  # latency hiding, the collective transport, a flush schedule
            {"name": "pipedream", "label": "pipedream+1", "extra": 1,
             "units": s.units, "stages": split},
            {"name": "pipedream", "label": "pipedream/coll",
             "transport": "collective", "units": s.units, "stages": split},
            {"name": "1f1b", "units": s.units, "stages": split, "microbatches": _M},
        ]  # fmt: skip
    return runners


def _run_link(m: _Model, baseline: _Baseline, rate: float | None, s: _Settings) -> _Link:
    """One model's runners on 2 workers joined by a link of ``rate`` Mbit/s (None:
    loopback), in one launch that calibrates the link first; predicted from its calibration."""
    runners = _runners(m, rate, s)
    where = "loopback" if rate is None else f"{rate:g} Mbit/s"
    s.log(f"({m.experiment}) {m.name}: {len(runners)} runners on {where}, links "
          "calibrated first")  # fmt: skip
    # the candidate stages are calibrated again in this launch, beside the runners (the
    # profile worker's measures are the fallback of a launch that did not return them)
    wanted = [[st["first"], st["last"], st["replicas"], st["replication"]] for st in m.stages]
    job = {**m.job, "runners": runners, "calibrate": True, "stages": wanted}
    got = launch(job, 2, rate, s.emulate, s.work)
    meas = got.pop("_calibration")
    cpu = got.pop("_cpu", [])
    stages = meas.get("stages") or m.stages
    cal = stage_calibration(m.prof, m.name, m.microbatch, stages, meas)
    # everything the predictions came from, to predict again offline
    seen = {"model": m.name, "link_mbit": rate, "links": meas["links"],
            "allreduce": meas["allreduce"], "allreduce_model": meas["allreduce_model"],
            "device_ids": meas["device_ids"], "stages": stages}  # fmt: skip
    rows, plans = _measured_rows(
        m, baseline=baseline, rate=rate, runners=runners, got=got, cal=cal, cpu=cpu
    )
    # one worker alone is a candidate too (measured in its own launch)
    plans.append({"runner": "single", "layout": "1 worker", "measured": baseline.measured,
                  "planner": baseline.planner, "simulated": baseline.simulated})  # fmt: skip
    ranking, choice = _rank_plans(m, rate, cal, plans)
    return _Link(rows=rows, ranking=ranking, choice=choice, measured=seen)


def _measured_rows(
    m: _Model,
    *,
    baseline: _Baseline,
    rate: float | None,
    runners: Sequence[Mapping[str, Any]],
    got: Mapping[str, list[float]],
    cal: Any,
    cpu: Sequence[Mapping[str, Sequence[float]]] = (),
) -> tuple[list[Row], list[dict[str, Any]]]:
    """Per runner of a launch (``got``: its seconds per timed call; ``cpu``: per process,
    per runner, its driver's and other threads' CPU seconds and the calls' wall seconds) a
    row, measured and predicted; and the candidate plans among them (the plain 2-stage
    cuts and DP)."""
    L = m.num_layers
    ring = sum(lp.param_bytes for lp in m.prof.layers) / bandwidth(rate)
    rows: list[Row] = []
    plans: list[dict[str, Any]] = []
    for r in runners:
        n = r["units"]
        label = r.get("label", r["name"])
        t = statistics.median(got[label]) / n
        st = r.get("stages", [])
        run = _Run(
            rate_mbit=rate,
            runner=r["name"],
            stages=st,
            units=n,
            microbatch=m.microbatch,
            microbatches=_M,
            extra=r.get("extra", 0),
        )
        p, sim, s_old, s_posted = _predictions(m, cal, run)
        layout = "DP x2" if r["name"] == "dp" else " / ".join(f"{f}-{last}" for f, last in st)
        allreduce, allreduce_predicted = (
            (cal.stage(0, L - 1, 2, "round-robin").allreduce, ring)
            if r["name"] == "dp" else (math.nan, math.nan))  # fmt: skip
        rows.append(
            Row(
                experiment=m.experiment,
                model=m.name,
                link_mbit=rate,
                runner=label,
                stages=layout,
                measured=t,
                planner=p,
                simulated=sim,
                speedup=baseline.measured / t,
                predicted_speedup=baseline.simulated / sim,
                repeats=tuple(x / n for x in got[label]),
                allreduce=allreduce,
                allreduce_predicted=allreduce_predicted,
                simulated_profile=s_old,
                simulated_posted=s_posted,
                cpu=_per_microbatch(cpu, label, n * len(got[label])),
            )
        )
        if r["name"] == "dp" or (r["name"] == "pipedream" and not r.get("extra")
                                 and "transport" not in r):  # fmt: skip
            plans.append({"runner": label, "layout": layout, "measured": t,
                          "planner": p, "simulated": sim})  # fmt: skip
    return rows, plans


def _rank_plans(
    m: _Model, rate: float | None, cal: Any, plans: Sequence[Mapping[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(ranking, choice)`` on one link: Kendall's tau of the planner's and the simulator's
    order of the candidate ``plans`` against the measured one, and the planner's choice
    (from calibrated costs, among all it may pick) against the measured best."""
    from pdjax.partition import plan_pipedream

    chosen = plan_pipedream(
        m.prof, topology(cal, 2, rate), fewer_machines=True, microbatch_size=m.microbatch,
        replication="round-robin", stage_seconds=cal.stage_seconds("pipedream", 1),
        allreduce_seconds=cal.allreduce_function(),
    )  # fmt: skip
    runner, how = describe_plan(chosen)
    pick = f"pipedream@{chosen.stages[0].last_layer}" if runner == "pipedream" else runner
    best = min(plans, key=lambda q: q["measured"])
    refined = min(plans, key=lambda q: q["simulated"])
    of_pick = next((q["measured"] for q in plans if q["runner"] == pick), math.nan)
    measured = [q["measured"] for q in plans]
    ranking = {
        "model": m.name, "link_mbit": rate, "plans": plans,
        "tau_planner": kendall_tau([q["planner"] for q in plans], measured),
        "tau_simulated": kendall_tau([q["simulated"] for q in plans], measured),
        "pick": pick, "pick_layout": how, "pick_measured": of_pick,
        # the refinement loop's pick: the simulator's best on calibrated costs
        "refined": refined["runner"], "refined_measured": refined["measured"],
        "best": best["runner"], "best_measured": best["measured"],
    }  # fmt: skip
    choice = {
        "model": m.name, "link_mbit": rate, "planner": runner,
        "planner_layout": how, "planner_seconds": chosen.time_per_microbatch,
        "measured_best": best["runner"], "measured_best_seconds": best["measured"],
        "measured_of_choice": of_pick,
        "agree": of_pick <= 1.05 * best["measured"],
    }  # fmt: skip
    return ranking, choice


def _curves(
    m: _Model, baseline: _Baseline, units: int
) -> dict[str, list[tuple[float, float, float]]]:
    """The predicted speedups over one worker against bandwidth, for the plot:
    ``{runner: [(mbit, simulated speedup, planner speedup), ...]}``."""
    from pdjax.partition import Topology, plan_pipedream

    # the calibration without measured links (the one-worker launch's): each rate a flat link
    grid = [10 ** (k / 8) for k in range(8, 8 * 5 + 1)]  # 10 Mbit/s .. 100 Gbit/s
    curve: dict[str, list[tuple[float, float, float]]] = {"pipedream": [], "dp": []}
    for mbit in grid:
        topo = Topology.flat(2, bandwidth(mbit))
        straight = plan_pipedream(m.prof, topo, straight=True, microbatch_size=m.microbatch)
        split = [(st.first_layer, st.last_layer) for st in straight.stages]
        for name in curve:
            p, sim = predict_calibrated(
                m.prof,
                baseline.calibration,
                rate_mbit=mbit,
                runner=name,
                stages=split,
                units=units,
                microbatch=m.microbatch,
                microbatches=_M,
            )
            curve[name].append((mbit, baseline.simulated / sim, baseline.planner / p))
    return curve
