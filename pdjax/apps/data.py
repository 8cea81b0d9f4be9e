"""Offline datasets for real training runs, and deterministic, resumable batching.

Nothing here downloads anything. Two datasets ship with the software pdjax already
depends on, and :func:`load_npz` reads your own:

* :func:`digits`: scikit-learn's bundled ``load_digits`` (1797 grey 8x8 images of the
  digits 0-9), for the ``cnn`` (``(B, 8, 8, 1)``) and ``mlp`` (``(B, 64)``) models.
  Needs the optional dependency ``scikit-learn`` (``pip install 'pdjax[data]'``).
* :func:`text`: a character-level language-modelling corpus made of the documentation
  strings that ship with CPython (``pydoc_data.topics.topics``), for ``gpt`` and
  ``awd_lm``. Its exact content (and so its size) depends on the Python version.
* :func:`load_npz`: an ``.npz`` file (``numpy.savez``) holding ``x_train``, ``y_train``,
  ``x_test`` and ``y_test``; :func:`fit_to_sample` checks it against a model's sample
  batch (``pdjax train --dataset path.npz``).

Every array is numpy, so batches cost no device work until a runner places them.

Batching is a pure function of ``(seed, epoch)``: :func:`batches` shuffles the training
set with a generator seeded by both and yields batches from any index ``start``, so a
run restored from a checkpoint at global step ``s`` resumes with exactly the batches it
would have seen (see :func:`resume_point`). Batches that do not fill up are dropped, so
every training batch has the same shape and a jitted step compiles once. For
evaluation, :func:`eval_batches` covers the whole set in order, padding the last batch
and returning a mask of the real samples.

>>> ds = digits()
>>> ds.train_x.shape, ds.test_x.shape, ds.num_classes
((1438, 8, 8, 1), (359, 8, 8, 1), 10)
>>> x, y = next(ds.train_batches(32, seed=0, epoch=0))
>>> x.shape, x.dtype, y.shape, y.dtype
((32, 8, 8, 1), dtype('float32'), (32,), dtype('int32'))
"""

from __future__ import annotations

import collections
import dataclasses
import os
import platform
import types
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pdjax.errors import DataError

__all__ = [
    "NPZ_ARRAYS",
    "UNK",
    "Dataset",
    "batches",
    "decode",
    "digits",
    "eval_batches",
    "fit_to_sample",
    "load_npz",
    "num_batches",
    "resume_point",
    "text",
]

#: The arrays an ``.npz`` dataset holds (:func:`load_npz`).
NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")

#: Token id of characters outside a capped vocabulary (``text(vocab_size=...)``).
UNK = 0

# The text corpus is cut into this many equal contiguous blocks; the test set is a
# seed-chosen subset of whole blocks, so no test window overlaps training text.
_TEXT_BLOCKS = 100
_UNK_CHAR = "\ufffd"


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held as read-only numpy arrays (and a read-only ``info``).

    Attributes:
      name: ``"digits"``, ``"digits-flat"``, ``"text"``, or an ``.npz`` file's name.
      train_x: training inputs ``(N_train, ...)``: float32 images or int32 tokens.
      train_y: training targets: int32 labels ``(N_train,)`` or next tokens ``(N_train, T)``.
      test_x: test inputs ``(N_test, ...)``, same layout as ``train_x``.
      test_y: test targets, same layout as ``train_y``.
      num_classes: number of classes, or the vocabulary size for text (the last axis
        of the logits a model needs; alias :attr:`vocab_size`).
      info: facts about the data: source, preprocessing, and for text the vocabulary
        (``info["chars"][id]``, ``""`` for :data:`UNK` and unused ids).
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
            getattr(self, field).setflags(write=False)
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


# -- datasets -------------------------------------------------------------------------------


def _check_fraction(test_fraction: float) -> None:
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must lie in (0, 1), got {test_fraction}")


