"""Runtime faults found by hostile use (issue 44): a layer whose traces differ is refused
rather than trained as a mix of its traces."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pdjax.errors import PipelineError
from pdjax.layers import sequential
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline
from pdjax.schedules import ScheduleSpec


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


_CALLS = itertools.count(1)


class _Counting(nn.Module):
    """Multiplies by how often it was called: a Python-side counter, so every trace is
    another function."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x) * float(next(_CALLS))


class _Callbacks(nn.Module):
    """The same function on every trace, though each trace makes new callables (a
    ``custom_jvp``'s rule, a debug callback, a host callback): not refused."""

    @nn.compact
    def __call__(self, x):
        jax.debug.callback(lambda a: None, x)
        one = jax.pure_callback(
            lambda: np.ones((), np.float32), jax.ShapeDtypeStruct((), jnp.float32)
        )
        return jax.nn.relu(nn.Dense(4)(x)) * one


def _pipe(layer):
    layers = sequential(nn.Dense(4), layer, nn.Dense(4))
    # one stage: its forward-backward and its fused update are two programs of one step
    plan = (StagePlan(0, 2, (0,)),)
    return Pipeline(
        layers, plan, _mse, optax.sgd(0.1), schedule=ScheduleSpec("1f1b", microbatches=2)
    )


def test_a_layer_whose_traces_differ_is_refused():
    x, t = np.ones((8, 4), np.float32), np.zeros((8, 4), np.float32)
    pipe = _pipe(_Counting())
    state = pipe.init(jax.random.key(0), x[:4])
    with pytest.raises(
        PipelineError,
        match=r"layer 1 \(.*Counting\) computed a different function when traced again"
        r".*must compute the same function on every trace",
    ):
        pipe.step(state, (x, t))
    # refused before any update: the state is whole, nothing donated
    assert not any(a.is_deleted() for a in jax.tree.leaves(state.params))
    # new callables per trace are not a difference
    pipe = _pipe(_Callbacks())
    state = pipe.init(jax.random.key(0), x[:4])
    for _ in range(2):
        state, metrics = pipe.step(state, (x, t))
    assert np.isfinite(float(metrics.loss))
