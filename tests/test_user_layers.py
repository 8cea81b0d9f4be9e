"""User-written layers (issue 17, nothing silently wrong): nnx train/eval mode, plain
functions as layers, and module instances shared between layers."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from reference import flush_training

import pdjax
from pdjax.errors import LayerError
from pdjax.layers import Fn, FnLayer, NnxLayer, as_layer, sequential
from pdjax.pipeline import Pipeline, even_stages
from pdjax.schedules import ScheduleSpec

# -- nnx train/eval -------------------------------------------------------------------------


class TrainingBlock(nnx.Module):
    """The tutorial way: the mode comes in as ``__call__(..., training)``."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, training: bool = False):
        return self.drop(self.lin(x), deterministic=not training)


class DeterministicBlock(nnx.Module):
    """The mode comes in inverted, as ``__call__(..., deterministic)``."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, deterministic: bool = True):
        return self.drop(self.lin(x), deterministic=deterministic)


class AttributeBlock(nnx.Module):
    """No mode argument: ``nnx.Dropout`` built deterministic, switched by ``.train()``."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, deterministic=True, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.lin(x))


def _x(n=4, d=8, seed=1):
    return jax.random.normal(jax.random.key(seed), (n, d))


@pytest.mark.parametrize("block", [TrainingBlock, DeterministicBlock, AttributeBlock])
def test_nnx_dropout_is_on_in_train_mode_and_off_in_eval(block):
    seq = sequential(lambda rngs: block(rngs))
    x = _x()
    v = seq.init(jax.random.key(0), x)
    kernel, bias = v[0]["params"]["lin"]["kernel"], v[0]["params"]["lin"]["bias"]
    plain = x @ kernel + bias[None, :]
    # eval: no dropout, with or without an rng
    e1, _ = seq.apply(v, x)
    e2, _ = seq.apply(v, x, rng=jax.random.key(9))
    np.testing.assert_allclose(e1, plain, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(e1, e2)
    # train: a dropout mask that depends only on the rng
    a, _ = seq.apply(v, x, train=True, rng=jax.random.key(1))
    b, _ = seq.apply(v, x, train=True, rng=jax.random.key(2))
    a2, _ = seq.apply(v, x, train=True, rng=jax.random.key(1))
    np.testing.assert_array_equal(a, a2)
    assert not np.allclose(a, e1)
    assert not np.allclose(a, b)
    kept = np.asarray(a) != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(np.asarray(a)[kept], 2 * np.asarray(plain)[kept], rtol=1e-5)


def test_nnx_dropout_gets_a_fresh_key_per_call_under_jit():
    layer = as_layer(lambda rngs: TrainingBlock(rngs), "drop")
    x = _x()
    v = layer.init(jax.random.key(0), x)
    f = jax.jit(lambda v, x, k: layer.apply(v, x, train=True, rng=k)[0])
    masks = [np.asarray(f(v, x, jax.random.fold_in(jax.random.key(3), i)) != 0) for i in range(3)]
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    np.testing.assert_array_equal(
        masks[0], np.asarray(f(v, x, jax.random.fold_in(jax.random.key(3), 0)) != 0)
    )


def test_bare_nnx_dropout_layer_draws_from_the_rng_given():
    seq = sequential(nn.Dense(8), nnx.Dropout(0.5), names=["dense", "drop"])
    x = _x()
    v = seq.init(jax.random.key(0), x)
    a, _ = seq.apply(v, x, train=True, rng=jax.random.key(1))
    b, _ = seq.apply(v, x, train=True, rng=jax.random.key(2))
    e, _ = seq.apply(v, x)
    assert not np.allclose(a, b) and not np.allclose(a, e)
    with pytest.raises(LayerError, match="'drop' needs an RNG"):
        seq.apply(v, x, train=True)


class UnseededDropout(nnx.Module):
    def __init__(self):
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x):
        return self.drop(x)


def test_nnx_dropout_pdjax_cannot_seed_says_how_to_fix():
    seq = sequential(UnseededDropout(), names=["u"])
    x = _x()
    np.testing.assert_array_equal(seq.apply([{}], x)[0], x)  # eval needs no rng
    for rng in (None, jax.random.key(0)):
        with pytest.raises(LayerError, match=r"'u' needs random numbers.*rngs=rngs"):
            seq.apply([{}], x, train=True, rng=rng)


class NormBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.bn = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)

    def __call__(self, x):
        return self.bn(x)


