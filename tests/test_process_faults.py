"""Multi-process faults: what the coordinator listens on, launchers that get a signal (or
are killed outright), a worker that gets SIGTERM, and a peer that never joins.

Every process these tests start is on 127.0.0.1, bounded in time, and killed by pid if it
outlives its test. The workers of the launcher tests are plain Python (no JAX), so they
start fast; only the tests that need ``jax.distributed`` import it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
START = 90.0  # seconds for a process that imports JAX to get ready on a busy machine


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _kill(pids: list[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {seconds} s")
        time.sleep(0.05)


# -- a joined process: where it listens, and SIGTERM -------------------------------------------

_JOINED = """
import sys, time
from pdjax.distributed import DistributedConfig, initialize
initialize(DistributedConfig(sys.argv[1], 1, 0, init_timeout=30))
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def joined():
    """A process that joined a 1-process run (so JAX's coordination service runs in it) on
    127.0.0.1: ``(process, port)``."""
    from pdjax.distributed import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _JOINED, f"127.0.0.1:{port}"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded: the process ends itself after 600 s
        assert line.strip() == "ready", f"the process did not join (exit {proc.poll()})"
        yield proc, port
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def _listening(pid: int) -> list[tuple[str, int]]:
    """``(hex address, port)`` of every TCP socket ``pid`` listens on (``/proc/net``)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                host, port = address.split(":")
                found.append((host, int(port, 16)))
    return found


LOOPBACK = {
    "0100007F",  # 127.0.0.1
    "00000000000000000000000001000000",  # ::1
    "0000000000000000FFFF00000100007F",  # ::ffff:127.0.0.1
}


def test_the_coordinator_listens_on_loopback_only_and_ends_on_sigterm(joined):
    """One joined process (one JAX start-up) for both: where it listens, then SIGTERM."""
    proc, port = joined
    sockets = _listening(proc.pid)
    assert port in [p for _, p in sockets], f"nothing listens on the coordinator port: {sockets}"
    everywhere = [(host, p) for host, p in sockets if host not in LOOPBACK]
    assert not everywhere, f"listening beyond loopback: {everywhere}"
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("SIGTERM did not end the process (JAX's preemption notifier caught it)")
    assert code == -signal.SIGTERM


# -- launchers that get a signal --------------------------------------------------------------

# Writes its pid, then sleeps; process 1 ignores SIGTERM as a worker stuck in native code
# (or with JAX's preemption notifier) does, so the launcher has to escalate to SIGKILL.
_SLEEPER = """
import os, signal, sys, time
from pathlib import Path
if os.environ["PDJAX_PROCESS_ID"] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
Path(sys.argv[1], str(os.getpid())).write_text("")
time.sleep(600)
"""

_LAUNCHERS = {
    "local": """
import sys
from pdjax.distributed import launch_local
launch_local(["-c", sys.argv[2], sys.argv[1]], 2, timeout=600)
""",
    "cluster": """
import os, sys
from benchmarks.harness.cluster import run_processes
cmd = [sys.executable, "-c", sys.argv[2], sys.argv[1]]
envs = [{**os.environ, "PDJAX_PROCESS_ID": str(i)} for i in range(2)]
run_processes([cmd, cmd], envs, "sleepers", timeout=600)
""",
}


@pytest.mark.parametrize(
    "launcher,sig",
    [("local", signal.SIGTERM), ("cluster", signal.SIGTERM), ("local", signal.SIGHUP)],
)
def test_a_signalled_launcher_ends_its_workers(tmp_path, launcher, sig):
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHERS[launcher], str(tmp_path), _SLEEPER],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the test's own signal goes to the launcher alone
    )
    pids: list[int] = []
    try:
        _wait_for(lambda: len(list(tmp_path.iterdir())) == 2, START, "2 workers")
        pids = [int(p.name) for p in tmp_path.iterdir()]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)  # 5 s grace, then SIGKILL
        assert proc.returncode != 0
        assert signal.Signals(sig).name in err, err[-2000:]
        left = [pid for pid in pids if _alive(pid)]
        assert not left, f"the launcher left workers {left} running"
    finally:
        proc.kill()
        proc.wait()
        _kill(pids)


# -- a launcher killed outright ----------------------------------------------------------------

# The sleeper as a module for the cluster benchmark's launch (``python -m MODULE worker JOB``,
# pinned with taskset); it writes its pid into $SLEEPERS.
_SLEEPER_MODULE = """
import os, signal, time
from pathlib import Path
if os.environ.get("PDJAX_PROCESS_ID") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
Path(os.environ["SLEEPERS"], str(os.getpid())).write_text("")
time.sleep(600)
"""

_KILLED_LAUNCHERS = {
    "local": """
import sys
from pdjax.distributed import launch_local
launch_local(["-c", sys.argv[2], sys.argv[1]], 2, timeout=600, pin=True)
""",
    "cluster": """
