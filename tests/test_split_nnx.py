"""``split_model`` of a ``flax.nnx`` model: a small transformer-like model (embedding,
three blocks, a head sharing the embedding) cut at its blocks trains in a pipeline as the
user's own ``nnx.value_and_grad`` loop, its trained state goes back into the user's model
with ``nnx.update``; its RNG streams are no variable of any layer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pdjax
from pdjax.errors import LayerError
from pdjax.schedules import ScheduleSpec

V, D = 16, 8


class Block(nnx.Module):
    def __init__(self, rate, rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x, mask):
        h = self.down(jax.nn.relu(self.up(self.norm(x))))
        return x + self.drop(jnp.where(mask, h, 0.0))


class Model(nnx.Module):
    def __init__(self, rate=0.0, *, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([Block(rate, rngs) for _ in range(3)])
        self.norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, ids):
        mask = (ids > 0)[..., None]  # built once at the top, used in every block
        x = self.embed(ids) * jnp.sqrt(D)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norm(x))


def _batches(steps, size, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.integers(0, V, (size, 6)).astype(np.int32)
        out.append((x, np.roll(x, -1, axis=1)))
    return out


def _loss(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_the_model_splits_at_its_blocks_with_the_embedding_tied():
    model = Model(rngs=nnx.Rngs(0))
    x = _batches(1, 4)[0][0]
    layers = pdjax.split_model(model, x)
    assert layers.names == ("00_embed", "01_blocks_0", "02_blocks_1", "03_blocks_2")
    assert layers.tied == (
        (
            "embed/embedding",
            ("00_embed/embed/embedding", "03_blocks_2/embed/embedding"),
        ),
    )
    # jitted: op by op, every operation is a program of its own to compile
    v = jax.jit(layers.init)(jax.random.key(0), x)
    assert not any(
        "rngs" in "/".join(map(str, p)) for p, _ in jax.tree_util.tree_flatten_with_path(v)[0]
    )
    y, _ = jax.jit(layers.apply)(v, x[:3])  # another batch size: the layers re-trace for it
    np.testing.assert_allclose(y, nnx.jit(Model.__call__)(model, x[:3]), rtol=1e-6, atol=1e-6)
    again = layers.layer_variables(nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, again, v)
    named = pdjax.split_model(model, x, at=["blocks/0", "2"])
    assert named.names == ("00_embed", "01_blocks_0", "02_blocks_2")


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_the_pipeline_trains_as_the_users_own_nnx_loop(rate):
    """Dropout 0.5 with the model in eval mode (mode={}: pdjax leaves it as it is)."""
    batches = _batches(3, 8)
    model = Model(rate, rngs=nnx.Rngs(0))
    if rate:
        model.eval()
    layers = pdjax.split_model(model, batches[0][0][:4], mode={} if rate else None)
    optimizer = optax.sgd(0.1, momentum=0.9)
    pipe = pdjax.Pipeline(
        layers,
        pdjax.even_stages(4, 3),
        _loss,
        optimizer,
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )
    state = pipe.init(jax.random.key(1), batches[0][0][:4])
    piped = []
    for batch in batches:
        state, metrics = pipe.step(state, batch)
        piped.append(float(metrics.loss))

    own = Model(rate, rngs=nnx.Rngs(0))
    if rate:
        own.eval()
    opt = nnx.Optimizer(own, optimizer, wrt=nnx.Param)

    @nnx.jit
    def step(own, opt, x, y):
        value, grads = nnx.value_and_grad(lambda m: _loss(m(x), y))(own)
        opt.update(own, grads)
        return value

    mine = [float(step(own, opt, x, y)) for x, y in batches]
    np.testing.assert_allclose(piped, mine, rtol=1e-5)
    trained = layers.model_variables(pipe.variables(state))
    want = nnx.state(own, nnx.Param)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        nnx.to_pure_dict(trained),
        nnx.to_pure_dict(want),
    )
    nnx.update(model, trained)
    x = batches[0][0]
    np.testing.assert_allclose(pipe.predict(state, x), model(x), rtol=1e-5, atol=1e-6)


def test_dropout_draws_from_the_layer_rng_and_the_streams_are_not_trained():
    model = Model(0.5, rngs=nnx.Rngs(0))
    x = _batches(1, 4)[0][0]
    layers = pdjax.split_model(model, x)
    v = jax.jit(layers.init)(jax.random.key(0), x)  # one program, not one per operation
    apply = jax.jit(layers.apply, static_argnames="train")
    eval1, _ = apply(v, x)
    model.eval()
    np.testing.assert_allclose(eval1, nnx.jit(Model.__call__)(model, x), rtol=1e-6, atol=1e-6)
    a = apply(v, x, train=True, rng=jax.random.key(3))[0]
    b = apply(v, x, train=True, rng=jax.random.key(3))[0]
    c = apply(v, x, train=True, rng=jax.random.key(4))[0]
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, eval1) and not np.allclose(a, c)
    assert set(v[0]) == {"params"}


def test_an_nnx_model_without_submodule_calls_is_refused():
    with pytest.raises(LayerError, match=r"pdjax\.sequential"):
        pdjax.split_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.ones((1, 2)))


class NormBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.bn(self.linear(x))) + x


class NormModel(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NormBlock(rngs) for _ in range(3)])
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x, train: bool = False):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_batch_stats_come_back_in_train_mode_as_the_models_own():
    model = NormModel(nnx.Rngs(0))
    x = jnp.arange(24.0).reshape(6, 4) / 10
    layers = pdjax.split_model(model, x)
    assert layers.names == ("00_blocks_0", "01_blocks_1", "02_blocks_2")
    assert layers.splitter.mode == {"train": "train"}
    v = jax.jit(layers.init)(jax.random.key(0), x)  # one program, not one per operation

    @jax.jit
    def each_layer(v, h):
        new = []
        for k, layer in enumerate(layers.layers):
            h, state = layer.apply(v[k], h, train=True)
            new.append({**v[k], **state})
        return h, new

    h, new = each_layer(v, x)
    model.train()
    # nnx.jit writes the batch statistics the call updates back into the model
    np.testing.assert_allclose(h, nnx.jit(NormModel.__call__)(model, x), rtol=1e-6, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
        nnx.to_pure_dict(layers.model_variables(new)),
        nnx.to_pure_dict(nnx.state(model)),  # (no RNG streams held)
    )
