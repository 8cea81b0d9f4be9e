"""A cluster on one machine: PipeDream against data parallelism with real workers and links.

Each *worker* is a process of its own, pinned to one core (``taskset``) with one CPU device
and XLA's intra-op threading off, so that it computes alone, as one accelerator would.
Workers join with ``jax.distributed``: pipeline activations and gradients cross between
them with ``jax.device_put`` (:class:`~pdjax.pipeline.Pipeline`), the data-parallel
gradient all-reduce with JAX's CPU collectives (gloo over TCP). With root and ``tc``, every
worker runs in a network namespace of its own on a link of known bandwidth
(:class:`~pdjax.apps.netem.EmulatedNetwork`: veth pairs through a bridge, a token bucket each
way), so those transfers cross that link; without, the workers share loopback and the
report says so.

:func:`run_cluster` runs, side by side, per model and link rate (:data:`RATES`):

- (a) a compute-bound model (``mlp-512``: 8 dense layers of 512, 8 MB of weights that
  stay in the shared L3 cache, microbatches of 128); on the fast link also
  ``pipedream+1`` (one more microbatch in flight), ``pipedream/coll`` (the collective
  transport) and ``1f1b``;
- (b) a parameter-heavy VGG-style model (``vgg-fc``: a narrow VGG-16 front, then a
  2048 x 2048 fully connected layer, 18 MB of weights) over slow links;
- for both: a 2-stage ``pipedream`` at every cut point, 2-worker data parallelism, and one
  worker alone (one jitted step, and a one-stage pipeline);
- (c) for every run, the measured seconds per microbatch next to the planner's prediction
  (:func:`~pdjax.partition.evaluate_partition`) and the simulator's
  (:func:`~pdjax.pipeline.simulate` of exactly the schedule that ran), both from
  *calibrated* costs (:mod:`pdjax.calibrate`): every candidate stage timed as compiled
  programs (forward, backward, SGD update) on one pinned worker, the link measured both
  ways through ``jax.device_put`` and the gradient all-reduce measured, in the run's own
  launch before its runners; next to them the simulator from the per-layer profile alone;
- (d) per link, the planner's choice from the calibrated costs
  (:func:`~pdjax.partition.plan_pipedream`: a pipeline, data parallel, or one worker)
  against the measured best;
- (e) the plans ranked: Kendall's tau of the planner's (and the simulator's) order of
  every candidate against the measured order.

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
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pdjax.errors import ClusterError, PdjaxError

__all__ = [
    "CLUSTER_MODELS",
    "ClusterError",
    "ClusterResult",
    "Row",
    "cluster_model",
    "format_markdown",
    "kendall_tau",
    "plot_cluster",
    "plot_ranking",
    "run_cluster",
    "write_results",
]

#: Samples per microbatch of each benchmark model.
MICROBATCH = {"mlp-512": 128, "vgg-fc": 32}
#: Link rates (Mbit/s each way) each model runs at: every 2-stage cut, DP and one worker.
RATES: dict[str, tuple[float, ...]] = {"mlp-512": (1000.0, 10000.0), "vgg-fc": (100.0, 1000.0)}
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
    # time to accuracy on real data (pdjax.apps.cluster_tta): vgg-fc's shape for 8x8 digits
    # (2 convolution blocks, then 2048-wide fully connected layers: 19 MB of weights), and
    # the tiny GPT on characters of Python's docs (0.4 MB of weights)
    "vgg-digits": (
        "vgg16",
        {"image_size": 8, "in_channels": 1, "stages": ((32,), (64, 64)), "hidden": 2048},
    ),
    "gpt-text": ("gpt", {}),
    # a small one for the tests of time to accuracy (flattened digits)
    "mlp-digits": ("mlp", {"in_features": 64, "hidden": (64, 64)}),
}


def cluster_model(name: str) -> Any:
    """The :class:`~pdjax.models.ModelSpec` of a benchmark model (tiny config + overrides)."""
    from pdjax.models import get_model

    if name not in CLUSTER_MODELS:
        raise ClusterError(f"unknown cluster model {name!r}; choose one of {list(CLUSTER_MODELS)}")
    family, overrides = CLUSTER_MODELS[name]
    return get_model(family, "tiny", **overrides)


# -- inside a worker ----------------------------------------------------------------------------


def _optimizer(name: str = "sgd", learning_rate: float = 1e-3) -> Any:
    """The benchmark's optimizer (SGD); time to accuracy profiles with its runs' own."""
    from pdjax.apps.train import make_optimizer

    return make_optimizer(name, learning_rate)


def _profile_job(job: Mapping[str, Any]) -> None:
    """One pinned process: per-layer forward/backward seconds and optimizer-update seconds."""
    import jax
    import numpy as np

    from pdjax.profile.xla import profile

    spec = cluster_model(job["model"])
    b = job["microbatch"]
    x, _ = jax.tree.map(np.asarray, spec.sample_batch(b, job["seed"]))
    prof = profile(spec.layers, x, measure=True, repeats=job.get("repeats", 7))
    opt = _optimizer(job.get("optimizer", "sgd"), job.get("learning_rate", 1e-3))
    variables = jax.jit(spec.layers.init)(jax.random.key(0), x)
    updates = []
    for v in variables:
        params = v.get("params", {})
        if not jax.tree.leaves(params):
            updates.append(0.0)
            continue
        state = opt.init(params)

        def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
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
    measured = []
    if job.get("stages"):
        from pdjax.calibrate import measure_stages

        sample = jax.tree.map(np.asarray, spec.sample_batch(b, job["seed"]))
        stages = [tuple(st) for st in job["stages"]]
        measured = [
            dataclasses.asdict(m)
            for m in measure_stages(spec.layers, sample, spec.loss, opt, stages, repeats=7)
        ]
    Path(job["out"]).write_text(
        json.dumps({"profile": prof.to_json(), "updates": updates, "stages": measured})
    )


def _measure_links(job: Mapping[str, Any]) -> dict[str, Any]:
    """Every process: both directions of the link between the two workers' devices, through
    the runtime's ``device_put`` transport, and the data-parallel gradient all-reduce (the
    model's gradient tree, and a latency/bandwidth fit), as :mod:`pdjax.calibrate` measures
    them. Device ids are positions in ``jax.devices()``."""
    import jax

    from pdjax.calibrate import measure_allreduce, measure_link
    from pdjax.distributed import allgather_json

    spec = cluster_model(job["model"])
    devices = jax.devices()
    x, _ = spec.sample_batch(job["microbatch"], 0)
    shapes = jax.eval_shape(spec.layers.init, jax.random.key(0), x)
    grads = [v.get("params", {}) for v in shapes]
    sizes = job.get("sizes", (4096, 65536, 1 << 20, 4 << 20))
    mine = []
    for a, b in [(0, 1), (1, 0)]:
        m = measure_link(devices[a], devices[b], sizes=sizes, timeout=120.0)
        if m is not None:
            mine.append({**dataclasses.asdict(m), "src": a, "dst": b})
    fit, exact = measure_allreduce(devices, sizes=sizes, trees={"model": grads}, repeats=3)
    links = [m for part in allgather_json(mine) for m in part]
    return {
        "links": links,
        "allreduce": {**dataclasses.asdict(fit), "devices": list(range(len(devices)))},
        "allreduce_model": exact["model"],
        "device_ids": [int(d.id) for d in devices],
    }


def _worker_job(job: Mapping[str, Any]) -> None:
    """Every process of a launch: builds the runners, warms them up, times them round-robin;
    process 0 writes ``{runner: [seconds per timed call]}``."""
    from pdjax.distributed import allgather_json, config_from_env, initialize

    config = config_from_env()
    if config is not None and config.num_processes > 1:
        initialize(config)
    import jax

    calibration = _measure_links(job) if job.get("calibrate") else None
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
    for r, (name, call) in zip(job["runners"], runners, strict=True):
        if r.get("timeline"):  # one more call, each action timed (diagnosis)
            allgather_json(name)
            spans = call.timeline()  # type: ignore[attr-defined]
            path = Path(f"{job['out']}.{name}.{jax.process_index()}.timeline.json")
            path.write_text(json.dumps(spans))
    if jax.process_index() == 0:
        out: dict[str, Any] = dict(times)
        if calibration is not None:
            out["_calibration"] = calibration
        Path(job["out"]).write_text(json.dumps(out))


def _make_runner(job: Mapping[str, Any], r: Mapping[str, Any]) -> tuple[str, Callable[[], float]]:
    """``(name, call)``: ``call()`` trains ``r["units"]`` microbatches' worth and returns the
    seconds it took on this process (to the last result it holds)."""
    import jax
    import numpy as np

    from pdjax._sharding import held
    from pdjax.partition import StagePlan
    from pdjax.pipeline.executor import Pipeline
    from pdjax.pipeline.schedules import STREAMING
    from pdjax.runners import DataParallel, Runner

    spec = cluster_model(job["model"])
    b, seed, name = job["microbatch"], job["seed"], r["name"]
    label = r.get("label", name)
    units = r["units"]
    opt = _optimizer()
    runner: Runner[Any]
    if name in ("single", "dp"):  # every device a whole microbatch: its batch is theirs
        devices = jax.devices()[:1] if name == "single" else jax.devices()
        runner = DataParallel(spec.layers, spec.loss, opt, devices=devices)
        b, units = b * len(devices), units // len(devices)
    else:
        runner = Pipeline(
            spec.layers,
            [StagePlan(f, last, (i,)) for i, (f, last) in enumerate(r["stages"])],
            spec.loss,
            opt,
            schedule=name,
            microbatches=r.get("microbatches", 1),
            devices=jax.devices(),
            extra_in_flight=r.get("extra", 0),
            transport=r.get("transport", "auto"),
        )
    M = runner.microbatches
    x, y = jax.tree.map(np.asarray, spec.sample_batch(b * units, seed))
    mbs = [jax.tree.map(lambda a, k=k: a[k * b : (k + 1) * b], (x, y)) for k in range(units)]
    state: Any = runner.init(jax.random.key(seed), mbs[0][0])
    streaming = name in STREAMING  # one stream; flush schedules: steps of M
    calls = [mbs] if streaming else [mbs[k : k + M] for k in range(0, units, M)]

    def call() -> float:
        nonlocal state
        t0 = time.perf_counter()
        for chunk in calls:
            state, _ = runner.run(state, chunk)
        jax.block_until_ready([a for a in jax.tree.leaves(state) if held(a)])
        return time.perf_counter() - t0

    def timeline() -> list[tuple[int, float, float, str, int, int]]:
        """One call with every action waited for and timed: ``(group, start, end, kind,
        stage, microbatch)`` for the actions this process ran (a pipeline's diagnostic)."""
        nonlocal state
        if not isinstance(runner, Pipeline):
            raise ClusterError(f"{label} is no pipeline: it has no timeline of actions")
        spans = []
        for chunk in calls:
            state, metrics = runner.run(state, chunk, timeline=True)
            assert metrics.timeline is not None  # recorded when asked for
            spans += [(sp.group, sp.start, sp.end, sp.action.kind, sp.action.stage,
                       sp.action.mb) for sp in metrics.timeline.spans]  # fmt: skip
        return spans

    call.timeline = timeline  # type: ignore[attr-defined]
    return label, call


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
      allreduce_predicted: ``dp``: the all-reduce the simulator uses: the calibrated one
        (measured in the same launch, alone), or the ring at the link rate without a
        calibration.
      simulated_profile: the simulator's prediction from the per-layer profile alone (no
        calibration; the ring all-reduce at the link rate): what calibration corrects.
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
    simulated_profile: float = math.nan


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
      rankings: per (model, link): every candidate plan (each 2-stage cut, DP, one worker)
        with measured, planner and simulated seconds per microbatch, Kendall's tau of the
        planner's and the simulator's order against the measured one, the planner's pick
        and the measured best.
      links: per launch, the calibrated links (both directions) and all-reduce.
    """

    rows: tuple[Row, ...]
    choices: tuple[dict[str, Any], ...]
    network: str
    curves: dict[str, dict[str, list[tuple[float, float, float]]]]
    microbatch: dict[str, int]
    seconds: float
    rankings: tuple[dict[str, Any], ...] = ()
    links: tuple[dict[str, Any], ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


#: glibc allocator settings for every worker (see :func:`_python_env`): blocks up to 32 MB
#: from the heap, which is never trimmed below 1 GB.
_FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def _python_env(extra: Mapping[str, str]) -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {_ONE_CORE}".strip(),
        "PDJAX_CPU_DEVICES": "1",
        "PDJAX_HEARTBEAT_TIMEOUT": "20",
        # glibc's dynamic mmap threshold makes a large allocation's cost depend on what the
        # process freed before (a vgg-fc stage's backward: 18 or 29 ms by measuring order);
        # fixed thresholds make calibration and runs see the same allocator
        **_FIXED_MALLOC,
        **extra,
    }


def _run_processes(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    what: str,
    timeout: float = LAUNCH_TIMEOUT,
) -> None:
    """Runs the processes together, bounded by ``timeout`` seconds; ends them all (their
    process groups: SIGTERM, then SIGKILL) when one fails, at the timeout, or when this
    launcher gets SIGTERM, SIGINT or SIGHUP; raises :class:`ClusterError` with the failing
    one's output (:class:`~pdjax.errors.LaunchInterrupted` on a signal)."""
    from pdjax.distributed import describe_exit, end_process_groups, ending_on_signals

    logs = [tempfile.TemporaryFile() for _ in commands]
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + timeout
    failed = None
    with ending_on_signals() as guard:
        try:
            for c, e, log in zip(commands, envs, logs, strict=True):
                with guard.hold():  # no orphan from a Popen that a signal interrupts
                    procs.append(
                        subprocess.Popen(
                            list(c), env=dict(e), stdout=log, stderr=log, start_new_session=True
                        )
                    )
            while True:
                codes = [p.poll() for p in procs]
                bad = [i for i, c in enumerate(codes) if c is not None and c != 0]
                if bad:
                    failed = (bad[0], describe_exit(codes[bad[0]] or 0))
                    break
                if all(c == 0 for c in codes):
                    return
                if time.monotonic() > deadline:
                    failed = (codes.index(None), f"still running after {timeout:.0f} s")
                    break
                time.sleep(0.05)
        finally:
            end_process_groups(procs)
            if failed is not None:
                i, why = failed
                logs[i].seek(0)
                tail = logs[i].read().decode(errors="replace")[-4000:]
            for log in logs:
                log.close()
    raise ClusterError(f"{what}: worker {i} failed ({why}):\n{tail}")


