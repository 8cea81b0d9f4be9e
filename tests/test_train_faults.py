"""Faults of ``pdjax train`` and what survives them: divergence and the checkpoints it
keeps, metrics that survive restarts and stay strict JSON, the plan a resumed run keeps,
automatic plans that run, the devices hint, and resuming from a chosen step."""

import dataclasses
import importlib
import json
import math
import shutil
import tempfile

import jax
import numpy as np
import pytest
from user_model import mine_config as _cfg

from pdjax.apps.cli import main
from pdjax.apps.data.stream import TrainStream
from pdjax.apps.train import (
    PLAN_FILE,
    TrainConfig,
    TrainingDiverged,
    auto_plan,
    build,
    check,
    make_runner,
    read_metrics,
    train,
)
from pdjax.apps.train.planning import epoch_microbatches
from pdjax.errors import CheckpointError, PipelineError
from pdjax.partition import Plan, Topology, plan_pipedream
from pdjax.profile import LayerProfile, Profile
from pdjax.runners import Checkpointer


@pytest.fixture
def here(mine):
    """``mymodel.py`` and ``digits.npz`` in the current directory (tests/user_model.py)."""
    return mine


def _argv(out, *extra):
    return [
        "train", "--model", "mymodel:build", "--dataset", "digits.npz", "--devices", "2",
        "--plan", "even", "--batch-size", "32", "--microbatches", "2", "--epochs", "1",
        "--out", str(out), "--no-plots", "--progress", "lines", *extra,
    ]  # fmt: skip


def _strict(line):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def _epochs(path, run="pipedream"):
    """The epochs of ``run`` that stand in the metrics file (read_metrics' rule)."""
    return [e["epoch"] for e in read_metrics(path) if e["run"] == run]


def _raw_epochs(path, run="pipedream"):
    """The epochs of every line of ``run`` in the metrics file, as written (strict JSON)."""
    return [e["epoch"] for e in map(_strict, path.read_text().splitlines()) if e["run"] == run]


def _all_finite(tree):
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree))


# -- divergence ----------------------------------------------------------------------------------


def test_a_huge_learning_rate_saves_nothing_and_says_so(tmp_path):
    cfg = TrainConfig(
        model="mlp", devices=2, plan="even", epochs=3, batch_size=32, microbatches=2,
        optimizer="sgd", learning_rate=1e3,
    )  # fmt: skip
    with pytest.raises(TrainingDiverged) as info:
        train(cfg, checkpoint_dir=tmp_path / "ckpt", warmup=False)
    message = str(info.value)
    assert "epoch 1" in message and "no checkpoint was saved" in message
    assert "learning_rate=1000" in message and "--" not in message.replace(str(tmp_path), "")
    assert Checkpointer(tmp_path / "ckpt").all_steps() == []


def test_the_epoch_whose_weights_blow_up_is_not_saved(here, monkeypatch):
    """The last batch of epoch 2 is scaled so far that its update leaves the weights
    unusable, while every loss measured during the epoch (before each update) is finite:
    that epoch must not become the checkpoint a resume starts from."""
    n = epoch_microbatches(_cfg(), build(_cfg())[1].num_train)  # an epoch's microbatches
    good = TrainStream.take

    def blown(self, count):  # a call never spans two epochs
        start = self.position
        batches = good(self, count)
        return [(x * 1e30 if start + i == 2 * n - 1 else x, y) for i, (x, y) in enumerate(batches)]

    monkeypatch.setattr(TrainStream, "take", blown)
    ckpt = here / "ckpt"

    def sgd(**kw):  # plain SGD: the step grows with the gradient (Adam's would not)
        return _cfg(optimizer="sgd", **kw)

    with pytest.raises(TrainingDiverged) as info:
        train(sgd(epochs=3), checkpoint_dir=ckpt, metrics_path=here / "m.jsonl", warmup=False)
    message = str(info.value)
    assert "epoch 2" in message
    assert Checkpointer(ckpt).all_steps() == [1]
    assert f"step 1 (after epoch 1), {ckpt / '1'}" in message and (ckpt / "1").is_dir()
    assert _epochs(here / "m.jsonl") == [1]
    # the kept step is a good one: resuming from it finds finite weights and metrics
    resumed = train(sgd(epochs=1), checkpoint_dir=ckpt, warmup=False)
    assert resumed.resumed_epoch == 1 and math.isfinite(resumed.history[0].test_loss)
    assert _all_finite(resumed.state.params)


# -- metrics -------------------------------------------------------------------------------------


def test_a_fresh_run_refuses_an_out_folder_holding_metrics(here, capsys):
    out = here / "out"
    assert main(_argv(out)) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    for extra in ([], ["--checkpoint-dir", str(here / "fresh")]):
        assert main(_argv(out, *extra)) == 2
        err = capsys.readouterr().err
        assert "already holds metrics" in err and "another --out" in err, err
        assert (out / "metrics.jsonl").read_text() == before
    assert not (here / "fresh").exists()


