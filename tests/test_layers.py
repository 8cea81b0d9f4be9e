"""Layer sequences: linen and nnx layers, train/eval, state, RNG, merge/split."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdjax.errors import LayerError
from pdjax.layers import LinenLayer, NnxLayer, sequential


class ConvBN(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(self.features, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.relu(x)


class Head(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape(x.shape[0], -1)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(self.classes)(x)


class Monolith(nn.Module):
    """The same three modules written as one model, named like the sequence's layers."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = ConvBN(4, name="a")(x, train)
        x = ConvBN(4, name="b")(x, train)
        return Head(3, name="c")(x, train)


def _x():
    return jax.random.normal(jax.random.key(1), (6, 5, 5, 2))


def test_linen_sequence_equals_monolith_eval_and_train():
    seq = sequential(ConvBN(4), ConvBN(4), Head(3), names=["a", "b", "c"])
    x = _x()
    # each call one jitted program (op by op, every operation would compile its own)
    mono_vars = jax.jit(Monolith().init)(jax.random.key(0), x)
    per_layer = seq.split(mono_vars)
    y_seq, _ = jax.jit(seq.apply)(per_layer, x)
    y_mono = jax.jit(Monolith().apply)(mono_vars, x)
    np.testing.assert_allclose(y_seq, y_mono, rtol=1e-6, atol=1e-6)
    # train mode without dropout divergence: compare BatchNorm statistics after one call
    y_seq, states = jax.jit(lambda v, x, r: seq.apply(v, x, train=True, rng=r))(
        per_layer, x, jax.random.key(3)
    )
    _, mono_updates = jax.jit(
        lambda v, x, r: Monolith().apply(
            v, x, train=True, rngs={"dropout": r}, mutable=["batch_stats"]
        )
    )(mono_vars, x, jax.random.key(3))
    merged = seq.merge(states)
    for name in ("a", "b"):
        jax.tree.map(
            lambda p, q: np.testing.assert_allclose(p, q, rtol=1e-6, atol=1e-7),
            merged["batch_stats"][name],
            mono_updates["batch_stats"][name],
        )
    assert seq.merge(per_layer)["params"].keys() == {"a", "b", "c"}


def test_init_is_per_layer_and_merge_split_round_trip():
    seq = sequential(ConvBN(4), Head(3))
    v = jax.jit(seq.init)(jax.random.key(0), _x())  # one program, not one per operation
    assert [set(layer_vars) for layer_vars in v] == [{"params", "batch_stats"}, {"params"}]
    again = seq.split(seq.merge(v))
    jax.tree.map(np.testing.assert_array_equal, again, v)
    assert seq.names == ("00_ConvBN", "01_Head")


def test_train_mode_updates_state_eval_mode_does_not():
    seq = sequential(ConvBN(4))
    v = jax.jit(seq.init)(jax.random.key(0), _x())
    _, eval_state = seq.apply(v, _x())
    jax.tree.map(np.testing.assert_array_equal, eval_state[0], {"batch_stats": v[0]["batch_stats"]})
    _, train_state = seq.apply(v, _x(), train=True)
    assert not np.allclose(train_state[0]["batch_stats"]["BatchNorm_0"]["mean"], 0.0)


def test_dropout_depends_only_on_rng():
    seq = sequential(Head(3))
    v = jax.jit(seq.init)(jax.random.key(0), _x())
    a, _ = seq.apply(v, _x(), train=True, rng=jax.random.key(5))
    b, _ = seq.apply(v, _x(), train=True, rng=jax.random.key(5))
    c, _ = seq.apply(v, _x(), train=True, rng=jax.random.key(6))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    with pytest.raises(LayerError, match="needs an RNG"):
        seq.apply(v, _x(), train=True)


def test_sequence_apply_works_under_jit_and_eval_shape():
    seq = sequential(ConvBN(4), Head(3))
    x = _x()
    v = jax.jit(seq.init)(jax.random.key(0), x)
    y, _ = jax.jit(lambda v, x: seq.apply(v, x))(v, x)
    assert y.shape == (6, 3)
    abstract = jax.eval_shape(seq.init, jax.random.key(0), x)
    assert abstract[1]["params"]["Dense_0"]["kernel"].shape == (100, 3)
    specs = seq.boundary_specs(v, x)
    assert [s.shape for s in specs] == [(6, 5, 5, 2), (6, 5, 5, 4), (6, 3)]


