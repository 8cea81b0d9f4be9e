"""Datasets of your own: an ``.npz`` file read and checked (:func:`load_npz`), and any
dataset checked against a model's sample batch and cast to its dtypes (:func:`fit_to_sample`).

Everything here is re-exported by :mod:`pdjax.apps.data`, the module to import.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pdjax.apps.data.dataset import Dataset
from pdjax.errors import DataError

__all__ = ["MAX_VALUE", "NPZ_ARRAYS", "fit_to_sample", "load_npz"]

#: The arrays an ``.npz`` dataset holds (:func:`load_npz`).
NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")

# Ends every message about a file that is not an .npz dataset: how to write one.
_FORM = (
    "an .npz dataset is written with np.savez(path, x_train=..., y_train=..., "
    "x_test=..., y_test=...)"
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
        missing, not numeric, or has the wrong number of rows or row shape, or a float in
        it is NaN, infinite or above :data:`MAX_VALUE` in magnitude (the message names the
        first such value and its index); the message names the file and the arrays.

    >>> import tempfile, numpy as np
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     np.savez(f"{folder}/mine.npz", x_train=np.ones((8, 3)), y_train=np.arange(8) % 4,
    ...              x_test=np.ones((2, 3)), y_test=np.arange(2))
    ...     ds = load_npz(f"{folder}/mine.npz")
    >>> ds.train_x.dtype, ds.train_y.dtype, ds.num_train, ds.num_test, ds.num_classes
    (dtype('float32'), dtype('int32'), 8, 2, 4)
    """
    path = Path(path)
    arrays, names = _read_npz(path)
    ignored = sorted(set(names) - set(NPZ_ARRAYS) - {"num_classes"})
    arrays = _in_32_bits(arrays, path)
    _check_rows(arrays, path)
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


def _read_npz(path: Path) -> tuple[dict[str, np.ndarray], list[str]]:
    """The file's :data:`NPZ_ARRAYS` (and ``num_classes`` if present), and the names of
    all the arrays it holds."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise DataError(f"dataset file {str(path)!r} {what}; {_FORM}")
    arrays: dict[str, np.ndarray] = {}
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a .npy file: one array
            raise DataError(f"dataset file {str(path)!r} holds a single array (.npy); {_FORM}")
        with loaded as f:
            names = list(f.files)
            missing = [a for a in NPZ_ARRAYS if a not in names]
            if missing:
                raise DataError(
                    f"dataset file {str(path)!r} has no {', '.join(missing)} (it holds "
                    f"{', '.join(names) or 'no arrays'}); {_FORM}"
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
        raise DataError(f"cannot read dataset file {str(path)!r}: {reason}; {_FORM}") from e
    return arrays, names


def _in_32_bits(arrays: Mapping[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """``arrays`` with each of :data:`NPZ_ARRAYS` checked to be numeric with a leading
    axis, and cast to 32 bits (:func:`_to_32_bits`)."""
    out = dict(arrays)
    for name in NPZ_ARRAYS:
        a = out[name]
        numeric = a.dtype.kind in "biuf" or a.dtype.name == "bfloat16"
        if a.ndim == 0 or not numeric:
            raise DataError(
                f"dataset file {str(path)!r}: {name} is a {a.dtype}{list(a.shape)} array; it "
                "needs one row per sample (a leading axis) and a numeric dtype"
            )
        if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
            _check_float_values(a, name, path)
        out[name] = _to_32_bits(a, name, path)
    return out


#: The largest magnitude a float in an ``.npz`` dataset may have. Data for a network is
#: scaled to about 1; values past 1e20 are a unit mistake or a sentinel, and arithmetic on
#: them in float32 (a square, a sum over a batch: float32 ends at 3.4e38) overflows to inf,
#: which would surface as a diverged run.
MAX_VALUE = 1e20


def _check_float_values(a: np.ndarray, name: str, path: Path) -> None:
    """Refuses NaN, infinities and magnitudes above :data:`MAX_VALUE` in ``a``, naming the
    first one (its index and value), before it is cast to 32 bits (where a float64 above
    float32's range would become an infinity)."""
    flat = a.reshape(-1)
    first, count = -1, 0
    step = 1 << 20  # checked in float64 a million values at a time (bounded memory)
    for lo in range(0, flat.size, step):
        bad = ~(np.abs(flat[lo : lo + step].astype(np.float64)) <= MAX_VALUE)  # NaN: bad
        if bad.any():
            first = lo + int(np.argmax(bad)) if first < 0 else first
            count += int(bad.sum())
    if first < 0:
        return
    index = tuple(int(i) for i in np.unravel_index(first, a.shape))
    value = float(flat[first])
    what = "NaN" if np.isnan(value) else "infinite" if np.isinf(value) else "too large"
    raise DataError(
        f"dataset file {str(path)!r}: {name}[{', '.join(map(str, index))}] is {value!r} "
        f"({what}; {count} value{'s' if count > 1 else ''} of {name} out of bounds): every "
        f"float must be finite with |x| <= {MAX_VALUE:g}, since data for a network is scaled "
        "to about 1 and float32 arithmetic on larger values overflows to inf; remove or "
        "impute the missing values and rescale the data"
    )


def _check_rows(arrays: Mapping[str, np.ndarray], path: Path) -> None:
    """Each split has as many targets as inputs (at least one), and both splits the same
    row shapes."""
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
