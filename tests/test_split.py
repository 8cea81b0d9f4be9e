"""``split_model``: whole Flax models (an lm1b-style TransformerLM, an ImageNet-style
ResNet, both written as Flax's examples write them) cut into pdjax layers at submodule
calls; trained in a pipeline they equal the user's own ``jax.grad`` loop on the whole
model, and their variables are the model's own tree; what cannot be split is refused."""

import dataclasses
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pdjax
from pdjax.errors import LayerError
from pdjax.schedules import ScheduleSpec


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 16
    emb_dim: int = 16
    num_heads: int = 2
    num_layers: int = 2
    qkv_dim: int = 16
    mlp_dim: int = 32
    max_len: int = 16
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    deterministic: bool = False


def shift_right(x):
    padded = jnp.pad(x, [(0, 0), (1, 0)])
    return padded[:, :-1]


class AddPositionEmbs(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        cfg = self.config
        pe = self.param(
            "pos_embedding", nn.initializers.normal(stddev=0.02), (1, cfg.max_len, inputs.shape[-1])
        )
        return inputs + pe[:, : inputs.shape[1], :]


class MlpBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        cfg = self.config
        x = nn.Dense(cfg.mlp_dim)(inputs)
        x = nn.relu(x)
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
        out = nn.Dense(inputs.shape[-1])(x)
        return nn.Dropout(rate=cfg.dropout_rate)(out, deterministic=cfg.deterministic)


class DecoderBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        cfg = self.config
        x = nn.LayerNorm()(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads,
            qkv_features=cfg.qkv_dim,
            dropout_rate=cfg.attention_dropout_rate,
            deterministic=cfg.deterministic,
        )(x, mask=decoder_mask)
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
        x = x + inputs
        z = nn.LayerNorm()(x)
        z = MlpBlock(config=cfg)(z)
        return x + z


class Decoder(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        cfg = self.config
        embed = nn.Embed(
            num_embeddings=cfg.vocab_size,
            features=cfg.emb_dim,
            embedding_init=nn.initializers.normal(stddev=1.0),
        )
        y = shift_right(inputs.astype("int32"))
        y = embed(y)
        y = AddPositionEmbs(config=cfg, name="posembed_output")(y)
        y = nn.Dropout(rate=cfg.dropout_rate)(y, deterministic=cfg.deterministic)
        for lyr in range(cfg.num_layers):
            y = DecoderBlock(config=cfg, name=f"encoderdecoderblock_{lyr}")(
                y, decoder_mask=decoder_mask
            )
        y = nn.LayerNorm(name="encoderdecoder_norm")(y)
        logits = embed.attend(y.astype(jnp.float32))
        return logits / jnp.sqrt(y.shape[-1])


class TransformerLM(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        decoder_mask = nn.combine_masks(
            nn.make_attention_mask(inputs > 0, inputs > 0), nn.make_causal_mask(inputs)
        )
        logits = Decoder(config=self.config, name="decoder")(inputs, decoder_mask=decoder_mask)
        return logits.astype(jnp.float32)


class ResNetBlock(nn.Module):
    filters: int
    norm: Any
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
        y = self.norm()(y)
        y = nn.relu(y)
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = nn.Conv(
                self.filters, (1, 1), self.strides, use_bias=False, name="conv_proj"
            )(residual)
            residual = self.norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    stage_sizes: tuple = (1, 1)
    num_filters: int = 4
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
        x = nn.Conv(self.num_filters, (3, 3), use_bias=False, name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.num_filters * 2**i, norm=norm, strides=strides)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


# -- helpers -------------------------------------------------------------------------------


def _ids(n, seed=0, length=8):
    rng = np.random.default_rng(seed)
    return rng.integers(1, 16, (n, length)).astype(np.int32)


def _lm_batches(steps, size):
    out = []
    for s in range(steps):
        x = _ids(size, seed=s)
        out.append((x, np.roll(x, -1, axis=1)))
    return out


def _lm_loss(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _assert_close(got, want):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
        got,
        want,
    )


def _pipeline_vs_own_loop(model, layers, batches, loss, *, schedule, M, train_kwargs):
    """Trains through a 3-stage pipeline and with the user's own jax.grad + optax loop on
    the whole model, from the same initial variables; returns both losses and variables."""
    # SGD, not Adam: a key bias has a zero gradient (softmax ignores it), which Adam would
    # turn from float noise into full-size steps
    optimizer = optax.sgd(0.1, momentum=0.9)
    pipe = pdjax.Pipeline(
        layers,
        pdjax.even_stages(len(layers), 3),
        loss,
        optimizer,
        schedule=ScheduleSpec(schedule, microbatches=M),
    )
    state = pipe.init(jax.random.key(1), batches[0][0][: len(batches[0][0]) // M])
    variables = layers.model_variables(pipe.variables(state))
    piped = []
    for batch in batches:
        state, metrics = pipe.step(state, batch)
        piped.append(float(metrics.loss))
    piped_vars = layers.model_variables(pipe.variables(state))

    params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    opt_state = optimizer.init(params)

    def own_loss(params, rest, x, y):
        if rest:
            out, new = model.apply(
                {"params": params, **rest}, x, mutable=list(rest), **train_kwargs
            )
            return loss(out, y), dict(new)
        return loss(model.apply({"params": params}, x, **train_kwargs), y), rest

    grad = jax.jit(jax.value_and_grad(own_loss, has_aux=True))
    own = []
    for x, y in batches:
        (value, rest), g = grad(params, rest, x, y)
        updates, opt_state = optimizer.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        own.append(float(value))
    return pipe, state, piped, piped_vars, own, {"params": params, **rest}


# -- the lm1b-style TransformerLM ----------------------------------------------------------

LM = TransformerLM(TransformerConfig())


def test_transformer_splits_at_its_blocks_with_the_embedding_tied():
    layers = pdjax.split_model(LM, _ids(4))
    assert layers.names == ("00_Embed_0", "01_encoderdecoderblock_0", "02_encoderdecoderblock_1")
    assert layers.tied == (
        (
            "decoder/Embed_0/embedding",
            (
                "00_Embed_0/decoder/Embed_0/embedding",
                "02_encoderdecoderblock_1/decoder/Embed_0/embedding",
            ),
        ),
    )
    assert layers.splitter.mode == {"config.deterministic": "eval"}
    # jitted: op by op, every operation of the model is a program of its own to compile
    v = jax.jit(layers.init)(jax.random.key(0), _ids(4))
    tree = layers.model_variables(v)
    # exactly the tree model.init builds (its shapes: traced, not run), and the whole model
    # computes what the layers do
    want = jax.eval_shape(LM.init, jax.random.key(1), _ids(4))
    assert jax.tree.structure(tree) == jax.tree.structure(want)
    assert jax.tree.map(jnp.shape, tree) == jax.tree.map(lambda a: a.shape, want)
    x = _ids(3, seed=5)  # another batch size: the layers re-trace for it
    y, _ = jax.jit(layers.apply)(v, x)
    eval_model = TransformerLM(dataclasses.replace(LM.config, deterministic=True))
    np.testing.assert_array_equal(y, jax.jit(eval_model.apply)(tree, x))
    # and back: the model's tree as per-layer variables
    again = layers.layer_variables(tree)
    jax.tree.map(np.testing.assert_array_equal, again, v)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_transformer_trains_as_the_users_own_loop(schedule):
    batches = _lm_batches(3, 8)
    layers = pdjax.split_model(LM, batches[0][0][:4])
    pipe, state, piped, piped_vars, own, own_vars = _pipeline_vs_own_loop(
        LM, layers, batches, _lm_loss, schedule=schedule, M=2, train_kwargs={}
    )
    np.testing.assert_allclose(piped, own, rtol=1e-5)
    _assert_close(piped_vars, own_vars)
    # the trained variables are the model's own: model.apply runs them, as predict does
    x = batches[0][0]
    eval_model = TransformerLM(dataclasses.replace(LM.config, deterministic=True))
    np.testing.assert_allclose(
        pipe.predict(state, x), jax.jit(eval_model.apply)(piped_vars, x), rtol=1e-5, atol=1e-6
    )


def test_dropout_is_on_in_train_mode_and_needs_an_rng():
    model = TransformerLM(TransformerConfig(dropout_rate=0.5))
    x = _ids(2)
    layers = pdjax.split_model(model, x)
    v = jax.jit(layers.init)(jax.random.key(0), x)  # one program, not one per operation
    apply = jax.jit(layers.apply, static_argnames="train")
    eval1, _ = apply(v, x)
    eval2, _ = apply(v, x)
    np.testing.assert_array_equal(eval1, eval2)
    train, _ = apply(v, x, train=True, rng=jax.random.key(3))
    assert not np.allclose(train, eval1)
    with pytest.raises(LayerError, match=r"needs a PRNG in train mode.*mode=\{"):
        layers.apply(v, x, train=True)
    # the mode named by hand: the same field; mode={} leaves the model as it is (train mode
    # off here, deterministic=False: dropout always on, so an RNG is needed even in eval)
    same = pdjax.split_model(model, x, mode={"config.deterministic": "eval"})
    np.testing.assert_array_equal(jax.jit(same.apply)(v, x)[0], eval1)
    as_is = pdjax.split_model(model, x, mode={})
    with pytest.raises(LayerError, match="needs a PRNG in eval mode"):
        as_is.apply(v, x)


def test_named_cuts_and_glue_across_them():
    layers = pdjax.split_model(LM, _ids(4), at=["encoderdecoderblock_1", "encoderdecoder_norm"])
    assert layers.names == ("00_Embed_0", "01_encoderdecoderblock_1", "02_encoderdecoder_norm")
    v = jax.jit(layers.init)(jax.random.key(0), _ids(4))  # one program, not one per operation
    # the mask built at the top is sent to the block's layer: the boundary holds it
    mid, _ = jax.jit(layers[:1].apply)(v[:1], _ids(4))
    shapes = sorted(a.shape for a in mid["live"])
    assert (4, 1, 8, 8) in shapes
    y, _ = jax.jit(layers.apply)(v, _ids(4))
    eval_model = TransformerLM(dataclasses.replace(LM.config, deterministic=True))
    want = jax.jit(eval_model.apply)(layers.model_variables(v), _ids(4))
    np.testing.assert_array_equal(y, want)


# -- the ResNet: BatchNorm switched by a train argument ------------------------------------


def _images(n, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8, 8, 3)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)


def test_resnet_trains_as_the_users_own_loop_with_batch_stats():
    net = ResNet()
    batches = [_images(4, s) for s in range(3)]
    layers = pdjax.split_model(net, batches[0][0])
    assert layers.names == ("00_conv_init", "01_ResNetBlock_0", "02_ResNetBlock_1")
    assert layers.splitter.mode == {"train": "train"}
    pipe, state, piped, piped_vars, own, own_vars = _pipeline_vs_own_loop(
        net, layers, batches, _lm_loss, schedule="1f1b", M=1, train_kwargs={"train": True}
    )
    np.testing.assert_allclose(piped, own, rtol=1e-5)
    _assert_close(piped_vars, own_vars)  # batch statistics included
    x = batches[0][0]
    want = jax.jit(partial(net.apply, train=False))(piped_vars, x)
    np.testing.assert_allclose(pipe.predict(state, x), want, rtol=1e-5, atol=1e-5)


# -- refusals ------------------------------------------------------------------------------


def test_an_unknown_cut_lists_the_submodules():
    with pytest.raises(
        LayerError, match=r"'block_9' names no submodule.*decoder/encoderdecoderblock_0"
    ):
        pdjax.split_model(LM, _ids(2), at=["block_9"])


def test_cuts_out_of_order_of_two_parents_or_leaving_a_layer_empty():
    with pytest.raises(LayerError, match="in the order the model calls them"):
        pdjax.split_model(LM, _ids(2), at=["encoderdecoderblock_1", "encoderdecoderblock_0"])
    with pytest.raises(LayerError, match="children of one parent"):
        pdjax.split_model(
            LM, _ids(2), at=["encoderdecoderblock_1", "encoderdecoderblock_1/MlpBlock_0"]
        )
    with pytest.raises(LayerError, match="layer before it would be empty"):
        pdjax.split_model(ResNet(), _images(2, 0)[0], at=["conv_init"])
    with pytest.raises(LayerError, match="no repeated submodule"):
        pdjax.split_model(nn.Dense(3), jnp.ones((2, 3)))


class Branchy(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = nn.Dense(4, name=f"d{i}")(x)
        if x.sum() > 0:  # data-dependent Python control flow
            x = -x
        return x


def test_data_dependent_control_flow_is_refused():
    with pytest.raises(LayerError, match=r"control flow depends on the data.*jax.lax.cond"):
        pdjax.split_model(Branchy(), jnp.ones((2, 4)))


class SharedNorm(nn.Module):
    """One BatchNorm used before and after the blocks: its statistics cannot be tied."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        norm = nn.BatchNorm(use_running_average=not train)
        x = norm(x)
        for i in range(2):
            x = nn.Dense(4, name=f"d{i}")(x)
        return norm(x)


def test_state_used_in_two_layers_is_refused():
    with pytest.raises(
        LayerError, match=r"'BatchNorm_0/mean' \(collection 'batch_stats'\).*cannot be tied"
    ):
        pdjax.split_model(SharedNorm(), jnp.ones((2, 4)))


def test_a_mode_naming_nothing_is_refused():
    with pytest.raises(LayerError, match="neither a bool field"):
        pdjax.split_model(LM, _ids(2), mode={"config.train": "train"})
    with pytest.raises(LayerError, match="'train' or 'eval'"):
        pdjax.split_model(LM, _ids(2), mode={"config.deterministic": True})
    with pytest.raises(LayerError, match=r"flax\.linen or flax\.nnx Module"):
        pdjax.split_model(lambda x: x, _ids(2))
