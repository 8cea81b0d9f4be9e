"""What ``pdjax train`` checks of a model against its data before anything compiles: the
dataset's labels against the width of the model's outputs, the model's own accuracy
function (one fraction in [0, 1]), and the values of an ``.npz`` dataset (finite, bounded).
Each refusal names the model or the file, what is wrong and what to do."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pdjax
from pdjax.apps import data
from pdjax.apps.data.dataset import Dataset
from pdjax.apps.train import TrainConfig, check
from pdjax.apps.train.evaluation import evaluate
from pdjax.errors import DataError, PipelineError
from pdjax.models import CustomModel
from pdjax.models.spec import as_model_spec


def ce(out, y):
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def fraction(out, y):
    return jnp.mean(jnp.argmax(out, -1) == y)


def model(width=10, *, x_shape=(4, 6), y=None, loss=ce, accuracy=fraction, name="mine"):
    """A one-layer model of ``width`` outputs for rows of ``x_shape[1:]``."""
    y = np.zeros(x_shape[:-1], np.int32) if y is None else y
    layers = pdjax.sequential(nn.Dense(width))
    batch = (np.zeros(x_shape, np.float32), y)
    spec = CustomModel(layers, loss, batch, accuracy=accuracy, name=name)
    return as_model_spec(spec)


def dataset(y_train, y_test=None, *, x_row=(6,)):
    """A dataset of zeros with these targets (``y_test``: the first 4 of ``y_train``)."""
    y_test = y_train[:4] if y_test is None else y_test
    zeros = np.zeros((len(y_train), *x_row), np.float32)
    return Dataset("d.npz", zeros, y_train, zeros[: len(y_test)], y_test, num_classes=0)


CFG = TrainConfig(model="mine:build", dataset="d.npz", schedule="dp", devices=1, batch_size=8)
DIGITS = np.arange(20, dtype=np.int32) % 10


# -- labels against the model's outputs ----------------------------------------------------


def test_a_model_with_fewer_outputs_than_classes_is_refused_before_training():
    """3 outputs for labels 0-9: the loss would be NaN, reported as a diverged run."""
    with pytest.raises(PipelineError, match=r"puts out 3 values.*float32\[2, 3\].*0\.\.9") as e:
        check(CFG, model(3), dataset(DIGITS))
    assert "nn.Dense(10)" in str(e.value) and "store them as floats" in str(e.value)


def test_negative_labels_are_refused_too():
    labels = DIGITS - 1
    with pytest.raises(PipelineError, match=r"labels range over -1\.\.8"):
        check(CFG, model(10), dataset(labels))


def test_a_label_only_in_the_test_split_is_found():
    with pytest.raises(PipelineError, match=r"0\.\.12"):
        check(CFG, model(10), dataset(DIGITS, np.array([0, 12], np.int32)))


@pytest.mark.parametrize(
    "spec,ds",
    [
        (model(10), dataset(DIGITS)),  # classes that fit
        # regression: float targets of any value
        (model(1, loss=mse, accuracy=None, y=np.zeros(4, np.float32)),
         dataset(np.linspace(0, 50, 20, dtype=np.float32))),
        # one output, integer targets (counts): not class indices
        (model(1, loss=mse, accuracy=None), dataset(DIGITS * 7)),
        # targets of the outputs' own shape (multi-label): not class indices
        (model(3, loss=mse, accuracy=None, y=np.zeros((4, 3), np.int32)),
         dataset(np.ones((20, 3), np.int32) * 5)),
        # a language model: tokens < vocabulary at every position
        (model(50, x_shape=(4, 8, 6), y=np.zeros((4, 8), np.int32)),
         dataset(np.arange(160, dtype=np.int32).reshape(20, 8) % 50, x_row=(8, 6))),
    ],
)  # fmt: skip
def test_models_whose_targets_fit_or_are_no_class_indices_pass(spec, ds):
    check(CFG, spec, ds)


def test_a_language_model_with_a_small_vocabulary_is_refused():
    tokens = np.arange(160, dtype=np.int32).reshape(20, 8) % 50
    spec = model(40, x_shape=(4, 8, 6), y=np.zeros((4, 8), np.int32))
    with pytest.raises(PipelineError, match=r"puts out 40 values.*\[2, 8, 40\].*0\.\.49"):
        check(CFG, spec, dataset(tokens, x_row=(8, 6)))


# -- the model's own accuracy ----------------------------------------------------------------


@pytest.mark.parametrize(
    "accuracy,match",
    [
        (lambda out, y: jnp.argmax(out, -1) == y, r"returned bool\[2\]"),
        (lambda out, y: (jnp.argmax(out, -1) == y).astype(jnp.float32), r"float32\[2\]"),
        (lambda out, y: "high", r"returned a str 'high'"),
        (lambda out, y: 100 * fraction(out, y), r"returned 100\.0.*not a count or a percent"),
        (lambda out, y: jnp.sum(jnp.argmax(out, -1) == y), r"returned 2\.0"),
        (lambda out, y: out["logits"], r"fails on the model's outputs.*(TypeError|IndexError)"),
    ],
)
def test_an_accuracy_that_is_not_one_fraction_is_refused_naming_it(accuracy, match):
    with pytest.raises(PipelineError, match=match) as e:
        check(CFG, model(10, accuracy=accuracy, name="mymodel:build"), dataset(DIGITS))
    assert "accuracy of model 'mymodel:build'" in str(e.value)


def test_evaluation_refuses_an_accuracy_that_is_not_a_scalar():
    """The same accuracy reaching the evaluation from Python (not through check)."""
    spec = model(10, accuracy=lambda out, y: jnp.argmax(out, -1) == y)
    ds = dataset(DIGITS)
    variables = spec.layers.init(jax.random.key(0), ds.train_x[:1])
    with pytest.raises(PipelineError, match=r"returned bool\[4\].*\.mean\(\)"):
        evaluate(spec, variables, ds, batch_size=4)


# -- values of an .npz dataset ---------------------------------------------------------------


def _npz(tmp_path, **overrides):
    arrays = dict(
        x_train=np.ones((20, 6)),
        y_train=np.arange(20) % 3,
        x_test=np.ones((5, 6), np.float32),
        y_test=np.arange(5) % 3,
    )
    arrays.update(overrides)
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    return path


def _with(shape, index, value, dtype=np.float64):
    a = np.ones(shape, dtype)
    a[index] = value
    return a


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(x_train=_with((20, 6), (3, 2), np.nan)), r"x_train\[3, 2\] is nan \(NaN; 1 value"),
        (dict(x_test=_with((5, 6), (4, 5), np.inf, np.float32)), r"x_test\[4, 5\] is inf"),
        (dict(x_train=_with((20, 6), (0, 1), -1e30)), r"x_train\[0, 1\] is -1e\+30 \(too large"),
        (dict(y_train=_with(20, 7, np.nan)), r"y_train\[7\] is nan"),
        (dict(x_train=_with((20, 6), (2, 0), 1e300)), r"x_train\[2, 0\] is 1e\+300"),
    ],
)
def test_npz_floats_must_be_finite_and_bounded(tmp_path, overrides, match):
    path = _npz(tmp_path, **overrides)
    with pytest.raises(DataError, match=match) as e:
        data.load_npz(path)
    assert str(path) in str(e.value) and "|x| <= 1e+20" in str(e.value)


def test_npz_floats_at_the_bound_are_read(tmp_path):
    x = _with((20, 6), (1, 1), -1e20)
    assert data.load_npz(_npz(tmp_path, x_train=x)).train_x[1, 1] == np.float32(-1e20)
