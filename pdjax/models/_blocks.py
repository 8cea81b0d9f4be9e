"""Layer modules shared by the convolutional families (MLP, CNN, VGG, AlexNet).

Every layer module takes ``train: bool = False`` so that :class:`~pdjax.layers.LinenLayer`
and the monolithic models switch train/eval mode the same way.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from pdjax.errors import LayerError


def check_positive(owner: str, **values: int | float) -> None:
    """Raises :class:`LayerError` naming every non-positive value (config validation)."""
    bad = {k: v for k, v in values.items() if not v > 0}
    if bad:
        raise LayerError(f"{owner}: these settings must be positive: {bad}")


def check_rate(owner: str, **rates: float) -> None:
    """Raises :class:`LayerError` for a dropout rate outside ``[0, 1)``."""
    bad = {k: v for k, v in rates.items() if not 0.0 <= v < 1.0}
    if bad:
        raise LayerError(f"{owner}: dropout rates must lie in [0, 1); got {bad}")


class ConvReLU(nn.Module):
    """Convolution, ReLU and an optional max-pool, as one layer.

    Attributes:
      features: output channels.
      kernel_size: square kernel side.
      strides: convolution stride.
      padding: ``"SAME"``, ``"VALID"`` or a symmetric pixel count.
      pool_window: max-pool window side after the ReLU; 0 for no pooling.
      pool_stride: max-pool stride (``VALID`` pooling).
    """

    features: int
    kernel_size: int = 3
    strides: int = 1
    padding: str | int = "SAME"
    pool_window: int = 0
    pool_stride: int = 2

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Maps images ``(B, H, W, C)`` to ``(B, H', W', features)``."""
        del train
        k, s = self.kernel_size, self.strides
        pad = self.padding if isinstance(self.padding, str) else ((self.padding,) * 2,) * 2
        x = nn.Conv(self.features, (k, k), strides=(s, s), padding=pad, name="conv")(x)
        x = nn.relu(x)
        if self.pool_window:
            w, ps = self.pool_window, self.pool_stride
            x = nn.max_pool(x, (w, w), strides=(ps, ps))
        return x


class MaxPool(nn.Module):
    """A parameter-free max-pool layer (``VALID`` padding): ``(B, H, W, C) -> (B, H', W', C)``.

    Attributes:
      window: window side.
      stride: stride.
    """

    window: int = 2
    stride: int = 2

    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Pools ``x``; ``train`` is ignored."""
        del train
        w, s = self.window, self.stride
        x = nn.max_pool(x, (w, w), strides=(s, s))
        return x


class FullyConnected(nn.Module):
    """Optional flatten, dense, optional ReLU and dropout, as one layer.

    Attributes:
      features: output width.
      relu: apply a ReLU after the dense layer (off for a logits layer).
      dropout: dropout rate after the activation (active in train mode only).
      flatten: flatten ``(B, ...)`` inputs to ``(B, -1)`` first.
    """

    features: int
    relu: bool = True
    dropout: float = 0.0
    flatten: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Maps ``(B, F)`` (or ``(B, ...)`` with ``flatten``) to ``(B, features)``."""
        if self.flatten:
            x = x.reshape(x.shape[0], -1)
        x = nn.Dense(self.features, name="dense")(x)
        if self.relu:
            x = nn.relu(x)
        x = nn.Dropout(self.dropout)(x, deterministic=not train)
        return x
