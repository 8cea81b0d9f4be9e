"""``pdjax._allocator``: glibc's mmap and trim thresholds fixed once per process by
``mallopt`` (as the cluster workers get them from their environment), the user's own
settings kept, nothing done off CPU or off glibc, and ``pdjax train`` reporting it."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pdjax._allocator as allocator
from pdjax.apps import data
from pdjax.apps.cli import main

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.fixture
def calls(monkeypatch) -> list[tuple[int, int]]:
    """A fresh process's state, with a ``mallopt`` that records its calls (the test
    process's own allocator is left alone)."""
    seen: list[tuple[int, int]] = []
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)

    def mallopt(param: int, value: int) -> int:
        seen.append((param, value))
        return 1

    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.setattr(allocator, "_mallopt", lambda: mallopt)
    return seen


def test_both_thresholds_are_set_once_per_process(calls):
    line = allocator.fix_thresholds("cpu", env={})
    assert calls == [(-3, 32 << 20), (-1, 1 << 30)]
    assert "mmap threshold 32 MiB" in line and "trim threshold 1024 MiB" in line
    assert allocator.fix_thresholds("cpu", env={}) == line
    assert len(calls) == 2
    # the values are the cluster launcher's environment's
    assert allocator.ENVIRONMENT == {
        "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
        "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    }


@pytest.mark.parametrize(
    "env, kept, set_",
    [
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_=65536", (-1, 1 << 30)),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_=0", (-3, 32 << 20)),
        (
            {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=4096"},
            "GLIBC_TUNABLES glibc.malloc.mmap_threshold=4096",
            (-1, 1 << 30),
        ),
    ],
)
def test_a_threshold_the_user_set_is_kept_and_said(calls, env, kept, set_):
    line = allocator.fix_thresholds("cpu", env=env)
    assert calls == [set_]
    assert f"kept as the environment sets it ({kept})" in line


def test_nothing_is_done_off_cpu_or_off_glibc(calls, monkeypatch):
    line = allocator.fix_thresholds("gpu", env={})
    assert calls == [] and "not changed (training on gpu, not cpu)" in line
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.setattr(allocator, "_mallopt", lambda: None)
    line = allocator.fix_thresholds("cpu", env={})
    assert "not changed" in line and "mallopt is glibc's, on Linux" in line


def test_a_refused_setting_is_said(monkeypatch):
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda param, value: 0)
    line = allocator.fix_thresholds("cpu", env={})
    assert "mmap threshold not changed (mallopt refused 33554432)" in line


_BLOCK = textwrap.dedent(
    """
    import ctypes, sys

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "fix":
        from pdjax._allocator import fix_thresholds
        print(fix_thresholds("cpu", env={}))
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(8 << 20)  # 8 MiB: mmapped under glibc's default 128 KiB threshold
    print(libc.mallinfo2().hblkhd - before)
    """
)


@pytest.mark.skipif(not GLIBC, reason="mallopt and mallinfo2 are glibc's")
def test_the_real_mallopt_moves_an_8_mib_block_onto_the_heap():
    def run(mode: str) -> list[str]:
        env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_* of the test's environment
        done = subprocess.run([sys.executable, "-c", _BLOCK, mode], capture_output=True,
                              text=True, check=True, env=env)  # fmt: skip
        return done.stdout.splitlines()

    (mapped,) = run("default")
    assert int(mapped) >= 8 << 20
    line, mapped = run("fix")
    assert "mmap threshold 32 MiB" in line and int(mapped) == 0


def test_pdjax_train_sets_them_once_and_reports_them(calls, tmp_path, capsys):
    npz = tmp_path / "digits.npz"
    ds = data.digits(flatten=True)
    np.savez(npz, x_train=ds.train_x[:64], y_train=ds.train_y[:64], x_test=ds.test_x[:32],
             y_test=ds.test_y[:32])  # fmt: skip
    argv = ["train", "--model", "mlp", "--dataset", str(npz), "--devices", "2", "--plan",
            "even", "--batch-size", "32", "--microbatches", "2", "--epochs", "1",
            "--progress", "lines", "--compare", "dp", "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 0
    assert len(calls) == 2  # two runs, one process: one mallopt per threshold
    line = allocator.fix_thresholds("cpu")
    assert f"allocator: {line}" in capsys.readouterr().out
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert [s["allocator"] for s in summary] == [line, line]
