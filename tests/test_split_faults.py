"""``split_model`` on models as users write them that it used to fail on with a raw
traceback (issue 44): a scanned or rematerialised stack of blocks, an RNG stream other
than dropout, a model of several inputs, BatchNorm with Flax's ImageNet ``axis_name``,
nnx blocks inside a child module, the trained state back into a split nnx model; and what
it refuses, before any work, with a message that says what to do (an ``at`` of another
type, a sample given as a Python list, a cut inside a scanned stack)."""

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pdjax
from pdjax.errors import LayerError
from pdjax.export import update_nnx
from pdjax.schedules import ScheduleSpec


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _pipe(layers, stages=2, microbatches=2, optimizer=None):
    return pdjax.Pipeline(
        layers,
        pdjax.even_stages(len(layers), stages),
        _mse,
        optimizer or optax.sgd(0.1),
        schedule=ScheduleSpec("1f1b", microbatches=microbatches),
    )


def _data(n=4, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(n, 2)).astype(np.float32)


# -- a stack in nn.scan or nn.remat ---------------------------------------------------------


class Blk(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        return nn.Dense(4)(nn.relu(nn.Dense(4)(x))) + x, None


class Scanned(nn.Module):
    """The input and the head are of one class, so at='blocks' cuts before the head."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="inp")(x)
        stack = nn.scan(Blk, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = stack(name="stack")(x, None)
        return nn.Dense(2, name="head")(x)


class Blk1(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        return nn.relu(nn.Dense(4)(x)) + x, None


class ScannedOnly(nn.Module):
    """No class repeats outside the scan."""

    block: type = Blk1

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm(name="norm")(x)
        stack = nn.scan(
            self.block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        x, _ = stack(name="stack")(x, None)
        return nn.Dense(2, name="head")(x)


@pytest.mark.parametrize("at", ["blocks", ("stack",)])
def test_a_scanned_stack_is_one_layer_and_trains(at):
    """The scan inside a layer (at='blocks' cuts before the head) or a layer starting at
    the scan (at=['stack']): both compile, train, and compute the model."""
    x, y = _data()
    model = Scanned()
    layers = pdjax.split_model(model, x, at=list(at) if at != "blocks" else at)
    assert layers.names == (("00_inp", "01_head") if at == "blocks" else ("00_inp", "01_stack"))
    pipe = _pipe(layers)
    state = pipe.init(jax.random.key(0), x[:2])
    state, metrics = pipe.step(state, (x, y))
    assert np.isfinite(float(metrics.loss))
    tree = layers.model_variables(pipe.variables(state))
    np.testing.assert_allclose(pipe.predict(state, x), model.apply(tree, x), rtol=1e-5, atol=1e-6)


def test_a_cut_inside_a_scanned_stack_is_refused_with_how_to_unroll():
    x, _ = _data()
    with pytest.raises(LayerError, match=r"inside a 'scan'.*unroll it.*Python loop"):
        pdjax.split_model(Scanned(), x, at=["stack/Dense_0"])
    # at='blocks' finds the block's two Dense inside the scan: refused the same way
    with pytest.raises(LayerError, match=r"inside a 'scan'.*unroll it"):
        pdjax.split_model(ScannedOnly(Blk), x)
    with pytest.raises(LayerError, match=r"no repeated submodule.*'stack' is scanned.*unroll"):
        pdjax.split_model(ScannedOnly(), x)


class Remat(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = nn.remat(Blk)
        for i in range(3):
            x, _ = block(name=f"block_{i}")(x)
        return nn.Dense(2, name="head")(x)


def test_rematerialised_blocks_are_cut_at_their_calls():
    x, _ = _data()
    model = Remat()
    layers = pdjax.split_model(model, x)
    assert layers.names == ("00_block_0", "01_block_1", "02_block_2")
    v = layers.init(jax.random.key(0), x)
    y, _ = layers.apply(v, x)
    np.testing.assert_allclose(y, model.apply(layers.model_variables(v), x), rtol=1e-6)
    assert [sorted(k["params"]) for k in v] == [["block_0"], ["block_1"], ["block_2", "head"]]


# -- an RNG stream of the model's own ------------------------------------------------------


class Noisy(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        for i in range(2):
            x = nn.Dense(4, name=f"d{i}")(x)
            if train:
                x = x + 0.1 * jax.random.normal(self.make_rng("noise"), x.shape)
        return x


def test_an_rng_stream_is_named_or_refused_with_how_to_name_it():
    x, _ = _data()
    with pytest.raises(LayerError, match=r"stream 'noise'.*rng_streams=\('dropout', 'noise'\)"):
        pdjax.split_model(Noisy(), x, at=["d1"])
    layers = pdjax.split_model(Noisy(), x, at=["d1"], rng_streams=["noise"])
    v = layers.init(jax.random.key(0), x)
    a = layers.apply(v, x, train=True, rng=jax.random.key(1))[0]
    b = layers.apply(v, x, train=True, rng=jax.random.key(1))[0]
    c = layers.apply(v, x, train=True, rng=jax.random.key(2))[0]
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, layers.apply(v, x)[0])
    with pytest.raises(LayerError, match="not 'params'"):
        pdjax.split_model(Noisy(), x, at=["d1"], rng_streams=["params"])


# -- at= and the sample, checked --------------------------------------------------------


def test_an_at_of_another_type_and_a_list_sample_are_refused():
    x, _ = _data()
    with pytest.raises(LayerError, match=r"at= is 'blocks' or a list of submodule names.*int"):
        pdjax.split_model(Noisy(), x, at=123)
    with pytest.raises(LayerError, match=r"input 0\[0\]\[0\] is a Python float.*jnp\.asarray"):
        pdjax.split_model(Noisy(), [[1.0] * 4] * 2, at=["d1"])
    with pytest.raises(LayerError, match=r"sample_kwargs\['train'\].*mode="):
        pdjax.split_model(
            Noisy(), x, at=["d1"], mode={"train": "train"}, sample_kwargs={"train": x}
        )


# -- several inputs ------------------------------------------------------------------------


class Gemmaish(nn.Module):
    """A decoder whose __call__ takes tokens, positions and an attention mask, as Gemma's."""

    @nn.compact
    def __call__(self, tokens, positions, attn_mask):
        embed = nn.Embed(16, 8, name="embedder")
        x = embed(tokens) + self.param("pos", nn.initializers.normal(1.0), (8, 8))[positions]
        for i in range(2):
            h = nn.Dense(8, name=f"layer_{i}")(x)
            scores = jnp.einsum("bqd,bkd->bqk", h, x)
            x = x + jnp.einsum(
                "bqk,bkd->bqd", jax.nn.softmax(jnp.where(attn_mask, scores, -1e9)), h
            )
        return embed.attend(x)


def _gemma_inputs(n=4, length=5, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 16, (n, length)).astype(np.int32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (n, length)).copy()
    mask = np.broadcast_to(np.tril(np.ones((length, length), bool)), (n, length, length)).copy()
    return tokens, positions, mask


def test_a_model_of_several_inputs_splits_and_trains_as_the_users_own_loop():
    tokens, positions, mask = _gemma_inputs()
    model = Gemmaish()
    layers = pdjax.split_model(model, tokens, positions, sample_kwargs={"attn_mask": mask})
    assert layers.names == ("00_embedder", "01_layer_0", "02_layer_1")
    x = (tokens, positions, {"attn_mask": mask})  # the layers' one input
    # jitted here and below: op by op, every operation is a program of its own to compile
    v = jax.jit(layers.init)(jax.random.key(0), x)
    tree = layers.model_variables(v)
    y, _ = jax.jit(layers.apply)(v, x)
    whole = jax.jit(lambda t, a, b, m: model.apply(t, a, b, attn_mask=m))
    np.testing.assert_allclose(y, whole(tree, tokens, positions, mask), rtol=1e-5)
    # all positional, in a pipeline: the batch's x is the tuple of the inputs
    layers = pdjax.split_model(model, tokens, positions, mask)
    target = np.roll(tokens, -1, axis=1)

    def loss(logits, t):
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()

    optimizer = optax.sgd(0.1)
    pipe = pdjax.Pipeline(
        layers,
        pdjax.even_stages(3, 2),
        loss,
        optimizer,
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )
    state = pipe.init(jax.random.key(0), (tokens[:2], positions[:2], mask[:2]))
    params = layers.model_variables(pipe.variables(state))["params"]
    state, metrics = pipe.step(state, ((tokens, positions, mask), target))
    value, grads = jax.jit(
        jax.value_and_grad(
            lambda p: loss(model.apply({"params": p}, tokens, positions, mask), target)
        )
    )(params)
    np.testing.assert_allclose(float(metrics.loss), float(value), rtol=1e-5)
    want = jax.jit(lambda p, g: optax.apply_updates(p, optimizer.update(g, optimizer.init(p))[0]))(
        params, grads
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        layers.model_variables(pipe.variables(state))["params"],
        want,
    )


# -- BatchNorm with axis_name, as Flax's ImageNet ResNet writes it ---------------------------


class NormBlock(nn.Module):
    norm: partial

    @nn.compact
    def __call__(self, x):
        return nn.relu(self.norm()(nn.Dense(4)(x))) + x


class ImageNetStyle(nn.Module):
    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            axis_name=self.axis_name,
        )
        for _ in range(3):
            x = NormBlock(norm)(x)
        return nn.Dense(2)(x)


