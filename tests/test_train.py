"""The training loop and ``pdjax train``: accuracy, targets, divergence, resume; models and
datasets of your own, metrics that follow checkpoints, TensorBoard, log lines, and
configuration errors before anything runs."""

import glob
import json
import math
import os
import struct
import sys
import tempfile

import jax
import numpy as np
import pytest
from user_model import mine_config as _mine

from pdjax.apps import data
from pdjax.apps.cli import main
from pdjax.apps.data.stream import TrainStream
from pdjax.apps.train import EpochRecord, TrainConfig, TrainingDiverged, build, train
from pdjax.apps.train.outputs import read_metrics, sync_metrics
from pdjax.apps.train.planning import epoch_microbatches
from pdjax.errors import DataError, LayerError, PipelineError


def _cfg(**kw):
    base = dict(
        model="mlp",
        schedule="pipedream",
        devices=2,
        plan="even",
        epochs=2,
        batch_size=32,
        microbatches=2,
        learning_rate=3e-3,
    )
    return TrainConfig(**{**base, **kw})


def test_pipedream_learns_digits_and_stops_at_target():
    result = train(_cfg(epochs=6, target_accuracy=0.9))
    assert result.stopped == "target", [r.test_accuracy for r in result.history]
    assert result.final_accuracy >= 0.9
    assert result.target_epoch == len(result.history)
    assert result.time_to_target == pytest.approx(result.history[-1].elapsed)
    # PipeDream updates after every microbatch (16 samples), streaming the whole epoch
    assert result.history[0].updates == 1438 // 16


def test_dp_and_a_flush_schedule_run_the_same_loop():
    for schedule in ("dp", "1f1b"):
        result = train(_cfg(schedule=schedule, epochs=1))
        assert len(result.history) == 1 and np.isfinite(result.history[0].train_loss)


def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):

    cfg = _cfg(epochs=3)
    n = epoch_microbatches(cfg, data.digits(flatten=True).num_train)  # an epoch's microbatches
    good = TrainStream.take

    def poisoned(self, count):  # a call never spans two epochs
        epoch = self.position // n
        return [(x * np.nan if epoch == 1 else x, y) for x, y in good(self, count)]

    monkeypatch.setattr(TrainStream, "take", poisoned)
    with pytest.raises(TrainingDiverged, match=r"epoch 2.*last good checkpoint"):
        train(cfg, checkpoint_dir=tmp_path)
    from pdjax.runners import Checkpointer

    assert Checkpointer(tmp_path).latest_step() == 1


