"""Loss functions with aux outputs, and evaluation / inference through the pipeline."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import pipeline_kwargs

import pdjax
from pdjax.errors import PipelineError
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline
from pdjax.runners import DataParallel


class Net(nn.Module):
    """Dense, BatchNorm and Dropout: eval mode must differ from train mode."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x))
        return nn.Dropout(0.3, deterministic=not train)(nn.relu(x))


def layers():
    return pdjax.sequential(nn.Dense(16), Net(), nn.Dense(16), jnp.tanh, nn.Dense(4))


def loss_with_aux(y, t):
    loss = optax.softmax_cross_entropy_with_integer_labels(y, t).mean()
    return loss, {"accuracy": (y.argmax(-1) == t).mean(), "first": y[0, 0]}


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, 4, n).astype(np.int32)


PLANS = {
    "1f1b": dict(plan=pdjax.even_stages(5, 2), schedule="1f1b"),
    "replicated": dict(plan=[StagePlan(0, 1, (0, 1)), StagePlan(2, 4, (2,))], schedule="gpipe"),
    "round-robin": dict(
        plan=[StagePlan(0, 2, (0,)), StagePlan(3, 4, (1, 2))],
        schedule="gpipe",
        replication="round-robin",
    ),
    "pipedream": dict(plan=pdjax.even_stages(5, 3), schedule="pipedream"),
    "interleaved": dict(
        plan=[StagePlan(i, i, (i % 2,)) for i in range(4)] + [StagePlan(4, 4, (1,))],
        schedule="interleaved",
        chunks=2,
    ),
}


def _pipe(case, loss_fn=loss_with_aux, **kw):
    cfg = dict(PLANS[case])
    plan = cfg.pop("plan")
    if case == "interleaved":  # chunks=2 needs an even number of stages
        plan = [StagePlan(0, 0, (0,)), StagePlan(1, 1, (1,)), StagePlan(2, 3, (0,))]
        plan.append(StagePlan(4, 4, (1,)))
    return Pipeline(
        layers(), plan, loss_fn, optax.sgd(0.1), **pipeline_kwargs(microbatches=2, **cfg, **kw)
    )


@pytest.mark.parametrize("case", sorted(PLANS))
def test_aux_outputs_are_the_loss_functions_per_microbatch(case):
    pipe = _pipe(case)
    x, t = data(16)
    state = pipe.init(jax.random.key(0), x[:4])
    mbs = pipe.split_batch((x, t))
    state, metrics = pipe.run(state, mbs)
    assert len(metrics.aux) == len(mbs) == len(metrics.losses)
    for loss, aux in zip(metrics.losses, metrics.aux, strict=True):
        assert set(aux) == {"accuracy", "first"}
        assert np.shape(aux["accuracy"]) == ()
        assert 0.0 <= float(aux["accuracy"]) <= 1.0
        assert np.isfinite(float(loss))
    mean = metrics.mean_aux()
    np.testing.assert_allclose(
        mean["accuracy"], np.mean([float(a["accuracy"]) for a in metrics.aux]), rtol=1e-6
    )


def test_aux_match_an_independent_forward_of_the_first_microbatch():
    """Microbatch 0 runs on the initial weights (any schedule): its aux is the loss
    function's on the model's train-mode output with that microbatch's dropout key."""
    pipe = _pipe("1f1b")
    x, t = data(8)
    state = pipe.init(jax.random.key(0), x[:4])
    variables = jax.device_get(pipe.variables(state))
    key = jax.random.fold_in(state.rng, 0)
    state, metrics = pipe.run(state, pipe.split_batch((x, t)))

    @jax.jit  # one program, not one per operation
    def forward(variables, x, t, key):
        y, _ = pipe.layers.apply(variables, x, train=True, rng=key)
        return loss_with_aux(y, t)

    loss, aux = forward(variables, x[:4], t[:4], key)
    np.testing.assert_allclose(float(metrics.losses[0]), float(loss), rtol=1e-5)
    np.testing.assert_allclose(float(metrics.aux[0]["first"]), float(aux["first"]), rtol=1e-5)


