"""Several processes, one pipeline: 2 processes x 2 CPU devices on 127.0.0.1 train like
1 process x 4 devices.

Worker processes (this file run as a script) join by ``jax.distributed`` on loopback
only; every subprocess is bounded in time and ended by process group if it outlives its
launch. The tests that compare finished runs share one launch per process count (each
launch runs their scenarios in turn: :data:`TWO`, :data:`FOUR`); the tests of failures
launch their own.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from pdjax.schedules import ScheduleSpec

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 90.0  # seconds for one launch of worker processes
STEPS, M, MB = 2, 4, 4  # optimizer steps (flush) / microbatches per step / samples each


def _setup(schedule: str, span: bool = False, three: bool = False, transport: str = "auto"):
    """The model, pipeline and microbatches every run uses (same in every process);
    ``span``: stage 1 replicated on devices 1 and 2, one in each process; ``three``: 3
    stages on devices 0, 1, 2."""
    from pdjax.models import get_model
    from pdjax.partition import StagePlan
    from pdjax.pipeline import Pipeline, even_stages

    spec = get_model("mlp", "tiny")
    if span:
        stages = [StagePlan(0, 0, (0,)), StagePlan(1, 1, (1, 2)), StagePlan(2, 3, (3,))]
    elif three:
        stages = [StagePlan(0, 0, (0,)), StagePlan(1, 1, (1,)), StagePlan(2, 3, (2,))]
    else:
        stages = even_stages(len(spec.layers), 4)
    pipe = Pipeline(
        spec.layers,
        stages,
        spec.loss,
        optax.sgd(0.05),
        schedule=ScheduleSpec(schedule, microbatches=M),
        transport=transport,
    )
    key = jax.random.key(0)
    n = STEPS * M * MB
    x, y = spec.sample_input(n, key), spec.sample_target(n, key)
    mbs = [jax.tree.map(lambda a, k=k: a[k * MB : (k + 1) * MB], (x, y)) for k in range(n // MB)]
    state = pipe.init(jax.random.key(3), mbs[0][0])
    return pipe, state, mbs


def _train(schedule: str, span: bool = False, three: bool = False, transport: str = "auto"):
    """Trains; returns {layer index: params} of every stage, and the losses."""
    pipe, state, mbs = _setup(schedule, span, three, transport)
    losses = []
    if schedule == "pipedream":
        state, metrics = pipe.run(state, mbs)
        losses += metrics.losses
    else:
        for t in range(STEPS):
            state, metrics = pipe.run(state, mbs[t * M : (t + 1) * M])
            losses += metrics.losses
    # collective across processes: every process gets every stage's variables
    variables = pipe.variables(state)
    out = {i: jax.tree.map(np.asarray, v["params"]) for i, v in enumerate(variables)}
    return out, [float(v) for v in losses]


@functools.cache
def _reference(schedule: str, span: bool = False):
    """:func:`_train` in this process on 4 devices: the run the processes must match,
    computed once per pytest worker (several tests compare against the same run)."""
    return _train(schedule, span)


def _flat(params) -> dict[str, np.ndarray]:
    return {
        f"{i}/{jax.tree_util.keystr(path)}": np.asarray(leaf)
        for i, p in params.items()
        for path, leaf in jax.tree_util.tree_leaves_with_path(p)
    }


def _all_params(pipe, state) -> dict[str, np.ndarray]:
    return _flat({i: v["params"] for i, v in enumerate(pipe.variables(state))})


def _checkpoint_worker(out_dir: str, path: str) -> None:
    """Trains half, saves (collectively), trains on; restores the save into a new
    pipeline, trains the same second half and checks it ends as the first; writes the
    first's result to ``path``."""
    from pdjax.runners import Checkpointer

    half = STEPS * M // 2
    pipe, state, mbs = _setup("pipedream")
    state, _ = pipe.run(state, mbs[:half])
    with Checkpointer(os.path.join(out_dir, "ckpt")) as ckpt:
        ckpt.save(half, state, extra={"note": "two processes"})
    on, _ = pipe.run(state, mbs[half:])
    fresh, template, _ = _setup("pipedream")
    with Checkpointer(os.path.join(out_dir, "ckpt")) as ckpt:
        assert ckpt.all_steps() == [half]
        restored, extra = ckpt.restore(template)
    assert extra == {"note": "two processes"}, extra
    resumed, _ = fresh.run(restored, mbs[half:])
    on, resumed = _all_params(pipe, on), _all_params(fresh, resumed)
    np.savez(path, **on)
    for k in on:
        np.testing.assert_array_equal(on[k], resumed[k], err_msg=k)


