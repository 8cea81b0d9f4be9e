"""Pipeline.init and DataParallel.init through programs that identical layers share
(pdjax.layers.init_programs): the same values as the whole model's LayerSequence.init, one
compilation per distinct layer, and never a program shared where it would
hand one layer another's weights."""

import collections

import flax.linen as nn
import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pdjax
from pdjax.layers import init_programs
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline
from pdjax.schedules import ScheduleSpec

_compiled: collections.Counter[str] = collections.Counter()


def _count(event: str, duration: float, **kw: object) -> None:
    if event.endswith("backend_compile_duration"):  # also a hit in the persistent cache
        _compiled[str(kw.get("fun_name"))] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def _inits_compiled(fn):
    """How many initialisation programs ``fn()`` compiled."""
    before = _compiled["jit(init_layers)"]
    fn()
    return _compiled["jit(init_layers)"] - before


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(self.width)(x))


class Scaled(nn.Module):
    """A linen module with an array field: it neither hashes nor compares."""

    scale: np.ndarray

    @nn.compact
    def __call__(self, x):
        return nn.Dense(x.shape[-1])(x) * self.scale


def _loss(y, t):
    return jnp.mean((y - t) ** 2)


# the hidden width is the tests' own (9): no other module's cached program can serve them
W = 9


def _mlp():
    return pdjax.sequential(*[Block(W) for _ in range(5)], nn.Dense(3))


def _pipeline(layers, stages):
    return Pipeline(
        layers, stages, _loss, optax.sgd(0.1), schedule=ScheduleSpec("1f1b", microbatches=2)
    )


def _key(seed):
    """The key the layers of ``Pipeline.init(jax.random.key(seed), x)`` start from."""
    return jax.random.fold_in(jax.random.key(seed), 0)


def _assert_equal(got, want, rtol=0.0, atol=0.0):
    leaves_got, leaves_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(leaves_got) == len(leaves_want)
    for a, b in zip(leaves_got, leaves_want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def test_identical_layers_share_one_program_across_stages_and_pipelines(monkeypatch):
    monkeypatch.setattr(init_programs, "_shared", collections.OrderedDict())  # none yet
    stages = [StagePlan(0, 2, (0,)), StagePlan(3, 5, (1,))]
    x = jnp.ones((4, W))
    layers = _mlp()
    pipe = _pipeline(layers, stages)
    state = None

    def first():
        nonlocal state
        state = pipe.init(jax.random.key(3), x)

    # Block(9) and Dense(3), both run on the first stage's first device (device 0): two
    # programs for six layers on two devices
    assert _inits_compiled(first) == 2
    _assert_equal(pipe.variables(state), layers.init(_key(3), x))
    # a new pipeline of an equal model (new module objects) on the same devices: none
    again = _pipeline(_mlp(), stages)
    assert _inits_compiled(lambda: again.init(jax.random.key(4), x)) == 0
    _assert_equal(again.variables(again.init(jax.random.key(3), x)), pipe.variables(state))
    # the second stage on two other devices: the programs still run on device 0, and the
    # values land on the stage's devices, replicated
    other = _pipeline(_mlp(), [StagePlan(0, 2, (0,)), StagePlan(3, 5, (2, 3))])
    moved = None

    def third():
        nonlocal moved
        moved = other.init(jax.random.key(3), x)

    assert _inits_compiled(third) == 0
    _assert_equal(other.variables(moved), pipe.variables(state))
    for leaf in jax.tree.leaves(moved.params[1]):
        assert leaf.sharding.device_set == {jax.devices()[2], jax.devices()[3]}
        assert leaf.sharding.is_fully_replicated


def test_nnx_modules_of_one_class_keep_their_own_weights():
    """An nnx module's init returns the arrays it holds: a shared program would hand the
    second module the first one's weights."""
    x = jnp.ones((4, 6))

    def model(seed):
        rngs = nnx.Rngs(seed)
        return pdjax.sequential(nnx.Linear(6, 6, rngs=rngs), nnx.Linear(6, 6, rngs=rngs))

    stages = [StagePlan(0, 0, (0,)), StagePlan(1, 1, (1,))]
    for seed in (0, 1):
        layers = model(seed)
        pipe = _pipeline(layers, stages)
        _assert_equal(pipe.variables(pipe.init(jax.random.key(0), x)), layers.init(_key(0), x))
    a, b = (model(seed).init(jax.random.key(0), x) for seed in (0, 1))
    assert not np.array_equal(a[0]["params"]["kernel"], b[0]["params"]["kernel"])


def test_layers_that_cannot_share_still_initialise_like_the_whole_model():
    """An nnx module, a linen module with an array field, a function and a precision
    policy in one stage: the runs that cannot share get a program of their own."""
    x = jnp.ones((4, W))
    layers = pdjax.sequential(
        Block(W),
        Scaled(np.full((1, W), 2.0, np.float32)),
        nnx.Linear(W, W, rngs=nnx.Rngs(5)),
        jnp.tanh,
        Block(W),
        precision="bf16",
    )
    shares = [init_programs._share_key(layer) is not None for layer in layers.layers]
    assert shares == [True, False, False, True, True]
    pipe = _pipeline(layers, [StagePlan(0, 2, (2,)), StagePlan(3, 4, (3,))])
    got = pipe.variables(pipe.init(jax.random.key(1), x))
    # at the tests' lowest XLA optimization level, the bf16 model's initializers round
    # the last bit differently from one program to another (one program per stage too)
    _assert_equal(got, layers.init(_key(1), x), rtol=1e-6, atol=1e-7)


def test_the_shared_programs_are_bounded(monkeypatch):
    monkeypatch.setattr(init_programs, "MAX_SHARED", 1)
    pipe = _pipeline(_mlp(), [StagePlan(0, 5, (4,))])
    state = pipe.init(jax.random.key(2), jnp.ones((4, W)))
    assert len(init_programs._shared) == 1
    _assert_equal(pipe.variables(state), _mlp().init(_key(2), jnp.ones((4, W))))


def test_data_parallel_initialises_through_the_same_programs(monkeypatch):
    from pdjax.runners import DataParallel

    monkeypatch.setattr(init_programs, "_shared", collections.OrderedDict())
    x = jnp.ones((8, W))

    def dp_init(seed):
        dp = DataParallel(_mlp(), _loss, optax.sgd(0.1), devices=jax.devices()[:4])
        return dp.variables(dp.init(jax.random.key(seed), x))

    got = None

    def first():
        nonlocal got
        got = dp_init(5)

    assert _inits_compiled(first) == 2  # Block(9) and Dense(3), replicated on 4 devices
    _assert_equal(got, _mlp().init(_key(5), x))
    assert _inits_compiled(lambda: dp_init(6)) == 0