def digits(seed: int = 0, test_fraction: float = 0.2, *, flatten: bool = False) -> Dataset:
    """scikit-learn's 8x8 digits, split into train and test sets, stratified by class.

    Pixels (integers 0-16) are divided by 16, so inputs are float32 in ``[0, 1]`` (not
    standardised). Each class's images are shuffled with ``seed`` and its first
    ``round(test_fraction * n_class)`` go to the test set, so both sets keep the class
    balance; each set is kept in the original order. With the defaults: 1438 training
    and 359 test images.

    Args:
      seed: seed of the split (a non-negative integer).
      test_fraction: share of each class held out, in ``(0, 1)``.
      flatten: give inputs as ``(N, 64)`` vectors (for the ``mlp`` model) instead of
        ``(N, 8, 8, 1)`` images (for ``cnn``).

    Returns:
      A :class:`Dataset` named ``"digits"`` (``"digits-flat"``) with 10 classes and
      int32 labels ``(N,)``.

    Raises:
      DataError: for a bad ``test_fraction`` or ``seed``, or if scikit-learn is missing.
    """
    _check_fraction(test_fraction)
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise DataError(
            "digits() needs scikit-learn (its data ships with it, nothing is downloaded); "
            "install it with: pip install 'pdjax[data]'"
        ) from e
    raw = load_digits()
    images = (raw.images.astype(np.float32) / np.float32(16.0))[..., None]
    labels = raw.target.astype(np.int32)
    rng = _generator(seed)
    test = []
    for c in range(10):
        members = np.flatnonzero(labels == c)
        chosen = rng.permutation(members)[: round(test_fraction * len(members))]
        test.append(chosen)
    is_test = np.zeros(len(labels), bool)
    is_test[np.concatenate(test)] = True
    if flatten:
        images = images.reshape(len(images), -1)
    return Dataset(
        name="digits-flat" if flatten else "digits",
        train_x=images[~is_test],
        train_y=labels[~is_test],
        test_x=images[is_test],
        test_y=labels[is_test],
        num_classes=10,
        info={
            "source": "sklearn.datasets.load_digits",
            "scaling": "pixel / 16, in [0, 1]",
            "seed": seed,
            "test_fraction": test_fraction,
        },
    )


def _corpus() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


def text(
    seq_len: int = 16,
    seed: int = 0,
    test_fraction: float = 0.1,
    *,
    vocab_size: int | None = None,
) -> Dataset:
    """Character-level language-model windows of CPython's bundled documentation.

    The corpus is ``pydoc_data.topics.topics`` joined with ``"\\n"`` in sorted key order
    (465k characters, 103 distinct ones, on CPython 3.11). It is cut into 100 equal
    contiguous blocks; ``round(test_fraction * 100)`` of them, chosen with ``seed``, are
    the test text, the rest the training text. Each block yields non-overlapping windows
    of ``seq_len + 1`` characters at stride ``seq_len`` (inputs: the first ``seq_len``,
    targets: the last ``seq_len``, so ``targets[:, t] = inputs[:, t + 1]``); no window
    crosses a block boundary, so test windows hold only unseen text.

    The vocabulary is built from the whole corpus (so it does not depend on ``seed``):
    id 0 is :data:`UNK`, then the characters by descending frequency (ties by code
    point). Without a cap every character has an id: ``vocab_size`` = distinct + 1
    (104 on CPython 3.11). With ``vocab_size=V`` the ``V - 1`` most frequent characters
    keep ids and the rest map to :data:`UNK`; a ``V`` above distinct + 1 leaves the top
    ids unused. Build the model to match, e.g.
    ``get_model("gpt", vocab_size=ds.vocab_size)`` (its tiny context of 16 allows
    ``seq_len <= 16``), or pass ``vocab_size=spec.num_classes`` here.

    Args:
      seq_len: tokens per window ``T``, at least 1.
      seed: seed of the block split (a non-negative integer).
      test_fraction: share of the blocks held out, in ``(0, 1)``.
      vocab_size: the vocabulary size to produce (at least 2), or ``None`` for all.

    Returns:
      A :class:`Dataset` named ``"text"``: int32 inputs and targets ``(N, T)``,
      ``num_classes`` the vocabulary size, ``info["chars"]`` the character of each id.

    Raises:
      DataError: for a bad ``seq_len``, ``vocab_size``, ``test_fraction`` or ``seed``.
    """
    _check_fraction(test_fraction)
    if seq_len < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}")
    if vocab_size is not None and vocab_size < 2:
        raise DataError(f"vocab_size must be at least 2 (UNK and one character), got {vocab_size}")
    corpus = _corpus()
    counts = collections.Counter(corpus)
    ranked = sorted(counts, key=lambda ch: (-counts[ch], ord(ch)))
    size = len(ranked) + 1 if vocab_size is None else vocab_size
    kept = ranked[: size - 1]
    chars = ("", *kept) + ("",) * (size - 1 - len(kept))
    table = np.full(max(map(ord, ranked)) + 1, UNK, np.int32)
    table[[ord(ch) for ch in kept]] = np.arange(1, len(kept) + 1, dtype=np.int32)
    tokens = table[np.frombuffer(corpus.encode("utf-32-le"), np.uint32)]

    block = len(tokens) // _TEXT_BLOCKS
    if block < seq_len + 1:
        raise DataError(
            f"seq_len {seq_len} is too long: the corpus's blocks hold {block} characters"
        )
    num_test = max(1, round(test_fraction * _TEXT_BLOCKS))
    test_blocks = np.sort(_generator(seed).permutation(_TEXT_BLOCKS)[:num_test])
    per_block = (block - 1) // seq_len
    starts = np.arange(per_block) * seq_len
    offsets = np.arange(seq_len + 1)

    def windows(blocks: np.ndarray) -> np.ndarray:
        index = (blocks[:, None, None] * block + starts[None, :, None] + offsets).reshape(
            -1, seq_len + 1
        )
        return np.asarray(tokens[index])  # integer indexing is typed Any in numpy

    train_blocks = np.setdiff1d(np.arange(_TEXT_BLOCKS), test_blocks)
    train, test = windows(train_blocks), windows(test_blocks)
    return Dataset(
        name="text",
        train_x=train[:, :-1],
        train_y=train[:, 1:],
        test_x=test[:, :-1],
        test_y=test[:, 1:],
        num_classes=size,
        info={
            "source": f"pydoc_data.topics (Python {platform.python_version()})",
            "corpus_chars": len(corpus),
            "distinct_chars": len(ranked),
            "unk_chars": len(ranked) - len(kept),
            "chars": chars,
            "seq_len": seq_len,
            "test_blocks": tuple(int(b) for b in test_blocks),
            "seed": seed,
            "test_fraction": test_fraction,
        },
    )