def _profile(
    model: str,
    microbatch: int,
    seed: int,
    workdir: Path,
    stages: Sequence[tuple[int, int, int, str]] = (),
    optimizer: tuple[str, float] = ("sgd", 1e-3),
) -> tuple[Any, list[float], list[dict[str, Any]]]:
    """One pinned worker: the per-layer profile, per-layer update seconds, and the
    calibrated ``stages`` (``(first, last, replicas, replication)``), updates timed with
    ``optimizer`` (a :func:`pdjax.apps.train.make_optimizer` name and learning rate)."""
    from pdjax.profile import Profile

    out = workdir / f"profile-{model}.json"
    job = {"model": model, "microbatch": microbatch, "seed": seed, "out": str(out),
           "stages": [list(st) for st in stages], "optimizer": optimizer[0],
           "learning_rate": optimizer[1]}  # fmt: skip
    _run_processes(
        [
            [
                "taskset",
                "-c",
                "0",
                sys.executable,
                "-m",
                "pdjax.apps.cluster",
                "profile",
                json.dumps(job),
            ]
        ],
        [_python_env({})],
        f"profiling {model}",
        timeout=LAUNCH_TIMEOUT + 10 * len(stages),
    )
    data = json.loads(out.read_text())
    return Profile.from_json(data["profile"]), data["updates"], data["stages"]


