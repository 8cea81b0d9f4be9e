"""Damaged checkpoints: a flipped bit, overwritten bytes, a truncated or missing file,
edited metadata, or a folder that is not pdjax's end in one CheckpointError that names the
step, what is wrong and the steps that verify; never in wrong values or a raw orbax error.

The damage is done to real files: a step's arrays live in orbax's OCDBT database,
``<step>/arrays/ocdbt.process_0/d/<hash>`` (zstd-compressed chunks); its metadata is the
JSON file ``<step>/meta/metadata``."""

import asyncio
import errno
import json
import os
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from test_fixed_names import no_hang

from pdjax.errors import CheckpointError
from pdjax.models import get_model
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline, PipelineState, even_stages
from pdjax.runners import Checkpointer, checkpoint


def _state(seed: int) -> PipelineState:
    """A small 2-stage state built by hand (nothing to compile): a 64x64 random weight,
    big enough to be the largest data file, and a copy of it (stored once, "same_as")."""
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((64, 64)).astype(np.float32))
    return PipelineState(
        params=(
            [{"w": w, "b": jnp.asarray(rng.standard_normal(8).astype(np.float32))}],
            [{"w": w}],
        ),
        model_state=([{}], [{}]),
        opt_state=((), ()),
        updates=(seed, seed),
        microbatches=2 * seed,
        rng=jax.random.key(seed),
    )


def _assert_same(got: PipelineState, want: PipelineState) -> None:
    assert (got.updates, got.microbatches) == (want.updates, want.microbatches)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if isinstance(b, int):
            continue
        if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.fixture
def saved(tmp_path):
    """A folder with intact steps 1 and 2 (different values)."""
    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
    return directory


def _largest_data_file(step_dir: Path) -> Path:
    files = [
        Path(root, name)
        for root, _, names in os.walk(step_dir / "arrays")
        for name in names
        if Path(root).name == "d"  # OCDBT's data files; the rest is orbax's metadata
    ]
    return max(files, key=lambda p: p.stat().st_size)


def _restore_fails(directory: Path, step: int | None = None) -> str:
    """Restoring (default: the newest step) raises a CheckpointError; its message."""
    with Checkpointer(directory) as ckpt, pytest.raises(CheckpointError) as info:
        ckpt.restore(_state(0), step=step)
    return str(info.value)


def _offers_step_1(message: str) -> None:
    """The message names damaged step 2 and offers step 1, the one that verifies."""
    assert message.startswith("step 2 in ") and " is damaged: " in message, message
    assert "verify, newest first: [1]" in message, message
    assert "restore(..., step=1)" in message and "--resume-step 1" in message, message
    assert "TensorStore(" not in message and "\n" not in message, message  # no raw dump


def _restores_step_1(directory: Path) -> None:
    with Checkpointer(directory) as ckpt:
        restored, _ = ckpt.restore(_state(0), step=1)
        ckpt.verify(1)
    _assert_same(restored, _state(1))


# -- damaged arrays -----------------------------------------------------------------------


@pytest.mark.parametrize("where", [0.25, 0.5, 0.75])
def test_one_flipped_bit_is_detected(saved, where, capfd):
    # Compressed data: a flip either breaks decompression (a read error) or decodes to
    # other values (a checksum mismatch); both must end in the same CheckpointError.
    path = _largest_data_file(saved / "2")
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x08
    path.write_bytes(bytes(data))
    message = _restore_fails(saved)
    _offers_step_1(message)
    assert "array params.0.0.w " in message, message
    _restores_step_1(saved)
    assert "Exception ignored" not in capfd.readouterr().err


