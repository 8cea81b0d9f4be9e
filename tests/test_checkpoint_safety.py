"""Checkpoint safety (issue 33): the whole metadata is checksummed and bound to its step,
only pdjax's own folders are ever deleted, one writer at a time holds a folder, and a
save that fails (a full disk) ends in one CheckpointError, removing only its own
unfinished folder. The states are small and built by hand: nothing compiles."""

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.errors import CheckpointError
from pdjax.pipeline import PipelineState
from pdjax.runners import Checkpointer

EXTRA = {
    "history": [{"epoch": 0, "loss": 0.53125, "accuracy": 0.75}],
    "config": {"lr": 0.01, "batch_size": 32, "schedule": "1f1b"},
}


def _state(seed: int, size: int = 64) -> PipelineState:
    rng = np.random.default_rng(seed)
    return PipelineState(
        params=([{"w": jnp.asarray(rng.standard_normal(size).astype(np.float32))}],),
        model_state=([{}],),
        opt_state=((),),
        updates=(seed,),
        microbatches=2 * seed,
        rng=jax.random.key(seed),
    )


def _same(got: PipelineState, want: PipelineState) -> None:
    assert (got.updates, got.microbatches) == (want.updates, want.microbatches)
    w = got.params[0][0]["w"]
    assert np.asarray(w).tobytes() == np.asarray(want.params[0][0]["w"]).tobytes()


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """Steps 1, 2 and 3 (different values, the same extra)."""
    directory = tmp_path / "ckpt"
    with Checkpointer(directory, max_to_keep=None) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step), extra=EXTRA)
    return directory


def _edit_meta(directory: Path, step: int, edit) -> None:
    file = directory / str(step) / "meta" / "metadata"
    meta = json.loads(file.read_text())
    edit(meta)
    file.write_text(json.dumps(meta))


def _refused(directory: Path, step: int) -> str:
    """Both restore and verify of ``step`` raise the same CheckpointError; its message."""
    with Checkpointer(directory) as ckpt:
        with pytest.raises(CheckpointError) as restoring:
            ckpt.restore(_state(0), step=step)
        with pytest.raises(CheckpointError) as verifying:
            ckpt.verify(step)
    assert str(restoring.value) == str(verifying.value)
    return str(restoring.value)


# -- metadata checksums -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda m: m["ints"].update(microbatches=m["ints"]["microbatches"] + 1), "ints"),
        (lambda m: m["extra"]["history"][0].update(loss=0.53126), "extra"),
        (lambda m: m["extra"]["config"].update(batch_size=33), "extra"),
        (lambda m: m.update(version=3), "version"),  # posing as a version without checksums
    ],
    ids=["ints", "history", "config", "version"],
)
def test_an_edited_metadata_field_is_refused_as_damaged(saved, edit, field):
    _edit_meta(saved, 3, edit)
    message = _refused(saved, 3)
    assert message.startswith(f"step 3 in {saved} is damaged: "), message
    assert f"(field {field!r})" in message, message
    assert "verify, newest first: [2, 1]" in message, message
    with Checkpointer(saved) as ckpt:  # the intact steps still restore
        _same(ckpt.restore(_state(0), step=2)[0], _state(2))


def test_swapped_step_folders_are_refused(saved):
    os.replace(saved / "2", saved / "moving")
    os.replace(saved / "3", saved / "2")
    os.replace(saved / "moving", saved / "3")
    message = _refused(saved, 3)
    assert message.startswith(f"step 3 in {saved} is damaged: "), message
    assert "says step 2: " in message and "(field 'step')" in message, message
    assert "verify, newest first: [1]" in message, message
    assert "step 2 in " in _refused(saved, 2)
    with Checkpointer(saved) as ckpt:
        _same(ckpt.restore(_state(0), step=1)[0], _state(1))


# -- only pdjax's folders are deleted -----------------------------------------------------


