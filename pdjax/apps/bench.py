"""Throughput of every schedule and of data parallelism, measured next to the simulator.

:func:`bench` runs one model on one set of devices with every pipeline schedule and with
the data-parallel baseline, on synthetic data, and sets each measured throughput beside
what the simulator predicts for the same plan, schedule and microbatch size
(:func:`~pdjax.pipeline.costs.costs_from_plan` on a profile measured on the first device).

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

from pdjax.errors import PdjaxError, PipelineError
from pdjax.models import ModelSpec, get_model
from pdjax.partition import Plan, StagePlan, Topology, evaluate_partition, plan_pipedream
from pdjax.pipeline.costs import costs_from_plan
from pdjax.pipeline.executor import Pipeline, even_stages
from pdjax.pipeline.schedules import STREAMING, generate
from pdjax.pipeline.simulate import PipelineCosts, Simulation, simulate
from pdjax.profile import Profile, profile
from pdjax.runners import DataParallel, Runner

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

#: The pipeline schedules :func:`bench` runs by default (data parallelism comes after).
BENCH_SCHEDULES = ("gpipe", "1f1b", "pipedream", "2bw", "interleaved", "zb-h1")
#: Runner variants: ``<schedule>/<variant>`` runs the schedule with replicated stages
#: all-reducing in every backward (``backward``, the runtime before per-device gradient
#: sums) or replicated round-robin (``rr``, PipeDream's replication).
VARIANTS = ("backward", "rr")


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One runner's measurements and the simulator's prediction.

    Attributes:
      name: the schedule, or ``"dp"``.
      stages: where the model ran, e.g. ``"4 stages x1"`` or ``"1 stage x4"``.
      samples_per_second: median over the repeats of the measured training throughput.
      predicted_samples_per_second: the simulator's throughput for the same schedule.
      host_seconds_per_action: median over the repeats of the driver's seconds per
        dispatched action (data parallelism: per step, its one jitted call).
      actions: actions dispatched per repeat.
      samples: training samples per repeat.
      repeats: the measured samples/s of each repeat, in order.
      note: how the row was run, when it differs from the others.
      error: why the row could not run (its numbers are then NaN).
      all_reduces_per_step: all-reduce operations in the compiled programs one optimizer
        step of ``M`` microbatches runs (counted by the runtime in one extra, untimed
        call: :attr:`~pdjax.pipeline.executor.RunMetrics.all_reduces`); NaN for data
        parallelism.
    """

    name: str
    stages: str
    samples_per_second: float
    predicted_samples_per_second: float
    host_seconds_per_action: float
    actions: int
    samples: int
    repeats: tuple[float, ...] = ()
    note: str = ""
    error: str | None = None
    all_reduces_per_step: float = math.nan

    @property
    def ratio(self) -> float:
        """Measured over predicted throughput (1.0: as the simulator said)."""
        if not self.predicted_samples_per_second > 0:
            return math.nan
        return self.samples_per_second / self.predicted_samples_per_second


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """What :func:`bench` returns.

    Attributes:
      model: the model's registry name.
      config: ``"tiny"`` or ``"paper"``.
      devices: devices used.
      batch_size: samples per optimizer step.
      microbatches: ``M``.
      steps: optimizer steps timed per repeat.
      repeats: timed rounds over all runners.
      plan: the plan's one-line description.
      profile_seconds: the profile's forward + backward seconds of one microbatch on one
        device (what the predictions are built from).
      cpu_cores: cores this process may run on.
      platform: the devices' platform (``"cpu"``, ``"gpu"``, ...).
      rows: one per schedule, then data parallelism.
      pool_concurrency: on in-process CPU devices, the work their shared thread pool gets
        through at once (:func:`pool_concurrency`; 1.0 elsewhere).
    """

    model: str
    config: str
    devices: int
    batch_size: int
    microbatches: int
    steps: int
    repeats: int
    plan: str
    profile_seconds: float
    cpu_cores: int
    platform: str
    rows: tuple[BenchRow, ...]
    pool_concurrency: float = 1.0

    def row(self, name: str) -> BenchRow:
        """The row called ``name`` (a schedule or ``"dp"``)."""
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (NaN becomes None); rows carry their ratio."""

        def clean(x: Any) -> Any:
            return None if isinstance(x, float) and not math.isfinite(x) else x

        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "rows"}
        out["rows"] = [
            {
                k: clean(v) if not isinstance(v, tuple) else [clean(x) for x in v]
                for k, v in {**dataclasses.asdict(r), "ratio": r.ratio}.items()
            }
            for r in self.rows
        ]
        return out

    def header(self) -> str:
        """What the numbers are, and what they cannot show on this machine."""
        lines = [
            f"{self.model} ({self.config}), batch {self.batch_size} = {self.microbatches} "
            f"microbatches of {self.batch_size // self.microbatches}, {self.devices} "
            f"{self.platform} devices, {self.cpu_cores} CPU cores; {self.steps} steps per "
            f"repeat, {self.repeats} repeats round-robin, medians",
            f"plan: {self.plan}",
            f"profile (device 0): {self.profile_seconds * 1e3:.3g} ms forward + backward per "
            "microbatch; predictions: the simulator on that profile and plan",
        ]
        if self.platform == "cpu":
            lines.append(
                "In-process CPU devices share one thread pool: the stages do not run in "
                "parallel, so no pipeline speedup is expected here (least of all on a "
                "2-core machine). Predicted: the larger of the simulator's makespan (one "
                "processor per device) and the devices' summed busy seconds over the "
                f"pool's measured concurrency ({self.pool_concurrency:.2f}: two devices "
                "computing together get through that much more than one); "
                "measured/predicted shows the machinery's overhead beyond the work."
            )
        return "\n".join(lines)


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
    devs = visible[:devices]
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
    base = _plan(plan, prof, topology, len(spec.layers), devices, microbatches, b, straight)
    optimizer = optax.adam(learning_rate)
    runners: list[_Runner] = []
    rows: dict[str, BenchRow] = {}
    for name in schedules:
        if on_row is not None:
            on_row(name)
        try:
            if name == "dp":
                runner = _dp_runner(
                    spec, prof, topology, devs, optimizer, x, y, seed, steps, concurrency
                )
            else:
                runner = _pipeline_runner(
                    name,
                    spec,
                    prof,
                    base,
                    chunks,
                    optimizer,
                    x,
                    y,
                    microbatches,
                    seed,
                    steps,
                    concurrency,
                )
            runner.call()  # compile (and the first transfers); refusals come before work
        except PdjaxError as e:
            rows[name] = BenchRow(name, "-", math.nan, math.nan, math.nan, 0, 0, error=str(e))
            continue
        runners.append(runner)
    measured: dict[str, list[tuple[float, float]]] = {r.name: [] for r in runners}
    for _ in range(repeats):
        for runner in runners:
            measured[runner.name].append(runner.call())
    for runner in runners:
        sps = [runner.samples / seconds for seconds, _ in measured[runner.name]]
        all_reduces = runner.count() if runner.count is not None else math.nan
        rows[runner.name] = BenchRow(
            name=runner.name,
            stages=runner.stages,
            samples_per_second=statistics.median(sps),
            predicted_samples_per_second=runner.samples / runner.predicted_seconds,
            host_seconds_per_action=statistics.median(h for _, h in measured[runner.name]),
            actions=runner.actions,
            samples=runner.samples,
            repeats=tuple(sps),
            note=runner.note,
            all_reduces_per_step=all_reduces,
        )
    return BenchResult(
        model=model,
        config=config,
        devices=devices,
        batch_size=batch_size,
        microbatches=microbatches,
        steps=steps,
        repeats=repeats,
        plan=base.describe().splitlines()[0] + f" ({base.partitioner})",
        profile_seconds=float(np.sum(prof.forward_seconds()) + np.sum(prof.backward_seconds())),
        cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0,
        platform=str(devs[0].platform),
        rows=tuple(rows[name] for name in schedules),
        pool_concurrency=concurrency,
    )


def _plan(
    plan: str,
    prof: Profile,
    topology: Topology,
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


def _pipeline_runner(
    name: str,
    spec: ModelSpec,
    prof: Profile,
    plan: Plan,
    chunks: int,
    optimizer: optax.GradientTransformation,
    x: Any,
    y: Any,
    microbatches: int,
    seed: int,
    steps: int,
    concurrency: float,
) -> _Runner:
    L = len(spec.layers)
    note = ""
    runner_name, name = name, name.partition("/")[0]
    variant = runner_name.partition("/")[2]
    if name == "interleaved":
        G, K = plan.num_stages, plan.num_stages * chunks
        if K > L:
            raise PipelineError(
                f"interleaved needs {G} x {chunks} = {K} virtual stages, {spec.name} has only "
                f"{L} layers; use --chunks 1 or a plan with fewer stages"
            )
        # hand-written stages name devices by index into jax.devices(); the plan's are ids
        index = {int(d.id): i for i, d in enumerate(jax.devices())}
        ids = plan.topology.device_ids is not None

        def where(devs: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(index[d] for d in devs) if ids else devs

        specs: Any = tuple(
            StagePlan(s.first_layer, s.last_layer, where(plan.stages[k % G].devices))
            for k, s in enumerate(even_stages(L, K))
        )
        costs = _virtual_costs(prof, plan, specs, microbatches)
        stages = f"{_describe(plan.replicas)}, {chunks} chunks each"
        note = f"{K} equal virtual stages"
    else:
        specs = plan  # the plan itself: its device ids are looked up by id
        costs = costs_from_plan(plan, prof)
        stages = _describe(plan.replicas)
    pipe = Pipeline(
        spec.layers,
        specs,
        spec.loss,
        optimizer,
        schedule=name,
        microbatches=microbatches,
        chunks=chunks if name == "interleaved" else 1,
        devices=jax.devices(),
        grad_allreduce="backward" if variant == "backward" else "update",
        replication="round-robin" if variant == "rr" else "split",
    )
    if variant:
        how = {"rr": "round-robin replication", "backward": "all-reduce in every backward"}
        note = "; ".join(filter(None, [note, how[variant]]))
    batch = pipe.split_batch((x, y))
    if name in STREAMING:
        calls, stream = 1, batch * steps
        note = note or f"one stream of {len(stream)}"
    else:
        calls, stream = steps, batch
    sched = pipe.schedule(len(stream))  # fails here, before compiling, if it cannot run
    used = list(dict.fromkeys(d for st in pipe.stages for d in st.devices))
    predicted = _predicted(simulate(sched, costs), used, concurrency) * calls
    call = _Calls(pipe, pipe.init(jax.random.key(seed), batch[0][0]), stream, calls)
    # the runtime runs a replicated stage's programs one at a time on CPU (pdjax._xla_cpu)
    if any(pipe.workarounds.one_at_a_time):
        note = "; ".join(filter(None, [note, "synchronous (replicated stage, CPU)"]))

    def count() -> float:
        """All-reduces per optimizer step (M microbatches), from the runtime's counters."""
        call.state, metrics = pipe.run(call.state, stream, collectives=True)
        return sum((metrics.all_reduces or {}).values()) * microbatches / len(stream)

    samples = calls * len(stream) * (len(jax.tree.leaves(x)[0]) // microbatches)
    actions = calls * sum(len(group) for group in sched.actions)
    return _Runner(runner_name, stages, samples, actions, predicted, note, call, count)


def _virtual_costs(
    prof: Profile, plan: Plan, specs: Sequence[StagePlan], microbatches: int
) -> PipelineCosts:
    """Simulator costs of interleaved virtual stages: each priced as a stage of its own on
    its group's replica count, every link at the plan's slowest bandwidth."""
    bandwidth = min(level.bandwidth for level in plan.topology.levels)
    replicas = [len(s.devices) for s in specs]
    virtual = evaluate_partition(
        prof,
        Topology.flat(sum(replicas), bandwidth),
        [(s.first_layer, s.last_layer, r) for s, r in zip(specs, replicas, strict=True)],
        schedule="interleaved",
        num_microbatches=microbatches,
        microbatch_size=plan.microbatch_size,
        partitioner="uniform",
    )
    return costs_from_plan(virtual, prof)


def _shared_pool(devices: Sequence[jax.Device]) -> bool:
    """Whether the devices are in-process CPU devices, which share one thread pool."""
    return len(devices) > 1 and all(d.platform == "cpu" for d in devices)


def _predicted(sim: Simulation, devices: Sequence[jax.Device], concurrency: float) -> float:
    """Seconds the simulation predicts for one call: its makespan, or on in-process CPU
    devices (one shared thread pool, whose every program the profile timed with the whole
    pool) the larger of that and the devices' summed busy seconds over the pool's measured
    ``concurrency`` (:func:`pool_concurrency`)."""
    if not _shared_pool(devices):
        return sim.makespan
    replicas = sim.schedule.replicas
    work = math.fsum((sp.end - sp.start) * replicas[sp.group] for sp in sim.timeline.spans)
    return max(sim.makespan, work / concurrency)


def pool_concurrency(
    spec: ModelSpec, sample: tuple[Any, Any], devices: Sequence[jax.Device], rounds: int = 30
) -> float:
    """How much work in-process CPU devices get through at once: the seconds of ``2 n``
    forward-backward passes of the whole model on one device, over the seconds of ``n`` on
    each of two devices dispatched together (1.0: programs run one at a time; up to the
    cores). 1.0 where the devices do not share a pool."""
    if not _shared_pool(devices):
        return 1.0
    x, y = sample
    params = jax.jit(spec.layers.init)(jax.random.key(0), x)

    def loss(v: Any, x: Any, y: Any) -> Any:
        return spec.loss(spec.layers.apply(v, x, train=False)[0], y)

    step = jax.jit(jax.grad(loss))
    args = [jax.device_put((params, x, y), d) for d in devices[:2]]

    def timed(plan: Sequence[int]) -> float:
        jax.block_until_ready([step(*args[d]) for d in (0, 1)])  # compiled, warm
        t0 = time.perf_counter()
        jax.block_until_ready([step(*args[d]) for d in plan])
        return time.perf_counter() - t0

    serial = statistics.median(timed([0] * (2 * rounds)) for _ in range(5))
    together = statistics.median(timed([0, 1] * rounds) for _ in range(5))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
    return min(max(serial / together, 1.0), float(cores))


def driver_seconds_per_action(devices: Sequence[jax.Device], seed: int = 0) -> float:
    """The driver's host seconds per dispatched action where compute is next to nothing:
    8 dense layers of width 16 as one stage per device (at most 8), ``1f1b`` with
    ``M = 16``; the median of ``RunMetrics.host_seconds / actions`` over 5 calls after a
    warm-up."""
    import flax.linen as nn

    from pdjax.layers import sequential

    width, n = 16, max(1, min(8, len(devices)))
    layers = sequential([nn.Dense(width) for _ in range(8)])
    x = np.zeros((64, width), np.float32)

    def loss(out: Any, y: Any) -> Any:
        return ((out - y) ** 2).mean()

    pipe = Pipeline(
        layers,
        tuple(
            StagePlan(st.first_layer, st.last_layer, (i,)) for i, st in enumerate(even_stages(8, n))
        ),
        loss,
        optax.sgd(1e-3),
        schedule="1f1b",
        microbatches=16,
        devices=list(devices),
    )
    batch = pipe.split_batch((x, x))
    state = pipe.init(jax.random.key(seed), batch[0][0])
    out = []
    for k in range(6):
        state, metrics = pipe.run(state, batch)
        jax.block_until_ready(state)
        if k:
            out.append(metrics.host_seconds / metrics.actions)
    return statistics.median(out)


def host_costs(spec: ModelSpec, sample: tuple[Any, Any], devices: Sequence[jax.Device]) -> Any:
    """:class:`pdjax.partition.HostCosts` measured on ``devices``: the driver's seconds per
    action, and for in-process CPU devices the shared pool's concurrency on ``spec``'s
    forward-backward over ``sample`` (:func:`pool_concurrency`)."""
    from pdjax.partition import HostCosts

    concurrency = pool_concurrency(spec, sample, devices) if _shared_pool(devices) else None
    return HostCosts(driver_seconds_per_action(devices), concurrency)


def _dp_runner(
    spec: ModelSpec,
    prof: Profile,
    topology: Topology,
    devs: Sequence[jax.Device],
    optimizer: optax.GradientTransformation,
    x: Any,
    y: Any,
    seed: int,
    steps: int,
    concurrency: float,
) -> _Runner:
    n = len(devs)
    batch_size = len(jax.tree.leaves(x)[0])
    if batch_size % n:
        raise PipelineError(
            f"data parallelism shards the batch of {batch_size} over {n} devices; use a "
            f"batch size that is a multiple of {n}"
        )
    # A plan with one stage on every device is data parallelism; its microbatch is the batch.
    plan = evaluate_partition(
        prof,
        topology,
        [(0, len(spec.layers) - 1, n)],
        schedule="1f1b",
        num_microbatches=1,
        microbatch_size=batch_size,
        partitioner="uniform",
    )
    sched = generate("1f1b", 1, 1, replicas=(n,))
    predicted = _predicted(simulate(sched, costs_from_plan(plan, prof)), devs, concurrency) * steps
    dp = DataParallel(spec.layers, spec.loss, optimizer, devices=devs)
    call = _Calls(dp, dp.init(jax.random.key(seed), x), [(x, y)] * steps, 1)  # a step a batch
    return _Runner("dp", f"1 stage x{n}", steps * batch_size, steps, predicted, "", call)


def format_table(result: BenchResult) -> Any:
    """The result as a :class:`rich.table.Table` (print it with a rich ``Console``)."""
    from rich.table import Table

    table = Table(title="measured vs simulated throughput")
    for header, justify in [
        ("schedule", "left"),
        ("stages", "left"),
        ("measured samples/s", "right"),
        ("predicted samples/s", "right"),
        ("measured / predicted", "right"),
        ("host us / action", "right"),
        ("all-reduces / step", "right"),
        ("actions", "right"),
        ("note", "left"),
    ]:
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for r in result.rows:
        if r.error is not None:
            table.add_row(r.name, r.stages, "-", "-", "-", "-", "-", "-", f"not run: {r.error}")
            continue
        table.add_row(
            r.name,
            r.stages,
            f"{r.samples_per_second:,.0f}",
            f"{r.predicted_samples_per_second:,.0f}",
            f"{r.ratio:.2f}",
            f"{r.host_seconds_per_action * 1e6:,.0f}",
            "-" if math.isnan(r.all_reduces_per_step) else f"{r.all_reduces_per_step:g}",
            str(r.actions),
            r.note,
        )
    return table
