"""Train your own Flax model on your own data with ``pdjax train``.

The three steps of bringing a model and a dataset to pdjax, in one file:

1. **Data**: :func:`write_dataset` saves an ``.npz`` file with the four arrays pdjax reads,
   ``x_train``, ``y_train``, ``x_test`` and ``y_test`` (scikit-learn's 8x8 digits,
   flattened to 64 features; synthetic blobs if scikit-learn is missing).
2. **Model**: :func:`build` is a model factory. It returns a ``pdjax.models.CustomModel``:
   the layers (a ``flax.linen`` MLP as ``pdjax.sequential(...)``, which pdjax cuts into
   pipeline stages), the loss, an accuracy, and a sample batch giving the input and target
   shapes. pdjax calls it with ``config=`` (the ``--config`` value) because it takes it.
3. **Train**: ``pdjax train --model examples.custom_dataset:build --dataset data.npz``
   runs it as a PipeDream pipeline over simulated CPU devices, here through
   ``pdjax.apps.cli.main([...])``, exactly as the shell command would.

Run it from the repository root::

    python examples/custom_dataset.py          # digits, 2-stage pipeline vs data parallelism
    python examples/custom_dataset.py --tiny   # a few seconds (what the tests run)
    PDJAX_EXAMPLE_TINY=1 python examples/custom_dataset.py

It prints the command it runs, one line per epoch, a summary table, and where the
metrics (``metrics.jsonl``), plots and TensorBoard files went.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pdjax
from pdjax.models import CustomModel

ROOT = Path(__file__).resolve().parent.parent
#: Hidden width per ``--config``.
WIDTHS = {"tiny": 32, "paper": 256}


# -- 1. data --------------------------------------------------------------------------------


def write_dataset(path: str | Path, *, tiny: bool = False, seed: int = 0) -> Path:
    """Writes a 10-class dataset of 64 features as ``path`` (an ``.npz`` file).

    Args:
      path: where to write it.
      tiny: keep 256 training and 128 test samples.
      seed: seeds the split (and the blobs without scikit-learn).

    Returns:
      The path.
    """
    rng = np.random.default_rng(seed)
    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = (digits.data / 16.0).astype(np.float32)  # (1797, 64), pixels in [0, 1]
        y = digits.target.astype(np.int32)
    except ImportError:  # ten Gaussian blobs in 64 dimensions
        centres = rng.normal(size=(10, 64)).astype(np.float32)
        y = rng.integers(0, 10, size=1800).astype(np.int32)
        x = centres[y] + 0.5 * rng.normal(size=(1800, 64)).astype(np.float32)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    x_test, y_test, x_train, y_train = x[:n_test], y[:n_test], x[n_test:], y[n_test:]
    if tiny:
        x_train, y_train, x_test, y_test = x_train[:256], y_train[:256], x_test[:128], y_test[:128]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return path


# -- 2. model -------------------------------------------------------------------------------


class Block(nn.Module):
    """Dense + ReLU: one layer of the pipeline (a stage holds one or more)."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.relu(nn.Dense(self.features)(x))


def loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy: the scalar pdjax differentiates, per microbatch."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Fraction of the batch classified right (reported as the test accuracy)."""
    return jnp.mean(jnp.argmax(logits, axis=-1) == labels)


def build(config: str = "tiny") -> CustomModel:
    """The model factory ``--model examples.custom_dataset:build`` names.

    Args:
      config: ``tiny`` (hidden width 32) or ``paper`` (256); pdjax passes ``--config``.

    Returns:
      The layers, loss, accuracy and a sample batch of 64 float features and int labels.
    """
    if config not in WIDTHS:
        raise pdjax.LayerError(f"examples.custom_dataset:build takes --config {sorted(WIDTHS)}")
    width = WIDTHS[config]
    layers = pdjax.sequential(
        Block(width), Block(width), Block(width), nn.Dense(10), names=["b0", "b1", "b2", "logits"]
    )
    sample = (np.zeros((2, 64), np.float32), np.zeros((2,), np.int32))
    return CustomModel(
        layers=layers, loss=loss, sample_batch=sample, accuracy=accuracy, num_classes=10
    )


# -- 3. train -------------------------------------------------------------------------------


def command(data: Path, out: Path, *, tiny: bool) -> list[str]:
    """The ``pdjax`` arguments this example runs."""
    argv = ["train", "--model", "examples.custom_dataset:build", "--dataset", str(data)]
    argv += ["--schedule", "pipedream", "--devices", "2", "--out", str(out)]
    if tiny:
        argv += ["--plan", "even", "--epochs", "2", "--batch-size", "32", "--microbatches", "2"]
        argv += ["--lr", "1e-2", "--no-plots"]
    else:
        argv += ["--plan", "auto", "--straight", "--epochs", "10", "--batch-size", "64"]
        argv += ["--microbatches", "4"]
        argv += ["--lr", "3e-3", "--target-accuracy", "0.95", "--compare", "dp"]
    try:
        import tensorboardX  # noqa: F401

        argv += ["--tensorboard", str(out / "tensorboard")]
    except ImportError:
        pass
    return argv


def main(argv: list[str] | None = None) -> int:
    """Writes the dataset, trains the model on it with ``pdjax train`` and prints the
    last epoch of each run; returns ``pdjax``'s exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        default=os.environ.get("PDJAX_EXAMPLE_TINY", "") not in ("", "0"),
        help="a few seconds: 256 samples, 2 epochs, no plots (or set PDJAX_EXAMPLE_TINY=1)",
    )
    parser.add_argument("--data", default="/tmp/pdjax-example/digits64.npz", help="the .npz")
    parser.add_argument("--out", default="out/custom_dataset", help="pdjax train --out")
    args = parser.parse_args(argv)

    data = write_dataset(args.data, tiny=args.tiny)
    print(f"wrote {data}: x_train, y_train, x_test, y_test")
    # `pdjax train` imports examples.custom_dataset with the current directory on the
    # path; from elsewhere, the repository root has to be there.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    out = Path(args.out)
    pdjax_args = command(data, out, tiny=args.tiny)
    print("$ pdjax " + shlex.join(pdjax_args), flush=True)

    from pdjax.apps.cli import main as pdjax_main

    status = pdjax_main(pdjax_args)
    if status == 0:
        last: dict[str, dict] = {}
        for line in (out / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            last[record["run"]] = record
        for run, r in last.items():
            print(
                f"{run}: epoch {r['epoch']}, train loss {r['train_loss']:.4f}, "
                f"test accuracy {r['test_accuracy']:.3f}"
            )
    return status


if __name__ == "__main__":
    sys.exit(main())
