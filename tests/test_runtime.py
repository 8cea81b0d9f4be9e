"""The runtime: what the lowered programs and the interpreter must get right beyond the
schedules' semantics (optimizers across stages, keys, aliasing, asynchrony, options)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import delayed_training, flush_training, pipeline_kwargs

from pdjax.errors import PipelineError
from pdjax.models import get_model
from pdjax.pipeline import Pipeline, even_stages
from pdjax.schedules import ScheduleSpec


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
        **pipeline_kwargs(microbatches=M, **kwargs),
    )
    mbs = _mbs(spec, M * steps, 4)
    state = pipe.init(jax.random.key(3), mbs[0][0])
    variables = pipe.variables(state)
    for t in range(steps):
        state, _ = pipe.run(state, mbs[t * M : (t + 1) * M])
    ref, _, _ = flush_training(
        spec.layers, spec.loss, optimizer, variables, mbs, M=M, rng=state.rng
    )
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
        schedule=ScheduleSpec("2bw", microbatches=M),
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
        bounds=bounds,
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
    pipe = Pipeline(
        spec.layers, even_stages(L, 2), spec.loss, CLIP, schedule=ScheduleSpec("pipedream")
    )
    with pytest.raises(PipelineError, match="optimizer_scope='stage'"):
        pipe.init(jax.random.key(0), x)
    ok = Pipeline(
        spec.layers,
        even_stages(L, 2),
        spec.loss,
        CLIP,
        schedule=ScheduleSpec("pipedream"),
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
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )
    key = jax.device_put(jax.random.key(0), jax.devices()[0])
    mbs = _mbs(spec, 2, 4)
    mbs = jax.device_put(mbs, jax.devices()[5])
    state = pipe.init(key, mbs[0][0])
    state, metrics = pipe.run(state, mbs)
    assert np.isfinite(metrics.loss)


def test_dispatch_is_asynchronous():
    """The driver returns before the devices finish: a wait after every operation (what
    timeline mode does, or a regression) would leave nothing pending at return."""
    import flax.linen as nn

    from pdjax.layers import sequential

    layers = sequential(*[nn.Dense(1024) for _ in range(4)])
    x = np.ones((4, 256, 1024), np.float32)
    pipe = Pipeline(
        layers,
        even_stages(4, 2),
        lambda y, t: ((y - t) ** 2).mean(),
        optax.sgd(1e-3),
        schedule=ScheduleSpec("pipedream"),
    )
    state = pipe.init(jax.random.key(0), x[0])
    mbs = [(x[k], x[k]) for k in range(4)]
    state, _ = pipe.run(state, mbs)  # compile
    jax.block_until_ready(state)
    state, _ = pipe.run(state, mbs)
    pending = [not leaf.is_ready() for leaf in jax.tree.leaves(state.params[0])]
    jax.block_until_ready(state)
    assert any(pending), "every result was ready when run() returned: dispatch is synchronous"
    state, metrics = pipe.run(state, mbs, timeline=True)  # the diagnostic mode waits
    assert all(leaf.is_ready() for leaf in jax.tree.leaves(state.params[0]))
    assert metrics.timeline is not None


def test_the_loss_shapes_are_traced_once_per_shape(monkeypatch):
    """A process that does not hold the last stage needs the shapes of the losses it
    receives every call; tracing the model for them again each call cost the first stage's
    worker about 1 ms of its one core per microbatch. Traced once per microbatch shape."""
    from pdjax.pipeline.executor.forward import Forward

    spec = get_model("mlp", "tiny")
    pipe = Pipeline(spec.layers, even_stages(len(spec.layers), 2), spec.loss, optax.sgd(0.1))
    mbs = _mbs(spec, 2, 4)
    state = pipe.init(jax.random.key(0), mbs[0][0])
    traced = []
    trace = Forward._trace_loss_spec
    monkeypatch.setattr(
        Forward, "_trace_loss_spec", lambda self, *a: traced.append(1) or trace(self, *a)
    )
    first = pipe.forward.loss_spec(state, mbs[0])
    assert pipe.forward.loss_spec(state, mbs[1]) == first
    assert len(traced) == 1
    wider = _mbs(spec, 1, 8)[0]
    assert pipe.forward.loss_spec(state, wider) == trace(pipe.forward, state, wider)
    assert len(traced) == 2


def test_timeline_on_loss_and_several_runs_match_the_reference():
    """timeline=True (one span per action, unfused), on_loss, and several run() calls
    chained: the same training as sequential gradient accumulation."""
    spec = get_model("mlp", "tiny")
    M = 2
    pipe = Pipeline(
        spec.layers,
        even_stages(len(spec.layers), 2),
        spec.loss,
        optax.adam(1e-2),
        schedule=ScheduleSpec("1f1b", microbatches=M),
    )
    mbs = _mbs(spec, 3 * M, 4)
    state = pipe.init(jax.random.key(3), mbs[0][0])
    variables = pipe.variables(state)
    seen = []
    state, m0 = pipe.run(state, mbs[:M], on_loss=lambda k, loss: seen.append((k, loss)))
    state, m1 = pipe.run(state, mbs[M : 2 * M], timeline=True)
    later = []
    state, m2 = pipe.run(state, mbs[2 * M :], on_loss=lambda k, loss: later.append(k))
    ref, _, ref_losses = flush_training(
        spec.layers, spec.loss, optax.adam(1e-2), variables, mbs, M=M, rng=state.rng
    )
    _close([v["params"] for v in pipe.variables(state)], ref)
    losses = [float(v) for m in (m0, m1, m2) for v in m.losses]
    np.testing.assert_allclose(losses, [float(v) for v in ref_losses], rtol=1e-5)
    assert [k for k, _ in seen] == [0, 1] and later == [0, 1]  # each call its own callback
    np.testing.assert_allclose([float(v) for _, v in seen], losses[:M], rtol=1e-6)
    spans = m1.timeline.spans
    assert sorted(str(s.action) for s in spans) == sorted(
        str(a) for g in pipe.schedule(M).actions for a in g
    )
    assert all(s.end >= s.start for s in spans) and m1.peak_bytes is not None
    assert state.updates == (3, 3) and state.microbatches == 3 * M


@pytest.mark.parametrize("schedule", ["pipedream"])
def test_remat_through_the_pipeline(schedule):
    spec = get_model("gpt", "tiny")  # dropout: the recomputed forward draws the same masks
    stream = _mbs(spec, 4, 2)

    def train(remat):
        pipe = Pipeline(
            spec.layers,
            even_stages(len(spec.layers), 2),
            spec.loss,
            optax.sgd(0.1),
            schedule=ScheduleSpec(schedule, microbatches=2, remat=remat),
        )
        state = pipe.init(jax.random.key(0), stream[0][0])
        state, metrics = pipe.run(state, stream)
        return pipe, state, metrics

    _, kept, m_kept = train(False)
    pipe, again, m_again = train(True)
    _close(list(again.params), list(kept.params), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        [float(v) for v in m_again.losses], [float(v) for v in m_kept.losses], rtol=1e-5
    )
    assert any("recompute" in name for st in pipe.stages for name in st.trace_counts)
    # per stage: only the flagged stage recomputes, and the result is the same
    pipe, one, _ = train((True, False))
    _close(list(one.params), list(kept.params), rtol=1e-4, atol=1e-5)
    assert any("recompute" in name for name in pipe.stages[0].trace_counts)
    assert not any("recompute" in name for name in pipe.stages[1].trace_counts)
    with pytest.raises(PipelineError, match="one bool per stage"):
        train((1, 0))


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_async_schedules_with_replication_and_batchnorm(schedule):
    """A replicated stage (split microbatches) and BatchNorm state under the asynchronous
    schedules: the same as the unreplicated pipeline (per-microbatch statistics)."""
    import flax.linen as nn

    from pdjax.layers import sequential

    class DenseBN(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(32)(x))
            return nn.relu(x)

    layers = sequential(DenseBN(), DenseBN(), DenseBN(), nn.Dense(10))
    rng = np.random.default_rng(0)
    stream = [
        (rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8).astype(np.int32))
        for _ in range(4)
    ]

    def xent(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def train(replicas):
        pipe = Pipeline(
            layers,
            even_stages(4, 2, replicas),
            xent,
            optax.sgd(0.05),
            schedule=ScheduleSpec(schedule, microbatches=2),
        )
        state = pipe.init(jax.random.key(0), stream[0][0])
        start = jax.tree.map(np.asarray, state.model_state)
        state, metrics = pipe.run(state, stream)
        return state, metrics, start

    one, m1, start = train(1)
    two, m2, _ = train(2)
    np.testing.assert_allclose(
        [float(v) for v in m2.losses], [float(v) for v in m1.losses], rtol=1e-5
    )
    _far(list(one.model_state), list(start))  # BatchNorm statistics are carried on
    _close(list(two.model_state), list(one.model_state))
    _close(list(two.params), list(one.params))
    assert m2.workarounds  # replicated stages on CPU: reported


def test_updates_reuse_the_gradient_buffers():
    """The update does not hold old weights, new weights and gradients at once: the new
    weights take the donated gradient sum's buffers. (Fused updates without a sum donate
    the replaced weights instead, except on CPU: tests/test_program.py.)"""
    spec = get_model("mlp", "tiny")
    pipe = Pipeline(
        spec.layers,
        even_stages(len(spec.layers), 2),
        spec.loss,
        optax.adam(1e-3),
        schedule=ScheduleSpec("gpipe", microbatches=2),
    )
    mbs = _mbs(spec, 2, 4)
    state = pipe.init(jax.random.key(0), mbs[0][0])
    w, o = state.params[0], state.opt_state[0]
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(w))
    grads = jax.tree.map(jnp.zeros_like, w)
    u = pipe.stages[0].program("U").lower(grads, w, o).compile().memory_analysis()
    # the gradient sum becomes the new weights, the old moments the new moments
    assert u.alias_size_in_bytes >= 3 * weight_bytes, (u.alias_size_in_bytes, weight_bytes)


def test_xla_cpu_workarounds_have_one_home():
    from pdjax import _xla_cpu
    from pdjax.runners import DataParallel

    spec = get_model("mlp", "tiny")
    L = len(spec.layers)
    straight = Pipeline(spec.layers, even_stages(L, 2), spec.loss, optax.sgd(0.1))
    assert straight.workarounds.run_ahead is None
    assert straight.workarounds.one_at_a_time == (False, False)
    assert not straight.workarounds.donate_weights  # it would block the driver on CPU
    hybrid = Pipeline(spec.layers, even_stages(L, 2, 2), spec.loss, optax.sgd(0.1))
    assert hybrid.workarounds.one_at_a_time == (True, True)
    assert hybrid.workarounds.run_ahead == 4 * 2
    gpu = _xla_cpu.for_pipeline("gpu", (2, 2), 4, 2)
    assert gpu.run_ahead is None and gpu.donate_weights and not gpu.reasons
    dp = DataParallel(spec.layers, spec.loss, optax.sgd(0.1), devices=jax.devices()[:2])
    assert dp.workarounds.run_ahead == _xla_cpu.DP_WINDOW and dp.workarounds.reasons


def test_init_builds_each_stage_on_its_own_devices(monkeypatch):
    """Each stage's layers are initialised on that stage's devices (the whole model's init,
    which would build every layer on one device, is never called), to the values the whole
    model's init gives."""
    from pdjax.layers import LayerSequence

    spec = get_model("cnn", "tiny")
    L = len(spec.layers)
    pipe = Pipeline(spec.layers, even_stages(L, 3, first_device=1), spec.loss, optax.sgd(0.1))
    x = spec.sample_input(4, jax.random.key(0))
    with monkeypatch.context() as m:
        m.setattr(LayerSequence, "init", lambda *a: pytest.fail("whole-model init called"))
        state = pipe.init(jax.random.key(5), x)
    whole = jax.jit(spec.layers.init)(jax.random.fold_in(jax.random.key(5), 0), x)
    _close([v["params"] for v in pipe.variables(state)], [v["params"] for v in whole])
    for s, stage in enumerate(pipe.stages):
        for leaf in jax.tree.leaves((state.params[s], state.opt_state[s])):
            assert leaf.sharding.device_set == set(stage.devices), (s, leaf.sharding)
    assert not any(
        jax.devices()[0] in leaf.sharding.device_set for leaf in jax.tree.leaves(state.params)
    )