def load_npz(path: str | os.PathLike[str]) -> Dataset:
    """A dataset of your own: an ``.npz`` file with ``x_train``, ``y_train``, ``x_test`` and
    ``y_test``, as ``numpy.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)``
    writes it.

    Inputs and targets are single numeric arrays with one row per sample; a split's inputs
    and targets have the same number of rows (at least one), and both splits the same row
    shape. 64-bit floats become float32 and integers int32 (JAX computes in 32 bits);
    :func:`fit_to_sample` makes them the model's dtypes. Other arrays in the file are
    ignored (``info["ignored"]``), except ``num_classes``, a scalar that overrides the class
    count otherwise read from integer targets (their largest value + 1).

    Args:
      path: the ``.npz`` file.

    Returns:
      A :class:`Dataset` named after the file; ``info["path"]`` is its absolute path.

    Raises:
      DataError: the file is missing or not an ``.npz`` of plain arrays, an array is
        missing, not numeric, or has the wrong number of rows or row shape; the message
        names the file and the arrays.

    >>> import tempfile, numpy as np
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     np.savez(f"{folder}/mine.npz", x_train=np.ones((8, 3)), y_train=np.arange(8) % 4,
    ...              x_test=np.ones((2, 3)), y_test=np.arange(2))
    ...     ds = load_npz(f"{folder}/mine.npz")
    >>> ds.train_x.dtype, ds.train_y.dtype, ds.num_train, ds.num_test, ds.num_classes
    (dtype('float32'), dtype('int32'), 8, 2, 4)
    """
    path = Path(path)
    form = (
        "an .npz dataset is written with np.savez(path, x_train=..., y_train=..., "
        "x_test=..., y_test=...)"
    )
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise DataError(f"dataset file {str(path)!r} {what}; {form}")
    arrays: dict[str, np.ndarray] = {}
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a .npy file: one array
            raise DataError(f"dataset file {str(path)!r} holds a single array (.npy); {form}")
        with loaded as f:
            names = list(f.files)
            missing = [a for a in NPZ_ARRAYS if a not in names]
            if missing:
                raise DataError(
                    f"dataset file {str(path)!r} has no {', '.join(missing)} (it holds "
                    f"{', '.join(names) or 'no arrays'}); {form}"
                )
            for name in (*NPZ_ARRAYS, "num_classes"):
                if name in names:
                    arrays[name] = f[name]
    except DataError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        reason = str(e)
        if "pickle" in reason.lower() or "object arrays" in reason.lower():
            reason = "it holds Python objects (pickled), not plain numeric arrays"
        raise DataError(f"cannot read dataset file {str(path)!r}: {reason}; {form}") from e
    ignored = sorted(set(names) - set(NPZ_ARRAYS) - {"num_classes"})
    for name in NPZ_ARRAYS:
        a = arrays[name]
        numeric = a.dtype.kind in "biuf" or a.dtype.name == "bfloat16"
        if a.ndim == 0 or not numeric:
            raise DataError(
                f"dataset file {str(path)!r}: {name} is a {a.dtype}{list(a.shape)} array; it "
                "needs one row per sample (a leading axis) and a numeric dtype"
            )
        arrays[name] = _to_32_bits(a, name, path)
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if len(x) != len(y):
            raise DataError(
                f"dataset file {str(path)!r}: x_{split} has {len(x)} rows but y_{split} has "
                f"{len(y)}; each sample needs an input and a target"
            )
        if len(x) == 0:
            raise DataError(f"dataset file {str(path)!r}: x_{split} and y_{split} are empty")
    for part in ("x", "y"):
        train, test = arrays[f"{part}_train"], arrays[f"{part}_test"]
        if train.shape[1:] != test.shape[1:]:
            raise DataError(
                f"dataset file {str(path)!r}: {part}_train has rows of shape {train.shape[1:]} "
                f"but {part}_test {test.shape[1:]}; both splits need the same row shape"
            )
    num_classes = _class_count(arrays, path)
    return Dataset(
        name=path.name,
        train_x=arrays["x_train"],
        train_y=arrays["y_train"],
        test_x=arrays["x_test"],
        test_y=arrays["y_test"],
        num_classes=num_classes,
        info={
            "source": "npz",
            "path": str(path.resolve()),
            "arrays": {n: f"{arrays[n].dtype}{list(arrays[n].shape)}" for n in NPZ_ARRAYS},
            "ignored": tuple(ignored),
        },
    )


