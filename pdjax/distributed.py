"""Several processes, one pipeline: JAX's multi-controller runtime for pdjax.

Every process runs the same driver after :func:`initialize`; the plan's device ids index
``jax.devices()``, the global device list (process 0's devices first), and each process
dispatches only the actions of its own stages (see :class:`pdjax.pipeline.Pipeline`).
Activations and gradients cross processes with ``jax.device_put``; on CPU this needs
``jax_cross_host_transfer_socket_address`` with a fixed port per process, which
:func:`initialize` sets (coordinator port + 1 + process id, unless given).

If a process dies, JAX's coordination service stops the others after
``heartbeat_timeout`` seconds (they abort with "Terminating process because the JAX
distributed service detected fatal errors ... another task died"). A process that never
joins is caught before JAX's own start-up: process 0 waits ``init_timeout`` seconds on the
coordinator's port for every other process to say hello, and then every process ends with a
:class:`DistributedError` naming the missing ones (JAX would abort them all with a C++
stack instead). :func:`launch_local` starts ``N`` processes on this machine for trying it
out, optionally one core each, and ends them all when one fails or when it gets SIGTERM,
SIGINT or SIGHUP. A launcher killed outright (SIGKILL, or a crash) cannot end them, so
they end themselves (see :class:`Lifeline`): on Linux the kernel kills each with its
launcher (``PR_SET_PDEATHSIG``), and everywhere a process of pdjax's watches a pipe from
its launcher (:func:`watch_launcher`) and ends when it closes.

What listens: process 0's coordination service (and the join hello before it) on the
coordinator's ``HOST:PORT`` only (or ``bind_address``), and on CPU each process's transfer
socket on its ``transfer_host``; on :func:`launch_local`'s runs all of them are 127.0.0.1.
The coordination service is gRPC without authentication or encryption.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from pdjax.errors import DistributedError, LaunchInterrupted

__all__ = [
    "LAUNCHER_PIPE_ENV",
    "PEER_GONE",
    "DistributedConfig",
    "DistributedError",
    "LaunchInterrupted",
    "Lifeline",
    "allgather_json",
    "broadcast_json",
    "check_cpu_transfers",
    "config_from_env",
    "describe_exit",
    "end_process_groups",
    "ending_on_signals",
    "free_port",
    "initialize",
    "launch_local",
    "lifeline",
    "lost_peer",
    "orphan_proof",
    "run_position",
    "say",
    "watch_launcher",
]


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
      bind_address: ``HOST:PORT`` process 0's coordination service listens on (default:
        ``coordinator`` itself, so only that address is reachable; give
        ``0.0.0.0:PORT`` only behind a firewall, e.g. where the coordinator's host name
        resolves to another address on its own machine).
    """

    coordinator: str
    num_processes: int
    process_id: int
    cpu_devices: int | None = None
    transfer_port: int | None = None
    transfer_host: str | None = None
    init_timeout: int = 60
    heartbeat_timeout: int = 10
    bind_address: str | None = None

    def __post_init__(self) -> None:
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise DistributedError(
                f"process id {self.process_id} is not in 0..{self.num_processes - 1}"
            )
        for name in ("coordinator", "bind_address"):
            address = getattr(self, name)
            host, _, port = (address or "h:0").rpartition(":")
            if not host or not port.isdigit():
                raise DistributedError(
                    f"{name} must be HOST:PORT (brackets around an IPv6 host), got {address!r}"
                )
        if self.init_timeout < 1:
            raise DistributedError(f"init_timeout must be >= 1 s, got {self.init_timeout}")


def config_from_env(env: Mapping[str, str] | None = None) -> DistributedConfig | None:
    """The run described by ``PDJAX_COORDINATOR``/``PDJAX_NUM_PROCESSES``/``PDJAX_PROCESS_ID``
    (or JAX's ``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``), plus
    optional ``PDJAX_CPU_DEVICES``, ``PDJAX_TRANSFER_PORT``, ``PDJAX_TRANSFER_HOST`` (this
    process's address for transfers), ``PDJAX_HEARTBEAT_TIMEOUT``, ``PDJAX_INIT_TIMEOUT``
    and ``PDJAX_COORDINATOR_BIND`` (or ``JAX_COORDINATOR_BIND_ADDRESS``: see
    :class:`DistributedConfig`'s ``bind_address``); None when unset."""
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
            init_timeout=int(env.get("PDJAX_INIT_TIMEOUT") or 60),
            bind_address=env.get("PDJAX_COORDINATOR_BIND")
            or env.get("JAX_COORDINATOR_BIND_ADDRESS")
            or None,
        )
    except ValueError as e:
        raise DistributedError(f"bad multi-process environment: {e}") from e