def test_a_loss_that_is_not_a_scalar_is_refused_with_a_clear_error():
    x, t = data(8)
    for bad, match in (
        (lambda y, t: (y - 1.0) ** 2, r"float32\[4, 4\]: reduce it with \.mean\(\)"),
        (lambda y, t: ((y**2).mean(axis=0), {}), r"whose loss is float32\[4\]"),
        (lambda y, t: jnp.int32(1), "scalar floating-point"),
    ):
        pipe = _pipe("1f1b", loss_fn=bad)
        state = pipe.init(jax.random.key(0), x[:4])
        with pytest.raises(PipelineError, match=match):
            pipe.step(state, (x, t))


def test_data_parallel_returns_aux_too():
    x, t = data(8)
    dp = DataParallel(layers(), loss_with_aux, optax.sgd(0.1), devices=jax.devices()[:2])
    state = dp.init(jax.random.key(0), x[:4])
    state, metrics = dp.step(state, (x, t))
    assert set(metrics.mean_aux()) == {"accuracy", "first"}


@pytest.mark.parametrize("case", sorted(PLANS))
def test_evaluate_and_predict_equal_the_whole_model_in_eval_mode(case):
    pipe = _pipe(case)
    x, t = data(16)
    state = pipe.init(jax.random.key(0), x[:4])
    state, _ = pipe.run(state, pipe.split_batch((x, t)))  # BatchNorm statistics move
    variables = jax.device_get(pipe.variables(state))
    xs, ts = data(20, seed=1)
    batches = [(xs[:8], ts[:8]), (xs[8:14], ts[8:14]), (xs[14:], ts[14:])]
    got = pipe.evaluate(state, batches)

    @jax.jit  # one program, not one per operation
    def whole_model(variables, xs, ts):
        y, _ = pipe.layers.apply(variables, xs, train=False)
        parts = [loss_with_aux(y[a:b], ts[a:b]) for a, b in ((0, 8), (8, 14), (14, 20))]
        return y, parts, (y.argmax(-1) == ts).mean()

    y, parts, accuracy = whole_model(variables, xs, ts)
    # the mean over samples: each batch's mean weighted by its size
    w = np.array([8, 6, 6]) / 20
    assert got["samples"] == 20
    np.testing.assert_allclose(got["loss"], np.dot(w, [float(p[0]) for p in parts]), rtol=1e-5)
    np.testing.assert_allclose(
        got["accuracy"], np.dot(w, [float(p[1]["accuracy"]) for p in parts]), rtol=1e-6
    )
    np.testing.assert_allclose(got["accuracy"], float(accuracy), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(pipe.predict(state, xs, batch_size=7)), y, atol=1e-5)
    # the state is not consumed: training goes on from it
    state, _ = pipe.run(state, pipe.split_batch((x, t)))
    # nothing was gathered: every stage's eval program ran on its own devices
    for stage in pipe.stages:
        assert any(k.startswith("EVAL") for k in stage.trace_counts)


def test_evaluate_merges_dict_aux_and_keeps_other_aux_apart():
    x, t = data(8)
    pipe = _pipe("1f1b", loss_fn=lambda y, t: (loss_with_aux(y, t)[0], (y.mean(), y.max())))
    state = pipe.init(jax.random.key(0), x[:4])
    got = pipe.evaluate(state, [(x, t)])
    assert set(got) == {"loss", "samples", "aux"} and len(got["aux"]) == 2
    pipe = _pipe("1f1b", loss_fn=lambda y, t: loss_with_aux(y, t)[0])
    assert set(pipe.evaluate(pipe.init(jax.random.key(0), x[:4]), [(x, t)])) == {
        "loss",
        "samples",
    }
    with pytest.raises(PipelineError, match="at least one"):
        pipe.evaluate(pipe.init(jax.random.key(0), x[:4]), [])