class NormBlockKwarg(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.bn = nnx.BatchNorm(8, momentum=0.5, use_running_average=True, rngs=rngs)

    def __call__(self, x, training: bool = False):
        return self.bn(x, use_running_average=not training)


@pytest.mark.parametrize("block", [NormBlock, NormBlockKwarg])
def test_nnx_batchnorm_batch_stats_in_train_running_averages_in_eval(block):
    seq = sequential(lambda rngs: block(rngs))
    x = 3.0 + 2.0 * _x(n=16)
    v = seq.init(jax.random.key(0), x)
    stats = v[0]["batch_stats"]["bn"]
    # eval: running averages (mean 0, var 1 at init): the input comes back unchanged
    y, eval_state = seq.apply(v, x)
    np.testing.assert_allclose(y, x, rtol=1e-3, atol=1e-3)
    jax.tree.map(np.testing.assert_array_equal, eval_state[0]["batch_stats"], v[0]["batch_stats"])
    # train: normalised with the batch's statistics, which move the running averages
    y, train_state = seq.apply(v, x, train=True)
    np.testing.assert_allclose(np.asarray(y).mean(0), 0.0, atol=1e-4)
    new = train_state[0]["batch_stats"]["bn"]
    np.testing.assert_allclose(new["mean"], 0.5 * np.asarray(x).mean(0), rtol=1e-4, atol=1e-5)
    assert not np.allclose(new["var"], stats["var"])
    # and eval after the update uses the new running averages
    v1 = [{**v[0], "batch_stats": train_state[0]["batch_stats"]}]
    y1, _ = seq.apply(v1, x)
    ref = (x - new["mean"][None, :]) / np.sqrt(new["var"][None, :] + 1e-5)
    np.testing.assert_allclose(y1, ref, rtol=1e-4, atol=1e-4)


# -- plain functions as layers --------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "kind"),
    [
        (nn.relu, "relu"),
        (jnp.tanh, "tanh"),
        (lambda x: x * 2, "lambda"),
        (functools.partial(nn.gelu, approximate=False), "gelu"),
        (jax.jit(lambda x: x - 1), "lambda"),
        (abs, "abs"),
    ],
)
def test_plain_functions_are_parameter_free_layers(fn, kind):
    seq = sequential(nn.Dense(8), fn)
    layer = seq.layers[1]
    assert isinstance(layer, FnLayer) and layer.kind == kind
    assert seq.names == ("00_Dense", f"01_{kind}")
    x = _x(d=3)
    v = seq.init(jax.random.key(0), x)
    assert v[1] == {}
    y, state = seq.apply(v, x, train=True, rng=jax.random.key(1))
    h = x @ v[0]["params"]["kernel"] + v[0]["params"]["bias"][None, :]
    np.testing.assert_allclose(y, fn(h), rtol=1e-6)
    assert state[1] == {}
    assert isinstance(as_layer(fn, "f"), FnLayer)


def make_linear(key: nnx.Rngs):
    return nnx.Linear(3, 2, rngs=key)


class RngsOnly(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


@pytest.mark.parametrize(
    "factory",
    [
        lambda rngs: nnx.Linear(3, 2, rngs=rngs),
        lambda r: nnx.Linear(3, 2, rngs=r),
        make_linear,
        functools.partial(nnx.Linear, 3, 2),
        RngsOnly,
    ],
)
def test_nnx_factories_are_still_factories(factory):
    layer = as_layer(factory, "f")
    assert isinstance(layer, NnxLayer)
    x = _x(d=3)
    v1, v2 = layer.init(jax.random.key(0), x), layer.init(jax.random.key(1), x)
    assert jax.tree.leaves(v1["params"])
    assert not all(
        np.allclose(a, b) for a, b in zip(jax.tree.leaves(v1), jax.tree.leaves(v2), strict=True)
    )
    assert layer.apply(v1, x)[0].shape == (4, 2)


def test_fn_marks_a_function_that_looks_like_a_factory():
    seq = sequential(Fn(lambda rngs: rngs * 2), names=["double"])
    assert isinstance(seq.layers[0], FnLayer)
    y, _ = seq.apply(seq.init(jax.random.key(0), jnp.ones(3)), jnp.ones(3))
    np.testing.assert_array_equal(y, 2 * jnp.ones(3))
    with pytest.raises(LayerError, match="needs a callable"):
        Fn(3)


def test_callables_that_are_neither_say_what_to_pass():
    with pytest.raises(LayerError, match=r"class Dense: pass an instance, Dense\(\.\.\.\)"):
        sequential(nn.Dense)
    with pytest.raises(LayerError, match="class Linear: pass an instance, or a factory"):
        sequential(nnx.Linear)
    with pytest.raises(LayerError, match="takes one input"):
        sequential(lambda x, y: x + y)
    with pytest.raises(LayerError, match=r"takes rngs but also needs \['x'\]"):
        sequential(lambda x, rngs: x)
    with pytest.raises(LayerError, match=r"not an nnx\.Module"):
        NnxLayer(lambda rngs: 3, "three")
    # a callable pytree with arrays has parameters a function layer would never train
    with_arrays = jax.tree_util.Partial(jnp.add, jnp.ones(3))
    with pytest.raises(LayerError, match="holding arrays"):
        sequential(with_arrays)
    assert isinstance(sequential(Fn(with_arrays)).layers[0], FnLayer)  # said to be constants


def test_function_layers_profile_with_no_parameters():
    seq = sequential(nn.Dense(8), jnp.tanh, lambda x: x * 2, nn.Dense(2))
    prof = pdjax.profile(seq, jnp.ones((4, 3)))
    assert [p.kind for p in prof.layers] == ["Dense", "tanh", "lambda", "Dense"]
    assert [p.param_bytes for p in prof.layers[1:3]] == [0, 0]
    assert prof.layers[2].forward_flops > 0
    assert prof.layers[2].output_bytes == 4 * 8 * 4


def test_functions_and_nnx_dropout_train_through_a_two_stage_pipeline():
    layers = sequential(
        nn.Dense(8), jnp.tanh, lambda rngs: TrainingBlock(rngs), lambda x: x * 2, nn.Dense(2)
    )
    loss = lambda y, t: ((y - t) ** 2).mean()  # noqa: E731
    opt = optax.sgd(0.1)
    pipe = Pipeline(
        layers, even_stages(5, 2), loss, opt, schedule=ScheduleSpec("1f1b", microbatches=2)
    )
    x, y = _x(n=8, d=4), _x(n=8, d=2, seed=2)
    state = pipe.init(jax.random.key(3), x[:4])
    variables = pipe.variables(state)
    state, metrics = pipe.step(state, (x, y))
    microbatches = [(x[:4], y[:4]), (x[4:], y[4:])]
    ref_params, _, ref_losses = flush_training(
        layers, loss, opt, variables, microbatches, M=2, rng=state.rng
    )
    np.testing.assert_allclose(metrics.losses, ref_losses, rtol=1e-5)
    got = [v.get("params", {}) for v in pipe.variables(state)]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, ref_params
    )
    # dropout was on: the training losses are not the eval-mode losses
    variables = jax.device_put(variables, jax.devices()[0])
    eval_losses = [loss(layers.apply(variables, a)[0], b) for a, b in microbatches]
    assert not np.allclose(metrics.losses, eval_losses)