def initialize(config: DistributedConfig) -> None:
    """Joins the multi-process run (before any other JAX call in this process).

    Process 0's coordination service listens on ``config.bind_address`` (default: the
    coordinator's own ``HOST:PORT``, so 127.0.0.1 for a local run), not on every interface.
    Before JAX starts, the processes meet on that port (see :func:`_rendezvous`), so a
    process that never joins ends every other one with a :class:`DistributedError` after
    ``init_timeout`` seconds, instead of JAX's abort. SIGTERM ends the process as before
    the call (JAX's preemption notifier would otherwise swallow it).

    Raises:
      DistributedError: naming the processes that did not join, or why joining failed.
    """
    import jax

    watch_launcher()  # before the wait for the other processes: a dead launcher ends it
    host, port = _split(config.coordinator)
    if config.cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", config.cpu_devices)
    _set_transfer_addresses(config, host, port)
    _rendezvous(config)
    sigterm = _sigterm_handler()
    try:
        jax.distributed.initialize(
            config.coordinator,
            num_processes=config.num_processes,
            process_id=config.process_id,
            initialization_timeout=config.init_timeout,
            heartbeat_timeout_seconds=config.heartbeat_timeout,
            shutdown_timeout_seconds=config.heartbeat_timeout,
            # JAX's default is [::]:PORT, every interface, for an unauthenticated service
            coordinator_bind_address=config.bind_address or config.coordinator,
        )
    except Exception as e:
        raise DistributedError(
            f"process {config.process_id} could not join {config.coordinator} "
            f"({config.num_processes} processes) within {config.init_timeout} s: {e}"
        ) from e
    finally:
        _restore_sigterm(sigterm)


def _split(address: str) -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``; an IPv6 host loses its brackets."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _set_transfer_addresses(config: DistributedConfig, host: str, port: int) -> None:
    """On CPU, where this process listens for cross-process transfers (see the module)."""
    import jax

    transfer_port = port + 1 + config.process_id
    if config.transfer_port is not None:
        transfer_port = config.transfer_port
    if not transfer_port:  # port 0 would hang the receiver of a cross-process device_put
        return
    here = config.transfer_host or host
    here = f"[{here}]" if ":" in here and not here.startswith("[") else here
    jax.config.update("jax_cross_host_transfer_socket_address", f"{here}:{transfer_port}")
    # the bulk data connections (default 0.0.0.0:0, which a peer cannot reach when the
    # processes are on different hosts or network namespaces, and which listens everywhere)
    jax.config.update("jax_cross_host_transport_addresses", ",".join([f"{here}:0"] * 4))


def _sigterm_handler() -> Any:
    """This process's SIGTERM handler now, to put back after JAX's initialize (whose
    preemption notifier catches SIGTERM and only logs it, so that a launcher's SIGTERM
    would not end the process); None off the main thread, where it cannot be put back."""
    if threading.current_thread() is not threading.main_thread():
        return None
    handler = signal.getsignal(signal.SIGTERM)
    return signal.SIG_DFL if handler is None else handler  # None: not set from Python


def _restore_sigterm(handler: Any) -> None:
    if handler is not None:
        signal.signal(signal.SIGTERM, handler)


# -- joining: every process says hello to process 0 before JAX starts ---------------------------
#
# JAX's coordination service fails a process that waits for a peer that never comes with a
# fatal log (abort, C++ stack, nothing that names the peer). So process 0 first listens on
# the coordinator's own port for a one-line hello from each other process and answers each
# "go" when all are there, or which are missing when init_timeout runs out; then it closes
# that socket and JAX's service takes the port. The peers close first, so the port is left
# without TIME_WAIT connections on process 0's side.

_HELLO = "pdjax-join"
_LINE = 128  # bytes at most in one protocol line


def _rendezvous(config: DistributedConfig) -> None:
    """Returns when every process of the run has said hello to process 0.

    Raises:
      DistributedError: naming the missing processes (process 0 tells the others too), or
        the coordinator that did not answer.
    """
    if config.num_processes == 1:
        return
    if config.process_id == 0:
        _gather(config)
    else:
        _join(config)