def test_a_users_numbered_folder_is_never_taken_for_a_step(tmp_path):
    directory = tmp_path / "ckpt"
    results = directory / "0" / "arrays" / "my_results.npy"
    results.parent.mkdir(parents=True)
    np.save(results, np.arange(3))
    with pytest.raises(CheckpointError, match=r"holds '0', named like checkpoint steps"):
        Checkpointer(directory, max_to_keep=2)
    shutil.rmtree(directory / "0")

    # made while a run is going: not listed as a step, never deleted by the retention,
    # which still deletes pdjax's own old steps
    with Checkpointer(directory, max_to_keep=2) as ckpt:
        ckpt.save(1, _state(1))
        results.parent.mkdir(parents=True)
        np.save(results, np.arange(3))
        for step in (10, 20):
            ckpt.save(step, _state(step))
        assert ckpt.all_steps() == [10, 20]
    assert sorted(os.listdir(directory)) == ["0", "10", "20"]
    np.testing.assert_array_equal(np.load(results), np.arange(3))


def test_a_users_folder_named_like_an_unfinished_save_is_left_alone(tmp_path):
    directory = tmp_path / "ckpt"
    for name in ("4.orbax-checkpoint-tmp-123", "5.orbax-checkpoint-tmp"):
        (directory / name).mkdir(parents=True)
        (directory / name / "notes.txt").write_text("mine")
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, _state(1))
        # orbax would write step 5 into 5.orbax-checkpoint-tmp, deleting what is there
        with pytest.raises(CheckpointError, match=r"5\.orbax-checkpoint-tmp.*not pdjax's"):
            ckpt.save(5, _state(5))
        assert ckpt.all_steps() == [1]
    for name in ("4.orbax-checkpoint-tmp-123", "5.orbax-checkpoint-tmp"):
        assert (directory / name / "notes.txt").read_text() == "mine"


def test_a_writer_removes_only_the_leftovers_pdjax_marked(saved):
    """What a crashed save (``N.orbax-checkpoint-tmp``) or a deletion cut short
    (``N.pdjax-deleting-...``) left goes, when it holds pdjax's marker of step N; the same
    names without it, or marked as another step, stay."""

    def folder(name: str, marker: dict | None) -> Path:
        (saved / name).mkdir()
        (saved / name / "data").write_text("x")
        if marker is not None:
            (saved / name / "pdjax-step.json").write_text(json.dumps(marker))
        return saved / name

    ours = {"format": "pdjax.checkpoint"}
    os.replace(saved / "1", saved / "1.pdjax-deleting-5-6")  # its marker says step 1
    gone = [
        saved / "1.pdjax-deleting-5-6",
        folder("7.orbax-checkpoint-tmp", {**ours, "step": 7}),
        folder("8.orbax-checkpoint-tmp-99", {**ours, "step": 8}),
    ]
    kept = [
        folder("9.orbax-checkpoint-tmp", None),
        folder("10.orbax-checkpoint-tmp", {**ours, "step": 3}),
        folder("11.orbax-checkpoint-tmp", {"format": "other", "step": 11}),
        folder("12.pdjax-deleting-1-2", None),
    ]
    with Checkpointer(saved) as ckpt:
        assert ckpt.all_steps() == [2, 3]
        assert all(p.exists() for p in gone)  # a reader deletes nothing
        ckpt.claim()
        assert not any(p.exists() for p in gone)
        assert all((p / "data").read_text() == "x" for p in kept)
        assert ckpt.all_steps() == [2, 3]


# -- one writer ---------------------------------------------------------------------------


def test_a_second_writer_is_refused_and_readers_are_not(saved):
    first, second = Checkpointer(saved, max_to_keep=None), Checkpointer(saved, max_to_keep=None)
    try:
        first.claim()
        first.claim()  # idempotent
        holder = re.escape(
            f"{saved} is being written by another Checkpointer of this process (pid "
            f"{os.getpid()} on host {socket.gethostname()}, holding the lock "
            f"{saved / 'pdjax.lock'}): close() it"
        )
        for write in (second.claim, lambda: second.save(4, _state(4))):
            with pytest.raises(CheckpointError, match=f"^{holder}"):
                write()
        assert second.all_steps() == [1, 2, 3]  # readers take no lock
        second.verify(3)
        _same(second.restore(_state(0))[0], _state(3))
        first.save(4, _state(4))
        assert second.all_steps() == [1, 2, 3, 4]
        first.close()  # releases the lock
        second.save(5, _state(5))
    finally:
        first.close()
        second.close()
    assert "pdjax.lock" not in os.listdir(saved)