def test_fifty_overwritten_bytes_and_a_truncated_file_are_detected(saved, capfd):
    path = _largest_data_file(saved / "2")
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 50] = bytes(range(50))
    path.write_bytes(bytes(data))
    _offers_step_1(_restore_fails(saved))

    path.write_bytes(bytes(data[: len(data) // 2]))
    message = _restore_fails(saved)
    _offers_step_1(message)
    assert re.search(r"array params\.0\.0\.w cannot be read \(OUT_OF_RANGE", message), message
    # orbax's abandoned reads of the other arrays print nothing either
    assert "Exception ignored" not in capfd.readouterr().err
    _restores_step_1(saved)


def test_a_missing_data_file_is_detected(saved):
    _largest_data_file(saved / "2").unlink()
    _offers_step_1(_restore_fails(saved))
    _restores_step_1(saved)


def _late_wakeup_error() -> RuntimeError:
    """The error TensorStore's thread meets when it wakes a closed loop: raised in the
    loop's own call_soon_threadsafe, with no Python caller above it."""
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        assert e.__traceback__ is not None
        return e.with_traceback(e.__traceback__.tb_next)
    raise AssertionError("a closed loop accepted a callback")


def test_late_wakeups_of_abandoned_reads_are_silenced_and_nothing_else(saved, monkeypatch):
    """An abandoned read's TensorStore future may finish after orbax closed its event loop
    and fail in the dead loop (an "Exception ignored", at any later moment: CI saw one).
    After a failed restore exactly those are silenced; other unraisable errors, even the
    same message raised from Python code, still reach the previous hook."""
    seen: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    monkeypatch.setattr(checkpoint.reads, "_late_wakeups_dropped", False)
    _largest_data_file(saved / "2").unlink()
    _restore_fails(saved)
    late = _late_wakeup_error()
    try:
        raise RuntimeError("Event loop is closed")
    except RuntimeError as e:
        from_python = e
    other = ValueError("something else")
    for exc in (late, from_python, other):
        sys.unraisablehook(SimpleNamespace(exc_value=exc, object=None))
    assert seen == [from_python, other]


def test_a_full_disk_is_one_error_and_the_abandoned_writes_stay_quiet(tmp_path, monkeypatch):
    """A write failing for space (ENOSPC injected at orbax's save) is one CheckpointError
    saying so; the other writes orbax abandoned then wake its closed loop, from
    TensorStore's thread, at any moment (a traceback each: 87 of them above the error in
    a real run). Those are dropped from then on; other unraisable errors still print."""
    seen: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    monkeypatch.setattr(checkpoint.reads, "_late_wakeups_dropped", False)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    save = ocp.CheckpointManager.save
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _state(1))
        monkeypatch.setattr(ocp.CheckpointManager, "save", full)
        with pytest.raises(CheckpointError, match=r"cannot save step 2 .*the disk is full"):
            ckpt.save(2, _state(2))
        monkeypatch.setattr(ocp.CheckpointManager, "save", save)
        assert ckpt.all_steps() == [1]
        ckpt.save(2, _state(2))  # room again: the next save works
    late = _late_wakeup_error()
    other = ValueError("something else")
    for exc in (late, other):
        sys.unraisablehook(SimpleNamespace(exc_value=exc, object=None))
    assert seen == [other]


def test_intact_files_with_other_values_fail_their_checksums(saved, tmp_path):
    """Files that decode cleanly but hold other values (step 2's arrays replaced by those
    of another save of the same shapes) fail the checksum itself, whatever the codec."""
    other = tmp_path / "other"
    with Checkpointer(other) as ckpt:
        ckpt.save(2, _state(3))
    shutil.rmtree(saved / "2" / "arrays")
    shutil.copytree(other / "2" / "arrays", saved / "2" / "arrays")
    message = _restore_fails(saved)
    _offers_step_1(message)
    assert "array params.0.0.b does not match its checksum" in message, message
    with Checkpointer(saved) as ckpt, pytest.raises(CheckpointError) as info:
        ckpt.verify()
    assert str(info.value) == message  # verify raises what restore would
    _restores_step_1(saved)


def test_verify_checks_a_step_without_a_template(saved):
    with Checkpointer(saved) as ckpt:
        ckpt.verify()
        ckpt.verify(1)
        with pytest.raises(CheckpointError, match=r"no checkpoint for step 3 .*\[1, 2\]"):
            ckpt.verify(3)
    path = _largest_data_file(saved / "1")
    path.write_bytes(path.read_bytes()[:100])
    with Checkpointer(saved) as ckpt:
        ckpt.verify(2)
        with pytest.raises(CheckpointError, match=r"^step 1 in .* is damaged: .*params\.0\.0\.w"):
            ckpt.verify(1)
    # both damaged: no step to offer
    path = _largest_data_file(saved / "2")
    path.write_bytes(path.read_bytes()[:100])
    message = _restore_fails(saved)
    assert message.startswith("step 2 in "), message
    assert "its other steps [1] are damaged too, so start the run afresh" in message, message


def test_a_damaged_step_fails_a_restore_into_another_plan(tmp_path):
    # The re-planned restore reads every stored array (onto the new shardings): it checks them too.
    spec = get_model("mlp")
    x, _ = spec.sample_batch(4)
    pipe = Pipeline(spec.layers, even_stages(4, 2), spec.loss, optax.adam(1e-2))
    resplit = Pipeline(
        spec.layers, [StagePlan(0, 0, (0,)), StagePlan(1, 3, (1,))], spec.loss, optax.adam(1e-2)
    )
    state = pipe.init(jax.random.key(0), x)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
    path = _largest_data_file(tmp_path / "2")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    template = resplit.init(jax.random.key(1), x)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError) as info:
            ckpt.restore(template, pipeline=resplit)
        _offers_step_1(str(info.value))
        moved, _ = ckpt.restore(template, step=1, pipeline=resplit)
    assert np.asarray(jax.tree.leaves(moved.params[1])[0]).tobytes() == (
        np.asarray(jax.tree.leaves(state.params[1])[0]).tobytes()
    )


# -- metadata -----------------------------------------------------------------------------


def _edit_meta(directory: Path, step: int, edit) -> Path:
    file = directory / str(step) / "meta" / "metadata"
    meta = json.loads(file.read_text())
    edit(meta)
    file.write_text(json.dumps(meta))
    return file


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda m: m.pop("ints"), "ints"),
        (lambda m: m.pop("arrays"), "arrays"),
        (lambda m: m["ints"].pop("microbatches"), "ints.microbatches"),
        (lambda m: m["arrays"]["rng"].update(key_impl="bogus"), "arrays.rng.key_impl"),
        (lambda m: m["arrays"]["params.0.0.w"].update(dtype="floaty"), "arrays.params.0.0.w.dtype"),
        (lambda m: m["arrays"]["params.0.0.b"].pop("checksum"), "arrays.params.0.0.b.checksum"),
        (
            lambda m: m["arrays"]["params.1.0.w"].update(same_as="nowhere"),
            "arrays.params.1.0.w.same_as",
        ),
    ],
)
def test_metadata_missing_a_field_names_the_file_and_the_field(saved, edit, field):
    file = _edit_meta(saved, 2, edit)
    message = _restore_fails(saved)
    assert f"its metadata {file} " in message and f"(field {field!r})" in message, message
    _offers_step_1(message)


