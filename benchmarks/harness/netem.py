"""A cluster network on one machine: network namespaces, veth pairs, a bridge and ``tc``.

:class:`EmulatedNetwork` gives each of ``N`` hosts its own network namespace
(``<prefix>h<i>``) with one interface, ``eth0``, at ``10.213.X.(i+1)/24``. The other end of
every host's veth pair sits in a switch namespace (``<prefix>br``) as port ``p<i>`` of the
bridge ``br0``, so the topology is a star: host -- link -- switch -- link -- host. Run a
worker on host ``i`` with ``net.command(i, argv)`` (``ip netns exec <ns> argv...``; combine
it with ``taskset`` to pin it to a core) and have it reach the others at
``net.addresses``.

Each host's link is shaped in both directions, on the egress of both ends of its veth pair:

* ``rate_mbit``: a token bucket (``tbf``) at that rate. The rate counts Ethernet frames as
  the kernel sees them (headers included, no preamble, FCS or gap), so TCP payload moves at
  about 1448/1514 = 95.6% of it. The bucket holds ``max(64 KiB, rate x 1 ms)``: a bucket
  smaller than a TSO/GSO packet (up to 64 KiB on veth) makes ``tbf`` split every packet,
  and one smaller than what arrives between two timer wake-ups caps throughput below the
  rate (measured: a 3000-byte bucket passes 38% of 1 Gbit/s, a 16 KiB one 43% of 5 Gbit/s;
  this one 96% at 0.1, 1 and 5 Gbit/s); a larger one lets a burst of that size through at
  once, which shortens a transfer by at most ``burst / rate`` (5 ms at 100 Mbit/s). The
  queue holds another ``rate x 50 ms`` (at least 2 buckets) before it drops.
* ``delay_ms``: ``netem delay`` (root ``1:``) with the token bucket as its child
  (``parent 1:1``, handle ``10:``), the arrangement ``tc-netem(8)`` documents: a packet
  waits ``delay_ms``, then for its tokens. ``netem``'s queue is sized to hold what the link
  carries during the delay plus the token bucket's queue.

Delay is per link and per direction, as in Mininet's ``TCLink``: a packet from one host to
another crosses two links, so it takes ``2 x delay_ms`` one way and ``4 x delay_ms`` there
and back. Some kernels (e.g. minimal VM kernels, built without ``CONFIG_NET_SCH_NETEM``) lack
``netem``; :func:`network_support` with ``delay=True`` says so, and an
:class:`EmulatedNetwork` with ``delay_ms > 0`` raises :class:`NetworkError` there.

The namespaces are deleted when the ``with`` block ends (also on an exception, or on a
failure half-way through setup) and, should the driver exit without leaving the block, by
an :mod:`atexit` hook; a ``SIGKILL`` leaves them behind (``ip netns list``; they are named
``pdj...``). Deleting a namespace deletes its veths; processes still running in it keep
their (now nameless) namespace until they exit. Only namespaces this module created, and only
addresses it assigned itself, are ever touched.

Needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``), ``ip`` and ``tc`` from iproute2.
Every command it runs has a timeout; a failure raises :class:`NetworkError` naming the
command and what it printed.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import math
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from pdjax.errors import NetworkError

__all__ = [
    "EmulatedNetwork",
    "NetworkError",
    "measure_round_trip",
    "measure_throughput",
    "network_support",
]

COMMAND_TIMEOUT = 10.0
"""Seconds any one ``ip``/``tc`` command may take."""

_MIN_BURST = 64 * 1024  # bytes: at least one GSO packet on veth
_BURST_TIME = 1e-3  # seconds of the rate the bucket holds, when that is more
_QUEUE_TIME = 50e-3  # seconds of the rate the queue holds besides the bucket
_MTU = 1500  # veth default; sizes netem's queue, which counts packets
_instances = itertools.count()


def _run(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> str:
    """Runs a command and returns its stdout.

    Raises:
      NetworkError: naming the command and its stderr, when it fails, is missing or runs
        over ``timeout`` seconds.
    """
    cmd = " ".join(argv)
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as e:
        raise NetworkError(f"`{cmd}` failed: {argv[0]} not found") from e
    except subprocess.TimeoutExpired as e:
        raise NetworkError(f"`{cmd}` ran over {timeout:g} s") from e
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().replace("\n", " | ")
        hint = ""
        if "netem" in argv and "qdisc kind is unknown" in err:
            hint = " (this kernel has no netem: CONFIG_NET_SCH_NETEM; use delay_ms=0)"
        raise NetworkError(f"`{cmd}` failed (exit {proc.returncode}): {err}{hint}")
    return proc.stdout


def _namespaces() -> set[str]:
    """The names of the network namespaces that exist now (``ip netns list``)."""
    return {line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line}


def network_support(delay: bool = False) -> str | None:
    """Whether :class:`EmulatedNetwork` can run here.

    Tries it out with a throwaway namespace holding a veth pair, a bridge and a token
    bucket (and ``netem`` when ``delay``), then deletes it; takes well under a second when
    it works, and at most a few times ``COMMAND_TIMEOUT``.

    Args:
      delay: also check that links can be delayed (the kernel has ``netem``).

    Returns:
      None when it can, else a one-line reason ("not root", "tc not found", ...).
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "not root (network namespaces and tc need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} not found (install iproute2)"
    ns = f"pdjprobe{os.getpid() % 10000}x{next(_instances)}"
    try:
        _run(["ip", "netns", "add", ns])
    except NetworkError as e:
        return f"cannot create a network namespace: {e}"
    try:
        _run(["ip", "-n", ns, "link", "add", "name", "br0", "type", "bridge"])
        _run(["ip", "-n", ns, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb"])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "va", "root", *_tbf_args(100.0)])
        _run(["ip", "netns", "exec", ns, "true"])
        if delay:
            try:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", "vb", "root", *_netem_args(None, 1)])
            except NetworkError as e:
                if "qdisc kind is unknown" in str(e):
                    return "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): no link delay"
                raise
    except NetworkError as e:
        return str(e)
    finally:
        try:
            _run(["ip", "netns", "delete", ns])
        except NetworkError:
            pass
    return None


def burst_bytes(rate_mbit: float) -> int:
    """The token bucket's size: ``max(64 KiB, 1 ms at the rate)``."""
    return max(_MIN_BURST, math.ceil(rate_mbit * 1e6 / 8 * _BURST_TIME))


def _tbf_args(rate_mbit: float) -> list[str]:
    """``tbf ...`` for a link of ``rate_mbit`` (see the module's docstring)."""
    burst = burst_bytes(rate_mbit)
    limit = burst + max(burst, math.ceil(rate_mbit * 1e6 / 8 * _QUEUE_TIME))
    rate_bit = round(rate_mbit * 1e6)
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "limit", str(limit)]


def _netem_args(rate_mbit: float | None, delay_ms: float) -> list[str]:
    """``netem delay ...`` with a queue (in packets) for the delay and the bucket's queue."""
    if rate_mbit is None:
        limit = 100_000  # unshaped: veth is fast, and nothing but the delay holds packets
    else:
        rate = rate_mbit * 1e6 / 8
        in_flight = rate * (delay_ms * 1e-3 + _QUEUE_TIME) + 2 * burst_bytes(rate_mbit)
        limit = max(1000, 2 * math.ceil(in_flight / _MTU))  # 2x: ACKs are small packets
    return ["netem", "delay", f"{delay_ms:g}ms", "limit", str(limit)]


class EmulatedNetwork:
    """``num_hosts`` hosts, each on its own shaped link to one switch (a context manager).

    >>> EmulatedNetwork(2, 100.0, prefix="pdjdoc").describe()
    '2 hosts on veth through a bridge, 100 Mbit/s each way, 0 ms delay'

    Args:
      num_hosts: hosts (1 to the addresses ``subnet`` has, at most 254 for a /24).
      rate_mbit: each link's rate in Mbit/s, each way; None: unshaped veth.
      delay_ms: each link's delay, each way (so ``2 x delay_ms`` host to host); 0: none.
      prefix: the namespaces' names start with it (``<prefix>h<i>``, ``<prefix>br``); default
        ``pdj<pid % 10000>x<k>``, with ``k`` counting this process's networks (and skipping
        names in use).
      subnet: the hosts' subnet; host ``i`` gets its ``i + 1``-th address; default
        ``10.213.X.0/24`` with ``X`` from the pid and ``k``. The namespaces are isolated, so
        this only shows up in the addresses.

    Attributes:
      addresses: host ``i``'s address, as a string.
      namespaces: host ``i``'s namespace name.
      switch: the switch's namespace name.
    """

    def __init__(
        self,
        num_hosts: int,
        rate_mbit: float | None,
        delay_ms: float = 0.0,
        *,
        prefix: str | None = None,
        subnet: str | None = None,
    ) -> None:
        if num_hosts < 1:
            raise NetworkError(f"need at least 1 host, got {num_hosts}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise NetworkError(f"rate_mbit must be positive or None, got {rate_mbit}")
        if not delay_ms >= 0:
            raise NetworkError(f"delay_ms must be >= 0, got {delay_ms}")
        k = next(_instances)
        self.num_hosts = num_hosts
        self.rate_mbit = rate_mbit
        self.delay_ms = float(delay_ms)
        self._auto_prefix = prefix is None
        self.prefix = prefix if prefix is not None else f"pdj{os.getpid() % 10000}x{k}"
        if subnet is None:
            subnet = f"10.213.{(os.getpid() + k) % 254 + 1}.0/24"
        try:
            self.network = ipaddress.ip_network(subnet)
        except ValueError as e:
            raise NetworkError(f"bad subnet {subnet!r}: {e}") from e
        hosts = itertools.islice(self.network.hosts(), num_hosts)
        self.addresses = [str(a) for a in hosts]
        if len(self.addresses) < num_hosts:
            raise NetworkError(f"subnet {subnet} has fewer than {num_hosts} host addresses")
        self._created: list[str] = []
        self._folders: list[Path] = []
        self._name_namespaces()

    def _name_namespaces(self) -> None:
        self.namespaces = [f"{self.prefix}h{i}" for i in range(self.num_hosts)]
        self.switch = f"{self.prefix}br"

    def describe(self) -> str:
        """One line: hosts, link rate and delay."""
        rate = "unshaped" if self.rate_mbit is None else f"{self.rate_mbit:g} Mbit/s each way"
        hosts = "1 host" if self.num_hosts == 1 else f"{self.num_hosts} hosts"
        return f"{hosts} on veth through a bridge, {rate}, {self.delay_ms:g} ms delay"

    def __repr__(self) -> str:
        return f"EmulatedNetwork({self.describe()!r}, prefix={self.prefix!r})"

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``i``: ``["ip", "netns", "exec", <namespace>, *argv]``."""
        if not 0 <= i < self.num_hosts:
            raise NetworkError(f"host {i} is not in 0..{self.num_hosts - 1}")
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def __enter__(self) -> EmulatedNetwork:
        if self._created:
            raise NetworkError(f"{self!r} is already set up")
        atexit.register(self.close)
        try:
            self._setup()
        except BaseException:
            try:
                self.close()
            except NetworkError:
                pass
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except NetworkError as e:
            if exc is None:
                raise
            exc.add_note(f"while tearing down the emulated network: {e}")

    def _setup(self) -> None:
        if self._auto_prefix:
            existing = _namespaces()
            while self.switch in existing or existing.intersection(self.namespaces):
                self.prefix = f"pdj{os.getpid() % 10000}x{next(_instances)}"
                self._name_namespaces()
        sw = self.switch
        self._add_namespace(sw)
        _run(["ip", "-n", sw, "link", "add", "name", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        plen = self.network.prefixlen
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            port = f"p{i}"
            self._add_namespace(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            peer = ["peer", "name", "eth0", "netns", ns]
            _run(["ip", "-n", sw, "link", "add", "name", port, "type", "veth", *peer])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/{plen}", "dev", "eth0"])
            self._shape(sw, port)
            self._shape(ns, "eth0")
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._name_host(ns, addr)

    def _name_host(self, ns: str, addr: str) -> None:
        """Makes this machine's host name resolve to ``addr`` inside ``ns``: ``ip netns
        exec`` mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``. Programs that find
        their own address from the host name (gloo, which JAX's CPU collectives use)
        then advertise the host's link, not loopback."""
        folder = Path("/etc/netns") / ns
        folder.mkdir(parents=True, exist_ok=True)
        self._folders.append(folder)
        (folder / "hosts").write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)

    def _shape(self, ns: str, dev: str) -> None:
        """Shapes ``dev``'s egress in namespace ``ns`` (see the module's docstring)."""
        qdisc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        if self.delay_ms > 0:
            _run([*qdisc, "root", "handle", "1:", *_netem_args(self.rate_mbit, self.delay_ms)])
            if self.rate_mbit is not None:
                _run([*qdisc, "parent", "1:1", "handle", "10:", *_tbf_args(self.rate_mbit)])
        elif self.rate_mbit is not None:
            _run([*qdisc, "root", "handle", "1:", *_tbf_args(self.rate_mbit)])

    def close(self) -> None:
        """Deletes the namespaces this network created (and so their veths and bridge).

        Idempotent; a namespace that is already gone is fine.

        Raises:
          NetworkError: when a namespace could not be deleted (after trying all of them).
        """
        errors = []
        # each name leaves the list only once deleted, and the atexit hook only at the end:
        # a close cut short (a launcher's SIGTERM raises wherever it lands) is finished by
        # the next call or at exit, not left behind as namespaces and bridges
        while self._created:
            ns = self._created[-1]
            try:
                _run(["ip", "netns", "delete", ns])
            except NetworkError as e:
                if "No such file" not in str(e):
                    errors.append(str(e))
            self._created.pop()
        while self._folders:
            shutil.rmtree(self._folders[-1], ignore_errors=True)
            self._folders.pop()
        atexit.unregister(self.close)
        if errors:
            raise NetworkError("; ".join(errors))


# The helpers' programs. Each server prints its port, then its result, one line each.
_RECEIVER = """
import socket, sys, time
addr, n, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket()
s.bind((addr, 0))
s.listen(1)
s.settimeout(timeout)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
c.settimeout(timeout)
buf = bytearray(1 << 20)
got = first = 0
t0 = t1 = 0.0
while got < n:
    k = c.recv_into(buf)
    if not k:
        break
    t1 = time.perf_counter()
    if not got:
        t0, first = t1, k
    got += k
print(got, first, t1 - t0, flush=True)
"""

_SENDER = """
import socket, sys
addr, port, n, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
c = socket.create_connection((addr, port), timeout=timeout)
chunk = memoryview(bytes(1 << 20))
while n > 0:
    c.sendall(chunk[: min(n, len(chunk))])
    n -= len(chunk)
c.shutdown(socket.SHUT_WR)
c.recv(1)
"""

_ECHO = """
import socket, sys
addr, timeout = sys.argv[1], float(sys.argv[2])
s = socket.socket()
s.bind((addr, 0))
s.listen(1)
s.settimeout(timeout)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
c.settimeout(timeout)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while b := c.recv(1):
    c.sendall(b)
print("done", flush=True)
"""

_PINGER = """
import socket, sys, time
addr, port, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = socket.create_connection((addr, port), timeout=float(sys.argv[4]))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(rounds + 1):  # the first round also warms up
    t0 = time.perf_counter()
    c.sendall(b"x")
    if c.recv(1) != b"x":
        sys.exit("echo lost")
    times.append(time.perf_counter() - t0)
print(min(times[1:]), flush=True)
"""


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Kills ``proc`` if it still runs (``ip netns exec`` execs, so this is the program)."""
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        pass
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def _readline(proc: subprocess.Popen[bytes], deadline: float, what: str) -> str:
    """The next line ``proc`` prints, waiting until ``deadline`` (``time.monotonic``) at most.

    Reads the pipe unbuffered, so that ``communicate`` can read the rest later.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        byte = os.read(fd, 1) if ready else b""
        if not byte:
            proc.kill()
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise NetworkError(f"{what} printed nothing" + (f": {err}" if err else " in time"))
        line += byte
    return line.decode().strip()


def _client_server(
    net: EmulatedNetwork,
    src: int,
    dst: int,
    *,
    server: tuple[str, list[str]],
    client: tuple[str, list[str]],
    timeout: float,
) -> tuple[str, str]:
    """Runs ``server`` on host ``dst``, then ``client`` on host ``src`` (each a program and
    its arguments; the client gets the server's address and port first), and returns what
    each printed after that (the server's port aside). Both are ended in all cases."""
    deadline = time.monotonic() + timeout
    addr = net.addresses[dst]
    pipe = subprocess.PIPE
    srv = subprocess.Popen(
        net.command(dst, [sys.executable, "-c", server[0], addr, *server[1]]),
        stdout=pipe,
        stderr=pipe,
    )
    try:
        port = _readline(srv, deadline, f"the server on host {dst}")
        cli = subprocess.Popen(
            net.command(src, [sys.executable, "-c", client[0], addr, port, *client[1]]),
            stdout=pipe,
            stderr=pipe,
        )
        try:
            out, err = cli.communicate(timeout=max(0.0, deadline - time.monotonic()))
            if cli.returncode != 0:
                raise NetworkError(f"the client on host {src} failed: {err.decode().strip()}")
            srv_out, srv_err = srv.communicate(timeout=max(0.0, deadline - time.monotonic()))
            if srv.returncode != 0:
                raise NetworkError(f"the server on host {dst} failed: {srv_err.decode().strip()}")
        except subprocess.TimeoutExpired as e:
            raise NetworkError(f"host {src} to host {dst} ran over {timeout:g} s") from e
        finally:
            _end(cli)
    finally:
        _end(srv)
    return srv_out.decode().strip(), out.decode().strip()


def measure_throughput(
    net: EmulatedNetwork, src: int, dst: int, nbytes: int, *, timeout: float = 60.0
) -> float:
    """Bytes per second one TCP connection moves from host ``src`` to host ``dst``.

    A receiver on ``dst`` times the bytes after its first read, from that read to the last
    one, so connection setup, slow start's first round and the first burst of the token
    bucket barely count. Goodput, so about 95.6% of the link rate (see the module docstring).

    Args:
      net: a set-up network.
      src: the sending host.
      dst: the receiving host.
      nbytes: bytes to move (a few MB, to make the bucket's burst negligible).
      timeout: seconds the whole measurement may take; its processes are ended after.

    Raises:
      NetworkError: when it runs over ``timeout`` or the connection fails.
    """
    args = [str(nbytes), str(timeout)]
    line, _ = _client_server(
        net, src, dst, server=(_RECEIVER, args), client=(_SENDER, args), timeout=timeout
    )
    got, first, seconds = line.split()
    if int(got) < nbytes:
        raise NetworkError(f"host {dst} received {got} of {nbytes} bytes from host {src}")
    if float(seconds) <= 0:
        raise NetworkError(f"{nbytes} bytes are too few to time; send more")
    return (int(got) - int(first)) / float(seconds)


def measure_round_trip(
    net: EmulatedNetwork, src: int, dst: int, rounds: int = 5, *, timeout: float = 30.0
) -> float:
    """Seconds a 1-byte TCP request from host ``src`` takes to come back from host ``dst``
    (the fastest of ``rounds``, after a warm-up round; ``TCP_NODELAY`` on both ends).

    Raises:
      NetworkError: when it runs over ``timeout`` or the connection fails.
    """
    server = (_ECHO, [str(timeout)])
    client = (_PINGER, [str(rounds), str(timeout)])
    _, line = _client_server(net, src, dst, server=server, client=client, timeout=timeout)
    return float(line)