def _to_32_bits(a: np.ndarray, name: str, path: Path) -> np.ndarray:
    """64-bit floats as float32, integers and booleans as int32 (checked to fit)."""
    if a.dtype.kind == "f" and a.dtype.itemsize > 4:
        return a.astype(np.float32)
    if a.dtype.kind in "biu" and a.dtype != np.int32:
        if a.size and a.dtype.kind != "b":
            lo, hi = int(a.min()), int(a.max())
            info = np.iinfo(np.int32)
            if lo < info.min or hi > info.max:
                raise DataError(
                    f"dataset file {str(path)!r}: {name} holds integers {lo}..{hi}, beyond "
                    "int32; store them as floats or smaller integers"
                )
        return a.astype(np.int32)
    return a


def _class_count(arrays: Mapping[str, np.ndarray], path: Path) -> int:
    """Classes of integer targets (largest + 1; 0 for float targets or negative labels),
    or the file's ``num_classes``."""
    ys = (arrays["y_train"], arrays["y_test"])
    count = 0
    if all(y.dtype.kind in "biu" for y in ys) and min(int(y.min()) for y in ys) >= 0:
        count = max(int(y.max()) for y in ys) + 1
    given = arrays.get("num_classes")
    if given is None:
        return count
    if given.ndim != 0 or given.dtype.kind not in "iu" or int(given) < count:
        raise DataError(
            f"dataset file {str(path)!r}: num_classes must be one integer >= {count} (the "
            f"largest label + 1), got {given!r}"
        )
    return int(given)


