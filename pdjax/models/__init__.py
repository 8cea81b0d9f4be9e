"""The paper's model families as layer sequences, each with a tiny and a paper config.

``get_model(name, config)`` returns a :class:`ModelSpec`: the model as a
:class:`~pdjax.layers.LayerSequence` of ``flax.linen`` modules (what pdjax profiles,
partitions and runs), the same model as one ordinary linen module (``monolith``, whose
top-level submodules are named as the layers), a sampler of synthetic batches, and the
loss (mean softmax cross-entropy over integer labels).

============  ==============  =========================================  ============
name          task            paper config                               layers
============  ==============  =========================================  ============
``mlp``       classification  demo: 784 -> 3 x 1024 -> 10                4 (tiny 4)
``cnn``       classification  demo: 28x28x1, 3 conv, dense               5 (tiny 5)
``vgg16``     classification  VGG-16, ImageNet, 138.4M params            21 (tiny 21)
``alexnet``   classification  AlexNet, ImageNet, 61.1M params            8 (tiny 8)
``resnet50``  classification  ResNet-50, ImageNet, 25.6M params          18 (tiny 6)
``gnmt``      seq2seq         GNMT-8, hidden 1024, vocabulary 32000      10 (tiny 10)
``awd_lm``    language_model  AWD-LSTM, WikiText-2, vocabulary 33278     5 (tiny 5)
``gpt``       language_model  GPT-2 small (untied head), context 1024   14 (tiny 4)
============  ==============  =========================================  ============

>>> import jax
>>> spec = get_model("mlp")
>>> x, y = spec.sample_batch(4)
>>> variables = spec.layers.init(jax.random.key(0), x)
>>> logits, _ = spec.layers.apply(variables, x)
>>> logits.shape
(4, 10)
>>> bool(spec.loss(logits, y) > 0)
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pdjax.errors import LayerError
from pdjax.models import alexnet, awd_lm, cnn, gnmt, gpt, mlp, resnet, vgg
from pdjax.models.alexnet import AlexNetConfig
from pdjax.models.awd_lm import AWDLMConfig
from pdjax.models.cnn import CNNConfig
from pdjax.models.gnmt import GNMTConfig
from pdjax.models.gpt import GPTConfig
from pdjax.models.mlp import MLPConfig
from pdjax.models.resnet import ResNetConfig
from pdjax.models.spec import ModelSpec, Sampler, Task
from pdjax.models.vgg import VGGConfig

__all__ = [
    "CONFIGS",
    "MODELS",
    "AWDLMConfig",
    "AlexNetConfig",
    "CNNConfig",
    "GNMTConfig",
    "GPTConfig",
    "MLPConfig",
    "ModelSpec",
    "ResNetConfig",
    "Sampler",
    "Task",
    "VGGConfig",
    "get_model",
]

_FAMILIES: dict[str, tuple[type, Callable[[Any, str], ModelSpec]]] = {
    "mlp": (MLPConfig, mlp.make_spec),
    "cnn": (CNNConfig, cnn.make_spec),
    "vgg16": (VGGConfig, vgg.make_spec),
    "alexnet": (AlexNetConfig, alexnet.make_spec),
    "resnet50": (ResNetConfig, resnet.make_spec),
    "gnmt": (GNMTConfig, gnmt.make_spec),
    "awd_lm": (AWDLMConfig, awd_lm.make_spec),
    "gpt": (GPTConfig, gpt.make_spec),
}

#: Registry names accepted by :func:`get_model` (``"awd-lm"`` is accepted too).
MODELS: tuple[str, ...] = tuple(_FAMILIES)
#: Configuration names accepted by :func:`get_model`.
CONFIGS: tuple[str, ...] = ("tiny", "paper")


def get_model(name: str, config: str = "tiny", **overrides: Any) -> ModelSpec:
    """Builds a model family at a named configuration.

    Args:
      name: one of :data:`MODELS`; case and ``-``/``_`` are ignored (``"awd-lm"`` works).
      config: ``"tiny"`` (for tests: runs in well under a second on a CPU) or
        ``"paper"`` (the size the PipeDream paper trains).
      **overrides: fields of the family's config dataclass to replace, e.g.
        ``get_model("gpt", num_layers=4, dropout=0.0)``.

    Returns:
      The :class:`ModelSpec`; ``spec.config`` is ``config`` and ``spec.model_config``
      the config dataclass with the overrides applied.

    Raises:
      LayerError: for an unknown name, config or override field, or an invalid value.
    """
    key = name.strip().lower().replace("-", "_")
    if key not in _FAMILIES:
        raise LayerError(f"unknown model {name!r}; choose one of {', '.join(MODELS)} (or 'awd-lm')")
    if config not in CONFIGS:
        raise LayerError(f"unknown config {config!r} for {key!r}; choose one of {CONFIGS}")
    config_cls, make_spec = _FAMILIES[key]
    model_config = getattr(config_cls, config)()
    if overrides:
        fields = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise LayerError(
                f"{config_cls.__name__} has no field(s) {unknown}; valid overrides: "
                f"{sorted(fields)}"
            )
        model_config = dataclasses.replace(model_config, **overrides)
    return make_spec(model_config, config)
