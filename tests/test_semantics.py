"""Asynchronous schedules compute the delayed-update recurrences of
``docs/semantics.md#weight-versions-and-updates``, and no more weight versions are alive
than the table allows."""

import jax
import numpy as np
import optax
import pytest
from reference import delayed_training, pipeline_kwargs

from pdjax.models import get_model
from pdjax.pipeline import Pipeline, even_stages

OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


def _stream(spec, n, mb, seed=0):
    key = jax.random.key(seed)
    x, y = spec.sample_input(n * mb, key), spec.sample_target(n * mb, key)
    return [jax.tree.map(lambda a, k=k: a[k * mb : (k + 1) * mb], (x, y)) for k in range(n)]


def _compare(state, ref):
    # Separately compiled stage functions and the reference's one jitted gradient round
    # differently in the last bits (Adam amplifies that near zero gradients); a wrong
    # version would be off by about lr * gradient, ~1e-2 here, which _distinct checks.
    for s, (g, r) in enumerate(zip(state.params, ref, strict=True)):
        jax.tree.map(
            lambda a, b, s=s: np.testing.assert_allclose(
                a, b, rtol=1e-5, atol=1e-6, err_msg=f"stage {s}"
            ),
            g,
            r,
        )


def _distinct(state, other):
    """The tolerance above separates the recurrences: ``other`` is far from the result."""
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for g, r in zip(state.params, other, strict=True)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r), strict=True)
    )
    assert diff > 1e-4, diff


def _run(spec, P, stream, optimizer, **kwargs):
    pipe = Pipeline(
        spec.layers,
        even_stages(len(spec.layers), P),
        spec.loss,
        optimizer,
        **pipeline_kwargs(**kwargs),
    )
    state = pipe.init(jax.random.key(1), stream[0][0])
    variables = pipe.variables(state)
    state, metrics = pipe.run(state, stream)
    bounds = [(st.first_layer, st.last_layer + 1) for st in pipe.stage_specs]
    return pipe, state, metrics, variables, bounds


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize(
    "P,vertical_sync,weight_stashing",
    [(2, False, True), (4, False, True), (4, True, True), (3, False, False), (3, True, False)],
)
def test_pipedream_equals_delayed_update_recurrence(P, vertical_sync, weight_stashing, opt):
    spec = get_model("mlp", "tiny")
    N = 3 * P + 1
    stream = _stream(spec, N, mb=4)
    pipe, state, metrics, variables, bounds = _run(
        spec,
        P,
        stream,
        OPTIMIZERS[opt](),
        schedule="pipedream",
        vertical_sync=vertical_sync,
        weight_stashing=weight_stashing,
    )
    lag = (lambda s: P) if vertical_sync else (lambda s: P - s)

    def reference(version_of, backward_version_of=None):
        return delayed_training(
            spec.layers,
            spec.loss,
            OPTIMIZERS[opt](),
            variables,
            stream,
            bounds=bounds,
            version_of=version_of,
            rng=state.rng,
            backward_version_of=backward_version_of,
        )

    # forward (and, with stashing, backward) of microbatch k at stage s: version
    # max(0, k - lag + 1); without stashing the backward uses the newest weights, version k
    _compare(
        state,
        reference(
            lambda s, k: max(0, k - lag(s) + 1),
            None if weight_stashing else (lambda s, k: k),
        ),
    )
    _distinct(state, reference(lambda s, k: k))  # no delay at all: plain SGD per microbatch
    assert state.updates == (N,) * P

    bound = pipe.schedule(N).version_bound
    assert all(got <= b for got, b in zip(metrics.peak_versions, bound, strict=True))
    if not weight_stashing and not vertical_sync:
        assert metrics.peak_versions == (1,) * P
    elif weight_stashing and vertical_sync:
        # stage s keeps the versions made since stage 0's forward of its oldest in-flight
        # microbatch: P at every stage but the last
        assert metrics.peak_versions[:-1] == (P,) * (P - 1)
    elif weight_stashing:
        assert metrics.peak_versions == tuple(P - s for s in range(P))


@pytest.mark.parametrize("P,extra,vertical_sync", [(2, 1, False), (3, 2, False), (3, 1, True)])
def test_pipedream_with_extra_microbatches_in_flight(P, extra, vertical_sync):
    """Latency hiding: ``e`` more microbatches in flight at every stage but the last make
    the lag ``P - s + e`` (``P + e`` with vertical sync), one more version each."""
    spec = get_model("mlp", "tiny")
    N = 3 * P + 2
    stream = _stream(spec, N, mb=4)
    opt = OPTIMIZERS["sgd"]
    _pipe, state, metrics, variables, bounds = _run(
        spec,
        P,
        stream,
        opt(),
        schedule="pipedream",
        extra_in_flight=extra,
        vertical_sync=vertical_sync,
    )

    def lag(s):
        if vertical_sync:
            return P + extra
        return P - s + (extra if s < P - 1 else 0)

    def reference(version_of):
        return delayed_training(
            spec.layers,
            spec.loss,
            opt(),
            variables,
            stream,
            bounds=bounds,
            version_of=version_of,
            rng=state.rng,
        )

    _compare(state, reference(lambda s, k: max(0, k - lag(s) + 1)))
    _distinct(state, reference(lambda s, k: max(0, k - (P - s) + 1)))  # without the extra
    if not vertical_sync:
        assert metrics.peak_versions == tuple(lag(s) for s in range(P))


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("P,M", [(2, 2), (2, 3), (4, 4)])
def test_2bw_equals_double_buffered_recurrence(P, M, opt):
    spec = get_model("mlp", "tiny")
    steps = 3
    stream = _stream(spec, M * steps, mb=2)
    _, state, metrics, variables, bounds = _run(
        spec, P, stream, OPTIMIZERS[opt](), schedule="2bw", microbatches=M
    )

    def reference(version_of):
        return delayed_training(
            spec.layers,
            spec.loss,
            OPTIMIZERS[opt](),
            variables,
            stream,
            bounds=bounds,
            version_of=version_of,
            rng=state.rng,
            M=M,
        )

    # W(t+1) = W(t) - lr * mean grad f(W(t-1)), W(-1) = W(0): step t = k // M uses t - 1
    _compare(state, reference(lambda s, k: max(0, k // M - 1)))
    _distinct(state, reference(lambda s, k: k // M))  # a flush schedule's result
    assert metrics.peak_versions == (2,) * P
    assert state.updates == (steps,) * P


def test_dropout_streams_match_the_reference_rng():
    # GPT has dropout: the pipeline's per-microbatch, per-layer RNG is fold_in(fold_in(rng, k), i)
    spec = get_model("gpt", "tiny")
    P, N = 2, 5
    stream = _stream(spec, N, mb=2)
    _, state, _, variables, bounds = _run(spec, P, stream, optax.sgd(0.1), schedule="pipedream")
    ref = delayed_training(
        spec.layers,
        spec.loss,
        optax.sgd(0.1),
        variables,
        stream,
        bounds=bounds,
        version_of=lambda s, k: max(0, k - (P - s) + 1),
        rng=state.rng,
    )
    _compare(state, ref)