def test_moves_between_single_device_stages_copy_through_jaxlib():
    """The in-process move between one-device stages uses jaxlib's batched copy (the end of
    ``jax.device_put``, without its Python checks): found on this jax, committed to the
    destination, the values exact, pytrees and extended dtypes (keys) too."""
    from pdjax.pipeline import transport

    src, dst = jax.devices()[0], jax.devices()[1]
    target = jax.sharding.SingleDeviceSharding(dst)
    assert transport._copier(target) is not None  # a jax without it would be 2x slower here
    value = {
        "a": jax.device_put(jnp.arange(12.0).reshape(3, 4), src),
        "b": (jax.device_put(jnp.array([1, 2], jnp.int32), src),),
    }
    (moved,) = transport._receiver(target)(value)
    assert jax.tree.structure(moved) == jax.tree.structure(value)
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(value), strict=True):
        assert a.devices() == {dst} and a.committed and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    key = jax.device_put(jax.random.key(3), src)
    (k,) = transport._receiver(target)(key)
    assert k.devices() == {dst}
    np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(key))


def test_a_long_call_places_its_microbatches_in_chunks_of_one_program():
    """An epoch-long call's host microbatches are split on the device by programs of at
    most SPLIT_CHUNK outputs (XLA's compile time grows faster than a splitter's outputs),
    equal chunks sharing one: every microbatch arrives whole, in order, on its stage."""
    from pdjax.pipeline.executor import calls

    spec = get_model("mlp", "tiny")
    pipe = Pipeline(spec.layers, even_stages(len(spec.layers), 2), spec.loss, optax.sgd(0.1))
    n = 2 * calls.SPLIT_CHUNK + 5
    rng = np.random.default_rng(0)
    trees = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(n)]
    stage = pipe.stages[0]
    placed = pipe.feeder._place_microbatches(stage, trees)
    assert len(placed) == n
    for got, want in zip(placed, trees, strict=True):
        assert got.sharding == stage.batch_sharding
        np.testing.assert_array_equal(np.asarray(got), want)
    assert len(pipe.feeder._splitters) == 2  # a full chunk's program and the rest's
