"""``ModelSpec``: one configured model family, as the rest of pdjax consumes it.

A spec bundles the layer sequence (what pdjax profiles, partitions and runs), the same
model written as one ordinary Flax module (the reference the sequence must equal), a
sampler of synthetic batches with valid shapes and token ranges, and the task's loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from pdjax.errors import LayerError
from pdjax.layers import LayerSequence, PyTree, Variables

__all__ = ["ImageSampler", "LMSampler", "ModelSpec", "Sampler", "Seq2SeqSampler", "Task"]

Task = Literal["classification", "language_model", "seq2seq"]
#: ``(batch_size, key) -> (inputs, targets)``; the same key always gives the same batch.
Sampler = Callable[[int, jax.Array], tuple[PyTree, jax.Array]]


def _as_key(rng: jax.Array | int | None) -> jax.Array:
    if rng is None:
        return jax.random.key(0)
    if isinstance(rng, int):
        return jax.random.key(rng)
    return rng


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model family at one configuration: layers, monolith, synthetic data and loss.

    Attributes:
      name: the family's registry name, e.g. ``"vgg16"``.
      config: the configuration's name, ``"tiny"`` or ``"paper"`` (overrides keep it).
      model_config: the family's frozen config dataclass, with any overrides applied.
      layers: the model as a :class:`~pdjax.layers.LayerSequence` of linen modules.
      monolith: the same model as one linen module whose top-level submodules are named
        as the layers, so ``layers.split(monolith.init(...))`` gives per-layer variables.
        Call it as ``monolith.apply(variables, x, train=...)``.
      task: ``"classification"``, ``"language_model"`` or ``"seq2seq"``.
      num_classes: number of classes, or the (target) vocabulary size for language
        models and seq2seq models; the last axis of the output logits.
      sampler: ``(batch_size, key) -> (inputs, targets)`` drawing a synthetic batch.

    Specs built from equal configs compare and hash equal.
    """

    name: str
    config: str
    model_config: Any
    layers: LayerSequence
    monolith: nn.Module
    task: Task
    num_classes: int
    sampler: Sampler

    def sample_batch(
        self, batch_size: int, rng: jax.Array | int | None = None
    ) -> tuple[PyTree, jax.Array]:
        """Draws a synthetic ``(inputs, targets)`` batch.

        Args:
          batch_size: number of examples, at least 1.
          rng: a PRNG key or an integer seed; ``None`` means seed 0. The same ``rng``
            always gives the same batch, and :meth:`sample_input` / :meth:`sample_target`
            with that ``rng`` return its two halves.

        Returns:
          ``(inputs, targets)``: inputs as the first layer takes them (float images
          ``(B, ...)``, int32 tokens ``(B, T)``, or a tuple ``(src (B, S), tgt_in (B, T))``
          for seq2seq); int32 targets ``(B,)`` for classification, ``(B, T)`` otherwise,
          all in ``[0, num_classes)``.

        Raises:
          LayerError: if ``batch_size < 1``.
        """
        if batch_size < 1:
            raise LayerError(f"batch_size must be at least 1, got {batch_size}")
        return self.sampler(batch_size, _as_key(rng))

    def sample_input(self, batch_size: int, rng: jax.Array | int | None = None) -> PyTree:
        """The inputs of :meth:`sample_batch` (same arguments)."""
        return self.sample_batch(batch_size, rng)[0]

    def sample_target(self, batch_size: int, rng: jax.Array | int | None = None) -> jax.Array:
        """The targets of :meth:`sample_batch` (same arguments)."""
        return self.sample_batch(batch_size, rng)[1]

    def loss(self, outputs: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean softmax cross-entropy with integer labels.

        Args:
          outputs: logits ``(..., num_classes)``.
          targets: int labels of shape ``outputs.shape[:-1]``.

        Returns:
          A float32 scalar, averaged over every label position.
        """
        return optax.softmax_cross_entropy_with_integer_labels(outputs, targets).mean()

    def accuracy(self, outputs: jax.Array, targets: jax.Array) -> jax.Array:
        """Fraction of label positions whose arg-max logit is the target (a scalar in [0, 1])."""
        return jnp.mean(jnp.argmax(outputs, axis=-1) == targets)

    def abstract_variables(self, batch_size: int = 1) -> list[Variables]:
        """Per-layer variables as ``jax.ShapeDtypeStruct`` trees, with no FLOPs or allocation."""
        x = self.sample_input(batch_size)
        return jax.eval_shape(self.layers.init, jax.random.key(0), x)

    def num_params(self) -> int:
        """Number of parameters (the ``"params"`` collections), computed abstractly."""
        variables = self.abstract_variables()
        return sum(leaf.size for v in variables for leaf in jax.tree.leaves(v.get("params", {})))


# Samplers are frozen dataclasses rather than closures so that two specs built from the
# same config compare (and hash) equal.


@dataclasses.dataclass(frozen=True)
class ImageSampler:
    """Standard-normal float32 inputs ``(B, *shape)`` and int32 labels ``(B,)``."""

    shape: tuple[int, ...]
    num_classes: int

    def __call__(self, batch_size: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        kx, ky = jax.random.split(key)
        # Drawn flat and reshaped: XLA:CPU compiles random draws of rank >= 3 several times
        # slower (up to ~1 s each) than flat ones.
        size = batch_size * math.prod(self.shape)
        x = jax.random.normal(kx, (size,), jnp.float32).reshape(batch_size, *self.shape)
        y = jax.random.randint(ky, (batch_size,), 0, self.num_classes, jnp.int32)
        return x, y


@dataclasses.dataclass(frozen=True)
class LMSampler:
    """int32 tokens ``(B, seq_len)`` and their next tokens ``(B, seq_len)`` as targets."""

    seq_len: int
    vocab_size: int

    def __call__(self, batch_size: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        shape = (batch_size, self.seq_len + 1)
        tokens = jax.random.randint(key, shape, 0, self.vocab_size, jnp.int32)
        return tokens[:, :-1], tokens[:, 1:]


@dataclasses.dataclass(frozen=True)
class Seq2SeqSampler:
    """``((src (B, S), tgt_in (B, T)), tgt_out (B, T))`` int32 token batches."""

    src_len: int
    tgt_len: int
    src_vocab: int
    tgt_vocab: int

    def __call__(
        self, batch_size: int, key: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        ks, kt = jax.random.split(key)
        src = jax.random.randint(ks, (batch_size, self.src_len), 0, self.src_vocab, jnp.int32)
        shape = (batch_size, self.tgt_len + 1)
        tgt = jax.random.randint(kt, shape, 0, self.tgt_vocab, jnp.int32)
        # Teacher forcing: the decoder reads tgt[:, :-1] and predicts tgt[:, 1:].
        return (src, tgt[:, :-1]), tgt[:, 1:]
