"""Several processes, one pipeline: JAX's multi-controller runtime for pdjax.

Every process runs the same driver after :func:`initialize`; the plan's device ids index
``jax.devices()``, the global device list (process 0's devices first), and each process
dispatches only the actions of its own stages (see :class:`pdjax.pipeline.Pipeline`).
Activations and gradients cross processes with ``jax.device_put``; on CPU this needs
``jax_cross_host_transfer_socket_address`` with a fixed port per process, which
:func:`initialize` sets (coordinator port + 1 + process id, unless given).

If a process dies, JAX's coordination service stops the others after
``heartbeat_timeout`` seconds (they abort with "Terminating process because the JAX
distributed service detected fatal errors ... another task died"); a process that
never joins fails the others after ``init_timeout`` seconds. :func:`launch_local` starts
``N`` processes on this machine for trying it out, optionally one core each, and ends
them all when one fails.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdjax.errors import PdjaxError

__all__ = [
    "DistributedConfig",
    "allgather_json",
    "broadcast_json",
    "check_cpu_transfers",
    "config_from_env",
    "free_port",
    "initialize",
    "launch_local",
]


class DistributedError(PdjaxError):
    """A multi-process run could not start, or one of its processes failed."""


@dataclass(frozen=True)
class DistributedConfig:
    """Where a process stands in a multi-process run.

    Attributes:
      coordinator: ``HOST:PORT`` of process 0's coordination service.
      num_processes: processes in the run.
      process_id: this process (0-based).
      cpu_devices: on CPU, devices per process (``jax_num_cpu_devices``); None: leave it.
      transfer_port: this process's port for cross-process transfers on CPU (default:
        coordinator port + 1 + process id); 0 disables setting it.
      transfer_host: the address other processes reach this one at (default: the
        coordinator's host, right for one machine; give each host's own on a cluster).
      init_timeout: seconds to wait for every process to join.
      heartbeat_timeout: seconds after which a silent process counts as dead and the
        others are stopped.
    """

    coordinator: str
    num_processes: int
    process_id: int
    cpu_devices: int | None = None
    transfer_port: int | None = None
    transfer_host: str | None = None
    init_timeout: int = 60
    heartbeat_timeout: int = 10

    def __post_init__(self) -> None:
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise DistributedError(
                f"process id {self.process_id} is not in 0..{self.num_processes - 1}"
            )
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise DistributedError(f"coordinator must be HOST:PORT, got {self.coordinator!r}")


def config_from_env(env: Mapping[str, str] | None = None) -> DistributedConfig | None:
    """The run described by ``PDJAX_COORDINATOR``/``PDJAX_NUM_PROCESSES``/``PDJAX_PROCESS_ID``
    (or JAX's ``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``), plus
    optional ``PDJAX_CPU_DEVICES``, ``PDJAX_TRANSFER_PORT``, ``PDJAX_TRANSFER_HOST`` (this
    process's address for transfers) and ``PDJAX_HEARTBEAT_TIMEOUT``;
    None when unset."""
    env = os.environ if env is None else env

    def get(name: str) -> str | None:
        return env.get(f"PDJAX_{name}") or env.get(f"JAX_{name}")

    coordinator = env.get("PDJAX_COORDINATOR") or env.get("JAX_COORDINATOR_ADDRESS")
    if not coordinator:
        return None
    try:
        return DistributedConfig(
            coordinator=coordinator,
            num_processes=int(get("NUM_PROCESSES") or 1),
            process_id=int(get("PROCESS_ID") or 0),
            cpu_devices=int(env["PDJAX_CPU_DEVICES"]) if env.get("PDJAX_CPU_DEVICES") else None,
            transfer_port=int(env["PDJAX_TRANSFER_PORT"])
            if env.get("PDJAX_TRANSFER_PORT")
            else None,
            transfer_host=env.get("PDJAX_TRANSFER_HOST") or None,
            heartbeat_timeout=int(env.get("PDJAX_HEARTBEAT_TIMEOUT") or 10),
        )
    except ValueError as e:
        raise DistributedError(f"bad multi-process environment: {e}") from e


def initialize(config: DistributedConfig) -> None:
    """Joins the multi-process run (before any other JAX call in this process)."""
    import jax

    host, _, port = config.coordinator.rpartition(":")
    if config.cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", config.cpu_devices)
    transfer_port = (
        int(port) + 1 + config.process_id if config.transfer_port is None else config.transfer_port
    )
    if transfer_port:  # port 0 would hang the receiver of a cross-process device_put on CPU
        address = f"{config.transfer_host or host}:{transfer_port}"
        jax.config.update("jax_cross_host_transfer_socket_address", address)
        # the bulk data connections (default 0.0.0.0:0, which a peer cannot reach when
        # the processes are on different hosts or network namespaces)
        bulk = ",".join([f"{config.transfer_host or host}:0"] * 4)
        jax.config.update("jax_cross_host_transport_addresses", bulk)
    try:
        jax.distributed.initialize(
            config.coordinator,
            num_processes=config.num_processes,
            process_id=config.process_id,
            initialization_timeout=config.init_timeout,
            heartbeat_timeout_seconds=config.heartbeat_timeout,
            shutdown_timeout_seconds=config.heartbeat_timeout,
        )
    except Exception as e:
        raise DistributedError(
            f"process {config.process_id} could not join {config.coordinator} "
            f"({config.num_processes} processes) within {config.init_timeout} s: {e}"
        ) from e


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (with room for the transfer ports after)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 60000:
            return port
    raise DistributedError("no free port found on 127.0.0.1")


def launch_local(
    argv: Sequence[str],
    num_processes: int,
    *,
    pin: bool = False,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cpu_devices: int | None = None,
) -> int:
    """Runs ``python argv...`` in ``num_processes`` processes on this machine, joined on
    127.0.0.1 through the ``PDJAX_*`` environment variables (see :func:`config_from_env`).

    ``pin=True`` runs process ``i`` on core ``i`` (``taskset -c i``). When one process
    fails, the others are ended; a run longer than ``timeout`` seconds is ended too.

    Returns:
      0 when every process succeeded.

    Raises:
      DistributedError: naming the first process that failed (or the timeout).
    """
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    base = {**os.environ, **(env or {})}
    try:
        for i in range(num_processes):
            penv = {
                **base,
                "PDJAX_COORDINATOR": f"127.0.0.1:{port}",
                "PDJAX_NUM_PROCESSES": str(num_processes),
                "PDJAX_PROCESS_ID": str(i),
            }
            if cpu_devices is not None:
                penv["PDJAX_CPU_DEVICES"] = str(cpu_devices)
            cmd = [sys.executable, *argv]
            if pin:
                cmd = ["taskset", "-c", str(i % (os.cpu_count() or 1)), *cmd]
            procs.append(subprocess.Popen(cmd, env=penv, start_new_session=True))
        start = time.monotonic()
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, c = failed[0]
                raise DistributedError(f"process {i} of {num_processes} failed (exit {c})")
            if all(c == 0 for c in codes):
                return 0
            if timeout is not None and time.monotonic() - start > timeout:
                raise DistributedError(f"the {num_processes} processes ran over {timeout} s")
            time.sleep(0.05)
    finally:
        _end(procs)


def _end(procs: Sequence[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """Ends the processes (and their children) still running: SIGTERM, then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# -- small messages between processes ---------------------------------------------------------
#
# Through the coordination service's key-value store, not XLA collectives: a process
# waiting here leaves XLA's threads free, so the cross-process transfers it started
# (which its peers may be waiting for) go on. An XLA collective at that point can wait
# for the peers while the transfers they need wait behind it.

_messages = itertools.count()  # every process calls these in the same order


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise DistributedError("not in a multi-process run (call initialize first)")
    return client


def allgather_json(value: Any, timeout: float = 600.0) -> list[Any]:
    """Every process's JSON-able ``value``, in process order, on every process (collective:
    all call it, in the same order)."""
    import jax

    n = next(_messages)
    if jax.process_count() == 1:
        return [value]
    client = _client()
    client.key_value_set(f"pdjax/msg/{n}/{jax.process_index()}", json.dumps(value))
    return [
        json.loads(client.blocking_key_value_get(f"pdjax/msg/{n}/{q}", int(timeout * 1000)))
        for q in range(jax.process_count())
    ]


def broadcast_json(value: Any, source: int = 0, timeout: float = 600.0) -> Any:
    """Process ``source``'s JSON-able ``value`` on every process (collective; the others'
    ``value`` is ignored)."""
    import jax

    n = next(_messages)
    if jax.process_count() == 1:
        return value
    client = _client()
    key = f"pdjax/msg/{n}/{source}"
    if jax.process_index() == source:
        client.key_value_set(key, json.dumps(value))
        return value
    return json.loads(client.blocking_key_value_get(key, int(timeout * 1000)))


def check_cpu_transfers(what: str) -> None:
    """Refuses more than 2 processes on CPU for ``what``, which moves arrays between
    processes with ``jax.device_put``.

    JAX's CPU cross-process transfers (the socket transport of
    ``jax_cross_host_transfer_socket_address``, jax 0.10) match a receive to a send by
    counting the transfers per sender, not per sender and receiver: a process that sends
    to two others leaves one of them waiting for ever, or handing it the other's array
    (seen with 3 processes on loopback). With 2 processes every transfer is between the
    same pair, and pdjax's tests check the results bit for bit.

    Raises:
      DistributedError: with more than 2 processes on CPU.
    """
    import jax

    if jax.process_count() > 2 and jax.devices()[0].platform == "cpu":
        raise DistributedError(
            f"{what} moves arrays between processes, and JAX's CPU transfers between more "
            f"than 2 processes ({jax.process_count()} here) can hang or deliver an array to "
            "the wrong process (they are matched per sender, not per pair); use 2 processes "
            "on CPU (each with several devices), or data parallelism, which goes through "
            "JAX's collectives"
        )
