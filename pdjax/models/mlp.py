"""A small multi-layer perceptron classifier, for tests and demos.

Layers: ``dense0 .. dense{n-1}`` (dense + ReLU each), then ``logits``. The tiny config
takes flattened 8x8 digits, ``(B, 64)`` floats, and has 4 layers.

>>> import jax
>>> config = MLPConfig.tiny()
>>> seq = build_layers(config)
>>> seq.names
('dense0', 'dense1', 'dense2', 'logits')
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from pdjax.layers import LayerSequence, sequential
from pdjax.models._blocks import FullyConnected, check_positive
from pdjax.models.spec import ImageSampler, ModelSpec

__all__ = ["MLP", "MLPConfig", "build_layers", "make_spec"]


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """MLP hyper-parameters.

    Attributes:
      in_features: input width (64 for flattened 8x8 digits).
      hidden: widths of the hidden dense + ReLU layers.
      num_classes: output classes.
    """

    in_features: int = 64
    hidden: tuple[int, ...] = (32, 32, 32)
    num_classes: int = 10

    def __post_init__(self) -> None:
        check_positive(
            "MLPConfig",
            in_features=self.in_features,
            num_classes=self.num_classes,
            **{f"hidden[{i}]": h for i, h in enumerate(self.hidden)},
        )

    @classmethod
    def tiny(cls) -> MLPConfig:
        """64 -> 32 -> 32 -> 32 -> 10 (4 layers)."""
        return cls()

    @classmethod
    def paper(cls) -> MLPConfig:
        """A larger demo size (the MLP has no paper counterpart): 784 -> 3 x 1024 -> 10."""
        return cls(in_features=784, hidden=(1024, 1024, 1024))


class MLP(nn.Module):
    """The MLP as one module: ``(B, in_features) -> logits (B, num_classes)``."""

    config: MLPConfig

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the logits for a batch ``x`` of shape ``(B, in_features)``."""
        for i, width in enumerate(self.config.hidden):
            x = FullyConnected(width, name=f"dense{i}")(x, train)
        return FullyConnected(self.config.num_classes, relu=False, name="logits")(x, train)


def build_layers(config: MLPConfig) -> LayerSequence:
    """The MLP as a layer sequence (``len(hidden) + 1`` layers), named as in :class:`MLP`."""
    modules = [FullyConnected(w) for w in config.hidden]
    modules.append(FullyConnected(config.num_classes, relu=False))
    names = [f"dense{i}" for i in range(len(config.hidden))] + ["logits"]
    return sequential(*modules, names=names)


def make_spec(config: MLPConfig, config_name: str = "custom") -> ModelSpec:
    """The :class:`~pdjax.models.ModelSpec` of an MLP classifier with ``config``."""
    return ModelSpec(
        name="mlp",
        config=config_name,
        model_config=config,
        layers=build_layers(config),
        monolith=MLP(config),
        task="classification",
        num_classes=config.num_classes,
        sampler=ImageSampler((config.in_features,), config.num_classes),
    )
