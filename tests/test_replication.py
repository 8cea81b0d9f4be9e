"""Replicated stages: gradients summed per device and all-reduced once per update (checked
in the compiled programs), exact against sequential training, and the stages that cannot
be computed in parts (batch statistics, dropout, rows mixed) detected and kept whole."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from reference import flush_training, pipeline_kwargs, random_stream, xent

from pdjax.errors import PipelineError
from pdjax.layers import sequential
from pdjax.models import get_model
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline
from pdjax.schedules import ScheduleSpec


def _close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


class Centre(nn.Module):
    """Subtracts the microbatch mean: stateless, but every row depends on every other."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(32)(x - x.mean(axis=0, keepdims=True))


class DenseBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(32)(x)))


class DenseDropout(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(32)(x)))


class Dense32(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(32)(x))


def _pipe(layers, schedule="1f1b", M=4, plan=None, **kwargs):
    plan = plan or (StagePlan(0, 1, (0, 1, 2)), StagePlan(2, len(layers) - 1, (3,)))
    opt = kwargs.pop("opt", optax.sgd(0.05))
    return Pipeline(
        layers, plan, xent, opt, **pipeline_kwargs(schedule=schedule, microbatches=M, **kwargs)
    )


FLUSH = [("1f1b", 4, 1), ("zb-h1", 4, 1), ("2bw", 4, 1)]


@pytest.mark.parametrize("schedule,M,steps", FLUSH)
def test_one_all_reduce_per_update_none_in_a_backward(schedule, M, steps):
    """Counted in the HLO of every compiled program the runtime ran: the replicated stage's
    backward programs (B, I, W, FB) hold no all-reduce, its updates one each; asked to
    all-reduce in every backward, each backward holds one."""
    layers = sequential(Dense32(), Dense32(), Dense32(), nn.Dense(10))
    stream = random_stream(2 * M, 12)
    counts = {}
    for where in ("update", "backward"):
        pipe = _pipe(layers, schedule, M, grad_allreduce=where)
        state = pipe.init(jax.random.key(0), stream[0][0])
        state, metrics = pipe.run(state, stream, collectives=True)
        counts[where] = metrics.all_reduces
    got = counts["update"]
    updates = len(stream) // M
    backward_kinds = ("B", "I", "W", "FB")
    assert sum(got.get(k, 0) for k in backward_kinds) == 0, got
    assert sum(got.get(k, 0) for k in ("BU", "U", "FBU")) == updates, got
    old = counts["backward"]
    backwards = len(stream) - (0 if schedule == "zb-h1" else updates)  # the rest are BU/U
    assert sum(old.get(k, 0) for k in backward_kinds) == backwards, old


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_per_device_sums_equal_sequential_training(schedule):
    """Adam, uneven replicas (3 + 1), gradients summed per device: equal to sequential
    training on the concatenated microbatches."""
    layers = sequential(Dense32(), Dense32(), Dense32(), nn.Dense(10))
    opt = optax.adam(1e-2)
    M, steps = 4, 2
    plan = None
    kwargs = {}
    if schedule == "interleaved":
        plan = tuple(StagePlan(i, i, (0, 1) if i % 2 == 0 else (2,)) for i in range(4))
        kwargs["chunks"] = 2
    pipe = _pipe(layers, schedule, M, plan=plan, opt=opt, **kwargs)
    stream = random_stream(M * steps, 6)
    state = pipe.init(jax.random.key(0), stream[0][0])
    start = pipe.variables(state)
    for t in range(steps):
        state, _ = pipe.run(state, stream[t * M : (t + 1) * M])
    assert "update" in pipe.grad_allreduce_at
    ref, _, _ = flush_training(layers, xent, opt, start, stream, M=M, rng=state.rng)
    _close([v["params"] for v in pipe.variables(state)], ref)


