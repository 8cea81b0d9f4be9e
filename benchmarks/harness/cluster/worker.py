"""What each worker process of the cluster benchmark runs: ``python -m benchmarks.harness.cluster
(worker|profile) JOB_JSON``, started by :mod:`benchmarks.harness.cluster.launcher`.

``profile``: one pinned process times the model's layers, optimizer updates and candidate
stages. ``worker``: every process of a launch builds the job's runners, warms them up and
times them round-robin (after measuring the links when the job asks for it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.cluster.models import cluster_model
from pdjax.errors import ClusterError, PdjaxError
from pdjax.schedules import ScheduleSpec


def _optimizer(name: str = "sgd", learning_rate: float = 1e-3) -> Any:
    """The benchmark's optimizer (SGD); time to accuracy profiles with its runs' own."""
    from pdjax.apps.train import make_optimizer

    return make_optimizer(name, learning_rate)


def _profile_job(job: Mapping[str, Any]) -> None:
    """One pinned process: per-layer forward/backward seconds and optimizer-update seconds."""
    import jax
    import numpy as np

    from pdjax.profile import profile

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
    measured = _stage_measures(job, jax.devices()[0]) if job.get("stages") else []
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


def _stage_measures(job: Mapping[str, Any], device: Any) -> list[dict[str, Any]]:
    """``job["stages"]`` (``(first, last, replicas, replication)``) timed on ``device`` as
    the runtime's programs (:func:`pdjax.calibrate.measure_stages`), as plain data."""
    import jax
    import numpy as np

    from pdjax.calibrate import measure_stages

    spec = cluster_model(job["model"])
    sample = jax.tree.map(np.asarray, spec.sample_batch(job["microbatch"], job["seed"]))
    stages = [tuple(st) for st in job["stages"]]
    opt = _optimizer(job.get("optimizer", "sgd"), job.get("learning_rate", 1e-3))
    measures = measure_stages(spec.layers, sample, spec.loss, opt, stages, device=device,
                              repeats=7)  # fmt: skip
    return [dataclasses.asdict(m) for m in measures]


def _measure_stages_here(job: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every process: process 0 times ``job["stages"]`` on its device
    (:func:`_stage_measures`) while the others wait; all get the measures."""
    import jax

    from pdjax.distributed import broadcast_json

    measured = _stage_measures(job, jax.local_devices()[0]) if jax.process_index() == 0 else []
    got: list[dict[str, Any]] = broadcast_json(measured, timeout=1800.0)
    return got


def _worker_job(job: Mapping[str, Any]) -> None:
    """Every process of a launch: builds the runners, warms them up, times them round-robin;
    process 0 writes ``{runner: [seconds per timed call]}``."""
    from pdjax.distributed import allgather_json, config_from_env, initialize

    config = config_from_env()
    if config is not None and config.num_processes > 1:
        initialize(config)
    import jax

    calibration = _measure_links(job) if job.get("calibrate") else None
    if job.get("stages"):  # the candidate stages, in this launch, beside its runners
        measured = _measure_stages_here(job)
        if calibration is not None:
            calibration["stages"] = measured
    runners = [_make_runner(job, r) for r in job["runners"]]
    for _ in range(2):  # compile, first transfers; the first call after is slow still
        for name, call in runners:
            allgather_json(name)  # every process done with the runner before
            call()
    times: dict[str, list[float]] = {name: [] for name, _ in runners}
    # per runner, this process's CPU seconds in the timed calls: the driver's thread, the
    # other threads (XLA's programs and transfers), and the calls' wall seconds
    cpu: dict[str, list[float]] = {name: [0.0, 0.0, 0.0] for name, _ in runners}
    driver = threading.get_native_id()
    for _ in range(job["repeats"]):
        for name, call in runners:
            allgather_json(name)  # start together
            before = thread_seconds()
            times[name].append(call())
            after = thread_seconds()
            spent = {t: after[t] - before.get(t, 0.0) for t in after}
            mine = spent.pop(driver, 0.0)
            cpu[name][0] += mine
            cpu[name][1] += sum(spent.values())
            cpu[name][2] += times[name][-1]
    cpu_all = allgather_json(cpu if thread_seconds() else {})
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
        out["_cpu"] = cpu_all
        Path(job["out"]).write_text(json.dumps(out))


def thread_seconds() -> dict[int, float]:
    """CPU seconds per thread of this process, by thread id, from Linux's
    ``/proc/self/task``: the scheduler's nanoseconds on a CPU (``schedstat``), else user
    and system ticks (``stat``); empty where neither exists."""
    out: dict[int, float] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
            continue
        except (OSError, IndexError, ValueError):
            pass
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return out


def _make_runner(job: Mapping[str, Any], r: Mapping[str, Any]) -> tuple[str, Callable[[], float]]:
    """``(name, call)``: ``call()`` trains ``r["units"]`` microbatches' worth and returns the
    seconds it took on this process (to the last result it holds)."""
    import jax
    import numpy as np

    from pdjax._sharding import held
    from pdjax.partition import StagePlan
    from pdjax.pipeline import Pipeline
    from pdjax.runners import DataParallel, Runner
    from pdjax.schedules import STREAMING

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
            schedule=ScheduleSpec(
                name, microbatches=r.get("microbatches", 1), extra_in_flight=r.get("extra", 0)
            ),
            devices=jax.devices(),
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.harness.cluster (worker|profile) JOB_JSON`` (the driver starts
    these)."""
    from pdjax.distributed import watch_launcher

    watch_launcher()  # ends this worker if its launcher dies
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] not in ("worker", "profile"):
        print(
            "usage: python -m benchmarks.harness.cluster (worker|profile) JOB_JSON", file=sys.stderr
        )
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
        print(f"benchmarks.harness.cluster {argv[0]}: error: {e}", file=sys.stderr)
        return 2
    return 0
