"""An AWD-LSTM-style language model (Merity et al., "Regularizing and Optimizing LSTM
Language Models"), PipeDream's language-modelling workload.

Layers: ``embed`` (word embedding with embedding dropout, then locked input dropout),
``lstm0 .. lstm{n-1}`` (an LSTM over the sequence, then locked dropout: ``dropout_h``
between LSTMs, ``dropout_o`` after the last) and ``decoder`` (dense to vocabulary
logits). Input int32 tokens ``(B, T)``; output logits ``(B, T, vocab_size)``.

"Locked" (variational) dropout draws one mask per sequence and feature and reuses it at
every time step; embedding dropout drops whole words (rows of the embedding matrix).

Differences from AWD-LSTM, on purpose:

* The decoder's weights are *not* tied to the embedding: the two are different layers,
  which may sit on different pipeline stages, and a weight shared across stages would need
  its gradients summed across them. This adds ``vocab_size * embed_dim`` parameters, and
  the last LSTM's width is still ``embed_dim`` as in AWD-LSTM.
* No DropConnect on the hidden-to-hidden weights (``wdrop``); the standard flax LSTM
  cell has no hook for it.
* Every batch starts from a zero LSTM state (no hidden state carried across truncated
  BPTT windows), so that microbatches are independent.

The paper config follows the WikiText-2 setting: vocabulary 33278, embedding 400, three
LSTMs with 1150 hidden units (the last with 400), BPTT length 70.

>>> build_layers(AWDLMConfig.tiny()).names
('embed', 'lstm0', 'lstm1', 'lstm2', 'decoder')
"""

from __future__ import annotations

import dataclasses
from typing import cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from pdjax.layers import LayerSequence, sequential
from pdjax.models._blocks import check_positive, check_rate
from pdjax.models.spec import LMSampler, ModelSpec

__all__ = ["AWDLM", "AWDEmbedding", "AWDLMConfig", "LockedLSTM", "build_layers", "make_spec"]


@dataclasses.dataclass(frozen=True)
class AWDLMConfig:
    """AWD-LSTM hyper-parameters.

    Attributes:
      vocab_size: vocabulary size.
      embed_dim: embedding width, also the last LSTM's width.
      hidden: width of the other LSTMs.
      num_layers: LSTM layers (at least 1).
      seq_len: length of the sampled sequences (the BPTT window).
      dropout_e: embedding dropout (fraction of words dropped).
      dropout_i: locked dropout on the embedded input.
      dropout_h: locked dropout between LSTM layers.
      dropout_o: locked dropout on the last LSTM's output.
    """

    vocab_size: int = 33278
    embed_dim: int = 400
    hidden: int = 1150
    num_layers: int = 3
    seq_len: int = 70
    dropout_e: float = 0.1
    dropout_i: float = 0.65
    dropout_h: float = 0.2
    dropout_o: float = 0.4

    def __post_init__(self) -> None:
        check_positive(
            "AWDLMConfig",
            vocab_size=self.vocab_size,
            embed_dim=self.embed_dim,
            hidden=self.hidden,
            num_layers=self.num_layers,
            seq_len=self.seq_len,
        )
        check_rate(
            "AWDLMConfig",
            dropout_e=self.dropout_e,
            dropout_i=self.dropout_i,
            dropout_h=self.dropout_h,
            dropout_o=self.dropout_o,
        )

    def lstm_widths(self) -> tuple[int, ...]:
        """Hidden units of each LSTM layer (the last one has ``embed_dim``)."""
        return (self.hidden,) * (self.num_layers - 1) + (self.embed_dim,)

    @classmethod
    def tiny(cls) -> AWDLMConfig:
        """Vocabulary 32, embedding 16, LSTMs 24-24-16, sequences of 12, AWD's dropouts."""
        return cls(vocab_size=32, embed_dim=16, hidden=24, seq_len=12)

    @classmethod
    def paper(cls) -> AWDLMConfig:
        """WikiText-2 AWD-LSTM: vocabulary 33278, embedding 400, LSTMs 1150-1150-400."""
        return cls()


