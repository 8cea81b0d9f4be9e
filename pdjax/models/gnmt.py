"""A GNMT-style LSTM encoder-decoder with attention (Wu et al. 2016, as in MLPerf's GNMT),
PipeDream's translation workload.

Input ``(src, tgt_in)``: int32 source tokens ``(B, S)`` and teacher-forced target tokens
``(B, T)``; output logits ``(B, T, vocab_size)``. Activations between layers are pairs:

==========  ==========================================  ==================================
layer       computes                                    output
==========  ==========================================  ==================================
embed       source and target embeddings                ``(src (B,S,H), tgt (B,T,H))``
enc0        bidirectional LSTM over the source          ``(enc (B,S,2H), tgt)``
enc1        LSTM, 2H -> H                               ``(enc (B,S,H), tgt)``
enc2..      LSTM, residual                              ``(enc (B,S,H), tgt)``
dec0        LSTM over the target, then normalised       ``(dec (B,T,H), context (B,T,H))``
            Bahdanau attention of its outputs over enc
dec1        LSTM over concat(dec, context), 2H -> H     ``(dec (B,T,H), context)``
dec2..      as dec1, residual                           ``(dec (B,T,H), context)``
proj        dense to vocabulary logits                  ``logits (B,T,V)``
==========  ==========================================  ==================================

As in MLPerf's GNMT, attention is computed once, from the first decoder LSTM's outputs,
so the decoder runs over all target positions in parallel (teacher forcing); its context
vectors feed every later decoder layer. Dropout is applied to the input of every LSTM.
Source and target use separate embeddings (no sharing across stages). Sequences are
taken as unpadded: there is no source-length mask.

The paper config is GNMT-8 style (4 encoder + 4 decoder LSTMs, hidden 1024, vocabulary
32000, dropout 0.2): 10 layers. The tiny config keeps the 4 + 4 structure with hidden 16,
vocabulary 32, source length 7 and target length 5.

>>> build_layers(GNMTConfig.tiny()).names
('embed', 'enc0', 'enc1', 'enc2', 'enc3', 'dec0', 'dec1', 'dec2', 'dec3', 'proj')
"""

from __future__ import annotations

import dataclasses
from typing import cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from pdjax.errors import LayerError
from pdjax.layers import LayerSequence, sequential
from pdjax.models._blocks import check_positive, check_rate
from pdjax.models.spec import ModelSpec, Seq2SeqSampler

__all__ = [
    "GNMT",
    "AttentionDecoderLayer",
    "BahdanauAttention",
    "DecoderLayer",
    "EncoderLayer",
    "GNMTConfig",
    "GNMTEmbedding",
    "GNMTProjection",
    "build_layers",
    "make_spec",
]

Pair = tuple[jax.Array, jax.Array]


@dataclasses.dataclass(frozen=True)
class GNMTConfig:
    """GNMT hyper-parameters.

    Attributes:
      vocab_size: source and target vocabulary size.
      hidden: LSTM width ``H`` (and embedding width).
      num_encoder_layers: encoder LSTMs (the first bidirectional), at least 2.
      num_decoder_layers: decoder LSTMs (the first with attention), at least 2.
      src_len: length of sampled source sequences.
      tgt_len: length of sampled target sequences.
      dropout: dropout rate on every LSTM's input (train mode).
    """

    vocab_size: int = 32000
    hidden: int = 1024
    num_encoder_layers: int = 4
    num_decoder_layers: int = 4
    src_len: int = 50
    tgt_len: int = 50
    dropout: float = 0.2

    def __post_init__(self) -> None:
        check_positive(
            "GNMTConfig",
            vocab_size=self.vocab_size,
            hidden=self.hidden,
            src_len=self.src_len,
            tgt_len=self.tgt_len,
        )
        check_rate("GNMTConfig", dropout=self.dropout)
        if self.num_encoder_layers < 2 or self.num_decoder_layers < 2:
            raise LayerError(
                "GNMTConfig: needs at least 2 encoder and 2 decoder layers, got "
                f"{self.num_encoder_layers} and {self.num_decoder_layers}"
            )

    @classmethod
    def tiny(cls) -> GNMTConfig:
        """4 + 4 LSTMs, hidden 16, vocabulary 32, source length 7, target length 5."""
        return cls(vocab_size=32, hidden=16, src_len=7, tgt_len=5)

    @classmethod
    def paper(cls) -> GNMTConfig:
        """GNMT-8: 4 + 4 LSTMs, hidden 1024, vocabulary 32000, sequences of 50."""
        return cls()


