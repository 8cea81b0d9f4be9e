"""Sequence-length buckets for training: the BPE corpus as whole documents padded to the
largest bucket (:func:`bucketed_text`), and an endless, resumable stream of one-bucket
batches cropped to their bucket's length (:class:`BucketStream`).

Why one array at the largest length and a crop: padding is on the right and the models
are causal, so no real position ever attends to a pad, and an example padded to the
largest bucket and cropped to the smallest bucket ``L`` that holds it is exactly the
example padded to ``L`` (:func:`pdjax.apps.data.bpe.bucket_examples`). The dataset so
stays one :class:`~pdjax.apps.data.dataset.Dataset` (what checkpoints, evaluation and
:func:`~pdjax.apps.data.stream.split_identity` know), while training runs each batch at
its bucket's length, one program set per length.

The order is :meth:`pdjax.apps.data.bpe.Buckets.batches`', pass after pass: in pass
``p`` each bucket ``i``'s examples are shuffled with ``(seed, p, i)`` and cut into full
batches (the remainder waits for another pass, reshuffled), the batches of all buckets are
shuffled together with ``(seed, p)``, and each batch is cut into ``microbatches``
microbatches of consecutive rows. The stream's position is the number of microbatches
taken, which is all its state: the order is a pure function of it.

With ``token_weights`` each microbatch's targets are ``(targets, weight)``, the weight a
float32 scalar, ``microbatches * real(microbatch) / real(batch)`` (real: targets ``>= 0``),
so that the mean over a batch's microbatches of the weighted per-microbatch mean loss
(:func:`pdjax.apps.train.token_loss.token_weighted`) is the mean over the batch's real
tokens, every token counting the same whichever microbatch it landed in.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np

from pdjax.apps.data.bpe import (
    DEFAULT_VOCAB_SIZE,
    IGNORE,
    BPETokenizer,
    Buckets,
    bucket_examples,
    documents,
    split_documents,
    text_bpe_buckets,
)
from pdjax.apps.data.dataset import Dataset, generator
from pdjax.apps.data.stream import saved_position
from pdjax.errors import DataError

__all__ = [
    "BUCKETS_NAME",
    "BucketInfo",
    "BucketStream",
    "bucket_counts",
    "bucketed_text",
    "token_weights",
]

#: The name of :func:`bucketed_text`'s dataset (not the packed ``"text-bpe"``: a
#: checkpoint of one must not resume on the other).
BUCKETS_NAME = "text-bpe-buckets"

#: What :func:`bucketed_text` says of its data (also its dataset's ``info``): the keys of
#: :func:`pdjax.apps.data.bpe.text_bpe_buckets`' info, plus ``"lengths"``, ``"padding"``,
#: ``"cut_documents"`` and ``"longest_document"`` (see :func:`bucketed_text`).
BucketInfo: TypeAlias = dict[str, Any]


def _bucket_lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    """``lengths`` checked as bucket lengths (positive integers, strictly ascending) by
    bpe's own check, which an empty :func:`bucket_examples` runs and nothing else."""
    return bucket_examples([], lengths, pad_id=0).lengths


