"""AlexNet (Krizhevsky et al.; torchvision's single-tower variant), a PipeDream image model.

Layers (8): ``conv1 .. conv5`` (convolution + ReLU; ``conv1``, ``conv2`` and ``conv5``
end with a 3x3 stride-2 max-pool) and ``fc6, fc7, fc8`` (``fc6`` flattens; ``fc6`` and
``fc7`` are dense + ReLU + dropout). There is no local response normalisation and no
adaptive average pool: a 224x224 input already reaches ``fc6`` as 6x6x256.

The paper config has 61,100,840 parameters, as torchvision's ``alexnet``. The tiny config
uses 32x32 inputs, a 5x5 stride-2 first convolution, channels / 16, a 64-wide classifier,
10 classes and no dropout.

>>> build_layers(AlexNetConfig.tiny()).names
('conv1', 'conv2', 'conv3', 'conv4', 'conv5', 'fc6', 'fc7', 'fc8')
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from pdjax.errors import LayerError
from pdjax.layers import LayerSequence, sequential
from pdjax.models._blocks import ConvReLU, FullyConnected, check_positive, check_rate
from pdjax.models.spec import ImageSampler, ModelSpec

__all__ = ["AlexNet", "AlexNetConfig", "build_layers", "make_spec"]

_POOLED = (True, True, False, False, True)  # which conv layers end with a max-pool


@dataclasses.dataclass(frozen=True)
class AlexNetConfig:
    """AlexNet hyper-parameters.

    Attributes:
      image_size: input height and width.
      in_channels: input channels.
      channels: output channels of the five convolution layers.
      conv1_kernel: kernel side of ``conv1`` (the others are 5, 3, 3, 3).
      conv1_stride: stride of ``conv1``.
      conv1_padding: symmetric padding of ``conv1`` in pixels.
      hidden: width of ``fc6`` and ``fc7``.
      num_classes: output classes.
      dropout: dropout rate after ``fc6`` and ``fc7`` (train mode only).
    """

    image_size: int = 224
    in_channels: int = 3
    channels: tuple[int, int, int, int, int] = (64, 192, 384, 256, 256)
    conv1_kernel: int = 11
    conv1_stride: int = 4
    conv1_padding: int = 2
    hidden: int = 4096
    num_classes: int = 1000
    dropout: float = 0.5

    def __post_init__(self) -> None:
        check_positive(
            "AlexNetConfig",
            image_size=self.image_size,
            in_channels=self.in_channels,
            conv1_kernel=self.conv1_kernel,
            conv1_stride=self.conv1_stride,
            hidden=self.hidden,
            num_classes=self.num_classes,
        )
        check_rate("AlexNetConfig", dropout=self.dropout)
        if len(self.channels) != 5:
            raise LayerError(f"AlexNetConfig: channels needs 5 widths, got {self.channels}")
        if self.feature_size() < 1:
            raise LayerError(
                f"AlexNetConfig: image_size {self.image_size} is too small for the three "
                "3x3 stride-2 max-pools; use at least 32 with the tiny first convolution"
            )

    def feature_size(self) -> int:
        """Height (= width) of the feature map that ``fc6`` flattens."""
        size = (
            self.image_size + 2 * self.conv1_padding - self.conv1_kernel
        ) // self.conv1_stride + 1
        for _ in range(3):
            size = (size - 3) // 2 + 1
        return size

    @classmethod
    def tiny(cls) -> AlexNetConfig:
        """32x32x3 input, conv1 5x5 stride 2, channels (4, 12, 24, 16, 16), 10 classes."""
        return cls(
            image_size=32,
            channels=(4, 12, 24, 16, 16),
            conv1_kernel=5,
            conv1_stride=2,
            hidden=64,
            num_classes=10,
            dropout=0.0,
        )

    @classmethod
    def paper(cls) -> AlexNetConfig:
        """AlexNet on ImageNet: 224x224x3, 4096-wide classifier, 1000 classes, dropout 0.5."""
        return cls()


def _conv_layers(config: AlexNetConfig) -> list[ConvReLU]:
    c1, c2, c3, c4, c5 = config.channels
    first = ConvReLU(
        c1,
        kernel_size=config.conv1_kernel,
        strides=config.conv1_stride,
        padding=config.conv1_padding,
        pool_window=3,
    )
    rest = [
        ConvReLU(width, kernel_size=k, padding=k // 2, pool_window=3 if pool else 0)
        for width, k, pool in zip((c2, c3, c4, c5), (5, 3, 3, 3), _POOLED[1:], strict=True)
    ]
    return [first, *rest]


class AlexNet(nn.Module):
    """AlexNet as one module: images ``(B, H, W, C) -> logits (B, num_classes)``."""

    config: AlexNetConfig

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the logits for images ``x`` of shape ``(B, H, W, C)``."""
        c = self.config
        x = ConvReLU(
            c.channels[0],
            kernel_size=c.conv1_kernel,
            strides=c.conv1_stride,
            padding=c.conv1_padding,
            pool_window=3,
            name="conv1",
        )(x, train)
        x = ConvReLU(c.channels[1], kernel_size=5, padding=2, pool_window=3, name="conv2")(x, train)
        x = ConvReLU(c.channels[2], padding=1, name="conv3")(x, train)
        x = ConvReLU(c.channels[3], padding=1, name="conv4")(x, train)
        x = ConvReLU(c.channels[4], padding=1, pool_window=3, name="conv5")(x, train)
        x = FullyConnected(c.hidden, dropout=c.dropout, flatten=True, name="fc6")(x, train)
        x = FullyConnected(c.hidden, dropout=c.dropout, name="fc7")(x, train)
        return FullyConnected(c.num_classes, relu=False, name="fc8")(x, train)


def build_layers(config: AlexNetConfig) -> LayerSequence:
    """AlexNet as a layer sequence (8 layers), named as in :class:`AlexNet`."""
    modules: list[nn.Module] = list(_conv_layers(config))
    modules += [
        FullyConnected(config.hidden, dropout=config.dropout, flatten=True),
        FullyConnected(config.hidden, dropout=config.dropout),
        FullyConnected(config.num_classes, relu=False),
    ]
    names = ["conv1", "conv2", "conv3", "conv4", "conv5", "fc6", "fc7", "fc8"]
    return sequential(*modules, names=names)


def make_spec(config: AlexNetConfig, config_name: str = "custom") -> ModelSpec:
    """The :class:`~pdjax.models.ModelSpec` of AlexNet with ``config``."""
    shape = (config.image_size, config.image_size, config.in_channels)
    return ModelSpec(
        name="alexnet",
        config=config_name,
        model_config=config,
        layers=build_layers(config),
        monolith=AlexNet(config),
        task="classification",
        num_classes=config.num_classes,
        sampler=ImageSampler(shape, config.num_classes),
    )
