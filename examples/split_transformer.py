"""A whole Flax model through a pdjax pipeline with no layer wrappers: ``split_model``.

The model is written the way Flax's lm1b example writes its ``TransformerLM``: one
compact body, a config dataclass whose ``deterministic`` field switches dropout, the
output logits through the shared embedding (``embed.attend``), a loop of decoder blocks
and the causal mask built inside. ``pdjax.split_model`` cuts it before each block, ties
the embedding's two uses, and switches ``config.deterministic`` per call; the pipeline
trains it with ``1f1b`` on 3 CPU devices, and the trained variables are the model's own
tree: ``model.apply(variables, x)`` runs them as they are. The toy language: sequences
that count up modulo the vocabulary from a random start.

    python examples/split_transformer.py           # about a minute on 2 CPU cores
    python examples/split_transformer.py --tiny    # 2 steps (what the tests run)
"""

from __future__ import annotations

import argparse
import dataclasses

import jax

jax.config.update("jax_num_cpu_devices", 3)  # before any device is used

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import pdjax  # noqa: E402


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


def loss_fn(logits, targets):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, {"accuracy": (logits.argmax(-1) == targets).mean()}


def batches(n: int, size: int, vocab: int, length: int, seed: int):
    """Counting sequences mod vocab (tokens 1..vocab-1; 0 is padding): inputs, targets."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seq = (rng.integers(0, vocab - 1, (size, 1)) + np.arange(length + 1)) % (vocab - 1) + 1
        out.append((seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)))
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a few steps (tests)")
    args = parser.parse_args(argv)
    steps = 2 if args.tiny else 150
    config = TransformerConfig(dropout_rate=0.1, attention_dropout_rate=0.1)
    model = TransformerLM(config)  # the whole model, as the user has it
    train, test = (
        batches(steps, 32, config.vocab_size, 8, 0),
        batches(2, 32, config.vocab_size, 8, 1),
    )

    layers = pdjax.split_model(model, train[0][0][:8])  # cut before each decoder block
    print(f"layers {list(layers.names)}, tied {[name for name, _ in layers.tied]}")
    pipe = pdjax.Pipeline(
        layers,
        pdjax.even_stages(len(layers), 3),
        loss_fn,
        optax.adamw(3e-3),
        schedule=pdjax.ScheduleSpec("1f1b", microbatches=4),
    )
    state = pipe.init(jax.random.key(0), train[0][0][:8])
    for step, batch in enumerate(train, 1):
        state, metrics = pipe.step(state, batch)
        if step % max(1, steps // 5) == 0 or step == steps:
            print(f"step {step:4d}  loss {metrics.loss:.3f}")
    result = pipe.evaluate(state, test)
    print(f"test: loss {result['loss']:.3f}  accuracy {result['accuracy']:.3f}")

    variables = layers.model_variables(pipe.variables(state))  # the model's own tree
    evaluating = TransformerLM(dataclasses.replace(config, deterministic=True))
    x, y = test[0]
    own, _ = loss_fn(jax.jit(evaluating.apply)(variables, jnp.asarray(x)), jnp.asarray(y))
    piped = pipe.evaluate(state, [test[0]])["loss"]
    print(f"first test batch: your model {float(own):.4f}, the pipeline {piped:.4f}")
    return {"loss": result["loss"], "accuracy": result["accuracy"]}


if __name__ == "__main__":
    main()