def _which(ids: Sequence[int]) -> str:
    return ("process " if len(ids) == 1 else "processes ") + ", ".join(map(str, ids))


def _missing(config: DistributedConfig, ids: Sequence[int]) -> DistributedError:
    they, their = ("it was", "its log") if len(ids) == 1 else ("they were", "their logs")
    return DistributedError(
        f"process {config.process_id} of {config.num_processes}: {_which(ids)} did not join "
        f"the coordinator at {config.coordinator} within {config.init_timeout} s; check that "
        f"{they} started with PDJAX_COORDINATOR={config.coordinator} and "
        f"PDJAX_NUM_PROCESSES={config.num_processes}, did not fail at start (see {their}), "
        f"and can reach {config.coordinator} over TCP (firewall)"
    )


def _readline(conn: socket.socket, deadline: float) -> str:
    """One line from ``conn`` by ``deadline`` (``time.monotonic``); "" on EOF or timeout."""
    data = b""
    while not data.endswith(b"\n") and len(data) < _LINE:
        left = deadline - time.monotonic()
        if left <= 0:
            return ""
        conn.settimeout(left)
        try:
            chunk = conn.recv(_LINE - len(data))
        except OSError:  # timeout, reset
            return ""
        if not chunk:
            return ""
        data += chunk
    return data.decode(errors="replace").strip()


def _listen(config: DistributedConfig) -> socket.socket:
    host, port = _split(config.bind_address or config.coordinator)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise DistributedError(
            f"process 0 cannot listen on {config.bind_address or config.coordinator}: {e}; "
            "choose a free port on an address of this machine (PDJAX_COORDINATOR)"
        ) from e


def _gather(config: DistributedConfig) -> None:
    """Process 0: waits for every other process's hello, then answers them all."""
    n, deadline = config.num_processes, time.monotonic() + config.init_timeout
    peers: dict[int, socket.socket] = {}
    with _listen(config) as server:
        try:
            while len(peers) < n - 1 and (left := deadline - time.monotonic()) > 0:
                server.settimeout(left)
                try:
                    conn, _ = server.accept()
                except OSError:  # timed out
                    break
                # a stranger's connection (a port scan) gets a few seconds, then is dropped
                words = _readline(conn, min(deadline, time.monotonic() + 5)).split()
                if len(words) != 3 or words[0] != _HELLO or not words[1].isdigit():
                    conn.close()
                    continue
                i = int(words[1])
                if words[2] != str(n) or not 0 < i < n or i in peers:
                    with contextlib.suppress(OSError):
                        conn.sendall(f"refused {n} {sorted(peers)}\n".encode())
                    conn.close()
                    continue
                peers[i] = conn
            missing = sorted(set(range(1, n)) - set(peers))
            reply = "go" if not missing else "missing " + ",".join(map(str, missing))
            for conn in peers.values():
                with contextlib.suppress(OSError):
                    conn.sendall(f"{reply}\n".encode())
            for conn in peers.values():  # let the peers close first (see above)
                _readline(conn, time.monotonic() + 5)
        finally:
            for conn in peers.values():
                conn.close()
    if missing:
        raise _missing(config, missing)