def fit_to_sample(dataset: Dataset, sample: Any, *, num_classes: int = 0) -> Dataset:
    """``dataset`` checked against a model's sample batch ``(x, y)`` and cast to its dtypes.

    Rows of ``x`` and ``y`` must have the shapes of the sample's rows. Values are cast to
    the sample's dtypes where nothing is lost in meaning (integers or booleans to floats,
    float32 to bfloat16, one integer type to another); floats into integers are refused.
    With ``num_classes > 0`` and integer targets, every label must lie in
    ``[0, num_classes)``.

    Args:
      dataset: the dataset.
      sample: the model's ``(x, y)``, each one array with a leading batch axis (e.g.
        ``spec.sample_batch(1)``).
      num_classes: the model's classes (or vocabulary), 0 for unknown.

    Returns:
      The dataset with arrays of the sample's dtypes (the same object if nothing changed).

    Raises:
      DataError: naming the dataset and the arrays that do not fit, and what the model
        takes.
    """
    src = dataset.info.get("path", dataset.name)
    names = {"x": "x_train and x_test", "y": "y_train and y_test"}
    cast: dict[str, np.ndarray] = {}
    for part, want in zip("xy", sample, strict=True):
        leaves = [np.asarray(leaf) for leaf in _leaves(want)]
        if len(leaves) != 1:
            raise DataError(
                f"dataset {src!r}: the model's sample batch has {len(leaves)} arrays as {part} "
                f"({type(want).__name__}); a dataset gives {part} as one array"
            )
        want_a = leaves[0]
        for split in ("train", "test"):
            have = getattr(dataset, f"{split}_{part}")
            if have.shape[1:] != want_a.shape[1:]:
                raise DataError(
                    f"dataset {src!r}: {part}_{split} has rows of shape {have.shape[1:]} "
                    f"({have.dtype}) but the model's sample batch {part} has rows of shape "
                    f"{want_a.shape[1:]} ({want_a.dtype}); reshape {names[part]} to "
                    f"(N, {', '.join(map(str, want_a.shape[1:]))}) or change the model"
                )
            if have.dtype != want_a.dtype:
                if have.dtype.kind == "f" and want_a.dtype.kind in "biu":
                    raise DataError(
                        f"dataset {src!r}: {part}_{split} holds {have.dtype} values but the "
                        f"model takes {want_a.dtype} {part} (integers: labels or tokens); "
                        f"store {names[part]} as integers"
                    )
                cast[f"{split}_{part}"] = have.astype(want_a.dtype)
    result = dataset
    if cast:
        result = dataclasses.replace(
            dataset,
            train_x=cast.get("train_x", dataset.train_x),
            train_y=cast.get("train_y", dataset.train_y),
            test_x=cast.get("test_x", dataset.test_x),
            test_y=cast.get("test_y", dataset.test_y),
        )
    if num_classes > 0:
        for split in ("train", "test"):
            y = getattr(result, f"{split}_y")
            if y.dtype.kind in "biu" and y.size and (y.min() < 0 or y.max() >= num_classes):
                raise DataError(
                    f"dataset {src!r}: y_{split} holds labels {int(y.min())}..{int(y.max())} "
                    f"but the model has {num_classes} classes (labels 0..{num_classes - 1})"
                )
        if result.num_classes != num_classes:
            result = dataclasses.replace(result, num_classes=num_classes)
    return result


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, np.ndarray) or hasattr(tree, "shape"):
        return [tree]
    if isinstance(tree, Mapping):
        return [leaf for v in tree.values() for leaf in _leaves(v)]
    if isinstance(tree, list | tuple):
        return [leaf for v in tree for leaf in _leaves(v)]
    return [tree]


def decode(dataset: Dataset, tokens: np.ndarray) -> str:
    """Turns token ids ``(T,)`` of a :func:`text` dataset back into a string.

    :data:`UNK` and unused ids read as ``"\\ufffd"``.

    >>> ds = text(seq_len=8)
    >>> decode(ds, ds.train_x[0])
    'The "ass'
    """
    chars = dataset.info.get("chars")
    if chars is None:
        raise DataError(f"dataset {dataset.name!r} has no vocabulary; decode() is for text()")
    return "".join(chars[t] or _UNK_CHAR for t in np.asarray(tokens).reshape(-1).tolist())


# -- batching ---------------------------------------------------------------------------------


def _generator(*seeds: int) -> np.random.Generator:
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
    order = _generator(seed, epoch).permutation(n)

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
