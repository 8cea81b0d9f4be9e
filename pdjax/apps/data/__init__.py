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
* :func:`pdjax.apps.data.tokens.token_dataset`: a flat binary token file of any size
  (``pdjax train --dataset tokens:PATH``), read window by window as training goes.

Training reads every data set as a stream (:mod:`pdjax.apps.data.stream`: grain's
shuffled microbatches, with a position a checkpoint keeps); ``--buckets`` reads the BPE
corpus as whole documents in length buckets (:mod:`pdjax.apps.data.bucket_stream`).

Every array is numpy, so batches cost no device work until a runner places them. The
:class:`Dataset` container and its deterministic, resumable batching are in
:mod:`pdjax.apps.data.dataset` (re-exported here).

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
import platform

import numpy as np

from pdjax.apps.data.dataset import (
    Dataset,
    batches,
    eval_batches,
    generator,
    num_batches,
    resume_point,
)
from pdjax.apps.data.npz import NPZ_ARRAYS, fit_to_sample, load_npz
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

#: Token id of characters outside a capped vocabulary (``text(vocab_size=...)``).
UNK = 0

# The text corpus is cut into this many equal contiguous blocks; the test set is a
# seed-chosen subset of whole blocks, so no test window overlaps training text.
_TEXT_BLOCKS = 100
_UNK_CHAR = "\ufffd"


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
    rng = generator(seed)
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
    vocab = _vocabulary(corpus, vocab_size)
    tokens = vocab.table[np.frombuffer(corpus.encode("utf-32-le"), np.uint32)]

    block = len(tokens) // _TEXT_BLOCKS
    if block < seq_len + 1:
        raise DataError(
            f"seq_len {seq_len} is too long: the corpus's blocks hold {block} characters"
        )
    num_test = max(1, round(test_fraction * _TEXT_BLOCKS))
    test_blocks = np.sort(generator(seed).permutation(_TEXT_BLOCKS)[:num_test])
    train_blocks = np.setdiff1d(np.arange(_TEXT_BLOCKS), test_blocks)
    train = _windows(tokens, train_blocks, block, seq_len)
    test = _windows(tokens, test_blocks, block, seq_len)
    return Dataset(
        name="text",
        train_x=train[:, :-1],
        train_y=train[:, 1:],
        test_x=test[:, :-1],
        test_y=test[:, 1:],
        num_classes=len(vocab.chars),
        info={
            "source": f"pydoc_data.topics (Python {platform.python_version()})",
            "corpus_chars": len(corpus),
            "distinct_chars": vocab.distinct,
            "unk_chars": vocab.distinct - vocab.kept,
            "chars": vocab.chars,
            "seq_len": seq_len,
            "test_blocks": tuple(int(b) for b in test_blocks),
            "seed": seed,
            "test_fraction": test_fraction,
        },
    )


@dataclasses.dataclass(frozen=True)
class _Vocabulary:
    """A character vocabulary: ``chars[id]`` is the character of each id (``""`` for
    :data:`UNK` and unused ids), ``table[ord(ch)]`` the id of each character of the
    corpus; ``kept`` of its ``distinct`` characters have an id of their own."""

    chars: tuple[str, ...]
    table: np.ndarray
    distinct: int
    kept: int


def _vocabulary(corpus: str, vocab_size: int | None) -> _Vocabulary:
    """The vocabulary :func:`text` describes: :data:`UNK`, then the characters by
    descending frequency (ties by code point), cut or padded to ``vocab_size`` ids."""
    counts = collections.Counter(corpus)
    ranked = sorted(counts, key=lambda ch: (-counts[ch], ord(ch)))
    size = len(ranked) + 1 if vocab_size is None else vocab_size
    kept = ranked[: size - 1]
    chars = ("", *kept) + ("",) * (size - 1 - len(kept))
    table = np.full(max(map(ord, ranked)) + 1, UNK, np.int32)
    table[[ord(ch) for ch in kept]] = np.arange(1, len(kept) + 1, dtype=np.int32)
    return _Vocabulary(chars=chars, table=table, distinct=len(ranked), kept=len(kept))


def _windows(tokens: np.ndarray, blocks: np.ndarray, block: int, seq_len: int) -> np.ndarray:
    """The non-overlapping windows of ``seq_len + 1`` tokens, at stride ``seq_len``, of
    each of ``blocks`` (indices of the corpus's blocks of ``block`` tokens), in order."""
    per_block = (block - 1) // seq_len
    starts = np.arange(per_block) * seq_len
    offsets = np.arange(seq_len + 1)
    index = (blocks[:, None, None] * block + starts[None, :, None] + offsets).reshape(
        -1, seq_len + 1
    )
    return np.asarray(tokens[index])  # integer indexing is typed Any in numpy


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
