"""The pjit DP baseline trains exactly like one device, compiles once, and learns digits."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from pdjax.apps import data
from pdjax.errors import PipelineError
from pdjax.layers import sequential
from pdjax.models import get_model
from pdjax.pipeline import Pipeline, even_stages
from pdjax.runners import DataParallel


def _close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def _bn_dropout_model():
    """Batch statistics and dropout: the two things sharding and RNG streams could break."""
    return sequential(
        nn.Dense(16), nn.BatchNorm(momentum=0.9), nn.Dropout(0.3), nn.Dense(5), names=list("abcd")
    )


def _loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _reference(layers, optimizer, variables, batches, rng):
    """Plain single-device training: step k draws layer i's dropout from fold_in(fold_in(rng,
    k), i), takes jax.value_and_grad of the mean loss, and applies the optax update."""
    variables, batches = jax.device_put((variables, batches), jax.devices()[0])
    params = [v.get("params", {}) for v in variables]
    state = [{k: a for k, a in v.items() if k != "params"} for v in variables]

    @jax.jit
    def train(params, state, opt_state, x, y, key):
        def objective(p):
            h, new_state = x, []
            for i, layer in enumerate(layers.layers):
                r = jax.random.fold_in(key, i)
                h, s = layer.apply({**state[i], "params": p[i]}, h, train=True, rng=r)
                new_state.append(s)
            return _loss(h, y), new_state

        (loss, new_state), grads = jax.value_and_grad(objective, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state, opt_state, loss

    opt_state = optimizer.init(params)
    losses = []
    for k, (x, y) in enumerate(batches):
        params, state, opt_state, loss = train(
            params, state, opt_state, x, y, key=jax.random.fold_in(rng, k)
        )
        losses.append(loss)
    return params, state, losses


def _batches(n, steps, features=12, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, n, features)).astype(np.float32)
    y = rng.integers(0, classes, size=(steps, n)).astype(np.int32)
    return [(x[k], y[k]) for k in range(steps)]


@pytest.mark.parametrize("num_devices", [1, 2, 4])
def test_dp_equals_single_device_training(num_devices):
    # Not Adam: the bias before BatchNorm has a zero gradient up to rounding, whose sign
    # (which differs with the reduction order across devices) Adam's first step amplifies.
    layers, optimizer = _bn_dropout_model(), optax.sgd(0.1, momentum=0.9)
    batches = _batches(8, steps=3)
    dp = DataParallel(layers, _loss, optimizer, devices=jax.devices()[:num_devices])
    variables = jax.jit(layers.init)(jax.random.key(0), batches[0][0])
    rng = jax.random.key(7)
    state = dp.state_from_variables(variables, rng)
    losses = []
    for batch in batches:
        state, metrics = dp.step(state, batch)
        losses.append(metrics.loss)
    params, model_state, ref_losses = _reference(layers, optimizer, variables, batches, rng)
    assert state.step == 3
    _close(state.params, params)
    _close(state.model_state, model_state)
    _close(losses, [float(v) for v in ref_losses])
    assert state.params[0]["kernel"].sharding.is_fully_replicated
    outputs = dp.evaluate(state, batches[0][0])
    ref_out, _ = layers.apply(
        [{**s, "params": p} for p, s in zip(params, model_state, strict=True)], batches[0][0]
    )
    _close(outputs, ref_out)


def test_init_and_step_match_a_one_stage_pipeline_on_the_same_devices():
    spec = get_model("mlp")
    x, y = spec.sample_batch(8, 1)
    devices = jax.devices()[:2]
    dp = DataParallel(spec.layers, spec.loss, optax.sgd(0.1), devices=devices)
    stages = even_stages(len(spec.layers), 1, replicas=2)
    pipe = Pipeline(spec.layers, stages, spec.loss, optax.sgd(0.1), devices=devices)
    dp_state, pipe_state = dp.init(jax.random.key(5), x), pipe.init(jax.random.key(5), x)
    _close(dp.params(dp_state), pipe.params(pipe_state), rtol=0, atol=0)
    dp_state, dp_metrics = dp.step(dp_state, (x, y))
    pipe_state, pipe_metrics = pipe.step(pipe_state, (x, y))
    _close(dp.params(dp_state), pipe.params(pipe_state))
    np.testing.assert_allclose(dp_metrics.loss, pipe_metrics.loss, rtol=1e-6)


def test_step_compiles_once_and_donates_the_old_state():
    layers = _bn_dropout_model()
    batches = _batches(4, steps=3)
    dp = DataParallel(layers, _loss, optax.sgd(0.1), devices=jax.devices()[:2])
    state = dp.init(jax.random.key(0), batches[0][0])
    first = state
    for batch in batches:
        state, _ = dp.step(state, batch)
        dp.evaluate(state, batch[0])
    assert dp.trace_counts == {"step": 1, "evaluate": 1}
    assert first.params[0]["kernel"].is_deleted()
    assert not state.rng.is_deleted()

    keep = DataParallel(layers, _loss, optax.sgd(0.1), devices=jax.devices()[:2], donate=False)
    old = keep.state_from_variables(dp.variables(state), state.rng)
    keep.step(old, batches[0])
    assert not old.params[0]["kernel"].is_deleted()
    assert not state.params[0]["kernel"].is_deleted()  # copied in, not donated


def test_cnn_learns_digits():
    ds = data.digits(seed=0)
    spec = get_model("cnn")
    dp = DataParallel(spec.layers, spec.loss, optax.adam(1e-3), devices=jax.devices()[:2])
    state = dp.init(jax.random.key(0), ds.train_x[:32])
    for epoch in range(3):  # 0.955 test accuracy after 3 epochs (0.967 after 6)
        for batch in ds.train_batches(32, seed=0, epoch=epoch):
            state, _ = dp.step(state, batch)
    correct = 0
    for x, y, mask in ds.test_batches(64):
        logits = np.asarray(dp.evaluate(state, x))
        correct += int(((logits.argmax(-1) == y) & mask).sum())
    assert correct / ds.num_test > 0.9
    assert dp.trace_counts == {"step": 1, "evaluate": 1}


def test_bad_batch_sizes_fail_with_the_fix():
    layers = _bn_dropout_model()
    [(x, y)] = _batches(6, steps=1)
    dp = DataParallel(layers, _loss, optax.sgd(0.1), devices=jax.devices()[:4])
    state = dp.init(jax.random.key(0), x[:4])
    with pytest.raises(PipelineError, match="multiple of 4"):
        dp.step(state, (x, y))
    with pytest.raises(PipelineError, match="multiple of 4"):
        dp.evaluate(state, x)
    with pytest.raises(PipelineError, match="same leading batch axis"):
        dp.step(state, (x[:4], y[:8]))
    with pytest.raises(PipelineError, match="at least one device"):
        DataParallel(layers, _loss, optax.sgd(0.1), devices=[])
