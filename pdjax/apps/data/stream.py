"""Streamed input: the training split read as training goes, a bounded number of
microbatches at a time, with a position a checkpoint keeps (:class:`TrainStream`), and the
test split read in bounded groups of evaluation batches (:func:`eval_chunks`).

The training order is grain's (:mod:`grain`): the sample indices ``0 .. N-1`` shuffled by
a seed derived from the run's (``grain.MapDataset.shuffle``, a new permutation each pass
over the split, drawn index by index, so no permutation of ``N`` indices is ever held),
repeated without end and cut into microbatches of ``microbatch_size`` consecutive
indices, each read from the split with one index array (``x[idx], y[idx]``). A
microbatch may so hold the last samples of one pass and the first of the next; no sample
is dropped. The microbatches are read ahead by grain's threads into a buffer of
``prefetch`` of them, so host memory holds that many beyond the call being trained,
whatever the split's size (a token file's splits are memory-mapped views:
:mod:`pdjax.apps.data.tokens`).

The stream's position is the number of microbatches taken; :meth:`TrainStream.state`
returns it with grain's own iterator state and the split's identity, and a stream made
from that state continues with the next microbatch of the same order (checked: the
identity, the seed and the microbatch size must be the same).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from pdjax.apps.data.dataset import Dataset
from pdjax.errors import DataError

__all__ = ["TrainStream", "eval_chunks", "saved_position", "split_identity", "stream_seed"]

#: Microbatches grain reads ahead of the one being taken (per stream).
PREFETCH = 16
#: Threads grain reads them with.
THREADS = 2


def stream_seed(seed: int) -> int:
    """The 32-bit shuffle seed grain takes, derived from a run's seed (any integer
    ``>= 0``; distinct seeds give distinct orders with overwhelming probability)."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise DataError(f"the data seed must be an integer >= 0, got {seed!r}")
    return int(np.random.SeedSequence([int(seed), 0x5D]).generate_state(1)[0])


def split_identity(ds: Dataset) -> dict[str, Any]:
    """What a training split is, for an input state (:meth:`TrainStream.state`): the
    dataset's name and sample count, and its file's fingerprint (``info["identity"]``, a
    token file's) or else a SHA-256 of its arrays (held in memory: cheap)."""
    identity: dict[str, Any] = {"dataset": ds.name, "samples": ds.num_train}
    fingerprint = ds.info.get("identity") if ds.info else None
    if fingerprint is not None:
        identity["file"] = fingerprint
    else:
        digest = hashlib.sha256()
        for a in (ds.train_x, ds.train_y):
            a = np.ascontiguousarray(a)
            digest.update(f"{a.dtype.str}{a.shape}".encode())
            digest.update(a.tobytes())
        identity["sha256"] = digest.hexdigest()[:32]
    return identity


def saved_position(state: Mapping[str, Any], mine: Mapping[str, Any]) -> int:
    """The position of a stream's saved ``state``, once every field of ``mine`` (what the
    stream here is: its data's identity, seed, sizes) is found equal in it.

    Raises:
      DataError: a state of other data (naming the fields that differ, saved and here),
        or without a valid position.
    """
    theirs = {k: state.get(k) for k in mine}
    which = [k for k in mine if theirs[k] != mine[k]]
    if which:
        raise DataError(
            f"the input state saved with the run is of other data ({', '.join(which)}: "
            f"saved {[theirs[k] for k in which]}, here {[mine[k] for k in which]}): "
            "resume on the data the run was started with, or start a new run"
        )
    position = state.get("position")
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise DataError(f"an input state without a valid position: {dict(state)!r}")
    return position


