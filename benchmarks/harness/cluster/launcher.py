"""Starting the cluster benchmark's worker processes: a launch of pinned workers (on an
emulated network or loopback), watched and ended together.

Every worker is ``python -m benchmarks.harness.cluster (worker|profile) JOB_JSON`` (what it runs:
:mod:`benchmarks.harness.cluster.worker`), pinned to one core with ``taskset``, with one CPU device
and XLA's intra-op threading off; on an emulated network each runs in a network namespace
of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdjax._allocator import ENVIRONMENT
from pdjax.errors import ClusterError

#: XLA flags for a worker that computes on one core.
_ONE_CORE = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
LAUNCH_TIMEOUT = 300.0  # seconds for one launch of the workers

#: glibc allocator settings for every worker (see :func:`_python_env`): blocks up to 32 MB
#: from the heap, which is never trimmed below 1 GB (what ``pdjax train`` sets by itself).
_FIXED_MALLOC = dict(ENVIRONMENT)


def _python_env(extra: Mapping[str, str]) -> dict[str, str]:
    # the repository's root, which holds the benchmarks package (and, in a checkout, pdjax):
    # what ``python -m benchmarks.harness.cluster`` needs wherever the driver runs from (not
    # a package folder itself, whose profile/ would shadow the standard library's module)
    root = str(Path(__file__).resolve().parents[3])
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


def run_processes(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    what: str,
    timeout: float = LAUNCH_TIMEOUT,
) -> None:
    """Runs the processes together, bounded by ``timeout`` seconds; ends them all (their
    process groups: SIGTERM, then SIGKILL) when one fails, at the timeout, or when this
    launcher gets SIGTERM, SIGINT or SIGHUP; raises :class:`ClusterError` with the failing
    one's output (:class:`~pdjax.errors.LaunchInterrupted` on a signal). Each gets the
    launcher's :class:`~pdjax.distributed.Lifeline`; build ``commands`` with
    :func:`~pdjax.distributed.orphan_proof` for a launcher killed outright to take them
    with it."""
    from pdjax.distributed import describe_exit, end_process_groups, ending_on_signals, lifeline

    logs = [tempfile.TemporaryFile() for _ in commands]
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + timeout
    failed = None
    with ending_on_signals() as guard, lifeline() as line:
        try:
            for c, e, log in zip(commands, envs, logs, strict=True):
                with guard.hold():  # no orphan from a Popen that a signal interrupts
                    procs.append(line.start(c, e, stdout=log, stderr=log))
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


def profile_on_workers(
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
    from pdjax.distributed import orphan_proof
    from pdjax.profile import Profile

    out = workdir / f"profile-{model}.json"
    job = {"model": model, "microbatch": microbatch, "seed": seed, "out": str(out),
           "stages": [list(st) for st in stages], "optimizer": optimizer[0],
           "learning_rate": optimizer[1]}  # fmt: skip
    run_processes(
        [
            [
                "taskset",
                "-c",
                "0",
                *orphan_proof(
                    [sys.executable, "-m", "benchmarks.harness.cluster", "profile", json.dumps(job)]
                ),
            ]
        ],
        [_python_env({})],
        f"profiling {model}",
        timeout=LAUNCH_TIMEOUT + 10 * len(stages),
    )
    data = json.loads(out.read_text())
    return Profile.from_json(data["profile"]), data["updates"], data["stages"]


def launch(
    job: dict[str, Any],
    workers: int,
    rate_mbit: float | None,
    emulate: bool,
    workdir: Path,
    *,
    module: str = "benchmarks.harness.cluster",
    timeout: float | None = None,
) -> dict[str, Any]:
    """One launch: ``workers`` pinned processes (on an emulated network when ``emulate``),
    each running ``python -m module worker JOB``; returns the JSON process 0 writes to
    ``job["out"]``. ``timeout``: seconds (default: by the number of runners)."""
    from benchmarks.harness.netem import EmulatedNetwork
    from pdjax.distributed import free_port, orphan_proof

    out = workdir / f"run-{time.monotonic_ns()}.json"
    job = {**job, "out": str(out)}
    # behind taskset (and ip netns exec), which run it in their own process
    argv = orphan_proof([sys.executable, "-m", module, "worker", json.dumps(job)])
    cores = os.cpu_count() or 1
    if timeout is None:
        timeout = LAUNCH_TIMEOUT + 30.0 * len(job["runners"])

    def pinned(i: int) -> list[str]:
        return ["taskset", "-c", str(i % cores), *argv]

    if workers == 1:
        run_processes([pinned(0)], [_python_env({})], f"{job['model']} alone", timeout=timeout)
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
            run_processes(commands, envs, what, timeout=timeout)
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
        run_processes([pinned(i) for i in range(workers)], envs, what, timeout=timeout)
    result: dict[str, Any] = json.loads(out.read_text())
    return result