def _join(config: DistributedConfig) -> None:
    """Process 1 and up: says hello to process 0 (retrying until it listens) and waits for
    its answer."""
    host, port = _split(config.coordinator)
    i, n, timeout = config.process_id, config.num_processes, config.init_timeout
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            conn = socket.create_connection((host, port), timeout=min(left, 5.0))
        except OSError:  # refused: process 0 is not listening yet
            time.sleep(min(0.2, left))
            continue
        with conn:
            with contextlib.suppress(OSError):
                conn.sendall(f"{_HELLO} {i} {n}\n".encode())
            # process 0 answers by its own deadline, at most timeout s after we connected
            reply = _readline(conn, time.monotonic() + timeout + 5)
        if reply == "go":
            return
        if reply.startswith("missing "):
            raise _missing(config, [int(k) for k in reply.split()[1].split(",")])
        if reply.startswith("refused "):
            raise DistributedError(
                f"process {i} of {n}: the coordinator at {config.coordinator} refused it: it "
                f"runs {reply.split()[1]} processes, and has these joined already: "
                f"{reply.split(maxsplit=2)[2]}; give every process the same "
                "PDJAX_NUM_PROCESSES and a process id of its own"
            )
        raise DistributedError(
            f"process {i} of {n}: the coordinator at {config.coordinator} answered "
            f"{reply!r} instead of pdjax's join reply; is another program (or an older run) "
            "listening on that port? Choose another port (PDJAX_COORDINATOR)"
        )
    raise DistributedError(
        f"process {i} of {n}: the coordinator (process 0) at {config.coordinator} did not "
        f"answer within {timeout} s; check that process 0 started with the same "
        "PDJAX_COORDINATOR, did not fail at start (see its log), and that "
        f"{config.coordinator} is reachable from here over TCP (firewall)"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (with room for the transfer ports after)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port < 60000:
            return port
    raise DistributedError("no free port found on 127.0.0.1")


# -- launching: the launcher ends its workers however it ends -----------------------------------


#: What a launcher handles: ``kill``, Ctrl-C, and its terminal closing.
LAUNCH_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _SignalGuard:
    """Turns the first of :data:`LAUNCH_SIGNALS` into :class:`LaunchInterrupted` (raised in
    the main thread, like KeyboardInterrupt), so that the ``finally`` that ends the workers
    runs; later ones are ignored so that it finishes. Inside :meth:`hold` the raise waits
    for the end of the block: a Popen interrupted after its fork would orphan the child."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._holding = 0
        self._pending = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if self._holding:
            self._pending = True
        else:
            raise LaunchInterrupted(signum)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
        if self._pending and not self._holding and self.signum is not None:
            self._pending = False
            raise LaunchInterrupted(self.signum)


_guard: _SignalGuard | None = None  # the active one (guards nest: the outermost counts)


@contextlib.contextmanager
def ending_on_signals() -> Iterator[_SignalGuard]:
    """Within the block, :data:`LAUNCH_SIGNALS` raise :class:`LaunchInterrupted` (once),
    so a launcher's ``try/finally`` ends its workers and the launcher exits non-zero; the
    previous handlers come back after. Workers run in sessions of their own
    (``start_new_session``), so without this a launcher killed by a signal orphans them.
    Off the main thread (where Python cannot handle signals) nothing is installed."""
    global _guard
    if _guard is not None or threading.current_thread() is not threading.main_thread():
        yield _guard or _SignalGuard()
        return
    guard = _SignalGuard()
    previous = {s: signal.signal(s, guard.handle) for s in LAUNCH_SIGNALS}
    _guard = guard
    try:
        yield guard
    finally:
        _guard = None
        for s, handler in previous.items():
            signal.signal(s, handler)


# -- a launcher killed outright: its workers end themselves --------------------------------------
#
# A launcher that gets SIGKILL (or crashes) runs no ``finally``, and its workers, in
# sessions of their own, would train on as orphans. Two guards, each enough alone:
#
# * Linux: every worker runs first through a few lines of Python (:data:`_PARENT_DEATH`,
#   added by :func:`orphan_proof`) that ask the kernel to SIGKILL it when its launcher
#   dies (``prctl(PR_SET_PDEATHSIG)``, which survives ``exec``), check that the launcher
#   is still its parent (it may have died between the fork and the ``prctl``, and then
#   nothing would come), and ``exec`` the worker's own command in the same process. This
#   holds for any command, pdjax's or not, and needs no ``preexec_fn`` (unsafe in a
#   launcher with threads). SIGKILL rather than SIGTERM: a worker stuck in native code, or
#   whose SIGTERM JAX's preemption notifier swallows, would outlive a SIGTERM, and nothing
#   escalates once the launcher is gone; pdjax's outputs are written atomically.
# * Everywhere: the launcher holds the write end of a pipe whose read end every worker
#   gets (:class:`Lifeline`); the kernel closes it when the launcher dies, however it
#   dies, and a pdjax process that called :func:`watch_launcher` (``initialize``, ``pdjax
#   train``, the cluster benchmark's workers do) reads end-of-file and ends itself. A pipe
#   rather than polling the parent's pid: no pid to be reused, no polling, and a launcher
#   that died before the worker started watching is seen at once.

#: Where a launched process finds the read end of its launcher's pipe: ``FD:INODE``.
LAUNCHER_PIPE_ENV = "PDJAX_LAUNCHER_PIPE"

#: Runs ``argv[2:]`` in this process, to be killed with its parent (``argv[1]``, a pid).
_PARENT_DEATH = """
import os, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)  # the launcher died before the prctl: nothing would end this process
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    print(f"cannot run {sys.argv[2]}: {e.strerror or e}", file=sys.stderr)
    os._exit(127)
