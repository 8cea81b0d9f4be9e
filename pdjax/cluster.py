"""A cluster on one machine: PipeDream against data parallelism with real workers and links.

Each *worker* is a process of its own, pinned to one core (``taskset``) with one CPU device
and XLA's intra-op threading off, so that it computes alone, as one accelerator would.
Workers join with ``jax.distributed``: pipeline activations and gradients cross between
them with ``jax.device_put`` (:class:`~pdjax.pipeline.Pipeline`), the data-parallel
gradient all-reduce with JAX's CPU collectives (gloo over TCP). With root and ``tc``, every
worker runs in a network namespace of its own on a link of known bandwidth
(:class:`~pdjax.netem.EmulatedNetwork`: veth pairs through a bridge, a token bucket each
way), so those transfers cross that link; without, the workers share loopback and the
report says so.

:func:`run_cluster` runs, side by side:

- (a) a compute-bound model (``mlp-512``: 8 dense layers of 512, 8 MB of weights that
  stay in the shared L3 cache, microbatches of 128) on a fast link: a 2-stage
  ``pipedream`` and ``1f1b`` pipeline (and 2-worker DP) against one worker alone;
- (b) a parameter-heavy VGG-style model (``vgg-fc``: a narrow VGG-16 front, then a
  2048 x 2048 fully connected layer, 18 MB of weights) over links of several bandwidths:
  ``pipedream`` against 2-worker data parallelism, and one worker alone;
- (c) for every run, the measured seconds per microbatch next to the planner's prediction
  (:func:`~pdjax.partition.evaluate_partition`: the slowest stage or link) and the
  simulator's (:func:`~pdjax.pipeline.simulate` of exactly the schedule that ran), both
  from per-layer costs measured on one pinned worker (forward, backward and the optimizer
  update) and the configured link;
- (d) per link, the planner's choice (:func:`~pdjax.partition.plan_pipedream`: pipeline,
  data parallel, or fewer workers) against the measured best of the runs.

What one microbatch is: :data:`MICROBATCH` samples (128 for ``mlp-512``, 32 for
``vgg-fc``). One worker trains on batches of that size; a pipeline streams microbatches of
that size (``pipedream``: an update per microbatch; ``1f1b``: ``M = 4`` per update); data
parallelism gives each worker that many samples per step, so a step is 2 microbatches.
Every number is seconds per microbatch (or samples per second), the median of ``repeats``
rounds that go round-robin over the runners of one launch, after a warm-up round that
compiles.

Link rates are for Ethernet frames; TCP payload gets 1448/1514 of them, and the predictions
use that payload rate.

Run it with ``pdjax bench --cluster`` or ``python benchmarks/cluster/run.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pdjax.errors import PdjaxError

__all__ = [
    "CLUSTER_MODELS",
    "ClusterError",
    "ClusterResult",
    "Row",
    "cluster_model",
    "format_markdown",
    "plot_cluster",
    "run_cluster",
    "write_results",
]

#: Samples per microbatch of each benchmark model.
MICROBATCH = {"mlp-512": 128, "vgg-fc": 32}
#: XLA flags for a worker that computes on one core.
_ONE_CORE = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
#: TCP payload per Ethernet frame of a 1500-byte MTU (what a shaped link's rate buys).
PAYLOAD = 1448 / 1514
LAUNCH_TIMEOUT = 300.0  # seconds for one launch of the workers

#: The benchmark's models: ``name -> (family, overrides)`` for :func:`pdjax.models.get_model`.
CLUSTER_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp-512": ("mlp", {"in_features": 512, "hidden": (512,) * 8}),
    # next to no compute: what a microbatch costs the machinery itself (tests, diagnosis)
    "mlp-narrow": ("mlp", {"in_features": 16, "hidden": (16,) * 8}),
    "vgg-fc": (
        "vgg16",
        {
            "image_size": 32,
            "stages": ((16,), (32,), (64, 64), (64, 64), (64, 64)),
            "hidden": 2048,
        },
    ),
}


class ClusterError(PdjaxError):
    """The cluster benchmark could not run (a worker failed or ran out of time)."""


def cluster_model(name: str) -> Any:
    """The :class:`~pdjax.models.ModelSpec` of a benchmark model (tiny config + overrides)."""
    from pdjax.models import get_model

    if name not in CLUSTER_MODELS:
        raise ClusterError(f"unknown cluster model {name!r}; choose one of {list(CLUSTER_MODELS)}")
    family, overrides = CLUSTER_MODELS[name]
    return get_model(family, "tiny", **overrides)


# -- inside a worker ----------------------------------------------------------------------------


def _optimizer() -> Any:
    import optax

    return optax.sgd(1e-3)


def _profile_job(job: Mapping[str, Any]) -> None:
    """One pinned process: per-layer forward/backward seconds and optimizer-update seconds."""
    import jax
    import numpy as np

    from pdjax.profile.xla import profile

    spec = cluster_model(job["model"])
    b = job["microbatch"]
    x, _ = jax.tree.map(np.asarray, spec.sample_batch(b, job["seed"]))
    prof = profile(spec.layers, x, measure=True, repeats=job.get("repeats", 7))
    opt = _optimizer()
    variables = jax.jit(spec.layers.init)(jax.random.key(0), x)
    updates = []
    for v in variables:
        params = v.get("params", {})
        if not jax.tree.leaves(params):
            updates.append(0.0)
            continue
        state = opt.init(params)

        def step(p, s, g):
            import optax

            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        fn = jax.jit(step, donate_argnums=(0, 1))
        grads = jax.tree.map(lambda a: a * 0.5, params)
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            params, state = jax.block_until_ready(fn(params, state, grads))
            times.append(time.perf_counter() - t0)
        updates.append(statistics.median(times[2:]))
    Path(job["out"]).write_text(json.dumps({"profile": prof.to_json(), "updates": updates}))


def _worker_job(job: Mapping[str, Any]) -> None:
    """Every process of a launch: builds the runners, warms them up, times them round-robin;
    process 0 writes ``{runner: [seconds per timed call]}``."""
    from pdjax.distributed import allgather_json, config_from_env, initialize

    config = config_from_env()
    if config is not None and config.num_processes > 1:
        initialize(config)
    import jax

    runners = [_make_runner(job, r) for r in job["runners"]]
    for _ in range(2):  # compile, first transfers; the first call after is slow still
        for name, call in runners:
            allgather_json(name)  # every process done with the runner before
            call()
    times: dict[str, list[float]] = {name: [] for name, _ in runners}
    for _ in range(job["repeats"]):
        for name, call in runners:
            allgather_json(name)  # start together
            times[name].append(call())
    if jax.process_index() == 0:
        Path(job["out"]).write_text(json.dumps(times))


def _make_runner(job: Mapping[str, Any], r: Mapping[str, Any]) -> tuple[str, Callable[[], float]]:
    """``(name, call)``: ``call()`` trains ``r["units"]`` microbatches' worth and returns the
    seconds it took on this process (to the last result it holds)."""
    import jax
    import numpy as np

    from pdjax._sharding import held
    from pdjax.baselines import DataParallel
    from pdjax.pipeline.executor import Pipeline, StageSpec

    spec = cluster_model(job["model"])
    b, seed, name = job["microbatch"], job["seed"], r["name"]
    label = r.get("label", name)
    units = r["units"]
    opt = _optimizer()
    if name == "allreduce":  # the data-parallel gradient all-reduce alone, ``units`` times
        return label, _allreduce_runner(spec, b, units)
    if name in ("single", "dp"):
        devices = jax.devices()[:1] if name == "single" else jax.devices()
        n = b * len(devices)
        steps = units // len(devices)
        x, y = jax.tree.map(np.asarray, spec.sample_batch(n, seed))
        dp = DataParallel(spec.layers, spec.loss, opt, devices=devices)
        state = dp.init(jax.random.key(seed), x)

        def call() -> float:
            nonlocal state
            t0 = time.perf_counter()
            for _ in range(steps):
                state, _ = dp.step(state, (x, y))
            jax.block_until_ready(state)
            return time.perf_counter() - t0

        return label, call
    M = r.get("microbatches", 1)
    stages = [StageSpec(f, last, (i,)) for i, (f, last) in enumerate(r["stages"])]
    pipe = Pipeline(
        spec.layers,
        stages,
        spec.loss,
        opt,
        schedule=name,
        microbatches=M,
        devices=jax.devices(),
        extra_in_flight=r.get("extra", 0),
        transport=r.get("transport", "auto"),
    )
    x, y = jax.tree.map(np.asarray, spec.sample_batch(b * units, seed))
    mbs = [jax.tree.map(lambda a, k=k: a[k * b : (k + 1) * b], (x, y)) for k in range(units)]
    state = pipe.init(jax.random.key(seed), mbs[0][0])
    calls = [mbs] if name == "pipedream" else [mbs[k : k + M] for k in range(0, units, M)]

    def call() -> float:
        nonlocal state
        t0 = time.perf_counter()
        for chunk in calls:
            state, _ = pipe.run(state, chunk)
        jax.block_until_ready([a for a in jax.tree.leaves(state) if held(a)])
        return time.perf_counter() - t0

    return label, call


def _allreduce_runner(spec: Any, microbatch: int, units: int) -> Callable[[], float]:
    """Sums a gradient-shaped tree over every device, as a data-parallel step's all-reduce
    does (a program of its own, one all-reduce per array, through JAX's collectives)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    x, _ = spec.sample_batch(microbatch, 0)
    shapes = jax.eval_shape(spec.layers.init, jax.random.key(0), x)
    grads = [v.get("params", {}) for v in shapes]
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    n = len(jax.devices())
    sharded = NamedSharding(mesh, P("data"))

    def place(leaf: Any) -> jax.Array:
        shape = (n, *leaf.shape)
        return jax.make_array_from_callback(
            shape, sharded, lambda index: np.ones(shape, leaf.dtype)[index]
        )

    tree = jax.tree.map(place, grads)
    total = jax.jit(
        lambda t: jax.tree.map(lambda a: jnp.sum(a, axis=0), t),
        out_shardings=NamedSharding(mesh, P()),
    )

    def call() -> float:
        t0 = time.perf_counter()
        for _ in range(units):
            jax.block_until_ready(total(tree))
        return time.perf_counter() - t0

    return call


# -- the driver ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured run and its predictions (seconds per microbatch).

    Attributes:
      experiment: ``"a"`` or ``"b"``.
      model: a :data:`CLUSTER_MODELS` name.
      link_mbit: the link's configured rate (Mbit/s), or None for unshaped loopback.
      runner: ``single``, ``dp``, ``pipedream``, ``pipedream+1`` (one more microbatch in
        flight at the first stage: latency hiding), ``.../coll`` (transfers through a gloo
        collective instead of ``jax.device_put``) or ``1f1b``.
      stages: the layout (``"1 worker"``, ``"DP x2"``, ``"0-6 | 7-15"``).
      measured: median seconds per microbatch.
      planner: the planner's steady-state prediction (no fill/drain, no update).
      simulated: the simulator's prediction for the schedule that ran (fill, drain and the
        measured update time included).
      speedup: measured throughput over one worker's (same model).
      predicted_speedup: simulated, over one worker's simulated.
      repeats: every measured seconds per microbatch.
      allreduce: ``dp``: measured seconds of the gradient all-reduce alone (the same
        arrays summed over the 2 workers with JAX's collectives, in a program of its own).
      allreduce_predicted: ``dp``: the ring all-reduce the simulator assumes, on the link.
    """

    experiment: str
    model: str
    link_mbit: float | None
    runner: str
    stages: str
    measured: float
    planner: float
    simulated: float
    speedup: float = math.nan
    predicted_speedup: float = math.nan
    repeats: tuple[float, ...] = ()
    allreduce: float = math.nan
    allreduce_predicted: float = math.nan


@dataclasses.dataclass(frozen=True)
class ClusterResult:
    """What :func:`run_cluster` measured and predicted.

    Attributes:
      rows: every run.
      choices: per (model, link): the planner's choice, the measured best runner, and the
        planner's predicted and the measured seconds per microbatch of both.
      network: how the workers were connected (one line).
      curves: predicted speedup over one worker per bandwidth (Mbit/s) for the plot:
        ``{model: {runner: [(mbit, simulated speedup, planner speedup), ...]}}``.
      microbatch: samples per microbatch, per model.
      seconds: the benchmark's wall time.
    """

    rows: tuple[Row, ...]
    choices: tuple[dict[str, Any], ...]
    network: str
    curves: dict[str, dict[str, list[tuple[float, float, float]]]]
    microbatch: dict[str, int]
    seconds: float

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


def _python_env(extra: Mapping[str, str]) -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {_ONE_CORE}".strip(),
        "PDJAX_CPU_DEVICES": "1",
        "PDJAX_HEARTBEAT_TIMEOUT": "20",
        **extra,
    }


def _run_processes(
    commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], what: str
) -> None:
    """Runs the processes together, bounded by :data:`LAUNCH_TIMEOUT`; ends them all when
    one fails; raises :class:`ClusterError` with the failing one's output."""
    logs = [tempfile.TemporaryFile() for _ in commands]
    procs = [
        subprocess.Popen(list(c), env=dict(e), stdout=log, stderr=log, start_new_session=True)
        for c, e, log in zip(commands, envs, logs, strict=True)
    ]
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = (bad[0], f"exit {codes[bad[0]]}")
                break
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                failed = (codes.index(None), f"still running after {LAUNCH_TIMEOUT:.0f} s")
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if failed is not None:
            i, why = failed
            logs[i].seek(0)
            tail = logs[i].read().decode(errors="replace")[-4000:]
        for log in logs:
            log.close()
    raise ClusterError(f"{what}: worker {i} failed ({why}):\n{tail}")


def _profile(model: str, microbatch: int, seed: int, workdir: Path) -> tuple[Any, list[float]]:
    from pdjax.profile import Profile

    out = workdir / f"profile-{model}.json"
    job = {"model": model, "microbatch": microbatch, "seed": seed, "out": str(out)}
    _run_processes(
        [["taskset", "-c", "0", sys.executable, "-m", "pdjax.cluster", "profile", json.dumps(job)]],
        [_python_env({})],
        f"profiling {model}",
    )
    data = json.loads(out.read_text())
    return Profile.from_json(data["profile"]), data["updates"]


def _launch(
    job: dict[str, Any], workers: int, rate_mbit: float | None, emulate: bool, workdir: Path
) -> dict[str, list[float]]:
    """One launch: ``workers`` pinned processes (on an emulated network when ``emulate``)."""
    from pdjax.distributed import free_port
    from pdjax.netem import EmulatedNetwork

    out = workdir / f"run-{time.monotonic_ns()}.json"
    job = {**job, "out": str(out)}
    argv = [sys.executable, "-m", "pdjax.cluster", "worker", json.dumps(job)]
    cores = os.cpu_count() or 1

    def pinned(i: int) -> list[str]:
        return ["taskset", "-c", str(i % cores), *argv]

    if workers == 1:
        _run_processes([pinned(0)], [_python_env({})], f"{job['model']} alone")
        return json.loads(out.read_text())
    what = f"{job['model']} on {workers} workers"
    if emulate:
        with EmulatedNetwork(workers, rate_mbit) as net:
            port = 47000
            envs = [
                _python_env(
                    {
                        "PDJAX_COORDINATOR": f"{net.addresses[0]}:{port}",
                        "PDJAX_NUM_PROCESSES": str(workers),
                        "PDJAX_PROCESS_ID": str(i),
                        "PDJAX_TRANSFER_HOST": net.addresses[i],
                    }
                )
                for i in range(workers)
            ]
            _run_processes([net.command(i, pinned(i)) for i in range(workers)], envs, what)
    else:
        port = free_port()
        envs = [
            _python_env(
                {
                    "PDJAX_COORDINATOR": f"127.0.0.1:{port}",
                    "PDJAX_NUM_PROCESSES": str(workers),
                    "PDJAX_PROCESS_ID": str(i),
                }
            )
            for i in range(workers)
        ]
        _run_processes([pinned(i) for i in range(workers)], envs, what)
    return json.loads(out.read_text())


def _bandwidth(rate_mbit: float | None) -> float:
    """Bytes/s of TCP payload on a link of ``rate_mbit`` (None: loopback, taken as 2 GB/s,
    what unshaped veth measured here)."""
    return 2e9 if rate_mbit is None else rate_mbit * 1e6 / 8 * PAYLOAD


def _stage_costs(prof: Any, updates: Sequence[float], plan: Any) -> Any:
    """The simulator's costs for ``plan``, with each stage's measured update seconds."""
    from pdjax.pipeline.costs import costs_from_plan

    costs = costs_from_plan(plan, prof)
    stages = tuple(
        dataclasses.replace(st, update=float(sum(updates[s.first_layer : s.last_layer + 1])))
        for st, s in zip(costs.stages, plan.stages, strict=True)
    )
    return dataclasses.replace(costs, stages=stages)


def _predict(
    prof: Any,
    updates: Sequence[float],
    rate_mbit: float | None,
    runner: str,
    stages: Sequence[tuple[int, int]],
    units: int,
    microbatch: int,
    microbatches: int,
    extra: int = 0,
) -> tuple[float, float]:
    """``(planner, simulator)`` seconds per microbatch of one run (``extra``: pipedream's
    extra microbatches in flight)."""
    from pdjax.partition import Topology, evaluate_partition
    from pdjax.pipeline.schedule import generate
    from pdjax.pipeline.simulate import simulate

    L = len(prof.layers)
    bw = _bandwidth(rate_mbit)
    common = {"microbatch_size": microbatch, "partitioner": "manual"}
    if runner in ("single", "dp"):
        # one stage on r workers, each taking a microbatch per step: the plan's microbatch
        # is the step's r microbatches (pdjax's cost model splits it over the replicas)
        r = 1 if runner == "single" else 2
        plan = evaluate_partition(
            prof,
            Topology.flat(r, bw),
            [(0, L - 1, r)],
            schedule="1f1b",
            num_microbatches=1,
            microbatch_size=r * microbatch,
            partitioner="manual",
        )
        sched = generate("1f1b", 1, 1, steps=units // r, replicas=(r,))
        sim = simulate(sched, _stage_costs(prof, updates, plan)).makespan / units
        return plan.time_per_microbatch / r, sim
    plan = evaluate_partition(
        prof,
        Topology.flat(len(stages), bw),
        [(f, last, 1) for f, last in stages],
        schedule=runner,
        num_microbatches=microbatches,
        **common,
    )
    if runner == "pipedream":
        sched = generate("pipedream", len(stages), units, extra_in_flight=extra)
    else:
        sched = generate(runner, len(stages), microbatches, steps=units // microbatches)
    sim = simulate(sched, _stage_costs(prof, updates, plan)).makespan / units
    return plan.time_per_microbatch, sim


def _describe_plan(plan: Any) -> tuple[str, str]:
    """``(runner, layout)`` of a planner's choice on 2 workers."""
    if len(plan.stages) == 1:
        return ("dp", "DP x2") if plan.stages[0].replicas == 2 else ("single", "1 worker")
    if all(s.replicas == 1 for s in plan.stages):
        return "pipedream", " / ".join(f"{s.first_layer}-{s.last_layer}" for s in plan.stages)
    return "hybrid", plan.describe().splitlines()[0]


def run_cluster(
    *,
    rates_mbit: Sequence[float] = (100.0, 1000.0, 10000.0),
    fast_mbit: float = 10000.0,
    microbatch: Mapping[str, int] | None = None,
    units: int = 24,
    dp_units: Mapping[float, int] | None = None,
    repeats: int = 3,
    seed: int = 0,
    emulate: bool | None = None,
    workdir: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> ClusterResult:
    """Runs experiments (a)-(d) of the module doc on 2 pinned workers.

    Args:
      rates_mbit: link rates (Mbit/s each way) for experiment (b).
      fast_mbit: the fast link of experiment (a).
      microbatch: samples per microbatch, per model (default :data:`MICROBATCH`).
      units: microbatches per timed call (a ``pipedream`` stream, ``1f1b`` steps of 4,
        one worker's steps); data parallelism does ``units / 2`` steps of 2 microbatches.
      dp_units: per rate, fewer microbatches for data parallelism (its steps are long on
        slow links); default: 8 below 1 Gbit/s.
      repeats: timed rounds per launch (medians).
      seed: synthetic data and initialisation.
      emulate: use an emulated network (None: when :func:`~pdjax.netem.network_support`
        allows; False: loopback, one rate only).
      workdir: where the workers' files go (default: a temporary directory).
      log: progress lines.

    Raises:
      ClusterError: a worker failed, or ``emulate=True`` where it cannot be.
    """
    from pdjax.netem import network_support
    from pdjax.partition import Topology, plan_pipedream

    t_start = time.monotonic()
    reason = network_support()
    if emulate and reason:
        raise ClusterError(f"cannot emulate a network here: {reason}")
    emulate = reason is None if emulate is None else emulate
    if emulate:
        network = "2 workers, each in its own network namespace on a veth link through a bridge"
        rates: list[float | None] = list(rates_mbit)
        fast: float | None = fast_mbit
    else:
        why = reason or "emulate=False"
        network = f"2 workers on loopback ({why}): no link emulation, one unshaped link"
        rates, fast = [None], None
    cores = os.cpu_count() or 1
    if cores < 2:
        network += f"; only {cores} core: the workers share it"
    dp_units = dict(dp_units or {})
    sizes = {**MICROBATCH, **(microbatch or {})}
    M = 4
    rows: list[Row] = []
    choices: list[dict[str, Any]] = []
    curves: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for experiment, model, links in [("a", "mlp-512", [fast]), ("b", "vgg-fc", rates)]:
            microbatch = sizes[model]
            log(f"({experiment}) {model}: profiling one pinned worker")
            prof, updates = _profile(model, microbatch, seed, work)
            base = {"model": model, "microbatch": microbatch, "seed": seed, "repeats": repeats}
            log(f"({experiment}) {model}: one worker alone")
            L = len(prof.layers)
            one = [  # one jitted step, and a one-stage pipeline: the faster is the baseline
                {"name": "single", "units": units},
                {"name": "pipedream", "label": "single-pipe", "units": units,
                 "stages": [(0, L - 1)]},
            ]  # fmt: skip
            alone = _launch({**base, "runners": one}, 1, None, False, work)
            times = {k: statistics.median(v) / units for k, v in alone.items()}
            single = min(times.values())
            p_single, s_single = _predict(prof, updates, fast, "single", [], units, microbatch, M)
            for k, how in [("single", "1 worker, one jit"), ("single-pipe", "1 worker, 1 stage")]:
                rows.append(
                    Row(experiment, model, None, k, how, times[k], p_single, s_single,
                        single / times[k], 1.0, tuple(t / units for t in alone[k]))
                )  # fmt: skip
            for rate in links:
                topo = Topology.flat(2, _bandwidth(rate))
                straight = plan_pipedream(prof, topo, straight=True, microbatch_size=microbatch)
                split = [(s.first_layer, s.last_layer) for s in straight.stages]
                layout = " / ".join(f"{f}-{last}" for f, last in split)
                dpu = dp_units.get(rate, 8 if rate is not None and rate < 1000 else units)
                runners = [
                    {"name": "pipedream", "units": units, "stages": split},
                    {"name": "dp", "units": dpu},
                    {"name": "allreduce", "units": max(1, dpu // 4)},
                ]
                if experiment == "a":
                    runners.insert(1, {"name": "1f1b", "units": units, "stages": split,
                                       "microbatches": M})  # fmt: skip
                    # latency hiding: one more microbatch in flight at stage 0
                    runners.insert(1, {"name": "pipedream", "label": "pipedream+1", "extra": 1,
                                       "units": units, "stages": split})  # fmt: skip
                    # the other transport: a gloo collective per transfer, not device_put
                    runners.insert(1, {"name": "pipedream", "label": "pipedream/coll",
                                       "transport": "collective", "units": units,
                                       "stages": split})  # fmt: skip
                    runners.insert(1, {"name": "pipedream", "label": "pipedream+1/coll",
                                       "transport": "collective", "extra": 1, "units": units,
                                       "stages": split})  # fmt: skip
                where = "loopback" if rate is None else f"{rate:g} Mbit/s"
                log(f"({experiment}) {model}: {', '.join(r['name'] for r in runners)} on {where}")
                got = _launch({**base, "runners": runners}, 2, rate, emulate, work)
                measured: dict[str, float] = {}
                ring = sum(lp.param_bytes for lp in prof.layers) / _bandwidth(rate)
                allreduce = statistics.median(got["allreduce"]) / runners[-1]["units"]
                for r in runners[:-1]:
                    n = r["units"]
                    label = r.get("label", r["name"])
                    t = statistics.median(got[label]) / n
                    measured[label] = t
                    p, s = _predict(
                        prof,
                        updates,
                        rate,
                        r["name"],
                        r.get("stages", []),
                        n,
                        microbatch,
                        M,
                        r.get("extra", 0),
                    )
                    rows.append(
                        Row(
                            experiment,
                            model,
                            rate,
                            label,
                            "DP x2" if r["name"] == "dp" else layout,
                            t,
                            p,
                            s,
                            single / t,
                            s_single / s,
                            tuple(x / n for x in got[label]),
                            *((allreduce, ring) if r["name"] == "dp" else ()),
                        )
                    )
                chosen = plan_pipedream(prof, topo, fewer_machines=True, microbatch_size=microbatch)
                runner, how = _describe_plan(chosen)
                best = min(measured, key=measured.__getitem__)
                best_kind = best.split("+")[0].split("/")[0]  # pipedream+1/coll: pipedream
                choices.append(
                    {
                        "model": model,
                        "link_mbit": rate,
                        "planner": runner,
                        "planner_layout": how,
                        "planner_seconds": chosen.time_per_microbatch,
                        "measured_best": best,
                        "measured_best_seconds": measured[best],
                        "measured_of_choice": measured.get(runner),
                        "agree": runner == best_kind,
                    }
                )
            # the predicted curves over bandwidth, for the plot
            grid = [10 ** (k / 8) for k in range(8, 8 * 5 + 1)]  # 10 Mbit/s .. 100 Gbit/s
            curve: dict[str, list[tuple[float, float, float]]] = {"pipedream": [], "dp": []}
            for mbit in grid:
                topo = Topology.flat(2, _bandwidth(mbit))
                straight = plan_pipedream(prof, topo, straight=True, microbatch_size=microbatch)
                split = [(s.first_layer, s.last_layer) for s in straight.stages]
                for name in curve:
                    p, s = _predict(prof, updates, mbit, name, split, units, microbatch, M)
                    curve[name].append((mbit, s_single / s, p_single / p))
            curves[model] = curve
    return ClusterResult(
        rows=tuple(rows),
        choices=tuple(choices),
        network=network,
        curves=curves,
        microbatch={m: sizes[m] for m in ("mlp-512", "vgg-fc")},
        seconds=time.monotonic() - t_start,
    )


# -- reporting ----------------------------------------------------------------------------------


def _link(mbit: float | None) -> str:
    if mbit is None:
        return "-"
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def _err(pred: float, measured: float) -> str:
    return f"{100 * (pred / measured - 1):+.0f}%"


def format_markdown(result: ClusterResult) -> str:
    """The result as Markdown tables (runs, then the planner's choices)."""
    lines = [
        f"Network: {result.network}. Samples per microbatch: "
        + ", ".join(f"{m} {b}" for m, b in result.microbatch.items())
        + ". "
        f"Wall time: {result.seconds:.0f} s.",
        "",
        "| exp | model | link | runner | stages | measured ms/mb | speedup vs 1 worker "
        "| simulated ms/mb (err) | predicted speedup | planner ms/mb (err) |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result.rows:
        lines.append(
            f"| {r.experiment} | {r.model} | {_link(r.link_mbit)} | {r.runner} | {r.stages} | "
            f"{1e3 * r.measured:.1f} | {r.speedup:.2f}x | "
            f"{1e3 * r.simulated:.1f} ({_err(r.simulated, r.measured)}) | "
            f"{r.predicted_speedup:.2f}x | {1e3 * r.planner:.1f} ({_err(r.planner, r.measured)}) |"
        )
    dp = [r for r in result.rows if r.runner == "dp" and not math.isnan(r.allreduce)]
    if dp:
        lines += [
            "",
            "Data parallelism's gradient all-reduce alone (JAX's CPU collectives, gloo over "
            "TCP), measured, against the ring all-reduce at the link's rate that the "
            "simulator and planner assume:",
            "",
            "| model | link | measured all-reduce ms | ring at link rate ms |",
            "|---|---|---:|---:|",
        ]
        lines += [
            f"| {r.model} | {_link(r.link_mbit)} | {1e3 * r.allreduce:.1f} | "
            f"{1e3 * r.allreduce_predicted:.1f} |"
            for r in dp
        ]
    lines += [
        "",
        "| model | link | planner's choice | its predicted ms/mb | measured best | measured ms/mb "
        "| agree |",
        "|---|---|---|---:|---|---:|---|",
    ]
    for c in result.choices:
        lines.append(
            f"| {c['model']} | {_link(c['link_mbit'])} | {c['planner']} ({c['planner_layout']}) "
            f"| {1e3 * c['planner_seconds']:.1f} | {c['measured_best']} | "
            f"{1e3 * c['measured_best_seconds']:.1f} | {'yes' if c['agree'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def plot_cluster(result: ClusterResult, path: str | os.PathLike[str]) -> Path:
    """Speedup over one worker vs link bandwidth for the parameter-heavy model: predicted
    lines (simulator solid, planner dashed) and measured dots, for DP and PipeDream."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = "vgg-fc"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = {"pipedream": "tab:blue", "dp": "tab:red"}
    labels = {"pipedream": "PipeDream (2 stages)", "dp": "data parallel (2 workers)"}
    for name, points in result.curves.get(model, {}).items():
        mbit = [p[0] for p in points]
        ax.plot(mbit, [p[1] for p in points], color=colours[name], label=f"{labels[name]}: "
                "simulated")  # fmt: skip
        ax.plot(mbit, [p[2] for p in points], color=colours[name], ls="--", lw=1,
                label=f"{labels[name]}: planner")  # fmt: skip
        dots = [r for r in result.rows if r.model == model and r.runner == name]
        xs = [r.link_mbit if r.link_mbit is not None else 2e9 * 8 / 1e6 for r in dots]
        ax.scatter(xs, [r.speedup for r in dots], color=colours[name], zorder=3, s=40,
                   edgecolor="black", label=f"{labels[name]}: measured")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth, each way (Mbit/s)")
    ax.set_ylabel("throughput / one worker's")
    ax.set_title(f"{model}: 2 workers, microbatch {result.microbatch[model]}")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pdjax.cluster (worker|profile) JOB_JSON`` (the driver starts these)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] not in ("worker", "profile"):
        print("usage: python -m pdjax.cluster (worker|profile) JOB_JSON", file=sys.stderr)
        return 2
    job = json.loads(argv[1])
    if argv[0] == "profile":
        import jax

        jax.config.update("jax_num_cpu_devices", 1)
        _profile_job(job)
    else:
        _worker_job(job)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def write_results(result: ClusterResult, out: str | os.PathLike[str]) -> list[Path]:
    """Writes ``cluster.json``, ``cluster.md`` and (with matplotlib) ``cluster.png`` into
    the folder ``out``; returns the paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "cluster.json", folder / "cluster.md"]
    paths[0].write_text(result.to_json())
    paths[1].write_text(format_markdown(result))
    try:
        paths.append(plot_cluster(result, folder / "cluster.png"))
    except ImportError:  # matplotlib is the [plot] extra
        pass
    return paths