def _lstm(features: int, name: str | None = None) -> nn.RNN:
    return nn.RNN(nn.OptimizedLSTMCell(features), name=name)


def _uniform(scale: float) -> nn.initializers.Initializer:
    def init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -scale, scale)

    return init


class GNMTEmbedding(nn.Module):
    """Source and target embeddings: ``(src (B,S), tgt (B,T))`` -> ``((B,S,H), (B,T,H))``.

    Attributes:
      vocab_size: vocabulary size.
      features: embedding width.
    """

    vocab_size: int
    features: int

    @nn.compact
    def __call__(self, x: Pair, train: bool = False) -> Pair:
        """Embeds both token arrays; ``train`` is ignored."""
        del train
        src, tgt = x
        src_embed = nn.Embed(self.vocab_size, self.features, name="src")
        tgt_embed = nn.Embed(self.vocab_size, self.features, name="tgt")
        return src_embed(src), tgt_embed(tgt)


class EncoderLayer(nn.Module):
    """One encoder LSTM: ``(enc (B,S,F), tgt)`` -> ``(enc' (B,S,H or 2H), tgt)``.

    The target embeddings pass through untouched, for the decoder.

    Attributes:
      features: hidden units per direction.
      bidirectional: run a forward and a backward LSTM and concatenate (2H outputs).
      residual: add the layer's input to its output (needs equal widths).
      dropout: dropout rate on the input (train mode).
    """

    features: int
    bidirectional: bool = False
    residual: bool = False
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: Pair, train: bool = False) -> Pair:
        """Encodes the source states ``x[0]``."""
        enc, tgt = x
        h = nn.Dropout(self.dropout)(enc, deterministic=not train)
        lstm: nn.Bidirectional | nn.RNN
        if self.bidirectional:
            lstm = nn.Bidirectional(_lstm(self.features), _lstm(self.features), name="lstm")
        else:
            lstm = _lstm(self.features, name="lstm")
        y = cast(jax.Array, lstm(h))  # return_carry is off: the outputs alone
        if self.residual:
            y = y + enc
        return y, tgt


class BahdanauAttention(nn.Module):
    """Normalised additive attention: queries ``(B,T,H)``, keys ``(B,S,K)`` -> ``(B,T,K)``.

    ``score(q, k) = (g v / |v|) . tanh(W_q q + W_k k + b)``; the context is the softmax
    over ``S`` of the scores applied to the keys themselves (the encoder states).

    Attributes:
      features: width of the attention's hidden space.
    """

    features: int

    @nn.compact
    def __call__(self, query: jax.Array, keys: jax.Array) -> jax.Array:
        """Returns the context vectors, one per query position."""
        f = self.features
        q = nn.Dense(f, use_bias=False, name="query")(query)
        k = nn.Dense(f, use_bias=False, name="key")(keys)
        bias = self.param("bias", nn.initializers.zeros, (f,))
        v = self.param("v", _uniform(0.1), (f,))
        g = self.param("scale", nn.initializers.constant(f**-0.5), ())
        v = g * v / jnp.linalg.norm(v)
        hidden = jnp.tanh(q[:, :, None, :] + k[:, None, :, :] + bias.reshape(1, 1, 1, f))
        weights = nn.softmax(jnp.einsum("btsf,f->bts", hidden, v), axis=-1)
        return jnp.einsum("bts,bsk->btk", weights, keys)


class AttentionDecoderLayer(nn.Module):
    """First decoder LSTM + attention: ``(enc (B,S,H), tgt (B,T,H))`` -> ``(dec, context)``.

    Attributes:
      features: hidden units ``H``.
      dropout: dropout rate on the target embeddings (train mode).
    """

    features: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: Pair, train: bool = False) -> Pair:
        """Runs the LSTM over the target and attends over the encoder states."""
        enc, tgt = x
        h = nn.Dropout(self.dropout)(tgt, deterministic=not train)
        dec = cast(jax.Array, _lstm(self.features, name="lstm")(h))  # no carry: outputs alone
        context = BahdanauAttention(self.features, name="attention")(dec, enc)
        return dec, context


