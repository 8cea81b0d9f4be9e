"""Your own Flax linen model through a pdjax pipeline, and back.

A small CNN with BatchNorm and Dropout, written as a linen user writes one (``__call__``
takes ``train``), classifies scikit-learn's 8x8 digits. It trains with PipeDream's
asynchronous schedule (``pipedream``: 1F1B with weight stashing, no flushes) on 3 CPU
devices, one stage per block, evaluates through the pipeline after each epoch, and finally
hands the trained variables back as the tree of the user's own ``CNN`` module (its
submodule names), which then classifies on its own.

    python examples/linen_model.py           # about a minute on 2 CPU cores
    python examples/linen_model.py --tiny    # one short epoch (what the tests run)
"""

from __future__ import annotations

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 3)  # before any device is used

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import pdjax  # noqa: E402


class ConvBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.max_pool(nn.relu(x), (2, 2), (2, 2))


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(64)(x))
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(10)(x)


class CNN(nn.Module):
    """The whole model, as the user has it: what the trained variables go back into."""

    def setup(self):
        self.block1 = ConvBlock(16)
        self.block2 = ConvBlock(32)
        self.classify = Classifier()

    def __call__(self, x, train: bool = False):
        return self.classify(self.block2(self.block1(x, train), train), train)


def loss_fn(logits, labels):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": (logits.argmax(-1) == labels).mean()}


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[..., None]
    y = data.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="one short epoch (tests)")
    args = parser.parse_args(argv)
    x_train, y_train, x_test, y_test = digits()
    epochs, size = (1, 8) if args.tiny else (5, 16)
    if args.tiny:
        x_train, y_train = x_train[:160], y_train[:160]

    # the layers, named as the user's CNN names its submodules
    layers = pdjax.sequential(
        ConvBlock(16), ConvBlock(32), Classifier(), names=["block1", "block2", "classify"]
    )
    pipe = pdjax.Pipeline(
        layers,
        pdjax.even_stages(3, 3),
        loss_fn,
        optax.adam(1e-3),
        schedule=pdjax.ScheduleSpec("pipedream"),
    )
    state = pipe.init(jax.random.key(0), x_train[:size])
    test = [(x_test[i : i + 100], y_test[i : i + 100]) for i in range(0, len(x_test), 100)]
    result: dict[str, float] = {}
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(x_train))
        stream = [
            (x_train[order[i : i + size]], y_train[order[i : i + size]])
            for i in range(0, len(order) - size + 1, size)
        ]
        state, metrics = pipe.run(state, stream)  # one stream per epoch: fill, run, drain
        result = pipe.evaluate(state, test)
        print(
            f"epoch {epoch + 1}: train loss {metrics.loss:.3f}  test loss {result['loss']:.3f}"
            f"  test accuracy {result['accuracy']:.3f}"
        )

    variables = pipe.linen_variables(state)  # {"params": {"block1": ...}, "batch_stats": ...}
    logits = jax.jit(CNN().apply)(variables, jnp.asarray(x_test))
    accuracy = float((logits.argmax(-1) == y_test).mean())
    print(f"your CNN with the trained variables: test accuracy {accuracy:.3f}")
    return {"loss": result["loss"], "accuracy": accuracy}


if __name__ == "__main__":
    main()
