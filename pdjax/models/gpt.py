"""A GPT-2-style decoder-only transformer language model.

Layers: ``embed`` (token + learned position embedding, dropout), ``block0 ..
block{n-1}`` (pre-LayerNorm causal self-attention and GELU MLP, each with a residual and
dropout) and ``head`` (final LayerNorm and a bias-free projection to vocabulary logits).
Input int32 tokens ``(B, T)`` with ``T <= context``; output logits ``(B, T, vocab_size)``.

The output projection is *not* tied to the token embedding as in GPT-2: the two live in
different layers, which may sit on different pipeline stages, and a weight shared across
stages would need its gradients summed across them. Untying adds ``vocab_size * d_model``
parameters: the paper config (GPT-2 small: 12 layers, d=768, 12 heads, context 1024,
vocabulary 50257) has GPT-2's 124,439,808 parameters plus a 38,597,376-parameter head.

Weights are initialised as GPT-2: normal(0.02), residual projections normal(0.02 /
sqrt(2 * num_layers)), position embeddings normal(0.01).

>>> build_layers(GPTConfig.tiny()).names
('embed', 'block0', 'block1', 'head')
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from pdjax.errors import LayerError
from pdjax.layers import LayerSequence, sequential
from pdjax.models._blocks import check_positive, check_rate
from pdjax.models.spec import LMSampler, ModelSpec

__all__ = [
    "GPT",
    "CausalSelfAttention",
    "GPTBlock",
    "GPTConfig",
    "GPTEmbedding",
    "GPTHead",
    "build_layers",
    "make_spec",
]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """GPT hyper-parameters.

    Attributes:
      vocab_size: vocabulary size.
      context: maximum sequence length (rows of the position embedding).
      seq_len: length of the sampled sequences; at most ``context``.
      num_layers: transformer blocks.
      d_model: residual stream width; divisible by ``num_heads``.
      num_heads: attention heads.
      mlp_ratio: MLP hidden width / ``d_model``.
      dropout: dropout rate on embeddings, attention probabilities and residual branches.
      layer_norm_eps: LayerNorm epsilon.
    """

    vocab_size: int = 50257
    context: int = 1024
    seq_len: int = 1024
    num_layers: int = 12
    d_model: int = 768
    num_heads: int = 12
    mlp_ratio: int = 4
    dropout: float = 0.1
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        check_positive(
            "GPTConfig",
            vocab_size=self.vocab_size,
            context=self.context,
            seq_len=self.seq_len,
            num_layers=self.num_layers,
            d_model=self.d_model,
            num_heads=self.num_heads,
            mlp_ratio=self.mlp_ratio,
        )
        check_rate("GPTConfig", dropout=self.dropout)
        if self.d_model % self.num_heads:
            raise LayerError(
                f"GPTConfig: d_model {self.d_model} is not divisible by num_heads {self.num_heads}"
            )
        if self.seq_len > self.context:
            raise LayerError(
                f"GPTConfig: seq_len {self.seq_len} exceeds the context {self.context}"
            )

    @classmethod
    def tiny(cls) -> GPTConfig:
        """2 blocks, d=32, 2 heads, context 16, vocabulary 64, dropout 0.1."""
        return cls(vocab_size=64, context=16, seq_len=16, num_layers=2, d_model=32, num_heads=2)

    @classmethod
    def paper(cls) -> GPTConfig:
        """GPT-2 small: 12 blocks, d=768, 12 heads, context 1024, vocabulary 50257."""
        return cls()

    @classmethod
    def medium(cls) -> GPTConfig:
        """About 350M parameters (368,896,000): GPT-2 medium's shape (24 blocks, d=1024,
        16 heads, context 1024) with a 32,000-token vocabulary, 512-token samples and no
        dropout.

        Sized for one accelerator: 512-token samples keep the materialised ``(B, H, T, T)``
        attention scores of a whole-batch training step within one device's memory (XLA:CPU
        plans ~43 GB of temporaries for 16 samples); without dropout, runs from the same
        weights on the same batch compute the same loss, which benchmarks check.
        Not one of :data:`pdjax.models.CONFIGS`: build it with
        ``make_spec(GPTConfig.medium(), "350m")``.
        """
        return cls(
            vocab_size=32000,
            context=1024,
            seq_len=512,
            num_layers=24,
            d_model=1024,
            num_heads=16,
            dropout=0.0,
        )


def _normal(stddev: float) -> nn.initializers.Initializer:
    return nn.initializers.normal(stddev)


class GPTEmbedding(nn.Module):
    """Token + position embedding and dropout: int32 ``(B, T) -> (B, T, d_model)``.

    Attributes:
      vocab_size: vocabulary size.
      context: maximum sequence length.
      d_model: embedding width.
      dropout: dropout rate (train mode only).
    """

    vocab_size: int
    context: int
    d_model: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        """Embeds ``tokens``; raises :class:`LayerError` if ``T > context``."""
        t = tokens.shape[1]
        if t > self.context:
            raise LayerError(f"sequence length {t} exceeds the model's context {self.context}")
        wte = nn.Embed(self.vocab_size, self.d_model, embedding_init=_normal(0.02), name="wte")
        wpe = self.param("wpe", _normal(0.01), (self.context, self.d_model))
        x: jax.Array = wte(tokens) + wpe[:t].reshape(1, t, self.d_model)
        x = nn.Dropout(self.dropout)(x, deterministic=not train)
        return x


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``(B, T, D) -> (B, T, D)``.

    Attributes:
      num_heads: attention heads; must divide ``D``.
      dropout: dropout rate on the attention probabilities and the output.
      out_init_std: init stddev of the output projection.
    """

    num_heads: int
    dropout: float = 0.0
    out_init_std: float = 0.02

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Attends over the positions ``<=`` each query's."""
        b, t, d = x.shape
        h = self.num_heads
        qkv = nn.Dense(3 * d, kernel_init=_normal(0.02), name="qkv")(x)
        qkv = qkv.reshape(b, t, 3, h, d // h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each (B, T, H, D/H)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
        causal = jnp.tril(jnp.ones((t, t), bool)).reshape(1, 1, t, t)
        lowest = jnp.finfo(scores.dtype).min
        scores = jnp.where(causal, scores, lowest)
        probs = nn.Dropout(self.dropout)(nn.softmax(scores, axis=-1), deterministic=not train)
        y: jax.Array = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
        y = nn.Dense(d, kernel_init=_normal(self.out_init_std), name="proj")(y)
        y = nn.Dropout(self.dropout)(y, deterministic=not train)
        return y


class GPTBlock(nn.Module):
    """A pre-LayerNorm transformer block: ``(B, T, D) -> (B, T, D)``.

    Attributes:
      num_heads: attention heads.
      mlp_ratio: MLP hidden width / ``D``.
      dropout: dropout rate.
      num_layers: blocks in the whole model (scales the residual projections' init).
      layer_norm_eps: LayerNorm epsilon.
    """

    num_heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    num_layers: int = 1
    layer_norm_eps: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""
        d = x.shape[-1]
        out_std = 0.02 / math.sqrt(2 * self.num_layers)
        y = nn.LayerNorm(self.layer_norm_eps, name="ln1")(x)
        x = x + CausalSelfAttention(self.num_heads, self.dropout, out_std, name="attn")(y, train)
        y = nn.LayerNorm(self.layer_norm_eps, name="ln2")(x)
        y = nn.gelu(nn.Dense(self.mlp_ratio * d, kernel_init=_normal(0.02), name="fc")(y))
        y = nn.Dense(d, kernel_init=_normal(out_std), name="proj")(y)
        x = x + nn.Dropout(self.dropout)(y, deterministic=not train)
        return x


class GPTHead(nn.Module):
    """Final LayerNorm and bias-free vocabulary projection: ``(B, T, D) -> (B, T, vocab_size)``.

    Attributes:
      vocab_size: vocabulary size.
      layer_norm_eps: LayerNorm epsilon.
    """

    vocab_size: int
    layer_norm_eps: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the logits; ``train`` is ignored."""
        del train
        x = nn.LayerNorm(self.layer_norm_eps, name="ln_f")(x)
        return nn.Dense(self.vocab_size, use_bias=False, kernel_init=_normal(0.02), name="lm_head")(
            x
        )


def _embedding(c: GPTConfig, name: str | None = None) -> GPTEmbedding:
    return GPTEmbedding(c.vocab_size, c.context, c.d_model, c.dropout, name=name)


def _block(c: GPTConfig, name: str | None = None) -> GPTBlock:
    return GPTBlock(c.num_heads, c.mlp_ratio, c.dropout, c.num_layers, c.layer_norm_eps, name=name)


class GPT(nn.Module):
    """GPT as one module: int32 tokens ``(B, T) -> logits (B, T, vocab_size)``."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        """Returns next-token logits; dropout (train mode) needs a ``"dropout"`` RNG."""
        c = self.config
        x = _embedding(c, name="embed")(tokens, train)
        for i in range(c.num_layers):
            x = _block(c, name=f"block{i}")(x, train)
        return GPTHead(c.vocab_size, c.layer_norm_eps, name="head")(x, train)


def build_layers(config: GPTConfig) -> LayerSequence:
    """GPT as a layer sequence (``num_layers + 2`` layers), named as in :class:`GPT`."""
    modules: list[nn.Module] = [_embedding(config)]
    modules += [_block(config) for _ in range(config.num_layers)]
    modules.append(GPTHead(config.vocab_size, config.layer_norm_eps))
    names = ["embed", *(f"block{i}" for i in range(config.num_layers)), "head"]
    return sequential(*modules, names=names)


def make_spec(config: GPTConfig, config_name: str = "custom") -> ModelSpec:
    """The :class:`~pdjax.models.ModelSpec` of a GPT language model with ``config``."""
    return ModelSpec(
        name="gpt",
        config=config_name,
        model_config=config,
        layers=build_layers(config),
        monolith=GPT(config),
        task="language_model",
        num_classes=config.vocab_size,
        sampler=LMSampler(config.seq_len, config.vocab_size),
    )