def test_metadata_that_is_not_json_names_the_file(saved):
    file = saved / "2" / "meta" / "metadata"
    file.write_text('{"format": "pdjax.checkpoint", "version": 3,')
    message = _restore_fails(saved)
    assert f"its metadata {file} cannot be read" in message, message
    _offers_step_1(message)
    file.unlink()
    _offers_step_1(_restore_fails(saved))
    _restores_step_1(saved)


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_metadata_that_is_no_regular_file_is_damage_not_a_hang(saved, kind):
    file = saved / "2" / "meta" / "metadata"
    file.unlink()
    if kind == "fifo":
        os.mkfifo(file)
    else:
        file.symlink_to("/dev/zero")
    with no_hang():
        message = _restore_fails(saved)
    assert f"its metadata {file} is not a regular file" in message, message
    _offers_step_1(message)


def test_steps_of_earlier_versions_without_checksums_still_restore(saved):
    def as_version_2(meta):  # no checksums, no step, and no marker file
        meta["version"] = 2
        del meta["step"], meta["checksums"]
        for entry in meta["arrays"].values():
            del entry["checksum"]

    for step in (1, 2):
        _edit_meta(saved, step, as_version_2)
        (saved / str(step) / "pdjax-step.json").unlink()
    with Checkpointer(saved, max_to_keep=2) as ckpt:  # opens: its steps hold pdjax's metadata
        ckpt.verify()
        _assert_same(ckpt.restore(_state(0))[0], _state(2))
        _assert_same(ckpt.restore(_state(0), step=1)[0], _state(1))
        ckpt.save(3, _state(3))  # and the retention deletes them as pdjax's own
        assert ckpt.all_steps() == [2, 3]
    assert not (saved / "1").exists()


# -- folders that are not pdjax's ---------------------------------------------------------


def test_a_folder_of_other_numbered_folders_is_refused_and_left_alone(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "data.txt").write_text("not a checkpoint")
    (tmp_path / "2").mkdir()
    for keep in (1, None):
        with pytest.raises(
            CheckpointError, match=r"holds '1', '2', named like checkpoint steps .*pick an empty"
        ):
            Checkpointer(tmp_path, max_to_keep=keep)
    assert (tmp_path / "1" / "data.txt").read_text() == "not a checkpoint"
    assert sorted(os.listdir(tmp_path)) == ["1", "2"] and not os.listdir(tmp_path / "2")


def test_new_empty_or_unrelated_file_folders_open(tmp_path):
    with Checkpointer(tmp_path / "new") as ckpt:
        assert ckpt.all_steps() == []
    (tmp_path / "notes.txt").write_text("run notes")
    with Checkpointer(tmp_path, max_to_keep=1) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
        assert ckpt.all_steps() == [2]
    assert (tmp_path / "notes.txt").read_text() == "run notes"