def _launch(
    job: dict[str, Any],
    workers: int,
    rate_mbit: float | None,
    emulate: bool,
    workdir: Path,
    *,
    module: str = "pdjax.apps.cluster",
    timeout: float | None = None,
) -> dict[str, Any]:
    """One launch: ``workers`` pinned processes (on an emulated network when ``emulate``),
    each running ``python -m module worker JOB``; returns the JSON process 0 writes to
    ``job["out"]``. ``timeout``: seconds (default: by the number of runners)."""
    from pdjax.apps.netem import EmulatedNetwork
    from pdjax.distributed import free_port

    out = workdir / f"run-{time.monotonic_ns()}.json"
    job = {**job, "out": str(out)}
    argv = [sys.executable, "-m", module, "worker", json.dumps(job)]
    cores = os.cpu_count() or 1
    if timeout is None:
        timeout = LAUNCH_TIMEOUT + 30.0 * len(job["runners"])

    def pinned(i: int) -> list[str]:
        return ["taskset", "-c", str(i % cores), *argv]

    if workers == 1:
        _run_processes([pinned(0)], [_python_env({})], f"{job['model']} alone", timeout=timeout)
        alone: dict[str, Any] = json.loads(out.read_text())
        return alone
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
            commands = [net.command(i, pinned(i)) for i in range(workers)]
            _run_processes(commands, envs, what, timeout=timeout)
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
        _run_processes([pinned(i) for i in range(workers)], envs, what, timeout=timeout)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


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