@pytest.mark.parametrize(
    "layer,why",
    [
        (DenseBN, "depend on other rows"),
        (DenseDropout, "depend on other rows"),
        (Centre, "depend on other rows"),
    ],
)
def test_stages_that_mix_rows_stay_whole_and_exact(layer, why):
    """A replicated stage whose output rows depend on other rows (batch statistics,
    dropout masks drawn for the whole microbatch, a batch mean) cannot be computed in parts:
    it keeps the whole-microbatch programs (an all-reduce in each backward), says why, and
    trains exactly like the unreplicated pipeline."""
    layers = sequential(layer(), layer(), Dense32(), nn.Dense(10))
    stream = random_stream(4, 6)

    def train(plan):
        pipe = _pipe(layers, "1f1b", 2, plan=plan)
        state = pipe.init(jax.random.key(0), stream[0][0])
        state, metrics = pipe.run(state, stream)
        return pipe, state, metrics

    pipe, two, m2 = train(None)
    assert why in pipe.grad_allreduce_at[0] and pipe.grad_allreduce_at[1] == "-"
    _, one, m1 = train((StagePlan(0, 1, (0,)), StagePlan(2, 3, (3,))))
    np.testing.assert_allclose(
        [float(v) for v in m2.losses], [float(v) for v in m1.losses], rtol=1e-5
    )
    _close(list(two.params), list(one.params))
    _close(list(two.model_state), list(one.model_state))


def test_check_parts_on_real_model():
    """The tiny GPT's blocks draw dropout masks (whole), its MLP computes row by row."""
    for name, expect in (("mlp", True), ("gpt", False)):
        spec = get_model(name, "tiny")
        L = len(spec.layers)
        pipe = Pipeline(spec.layers, (StagePlan(0, L - 1, (0, 1)),), spec.loss, optax.sgd(0.1))
        x = spec.sample_input(4, jax.random.key(0))
        state = pipe.init(jax.random.key(1), x)
        state, _ = pipe.run(state, [(x, spec.sample_target(4, jax.random.key(0)))])
        assert pipe.stages[0].per_device is expect, pipe.grad_allreduce_at


def test_bad_grad_allreduce_option():
    layers = sequential(Dense32(), nn.Dense(10))
    with pytest.raises(PipelineError, match="grad_allreduce must be"):
        Pipeline(
            layers,
            (StagePlan(0, 1, (0, 1)),),
            xent,
            optax.sgd(0.1),
            schedule=ScheduleSpec("1f1b", grad_allreduce="x"),
        )


def test_each_device_keeps_its_own_rows_gradient():
    """The per-device sums are each device's own rows' gradient: device ``d`` of a stage
    holds the gradient of the microbatch loss restricted to the rows it holds (an
    independent single-device computation), and their sum is the whole gradient."""
    from pdjax.pipeline import Stage

    layers = sequential(Dense32(), nn.Dense(10))
    x, t = random_stream(1, 8)[0]
    variables = [
        jax.jit(layer.init)(jax.random.key(j), x if j == 0 else np.zeros((8, 32), np.float32))
        for j, layer in enumerate(layers.layers)
    ]
    params = [v["params"] for v in variables]
    stage = Stage(0, layers.layers, 0, jax.devices()[:2], optax.sgd(0.1), loss_fn=xent)
    assert stage.check_parts(params, [{}, {}], x) is None and stage.per_device
    w = stage.place_weights(params)
    key = jax.random.key(5)
    _, _, *res = stage.program("F")(w, [{}, {}], stage.place_batch(x), key, stage.place_batch(t))
    (g,) = stage.program("B")(w, stage.place_batch(x), *res)
    kernel = g[0]["Dense_0"]["kernel"]
    assert kernel.shape[0] == 2 and kernel.sharding.spec[0] == "data"

    def rows_loss(p, lo, hi):
        h = x
        for layer, pj in zip(layers.layers, p, strict=True):
            h, _ = layer.apply({"params": pj}, h, train=True, rng=key)
        per_row = optax.softmax_cross_entropy_with_integer_labels(h, t)
        return per_row[lo:hi].sum() / len(t)

    rows_grad = jax.jit(jax.grad(rows_loss), static_argnums=(1, 2))  # one program per rows
    for d, device in enumerate(stage.devices):
        mine = next(np.asarray(sh.data) for sh in kernel.addressable_shards if sh.device == device)
        want = rows_grad(params, 4 * d, 4 * d + 4)[0]["Dense_0"]["kernel"]
        np.testing.assert_allclose(mine[0], want, rtol=1e-5, atol=1e-7)
    whole = rows_grad(params, 0, 8)[0]["Dense_0"]["kernel"]
    np.testing.assert_allclose(np.asarray(kernel).sum(0), whole, rtol=1e-5, atol=1e-7)
