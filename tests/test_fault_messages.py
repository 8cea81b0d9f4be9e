"""Faults that end a command with one line, not a traceback: Ctrl-C (exit 130, its
checkpoints intact), a prompt that is not text, a worker whose peer died, a launcher's
signal; and the lines processes sharing a stderr write whole."""

from __future__ import annotations

import io
import signal

import jax
import orbax.checkpoint as ocp
import pytest

from pdjax import distributed
from pdjax.apps import cli
from pdjax.apps.commands import simulate
from pdjax.errors import LaunchInterrupted
from pdjax.runners import Checkpointer


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, list[str]]:
    """``pdjax argv`` in this process: its exit status and the lines of its stderr."""
    capsys.readouterr()
    try:
        rc: object = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    except KeyboardInterrupt:  # caught here: pytest would end the session on it
        rc = "KeyboardInterrupt raised"
    return rc, capsys.readouterr().err.strip().splitlines()


def test_ctrl_c_is_one_line_exit_130_and_leaves_the_checkpoints_intact(mine, capsys, monkeypatch):
    """Ctrl-C while epoch 2's checkpoint is being written (orbax's background save under
    way): one line, exit 130; the folder's lock is released, step 1 verifies, and no
    unfinished step is listed."""
    save = ocp.CheckpointManager.save

    def interrupted(self, step, *args, **kwargs):
        started = save(self, step, *args, **kwargs)
        if step == 2:
            raise KeyboardInterrupt
        return started

    monkeypatch.setattr(ocp.CheckpointManager, "save", interrupted)
    argv = [
        "train", "--model", "mymodel:build", "--dataset", "digits.npz", "--devices", "2",
        "--plan", "even", "--batch-size", "32", "--microbatches", "2", "--epochs", "3",
        "--out", str(mine / "out"), "--no-plots", "--progress", "lines",
        "--checkpoint-dir", str(mine / "ckpt"),
    ]  # fmt: skip
    rc, lines = _run(argv, capsys)
    assert rc == cli.INTERRUPTED == 130
    assert lines[-1] == "pdjax train: interrupted (Ctrl-C)", lines[-5:]
    assert not any("Traceback" in line for line in lines), lines
    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    (folder,) = (mine / "ckpt").iterdir()
    with Checkpointer(folder) as ckpt:
        ckpt.claim()  # the lock was released
        assert ckpt.all_steps() in ([1], [1, 2])  # 2: committed whole by the close
        for step in ckpt.all_steps():
            ckpt.verify(step)


def test_generate_refuses_a_prompt_that_is_not_utf8(tmp_path, capsys):
    """``--prompt $'abc\\xff'``: Python keeps the byte as a lone surrogate, which the
    tokenizer cannot take; refused while parsing, before the checkpoint is read."""
    for prompt, what in (
        ("abc\udcff", "the byte 0xff, which is not UTF-8,"),
        ("\ud800", "a lone surrogate U+D800"),
    ):
        rc, lines = _run(
            ["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", prompt], capsys
        )
        assert rc == 2
        assert lines == [
            f"pdjax generate: error: --prompt holds {what} at character "
            f"{len(prompt)}; give the prompt as UTF-8 text (e.g. set the terminal's "
            "encoding, or write the character itself)"
        ]


def _fails_with(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """Makes ``pdjax simulate`` raise ``error``."""

    def run(args: object) -> int:
        raise error

    monkeypatch.setattr(simulate, "run", run)


def test_a_worker_that_lost_its_peer_is_one_line(monkeypatch, capsys):
    """A worker of a run of several processes whose transfer connection closed under it
    (its peer was killed): one line naming what happened, not JAX's stack; the launcher's
    line that follows names the process that died."""
    dispatch = "Error dispatching computation: " * 30  # one per program waiting on it
    gone = jax.errors.JaxRuntimeError(
        f"INTERNAL: {dispatch}-1 = recv() failed errno: 107 err: Transport endpoint is not "
        "connected"
    )
    _fails_with(monkeypatch, gone)
    with pytest.raises(jax.errors.JaxRuntimeError):  # one process: JAX's error as it is
        cli.main(["simulate"])
    monkeypatch.setattr(distributed, "run_position", lambda: (0, 2))
    rc, lines = _run(["simulate"], capsys)
    assert rc == 2
    assert lines == [
        "pdjax simulate: error: process 0 of 2 lost another process of the run (INTERNAL: "
        "Error dispatching computation: -1 = recv() failed errno: 107 err: Transport "
        "endpoint is not connected): it died or was ended; the launcher's line (or that "
        "process's own output) says why"
    ]
    _fails_with(
        monkeypatch,
        jax.errors.JaxRuntimeError(
            f"INTERNAL: {dispatch}SocketServer: Connection closed recv() == 0."
        ),
    )
    assert _run(["simulate"], capsys)[0] == 2
    _fails_with(monkeypatch, jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory"))
    with pytest.raises(jax.errors.JaxRuntimeError):  # anything else stays what it is
        cli.main(["simulate"])


def test_a_signalled_launcher_exits_with_its_signal(monkeypatch, capsys):
    _fails_with(monkeypatch, LaunchInterrupted(signal.SIGTERM))
    rc, lines = _run(["simulate"], capsys)
    assert rc == 128 + signal.SIGTERM and len(lines) == 1
    assert lines[0].startswith("pdjax simulate: error: got SIGTERM: ended the processes")


def test_lines_shared_with_other_processes_are_written_whole(monkeypatch):
    """Processes of a run share their launcher's stderr, which Python does not buffer:
    each line must be one write, its newline included, or another process's line lands
    before the newline ("...ending itpdjax: process ...")."""

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append(text)
            return super().write(text)

    err = Writes()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(distributed.os, "killpg", lambda *a: None)
    monkeypatch.setattr(distributed.os, "kill", lambda *a: None)
    monkeypatch.setattr(distributed.time, "sleep", lambda s: None)
    distributed._end_this_process()
    assert len(err.calls) == 1 and err.calls[0].endswith("; ending it\n"), err.calls