def _padded(buckets: Buckets, width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Every example of ``buckets``, bucket by bucket in order, padded on the right to
    ``width`` positions: int32 ``(inputs, targets)`` of shape ``(N, width)``."""
    n = buckets.num_examples
    x = np.full((n, width), pad_id, np.int32)
    y = np.full((n, width), IGNORE, np.int32)
    row = 0
    for b in buckets.buckets:
        x[row : row + len(b.inputs), : b.length] = b.inputs
        y[row : row + len(b.inputs), : b.length] = b.targets
        row += len(b.inputs)
    return x, y


def _real_positions(targets: np.ndarray) -> np.ndarray:
    """int32 ``(N,)``: each row's real positions (targets ``>= 0``)."""
    out: np.ndarray = np.asarray(targets >= 0).sum(axis=1).astype(np.int32)
    return out


def bucketed_text(
    lengths: Sequence[int],
    *,
    seed: int,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    test_fraction: float = 0.1,
    cache_dir: str | os.PathLike[str] | None = None,
    cache: bool = True,
) -> tuple[Dataset, BucketInfo]:
    """The text-bpe corpus as whole-document examples, each padded to the largest bucket.

    The examples are :func:`~pdjax.apps.data.bpe.text_bpe_buckets`' (the same document
    split and tokenizer as :func:`~pdjax.apps.data.bpe.text_bpe`; each document framed
    by ``<|endoftext|>``; a document longer than the largest bucket is cut into pieces of
    that many positions, counted in ``info["cut_documents"]``), bucket by bucket, padded
    on the right to the largest bucket: inputs with the pad token, targets with
    :data:`~pdjax.apps.data.bpe.IGNORE`. Cropping a row of bucket ``L`` to ``L``
    positions gives it as padded to ``L`` (the module docstring says why);
    :class:`BucketStream` trains on them so.

    Args:
      lengths: bucket lengths (positions per example), strictly ascending positive
        integers; the largest is the dataset's width.
      seed: seed of the document split (a non-negative integer).
      vocab_size: the tokenizer's vocabulary size, at least 258.
      test_fraction: share of the characters held out, in ``(0, 1)``.
      cache_dir: the tokenizer cache (default: bpe's).
      cache: use the tokenizer cache.

    Returns:
      ``(dataset, info)``: a :class:`Dataset` named :data:`BUCKETS_NAME`, int32 inputs and
      targets ``(N, max(lengths))``, ``num_classes`` the vocabulary size, whose ``info``
      is ``info``: text_bpe_buckets' info and

      * ``"lengths"``: ``{"train": ..., "test": ...}``, int32 ``(N,)`` real positions of
        each example;
      * ``"padding"``: of the training set, ``"buckets"`` (per bucket: ``length``,
        ``examples``, ``real_tokens``, ``positions`` = examples x length,
        ``padding_fraction``), ``"bucketed"`` (the padding fraction with the buckets) and
        ``"one_length"`` (with every example at the largest bucket);
      * ``"cut_documents"``: ``{"train": ..., "test": ...}``, documents longer than the
        largest bucket, each cut into several examples;
      * ``"longest_document"``: the longest document's positions (its tokens and the
        two frames, less one).

    Raises:
      DataError: for bad lengths, ``seed``, ``vocab_size`` or ``test_fraction``, or a
        missing ``tokenizers`` (``pip install 'pdjax[text]'``).
    """
    lengths = _bucket_lengths(lengths)
    largest = lengths[-1]
    train, test, base = text_bpe_buckets(
        lengths,
        seed,
        test_fraction,
        vocab_size=vocab_size,
        split_long=True,
        cache_dir=cache_dir,
        cache=cache,
    )
    pad_id = int(base["pad_id"])
    train_x, train_y = _padded(train, largest, pad_id)
    test_x, test_y = _padded(test, largest, pad_id)
    # Which documents were cut: their lengths, from the same split and tokenizer.
    tok = BPETokenizer(base["tokenizer_json"])
    cut: dict[str, int] = {}
    longest = 0
    for name, docs, made in zip(
        ("train", "test"),
        split_documents(documents(), seed, test_fraction),
        (train, test),
        strict=True,
    ):
        sizes = [len(ids) + 1 for ids in tok.encode_batch([d.text for d in docs])]
        pieces = sum(math.ceil(n / largest) for n in sizes)
        if pieces != made.num_examples:  # the recount must see the examples made
            raise DataError(
                f"the {name} documents make {made.num_examples} examples but {pieces} by "
                "their lengths: the corpus changed while it was read; run again"
            )
        cut[name] = sum(n > largest for n in sizes)
        longest = max(longest, *sizes)
    per_bucket = [
        {
            "length": b.length,
            "examples": len(b.inputs),
            "real_tokens": b.real_tokens,
            "positions": int(b.targets.size),
            "padding_fraction": 1.0 - b.real_tokens / b.targets.size if b.targets.size else 0.0,
        }
        for b in train.buckets
    ]
    real = train.real_tokens
    info: BucketInfo = {
        **base,
        "lengths": {"train": _real_positions(train_y), "test": _real_positions(test_y)},
        "padding": {
            "buckets": per_bucket,
            "bucketed": train.padding_fraction,
            "one_length": 1.0 - real / (len(train_x) * largest) if len(train_x) else 0.0,
        },
        "cut_documents": cut,
        "longest_document": longest,
    }
    for split in info["lengths"].values():
        split.setflags(write=False)
    ds = Dataset(
        name=BUCKETS_NAME,
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=max(vocab_size, int(base["tokenizer_vocab"])),
        info=info,
    )
    return ds, info


def bucket_counts(ds: Dataset, lengths: Sequence[int]) -> list[int]:
    """Training examples per bucket of ``lengths`` in a :func:`bucketed_text` dataset,
    from each example's real positions (``info["lengths"]["train"]``): an example goes to
    the smallest bucket that holds it."""
    real = np.asarray(ds.info["lengths"]["train"])
    which = np.searchsorted(np.asarray(lengths), real, side="left")
    return [int(c) for c in np.bincount(which, minlength=len(lengths))]


def token_weights(targets: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The token weights of one batch's microbatches (their targets, in order):
    ``len(targets) * real(microbatch) / real(batch)`` each, a float32 scalar array (0 for
    all of them if the batch holds no real target, which leaves its losses 0, not NaN).

    >>> [float(w) for w in token_weights([np.array([[3, -1, -1]]), np.array([[4, 5, 6]])])]
    [0.5, 1.5]
    """
    real = [int(np.count_nonzero(np.asarray(t) >= 0)) for t in targets]
    total = sum(real)
    return [np.asarray(len(real) * r / total if total else 0.0, np.float32) for r in real]


class BucketStream:
    """The training split as an endless stream of microbatches, each batch from one
    bucket and cropped to its length (the order: see the module). The same interface as
    :class:`~pdjax.apps.data.stream.TrainStream`.

    Each training example's bucket is the smallest of ``lengths`` that holds its real
    positions (targets ``>= 0``, which must fill a prefix of the row: right padding).

    Args:
      ds: the data (:func:`bucketed_text`'s, or any right-padded int targets ``(N, W)``
        with ``W >= max(lengths)``).
      lengths: bucket lengths, strictly ascending positive integers.
      batch_size: examples per batch (one update), all of one bucket.
      microbatches: microbatches per batch; divides ``batch_size``.
      seed: the run's data seed (a non-negative integer).
      identity: what the split is (JSON-able: :func:`~pdjax.apps.data.stream.split_identity`),
        kept in :meth:`state` so that a resume on other data is refused.
      state: a :meth:`state` to continue from (None: from the start).
      token_weights: give each microbatch's targets as ``(targets, weight)``
        (:func:`token_weights`) for :func:`pdjax.apps.train.token_loss.token_weighted`.

    Attributes:
      lengths: the bucket lengths.
      counts: training examples per bucket.
      batches_per_pass: full batches in one pass over the data (an epoch of buckets).
      microbatches_per_pass: ``batches_per_pass * microbatches``.
      num_samples: training examples.
      microbatch_size: examples per microbatch, ``batch_size // microbatches``.
      position: microbatches taken (or skipped) so far.

    Raises:
      DataError: for bad lengths, a ``batch_size`` not divisible by ``microbatches``, one
        larger than every bucket's example count (naming the counts), targets that are
        not right-padded or longer than the largest bucket, a bad seed, or a ``state``
        of other data, seed, batch size, microbatches or lengths.
    """

    def __init__(
        self,
        ds: Dataset,
        lengths: Sequence[int],
        batch_size: int,
        microbatches: int,
        *,
        seed: int,
        identity: Mapping[str, Any],
        state: Mapping[str, Any] | None = None,
        token_weights: bool = False,
    ) -> None:
        self.lengths = _bucket_lengths(lengths)
        for what, value in (("batch_size", batch_size), ("microbatches", microbatches)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise DataError(f"{what} must be a positive integer, got {value!r}")
        if batch_size % microbatches:
            raise DataError(
                f"a batch of {batch_size} examples does not split into {microbatches} "
                f"microbatches: pass a batch_size that is a multiple of {microbatches}"
            )
        generator(seed)  # a bad seed is refused now, not at the first take
        self.batch_size, self.microbatches = int(batch_size), int(microbatches)
        self.microbatch_size = self.batch_size // self.microbatches
        self.seed = int(seed)
        self.identity = dict(identity)
        self.token_weights = bool(token_weights)
        self._x, self._y = ds.train_x, ds.train_y
        self.num_samples = len(ds.train_y)
        bucket = self._bucket_of(np.asarray(ds.train_y))
        self._members = [np.flatnonzero(bucket == i) for i in range(len(self.lengths))]
        self.counts = tuple(len(m) for m in self._members)
        self.batches_per_pass = sum(c // self.batch_size for c in self.counts)
        if self.batches_per_pass == 0:
            shown = ", ".join(f"{n}: {c}" for n, c in zip(self.lengths, self.counts, strict=True))
            raise DataError(
                f"no bucket holds a batch of {self.batch_size} examples (examples per "
                f"bucket length: {shown}): pass a batch_size of at most {max(self.counts)}"
                ", or fewer buckets"
            )
        self.microbatches_per_pass = self.batches_per_pass * self.microbatches
        self.position = 0
        self._pass = -1
        self._plan: list[tuple[int, np.ndarray]] = []
        if state is not None:
            self._restore(state)

    def _bucket_of(self, y: np.ndarray) -> np.ndarray:
        """Each training example's bucket index, checking the targets' layout."""
        if y.ndim != 2 or y.dtype.kind not in "iu":
            raise DataError(
                f"bucketed training needs int targets (N, positions), got {y.dtype} "
                f"{y.shape}: pass bucketed_text's data"
            )
        if y.shape[1] < self.lengths[-1]:
            raise DataError(
                f"the largest bucket, {self.lengths[-1]}, is longer than the examples "
                f"({y.shape[1]} positions): pass buckets of at most {y.shape[1]}, or data "
                "made with these buckets (bucketed_text)"
            )
        real = y >= 0
        positions = real.sum(axis=1)
        prefix = np.arange(y.shape[1]) < positions[:, None]
        if not np.array_equal(real, prefix):
            row = int(np.flatnonzero((real != prefix).any(axis=1))[0])
            raise DataError(
                f"training example {row} is not padded on the right (a padded target, "
                f"{IGNORE}, before a real one): bucketed training crops rows, so pass "
                "right-padded data (bucketed_text's)"
            )
        too_long = positions > self.lengths[-1]
        if too_long.any():
            row = int(np.flatnonzero(too_long)[0])
            raise DataError(
                f"training example {row} has {int(positions[row])} positions, more than the "
                f"largest bucket, {self.lengths[-1]}: pass a bucket of at least "
                f"{int(positions.max())}, or data made with these buckets (bucketed_text)"
            )
        self._positions = positions
        out: np.ndarray = np.searchsorted(np.asarray(self.lengths), positions, side="left")
        return out

    def _restore(self, state: Mapping[str, Any]) -> None:
        mine = {
            "stream": "buckets",
            "identity": self.identity,
            "seed": self.seed,
            "size": self.batch_size,
            "microbatches": self.microbatches,
            "lengths": list(self.lengths),
        }
        if isinstance(state.get("lengths"), tuple):  # a state made here, not read from JSON
            state = {**state, "lengths": list(state["lengths"])}
        self.position = saved_position(state, mine)

    def _plan_of(self, pass_: int) -> list[tuple[int, np.ndarray]]:
        """Pass ``pass_``'s batches in order, each ``(bucket, example indices)``: the
        order of :meth:`Buckets.batches` with ``epoch=pass_``."""
        if pass_ != self._pass:
            plan: list[tuple[int, np.ndarray]] = []
            for i, members in enumerate(self._members):
                order = members[generator(self.seed, pass_, i).permutation(len(members))]
                for k in range(len(members) // self.batch_size):
                    plan.append((i, order[k * self.batch_size : (k + 1) * self.batch_size]))
            shuffle = generator(self.seed, pass_).permutation(len(plan)).tolist()
            self._plan, self._pass = [plan[j] for j in shuffle], pass_
        return self._plan

    def length_at(self, position: int) -> int:
        """The sequence length of microbatch ``position`` of the stream (its bucket's)."""
        batch, _ = divmod(position, self.microbatches)
        pass_, j = divmod(batch, self.batches_per_pass)
        return self.lengths[self._plan_of(pass_)[j][0]]

    def skip(self, count: int) -> None:
        """Moves the stream ``count`` microbatches on without reading them."""
        if count < 0:
            raise DataError(f"a stream moves forward only: skip(count >= 0), got {count}")
        self.position += count

    def take(self, count: int) -> list[tuple[np.ndarray, Any]]:
        """The next ``count`` microbatches (any count: a batch may span two calls), each
        ``(inputs, targets)`` int32 ``(batch_size // microbatches, bucket length)``, its
        targets ``(targets, weights)`` with ``token_weights``: the microbatch's weight
        once per row (float32 ``(rows,)``)."""
        if count < 0:
            raise DataError(f"take(count >= 0), got {count}")
        out: list[tuple[np.ndarray, Any]] = []
        b = self.microbatch_size
        for position in range(self.position, self.position + count):
            batch, m = divmod(position, self.microbatches)
            pass_, j = divmod(batch, self.batches_per_pass)
            i, idx = self._plan_of(pass_)[j]
            length = self.lengths[i]
            rows = idx[m * b : (m + 1) * b]
            x = np.ascontiguousarray(np.asarray(self._x[rows])[:, :length])
            y = np.ascontiguousarray(np.asarray(self._y[rows])[:, :length])
            if not self.token_weights:
                out.append((x, y))
                continue
            real_batch = int(self._positions[idx].sum())
            real = int(np.count_nonzero(y >= 0))
            weight = self.microbatches * real / real_batch if real_batch else 0.0
            out.append((x, (y, np.full(len(rows), weight, np.float32))))
        self.position += count
        return out

    def state(self) -> dict[str, Any]:
        """Where the stream stands, JSON-able: a checkpoint keeps it; a stream made with
        it as ``state=`` continues with the next microbatch."""
        return {
            "stream": "buckets",
            "position": self.position,
            "identity": self.identity,
            "seed": self.seed,
            "size": self.batch_size,
            "microbatches": self.microbatches,
            "lengths": list(self.lengths),
        }

    def close(self) -> None:
        """Drops the pass held in memory (the stream holds no threads or files; it can
        still be read, rebuilding the pass)."""
        self._plan, self._pass = [], -1