class NnxBlock(nnx.Module):
    def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
        self.lin = nnx.Linear(din, dout, rngs=rngs)
        self.bn = nnx.BatchNorm(dout, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(nnx.relu(self.bn(self.lin(x))))


def test_nnx_layers_match_direct_nnx_calls():
    x = jax.random.normal(jax.random.key(2), (4, 3))
    block = NnxBlock(3, 5, nnx.Rngs(7))
    seq = sequential(block, lambda rngs: NnxBlock(5, 2, rngs))
    assert isinstance(seq.layers[0], NnxLayer) and isinstance(seq.layers[1], NnxLayer)
    v = jax.jit(seq.init)(jax.random.key(0), x)  # one program, not one per operation
    assert set(v[0]) == {"params", "batch_stats", "state"}
    y, _ = jax.jit(seq.apply)(v, x)
    assert y.shape == (4, 2)
    # reference: the instance itself, called by nnx in eval mode
    block.eval()
    first_out, _ = jax.jit(seq[0].apply)([v[0]], x)
    np.testing.assert_allclose(first_out, nnx.jit(lambda block, x: block(x))(block, x), rtol=1e-6)


def test_nnx_factory_init_uses_rng_and_train_updates_batch_stats():
    x = jax.random.normal(jax.random.key(2), (4, 3))
    seq = sequential(lambda rngs: NnxBlock(3, 5, rngs))
    init = jax.jit(seq.init)  # one program, not one per operation
    v1 = init(jax.random.key(0), x)
    v2 = init(jax.random.key(1), x)
    assert not np.allclose(v1[0]["params"]["lin"]["kernel"], v2[0]["params"]["lin"]["kernel"])

    def train(v, rng):  # traced anew on each call: nothing carried from the last call
        return jax.jit(lambda v, x, r: seq.apply(v, x, train=True, rng=r))(v, x, rng)

    a, s = train(v1, jax.random.key(4))
    b, _ = train(v1, jax.random.key(4))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(s[0]["batch_stats"]["bn"]["mean"], v1[0]["batch_stats"]["bn"]["mean"])
    grads = jax.jit(jax.grad(lambda p: jnp.sum(seq.apply([{**v1[0], "params": p}], x)[0])))(
        v1[0]["params"]
    )
    assert np.all(np.isfinite(grads["lin"]["kernel"]))


def test_linen_and_nnx_mix_in_one_sequence():
    x = jnp.ones((2, 3))
    seq = sequential(nn.Dense(5), lambda rngs: nnx.Linear(5, 2, rngs=rngs))
    assert isinstance(seq.layers[0], LinenLayer)
    v = jax.jit(seq.init)(jax.random.key(0), x)  # each one program, not one per operation
    y, _ = jax.jit(seq.apply)(v, x)

    @jax.jit
    def reference(v, x):
        h = x @ v[0]["params"]["kernel"] + v[0]["params"]["bias"][None, :]
        return h @ v[1]["params"]["kernel"] + v[1]["params"]["bias"][None, :]

    np.testing.assert_allclose(y, reference(v, x), rtol=1e-6)


def test_bad_sequences_are_rejected_with_a_hint():
    with pytest.raises(LayerError, match="at least one layer"):
        sequential()
    with pytest.raises(LayerError, match="unique"):
        sequential(nn.Dense(2), nn.Dense(2), names=["x", "x"])
    with pytest.raises(LayerError, match="2 names for 1 modules"):
        sequential(nn.Dense(2), names=["x", "y"])
    with pytest.raises(LayerError, match="cannot make a layer"):
        sequential(42)
    seq = sequential(nn.Dense(2))
    with pytest.raises(LayerError, match="variables for 0 layers"):
        seq.apply([], jnp.ones((1, 2)))