def test_metrics_follow_commits_and_resumes_write_each_epoch_once(here, monkeypatch):
    path, ckpt = here / "m.jsonl", here / "ckpt"
    save = Checkpointer.save

    def crash_at_2(self, step, state, extra=None):
        if step == 2:
            raise OSError("disk full")
        save(self, step, state, extra)

    monkeypatch.setattr(Checkpointer, "save", crash_at_2)
    with pytest.raises(OSError):
        train(_cfg(epochs=2), checkpoint_dir=ckpt, metrics_path=path, warmup=False)
    assert _epochs(path) == [1]  # no line for the epoch that was never checkpointed
    monkeypatch.setattr(Checkpointer, "save", save)
    train(_cfg(epochs=2), checkpoint_dir=ckpt, metrics_path=path, warmup=False)
    assert _raw_epochs(path) == [1, 2]
    # a crash after a commit, before (or while) writing its line: the cut line is kept
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1][:20])
    train(_cfg(epochs=3), checkpoint_dir=ckpt, metrics_path=path, warmup=False)
    assert path.read_text().startswith(lines[0] + "\n" + lines[1][:20] + "\n")
    assert _epochs(path) == [1, 2, 3]
    assert len(path.read_text().splitlines()) == 4  # 1, the cut line, 2, 3: each once


