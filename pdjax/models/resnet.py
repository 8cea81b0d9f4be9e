"""ResNet-50 (He et al., bottleneck blocks, stride on the 3x3 convolution as in torchvision).

Layers: ``stem`` (7x7 stride-2 convolution, BatchNorm, ReLU, 3x3 stride-2 max-pool),
one layer per bottleneck block, ``stage{s}_block{b}`` (1-based), and ``head`` (global
average pool + dense). The first block of every stage has a projection shortcut
(1x1 convolution + BatchNorm). BatchNorm uses batch statistics in train mode and updates
the ``"batch_stats"`` collection (momentum 0.9, epsilon 1e-5, as PyTorch).

The paper config (stages ``[3, 4, 6, 3]``, width 64, 224x224x3, 1000 classes) has
25,557,032 parameters, as torchvision's ``resnet50``; 18 layers. The tiny config has one
block per stage, width 8 and 32x32 inputs; 6 layers.

>>> build_layers(ResNetConfig.tiny()).names
('stem', 'stage1_block1', 'stage2_block1', 'stage3_block1', 'stage4_block1', 'head')
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from pdjax.layers import LayerSequence, sequential
from pdjax.models._blocks import check_positive
from pdjax.models.spec import ImageSampler, ModelSpec

__all__ = [
    "Bottleneck",
    "ResNet",
    "ResNetConfig",
    "ResNetHead",
    "Stem",
    "build_layers",
    "make_spec",
]

_EXPANSION = 4  # bottleneck output channels = 4 x its inner width


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """ResNet hyper-parameters.

    Attributes:
      image_size: input height and width.
      in_channels: input channels.
      stage_sizes: bottleneck blocks per stage (stage ``s`` has inner width
        ``width * 2**s`` and downsamples by 2, except the first).
      width: stem channels and inner width of the first stage.
      num_classes: output classes.
      bn_momentum: BatchNorm running-average momentum (flax convention: weight of the
        old value).
    """

    image_size: int = 224
    in_channels: int = 3
    stage_sizes: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64
    num_classes: int = 1000
    bn_momentum: float = 0.9

    def __post_init__(self) -> None:
        check_positive(
            "ResNetConfig",
            image_size=self.image_size,
            in_channels=self.in_channels,
            width=self.width,
            num_classes=self.num_classes,
            num_stages=len(self.stage_sizes),
            **{f"stage_sizes[{i}]": n for i, n in enumerate(self.stage_sizes)},
        )

    @classmethod
    def tiny(cls) -> ResNetConfig:
        """32x32x3 input, one block per stage, width 8 (block outputs 32 .. 256), 10 classes."""
        return cls(image_size=32, stage_sizes=(1, 1, 1, 1), width=8, num_classes=10)

    @classmethod
    def paper(cls) -> ResNetConfig:
        """ResNet-50 on ImageNet: 224x224x3, stages [3, 4, 6, 3], width 64, 1000 classes."""
        return cls()


def _batch_norm(momentum: float, train: bool, name: str) -> nn.BatchNorm:
    return nn.BatchNorm(use_running_average=not train, momentum=momentum, epsilon=1e-5, name=name)


class Stem(nn.Module):
    """Conv 7x7/2, BatchNorm, ReLU, max-pool 3x3/2: ``(B, H, W, C) -> (B, H/4, W/4, F)``.

    Attributes:
      features: output channels.
      bn_momentum: BatchNorm momentum.
    """

    features: int
    bn_momentum: float = 0.9

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Applies the stem; ``train`` selects batch statistics and updates them."""
        x = nn.Conv(
            self.features,
            (7, 7),
            strides=(2, 2),
            padding=((3, 3), (3, 3)),
            use_bias=False,
            name="conv",
        )(x)
        x = nn.relu(_batch_norm(self.bn_momentum, train, "bn")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        return x


class Bottleneck(nn.Module):
    """A bottleneck residual block: ``(B, H, W, C) -> (B, H/s, W/s, 4 * features)``.

    Attributes:
      features: inner width (the block outputs ``4 * features`` channels).
      strides: stride of the 3x3 convolution and of the projection shortcut.
      bn_momentum: BatchNorm momentum.
    """

    features: int
    strides: int = 1
    bn_momentum: float = 0.9

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Applies the block; ``train`` selects batch statistics and updates them."""
        bn = functools.partial(_batch_norm, self.bn_momentum, train)
        conv = functools.partial(nn.Conv, use_bias=False)
        s = self.strides
        out_features = _EXPANSION * self.features
        y = nn.relu(bn("bn1")(conv(self.features, (1, 1), name="conv1")(x)))
        y = conv(self.features, (3, 3), strides=(s, s), padding=((1, 1), (1, 1)), name="conv2")(y)
        y = nn.relu(bn("bn2")(y))
        y = bn("bn3")(conv(out_features, (1, 1), name="conv3")(y))
        shortcut = x
        if s != 1 or x.shape[-1] != out_features:
            shortcut = conv(out_features, (1, 1), strides=(s, s), name="proj_conv")(x)
            shortcut = bn("proj_bn")(shortcut)
        return nn.relu(y + shortcut)


class ResNetHead(nn.Module):
    """Global average pool and dense: ``(B, H, W, C) -> logits (B, num_classes)``.

    Attributes:
      num_classes: output classes.
    """

    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the logits; ``train`` is ignored."""
        del train
        return nn.Dense(self.num_classes, name="fc")(jnp.mean(x, axis=(1, 2)))


def _blocks(config: ResNetConfig) -> list[tuple[str, Bottleneck]]:
    out = []
    for s, size in enumerate(config.stage_sizes):
        for b in range(size):
            strides = 2 if s > 0 and b == 0 else 1
            block = Bottleneck(config.width * 2**s, strides, config.bn_momentum)
            out.append((f"stage{s + 1}_block{b + 1}", block))
    return out


class ResNet(nn.Module):
    """ResNet as one module: images ``(B, H, W, C) -> logits (B, num_classes)``.

    Apply with ``mutable=["batch_stats"]`` in train mode.
    """

    config: ResNetConfig

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the logits for images ``x`` of shape ``(B, H, W, C)``."""
        c = self.config
        x = Stem(c.width, c.bn_momentum, name="stem")(x, train)
        for s, size in enumerate(c.stage_sizes):
            for b in range(size):
                strides = 2 if s > 0 and b == 0 else 1
                block = Bottleneck(
                    c.width * 2**s, strides, c.bn_momentum, name=f"stage{s + 1}_block{b + 1}"
                )
                x = block(x, train)
        return ResNetHead(c.num_classes, name="head")(x, train)


def build_layers(config: ResNetConfig) -> LayerSequence:
    """ResNet as a layer sequence (``sum(stage_sizes) + 2`` layers), named as in :class:`ResNet`."""
    blocks = _blocks(config)
    modules = [Stem(config.width, config.bn_momentum), *(m for _, m in blocks)]
    modules.append(ResNetHead(config.num_classes))
    names = ["stem", *(n for n, _ in blocks), "head"]
    return sequential(*modules, names=names)


def make_spec(config: ResNetConfig, config_name: str = "custom") -> ModelSpec:
    """The :class:`~pdjax.models.ModelSpec` of ResNet with ``config``."""
    shape = (config.image_size, config.image_size, config.in_channels)
    return ModelSpec(
        name="resnet50",
        config=config_name,
        model_config=config,
        layers=build_layers(config),
        monolith=ResNet(config),
        task="classification",
        num_classes=config.num_classes,
        sampler=ImageSampler(shape, config.num_classes),
    )
