"""A whole Flax ResNet with BatchNorm through a pdjax pipeline: ``split_model``, no wrappers.

The model is written the way Flax's ImageNet example writes its ``ResNet``: one compact
body, BatchNorm switched by the ``train`` argument (``use_running_average=not train``),
the blocks built from ``functools.partial`` conv and norm factories, a loop over the stages
and blocks. ``pdjax.split_model`` cuts it before each block and passes ``train`` per call;
the pipeline trains it with ``1f1b`` on 3 CPU devices on scikit-learn's 8x8 digits, the
BatchNorm statistics come back with the parameters, and the trained variables are the
model's own tree: ``model.apply(variables, x, train=False)`` runs them as they are.

    python examples/split_resnet.py           # about a minute on 2 CPU cores
    python examples/split_resnet.py --tiny    # 2 steps (what the tests run)
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 3)  # before any device is used

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import pdjax  # noqa: E402

ModuleDef = Any


class ResNetBlock(nn.Module):
    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable[..., Any]
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    act: Callable[..., Any] = nn.relu

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
        )
        x = conv(self.num_filters, (3, 3), name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(
                    self.num_filters * 2**i, strides=strides, conv=conv, norm=norm, act=self.act
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


def loss_fn(logits, labels):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": (logits.argmax(-1) == labels).mean()}


def digits(batch: int, steps: int) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
    """scikit-learn's 8x8 digits as NHWC images in [0, 1]: training batches, test batches."""
    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[..., None]
    labels = data.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    images, labels = images[order], labels[order]
    train_x, train_y, test_x, test_y = images[:1500], labels[:1500], images[1500:], labels[1500:]
    rng = np.random.default_rng(1)
    train = []
    for _ in range(steps):
        pick = rng.choice(len(train_y), batch, replace=False)
        train.append((train_x[pick], train_y[pick]))
    test = [(test_x[i : i + batch], test_y[i : i + batch]) for i in range(0, 256, batch)]
    return train, test


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a few steps (tests)")
    args = parser.parse_args(argv)
    steps = 2 if args.tiny else 120
    model = ResNet(stage_sizes=(1, 1, 1), block_cls=ResNetBlock, num_classes=10, num_filters=8)
    train, test = digits(64, steps)

    layers = pdjax.split_model(model, train[0][0][:8])  # cut before each ResNetBlock
    print(f"layers {list(layers.names)}")
    pipe = pdjax.Pipeline(
        layers,
        pdjax.even_stages(len(layers), 3),
        loss_fn,
        optax.sgd(0.1, momentum=0.9),
        schedule=pdjax.ScheduleSpec("1f1b", microbatches=2),
    )
    state = pipe.init(jax.random.key(0), train[0][0][:8])
    for step, batch in enumerate(train, 1):
        state, metrics = pipe.step(state, batch)
        if step % max(1, steps // 5) == 0 or step == steps:
            print(f"step {step:4d}  loss {metrics.loss:.3f}")
    result = pipe.evaluate(state, test)
    print(f"test: loss {result['loss']:.3f}  accuracy {result['accuracy']:.3f}")

    variables = layers.model_variables(pipe.variables(state))  # params and batch_stats
    x, y = test[0]
    logits = jax.jit(functools.partial(model.apply, train=False))(variables, jnp.asarray(x))
    own, _ = loss_fn(logits, jnp.asarray(y))
    piped = pipe.evaluate(state, [test[0]])["loss"]
    print(f"first test batch: your model {float(own):.4f}, the pipeline {piped:.4f}")
    return {"loss": result["loss"], "accuracy": result["accuracy"]}


if __name__ == "__main__":
    main()