def test_metrics_and_summary_are_strict_json(here):
    out = here / "out"
    assert main([*_argv(out), "--model", "mymodel:no_accuracy", "--compare", "dp"]) == 0
    lines = [_strict(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["run"] for x in lines] == ["pipedream", "dp"]
    assert all(x["test_accuracy"] is None for x in lines)
    summary = json.loads(
        (out / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c)
    )
    assert summary[0]["history"][0]["test_accuracy"] is None


# -- plans ---------------------------------------------------------------------------------------


def test_a_resume_follows_the_plan_the_run_started_with(here, monkeypatch):
    ckpt = here / "ckpt"
    first = train(_cfg(plan="auto", epochs=1), checkpoint_dir=ckpt, warmup=False)
    saved = Plan.load(ckpt / PLAN_FILE)
    assert first.plan == saved.describe().splitlines()[0]

    def replan(*args, **kwargs):
        raise AssertionError("a resumed run planned again")

    monkeypatch.setattr("pdjax.apps.train.planning.auto_plan", replan)
    resumed = train(_cfg(plan="auto", epochs=2), checkpoint_dir=ckpt, warmup=False)
    assert resumed.plan == first.plan and [r.epoch for r in resumed.history] == [1, 2]
    # an explicit plan file: the saved plan's copy resumes, another plan is refused
    copy = here / "copy.json"
    shutil.copy(ckpt / PLAN_FILE, copy)
    again = train(_cfg(plan=str(copy), epochs=3), checkpoint_dir=ckpt, warmup=False)
    assert [r.epoch for r in again.history] == [1, 2, 3]
    other = here / "other.json"
    changed = saved.to_dict()
    changed["time_per_microbatch"] *= 2
    Plan.from_dict(changed).save(other)
    with pytest.raises(PipelineError, match=r"differs from .*plan\.json"):
        train(_cfg(plan=str(other), epochs=4), checkpoint_dir=ckpt, warmup=False)


def test_the_plan_is_written_beside_the_metrics_and_runs_again(here, monkeypatch):
    """Without --checkpoint-dir too: a fresh --plan auto run measures and may plan other
    stages, so its plan file is how it is repeated."""
    out = here / "out"
    assert main(_argv(out, "--plan", "auto")) == 0
    written = out / "pipedream" / PLAN_FILE
    plan = Plan.load(written)
    summary = json.loads((out / "summary.json").read_text())
    assert summary[0]["plan"] == plan.describe().splitlines()[0]

    def replan(*args, **kwargs):
        raise AssertionError("a run given a plan file planned")

    monkeypatch.setattr("pdjax.apps.train.planning.auto_plan", replan)
    again = here / "again"
    assert main(_argv(again, "--plan", str(written))) == 0
    assert json.loads((again / "summary.json").read_text())[0]["plan"] == summary[0]["plan"]
    assert Plan.load(again / "pipedream" / PLAN_FILE).to_dict() == plan.to_dict()


def test_a_resumed_schedule_auto_run_keeps_its_choice(here, monkeypatch):
    ckpt = here / "ckpt"
    temp = here / "temp"  # the system's temporary folder, for the runs below
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    cfg = _cfg(schedule="auto", plan="auto", batch_size=64, microbatches=1, epochs=1)
    first = train(cfg, checkpoint_dir=ckpt, warmup=False)
    assert (ckpt / PLAN_FILE).is_file()
    # the run names the plan among its outputs and leaves no temporary copy behind
    assert first.config.plan == str(ckpt / PLAN_FILE)
    assert not list(temp.glob("pdjax-plan-auto-*"))

    def replan(*args, **kwargs):
        raise AssertionError("a resumed run planned again")

    monkeypatch.setattr("pdjax.partition.plan_auto", replan)
    resumed = train(dataclasses.replace(cfg, epochs=2), checkpoint_dir=ckpt, warmup=False)
    assert resumed.plan == first.plan
    for key in ("schedule", "microbatches", "options"):
        assert getattr(resumed.config, key) == getattr(first.config, key)


def _replicating(num_layers, batch):
    """A measured profile whose optimal plan is data parallelism over all the devices:
    costly layers with few parameters, and activations too big to cross a cut."""
    layers = [
        LayerProfile(
            f"layer{i}",
            forward_flops=1e8,
            backward_flops=2e8,
            forward_bytes_accessed=1e6,
            backward_bytes_accessed=2e6,
            param_bytes=1000,
            input_bytes=10**8,
            output_bytes=10**8,
            forward_seconds=1e-3,
            backward_seconds=2e-3,
        )
        for i in range(num_layers)
    ]
    return Profile.chain(layers, batch_size=batch, time_source="measured:cpu")


@pytest.mark.parametrize("devices", [3, 5, 6])
def test_plan_auto_runs_on_device_counts_not_dividing_the_microbatch(devices, monkeypatch):
    cfg = TrainConfig(model="cnn", devices=devices, plan="auto")  # microbatches of 16
    spec, ds = build(cfg)
    sample = ds.train_x[: cfg.microbatch_size]
    prof = _replicating(len(spec.layers), cfg.microbatch_size)
    monkeypatch.setattr(importlib.import_module("pdjax.profile"), "profile", lambda *a, **k: prof)
    devs = jax.devices()[:devices]
    optimal = plan_pipedream(
        prof, Topology.from_devices(devs), num_microbatches=cfg.microbatches, replication="split"
    )
    assert [st.replicas for st in optimal.stages] == [devices]  # 16 samples over 3, 5, 6
    plan = auto_plan(spec, sample, devs, "pipedream", cfg.microbatches)
    # the fallback: not the optimizer's plan, but one whose replica counts divide 16
    assert plan.stages != optimal.stages
    assert all(cfg.microbatch_size % st.replicas == 0 for st in plan.stages), plan.describe()
    runner, _ = make_runner(cfg, spec, sample, plan)
    assert runner.num_stages == plan.num_stages


def test_too_few_devices_names_the_devices_option(here):
    cfg = _cfg(devices=len(jax.devices()) + 8)
    with pytest.raises(PipelineError, match=f"pass devices={len(jax.devices())} "):
        check(cfg, *build(cfg))


# -- resuming from a chosen step -----------------------------------------------------------------


def test_resume_step_goes_on_from_the_step_asked_for(here):
    ckpt, path = here / "ckpt", here / "m.jsonl"
    whole = train(_cfg(epochs=3), checkpoint_dir=ckpt, metrics_path=path, warmup=False)
    assert Checkpointer(ckpt).all_steps() == [1, 2, 3]
    with pytest.raises(CheckpointError, match=r"resume_step=7: .* \[1, 2, 3\]"):
        train(_cfg(epochs=3), checkpoint_dir=ckpt, resume_step=7)
    again = train(_cfg(epochs=3), checkpoint_dir=ckpt, metrics_path=path, resume_step=1)
    assert again.resumed_epoch == 1
    assert [r.test_loss for r in again.history] == [r.test_loss for r in whole.history]
    assert Checkpointer(ckpt).all_steps() == [1, 2, 3]
    kept = sorted(p.name for p in ckpt.glob("set-aside-after-1-*/*"))
    assert kept == ["2", "3"]  # the later steps it replaced are kept aside
    # the lines of the steps set aside are kept too; epoch 1 again ends them, and the new
    # ones come after it and stand
    assert _raw_epochs(path) == [1, 2, 3, 1, 2, 3]
    assert _epochs(path) == [1, 2, 3]
    stand = read_metrics(path)
    assert [x["test_loss"] for x in stand] == [r.test_loss for r in again.history]
    assert {x["run_id"] for x in stand} == {whole.run_id} == {again.run_id}


def test_a_damaged_newest_step_is_not_skipped_silently(here, capsys):
    ckpt = here / "ckpt"
    train(_cfg(epochs=2), checkpoint_dir=ckpt, warmup=False)
    shutil.rmtree(ckpt / "2" / "meta")  # the newest step is unreadable
    with pytest.raises(CheckpointError, match=r"with resume_step \(steps there: \[1\]\)"):
        train(_cfg(epochs=3), checkpoint_dir=ckpt, warmup=False)
    assert Checkpointer(ckpt).all_steps() == [1, 2]  # nothing trained or saved meanwhile
    resumed = train(_cfg(epochs=2), checkpoint_dir=ckpt, resume_step=1, warmup=False)
    assert [r.epoch for r in resumed.history] == [1, 2]
    assert main(_argv(here / "out", "--resume-step", "1")) == 2
    assert "--checkpoint-dir" in capsys.readouterr().err
