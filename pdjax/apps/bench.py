"""Throughput of every schedule and of data parallelism, measured next to the simulator.

:func:`bench` runs one model on one set of devices with every pipeline schedule and with
the data-parallel baseline, on synthetic data, and sets each measured throughput beside
what the simulator predicts for the same plan, schedule and microbatch size
(:func:`~pdjax.partition.costs_from_plan` on a profile measured on the first device).

What is timed. A flush schedule (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``) and data
parallelism make ``steps`` calls of one optimizer step (``batch_size`` samples each); the
streaming schedules (``pipedream``, ``2bw``) make one :meth:`~pdjax.pipeline.Pipeline.run`
over ``steps * M`` microbatches, which is how ``pdjax train`` runs them (one drain at the end
of the call). The prediction is the simulator's makespan of exactly the schedule the
executor runs (``Pipeline.schedule``), so fill and drain are in both. Every runner is
called once first (compilation) and then timed ``repeats`` times, round-robin over the
runners, so that the noise of a shared machine falls on all of them alike; the table gives
the medians.

On CPU the runners bound how far they dispatch ahead and run a replicated stage one
program at a time (the row says so): XLA's CPU client can deadlock on collectives queued
together (``pdjax._xla_cpu``, the one home of these workarounds).

How to read it on a CPU-only machine: in-process CPU devices share one thread pool, so the
stages of a pipeline do not run in parallel and no pipeline speedup is expected. There the
prediction is the larger of the simulator's makespan and the devices' summed busy seconds
in the simulation (every program was profiled with the whole pool: two programs never run
at once), so measured/predicted shows what the machinery (dispatch, ``device_put``
transfers) costs beyond the work itself, and the host seconds per dispatched action show
the driver's share. On accelerators (and in the cluster benchmark) the prediction is the
makespan: one processor per device.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from pdjax.apps.bench_host import (
    driver_seconds_per_action,
    host_costs,
    pool_concurrency,
    shared_pool,
)
from pdjax.apps.bench_report import BenchResult, BenchRow, format_table
from pdjax.errors import PdjaxError, PipelineError
from pdjax.models import ModelSpec, get_model
from pdjax.partition import (
    Plan,
    StagePlan,
    Topology,
    costs_from_plan,
    evaluate_partition,
    plan_pipedream,
)
from pdjax.pipeline import Pipeline, even_stages
from pdjax.profile import Profile, profile
from pdjax.runners import DataParallel, Runner
from pdjax.schedules import STREAMING, ScheduleSpec, generate, schedule_kind
from pdjax.simulator import PipelineCosts, Simulation, simulate

__all__ = [
    "BENCH_SCHEDULES",
    "BenchResult",
    "BenchRow",
    "bench",
    "driver_seconds_per_action",
    "format_table",
    "host_costs",
    "pool_concurrency",
]

#: The pipeline schedules :func:`bench` runs by default (data parallelism comes after):
#: the zero-bubble variants beyond zb-h1 only when named.
BENCH_SCHEDULES = ("gpipe", "1f1b", "pipedream", "2bw", "interleaved", "zb-h1")
#: Runner variants: ``<schedule>/<variant>`` runs the schedule with replicated stages
#: all-reducing in every backward (``backward``, the runtime before per-device gradient
#: sums) or replicated round-robin (``rr``, PipeDream's replication).
VARIANTS = ("backward", "rr")


def bench(
    model: str = "cnn",
    config: str = "tiny",
    *,
    devices: int = 4,
    batch_size: int = 64,
    microbatches: int = 4,
    plan: str = "auto",
    straight: bool = False,
    chunks: int = 2,
    steps: int = 10,
    repeats: int = 3,
    schedules: Sequence[str] = (*BENCH_SCHEDULES, "dp"),
    learning_rate: float = 1e-3,
    seed: int = 0,
    on_row: Callable[[str], None] | None = None,
) -> BenchResult:
    """Measures every schedule (and data parallelism) on synthetic data; see the module doc.

    Args:
      model: a name from :data:`pdjax.models.MODELS`.
      config: ``"tiny"`` or ``"paper"``.
      devices: how many of ``jax.devices()`` to use.
      batch_size: samples per optimizer step (``M`` microbatches for a pipeline; the whole
        batch, sharded, for data parallelism).
      microbatches: ``M``.
      plan: ``"auto"`` (PipeDream's planner on the profile, for ``1f1b``), ``"even"``
        (equal layer counts, one device per stage) or a plan JSON path. Every schedule
        runs this plan; ``interleaved`` cuts the model into ``P * chunks`` equal virtual
        stages on the plan's device groups.
      straight: ``plan="auto"`` without replication.
      chunks: ``v`` for ``interleaved``.
      steps: optimizer steps per timed repeat.
      repeats: timed rounds over all runners (the table reports medians).
      schedules: which runners, in order; ``"dp"`` is data parallelism; a schedule may
        carry a variant, ``"1f1b/backward"`` or ``"pipedream/rr"`` (:data:`VARIANTS`).
      learning_rate: Adam's step size (the numbers do not depend on it).
      seed: the synthetic batch and the initialisation.
      on_row: called with a runner's name when it starts compiling (progress).

    Returns:
      The :class:`BenchResult`; a runner that cannot run (``2bw`` with fewer microbatches
      than stages, ``interleaved`` with too few layers) has a row with its ``error``.

    Raises:
      PipelineError: bad sizes or counts, or more devices than are visible.
    """
    setup = _setup(
        model,
        config,
        devices=devices,
        batch_size=batch_size,
        microbatches=microbatches,
        plan=plan,
        straight=straight,
        chunks=chunks,
        steps=steps,
        repeats=repeats,
        schedules=schedules,
        learning_rate=learning_rate,
        seed=seed,
    )
    runners, failed = _compile(schedules, setup, on_row)
    measured = _time_round_robin(runners, repeats)
    rows = {**failed, **{r.name: _row(r, measured[r.name]) for r in runners}}
    return _result(setup, tuple(rows[name] for name in schedules))


@dataclasses.dataclass(frozen=True)
class _Setup:
    """One :func:`bench` call's arguments, checked, and what all its runners share: the
    model, the synthetic batch ``(x, y)``, the profile (on the first device), the plan and
    the optimizer."""

    model: str
    config: str
    devices: tuple[jax.Device, ...]
    batch_size: int
    microbatches: int
    chunks: int
    steps: int
    repeats: int
    seed: int
    spec: ModelSpec
    x: Any
    y: Any
    profile: Profile
    topology: Topology
    plan: Plan
    optimizer: optax.GradientTransformation
    concurrency: float


def _setup(
    model: str,
    config: str,
    *,
    devices: int,
    batch_size: int,
    microbatches: int,
    plan: str,
    straight: bool,
    chunks: int,
    steps: int,
    repeats: int,
    schedules: Sequence[str],
    learning_rate: float,
    seed: int,
) -> _Setup:
    """:func:`bench`'s arguments checked, the synthetic batch made, the model profiled on
    the first device (and the shared pool's concurrency measured), the plan made."""
    devs = _check_arguments(
        devices=devices,
        batch_size=batch_size,
        microbatches=microbatches,
        chunks=chunks,
        steps=steps,
        repeats=repeats,
        schedules=schedules,
    )
    spec = get_model(model, config)
    b = batch_size // microbatches
    x, y = jax.tree.map(np.asarray, spec.sample_batch(batch_size, seed))
    prof = profile(
        spec.layers,
        jax.tree.map(lambda a: a[:b], x),
        measure=True,
        device=devs[0],
        repeats=5,
        meta={"model": model, "config": config},
    )
    mb = jax.tree.map(lambda a: a[:b], (x, y))
    concurrency = pool_concurrency(spec, mb, devs)
    topology = Topology.from_devices(devs)
    base = _plan(
        plan,
        prof,
        topology,
        num_layers=len(spec.layers),
        devices=devices,
        microbatches=microbatches,
        microbatch_size=b,
        straight=straight,
    )
    return _Setup(
        model=model,
        config=config,
        devices=tuple(devs),
        batch_size=batch_size,
        microbatches=microbatches,
        chunks=chunks,
        steps=steps,
        repeats=repeats,
        seed=seed,
        spec=spec,
        x=x,
        y=y,
        profile=prof,
        topology=topology,
        plan=base,
        optimizer=optax.adam(learning_rate),
        concurrency=concurrency,
    )


def _check_arguments(
    *,
    devices: int,
    batch_size: int,
    microbatches: int,
    chunks: int,
    steps: int,
    repeats: int,
    schedules: Sequence[str],
) -> list[jax.Device]:
    """The first ``devices`` of ``jax.devices()``, once the counts and schedules are
    checked (:class:`~pdjax.errors.PipelineError` for the first that is wrong)."""
    for name, value in [
        ("devices", devices),
        ("batch_size", batch_size),
        ("microbatches", microbatches),
        ("chunks", chunks),
        ("steps", steps),
        ("repeats", repeats),
    ]:
        if value < 1:
            raise PipelineError(f"{name} must be >= 1, got {value}")
    if batch_size % microbatches:
        raise PipelineError(
            f"batch_size {batch_size} is not a multiple of microbatches {microbatches}"
        )
    unknown = [s for s in schedules if not _known_runner(s)]
    if unknown or len(set(schedules)) != len(schedules) or not schedules:
        raise PipelineError(
            f"unknown, repeated or no schedules in {list(schedules)}; choose some of "
            f"{', '.join((*BENCH_SCHEDULES, 'dp'))}, each once, a schedule optionally with "
            f"a variant /{' or /'.join(VARIANTS)} (e.g. 1f1b/backward)"
        )
    visible = jax.devices()
    if devices > len(visible):
        raise PipelineError(
            f"{devices} devices requested, {len(visible)} visible; on CPU set "
            "jax.config.update('jax_num_cpu_devices', N) before using JAX (pdjax bench "
            "does it for you with --devices)"
        )
    return visible[:devices]


def _compile(
    schedules: Sequence[str], setup: _Setup, on_row: Callable[[str], None] | None
) -> tuple[list[_Runner], dict[str, BenchRow]]:
    """Every runner made and called once (compilation, the first transfers), in order; one
    that refuses to run gets a row with its error instead."""
    runners: list[_Runner] = []
    failed: dict[str, BenchRow] = {}
    for name in schedules:
        if on_row is not None:
            on_row(name)
        try:
            runner = _dp_runner(setup) if name == "dp" else _pipeline_runner(name, setup)
            runner.call()  # compile (and the first transfers); refusals come before work
        except PdjaxError as e:
            failed[name] = BenchRow(
                name=name,
                stages="-",
                samples_per_second=math.nan,
                predicted_samples_per_second=math.nan,
                host_seconds_per_action=math.nan,
                actions=0,
                samples=0,
                error=str(e),
            )
            continue
        runners.append(runner)
    return runners, failed


def _time_round_robin(
    runners: Sequence[_Runner], repeats: int
) -> dict[str, list[tuple[float, float]]]:
    """``repeats`` timed calls of every runner, round-robin so that the noise of a shared
    machine falls on all of them alike: each call's ``(seconds, host seconds per action)``
    by runner name."""
    measured: dict[str, list[tuple[float, float]]] = {r.name: [] for r in runners}
    for _ in range(repeats):
        for runner in runners:
            measured[runner.name].append(runner.call())
    return measured


def _row(runner: _Runner, measured: Sequence[tuple[float, float]]) -> BenchRow:
    """The runner's row: the medians of its timed calls, its prediction, and its
    all-reduces per step (counted in one more, untimed call)."""
    sps = [runner.samples / seconds for seconds, _ in measured]
    all_reduces = runner.count() if runner.count is not None else math.nan
    return BenchRow(
        name=runner.name,
        stages=runner.stages,
        samples_per_second=statistics.median(sps),
        predicted_samples_per_second=runner.samples / runner.predicted_seconds,
        host_seconds_per_action=statistics.median(h for _, h in measured),
        actions=runner.actions,
        samples=runner.samples,
        repeats=tuple(sps),
        note=runner.note,
        all_reduces_per_step=all_reduces,
    )


def _result(setup: _Setup, rows: tuple[BenchRow, ...]) -> BenchResult:
    """The :class:`BenchResult` of ``rows``, with what they were measured on."""
    prof, plan = setup.profile, setup.plan
    return BenchResult(
        model=setup.model,
        config=setup.config,
        devices=len(setup.devices),
        batch_size=setup.batch_size,
        microbatches=setup.microbatches,
        steps=setup.steps,
        repeats=setup.repeats,
        plan=plan.describe().splitlines()[0] + f" ({plan.partitioner})",
        profile_seconds=float(np.sum(prof.forward_seconds()) + np.sum(prof.backward_seconds())),
        cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0,
        platform=str(setup.devices[0].platform),
        rows=rows,
        pool_concurrency=setup.concurrency,
    )


def _plan(
    plan: str,
    prof: Profile,
    topology: Topology,
    *,
    num_layers: int,
    devices: int,
    microbatches: int,
    microbatch_size: int,
    straight: bool,
) -> Plan:
    """The plan every schedule runs: planned, even, or loaded (at this microbatch size)."""
    if plan == "auto":
        return plan_pipedream(
            prof,
            topology,
            schedule="1f1b",
            straight=straight,
            num_microbatches=microbatches,
            microbatch_size=microbatch_size,
        )
    if plan == "even":
        stages = even_stages(num_layers, min(num_layers, devices))
        return evaluate_partition(
            prof,
            topology,
            [(s.first_layer, s.last_layer, 1) for s in stages],
            schedule="1f1b",
            partitioner="uniform",
            num_microbatches=microbatches,
            microbatch_size=microbatch_size,
        )
    if not Path(plan).is_file():
        raise PipelineError(f"--plan takes 'auto', 'even' or a plan JSON file; got {plan!r}")
    loaded = Plan.load(plan)
    if loaded.num_layers != num_layers:
        raise PipelineError(
            f"the plan {plan} covers {loaded.num_layers} layers, the model has {num_layers}"
        )
    # Predict at the microbatch size that runs, whatever the plan was made for.
    return dataclasses.replace(loaded, microbatch_size=microbatch_size)


@dataclasses.dataclass
class _Runner:
    """A runner with its state; ``call()`` runs one timed unit and returns
    ``(seconds, host seconds per action)``."""

    name: str
    stages: str
    samples: int
    actions: int
    predicted_seconds: float
    note: str
    call: Callable[[], tuple[float, float]]
    count: Callable[[], float] | None = None


@dataclasses.dataclass
class _Calls:
    """What a row times, for any :class:`~pdjax.runners.Runner`: ``calls`` calls of
    ``runner.run`` over ``stream``, from ``state`` (updated by each)."""

    runner: Runner[Any]
    state: Any
    stream: list[Any]
    calls: int

    def __call__(self) -> tuple[float, float]:
        """Runs the calls: ``(seconds until the state is computed, host seconds per
        action)``."""
        host = 0.0
        actions = 0
        t0 = time.perf_counter()
        for _ in range(self.calls):
            self.state, metrics = self.runner.run(self.state, self.stream)
            host += metrics.host_seconds
            actions += metrics.actions
        jax.block_until_ready(self.state)
        return time.perf_counter() - t0, host / actions


def _known_runner(name: str) -> bool:
    base, _, variant = name.partition("/")
    if base == "dp":
        return not variant
    return base in BENCH_SCHEDULES and (not variant or variant in VARIANTS)


def _describe(replicas: Sequence[int]) -> str:
    if len(set(replicas)) == 1:
        n = len(replicas)
        return f"{n} stage{'s' if n > 1 else ''} x{replicas[0]}"
    return "-".join(str(r) for r in replicas)


def _pipeline_runner(name: str, setup: _Setup) -> _Runner:
    """The runner of pipeline schedule ``name`` (with its variant, if any) on the plan."""
    spec, plan, chunks, microbatches = setup.spec, setup.plan, setup.chunks, setup.microbatches
    L = len(spec.layers)
    note = ""
    runner_name, name = name, name.partition("/")[0]
    variant = runner_name.partition("/")[2]
    kind = schedule_kind(name)
    if kind.chunks is None:  # the caller's chunks over the plan's device groups
        G, K = plan.num_stages, plan.num_stages * chunks
        if K > L:
            raise PipelineError(
                f"{name} needs {G} x {chunks} = {K} virtual stages, {spec.name} has only "
                f"{L} layers; use --chunks 1 or a plan with fewer stages"
            )
        specs: Any = _interleaved_stages(plan, L, chunks)
        costs = _virtual_costs(setup.profile, plan, specs, microbatches, name)
        stages = f"{_describe(plan.replicas)}, {chunks} chunks each"
        note = f"{K} equal virtual stages"
    else:
        specs = plan  # the plan itself: its device ids are looked up by id
        costs = costs_from_plan(plan, setup.profile)
        stages = _describe(plan.replicas)
    pipe = Pipeline(
        spec.layers,
        specs,
        spec.loss,
        setup.optimizer,
        schedule=ScheduleSpec(
            name,
            microbatches=microbatches,
            chunks=kind.chunks_for(chunks),
            replication="round-robin" if variant == "rr" else "split",
            grad_allreduce="backward" if variant == "backward" else "update",
        ),
        devices=jax.devices(),
    )
    if variant:
        how = {"rr": "round-robin replication", "backward": "all-reduce in every backward"}
        note = "; ".join(filter(None, [note, how[variant]]))
    batch = pipe.split_batch((setup.x, setup.y))
    if name in STREAMING:
        calls, stream = 1, batch * setup.steps
        note = note or f"one stream of {len(stream)}"
    else:
        calls, stream = setup.steps, batch
    sched = pipe.schedule(len(stream))  # fails here, before compiling, if it cannot run
    used = list(dict.fromkeys(d for st in pipe.stages for d in st.devices))
    predicted = predicted_call_seconds(simulate(sched, costs), used, setup.concurrency) * calls
    call = _Calls(pipe, pipe.init(jax.random.key(setup.seed), batch[0][0]), stream, calls)
    # the runtime runs a replicated stage's programs one at a time on CPU (pdjax._xla_cpu)
    if any(pipe.workarounds.one_at_a_time):
        note = "; ".join(filter(None, [note, "synchronous (replicated stage, CPU)"]))

    def count() -> float:
        """All-reduces per optimizer step (M microbatches), from the runtime's counters."""
        call.state, metrics = pipe.run(call.state, stream, collectives=True)
        return sum((metrics.all_reduces or {}).values()) * microbatches / len(stream)

    samples = calls * len(stream) * (len(jax.tree.leaves(setup.x)[0]) // microbatches)
    actions = calls * sum(len(group) for group in sched.actions)
    return _Runner(
        name=runner_name,
        stages=stages,
        samples=samples,
        actions=actions,
        predicted_seconds=predicted,
        note=note,
        call=call,
        count=count,
    )


def _interleaved_stages(plan: Plan, num_layers: int, chunks: int) -> tuple[StagePlan, ...]:
    """The model cut into ``P * chunks`` equal virtual stages, virtual stage ``k`` on the
    devices of the plan's stage ``k % P``."""
    G, K = plan.num_stages, plan.num_stages * chunks
    # hand-written stages name devices by index into jax.devices(); the plan's are ids
    index = {int(d.id): i for i, d in enumerate(jax.devices())}
    ids = plan.topology.device_ids is not None

    def where(devs: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(index[d] for d in devs) if ids else devs

    return tuple(
        StagePlan(s.first_layer, s.last_layer, where(plan.stages[k % G].devices))
        for k, s in enumerate(even_stages(num_layers, K))
    )


def _virtual_costs(
    prof: Profile, plan: Plan, specs: Sequence[StagePlan], microbatches: int, schedule: str
) -> PipelineCosts:
    """Simulator costs of interleaved virtual stages: each priced as a stage of its own on
    its group's replica count, every link at the plan's slowest bandwidth."""
    bandwidth = min(level.bandwidth for level in plan.topology.levels)
    replicas = [len(s.devices) for s in specs]
    virtual = evaluate_partition(
        prof,
        Topology.flat(sum(replicas), bandwidth),
        [(s.first_layer, s.last_layer, r) for s, r in zip(specs, replicas, strict=True)],
        schedule=schedule,
        num_microbatches=microbatches,
        microbatch_size=plan.microbatch_size,
        partitioner="uniform",
    )
    return costs_from_plan(virtual, prof)


def predicted_call_seconds(
    sim: Simulation, devices: Sequence[jax.Device], concurrency: float
) -> float:
    """Seconds the simulation predicts for one call: its makespan, or on in-process CPU
    devices (one shared thread pool, whose every program the profile timed with the whole
    pool) the larger of that and the devices' summed busy seconds over the pool's measured
    ``concurrency`` (:func:`pool_concurrency`)."""
    if not shared_pool(devices):
        return sim.makespan
    replicas = sim.schedule.replicas
    work = math.fsum((sp.end - sp.start) * replicas[sp.group] for sp in sim.timeline.spans)
    return max(sim.makespan, work / concurrency)


def _dp_runner(setup: _Setup) -> _Runner:
    """The data-parallel runner: one stage on every device, a step a batch."""
    spec, devs, x, y, steps = setup.spec, setup.devices, setup.x, setup.y, setup.steps
    n = len(devs)
    batch_size = len(jax.tree.leaves(x)[0])
    if batch_size % n:
        raise PipelineError(
            f"data parallelism shards the batch of {batch_size} over {n} devices; use a "
            f"batch size that is a multiple of {n}"
        )
    # A plan with one stage on every device is data parallelism; its microbatch is the batch.
    plan = evaluate_partition(
        setup.profile,
        setup.topology,
        [(0, len(spec.layers) - 1, n)],
        schedule="1f1b",
        num_microbatches=1,
        microbatch_size=batch_size,
        partitioner="uniform",
    )
    sched = generate("1f1b", 1, 1, replicas=(n,))
    simulation = simulate(sched, costs_from_plan(plan, setup.profile))
    predicted = predicted_call_seconds(simulation, devs, setup.concurrency) * steps
    dp = DataParallel(spec.layers, spec.loss, setup.optimizer, devices=devs)
    call = _Calls(dp, dp.init(jax.random.key(setup.seed), x), [(x, y)] * steps, 1)  # a step a batch
    return _Runner(
        name="dp",
        stages=f"1 stage x{n}",
        samples=steps * batch_size,
        actions=steps,
        predicted_seconds=predicted,
        note="",
        call=call,
    )
