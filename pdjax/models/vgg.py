"""VGG-16 (Simonyan & Zisserman, configuration D), one of PipeDream's image models.

Layers (21): ``conv1_1, conv1_2, pool1, conv2_1, conv2_2, pool2, conv3_1 .. conv3_3,
pool3, conv4_1 .. conv4_3, pool4, conv5_1 .. conv5_3, pool5, fc6, fc7, fc8``. Each
``conv`` layer is a 3x3 ``SAME`` convolution + ReLU, each ``pool`` a parameter-free 2x2
max-pool (separate layers, so a stage boundary may fall after the pool, where activations
are 4x smaller), ``fc6`` flattens. ``fc6`` and ``fc7`` are dense + ReLU + dropout.

The paper config (224x224x3, 1000 classes) has 138,357,544 parameters, as torchvision's
``vgg16``. The tiny config keeps the structure with 32x32 inputs, channels / 16, a 64-wide
classifier, 10 classes and no dropout (so tiny models are deterministic in train mode).

>>> build_layers(VGGConfig.tiny()).names[:4]
('conv1_1', 'conv1_2', 'pool1', 'conv2_1')
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from pdjax.errors import LayerError
from pdjax.layers import LayerSequence, sequential
from pdjax.models._blocks import ConvReLU, FullyConnected, MaxPool, check_positive, check_rate
from pdjax.models.spec import ImageSampler, ModelSpec

__all__ = ["VGG", "VGGConfig", "build_layers", "make_spec"]

_VGG16_STAGES = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))


@dataclasses.dataclass(frozen=True)
class VGGConfig:
    """VGG hyper-parameters.

    Attributes:
      image_size: input height and width; divisible by ``2 ** len(stages)``.
      in_channels: input channels.
      stages: conv widths per stage; each stage ends with a 2x2 max-pool.
      hidden: width of ``fc6`` and ``fc7``.
      num_classes: output classes.
      dropout: dropout rate after ``fc6`` and ``fc7`` (train mode only).
    """

    image_size: int = 224
    in_channels: int = 3
    stages: tuple[tuple[int, ...], ...] = _VGG16_STAGES
    hidden: int = 4096
    num_classes: int = 1000
    dropout: float = 0.5

    def __post_init__(self) -> None:
        check_positive(
            "VGGConfig",
            image_size=self.image_size,
            in_channels=self.in_channels,
            hidden=self.hidden,
            num_classes=self.num_classes,
            num_stages=len(self.stages),
        )
        check_rate("VGGConfig", dropout=self.dropout)
        if self.image_size % 2 ** len(self.stages):
            raise LayerError(
                f"VGGConfig: image_size {self.image_size} must be divisible by "
                f"2 ** {len(self.stages)} (one 2x2 pool per stage)"
            )

    @classmethod
    def tiny(cls) -> VGGConfig:
        """32x32x3 input, channels / 16 (4 .. 32), 64-wide classifier, 10 classes, no dropout."""
        stages = tuple(tuple(w // 16 for w in stage) for stage in _VGG16_STAGES)
        return cls(image_size=32, stages=stages, hidden=64, num_classes=10, dropout=0.0)

    @classmethod
    def paper(cls) -> VGGConfig:
        """VGG-16 on ImageNet: 224x224x3, 4096-wide classifier, 1000 classes, dropout 0.5."""
        return cls()


class VGG(nn.Module):
    """VGG as one module: images ``(B, H, W, C) -> logits (B, num_classes)``."""

    config: VGGConfig

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the logits for images ``x`` of shape ``(B, H, W, C)``."""
        c = self.config
        for s, widths in enumerate(c.stages, start=1):
            for i, width in enumerate(widths, start=1):
                x = ConvReLU(width, name=f"conv{s}_{i}")(x, train)
            x = MaxPool(name=f"pool{s}")(x, train)
        x = FullyConnected(c.hidden, dropout=c.dropout, flatten=True, name="fc6")(x, train)
        x = FullyConnected(c.hidden, dropout=c.dropout, name="fc7")(x, train)
        return FullyConnected(c.num_classes, relu=False, name="fc8")(x, train)


def build_layers(config: VGGConfig) -> LayerSequence:
    """VGG as a layer sequence (21 layers for VGG-16), named as in :class:`VGG`."""
    modules: list[nn.Module] = []
    names: list[str] = []
    for s, widths in enumerate(config.stages, start=1):
        for i, width in enumerate(widths, start=1):
            modules.append(ConvReLU(width))
            names.append(f"conv{s}_{i}")
        modules.append(MaxPool())
        names.append(f"pool{s}")
    modules += [
        FullyConnected(config.hidden, dropout=config.dropout, flatten=True),
        FullyConnected(config.hidden, dropout=config.dropout),
        FullyConnected(config.num_classes, relu=False),
    ]
    names += ["fc6", "fc7", "fc8"]
    return sequential(*modules, names=names)


def make_spec(config: VGGConfig, config_name: str = "custom") -> ModelSpec:
    """The :class:`~pdjax.models.ModelSpec` of VGG with ``config``."""
    shape = (config.image_size, config.image_size, config.in_channels)
    return ModelSpec(
        name="vgg16",
        config=config_name,
        model_config=config,
        layers=build_layers(config),
        monolith=VGG(config),
        task="classification",
        num_classes=config.num_classes,
        sampler=ImageSampler(shape, config.num_classes),
    )
