"""Safety properties kept by tests: restoring a checkpoint never unpickles (a checkpoint
is data, not code to run), ``numpy.load`` never allows pickles, and every subprocess pdjax
starts gets an argument list, never a shell command line."""

import ast
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import pdjax
from benchmarks.harness import cluster, netem
from pdjax.apps.data import load_npz
from pdjax.distributed import launch_local
from pdjax.models import get_model
from pdjax.pipeline import Pipeline, even_stages
from pdjax.runners import Checkpointer
from pdjax.schedules import ScheduleSpec

SOURCES = sorted(Path(pdjax.__file__).parent.rglob("*.py"))


class Unpickled(AssertionError):
    pass


def _no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise Unpickled("a restore unpickled")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)


def _numpy_loads(monkeypatch):
    """Records the ``allow_pickle`` of every ``numpy.load`` call (None: not given)."""
    calls = []
    real = np.load

    def load(*args, **kwargs):
        calls.append(kwargs.get("allow_pickle"))
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "load", load)
    return calls


# -- no pickle on restore ------------------------------------------------------------------------


def test_a_checkpoint_restores_without_unpickling(tmp_path, monkeypatch):
    spec = get_model("mlp")
    pipe = Pipeline(
        spec.layers,
        even_stages(len(spec.layers), 2),
        spec.loss,
        optax.adam(1e-2),
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )
    x, y = spec.sample_batch(8)
    state, _ = pipe.step(pipe.init(jax.random.key(0), x[:4]), (x, y))
    extra = {"epoch": 1, "history": [{"loss": 0.5}]}
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state, extra=extra)

    _no_unpickling(monkeypatch)
    with pytest.raises(Unpickled):  # the patch is live: a real unpickling would be caught
        pickle.loads(pickle.dumps(1))
    loads = _numpy_loads(monkeypatch)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        restored, got_extra = ckpt.restore(pipe.init(jax.random.key(5), x[:4]))
    assert got_extra == extra
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        if isinstance(b, jax.Array) and jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert True not in loads


def test_numpy_load_never_allows_pickles(tmp_path, monkeypatch):
    """At run time (a dataset file) and in the source: no ``allow_pickle`` but False."""
    path = tmp_path / "d.npz"
    x, y = np.zeros((4, 3), np.float32), np.zeros(4, np.int32)
    np.savez(path, x_train=x, y_train=y, x_test=x, y_test=y)
    loads = _numpy_loads(monkeypatch)
    _no_unpickling(monkeypatch)
    load_npz(path)
    assert loads and True not in loads
    allowing = [
        f"{src.name}:{node.lineno}"
        for src in SOURCES
        for node in ast.walk(ast.parse(src.read_text()))
        if isinstance(node, ast.keyword)
        and node.arg == "allow_pickle"
        and not (isinstance(node.value, ast.Constant) and node.value.value is False)
    ]
    assert allowing == []


# -- subprocesses: argument lists, no shell ------------------------------------------------------


class Recorded(RuntimeError):
    pass


@pytest.fixture
def popen(monkeypatch):
    """``subprocess.Popen`` replaced by one that records its call and raises, so that
    nothing starts; the calls as ``(args, kwargs)``."""
    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        raise Recorded("recorded, not started")

    monkeypatch.setattr(subprocess, "Popen", fake)
    return calls


def _argv_lists(calls):
    assert calls, "no subprocess was started"
    for args, kwargs in calls:
        argv = args[0] if args else kwargs["args"]
        assert isinstance(argv, list | tuple), argv
        assert all(isinstance(a, str) for a in argv), argv
        assert kwargs.get("shell", False) is False, kwargs
        assert len(args) <= 1  # shell is not passed by position either (Popen's 9th)


def test_launch_local_starts_argument_lists(popen):
    with pytest.raises(Recorded):
        launch_local(["-m", "pdjax", "train", "--devices", "2"], 2, pin=True)
    _argv_lists(popen)
    assert popen[0][0][0][:3] == ["taskset", "-c", "0"]


def test_cluster_starts_argument_lists(popen):
    commands = [(sys.executable, "-c", "pass; rm -rf /"), [sys.executable, "-V"]]
    with pytest.raises(Recorded):
        cluster.run_processes(commands, [{}, {}], "a test", timeout=5)
    _argv_lists(popen)
    assert popen[0][0][0] == list(commands[0])  # one argument, not split or joined


def test_netem_runs_argument_lists(popen):
    with pytest.raises(Recorded):
        netem._run(["ip", "netns", "list"])  # subprocess.run, through Popen
    net = netem.EmulatedNetwork(2, None)  # named only: nothing set up
    with pytest.raises(Recorded):
        netem.measure_throughput(net, 0, 1, 1000, timeout=5)
    _argv_lists(popen)
    assert popen[-1][0][0][:4] == ["ip", "netns", "exec", net.namespaces[1]]


def test_no_source_asks_for_a_shell():
    """The calls above are the ones there are today; this holds for any added later."""
    found = []
    for src in SOURCES:
        for node in ast.walk(ast.parse(src.read_text())):
            if not isinstance(node, ast.Call):
                continue
            shell = [k for k in node.keywords if k.arg == "shell"]
            if any(
                not (isinstance(k.value, ast.Constant) and k.value.value is False) for k in shell
            ):
                found.append(f"{src.name}:{node.lineno} shell=")
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("system", "popen"):
                if isinstance(f.value, ast.Name) and f.value.id == "os":
                    found.append(f"{src.name}:{node.lineno} os.{f.attr}")
    assert found == []