def test_a_filesystem_without_locks_warns_and_saves(saved, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with (
        Checkpointer(saved, max_to_keep=None) as ckpt,
        pytest.warns(RuntimeWarning, match=r"cannot lock .*pdjax\.lock \(No locks available\)"),
    ):
        ckpt.save(4, _state(4))
    assert ckpt.all_steps() == [1, 2, 3, 4]


def test_a_stale_lock_file_does_not_block_and_a_strangers_file_is_kept(saved):
    # a writer that died leaves its file; its lock went with it
    lock = saved / "pdjax.lock"
    lock.write_text(json.dumps({"format": "pdjax.checkpoint.lock", "pid": 1, "host": "x"}))
    with Checkpointer(saved, max_to_keep=None) as ckpt:
        ckpt.save(4, _state(4))
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()
    lock.write_text("my notes")  # not pdjax's: refused, not overwritten
    with (
        Checkpointer(saved) as ckpt,
        pytest.raises(CheckpointError, match=r"pdjax\.lock is not pdjax's lock file"),
    ):
        ckpt.claim()
    assert lock.read_text() == "my notes"


_HOLD = """
import sys
from pdjax.runners import Checkpointer
ckpt = Checkpointer(sys.argv[1])  # kept: a Checkpointer collected lets go of its lock
ckpt.claim()
print("held", flush=True)
sys.stdin.read()  # holds the lock until the test closes its input; exits without close()
"""


def test_a_writer_in_another_process_is_named_and_its_lock_dies_with_it(saved):
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(saved)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            assert holder.stdout.readline() == "held\n"
            pid = rf"pid {holder.pid} on host {re.escape(socket.gethostname())}"
            with (
                Checkpointer(saved) as ckpt,
                pytest.raises(CheckpointError, match=rf"being written by another run \({pid}"),
            ):
                ckpt.claim()
        finally:
            holder.communicate("", timeout=60)
    assert holder.returncode == 0
    with Checkpointer(saved, max_to_keep=None) as ckpt:  # its file is left; no lock with it
        assert (saved / "pdjax.lock").exists()
        ckpt.save(4, _state(4))


# -- failed saves -------------------------------------------------------------------------


def _disk_full_midway(monkeypatch) -> None:
    """Makes the next save write half its arrays and then fail as TensorStore does on a
    full disk."""
    from orbax.checkpoint import type_handlers

    serialize = type_handlers.ArrayHandler.serialize

    async def half_then_full(self, values, infos, args=None):
        n = max(1, len(values) // 2)
        for f in await serialize(self, values[:n], infos[:n], args and args[:n]):
            f.result()
        raise ValueError(
            'RESOURCE_EXHAUSTED: Error writing "params.0.0.w/0" in OCDBT database: Failed '
            "to write 2248704 bytes to file 4: No space left on device [os_error_code='28']"
        )

    monkeypatch.setattr(type_handlers.ArrayHandler, "serialize", half_then_full)


def _failed_save_leaves_step_1(directory: Path, message: str, step: int) -> None:
    assert message.startswith(f"cannot save step {step} in {directory}: "), message
    assert "the disk is full" in message and "bytes are free" in message, message
    assert "the step needs about " in message, message
    # its temporary folder is gone (the lock file is the open checkpointer's)
    assert sorted(os.listdir(directory)) == ["1", "pdjax.lock"]
    with Checkpointer(directory) as ckpt:
        assert ckpt.all_steps() == [1]
        ckpt.verify(1)
        _same(ckpt.restore(_state(0))[0], _state(1))


def test_a_save_failing_on_a_full_disk_says_so_and_removes_its_folder(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, _state(1))
        _disk_full_midway(monkeypatch)
        with pytest.raises(CheckpointError) as info:
            ckpt.save(2, _state(2, size=4096))
        monkeypatch.undo()
        _failed_save_leaves_step_1(directory, str(info.value), 2)
        ckpt.save(2, _state(2))  # the same checkpointer saves again once there is room
        assert ckpt.all_steps() == [1, 2]


def test_a_save_on_a_really_full_disk(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        directory = mount / "ckpt"
        with Checkpointer(directory) as ckpt:
            ckpt.save(1, _state(1))
            with pytest.raises(CheckpointError) as info:
                ckpt.save(2, _state(2, size=1_000_000))  # 4 MB of random floats
            _failed_save_leaves_step_1(directory, str(info.value), 2)
            assert "needs about 4,0" in str(info.value), str(info.value)
    finally:
        subprocess.run(["umount", str(mount)], check=True)
