"""The runnable examples in ``examples/``, in their tiny modes: they run, write what they
say, and learn."""

import importlib.util
import json
import math
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

from pdjax.apps import data
from pdjax.errors import LayerError
from pdjax.models import load_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_custom_dataset_example_runs_tiny(tmp_path, capsys, monkeypatch):
    out, npz = tmp_path / "out", tmp_path / "data" / "digits64.npz"
    argv = [str(EXAMPLES / "custom_dataset.py"), "--out", str(out), "--data", str(npz)]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("PDJAX_EXAMPLE_TINY", "1")
    with pytest.raises(SystemExit) as e:
        runpy.run_path(argv[0], run_name="__main__")
    stdout = capsys.readouterr().out
    assert e.value.code == 0, stdout
    assert "$ pdjax train --model examples.custom_dataset:build --dataset" in stdout
    # the dataset it wrote is a valid .npz dataset, tiny
    ds = data.load_npz(npz)
    assert (ds.num_train, ds.num_test, ds.num_classes) == (256, 128, 10)
    assert ds.train_x.shape[1:] == (64,)
    # what pdjax train wrote: one line per epoch, finite losses that fall, real accuracy
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["run"], r["epoch"]) for r in records] == [("pipedream", 1), ("pipedream", 2)]
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["test_loss"]) for r in records)
    assert records[1]["train_loss"] < records[0]["train_loss"]
    assert 0.1 < records[1]["test_accuracy"] <= 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary[0]["config"]["model"] == "examples.custom_dataset:build"
    assert "pipedream: epoch 2, train loss" in stdout  # the example's own closing line
    if importlib.util.find_spec("tensorboardX") is not None:  # the example then writes them
        assert list((out / "tensorboard" / "pipedream").glob("events.out.tfevents.*"))


def test_custom_dataset_factory_is_a_model_of_its_own():
    spec = load_model("examples.custom_dataset:build", offer={"config": "paper"})
    assert spec.task == "custom" and spec.layers.names == ("b0", "b1", "b2", "logits")
    assert spec.config == "paper" and spec.num_classes == 10 and spec.has_accuracy
    x, y = spec.sample_batch(5)
    assert x.shape == (5, 64) and x.dtype == np.float32 and y.shape == (5,)
    same = load_model(f"{EXAMPLES / 'custom_dataset.py'}:build")  # as a file
    assert same.layers.names == spec.layers.names
    with pytest.raises(LayerError, match="takes --config"):
        load_model("examples.custom_dataset:build", offer={"config": "huge"})


def _run_example(name, capsys, monkeypatch):
    """Runs ``examples/<name>`` in its tiny mode in this process (the suite's 8 CPU devices:
    the example's own device count must not be set again once JAX has started)."""
    import jax

    monkeypatch.setattr(jax.config, "update", lambda *a, **k: None)
    module = runpy.run_path(str(EXAMPLES / name), run_name="example")
    result = module["main"](["--tiny"])
    return result, capsys.readouterr().out


def test_nnx_model_example_runs_tiny_and_its_own_model_agrees(capsys, monkeypatch):
    result, out = _run_example("nnx_model.py", capsys, monkeypatch)
    assert math.isfinite(result["loss"]) and 0.0 <= result["accuracy"] <= 1.0
    # the last line compares the user's own model (weights put back) with the pipeline
    line = out.strip().splitlines()[-1]
    assert line.startswith("first test batch: your model ")
    own, piped = (float(w) for w in line.replace(",", "").split() if w[0].isdigit())
    assert abs(own - piped) < 1e-3


def test_linen_model_example_runs_tiny_and_its_own_model_agrees(capsys, monkeypatch):
    result, out = _run_example("linen_model.py", capsys, monkeypatch)
    # the user's CNN with the trained variables classifies as the pipeline evaluated
    evaluated = float(out.split("test accuracy ")[1].split()[0])
    assert result["accuracy"] == pytest.approx(evaluated, abs=1e-3)
    assert result["accuracy"] > 0.15  # one short epoch learns something (chance: 0.1)


def test_split_transformer_example_runs_tiny_and_its_own_model_agrees(capsys, monkeypatch):
    result, out = _run_example("split_transformer.py", capsys, monkeypatch)
    assert math.isfinite(result["loss"]) and 0.0 <= result["accuracy"] <= 1.0
    assert "tied ['decoder/Embed_0/embedding']" in out  # the shared embedding, found
    # the user's own TransformerLM.apply on the trained variables, as the pipeline evaluates
    line = out.strip().splitlines()[-1]
    assert line.startswith("first test batch: your model ")
    own, piped = (float(w) for w in line.replace(",", "").split() if w[0].isdigit())
    assert abs(own - piped) < 1e-3


def test_split_resnet_example_runs_tiny_and_its_own_model_agrees(capsys, monkeypatch):
    result, out = _run_example("split_resnet.py", capsys, monkeypatch)
    assert math.isfinite(result["loss"]) and 0.0 <= result["accuracy"] <= 1.0
    assert "'01_ResNetBlock_0'" in out  # cut before each block, the glue in its own layer
    # the user's own ResNet.apply(train=False) on the trained params and batch_stats
    line = out.strip().splitlines()[-1]
    assert line.startswith("first test batch: your model ")
    own, piped = (float(w) for w in line.replace(",", "").split() if w[0].isdigit())
    assert abs(own - piped) < 1e-3