def test_batchnorm_with_an_axis_name_normalises_each_call_by_its_own_batch():
    """``axis_name="batch"`` is bound to a size-1 axis: the layers compute what the same
    model without the axis name does, statistics included, and a pipeline trains it."""
    x, y = _data(8)
    layers = pdjax.split_model(ImageNetStyle(), x)
    assert layers.names == ("00_NormBlock_0", "01_NormBlock_1", "02_NormBlock_2")
    v = jax.jit(layers.init)(jax.random.key(0), x)  # one program, not one per operation
    tree = layers.model_variables(v)

    @jax.jit
    def each_layer(v, h):
        new = []
        for k, layer in enumerate(layers.layers):
            h, s = layer.apply(v[k], h, train=True)
            new.append({**v[k], **s})
        return h, new

    h, new = each_layer(v, x)
    plain = ImageNetStyle(axis_name=None)
    want, stats = jax.jit(lambda t, x: plain.apply(t, x, mutable=["batch_stats"]))(tree, x)
    np.testing.assert_allclose(h, want, rtol=1e-5, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        layers.model_variables(new)["batch_stats"],
        stats["batch_stats"],
    )
    pipe = _pipe(layers, stages=2, microbatches=2)
    state = pipe.init(jax.random.key(0), x[:4])
    state, metrics = pipe.step(state, (x, y))
    assert np.isfinite(float(metrics.loss))


