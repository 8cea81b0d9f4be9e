"""The :class:`Dataset` container, and deterministic, resumable batching.

Batching is a pure function of ``(seed, epoch)``: :func:`batches` shuffles the training
set with a generator seeded by both and yields batches from any index ``start``, so a
run restored from a checkpoint at global step ``s`` resumes with exactly the batches it
would have seen (see :func:`resume_point`). Batches that do not fill up are dropped, so
every training batch has the same shape and a jitted step compiles once. For
evaluation, :func:`eval_batches` covers the whole set in order, padding the last batch
and returning a mask of the real samples.

Everything here is re-exported by :mod:`pdjax.apps.data`, the module to import.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from pdjax.errors import DataError

__all__ = [
    "Dataset",
    "batches",
    "eval_batches",
    "num_batches",
    "resume_point",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held as read-only numpy arrays, or read-only lazy views of a
    file that index like them (a token file's: :mod:`pdjax.apps.data.tokens`), and a
    read-only ``info``.

    Attributes:
      name: ``"digits"``, ``"digits-flat"``, ``"text"``, or an ``.npz`` file's name.
      train_x: training inputs ``(N_train, ...)``: float32 images or int32 tokens.
      train_y: training targets: int32 labels ``(N_train,)`` or next tokens ``(N_train, T)``.
      test_x: test inputs ``(N_test, ...)``, same layout as ``train_x``.
      test_y: test targets, same layout as ``train_y``.
      num_classes: number of classes, or the vocabulary size for text (the last axis
        of the logits a model needs; alias :attr:`vocab_size`).
      info: facts about the data: source, preprocessing, and for text the vocabulary
        (``info["chars"][id]``, ``""`` for :data:`~pdjax.apps.data.UNK` and unused ids).
    """

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "info", types.MappingProxyType(dict(self.info)))
        for field in ("train_x", "train_y", "test_x", "test_y"):
            array = getattr(self, field)
            if isinstance(array, np.ndarray):  # else a read-only lazy view (a token file's)
                array.setflags(write=False)
        if len(self.train_x) != len(self.train_y) or len(self.test_x) != len(self.test_y):
            raise DataError(
                f"dataset {self.name!r}: inputs and targets differ in length "
                f"(train {len(self.train_x)} vs {len(self.train_y)}, "
                f"test {len(self.test_x)} vs {len(self.test_y)})"
            )

    @property
    def vocab_size(self) -> int:
        """The vocabulary size of a text dataset (the same number as :attr:`num_classes`)."""
        return self.num_classes

    @property
    def num_train(self) -> int:
        """Training samples (images, or token windows)."""
        return len(self.train_x)

    @property
    def num_test(self) -> int:
        """Test samples (images, or token windows)."""
        return len(self.test_x)

    def train_batches(
        self, batch_size: int, *, seed: int, epoch: int, start: int = 0
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """:func:`batches` over the training set (remainder dropped)."""
        return batches(self.train_x, self.train_y, batch_size, seed=seed, epoch=epoch, start=start)

    def test_batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """:func:`eval_batches` over the test set (padded, with a mask)."""
        return eval_batches(self.test_x, self.test_y, batch_size)


# -- batching ---------------------------------------------------------------------------------


def generator(*seeds: int) -> np.random.Generator:
    if any(not isinstance(s, (int, np.integer)) or s < 0 for s in seeds):
        raise DataError(f"seeds and epochs must be non-negative integers, got {seeds}")
    return np.random.default_rng([int(s) for s in seeds])


def _check_pair(x: np.ndarray, y: np.ndarray, batch_size: int) -> int:
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}")
    if len(x) != len(y):
        raise DataError(f"inputs and targets differ in length: {len(x)} vs {len(y)}")
    return len(x)