def test_resume_continues_bit_identically(tmp_path):
    whole = train(_cfg(epochs=2))
    train(_cfg(epochs=1), checkpoint_dir=tmp_path)
    resumed = train(_cfg(epochs=2), checkpoint_dir=tmp_path)
    assert [r.epoch for r in resumed.history] == [1, 2]
    for a, b in zip(
        jax.tree.leaves(whole.state.params), jax.tree.leaves(resumed.state.params), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    assert resumed.history[1].test_accuracy == whole.history[1].test_accuracy
    with pytest.raises(PipelineError, match="differs in \\['learning_rate'\\]"):
        train(_cfg(epochs=3, learning_rate=1e-2), checkpoint_dir=tmp_path)


def test_bad_settings_fail_before_training():
    with pytest.raises(PipelineError, match="multiple of microbatches"):
        _cfg(batch_size=30, microbatches=4)
    with pytest.raises(PipelineError, match="unknown schedule"):
        _cfg(schedule="ring")
    with pytest.raises(PipelineError, match="language model"):
        train(_cfg(dataset="text"))


def test_cli_trains_compares_and_writes_metrics_and_plots(tmp_path, capsys):
    argv = [
        "train",
        "--model",
        "mlp",
        "--devices",
        "2",
        "--plan",
        "even",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--microbatches",
        "2",
        "--compare",
        "dp",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "summary" in out and "pipedream" in out and "dp" in out
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["run"] for line in lines] == ["pipedream", "dp"]
    assert (tmp_path / "accuracy-vs-epochs.png").stat().st_size > 1000
    assert (tmp_path / "accuracy-vs-seconds.png").stat().st_size > 1000


# -- models and datasets of your own -----------------------------------------------------------


def test_a_model_of_your_own_trains_on_an_npz_dataset(mine):
    result = train(_mine(epochs=2), metrics_path=mine / "m.jsonl")
    assert sys.modules["mymodel"].SEEN == {"config": "tiny", "seq_len": 16}
    losses = [r.train_loss for r in result.history]
    assert losses[1] < losses[0] and all(math.isfinite(x) for x in losses)
    assert result.final_accuracy > 0.5
    assert result.history[0].updates == 320 // 16  # PipeDream: one update per microbatch
    lines = [json.loads(x) for x in (mine / "m.jsonl").read_text().splitlines()]
    assert [x["epoch"] for x in lines] == [1, 2]
    # no accuracy function: trained and evaluated on the loss, accuracy NaN (null in JSON)
    cfg = _cfg(model="mymodel:no_accuracy", dataset="digits.npz", epochs=1, schedule="dp")
    result = train(cfg, metrics_path=mine / "n.jsonl")
    assert math.isnan(result.final_accuracy) and math.isfinite(result.history[0].test_loss)
    assert json.loads((mine / "n.jsonl").read_text())["test_accuracy"] is None
    with pytest.raises(PipelineError, match="target_accuracy needs an accuracy"):
        train(_cfg(model="mymodel:no_accuracy", dataset="digits.npz", target_accuracy=0.5))


def test_datasets_are_checked_against_the_model_before_training(mine):
    spec, ds = build(_mine())
    assert spec.task == "custom" and len(spec.layers) == 3
    assert ds.name == "digits.npz" and ds.train_x.shape == (320, 64) and ds.num_classes == 10
    _, ds = build(_cfg(model="mymodel:build", dataset="digits"))  # 64 features: flat digits
    assert ds.name == "digits-flat"
    _, ds = build(_cfg(model="mlp", dataset="digits.npz"))  # a bundled model, your data
    assert ds.num_train == 320
    with pytest.raises(PipelineError, match=r"takes inputs \(12,\).*digits has \(8, 8, 1\)"):
        build(_cfg(model="mymodel:twelve", dataset="digits"))
    with pytest.raises(DataError, match=r"digits.npz.*x_train has rows of shape \(64,\)"):
        build(_cfg(model="mymodel:twelve", dataset="digits.npz"))
    np.savez("labels.npz", x_train=ds.train_x, y_train=ds.train_y + 5, x_test=ds.test_x,
             y_test=ds.test_y)  # fmt: skip
    with pytest.raises(DataError, match=r"labels.npz.*y_train holds labels 5\.\.14.*10 classes"):
        build(_cfg(model="mlp", dataset="labels.npz"))
    with pytest.raises(DataError, match=r"'nothere.npz' does not exist"):
        build(_cfg(dataset="nothere.npz"))
    with pytest.raises(PipelineError, match=r"unknown dataset 'mnist'.*\.npz file"):
        _cfg(dataset="mnist")
    with pytest.raises(LayerError, match=r"package\.module:factory"):
        _cfg(model="resnet18")


def test_metrics_follow_the_checkpoint_by_appending_only(tmp_path):
    """A resume's re-sync appends (read_metrics' rule: a line of run id R and epoch e
    replaces R's earlier lines of epochs >= e); no line is ever deleted or rewritten."""
    path = tmp_path / "m.jsonl"

    def rec(epoch, loss=1.0):
        return EpochRecord(
            epoch=epoch,
            train_loss=loss,
            test_loss=1.0,
            test_accuracy=0.5,
            seconds=1.0,
            elapsed=float(epoch),
            samples_per_second=10.0,
            updates=10 * epoch,
        )

    def epochs(run_id="a"):
        return [(x["epoch"], x["train_loss"]) for x in read_metrics(path) if x["run_id"] == run_id]

    other = json.dumps({"run": "dp", "run_id": "b", "epoch": 1})
    path.write_text(f"{other}\n")
    sync_metrics(path, "pipedream", "a", [rec(1), rec(2)])  # lines missing: written
    assert [json.loads(x).get("run") for x in path.read_text().splitlines()] == [
        "dp",
        "pipedream",
        "pipedream",
    ]
    before = path.read_text()
    sync_metrics(path, "pipedream", "a", [rec(1), rec(2)])  # all there: unchanged
    assert path.read_text() == before
    with path.open("a") as f:  # an epoch written after the checkpoint it never reached
        f.write(json.dumps({"run": "pipedream", "run_id": "a", "epoch": 3}) + "\n")
    grown = path.read_text()
    sync_metrics(path, "pipedream", "a", [rec(1), rec(2)])  # epoch 2 again ends it
    assert path.read_text().startswith(grown)  # kept, not rewritten
    assert epochs() == [(1, 1.0), (2, 1.0)]
    # another branch of the run (resumed from step 1): its epoch 2 differs, and stands
    sync_metrics(path, "pipedream", "a", [rec(1), rec(2, loss=0.5)])
    assert epochs() == [(1, 1.0), (2, 0.5)]
    assert [x["run_id"] for x in read_metrics(path) if x["run"] == "dp"] == ["b"]
    # a line a crash cut off is kept; the lines after it start on a line of their own
    with path.open("a") as f:
        f.write('{"run": "pipedream", "run_id": "a", "ep')
    cut = path.read_text()
    sync_metrics(path, "pipedream", "a", [rec(1), rec(2, loss=0.5), rec(3)])
    assert path.read_text().startswith(cut + "\n")
    assert epochs() == [(1, 1.0), (2, 0.5), (3, 1.0)]
    assert len(path.read_text().splitlines()) == 8  # every line written is still there


def _argv(out, *extra):
    return [
        "train", "--model", "mlp", "--devices", "2", "--plan", "even", "--batch-size", "32",
        "--microbatches", "2", "--out", str(out), "--no-plots", *extra,
    ]  # fmt: skip


def test_cli_resume_appends_metrics_and_says_so(mine, capsys):
    out, ckpt = mine / "out", str(mine / "ckpt")
    argv = _argv(out, "--dataset", "digits.npz", "--checkpoint-dir", ckpt)
    assert main([*argv, "--epochs", "1"]) == 0
    first = (out / "metrics.jsonl").read_text()
    assert "resuming" not in capsys.readouterr().out
    assert main([*argv, "--epochs", "2"]) == 0
    stdout = capsys.readouterr().out
    assert "resuming from checkpoint step 20 (epoch 1)" in stdout  # 320 // 16 updates
    assert stdout.index("resuming") < stdout.index("pipedream epoch 2/2")
    text = (out / "metrics.jsonl").read_text()
    assert text.startswith(first)  # appended, not truncated
    assert [json.loads(x)["epoch"] for x in text.splitlines()] == [1, 2]


def _events(folder):
    """``(tag, step, value)`` of every scalar in the TensorBoard event files of ``folder``."""
    from tensorboardX.proto import event_pb2

    out = []
    for name in sorted(glob.glob(f"{folder}/events.out.tfevents.*")):
        with open(name, "rb") as f:
            raw = f.read()
        i = 0
        while i < len(raw):  # TFRecord: length, its CRC, the event, its CRC
            (n,) = struct.unpack("<Q", raw[i : i + 8])
            event = event_pb2.Event.FromString(raw[i + 12 : i + 12 + n])
            i += 12 + n + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_cli_tensorboard_and_one_line_per_epoch_off_a_terminal(mine, capsys):
    pytest.importorskip("tensorboardX")
    argv = _argv(mine / "out", "--model", "mymodel:build", "--dataset", "digits.npz")
    assert main([*argv, "--epochs", "2", "--lr", "1e-2", "--tensorboard", "tb"]) == 0
    stdout = capsys.readouterr().out  # not a terminal: lines, no progress bar
    lines = [x for x in stdout.splitlines() if x.startswith("pipedream epoch")]
    assert [x.split(":")[0] for x in lines] == ["pipedream epoch 1/2", "pipedream epoch 2/2"]
    assert all("train loss" in x and "test accuracy" in x for x in lines)
    assert not any("━" in x and "epoch" in x for x in stdout.splitlines())
    events = _events(mine / "tb" / "pipedream")
    tags = {tag for tag, _, _ in events}
    assert tags >= {"train/loss", "test/loss", "test/accuracy", "train/samples_per_second"}
    assert "train/mfu" in tags and "test/perplexity" not in tags  # not a language model
    metrics = [json.loads(x) for x in (mine / "out" / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        logged = {tag: v for tag, step, v in events if step == m["epoch"]}
        assert logged["train/loss"] == pytest.approx(m["train_loss"], rel=1e-6)
        assert logged["test/accuracy"] == pytest.approx(m["test_accuracy"], rel=1e-6)
        assert logged["train/mfu"] == pytest.approx(m["mfu"], rel=1e-6)
        assert m["perplexity"] is None and m["tokens_per_second"] is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "nosuchmodule:build"], "cannot import 'nosuchmodule'"),
        (["--model", "resnet18"], "unknown model 'resnet18'"),
        (["--dataset", "nothere.npz"], "'nothere.npz' does not exist"),
        (["--model", "mymodel:twelve", "--dataset", "digits.npz"], "x_train has rows of shape"),
        (["--batch-size", "33"], "not a multiple of microbatches"),
        (["--compare", "dp,ring"], "unknown schedule 'ring'"),
        (["--schedule", "1f1b", "--vertical-sync"], "vertical_sync is an option of pipedream"),
        (["--model", "mymodel:no_accuracy", "--target-accuracy", "0.9"], "needs an accuracy"),
        (["--plan", "noplan.json"], "'noplan.json' is not a file"),
        (["--compare", "dp", "--batch-size", "34", "--microbatches", "1", "--devices", "4"],
         "multiple of 4"),
        (["--schedule", "interleaved", "--devices", "4"], "interleaved needs 4 devices x 2"),
    ],
)  # fmt: skip
def test_cli_config_errors_come_before_anything_runs_or_is_written(mine, capsys, extra, message):
    out = mine / "out"
    assert main([*_argv(out, "--epochs", "1", "--progress", "bar"), *extra]) == 2
    captured = capsys.readouterr()
    assert message in captured.err, captured.err
    assert captured.out == ""  # no run started, no progress bar
    assert not out.exists()


def test_schedule_auto_profiles_plans_and_trains(tmp_path, monkeypatch):
    """--schedule auto: plan_auto picks the schedule, M and stages; the run trains with
    them, and a flush schedule is chosen unless stale weights are allowed. A run without
    outputs keeps the plan in a temporary file: its one copy."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = TrainConfig(
        model="mlp", dataset="digits", schedule="auto", devices=4, epochs=1, batch_size=64
    )
    result = train(cfg, warmup=False)
    resolved = result.config  # what plan_auto chose
    assert resolved.schedule in ("gpipe", "1f1b", "zb-h1", "zb-h2")
    assert 64 % resolved.microbatches == 0 and resolved.plan.endswith(".json")
    assert os.path.dirname(resolved.plan) == str(tmp_path)
    assert math.isfinite(result.history[-1].train_loss)
    # ranked with the driver's and the shared CPU pool's costs, measured before planning
    from pdjax.partition import Plan, auto_choice

    host = auto_choice(Plan.load(resolved.plan))["host"]
    assert host["seconds_per_action"] > 0 and host["concurrency"] >= 1.0
    with pytest.raises(PipelineError, match="option of schedule='auto'"):
        TrainConfig(model="mlp", schedule="1f1b", allow_stale=True)