"""


def orphan_proof(cmd: Sequence[str]) -> list[str]:
    """``cmd`` run so that it is killed when this process dies, however it dies: on Linux
    behind a few lines of Python that set ``PR_SET_PDEATHSIG`` (SIGKILL) and ``exec``
    ``cmd`` in the same process (the same pid: start it directly from this process, or
    behind commands that ``exec`` in place, such as ``taskset`` and ``ip netns exec``);
    elsewhere ``cmd`` as it is (:func:`watch_launcher` is the guard there). The signal
    comes when the thread that started the process ends: start it from one that outlives
    it (a launcher's waiting thread does)."""
    if sys.platform != "linux":
        return list(cmd)
    return [sys.executable, "-I", "-S", "-c", _PARENT_DEATH, str(os.getpid()), *cmd]


class Lifeline:
    """A pipe whose write end only this launcher holds, and whose read end each process
    it starts with :meth:`start` gets (with :data:`LAUNCHER_PIPE_ENV` naming it): when the
    launcher dies, however it dies, the pipe closes, and a process that called
    :func:`watch_launcher` ends itself. Use it through :func:`lifeline`."""

    def __init__(self) -> None:
        self.read, self._write = os.pipe()  # neither is inherited unless passed
        self.env = {LAUNCHER_PIPE_ENV: f"{self.read}:{os.fstat(self.read).st_ino}"}

    def start(
        self, cmd: Sequence[str], env: Mapping[str, str], **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        """``subprocess.Popen(cmd)`` in a session of its own (``start_new_session``), with
        the pipe's read end and its name in ``env``."""
        return subprocess.Popen(
            list(cmd),
            env={**env, **self.env},
            pass_fds=(self.read,),
            start_new_session=True,
            **kwargs,
        )

    def close(self) -> None:
        for fd in (self.read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def lifeline() -> Iterator[Lifeline]:
    """A :class:`Lifeline` for the block; closed after it (end the processes first)."""
    line = Lifeline()
    try:
        yield line
    finally:
        line.close()


def watch_launcher(
    env: MutableMapping[str, str] | None = None,
    on_death: Callable[[], None] | None = None,
) -> bool:
    """If this process was started by a pdjax launcher (:data:`LAUNCHER_PIPE_ENV` in
    ``env``, default ``os.environ``, names an open pipe), watches the pipe in a daemon
    thread and calls ``on_death`` (default: ends this process and its process group,
    SIGTERM, then SIGKILL 5 s later) when the launcher dies. The variable is removed from
    ``env``, so that this process's own children do not take another file for the pipe.

    Returns:
      Whether it watches (False: not started by a launcher, or the pipe is not there).
    """
    env = os.environ if env is None else env
    token = env.pop(LAUNCHER_PIPE_ENV, None)
    fd_text, _, inode = (token or "").partition(":")
    if not (fd_text.isdigit() and inode.isdigit()):
        return False
    fd = int(fd_text)
    try:
        info = os.fstat(fd)
    except OSError:
        return False
    if not stat.S_ISFIFO(info.st_mode) or info.st_ino != int(inode):
        return False  # another file has that number here: not the launcher's pipe
    os.set_inheritable(fd, False)
    threading.Thread(
        target=_watch,
        args=(fd, on_death or _end_this_process),
        name="pdjax-launcher-watch",
        daemon=True,
    ).start()
    return True


def _watch(fd: int, on_death: Callable[[], None]) -> None:
    """Reads ``fd`` to end-of-file (the launcher never writes), then ``on_death()``."""
    while True:
        try:
            if not os.read(fd, 512):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    on_death()


def say(line: str) -> None:
    """Writes ``line`` and its newline to stderr in one write: the processes of a run
    share their launcher's stderr, and Python's unbuffered stderr makes ``print`` two
    writes (the text, then the newline), between which another process's line can land
    ("...ending itpdjax: process ...")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _end_this_process(grace: float = 5.0) -> None:
    """Ends this process as a launcher would: SIGTERM to its process group (to itself, if
    it leads none), then SIGKILL after ``grace`` seconds."""
    say(f"pdjax: process {os.getpid()}: its launcher is gone; ending it")
    group = os.getpgrp() == os.getpid()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if group:
            os.killpg(os.getpid(), sig)
        else:
            os.kill(os.getpid(), sig)
        time.sleep(grace)


#: What JAX's errors say when another process of the run is gone mid-run: its transfer
#: connection closed, reset or no longer there (CPU's socket transfers: ``SocketServer:
#: Connection closed recv() == 0``, ``recv() failed errno: 107 err: Transport endpoint
#: is not connected``), or the coordination service's verdict on it.
PEER_GONE = (
    "Connection closed",
    "Connection reset",
    "connection reset",
    "Connection refused",
    "Transport endpoint is not connected",
    "Broken pipe",
    "recv() failed",
    "send() failed",
    "another task died",
    "tasks are unhealthy",
)


def run_position() -> tuple[int, int] | None:
    """``(this process, processes)`` in a joined run of several processes (after
    :func:`initialize`); None in a single process, or before JAX is imported."""
    if "jax" not in sys.modules:
        return None
    from jax._src import distributed

    if distributed.global_state.client is None:
        return None
    import jax

    return jax.process_index(), jax.process_count()


def lost_peer(e: BaseException) -> DistributedError | None:
    """The one-line error for ``e`` when it is JAX's report, in a run of several
    processes, that another process is gone (:data:`PEER_GONE`: a transfer whose
    connection closed under it); None for anything else, which stays what it is. The
    launcher names the process that died; its own output says why."""
    position = run_position()
    jax = sys.modules.get("jax")
    if position is None or jax is None or not isinstance(e, jax.errors.JaxRuntimeError):
        return None
    text = str(e)
    if not any(words in text for words in PEER_GONE):
        return None
    first = _condensed(text.strip().splitlines()[0] if text.strip() else type(e).__name__)
    i, n = position
    lost = DistributedError(
        f"process {i} of {n} lost another process of the run ({first}): it died or was "
        "ended; the launcher's line (or that process's own output) says why"
    )
    lost.__cause__ = e
    return lost


def _condensed(line: str, limit: int = 240) -> str:
    """``line`` without the repeats of its ``"context: "`` parts (XLA wraps a failed
    dispatch in one "Error dispatching computation: " per program waiting on it), cut
    to ``limit`` characters."""
    parts: list[str] = []
    for part in line.split(": "):
        if not parts or part != parts[-1]:
            parts.append(part)
    text = ": ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_exit(code: int) -> str:
    """A worker's exit status in words: ``exit 3``, ``killed by SIGKILL``, and for
    SIGABRT what it means here (JAX aborts on fatal errors, with a C++ stack in its log)."""
    if code >= 0:
        return f"exit {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGABRT:
        return (
            f"killed by {name}: JAX aborted it on a fatal error (the 'F...' line above its "
            "C++ stack trace in its output says which; 'another task died' means look at the "
            "other processes first)"
        )
    return f"killed by {name}"


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
    fails, the others are ended; a run longer than ``timeout`` seconds is ended too, and so
    is every process when the launcher gets SIGTERM, SIGINT or SIGHUP. A launcher killed
    outright takes them with it (:func:`orphan_proof`, :class:`Lifeline`).

    Returns:
      0 when every process succeeded.

    Raises:
      DistributedError: naming the first process that failed (or the timeout).
      LaunchInterrupted: on a signal, after ending the processes.
    """
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    base = {**os.environ, **(env or {})}
    with ending_on_signals() as guard, lifeline() as line:
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
                cmd = orphan_proof([sys.executable, *argv])
                if pin:  # taskset runs the command in its own process, as orphan_proof needs
                    cmd = ["taskset", "-c", str(i % (os.cpu_count() or 1)), *cmd]
                with guard.hold():
                    procs.append(line.start(cmd, penv))
            _wait_all(procs, timeout)
            return 0
        finally:
            end_process_groups(procs)


def _wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout: float | None) -> None:
    """Returns when every process succeeded; raises on the first failure or the timeout."""
    n, start = len(procs), time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c is not None and c != 0]
        if failed:
            i, c = failed[0]
            raise DistributedError(
                f"process {i} of {n} failed ({describe_exit(c)}); its error is in its output "
                "above, and the others were ended"
            )
        if all(c == 0 for c in codes):
            return
        if timeout is not None and time.monotonic() - start > timeout:
            raise DistributedError(
                f"the {n} processes ran over {timeout} s and were ended; give a longer "
                "timeout, or look for a process that waits on another"
            )
        time.sleep(0.05)


def end_process_groups(procs: Sequence[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """Ends the processes still running and their process groups (each was started with
    ``start_new_session``): SIGTERM, then SIGKILL for those still there after ``grace``
    seconds. Signals to a group that is already gone are fine."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:  # exited between the poll and now, group and all
        pass


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