class DecoderLayer(nn.Module):
    """A later decoder LSTM over ``concat(dec, context)``: ``(dec, context) -> (dec', context)``.

    Attributes:
      features: hidden units ``H``.
      residual: add the incoming decoder states to the output.
      dropout: dropout rate on the LSTM's input (train mode).
    """

    features: int
    residual: bool = False
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: Pair, train: bool = False) -> Pair:
        """Decodes; the attention context passes through for the next layer."""
        dec, context = x
        h = nn.Dropout(self.dropout)(
            jnp.concatenate([dec, context], axis=-1), deterministic=not train
        )
        y = cast(jax.Array, _lstm(self.features, name="lstm")(h))  # no carry: outputs alone
        if self.residual:
            y = y + dec
        return y, context


class GNMTProjection(nn.Module):
    """Vocabulary projection of the decoder states: ``(dec (B,T,H), context)`` -> ``(B,T,V)``.

    Attributes:
      vocab_size: vocabulary size.
    """

    vocab_size: int

    @nn.compact
    def __call__(self, x: Pair, train: bool = False) -> jax.Array:
        """Returns the logits; ``train`` is ignored."""
        del train
        dec, _ = x
        return nn.Dense(self.vocab_size, name="logits")(dec)


def _encoder(c: GNMTConfig, i: int, name: str | None = None) -> EncoderLayer:
    # Layer 0 is bidirectional (2H out) and layer 1 narrows it to H: no residual there.
    return EncoderLayer(
        c.hidden, bidirectional=i == 0, residual=i >= 2, dropout=c.dropout, name=name
    )


def _decoder(c: GNMTConfig, i: int, name: str | None = None) -> DecoderLayer:
    # Layer 1 maps concat(dec, context) (2H) to H like the others; MLPerf's GNMT adds the
    # residual from layer 2 on.
    return DecoderLayer(c.hidden, residual=i >= 2, dropout=c.dropout, name=name)


class GNMT(nn.Module):
    """GNMT as one module: ``(src (B,S), tgt_in (B,T))`` int32 -> logits ``(B,T,V)``."""

    config: GNMTConfig

    @nn.compact
    def __call__(self, x: Pair, train: bool = False) -> jax.Array:
        """Returns teacher-forced next-token logits; dropout needs a ``"dropout"`` RNG."""
        c = self.config
        h = GNMTEmbedding(c.vocab_size, c.hidden, name="embed")(x, train)
        for i in range(c.num_encoder_layers):
            h = _encoder(c, i, name=f"enc{i}")(h, train)
        h = AttentionDecoderLayer(c.hidden, c.dropout, name="dec0")(h, train)
        for i in range(1, c.num_decoder_layers):
            h = _decoder(c, i, name=f"dec{i}")(h, train)
        return GNMTProjection(c.vocab_size, name="proj")(h, train)


def build_layers(config: GNMTConfig) -> LayerSequence:
    """GNMT as a layer sequence (encoder + decoder layers + 2), named as in :class:`GNMT`."""
    c = config
    modules: list[nn.Module] = [GNMTEmbedding(c.vocab_size, c.hidden)]
    modules += [_encoder(c, i) for i in range(c.num_encoder_layers)]
    modules.append(AttentionDecoderLayer(c.hidden, c.dropout))
    modules += [_decoder(c, i) for i in range(1, c.num_decoder_layers)]
    modules.append(GNMTProjection(c.vocab_size))
    names = [
        "embed",
        *(f"enc{i}" for i in range(c.num_encoder_layers)),
        *(f"dec{i}" for i in range(c.num_decoder_layers)),
        "proj",
    ]
    return sequential(*modules, names=names)


def make_spec(config: GNMTConfig, config_name: str = "custom") -> ModelSpec:
    """The :class:`~pdjax.models.ModelSpec` of a GNMT-style translation model with ``config``."""
    return ModelSpec(
        name="gnmt",
        config=config_name,
        model_config=config,
        layers=build_layers(config),
        monolith=GNMT(config),
        task="seq2seq",
        num_classes=config.vocab_size,
        sampler=Seq2SeqSampler(
            config.src_len, config.tgt_len, config.vocab_size, config.vocab_size
        ),
    )
