"""What ``pdjax train`` writes and never touches: metrics bound to a run's id (a resume
never mixes with another run's lines, deletes or rewrites one), writers that never follow
a symbolic link, every output path checked before any work, one folder per run, another
run's summary and plots kept, and a divergence found in the optimizer state.

One run trains here (module-scoped, one short epoch); the rest are refusals made before
any work, or the writers and checks called directly."""

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax._jsonio import append_text, write_atomic
from pdjax.apps import data
from pdjax.apps.cli import main
from pdjax.apps.train import (
    EpochRecord,
    TrainConfig,
    TrainingDiverged,
    TrainResult,
    build,
    check_outputs,
    check_results,
    make_runner,
    read_metrics,
    train,
)
from pdjax.errors import CheckpointError, PdjaxError, PipelineError
from pdjax.pipeline import Pipeline
from pdjax.runners import Checkpointer

OTHER = "0" * 32  # another run's id


def _cfg(npz, **kw):
    base = dict(
        model="mlp", dataset=str(npz), devices=2, plan="even", epochs=1, batch_size=32,
        microbatches=2, learning_rate=1e-2,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _argv(npz, out, *extra):
    return [
        "train", "--model", "mlp", "--dataset", str(npz), "--devices", "2", "--plan", "even",
        "--batch-size", "32", "--microbatches", "2", "--epochs", "1", "--lr", "1e-2",
        "--progress", "lines", "--out", str(out), *extra,
    ]  # fmt: skip


def _line(epoch, run_id=OTHER, run="pipedream"):
    line = {"run": run, "run_id": run_id, "epoch": epoch, "train_loss": 1.0}
    if run_id is None:
        del line["run_id"]
    return json.dumps(line) + "\n"


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    """320 + 100 flat digits (64 features, which the bundled mlp takes)."""
    path = tmp_path_factory.mktemp("data") / "digits.npz"
    ds = data.digits(flatten=True)
    np.savez(path, x_train=ds.train_x[:320], y_train=ds.train_y[:320], x_test=ds.test_x[:100],
             y_test=ds.test_y[:100])  # fmt: skip
    return path


@pytest.fixture(scope="module")
def trained(npz, tmp_path_factory):
    """``pdjax train`` of one epoch with checkpoints and plots: ``(out, checkpoint dir)``."""
    root = tmp_path_factory.mktemp("trained")
    out, ckpt = root / "out", root / "ckpt"
    assert main(_argv(npz, out, "--checkpoint-dir", str(ckpt))) == 0
    return out, ckpt


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if ``pdjax train`` starts any work (loading the model and data
    comes before profiling, planning and training)."""

    def work(*args, **kwargs):
        raise AssertionError("pdjax train started work before refusing")

    monkeypatch.setattr("pdjax.apps.train.build", work)


# -- metrics bound to a run's id -----------------------------------------------------------------


def test_a_resume_refuses_another_runs_metrics_and_changes_nothing(
    trained, npz, tmp_path, monkeypatch, capsys
):
    out, ckpt = trained
    ours = read_metrics(out / "metrics.jsonl")
    assert len(ours) == 1 and len(ours[0]["run_id"]) == 32
    assert json.loads((out / "summary.json").read_text())[0]["run_id"] == ours[0]["run_id"]

    def work(*args, **kwargs):
        raise AssertionError("a resume made its runner before refusing")

    monkeypatch.setattr("pdjax.apps.train.loop.make_runner", work)
    folder = ckpt / "pipedream"
    for lines in (_line(1) + _line(2) + _line(3), _line(1, run_id=None)):  # None: older pdjax
        path = tmp_path / "metrics.jsonl"
        path.write_text(_line(1, run="dp") + lines)
        for refuse in (
            lambda p=path: train(_cfg(npz, epochs=2), checkpoint_dir=folder, metrics_path=p),
            lambda p=path: check_outputs(_cfg(npz, epochs=2), folder, p),
        ):
            with pytest.raises(PipelineError, match=r"holds metrics of another 'pipedream' run"):
                refuse()
            assert path.read_text() == _line(1, run="dp") + lines
    assert Checkpointer(folder).all_steps() == [1]
    # the command line: exit 2, the file named, nothing trained or written
    assert main(_argv(npz, tmp_path, "--epochs", "2", "--checkpoint-dir", str(ckpt))) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "another --out" in err, err
    assert path.read_text() == _line(1, run="dp") + _line(1, run_id=None)
    assert Checkpointer(folder).all_steps() == [1]


def test_a_second_run_on_a_checkpoint_folder_is_refused_before_any_work(
    trained, npz, tmp_path, monkeypatch
):
    _, ckpt = trained
    folder = ckpt / "pipedream"

    def work(*args, **kwargs):
        raise AssertionError("the second run made its runner before refusing")

    monkeypatch.setattr("pdjax.apps.train.loop.make_runner", work)
    with Checkpointer(folder) as first:
        first.claim()  # a run writing the folder
        with pytest.raises(CheckpointError, match=rf"pid {os.getpid()}"):
            train(_cfg(npz, epochs=2), checkpoint_dir=folder, metrics_path=tmp_path / "m.jsonl")
    assert not (tmp_path / "m.jsonl").exists()
    assert Checkpointer(folder).all_steps() == [1]


def test_a_checkpoint_from_before_run_ids_resumes_with_an_id_made_from_it(npz, tmp_path):
    """A checkpoint without a run id (pdjax before them): the run gets an id made from its
    settings and first epoch, the same at every resume; its own lines (equal to its
    checkpoint's records) are accepted, others refused."""
    cfg = _cfg(npz)
    spec, ds = build(cfg)
    sample = ds.train_x[: cfg.microbatch_size]
    runner, _ = make_runner(cfg, spec, sample)
    state = runner.init(jax.random.key(cfg.seed), sample)
    record = EpochRecord(1, 2.0, 1.5, 0.5, 1.25, 1.25, 256.0, 20)
    # the fields an epoch had then (tokens/s, perplexity and MFU came later)
    fields = {k: v for k, v in dataclasses.asdict(record).items() if math.isfinite(v)}
    with Checkpointer(tmp_path / "ckpt") as ckpt:  # what pdjax saved before run ids
        extra = {"config": dataclasses.asdict(cfg), "history": [fields]}
        ckpt.save(1, state, extra)
    path = tmp_path / "m.jsonl"
    old = {"run": "pipedream", **fields}
    path.write_text(json.dumps(old) + "\n")
    ids = []
    for _ in range(2):
        with (
            pytest.warns(UserWarning, match=r"without run ids: the run is given the id"),
            pytest.warns(UserWarning, match=r"holds no input state \(a pdjax before streamed"),
        ):
            result = train(cfg, checkpoint_dir=tmp_path / "ckpt", metrics_path=path)
        ids.append(result.run_id)
    assert ids[0] == ids[1] and len(ids[0]) == 32
    lines = path.read_text().splitlines()
    assert lines[0] == json.dumps(old)  # kept; the run's history follows under its new id
    assert [x["epoch"] for x in read_metrics(path) if x.get("run_id") == ids[0]] == [1]
    assert len(lines) == 2
    path.write_text(json.dumps({**old, "train_loss": 9.0}) + "\n")  # not this run's
    with pytest.raises(PipelineError, match=r"no run id: an older pdjax"):
        check_outputs(cfg, tmp_path / "ckpt", path)


# -- writers and output paths --------------------------------------------------------------------


def test_writers_never_follow_a_symbolic_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("not pdjax's\n")
    link = tmp_path / "link"
    link.symlink_to(victim)
    with pytest.raises(PdjaxError, match=r"link.* is a symbolic link"):
        write_atomic(link, "x")
    with pytest.raises(PdjaxError, match=r"link.* is a symbolic link"):
        append_text(link, "x\n")
    pytest.importorskip("matplotlib")
    from pdjax.apps.plots import plot_training

    cfg = TrainConfig(model="mlp", devices=2, plan="even")
    history = [EpochRecord(1, 2.0, 1.5, 0.5, 1.0, 1.0, 256.0, 20)]
    (tmp_path / "accuracy-vs-seconds.png").symlink_to(victim)
    with pytest.raises(PdjaxError, match=r"accuracy-vs-seconds.png: it is a symbolic link"):
        plot_training([TrainResult(cfg, "even", history, "epochs")], tmp_path)
    assert link.is_symlink() and (tmp_path / "accuracy-vs-seconds.png").is_symlink()
    assert victim.read_text() == "not pdjax's\n"


def _unwritable(tmp_path):
    """A folder nothing can be created in, even by root (whom ``os.access`` and chmod do
    not stop): a read-only one for a user, else sysfs."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir(mode=0o555)
        return folder
    try:
        fd, probe = tempfile.mkstemp(dir="/sys")
    except OSError:
        return Path("/sys")
    os.close(fd)
    os.unlink(probe)
    pytest.skip("root can write in /sys here: no folder to test an unwritable --out with")


@pytest.mark.parametrize(
    "case",
    ["out-under-a-file", "out-read-only", "metrics-link", "summary-link", "plot-link",
     "plan-link", "run-folder-link", "checkpoint-dir-under-a-file", "tensorboard-read-only"],
)  # fmt: skip
def test_output_paths_are_refused_before_any_work(case, npz, tmp_path, no_work, capsys):
    victim = tmp_path / "victim"
    victim.write_text("not pdjax's\n")
    out, extra = tmp_path / "out", []
    if case == "out-under-a-file":
        out = victim / "out"
    elif case == "out-read-only":
        out = _unwritable(tmp_path) / "out"
    elif case == "checkpoint-dir-under-a-file":
        extra = ["--checkpoint-dir", str(victim / "ckpt")]
    elif case == "tensorboard-read-only":
        extra = ["--tensorboard", str(_unwritable(tmp_path) / "tb")]
    else:
        name = {
            "metrics-link": "metrics.jsonl",
            "summary-link": "summary.json",
            "plot-link": "accuracy-vs-epochs.png",
            "plan-link": "pipedream/plan.json",
            "run-folder-link": "pipedream",
        }[case]
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).symlink_to(victim if name != "pipedream" else tmp_path)
    assert main(_argv(npz, out, *extra)) == 2
    err = capsys.readouterr().err
    option = {"checkpoint-dir-under-a-file": "--checkpoint-dir"}.get(case, "--out")
    option = "--tensorboard" if case == "tensorboard-read-only" else option
    assert err.startswith(f"pdjax train: error: {option}") and len(err.splitlines()) == 1, err
    assert victim.read_text() == "not pdjax's\n"


def test_two_runs_of_one_label_are_refused(npz, tmp_path, no_work, capsys):
    argv = _argv(npz, tmp_path / "out", "--schedule", "pipedream", "--compare", "dp,pipedream")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the run 'pipedream' is asked for twice" in err and "--compare" in err, err
    assert not (tmp_path / "out").exists()


# -- the summary and plots of a run --------------------------------------------------------------


def test_a_run_replaces_only_its_own_summary_and_plots(trained, npz, tmp_path, capsys):
    out, ckpt = trained
    summary = (out / "summary.json").read_text()
    plot = (out / "accuracy-vs-epochs.png").read_bytes()
    lines = (out / "metrics.jsonl").read_text()
    # another (fresh) run into the same --out: its metrics could be kept, not the summary
    fresh = _argv(npz, out, "--schedule", "dp", "--checkpoint-dir", str(tmp_path / "c"))
    assert main(fresh) == 2
    err = capsys.readouterr().err
    assert "holds the summary of another run ('pipedream', run id" in err, err
    assert (out / "summary.json").read_text() == summary
    assert (out / "accuracy-vs-epochs.png").read_bytes() == plot
    assert not (tmp_path / "c").exists()
    # the run itself, resumed (nothing left to train): its own summary and plots replaced
    assert main(_argv(npz, out, "--checkpoint-dir", str(ckpt))) == 0
    assert "resuming from checkpoint step" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text()) == json.loads(summary)
    assert (out / "metrics.jsonl").read_text() == lines  # every line there already
    # plots that no summary names, and a summary that is not one, are kept too
    for name, text in (("accuracy-vs-epochs.png", "x"), ("summary.json", "[1]")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / name).write_text(text)
        with pytest.raises(PipelineError, match=rf"{name}.*another out, or move it away"):
            check_results(folder, [("pipedream", OTHER)], plots=True)
    check_results(tmp_path / "accuracy-vs-epochs.png", [], plots=False)  # no plots: fine


# -- divergence in the optimizer state -----------------------------------------------------------


def test_an_infinite_adam_moment_is_a_divergence_and_is_not_saved(npz, tmp_path, monkeypatch):
    """The weights and losses stay finite; only the optimizer state (Adam's moments)
    holds an infinity: the epoch must not become a checkpoint."""
    run = Pipeline.run

    def poisoned(self, state, *args, **kwargs):
        state, metrics = run(self, state, *args, **kwargs)
        inf = jax.tree.map(
            lambda x: x + jnp.inf if jnp.issubdtype(x.dtype, jnp.inexact) else x,
            state.opt_state,
        )
        return state._replace(opt_state=inf), metrics

    monkeypatch.setattr(Pipeline, "run", poisoned)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(TrainingDiverged, match=r"epoch 1.*optimizer state holds NaN or inf"):
        train(_cfg(npz), checkpoint_dir=ckpt, metrics_path=tmp_path / "m.jsonl", warmup=False)
    assert Checkpointer(ckpt).all_steps() == []
    assert read_metrics(tmp_path / "m.jsonl") == []