def num_batches(num_samples: int, batch_size: int, *, drop_last: bool = True) -> int:
    """Batches per epoch: ``num_samples // batch_size`` (rounded up if not ``drop_last``).

    >>> num_batches(1438, 32)
    44
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}")
    return num_samples // batch_size if drop_last else -(-num_samples // batch_size)


def resume_point(
    step: int, num_samples: int, batch_size: int, *, drop_last: bool = True
) -> tuple[int, int]:
    """Where training resumes after ``step`` batches: ``(epoch, start)`` for :func:`batches`.

    >>> resume_point(100, 1438, 32)  # 44 batches per epoch
    (2, 12)
    """
    per_epoch = num_batches(num_samples, batch_size, drop_last=drop_last)
    if per_epoch == 0:
        raise DataError(f"batch_size {batch_size} exceeds the {num_samples} samples")
    epoch, start = divmod(step, per_epoch)
    return epoch, start


def batches(
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    start: int = 0,
    drop_last: bool = True,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One epoch of shuffled ``(inputs, targets)`` batches.

    The order is a permutation drawn from ``numpy.random.default_rng([seed, epoch])``:
    it depends only on ``(seed, epoch)``, and each sample appears at most once per
    epoch. With ``drop_last`` (the default) the ``len(x) % batch_size`` samples left
    over after the last full batch are skipped this epoch (a different set each epoch),
    so every batch has ``batch_size`` rows; otherwise the last batch is smaller (and a
    jitted step compiles again for it).

    Args:
      x: inputs ``(N, ...)``.
      y: targets ``(N, ...)``.
      batch_size: rows per batch.
      seed: the run's data seed (a non-negative integer).
      epoch: the epoch number (a non-negative integer).
      start: index of the first batch to yield; ``start=k`` yields exactly what skipping
        ``k`` batches would (use :func:`resume_point` after a checkpoint).
      drop_last: drop the last, incomplete batch.

    Returns:
      An iterator of ``(x[idx], y[idx])`` numpy batches, ``num_batches(N, batch_size)
      - start`` of them.

    Raises:
      DataError: for a bad batch size, seed, epoch or ``start``, or mismatched lengths
        (raised at the call, before iteration).
    """
    n = _check_pair(x, y, batch_size)
    count = num_batches(n, batch_size, drop_last=drop_last)
    if not 0 <= start <= count:
        raise DataError(f"start must lie in 0..{count} (batches per epoch), got {start}")
    order = generator(seed, epoch).permutation(n)

    def generate() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for b in range(start, count):
            idx = order[b * batch_size : (b + 1) * batch_size]
            yield x[idx], y[idx]

    return generate()


def eval_batches(
    x: np.ndarray, y: np.ndarray, batch_size: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The whole set in order, as equal-shape batches with a mask of real samples.

    The last batch is padded with zeros (zero pixels, label or token 0) up to
    ``batch_size`` rows, so an evaluation step compiles once. Weight per-sample metrics
    by the mask: ``sum(metric * mask) / sum(mask)`` over all batches.

    Args:
      x: inputs ``(N, ...)``.
      y: targets ``(N, ...)``.
      batch_size: rows per batch.

    Returns:
      An iterator of ``(inputs, targets, mask)``; ``mask`` is bool ``(batch_size,)``,
      ``True`` for real rows. ``ceil(N / batch_size)`` batches.

    Raises:
      DataError: for a bad batch size or mismatched lengths.
    """
    n = _check_pair(x, y, batch_size)

    def pad(a: np.ndarray, rows: int) -> np.ndarray:
        return np.concatenate([a, np.zeros((rows, *a.shape[1:]), a.dtype)])

    def generate() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        for lo in range(0, n, batch_size):
            bx, by = x[lo : lo + batch_size], y[lo : lo + batch_size]
            mask = np.ones(batch_size, bool)
            missing = batch_size - len(bx)
            if missing:
                bx, by = pad(bx, missing), pad(by, missing)
                mask[batch_size - missing :] = False
            yield bx, by, mask

    return generate()