def _dp_train():
    """Data parallelism over every device (2 processes x 2 devices, or 1 x 4): params."""
    from pdjax.models import get_model
    from pdjax.runners import DataParallel

    spec = get_model("mlp", "tiny")
    x, y = spec.sample_batch(16, jax.random.key(0))
    dp = DataParallel(spec.layers, spec.loss, optax.sgd(0.05))
    state = dp.init(jax.random.key(3), x)
    losses = []
    for _ in range(3):
        state, metrics = dp.step(state, (x, y))
        losses += [float(v) for v in metrics.losses]
    params = [p for p in state.params]  # replicated: every process holds all of them
    return _flat({i: jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), p)
                  for i, p in enumerate(params)}), losses  # fmt: skip


def _sharded_train():
    """Llama tiny, a sharded stage per process: stage 0 on devices 0-1 as (tensor 2),
    stage 1 on devices 2-3 as (fsdp 2), 1f1b; every stage's params, and the losses."""
    from pdjax.models import get_model
    from pdjax.partition import StagePlan
    from pdjax.pipeline import Pipeline

    spec = get_model("llama", "tiny")
    stages = [
        StagePlan(0, 1, (0, 1), mesh={"tensor": 2}),
        StagePlan(2, 3, (2, 3), mesh={"fsdp": 2}),
    ]
    pipe = Pipeline(
        spec.layers,
        stages,
        spec.loss,
        optax.adamw(1e-2),
        schedule=ScheduleSpec("1f1b", microbatches=M),
    )
    key = jax.random.key(0)
    n = STEPS * M * MB
    x, y = spec.sample_input(n, key), spec.sample_target(n, key)
    mbs = [jax.tree.map(lambda a, k=k: a[k * MB : (k + 1) * MB], (x, y)) for k in range(n // MB)]
    state = pipe.init(jax.random.key(3), mbs[0][0])
    losses = []
    for t in range(STEPS):
        state, metrics = pipe.run(state, mbs[t * M : (t + 1) * M])
        losses += [float(v) for v in metrics.losses]
    return _all_params(pipe, state), losses


#: What one launch of 2 processes x 2 devices runs, in order (each result saved under its
#: name): the tests comparing them share the launch (:func:`two_processes`).
TWO = ("pipedream", "1f1b", "checkpoint", "dp", "span-1f1b", "span-pipedream", "sharded")
#: The same for 4 processes x 1 device (:func:`four_processes`).
FOUR = ("pipedream", "1f1b", "span-1f1b", "checkpoint")


def _scenario(name: str, out_dir: str) -> None:
    """Runs one scenario in every process; saves ``{name}-{process}.npz``."""
    path = os.path.join(out_dir, f"{name}-{jax.process_index()}.npz")

    def save(flat: dict[str, np.ndarray], losses: list[float]) -> None:
        np.savez(path, **flat, losses=np.asarray(losses))

    if name == "checkpoint":
        _checkpoint_worker(out_dir, path)
    elif name == "dp":
        save(*_dp_train())
    elif name == "sharded":
        save(*_sharded_train())
    else:  # span-: stage 1 on one device of each of 2 processes
        params, losses = _train(name.removeprefix("span-"), span=name.startswith("span-"))
        save(_flat(params), losses)


def _worker(schedule: str, out_dir: str, die: str) -> None:
    from pdjax.distributed import config_from_env, initialize

    config = config_from_env()
    initialize(config)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_threefry_partitionable", False)  # as tests/conftest.py
    pid = jax.process_index()
    if schedule in ("two", "four"):
        for name in TWO if schedule == "two" else FOUR:
            _scenario(name, out_dir)
        return
    if schedule.startswith("threecol-"):  # 3 processes, collective transfers
        if die == str(pid):
            _setup(schedule[9:], three=True)
            os._exit(7)  # dies before its first transfer; the others wait on it
        _train(schedule[9:], three=True)
        return
    if schedule.startswith("three-"):  # device_put transfers between 3 processes: refused
        _train(schedule[6:], three=True, transport="device_put")
        return
    if die == str(pid):
        _setup(schedule)
        os._exit(7)  # dies before its first transfer; the peer is waiting on it
    _train(schedule)


def _launch(
    tmp_path: Path,
    schedule: str,
    die: str = "",
    procs: int = 2,
    devices: int = 2,
    budget: float = BUDGET,
) -> list[tuple[int, str, float]]:
    """Runs the workers (``procs`` processes of ``devices`` CPU devices); returns per
    process (exit code, output, seconds)."""
    from pdjax.distributed import free_port

    port = free_port()
    n, procs = procs, []
    t0 = time.monotonic()
    deadline = t0 + budget
    for i in range(n):
        env = {
            **os.environ,
            "PDJAX_COORDINATOR": f"127.0.0.1:{port}",
            "PDJAX_NUM_PROCESSES": str(n),
            "PDJAX_PROCESS_ID": str(i),
            "PDJAX_CPU_DEVICES": str(devices),
            "PDJAX_HEARTBEAT_TIMEOUT": "5",
            "PYTHONPATH": str(ROOT),
        }
        log = open(tmp_path / f"log{i}.txt", "w+b")
        cmd = [sys.executable, __file__, schedule, str(tmp_path), die]
        procs.append(
            (subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True), log)
        )
    results = []
    try:
        for p, log in procs:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            code = p.poll()
            log.seek(0)
            text = log.read().decode(errors="replace")
            if code is None:
                text += f"\n[still running after the {budget:.0f} s budget: killed]"
            results.append((code, text, time.monotonic() - t0))
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    return results


def _all_succeeded(results: list[tuple[int, str, float]]) -> None:
    for i, (code, log, _) in enumerate(results):
        assert code == 0, f"process {i} exit {code}:\n{log[-3000:]}"


def _assert_saved(files: list[Path], want: dict[str, np.ndarray], losses=None, exact=True):
    """Every worker's saved arrays (and losses, when given) against ``want``: bit for bit,
    or (``exact=False``) to rtol 1e-6 (sums across processes may run in another order)."""
    for path in files:
        with np.load(path) as f:
            assert sorted(f.files) == sorted([*want, "losses"] if losses is not None else want)
            for k in want:
                if exact:
                    np.testing.assert_array_equal(f[k], want[k], err_msg=f"{path.name}: {k}")
                else:
                    np.testing.assert_allclose(
                        f[k], want[k], rtol=1e-6, atol=1e-7, err_msg=f"{path.name}: {k}"
                    )
            if losses is not None:
                if exact:
                    np.testing.assert_array_equal(f["losses"], losses, err_msg=path.name)
                else:
                    np.testing.assert_allclose(f["losses"], losses, rtol=1e-6)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One launch of 2 processes x 2 CPU devices running every scenario of :data:`TWO`
    (the tests below check one each): its folder."""
    out = tmp_path_factory.mktemp("two")
    _all_succeeded(_launch(out, "two", budget=2 * BUDGET))
    return out


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    """One launch of 4 processes x 1 CPU device running :data:`FOUR`: its folder."""
    out = tmp_path_factory.mktemp("four")
    _all_succeeded(_launch(out, "four", procs=4, devices=1, budget=2 * BUDGET))
    return out


def _saved(folder: Path, name: str, procs: int) -> list[Path]:
    return [folder / f"{name}-{i}.npz" for i in range(procs)]


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b"])
def test_two_processes_train_like_one(two_processes, schedule):
    params, losses = _reference(schedule)  # the same pipeline in this process on 4 devices
    want = _flat(params)
    # each process has all of them (Pipeline.variables gathers)
    _assert_saved(_saved(two_processes, schedule, 2), want, losses)
    _, state, _ = _setup(schedule)  # and training did move them
    assert not np.allclose(
        want["0/['dense']['kernel']"], np.asarray(state.params[0][0]["dense"]["kernel"])
    )


def _resumed_here(folder: Path) -> dict[str, np.ndarray]:
    """The processes' checkpoint restored in this process on 4 devices, trained on."""
    from pdjax.runners import Checkpointer

    half = STEPS * M // 2
    pipe, template, mbs = _setup("pipedream")
    with Checkpointer(folder / "ckpt") as ckpt:
        restored, _ = ckpt.restore(template)
    return _all_params(pipe, pipe.run(restored, mbs[half:])[0])


def test_checkpoint_across_processes(two_processes):
    """2 processes save one checkpoint together (each stage from its own process); it
    restores there into a new pipeline, and in one process on 4 devices, and both go on
    training exactly as the run that never stopped."""
    _assert_saved(_saved(two_processes, "checkpoint", 2), _resumed_here(two_processes))


def test_data_parallel_across_processes(two_processes):
    """DataParallel over 2 processes x 2 devices (the gradient all-reduce crosses
    processes, through JAX's CPU collectives) trains as over 4 devices in one process."""
    want, losses = _dp_train()
    _assert_saved(_saved(two_processes, "dp", 2), want, losses, exact=False)


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_a_replicated_stage_spans_processes(two_processes, schedule):
    """Stage 1 is replicated on one device of each process (its gradient all-reduce
    crosses processes; activations are split between its replicas and gathered after):
    training matches the same plan in one process."""
    params, losses = _reference(schedule, span=True)
    saved = _saved(two_processes, f"span-{schedule}", 2)
    _assert_saved(saved, _flat(params), losses, exact=False)


def test_sharded_stages_one_per_process_train_like_one_process(two_processes):
    """A sharded stage in each process (tensor 2 in one, fsdp 2 in the other: activations
    and gradients cross between differently sharded stages, each shard once) trains bit
    for bit as the same plan in one process on 4 devices."""
    want, losses = _sharded_train()
    _assert_saved(_saved(two_processes, "sharded", 2), want, losses)


def test_device_put_between_three_processes_is_refused_with_a_reason(tmp_path):
    """JAX's CPU transfers pair a receive with a send by counting per sender: a process
    that sends to two others hangs one of them (or hands it the other's array). Asked for
    device_put transfers anyway, pdjax says so before any transfer."""
    results = _launch(tmp_path, "three-pipedream", procs=3, devices=1)
    for i, (code, log, _) in enumerate(results):
        assert code not in (0, None), f"process {i} did not fail:\n{log[-3000:]}"
        assert "more than 2 processes (3 here)" in log, log[-3000:]


def test_four_processes_train_like_one(four_processes):
    """4 processes x 1 CPU device, transfers through XLA collectives (the default there):
    pipedream and 1f1b over 4 stages train bit for bit as 4 devices in one process, and a
    stage replicated across processes 1 and 2 as in one process (its all-reduce crosses
    processes: rtol 1e-6)."""
    for name in ("pipedream", "1f1b"):
        params, losses = _reference(name)
        _assert_saved(_saved(four_processes, name, 4), _flat(params), losses)
    params, losses = _reference("1f1b", span=True)
    _assert_saved(_saved(four_processes, "span-1f1b", 4), _flat(params), losses, exact=False)


def test_checkpoint_across_four_processes(four_processes):
    """4 processes save one checkpoint (each stage's arrays reach process 0 through a
    collective), restore it among themselves, and it restores in one process; every
    resumed run goes on exactly as the run that never stopped."""
    _assert_saved(_saved(four_processes, "checkpoint", 4), _resumed_here(four_processes))


def test_dead_peer_stops_the_others_in_collectives(tmp_path):
    """Process 1 of 3 dies while the others wait in a collective transfer on it: they end
    with an error after the heartbeat timeout, not a hang."""
    results = _launch(tmp_path, "threecol-pipedream", die="1", procs=3, devices=1)
    assert results[1][0] == 7
    for i in (0, 2):
        code, log, _ = results[i]
        assert code not in (0, None), f"process {i} did not end:\n{log[-3000:]}"
        assert "another task died" in log or "unhealthy" in log or "died" in log, log[-3000:]


def test_dead_peer_stops_the_other(tmp_path):
    results = _launch(tmp_path, "1f1b", die="1")
    (code0, log0, _), (code1, _, _) = results
    assert code1 == 7
    assert code0 not in (0, None), f"process 0 did not end:\n{log0[-3000:]}"
    assert "another task died" in log0 or "unhealthy" in log0, log0[-3000:]


def test_local_launcher_ends_the_others_when_one_fails(tmp_path, monkeypatch):
    from pdjax.distributed import DistributedError, launch_local

    pid_file = tmp_path / "pid0"
    monkeypatch.setenv("PID_FILE", str(pid_file))
    code = (
        "import os, pathlib, sys, time\n"
        "if int(os.environ['PDJAX_PROCESS_ID']):\n"
        "    while not pathlib.Path(os.environ['PID_FILE']).exists(): time.sleep(0.01)\n"
        "    sys.exit(3)\n"
        "pathlib.Path(os.environ['PID_FILE']).write_text(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(DistributedError, match="process 1 of 2 failed"):
        launch_local(["-c", code], 2, timeout=300)
    # process 0 (asleep) was ended, not waited for: it is gone once the launcher raises
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
