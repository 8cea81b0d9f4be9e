"""The training loop and ``pdjax train``: accuracy, targets, divergence, resume."""

import json

import jax
import numpy as np
import pytest

from pdjax.cli import main
from pdjax.errors import PipelineError
from pdjax.train import TrainConfig, TrainingDiverged, train


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
    from pdjax import data

    good = data.Dataset.train_batches

    def poisoned(self, batch_size, *, seed, epoch, start=0):
        for x, y in good(self, batch_size, seed=seed, epoch=epoch, start=start):
            yield (x * np.nan if epoch == 1 else x), y

    monkeypatch.setattr(data.Dataset, "train_batches", poisoned)
    with pytest.raises(TrainingDiverged, match=r"epoch 2.*last good checkpoint"):
        train(_cfg(epochs=3), checkpoint_dir=tmp_path)
    from pdjax.pipeline.checkpoint import Checkpointer

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