class _Read:
    """grain's map from a microbatch's sample indices to its ``(inputs, targets)``."""

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y

    def __call__(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        both = getattr(self.x, "read_with", None)  # a token file's windows: one read
        if both is not None:
            x, y = both(self.y, idx)
            return x, y
        return np.asarray(self.x[idx]), np.asarray(self.y[idx])


class TrainStream:
    """The training split as an endless stream of shuffled microbatches (see the module).

    Args:
      x: the split's inputs ``(N, ...)``: a numpy array or a lazy view indexable by an
        int array (:class:`pdjax.apps.data.tokens.WindowView`).
      y: its targets, indexed alike.
      microbatch_size: samples per microbatch.
      seed: the run's data seed.
      identity: what the split is (JSON-able: its name, file fingerprint...), kept in
        :meth:`state` so that a resume on other data is refused.
      state: a :meth:`state` to continue from (None: from the start).
      prefetch: microbatches read ahead (host memory bound).
      threads: grain's reading threads.

    Raises:
      DataError: an empty split, a microbatch larger than the split, a bad seed, or a
        ``state`` of another split, seed or microbatch size.
    """

    def __init__(
        self,
        x: Any,
        y: Any,
        microbatch_size: int,
        *,
        seed: int,
        identity: Mapping[str, Any],
        state: Mapping[str, Any] | None = None,
        prefetch: int = PREFETCH,
        threads: int = THREADS,
    ) -> None:
        import grain

        n = len(x)
        if len(y) != n:
            raise DataError(f"inputs and targets differ in length: {n} vs {len(y)}")
        if microbatch_size < 1 or microbatch_size > n:
            raise DataError(
                f"microbatches of {microbatch_size} samples from a split of {n}: pick a "
                f"microbatch of 1 to {n} samples"
            )
        self.microbatch_size = microbatch_size
        self.seed = int(seed)
        self.identity = dict(identity)
        self.num_samples = n
        self.position = 0
        dataset = (
            grain.MapDataset.range(n)
            .shuffle(seed=stream_seed(seed))
            .repeat()
            .batch(microbatch_size)
            .map(_Read(x, y))
        )
        options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
        self._iter: Any = iter(dataset.to_iter_dataset(options))
        if state is not None:
            self._restore(state)

    def _restore(self, state: Mapping[str, Any]) -> None:
        mine = {"identity": self.identity, "seed": self.seed, "size": self.microbatch_size}
        position = saved_position(state, mine)
        grain_state = state.get("grain")
        if not isinstance(grain_state, dict):
            raise DataError(f"an input state without grain's iterator state: {dict(state)!r}")
        self._iter.set_state(dict(grain_state))
        self.position = position

    def skip(self, count: int) -> None:
        """Moves the stream ``count`` microbatches on without reading them."""
        state = self._iter.get_state()
        if isinstance(state, dict) and isinstance(state.get("next_index"), int):
            self._iter.set_state({**state, "next_index": state["next_index"] + count})
        else:  # a grain whose state has another form: read them
            for _ in range(count):
                next(self._iter)
        self.position += count

    def take(self, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The next ``count`` microbatches (read now, or already read ahead)."""
        out = [next(self._iter) for _ in range(count)]
        self.position += count
        return out

    def state(self) -> dict[str, Any]:
        """Where the stream stands, JSON-able: a checkpoint keeps it (see the class)."""
        return {
            "position": self.position,
            "grain": self._iter.get_state(),
            "identity": self.identity,
            "seed": self.seed,
            "size": self.microbatch_size,
        }

    def close(self) -> None:
        """Stops grain's reading threads (the stream cannot be read afterwards)."""
        close = getattr(self._iter, "close", None)
        if close is not None:
            close()


def eval_chunks(
    x: Any, y: Any, batch_size: int, chunk: int
) -> Iterator[list[tuple[np.ndarray, np.ndarray]]]:
    """The whole split in order as ``(inputs, targets)`` batches of ``batch_size`` rows
    (the last one shorter), ``chunk`` batches at a time: each group is read when the one
    before has been consumed, so memory holds at most ``chunk`` batches."""
    n = len(x)
    if batch_size < 1 or chunk < 1:
        raise DataError(f"batch_size and chunk must be >= 1, got {batch_size}, {chunk}")
    step = batch_size * chunk
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        yield [
            (np.asarray(x[b : min(hi, b + batch_size)]), np.asarray(y[b : min(hi, b + batch_size)]))
            for b in range(lo, hi, batch_size)
        ]