# -- nnx: blocks inside a child module, and the trained state back in the model --------------


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.linear(x)) + x


class Decoder(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(3)])
        self.norm = nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class Head(nnx.Module):
    def __init__(self, rngs):
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


class Nested(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(4, 4, rngs=rngs)
        self.decoder = Decoder(rngs)
        self.head = Head(rngs)

    def __call__(self, x):
        return self.head(self.decoder(self.inp(x)))


def test_nnx_blocks_inside_a_child_module_are_cut():
    x, _ = _data()
    model = Nested(nnx.Rngs(0))
    layers = pdjax.split_model(model, x)
    assert layers.names == ("00_blocks_0", "01_blocks_1", "02_blocks_2")
    v = layers.init(jax.random.key(0), x)
    assert sorted(v[0]["params"]) == ["decoder", "inp"]
    assert sorted(v[2]["params"]) == ["decoder", "head"]
    y, _ = layers.apply(v, x)
    np.testing.assert_allclose(y, model(x), rtol=1e-6, atol=1e-6)
    named = pdjax.split_model(model, x, at=["decoder/blocks/2"])
    assert named.names == ("00_blocks_0", "01_blocks_2")


class Flat(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(4, 4, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(2)])
        self.head = Head(rngs)

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_update_nnx_writes_a_split_models_trained_state_into_it():
    x, y = _data()
    model = Flat(nnx.Rngs(0))
    layers = pdjax.split_model(model, x)
    pipe = _pipe(layers, stages=3, microbatches=2)
    state = pipe.init(jax.random.key(0), x[:2])
    state, _ = pipe.step(state, (x, y))
    assert not np.allclose(pipe.predict(state, x), model(x))
    assert update_nnx(layers, pipe.variables(state), model) is model
    np.testing.assert_allclose(pipe.predict(state, x), model(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(LayerError, match="another Flat than the model given"):
        update_nnx(layers, pipe.variables(state), Flat(nnx.Rngs(1)))
    linen = pdjax.split_model(Remat(), x)
    with pytest.raises(LayerError, match=r"linen model.*model_variables"):
        update_nnx(linen, linen.init(jax.random.key(0), x))