# -- shared modules -------------------------------------------------------------------------


class Wrap(nnx.Module):
    def __init__(self, inner: nnx.Module, rngs: nnx.Rngs):
        self.inner = inner
        self.own = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.own(self.inner(x))


def test_nnx_submodule_shared_by_two_layers_is_refused():
    shared = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    with pytest.raises(LayerError, match=r"'a' and 'b' share an nnx Param \('inner/bias' in 'a'"):
        sequential(Wrap(shared, nnx.Rngs(1)), Wrap(shared, nnx.Rngs(2)), names=["a", "b"])
    # through factories that capture it, and mixed
    with pytest.raises(LayerError, match=r"not supported yet.*tied="):
        sequential(lambda rngs: Wrap(shared, rngs), lambda rngs: Wrap(shared, rngs))
    with pytest.raises(LayerError, match="'00_Linear' and '01_Wrap' share"):
        sequential(shared, Wrap(shared, nnx.Rngs(1)))
    # one module instance twice
    block = Wrap(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Rngs(1))
    with pytest.raises(LayerError, match="'x' and 'y' share"):
        sequential(block, block, names=["x", "y"])
    # separately built modules are fine, as is a shared module without parameters
    sequential(
        lambda rngs: Wrap(nnx.Linear(4, 4, rngs=rngs), rngs),
        lambda rngs: Wrap(nnx.Linear(4, 4, rngs=rngs), rngs),
    )
    drop = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
    sequential(Wrap(drop, nnx.Rngs(1)), Wrap(drop, nnx.Rngs(2)))


def test_linen_instance_used_twice_is_refused_equal_instances_are_not():
    dense = nn.Dense(8)
    assert dense == nn.Dense(8)  # equal config compares equal: identity is what counts
    with pytest.raises(
        LayerError, match="'00_Dense' and '02_Dense' share the Dense module instance"
    ):
        sequential(dense, jnp.tanh, dense)
    seq = sequential(dense, nn.Dense(8))
    v = seq.init(jax.random.key(0), jnp.ones((2, 8)))
    assert not np.allclose(v[0]["params"]["kernel"], v[1]["params"]["kernel"])


def test_same_function_twice_is_fine():
    double = lambda x: x * 2  # noqa: E731
    seq = sequential(double, nn.Dense(3), double, jnp.tanh, jnp.tanh)
    assert seq.names == ("00_lambda", "01_Dense", "02_lambda", "03_tanh", "04_tanh")
    x = jnp.ones((2, 3))
    v = seq.init(jax.random.key(0), x)
    y, _ = seq.apply(v, x)
    h = (2 * x) @ v[1]["params"]["kernel"] + v[1]["params"]["bias"][None, :]
    np.testing.assert_allclose(y, jnp.tanh(jnp.tanh(2 * h)), rtol=1e-6)
