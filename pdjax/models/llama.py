"""A Llama-style decoder-only language model, written with ``flax.nnx``.

Layers: ``embed`` (token embedding, dropout), ``block0 .. block{n-1}`` (pre-RMSNorm
causal self-attention with rotary positions and grouped-query attention, then a SwiGLU
MLP, each on a residual branch with dropout) and ``head`` (final RMSNorm and a bias-free
projection to vocabulary logits). Input int32 tokens ``(B, T)`` with ``T <= context``;
output logits ``(B, T, vocab_size)``.

Each layer is an ``nnx.Module`` built by a factory ``rngs -> module``
(:class:`~pdjax.layers.NnxLayer`), so ``layers.init(rng, x)`` draws fresh weights from
``rng``. Train mode reaches the modules as ``train=`` in their ``__call__``; dropout
draws from the ``rngs`` pdjax passes there in train mode (a key per layer and
microbatch), so the modules hold no RNG state and their only collection is ``"params"``.

With ``tie_embeddings=True`` the head multiplies by its own copy of the embedding table,
declared one parameter with the embedding's through ``sequential(..., tied=...)``
(:mod:`pdjax.layers.tied`): the copies start equal, and a pipeline with ``embed`` and
``head`` on different stages sums their gradients, so they stay equal.

Weights are initialised as GPT-2's: normal(0.02), the residual branches' output
projections normal(0.02 / sqrt(2 * num_layers)); RMSNorm scales start at one.

Every parameter carries logical axis names, one per dimension, in its ``nnx`` metadata
``out_sharding`` (:data:`AXES`; read them with ``variable.get_metadata()["out_sharding"]``):
the embedding table and the tied head's copy ``(vocab, embed)``; the attention's ``q``
kernel ``(embed, heads)``, ``k`` and ``v`` ``(embed, kv_heads)``, ``o`` ``(heads,
embed)``; the MLP's ``gate`` and ``up`` ``(embed, mlp)``, ``down`` ``(mlp, embed)``; the
RMSNorm scales ``(norm,)``; the untied ``lm_head`` ``(embed, vocab)``. pdjax's default
rules (:mod:`pdjax.layers.sharding`) map ``embed`` to the ``fsdp`` mesh axis, ``heads``,
``kv_heads``, ``mlp`` and ``vocab`` to ``tensor``, and replicate ``norm``. The names are
metadata only: the variables are made with ``eager_sharding=False``, so building the model
needs no mesh and draws the same values as without them.

Cached generation (:meth:`pdjax.pipeline.Pipeline.generate`): every layer also takes a
:class:`~pdjax._decoding.CacheStep` in eval mode, a path of its own that training and
evaluation never reach (their inputs are arrays): the embedding embeds the step's tokens,
each block's attention writes the step's keys and values into its cache (``(k, v)``,
each ``(B, length, num_kv_heads, head_dim)``, allocated by the prefill) and attends over
the cached positions up to each query's (:func:`cached_attention`), and the head returns
the logits. The parameters are the same; no variable is added.

>>> build_layers(LlamaConfig.tiny()).names
('embed', 'block0', 'block1', 'head')
>>> LlamaConfig.paper().num_params()
336118784
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import bridge

from pdjax._decoding import CacheStep
from pdjax.errors import LayerError
from pdjax.layers import LayerSequence, sequential
from pdjax.models._blocks import check_positive, check_rate
from pdjax.models.spec import LMSampler, ModelSpec

__all__ = [
    "AXES",
    "TIED",
    "Llama",
    "LlamaAttention",
    "LlamaBlock",
    "LlamaConfig",
    "LlamaEmbedding",
    "LlamaHead",
    "LlamaMLP",
    "build_layers",
    "cached_attention",
    "causal_attention",
    "make_spec",
    "rotary",
    "swiglu_hidden",
]

#: The ``tied=`` group of a model with ``tie_embeddings``: the embedding and the head's copy.
TIED = {"embedding": ("embed/embedding", "head/embedding")}

#: Logical axis names of the parameters, by role (first name = first dimension).
AXES: dict[str, tuple[str, ...]] = {
    "embedding": ("vocab", "embed"),  # (vocab_size, d_model); the tied head's copy too
    "q": ("embed", "heads"),  # (d_model, num_heads * head_dim)
    "kv": ("embed", "kv_heads"),  # (d_model, num_kv_heads * head_dim), k and v
    "o": ("heads", "embed"),  # (num_heads * head_dim, d_model)
    "gate_up": ("embed", "mlp"),  # (d_model, hidden_dim)
    "down": ("mlp", "embed"),  # (hidden_dim, d_model)
    "norm": ("norm",),  # RMSNorm scale (d_model,)
    "lm_head": ("embed", "vocab"),  # (d_model, vocab_size), untied
}


def swiglu_hidden(d_model: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU hidden width: two thirds of ``4 * d_model``, rounded up to a
    multiple of ``multiple_of`` (the three matrices then cost about what a GELU MLP of
    width ``4 * d_model`` does).

    >>> swiglu_hidden(4096), swiglu_hidden(1024), swiglu_hidden(64, 32)
    (11008, 2816, 192)
    """
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * -(-hidden // multiple_of)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama hyper-parameters.

    Attributes:
      vocab_size: vocabulary size.
      context: maximum sequence length (rotary positions need no table; longer inputs
        are refused all the same).
      seq_len: length of the sampled sequences; at most ``context``.
      num_layers: transformer blocks.
      d_model: residual stream width; divisible by ``num_heads``.
      num_heads: query heads; ``head_dim = d_model // num_heads``, even (rotary pairs).
      num_kv_heads: key/value heads (grouped-query attention); divides ``num_heads``.
        ``num_heads`` is ordinary multi-head attention, 1 multi-query attention.
      ffn_dim: SwiGLU hidden width; 0 for Llama's rule (:func:`swiglu_hidden` of
        ``d_model`` and ``ffn_multiple_of``).
      ffn_multiple_of: what Llama's rule rounds the hidden width up to.
      rope_theta: base of the rotary frequencies.
      rms_norm_eps: RMSNorm epsilon.
      dropout: dropout rate on the embeddings and the residual branches (train mode).
      tie_embeddings: the head's projection is the embedding table (one parameter).
    """

    vocab_size: int = 32000
    context: int = 2048
    seq_len: int = 512
    num_layers: int = 24
    d_model: int = 1024
    num_heads: int = 16
    num_kv_heads: int = 4
    ffn_dim: int = 0
    ffn_multiple_of: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        check_positive(
            "LlamaConfig",
            vocab_size=self.vocab_size,
            context=self.context,
            seq_len=self.seq_len,
            num_layers=self.num_layers,
            d_model=self.d_model,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            ffn_multiple_of=self.ffn_multiple_of,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
        )
        check_rate("LlamaConfig", dropout=self.dropout)
        if self.ffn_dim < 0:
            raise LayerError(
                f"LlamaConfig: ffn_dim must be positive (or 0 for Llama's rule), got {self.ffn_dim}"
            )
        if self.d_model % self.num_heads:
            raise LayerError(
                f"LlamaConfig: d_model {self.d_model} is not divisible by num_heads "
                f"{self.num_heads}"
            )
        if (self.d_model // self.num_heads) % 2:
            raise LayerError(
                f"LlamaConfig: head_dim {self.d_model // self.num_heads} (d_model / num_heads) "
                "must be even: rotary positions turn pairs of features"
            )
        if self.num_heads % self.num_kv_heads:
            raise LayerError(
                f"LlamaConfig: num_heads {self.num_heads} is not divisible by num_kv_heads "
                f"{self.num_kv_heads} (grouped-query attention shares each key/value head "
                "between num_heads / num_kv_heads query heads)"
            )
        if self.seq_len > self.context:
            raise LayerError(
                f"LlamaConfig: seq_len {self.seq_len} exceeds the context {self.context}"
            )

    @property
    def head_dim(self) -> int:
        """Features per attention head."""
        return self.d_model // self.num_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden width: ``ffn_dim``, or Llama's rule where it is 0."""
        return self.ffn_dim or swiglu_hidden(self.d_model, self.ffn_multiple_of)

    def num_params(self) -> int:
        """The number of parameters, from the shapes (nothing is built).

        >>> c = LlamaConfig.tiny()
        >>> v, d, f, kv = c.vocab_size, c.d_model, c.hidden_dim, c.num_kv_heads * c.head_dim
        >>> block = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
        >>> c.num_params() == v * d + c.num_layers * block + d + v * d
        True
        """
        d, kv = self.d_model, self.num_kv_heads * self.head_dim
        attention = d * d + 2 * d * kv + d * d  # q, k, v, o (no biases)
        mlp = 3 * d * self.hidden_dim  # gate, up, down
        block = attention + mlp + 2 * d  # and two RMSNorm scales
        embed = self.vocab_size * d
        head = d + (0 if self.tie_embeddings else self.vocab_size * d)
        return embed + self.num_layers * block + head

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """2 blocks, d=32, 4 heads over 2 key/value heads, SwiGLU width 96, context 16,
        vocabulary 64, dropout 0.1 (fast on a CPU, for tests)."""
        return cls(
            vocab_size=64,
            context=16,
            seq_len=16,
            num_layers=2,
            d_model=32,
            num_heads=4,
            num_kv_heads=2,
            ffn_multiple_of=32,
            dropout=0.1,
        )

    @classmethod
    def small(cls) -> LlamaConfig:
        """4 blocks, d=128, 4 heads over 2 key/value heads, SwiGLU width 384, context 128,
        vocabulary 256, dropout 0.1: 853,120 parameters, trains on a CPU in minutes.
        ``get_model("llama", "small")`` (one of :data:`pdjax.models.EXTRA_CONFIGS`;
        ``pdjax train --config small``).

        >>> LlamaConfig.small().num_params()
        853120
        """
        return cls(
            vocab_size=256,
            context=128,
            seq_len=128,
            num_layers=4,
            d_model=128,
            num_heads=4,
            num_kv_heads=2,
            ffn_multiple_of=64,
            dropout=0.1,
        )

    @classmethod
    def paper(cls) -> LlamaConfig:
        """About 350M parameters (336,118,784), for one accelerator: 24 blocks, d=1024, 16
        heads over 4 key/value heads (head_dim 64), SwiGLU width 2816, vocabulary 32000,
        untied head, context 2048, 512-token samples, no dropout (as Llama).

        Its count, by :meth:`num_params`: embedding and head 2 x 32000 x 1024; per block
        q and o 2 x 1024^2, k and v 2 x 1024 x 256, the MLP 3 x 1024 x 2816, two norms
        2 x 1024; the final norm 1024.

        >>> 2 * 32000 * 1024 + 24 * (2 * 1024**2 + 2 * 1024 * 256 + 3 * 1024 * 2816 + 2048) + 1024
        336118784
        """
        return cls()

    @classmethod
    def llama2_7b(cls) -> LlamaConfig:
        """Llama-2-7B's shapes (``get_model("llama", "7b")``): 32 blocks, d=4096, 32 heads
        (no grouping), SwiGLU width 11008, vocabulary 32000, untied head, context 4096,
        no dropout: 6,738,415,616 parameters (27 GB in float32), for planning from shapes
        (:func:`pdjax.profile.profile` with a device model, or
        :func:`pdjax.profile.profile_sharded`), not for allocating on a CPU.

        >>> LlamaConfig.llama2_7b().num_params()
        6738415616
        """
        return cls(
            vocab_size=32000,
            context=4096,
            seq_len=4096,
            num_layers=32,
            d_model=4096,
            num_heads=32,
            num_kv_heads=32,
            ffn_dim=11008,
            dropout=0.0,
        )

    @classmethod
    def gpu_350m(cls) -> LlamaConfig:
        """The ~350M configuration for a GPU check: :meth:`paper`."""
        return cls.paper()