def _schedule(runner: str, num_stages: int, units: int, microbatches: int, extra: int = 0) -> Any:
    """The schedule a runner plays: ``units`` microbatches (see :func:`_make_runner`)."""
    from pdjax.pipeline.schedules import generate

    if runner == "single":
        return generate("1f1b", 1, 1, steps=units)
    if runner == "dp":  # each worker a whole microbatch per step: round-robin over 2
        return generate("1f1b", 1, 2, steps=units // 2, replicas=(2,),
                        replication=("round-robin",))  # fmt: skip
    if runner == "pipedream":
        return generate("pipedream", num_stages, units, extra_in_flight=extra)
    return generate(runner, num_stages, microbatches, steps=units // microbatches)


def _layout(runner: str, stages: Sequence[tuple[int, int]], L: int) -> list[tuple[int, int, int]]:
    if runner == "single":
        return [(0, L - 1, 1)]
    if runner == "dp":
        return [(0, L - 1, 2)]
    return [(f, last, 1) for f, last in stages]


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
    """``(planner, simulator)`` seconds per microbatch of one run from the per-layer profile
    alone (no calibration; ``extra``: pipedream's extra microbatches in flight)."""
    from pdjax.partition import Topology, evaluate_partition
    from pdjax.pipeline.schedules import generate
    from pdjax.pipeline.simulate import simulate

    L = len(prof.layers)
    bw = _bandwidth(rate_mbit)
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


def _calibration(
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


def _topology(cal: Any, workers: int, rate_mbit: float | None) -> Any:
    """A flat topology of ``workers`` with the calibrated link (both directions' mean
    bandwidth and latency), or the configured rate without measured links."""
    from pdjax.partition import Topology
    from pdjax.partition.topology import Level

    there, back = cal.link(0, 1), cal.link(1, 0)
    if workers < 2 or there is None or back is None:
        return Topology.flat(max(1, workers), _bandwidth(rate_mbit))
    bw = 2.0 / (1.0 / there.bandwidth + 1.0 / back.bandwidth)
    return Topology((Level(workers, bw, "worker", (there.latency + back.latency) / 2),))


def _predict_calibrated(
    prof: Any,
    cal: Any,
    rate_mbit: float | None,
    runner: str,
    stages: Sequence[tuple[int, int]],
    units: int,
    microbatch: int,
    microbatches: int,
    extra: int = 0,
) -> tuple[float, float]:
    """``(planner, simulator)`` seconds per microbatch of one run from calibrated costs:
    the stages' programs measured on a pinned worker, the link and the all-reduce measured
    in the run's own launch."""
    from pdjax.partition import evaluate_partition
    from pdjax.pipeline.costs import costs_from_plan
    from pdjax.pipeline.simulate import simulate

    L = len(prof.layers)
    layout = _layout(runner, stages, L)
    n = sum(r for *_, r in layout)
    schedule = {"single": "1f1b", "dp": "1f1b"}.get(runner, runner)
    M = {"single": 1, "dp": 2}.get(runner, microbatches)
    mode = "round-robin" if runner == "dp" else "split"
    kw = {"stage_seconds": cal.stage_seconds(schedule, M),
          "allreduce_seconds": cal.allreduce_function()}  # fmt: skip
    plan = evaluate_partition(prof, _topology(cal, n, rate_mbit), layout, schedule=schedule,
                              num_microbatches=M, microbatch_size=microbatch,
                              partitioner="manual", replication=mode, **kw)  # fmt: skip
    sched = _schedule(runner, len(layout), units, microbatches, extra)
    costs = costs_from_plan(plan, prof, calibration=cal, partial=not cal.links)
    sim = simulate(sched, costs).makespan / units
    return plan.time_per_microbatch, sim


def _describe_plan(plan: Any) -> tuple[str, str]:
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
      emulate: use an emulated network (None: when :func:`~pdjax.apps.netem.network_support`
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
    from pdjax.apps.netem import network_support
    from pdjax.distributed import ending_on_signals
    from pdjax.partition import Topology, plan_pipedream

    t_start = time.monotonic()
    reason = network_support()
    if emulate and reason:
        raise ClusterError(f"cannot emulate a network here: {reason}")
    emulate = reason is None if emulate is None else emulate
    wanted_rates = {**RATES, **(rates_mbit or {})}
    if emulate:
        network = "2 workers, each in its own network namespace on a veth link through a bridge"
    else:
        why = reason or "emulate=False"
        network = f"2 workers on loopback ({why}): no link emulation, one unshaped link"
    cores = os.cpu_count() or 1
    if cores < 2:
        network += f"; only {cores} core: the workers share it"
    dp_units = dict(dp_units or {})
    sizes = {**MICROBATCH, **(microbatch or {})}
    M = 4
    rows: list[Row] = []
    choices: list[dict[str, Any]] = []
    rankings: list[dict[str, Any]] = []
    links_seen: list[dict[str, Any]] = []
    curves: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    # a signal raises here like Ctrl-C does, so the workers are ended and the network is torn
    # down on the way out (the workers run in sessions of their own, out of the terminal's
    # reach, and a launcher killed outright would leave them and the namespaces behind)
    with ending_on_signals(), tempfile.TemporaryDirectory() as tmp:
        work = Path(workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for model in models:
            experiment = "a" if model == "mlp-512" else "b"
            links: list[float | None] = list(wanted_rates[model]) if emulate else [None]
            mb_size = sizes[model]
            L = len(cluster_model(model).layers)
            cuts = [((0, c), (c + 1, L - 1)) for c in range(L - 1)]
            wanted = [(0, L - 1, 1, "split"), (0, L - 1, 2, "round-robin")]
            wanted += [(f, last, 1, "split") for cut in cuts for f, last in cut]
            log(f"({experiment}) {model}: profiling and calibrating {len(wanted)} stages on "
                "one pinned worker")  # fmt: skip
            prof, updates, measured_stages = _profile(model, mb_size, seed, work, wanted)
            base = {"model": model, "microbatch": mb_size, "seed": seed, "repeats": repeats}
            log(f"({experiment}) {model}: one worker alone")
            one = [  # one jitted step, and a one-stage pipeline: the faster is the baseline
                {"name": "single", "units": units},
                {"name": "pipedream", "label": "single-pipe", "units": units,
                 "stages": [(0, L - 1)]},
            ]  # fmt: skip
            alone = _launch({**base, "runners": one}, 1, None, False, work)
            times = {k: statistics.median(v) / units for k, v in alone.items()}
            single = min(times.values())
            cal0 = _calibration(prof, model, mb_size, measured_stages, None)
            p_single, s_single = _predict_calibrated(
                prof, cal0, None, "single", [], units, mb_size, M
            )
            _, s_prof = _predict(prof, updates, None, "single", [], units, mb_size, M)
            for k, how in [("single", "1 worker, one jit"), ("single-pipe", "1 worker, 1 stage")]:
                rows.append(
                    Row(experiment, model, None, k, how, times[k], p_single, s_single,
                        single / times[k], 1.0, tuple(t / units for t in alone[k]),
                        simulated_profile=s_prof)
                )  # fmt: skip
            for rate in links:
                topo = Topology.flat(2, _bandwidth(rate))
                straight = plan_pipedream(prof, topo, straight=True, microbatch_size=mb_size)
                split = [(s.first_layer, s.last_layer) for s in straight.stages]
                dpu = 8 if rate is not None and rate < 1000 else units
                dpu = dpu if rate is None else dp_units.get(rate, dpu)
                chosen_cuts = cuts if every_cut else [tuple(split)]
                runners: list[dict[str, Any]] = [
                    {"name": "pipedream", "label": f"pipedream@{a[1]}", "units": units,
                     "stages": [a, b]}
                    for a, b in chosen_cuts
                ]  # fmt: skip
                runners.append({"name": "dp", "units": dpu})
                if experiment == "a" and rate == fast_mbit:
                    runners += [  # latency hiding, the collective transport, a flush schedule
                        {"name": "pipedream", "label": "pipedream+1", "extra": 1,
                         "units": units, "stages": split},
                        {"name": "pipedream", "label": "pipedream/coll",
                         "transport": "collective", "units": units, "stages": split},
                        {"name": "1f1b", "units": units, "stages": split, "microbatches": M},
                    ]  # fmt: skip
                where = "loopback" if rate is None else f"{rate:g} Mbit/s"
                log(f"({experiment}) {model}: {len(runners)} runners on {where}, links "
                    "calibrated first")  # fmt: skip
                got = _launch({**base, "runners": runners, "calibrate": True}, 2, rate,
                              emulate, work)  # fmt: skip
                meas = got.pop("_calibration")
                cal = _calibration(prof, model, mb_size, measured_stages, meas)
                # everything the predictions came from, to predict again offline
                links_seen.append({"model": model, "link_mbit": rate, "links": meas["links"],
                                   "allreduce": meas["allreduce"],
                                   "allreduce_model": meas["allreduce_model"],
                                   "device_ids": meas["device_ids"],
                                   "stages": measured_stages})  # fmt: skip
                ring = sum(lp.param_bytes for lp in prof.layers) / _bandwidth(rate)
                measured: dict[str, float] = {}
                plans: list[dict[str, Any]] = []
                for r in runners:
                    n = r["units"]
                    label = r.get("label", r["name"])
                    t = statistics.median(got[label]) / n
                    measured[label] = t
                    args = (rate, r["name"], r.get("stages", []), n, mb_size, M,
                            r.get("extra", 0))  # fmt: skip
                    p, sim = _predict_calibrated(prof, cal, *args)
                    _, s_old = _predict(prof, updates, *args)
                    st = r.get("stages", [])
                    layout = "DP x2" if r["name"] == "dp" else " / ".join(
                        f"{f}-{last}" for f, last in st)  # fmt: skip
                    allreduce, allreduce_predicted = (
                        (cal.stage(0, L - 1, 2, "round-robin").allreduce, ring)
                        if r["name"] == "dp" else (math.nan, math.nan))  # fmt: skip
                    rows.append(
                        Row(experiment, model, rate, label, layout, t, p, sim, single / t,
                            s_single / sim, tuple(x / n for x in got[label]),
                            allreduce=allreduce, allreduce_predicted=allreduce_predicted,
                            simulated_profile=s_old)
                    )  # fmt: skip
                    if r["name"] == "dp" or (r["name"] == "pipedream" and not r.get("extra")
                                             and "transport" not in r):  # fmt: skip
                        plans.append({"runner": label, "layout": layout, "measured": t,
                                      "planner": p, "simulated": sim})  # fmt: skip
                # one worker alone is a candidate too (measured in its own launch)
                plans.append({"runner": "single", "layout": "1 worker", "measured": single,
                              "planner": p_single, "simulated": s_single})  # fmt: skip
                # the planner's choice, from calibrated costs, among all it may pick
                ctopo = _topology(cal, 2, rate)
                chosen = plan_pipedream(
                    prof, ctopo, fewer_machines=True, microbatch_size=mb_size,
                    replication="round-robin", stage_seconds=cal.stage_seconds("pipedream", 1),
                    allreduce_seconds=cal.allreduce_function(),
                )  # fmt: skip
                runner, how = _describe_plan(chosen)
                if runner == "pipedream":
                    pick = f"pipedream@{chosen.stages[0].last_layer}"
                else:
                    pick = runner
                best = min(plans, key=lambda q: q["measured"])
                refined = min(plans, key=lambda q: q["simulated"])
                of_pick = next((q["measured"] for q in plans if q["runner"] == pick), math.nan)
                rankings.append({
                    "model": model, "link_mbit": rate, "plans": plans,
                    "tau_planner": kendall_tau([q["planner"] for q in plans],
                                               [q["measured"] for q in plans]),
                    "tau_simulated": kendall_tau([q["simulated"] for q in plans],
                                                 [q["measured"] for q in plans]),
                    "pick": pick, "pick_layout": how, "pick_measured": of_pick,
                    # the refinement loop's pick: the simulator's best on calibrated costs
                    "refined": refined["runner"], "refined_measured": refined["measured"],
                    "best": best["runner"], "best_measured": best["measured"],
                })  # fmt: skip
                choices.append({
                    "model": model, "link_mbit": rate, "planner": runner,
                    "planner_layout": how, "planner_seconds": chosen.time_per_microbatch,
                    "measured_best": best["runner"], "measured_best_seconds": best["measured"],
                    "measured_of_choice": of_pick,
                    "agree": of_pick <= 1.05 * best["measured"],
                })  # fmt: skip
            # the predicted curves over bandwidth, for the plot (the last launch's
            # calibration, its link replaced by each rate)
            grid = [10 ** (k / 8) for k in range(8, 8 * 5 + 1)]  # 10 Mbit/s .. 100 Gbit/s
            curve: dict[str, list[tuple[float, float, float]]] = {"pipedream": [], "dp": []}
            for mbit in grid:
                topo = Topology.flat(2, _bandwidth(mbit))
                straight = plan_pipedream(prof, topo, straight=True, microbatch_size=mb_size)
                split = [(s.first_layer, s.last_layer) for s in straight.stages]
                for name in curve:
                    p, sim = _predict_calibrated(prof, cal0, mbit, name, split, units,
                                                 mb_size, M)  # fmt: skip
                    curve[name].append((mbit, s_single / sim, p_single / p))
            curves[model] = curve
    return ClusterResult(
        rows=tuple(rows),
        choices=tuple(choices),
        network=network,
        curves=curves,
        microbatch={m: sizes[m] for m in models},
        seconds=time.monotonic() - t_start,
        rankings=tuple(rankings),
        links=tuple(links_seen),
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
        "Predictions from calibrated costs (stages measured as programs on a pinned worker, "
        "the link and the all-reduce measured in the run's launch); the last column is the "
        "simulator from the per-layer profile alone, as before calibration.",
        "",
        "| exp | model | link | runner | stages | measured ms/mb | speedup vs 1 worker "
        "| simulated ms/mb (err) | predicted speedup | planner ms/mb (err) "
        "| profile-only simulated (err) |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.rows:
        lines.append(
            f"| {r.experiment} | {r.model} | {_link(r.link_mbit)} | {r.runner} | {r.stages} | "
            f"{1e3 * r.measured:.1f} | {r.speedup:.2f}x | "
            f"{1e3 * r.simulated:.1f} ({_err(r.simulated, r.measured)}) | "
            f"{r.predicted_speedup:.2f}x | {1e3 * r.planner:.1f} ({_err(r.planner, r.measured)}) "
            f"| {_ms_err(r.simulated_profile, r.measured)} |"
        )
    errs = [
        (abs(r.simulated / r.measured - 1), abs(r.planner / r.measured - 1)) for r in result.rows
    ]
    if errs:
        lines += [
            "",
            f"Rows with the simulator within 10%: {sum(e[0] <= 0.10 for e in errs)} of "
            f"{len(errs)} (largest error {100 * max(e[0] for e in errs):.0f}%); the planner "
            f"within 15%: {sum(e[1] <= 0.15 for e in errs)} of {len(errs)} (largest "
            f"{100 * max(e[1] for e in errs):.0f}%).",
        ]
    dp = [r for r in result.rows if r.runner == "dp" and not math.isnan(r.allreduce)]
    if dp:
        lines += [
            "",
            "Data parallelism's gradient all-reduce alone (JAX's CPU collectives, gloo over "
            "TCP), measured by the calibration, against the ring all-reduce at the link's "
            "rate that the uncalibrated model assumes:",
            "",
            "| model | link | measured all-reduce ms | ring at link rate ms |",
            "|---|---|---:|---:|",
        ]
        lines += [
            f"| {r.model} | {_link(r.link_mbit)} | {1e3 * r.allreduce:.1f} | "
            f"{1e3 * r.allreduce_predicted:.1f} |"
            for r in dp
        ]
    if result.links:
        lines += [
            "",
            "Calibrated links (through `jax.device_put` between the workers, fitted to "
            "latency + bytes / bandwidth) and the model's all-reduce:",
            "",
            "| model | link | 0 -> 1 latency us, MB/s | 1 -> 0 latency us, MB/s | sender host us "
            "| all-reduce ms |",
            "|---|---|---|---|---:|---:|",
        ]
        for cal in result.links:
            by = {(ln["src"], ln["dst"]): ln for ln in cal["links"]}
            cells = [
                f"{1e6 * by[k]['latency']:.0f}, {by[k]['bandwidth'] / 1e6:.1f}" if k in by else "-"
                for k in [(0, 1), (1, 0)]
            ]
            host = [ln["send_seconds"] for ln in cal["links"]]
            lines.append(
                f"| {cal['model']} | {_link(cal['link_mbit'])} | {cells[0]} | {cells[1]} | "
                f"{1e6 * statistics.mean(host) if host else math.nan:.0f} | "
                f"{1e3 * cal['allreduce_model']:.1f} |"
            )
    lines += [
        "",
        "| model | link | planner's choice | its predicted ms/mb | measured best | measured ms/mb "
        "| measured of the choice | within 5% |",
        "|---|---|---|---:|---|---:|---:|---|",
    ]
    for c in result.choices:
        lines.append(
            f"| {c['model']} | {_link(c['link_mbit'])} | {c['planner']} ({c['planner_layout']}) "
            f"| {1e3 * c['planner_seconds']:.1f} | {c['measured_best']} | "
            f"{1e3 * c['measured_best_seconds']:.1f} | "
            f"{1e3 * (c['measured_of_choice'] or math.nan):.1f} | "
            f"{'yes' if c['agree'] else 'NO'} |"
        )
    for rk in result.rankings:
        lines += [
            "",
            f"Plans ranked, {rk['model']} at {_link(rk['link_mbit'])}: Kendall tau (planner vs "
            f"measured) {rk['tau_planner']:.2f}, (simulator vs measured) "
            f"{rk['tau_simulated']:.2f}; planner's pick {rk['pick']} measured "
            f"{1e3 * rk['pick_measured']:.1f} ms/mb against the best, {rk['best']}, "
            f"{1e3 * rk['best_measured']:.1f} ms/mb; the simulator's pick (the refinement "
            f"loop's) {rk.get('refined', '-')} measured "
            f"{1e3 * rk.get('refined_measured', math.nan):.1f} ms/mb.",
            "",
            "| plan | stages | measured ms/mb | planner ms/mb (err) | simulated ms/mb (err) |",
            "|---|---|---:|---:|---:|",
        ]
        for q in sorted(rk["plans"], key=lambda q: q["measured"]):
            lines.append(
                f"| {q['runner']} | {q['layout']} | {1e3 * q['measured']:.1f} | "
                f"{_ms_err(q['planner'], q['measured'])} | "
                f"{_ms_err(q['simulated'], q['measured'])} |"
            )
    return "\n".join(lines) + "\n"


def _ms_err(pred: float, measured: float) -> str:
    if pred is None or math.isnan(pred):
        return "-"
    return f"{1e3 * pred:.1f} ({_err(pred, measured)})"


def plot_ranking(result: ClusterResult, path: str | os.PathLike[str]) -> Path:
    """Predicted (planner) against measured seconds per microbatch, one point per plan, one
    panel per model and link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(result.rankings))
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n, 3.4), squeeze=False)
    for ax, rk in zip(axes[0], result.rankings, strict=False):
        xs = [1e3 * q["measured"] for q in rk["plans"]]
        for key, colour, marker in [("planner", "tab:blue", "o"), ("simulated", "tab:orange", "x")]:
            ax.scatter(xs, [1e3 * q[key] for q in rk["plans"]], s=18, color=colour,
                       marker=marker, label=key)  # fmt: skip
        for q, x in zip(rk["plans"], xs, strict=True):
            if q["runner"] in (rk["pick"], rk["best"]):
                ax.annotate(q["runner"].replace("pipedream@", "cut "), (x, 1e3 * q["planner"]),
                            fontsize=6)  # fmt: skip
        lo = min(xs + [1e3 * q["planner"] for q in rk["plans"]]) * 0.8
        hi = max(xs + [1e3 * q["planner"] for q in rk["plans"]]) * 1.2
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{rk['model']}, {_link(rk['link_mbit'])}: tau {rk['tau_planner']:.2f}",
                     fontsize=8)  # fmt: skip
        ax.set_xlabel("measured ms / microbatch", fontsize=7)
        ax.set_ylabel("predicted ms / microbatch", fontsize=7)
        ax.legend(fontsize=6)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


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
        # measured: DP, and per link the best 2-stage cut
        dots = [r for r in result.rows if r.model == model and r.runner == name]
        if name == "pipedream":
            cut = [r for r in result.rows if r.model == model and r.runner.startswith("pipedream@")]
            best: dict[Any, Row] = {}
            for r in cut:
                if r.link_mbit not in best or r.measured < best[r.link_mbit].measured:
                    best[r.link_mbit] = r
            dots += list(best.values())
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
    """``python -m pdjax.apps.cluster (worker|profile) JOB_JSON`` (the driver starts these)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] not in ("worker", "profile"):
        print("usage: python -m pdjax.apps.cluster (worker|profile) JOB_JSON", file=sys.stderr)
        return 2
    job = json.loads(argv[1])
    try:
        if argv[0] == "profile":
            import jax

            jax.config.update("jax_num_cpu_devices", 1)
            _profile_job(job)
        else:
            _worker_job(job)
    except PdjaxError as e:  # one line, which the driver's ClusterError quotes
        print(f"pdjax.apps.cluster {argv[0]}: error: {e}", file=sys.stderr)
        return 2
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
        if result.rankings:
            paths.append(plot_ranking(result, folder / "cluster-ranking.png"))
    except ImportError:  # matplotlib is the [plot] extra
        pass
    return paths