def _uniform(scale: float) -> nn.initializers.Initializer:
    def init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -scale, scale)

    return init


class AWDEmbedding(nn.Module):
    """Embedding with word dropout and locked input dropout: int32 ``(B, T) -> (B, T, E)``.

    Attributes:
      vocab_size: vocabulary size.
      features: embedding width ``E``.
      dropout_e: fraction of vocabulary rows zeroed (train mode; the rest rescaled).
      dropout_i: locked dropout rate on the embedded sequence (train mode).
    """

    vocab_size: int
    features: int
    dropout_e: float = 0.0
    dropout_i: float = 0.0

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        """Embeds ``tokens``; dropout needs a ``"dropout"`` RNG in train mode."""
        table = self.param("embedding", _uniform(0.1), (self.vocab_size, self.features))
        if train and self.dropout_e > 0:
            keep = 1.0 - self.dropout_e
            rows = jax.random.bernoulli(self.make_rng("dropout"), keep, (self.vocab_size, 1))
            table = jnp.where(rows, table / keep, 0.0)
        x: jax.Array = jnp.take(table, tokens, axis=0)
        x = nn.Dropout(self.dropout_i, broadcast_dims=(1,))(x, deterministic=not train)
        return x


class LockedLSTM(nn.Module):
    """A unidirectional LSTM followed by locked dropout: ``(B, T, F) -> (B, T, features)``.

    Attributes:
      features: hidden units.
      dropout: locked dropout rate on the output (train mode).
    """

    features: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Runs the LSTM from a zero state over the time axis 1."""
        rnn = nn.RNN(nn.OptimizedLSTMCell(self.features), name="rnn")
        x = cast(jax.Array, rnn(x))  # return_carry is off: the outputs alone
        x = nn.Dropout(self.dropout, broadcast_dims=(1,))(x, deterministic=not train)
        return x


def _lstm(config: AWDLMConfig, i: int, name: str | None = None) -> LockedLSTM:
    last = i == config.num_layers - 1
    rate = config.dropout_o if last else config.dropout_h
    return LockedLSTM(config.lstm_widths()[i], rate, name=name)


class AWDLM(nn.Module):
    """The AWD language model as one module: ``(B, T)`` tokens -> ``(B, T, V)`` logits."""

    config: AWDLMConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        """Returns next-token logits; dropout (train mode) needs a ``"dropout"`` RNG."""
        c = self.config
        x = AWDEmbedding(c.vocab_size, c.embed_dim, c.dropout_e, c.dropout_i, name="embed")(
            tokens, train
        )
        for i in range(c.num_layers):
            x = _lstm(c, i, name=f"lstm{i}")(x, train)
        return nn.Dense(c.vocab_size, name="decoder")(x)


def build_layers(config: AWDLMConfig) -> LayerSequence:
    """The model as a layer sequence (``num_layers + 2`` layers), named as in :class:`AWDLM`."""
    modules: list[nn.Module] = [
        AWDEmbedding(config.vocab_size, config.embed_dim, config.dropout_e, config.dropout_i)
    ]
    modules += [_lstm(config, i) for i in range(config.num_layers)]
    modules.append(nn.Dense(config.vocab_size))
    names = ["embed", *(f"lstm{i}" for i in range(config.num_layers)), "decoder"]
    return sequential(*modules, names=names)


def make_spec(config: AWDLMConfig, config_name: str = "custom") -> ModelSpec:
    """The :class:`~pdjax.models.ModelSpec` of an AWD-style language model with ``config``."""
    return ModelSpec(
        name="awd_lm",
        config=config_name,
        model_config=config,
        layers=build_layers(config),
        monolith=AWDLM(config),
        task="language_model",
        num_classes=config.vocab_size,
        sampler=LMSampler(config.seq_len, config.vocab_size),
    )