def _normal(stddev: float) -> nnx.Initializer:
    return nnx.initializers.normal(stddev)


def _axes(role: str) -> dict[str, Any]:
    """Variable metadata naming the logical axes of a parameter of ``role`` (:data:`AXES`),
    never sharded on creation (no mesh needed)."""
    return {"out_sharding": AXES[role], "eager_sharding": False}


def _linear(n_in: int, n_out: int, std: float, role: str, rngs: nnx.Rngs) -> nnx.Linear:
    """A bias-free ``nnx.Linear`` with normal(``std``) weights, its kernel named ``role``."""
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=False,
        kernel_init=_normal(std),
        kernel_metadata=_axes(role),
        rngs=rngs,
    )


def _rms_norm(config: LlamaConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    """An RMSNorm over ``d_model``, its scale named ``(norm,)``."""
    return nnx.RMSNorm(
        config.d_model, epsilon=config.rms_norm_eps, scale_metadata=_axes("norm"), rngs=rngs
    )


def _embedding_table(config: LlamaConfig, rngs: nnx.Rngs) -> nnx.Param[jax.Array]:
    """A normal(0.02) ``(vocab_size, d_model)`` table named ``(vocab, embed)``."""
    shape = (config.vocab_size, config.d_model)
    return nnx.Param(_normal(0.02)(rngs.params(), shape, jnp.float32), **_axes("embedding"))


def rotary(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary position embedding of ``x`` ``(..., T, H, D)`` at ``positions`` ``(T,)``.

    Feature ``i`` and feature ``i + D/2`` form a pair (the "rotate half" layout) turned
    by the angle ``position * theta ** (-2 i / D)``, so the dot product of a query turned
    to position ``m`` and a key turned to position ``n`` depends on ``m - n`` only.

    >>> q = jnp.arange(8.0).reshape(1, 1, 8)
    >>> bool(jnp.allclose(rotary(q, jnp.array([0])), q))  # position 0: no turn
    True
    """
    d = x.shape[-1]
    if d % 2:
        raise LayerError(f"rotary positions need an even number of features, got {d}")
    freqs = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2 / d)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # (T, D/2)
    shape = (1,) * (x.ndim - 3) + (len(positions), 1, d // 2)  # every batch row and head
    cos = jnp.cos(angles).reshape(shape).astype(x.dtype)
    sin = jnp.sin(angles).reshape(shape).astype(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention: ``q`` ``(B, T, H, D)``, ``k`` and ``v`` ``(B, T, K, D)``
    with ``K`` dividing ``H`` (each key/value head serves ``H / K`` consecutive query
    heads) -> ``(B, T, H, D)``."""
    groups = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, groups, axis=2)
    v = jnp.repeat(v, groups, axis=2)
    t = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((t, t), bool)).reshape(1, 1, t, t)
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
    """Causal softmax attention over a key/value cache: ``q`` ``(B, T, H, D)`` at
    ``positions`` ``(T,)``, ``k`` and ``v`` ``(B, L, K, D)`` (cache positions ``0 ..
    L - 1``; ``K`` divides ``H``) -> ``(B, T, H, D)``. Query ``i`` attends over the keys
    at positions ``<= positions[i]`` (those the cache holds), as :func:`causal_attention`
    does over a sequence; the positions past them (not yet written) weigh exactly 0.

    >>> q = k = v = jnp.ones((1, 3, 2, 4))
    >>> bool(jnp.allclose(cached_attention(q, k, v, jnp.arange(3)), causal_attention(q, k, v)))
    True
    """
    groups = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, groups, axis=2)
    v = jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    seen = jnp.arange(k.shape[1])[None, :] <= positions[:, None]  # (T, L)
    scores = jnp.where(seen[None, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class LlamaEmbedding(nnx.Module):
    """Token embedding and dropout: int32 ``(B, T) -> (B, T, d_model)``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.context = config.context
        self.embedding = _embedding_table(config, rngs)
        self.dropout = nnx.Dropout(config.dropout)

    def __call__(self, tokens: Any, *, train: bool = False, rngs: nnx.Rngs | None = None) -> Any:
        """Embeds ``tokens``; raises :class:`LayerError` if ``T > context`` (a
        :class:`~pdjax._decoding.CacheStep`: its tokens, and if its cache would hold more
        than ``context`` positions)."""
        if isinstance(tokens, CacheStep):
            if tokens.length > self.context:
                raise LayerError(
                    f"a key/value cache of {tokens.length} positions exceeds the model's "
                    f"context {self.context}"
                )
            return tokens.advance(self(tokens.x))
        t = tokens.shape[1]
        if t > self.context:
            raise LayerError(f"sequence length {t} exceeds the model's context {self.context}")
        x = jnp.take(self.embedding.get_value(), tokens, axis=0)
        return self.dropout(x, deterministic=not train, rngs=rngs)


class LlamaAttention(nnx.Module):
    """Causal grouped-query self-attention with rotary positions, no biases:
    ``(B, T, d_model) -> (B, T, d_model)``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        d, hd = config.d_model, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            hd,
        )
        self.rope_theta = config.rope_theta
        out_std = 0.02 / math.sqrt(2 * config.num_layers)

        self.q = _linear(d, config.num_heads * hd, 0.02, "q", rngs)
        self.k = _linear(d, config.num_kv_heads * hd, 0.02, "kv", rngs)
        self.v = _linear(d, config.num_kv_heads * hd, 0.02, "kv", rngs)
        self.o = _linear(config.num_heads * hd, d, out_std, "o", rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Attends over the positions ``<=`` each query's."""
        b, t, _ = x.shape
        q, k, v = self._project(x, jnp.arange(t))
        y = causal_attention(q, k, v).reshape(b, t, self.num_heads * self.head_dim)
        return self.o(y)

    def cached(
        self, x: jax.Array, cache: tuple[jax.Array, jax.Array] | None, start: Any, length: int
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """:meth:`__call__` of ``x`` ``(B, T, d_model)``, positions ``start .. start + T -
        1``, attending also over the positions before ``start`` held in ``cache`` (``(k,
        v)``, each ``(B, length, num_kv_heads, head_dim)``; None: a fresh cache of
        ``length`` positions). Returns the output and the cache with ``x``'s keys and
        values written at its positions."""
        b, t, _ = x.shape
        positions = start + jnp.arange(t)
        q, k, v = self._project(x, positions)
        if cache is None:
            shape = (b, length, self.num_kv_heads, self.head_dim)
            cache = (jnp.zeros(shape, k.dtype), jnp.zeros(shape, v.dtype))
        ck = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), start, 1)
        cv = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), start, 1)
        y = cached_attention(q, ck, cv, positions).reshape(b, t, self.num_heads * self.head_dim)
        return self.o(y), (ck, cv)

    def _project(
        self, x: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values of ``x``, the queries and keys turned to
        ``positions``."""
        b, t, _ = x.shape
        q = self.q(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        q = rotary(q, positions, self.rope_theta)
        k = rotary(k, positions, self.rope_theta)
        return q, k, v


class LlamaMLP(nnx.Module):
    """The SwiGLU MLP, no biases: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        d, f = config.d_model, config.hidden_dim
        out_std = 0.02 / math.sqrt(2 * config.num_layers)
        self.gate = _linear(d, f, 0.02, "gate_up", rngs)
        self.up = _linear(d, f, 0.02, "gate_up", rngs)
        self.down = _linear(f, d, out_std, "down", rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``(B, T, d_model) -> (B, T, d_model)``."""
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nnx.Module):
    """A pre-RMSNorm transformer block: ``x + drop(attn(norm(x)))``, then
    ``x + drop(mlp(norm(x)))``; ``(B, T, d_model) -> (B, T, d_model)``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = _rms_norm(config, rngs)
        self.attn = LlamaAttention(config, rngs=rngs)
        self.mlp_norm = _rms_norm(config, rngs)
        self.mlp = LlamaMLP(config, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout)

    def __call__(self, x: Any, *, train: bool = False, rngs: nnx.Rngs | None = None) -> Any:
        """Dropout (train mode) draws from ``rngs``: first the attention branch's mask,
        then the MLP's. A :class:`~pdjax._decoding.CacheStep` (eval mode: no dropout)
        attends through the block's key/value cache (:meth:`LlamaAttention.cached`)."""
        if isinstance(x, CacheStep):
            h = x.x
            y, cache = self.attn.cached(self.attn_norm(h), x.cache, x.start, x.length)
            h = h + y
            return x.advance(h + self.mlp(self.mlp_norm(h)), cache)
        y = self.attn(self.attn_norm(x))
        x = x + self.dropout(y, deterministic=not train, rngs=rngs)
        y = self.mlp(self.mlp_norm(x))
        return x + self.dropout(y, deterministic=not train, rngs=rngs)


class LlamaHead(nnx.Module):
    """Final RMSNorm and bias-free projection to the vocabulary:
    ``(B, T, d_model) -> (B, T, vocab_size)``.

    Untied, the projection is ``lm_head`` (an ``nnx.Linear``, kernel ``(d_model,
    vocab_size)``); tied, it is ``embedding`` ``(vocab_size, d_model)``, the head's copy
    of the embedding table (``logits = x @ embedding.T``), declared tied to it by
    :func:`build_layers`.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.norm = _rms_norm(config, rngs)
        self.tied = config.tie_embeddings
        if self.tied:
            self.embedding = _embedding_table(config, rngs)
        else:
            self.lm_head = _linear(config.d_model, config.vocab_size, 0.02, "lm_head", rngs)

    def __call__(self, x: Any) -> Any:
        """Returns the logits (of a :class:`~pdjax._decoding.CacheStep`: the step with
        them)."""
        if isinstance(x, CacheStep):
            return x.advance(self(x.x))
        x = self.norm(x)
        if self.tied:
            table: jax.Array = self.embedding.get_value()
            return x @ table.T
        return self.lm_head(x)


class Llama(nnx.Module):
    """The whole model as one ``nnx.Module`` (submodules named as the layers):
    int32 tokens ``(B, T) -> logits (B, T, vocab_size)``.

    Tied, the head reads the embedding's own table (one ``nnx.Param``), where the layer
    sequence keeps two copies made one by ``tied=``.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.embed = LlamaEmbedding(config, rngs=rngs)
        for i in range(config.num_layers):
            setattr(self, f"block{i}", LlamaBlock(config, rngs=rngs))
        self.head = LlamaHead(config, rngs=rngs)
        if config.tie_embeddings:
            self.head.embedding = self.embed.embedding

    def __call__(
        self, tokens: jax.Array, *, train: bool = False, rngs: nnx.Rngs | None = None
    ) -> jax.Array:
        """Returns next-token logits; dropout (train mode) draws from ``rngs``."""
        x = self.embed(tokens, train=train, rngs=rngs)
        for i in range(self.config.num_layers):
            x = getattr(self, f"block{i}")(x, train=train, rngs=rngs)
        logits: jax.Array = self.head(x)
        return logits


@functools.cache
def build_layers(config: LlamaConfig) -> LayerSequence:
    """Llama as a layer sequence (``num_layers + 2`` layers: ``embed``, ``block{i}``,
    ``head``), each layer a factory ``rngs -> nnx.Module``; with ``tie_embeddings`` the
    head's ``embedding`` is tied to the embedding's (:data:`TIED`).

    One sequence per config (cached; it holds no arrays): nnx layers compare by identity,
    so specs built from equal configs compare equal, as the linen families' do.
    """
    factories: list[Callable[..., nnx.Module]] = [functools.partial(LlamaEmbedding, config)]
    factories += [functools.partial(LlamaBlock, config) for _ in range(config.num_layers)]
    factories.append(functools.partial(LlamaHead, config))
    names = ["embed", *(f"block{i}" for i in range(config.num_layers)), "head"]
    return sequential(*factories, names=names, tied=TIED if config.tie_embeddings else None)


def _plain_value(variable: nnx.Variable[Any]) -> Any:
    """The monolith's linen variables: the bare arrays, without the axis names (which
    the bridge would otherwise box), as ``layers.split`` takes them."""
    return variable.get_value()


def make_spec(config: LlamaConfig, config_name: str = "custom") -> ModelSpec:
    """The :class:`~pdjax.models.ModelSpec` of a Llama language model with ``config``.

    Its ``monolith`` is :class:`Llama` as a linen module (``nnx.bridge.to_linen``: its
    variables are ``{"params": {layer name: ...}}``, as ``layers.split`` takes them). The
    bridge hands an nnx module RNGs only when it is built, so the monolith runs train mode
    without dropout alone (a config with ``dropout`` 0); call :class:`Llama` itself with
    ``rngs=`` for dropout. Tied, the monolith holds the table once, under ``embed``: give
    the head its copy (``params["head"]["embedding"]``) before ``layers.split``. Its
    variables are bare arrays: the logical axis names stay on the nnx variables (the
    layers' templates), not boxed into the linen tree.
    """
    return ModelSpec(
        name="llama",
        config=config_name,
        model_config=config,
        layers=build_layers(config),
        monolith=bridge.to_linen(Llama, config, metadata_fn=_plain_value),
        task="language_model",
        num_classes=config.vocab_size,
        sampler=LMSampler(config.seq_len, config.vocab_size),
    )
