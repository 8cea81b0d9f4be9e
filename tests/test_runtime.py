"""Runtime v2: what the lowered programs and the interpreter must get right beyond the
schedules' semantics (optimizers across stages, keys, aliasing, asynchrony, options)."""

import jax
import numpy as np
import optax
import pytest
from reference import delayed_training, flush_training

from pdjax.errors import PipelineError
from pdjax.models import get_model
from pdjax.pipeline.executor import Pipeline, even_stages


def _close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def _far(a, b, at_least=1e-4):
    diff = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    assert diff > at_least, diff


def _mbs(spec, n, mb, seed=0):
    key = jax.random.key(seed)
    x, y = spec.sample_input(n * mb, key), spec.sample_target(n * mb, key)
    return [jax.tree.map(lambda a, k=k: a[k * mb : (k + 1) * mb], (x, y)) for k in range(n)]


def _flush(spec, optimizer, P=2, M=2, steps=2, **kwargs):
    pipe = Pipeline(
        spec.layers,
        even_stages(len(spec.layers), P),
        spec.loss,
        optimizer,
        schedule=kwargs.pop("schedule", "1f1b"),
        microbatches=M,
        **kwargs,
    )
    mbs = _mbs(spec, M * steps, 4)
    state = pipe.init(jax.random.key(3), mbs[0][0])
    variables = pipe.variables(state)
    for t in range(steps):
        state, _ = pipe.run(state, mbs[t * M : (t + 1) * M])
    ref, _, _ = flush_training(spec.layers, spec.loss, optimizer, variables, mbs, M, state.rng)
    got = [v["params"] for v in pipe.variables(state)]
    return pipe, got, ref, variables, mbs, state


CLIP = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_global_norm_clipping_equals_sequential_training(schedule):
    spec = get_model("mlp", "tiny")
    pipe, got, ref, *_ = _flush(spec, CLIP, schedule=schedule)
    assert pipe.coupled
    _close(got, ref)
    # per-stage clipping (what pdjax did before) is far from it
    _, per_stage, ref2, *_ = _flush(spec, CLIP, schedule=schedule, optimizer_scope="stage")
    _far(per_stage, ref2)


def test_global_norm_clipping_under_2bw_equals_whole_model_recurrence():
    spec = get_model("mlp", "tiny")
    P, M, steps = 2, 2, 3
    opt = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    pipe = Pipeline(
        spec.layers,
        even_stages(len(spec.layers), P),
        spec.loss,
        opt,
        schedule="2bw",
        microbatches=M,
    )
    stream = _mbs(spec, M * steps, 2)
    state = pipe.init(jax.random.key(1), stream[0][0])
    variables = pipe.variables(state)
    state, metrics = pipe.run(state, stream)
    bounds = [(st.first_layer, st.last_layer + 1) for st in pipe.stage_specs]
    ref = delayed_training(
        spec.layers,
        spec.loss,
        opt,
        variables,
        stream,
        bounds,
        version_of=lambda s, k: max(0, k // M - 1),
        rng=state.rng,
        M=M,
        whole_model=True,
    )
    _close(list(state.params), ref)
    assert metrics.peak_versions == (2,) * P  # the exchange costs no extra version


def test_coupled_optimizers_that_cannot_be_exact_are_refused():
    spec = get_model("mlp", "tiny")
    L = len(spec.layers)
    x = spec.sample_input(4, jax.random.key(0))
    pipe = Pipeline(spec.layers, even_stages(L, 2), spec.loss, CLIP, schedule="pipedream")
    with pytest.raises(PipelineError, match="optimizer_scope='stage'"):
        pipe.init(jax.random.key(0), x)
    ok = Pipeline(
        spec.layers,
        even_stages(L, 2),
        spec.loss,
        CLIP,
        schedule="pipedream",
        optimizer_scope="stage",
    )
    ok.init(jax.random.key(0), x)
    if hasattr(optax.contrib, "dog"):
        dog = Pipeline(spec.layers, even_stages(L, 2), spec.loss, optax.contrib.dog())
        with pytest.raises(PipelineError, match="couples the pipeline stages"):
            dog.init(jax.random.key(0), x)


@pytest.mark.parametrize(
    "name",
    ["cocob", "schedule_free_sgd"],
)
def test_optimizers_holding_parameter_buffers_train(name):
    """Their state keeps the initial parameters: it must never be donated with them."""
    make = getattr(optax.contrib, name, None) or getattr(optax, name, None)
    if make is None:
        pytest.fail(f"optax has no {name}")
    opt = make() if name == "cocob" else make(0.1)
    spec = get_model("mlp", "tiny")
    _, got, ref, *_ = _flush(spec, opt, M=1, steps=3)
    _close(got, ref)


def test_committed_key_and_inputs_on_another_device():
    """A key committed to device 0 reaches every stage (placed once per stage per call)."""
    spec = get_model("mlp", "tiny")
    pipe = Pipeline(
        spec.layers,
        even_stages(len(spec.layers), 2, first_device=2),
        spec.loss,
        optax.sgd(0.1),
        microbatches=2,
    )
    key = jax.device_put(jax.random.key(0), jax.devices()[0])
    mbs = _mbs(spec, 2, 4)
    mbs = jax.device_put(mbs, jax.devices()[5])
    state = pipe.init(key, mbs[0][0])
    state, metrics = pipe.run(state, mbs)
    assert np.isfinite(metrics.loss)
