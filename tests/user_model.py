"""A user's own model file and dataset in the current directory, for the tests of
``--model pkg:factory`` and ``--dataset x.npz`` (a pytest plugin: see conftest.py)."""

import sys

import numpy as np
import pytest

from pdjax.apps import data
from pdjax.apps.train import TrainConfig

MODEL_PY = """
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

SEEN = {}


def _loss(out, y):
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def build(config="tiny", seq_len=None):
    SEEN.update(config=config, seq_len=seq_len)
    return {
        "layers": [nn.Dense(32), nn.relu, nn.Dense(10)],
        "loss": _loss,
        "sample_batch": (np.zeros((2, 64), np.float32), np.zeros((2,), np.int32)),
        "accuracy": lambda out, y: jnp.mean(jnp.argmax(out, -1) == y),
        "num_classes": 10,
    }


def no_accuracy():
    model = build()
    del model["accuracy"]
    return model


def twelve():
    model = build()
    model["sample_batch"] = (np.zeros((2, 12), np.float32), np.zeros((2,), np.int32))
    return model
"""


@pytest.fixture
def mine(tmp_path, monkeypatch):
    """``mymodel.py`` in the current directory and ``digits.npz``: 320 + 100 flat digits."""
    (tmp_path / "mymodel.py").write_text(MODEL_PY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymodel", raising=False)
    ds = data.digits(flatten=True)
    np.savez(
        tmp_path / "digits.npz",
        x_train=ds.train_x[:320],
        y_train=ds.train_y[:320],
        x_test=ds.test_x[:100],
        y_test=ds.test_y[:100],
    )
    yield tmp_path
    sys.modules.pop("mymodel", None)


def mine_config(**kw):
    """A short pipedream run of ``mymodel:build`` on ``digits.npz`` (the ``mine`` fixture's
    files), with ``kw`` replacing any field."""
    base = dict(
        model="mymodel:build",
        dataset="digits.npz",
        schedule="pipedream",
        devices=2,
        plan="even",
        epochs=2,
        batch_size=32,
        microbatches=2,
        learning_rate=1e-2,
    )
    return TrainConfig(**{**base, **kw})