import sys
from pathlib import Path
from benchmarks.harness.cluster.launcher import launch
job = {"model": "sleepers", "runners": []}
launch(job, 2, None, False, Path(sys.argv[3]), module="pdjax_sleeper", timeout=600)
""",
}


@pytest.mark.parametrize("launcher", ["local", "cluster"])
def test_a_launcher_killed_outright_takes_its_workers_with_it(tmp_path, launcher):
    """SIGKILL runs no handler: the workers (one of which ignores SIGTERM) go with their
    launcher all the same (on Linux, PR_SET_PDEATHSIG)."""
    pids_dir, work = tmp_path / "pids", tmp_path / "work"
    pids_dir.mkdir()
    work.mkdir()
    (tmp_path / "pdjax_sleeper.py").write_text(_SLEEPER_MODULE)
    env = {**ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "SLEEPERS": str(pids_dir)}
    code = _KILLED_LAUNCHERS[launcher]
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(pids_dir), _SLEEPER, str(work)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        _wait_for(lambda: len(list(pids_dir.iterdir())) == 2, START, "2 workers")
        pids = [int(p.name) for p in pids_dir.iterdir()]
        proc.kill()
        proc.wait(timeout=30)
        _wait_for(lambda: not any(_alive(pid) for pid in pids), 10, "the workers' end")
    finally:
        proc.kill()
        proc.wait()
        _kill(pids)


# -- a peer that never joins ------------------------------------------------------------------

# Process 1 never joins (exits at once, as a process that failed before initialize would);
# process 0 joins and prints what it fails with, as pdjax's CLI does.
_LONELY = """
import os, sys
if os.environ["PDJAX_PROCESS_ID"] == "1":
    sys.exit(0)
from pdjax.distributed import DistributedError, config_from_env, initialize
try:
    initialize(config_from_env())
except DistributedError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
"""


def _run_launcher(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [sys.executable, "-c", code],
            env={**ENV, **env},
            capture_output=True,
            text=True,
            timeout=START,  # JAX's own default would abort after 60 s
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a missing peer was not caught within the init timeout")


def test_a_peer_that_never_joins_is_named():
    launcher = (
        "import sys\nfrom pdjax.distributed import launch_local\n"
        f"launch_local(['-c', {_LONELY!r}], 2, timeout=120)"
    )
    done = _run_launcher(launcher, {"PDJAX_INIT_TIMEOUT": "3"})
    assert done.returncode != 0
    assert "process 0 of 2: process 1 did not join the coordinator at 127.0.0.1:" in done.stderr
    assert "within 3 s" in done.stderr
    assert "stack trace" not in done.stderr, done.stderr[-3000:]
    assert "process 0 of 2 failed (exit 2)" in done.stderr, done.stderr[-3000:]


def test_a_coordinator_that_never_starts_is_named():
    from pdjax.distributed import free_port

    code = (
        "from pdjax.distributed import config_from_env, initialize\ninitialize(config_from_env())"
    )
    env = {
        "PDJAX_COORDINATOR": f"127.0.0.1:{free_port()}",
        "PDJAX_NUM_PROCESSES": "2",
        "PDJAX_PROCESS_ID": "1",
        "PDJAX_INIT_TIMEOUT": "2",
    }
    done = _run_launcher(code, env)
    assert done.returncode == 1  # the DistributedError's traceback, not an abort
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pdjax.errors.DistributedError: process 1 of 2: the "), last
    assert "coordinator (process 0) at 127.0.0.1:" in last
    assert "did not answer within 2 s" in last


def test_the_launcher_explains_an_abort():
    from pdjax.distributed import DistributedError, launch_local

    with pytest.raises(DistributedError, match=r"process 0 of 1 failed \(killed by SIGABRT: JAX"):
        launch_local(["-c", "import os; os.abort()"], 1, timeout=60)


# -- the emulated network's teardown -----------------------------------------------------------


def test_a_teardown_cut_short_is_finished_later(monkeypatch):
    """A launcher's signal can land in the middle of deleting the namespaces; the next
    close (or the one at exit) deletes the rest, the one it was deleting included."""
    from benchmarks.harness import netem

    if (reason := netem.network_support()) is not None:
        pytest.skip(reason)
    net = netem.EmulatedNetwork(2, None)
    names = {net.switch, *net.namespaces}
    real_run = netem._run

    def interrupted(argv, *args, **kwargs):
        if argv[:3] == ["ip", "netns", "delete"]:
            raise KeyboardInterrupt  # as LaunchInterrupted would, before the deletion
        return real_run(argv, *args, **kwargs)

    try:
        net.__enter__()
        monkeypatch.setattr(netem, "_run", interrupted)
        with pytest.raises(KeyboardInterrupt):
            net.close()
        monkeypatch.setattr(netem, "_run", real_run)
        net.close()
        assert not names & netem._namespaces()
    finally:
        monkeypatch.setattr(netem, "_run", real_run)
        for ns in names & netem._namespaces():
            subprocess.run(["ip", "netns", "delete", ns], timeout=10, check=False)
