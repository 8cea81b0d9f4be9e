"""Token files: flat binary token streams for ``pdjax train --dataset tokens:PATH``.

A token file is what nanoGPT's ``prepare.py`` writes (``train.bin``): the token ids one
after another, little-endian ``uint16`` or ``uint32``, nothing else, so other tools read
it unchanged. What the bytes mean lives in a side file beside it, ``PATH.json``::

    {"format": "pdjax-tokens", "version": 1, "dtype": "uint16",
     "vocab_size": 50257, "separator": 50256}

``separator`` is the id that ends each document (GPT-2's ``<|endoftext|>`` above), or
``null`` for one unbroken stream. :func:`write_tokens` (an array) and
:func:`write_token_chunks` (any number of chunks, never all in memory) write both files;
:func:`write_side_file` describes a ``.bin`` written by another tool.

Reading never loads the file: :func:`open_tokens` memory-maps it read-only, checks that
its size is a whole number of tokens and that a sample of ~1M tokens lies inside the
vocabulary, and fingerprints it (:attr:`TokenFile.identity`) for checkpoints to compare.
:func:`token_dataset` cuts it into training windows: a :class:`Dataset` whose arrays are
:class:`WindowView`\\ s, lazy views that read the windows a batch asks for from the map,
check them against the vocabulary, and refuse to read once the file changed on disk.

Packing follows :func:`pdjax.apps.data.text`: windows of ``seq_len + 1`` tokens start every
``seq_len`` tokens (inputs the first ``seq_len``, targets the last ``seq_len``, so every
token but a region's first is a target exactly once). With a separator, documents are the
runs of tokens that *end* with a separator (plus whatever follows the last one, up to the
end of the file); no window crosses from one document into the next, so a separator is
only ever a window's last token (a target, never an input), and each document's tail that
fills no window is dropped (counted in ``Dataset.info["dropped_tokens"]``).

>>> import tempfile, numpy as np
>>> tmp = tempfile.TemporaryDirectory()
>>> path = tmp.name + "/train.bin"
>>> write_tokens(path, np.arange(100) % 7, vocab_size=7)
100
>>> ds = token_dataset(path, seq_len=8, validation=0.2)
>>> ds.train_x.shape, ds.test_x.shape, ds.train_x.dtype
((9, 8), (3, 8), dtype('int32'))
>>> bool((ds.train_y[0][:-1] == ds.train_x[0][1:]).all())
True
>>> tmp.cleanup()
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import mmap
import numbers
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn, cast

import numpy as np
import numpy.typing as npt

from pdjax._jsonio import FieldReader, parse_json, read_regular, refuse_link, write_atomic
from pdjax.apps.data.dataset import Dataset, generator
from pdjax.errors import DataError

__all__ = [
    "DTYPES",
    "FORMAT",
    "VERSION",
    "TokenFile",
    "WindowView",
    "check_identity",
    "declared_vocab_size",
    "open_tokens",
    "side_file",
    "token_dataset",
    "write_random_tokens",
    "write_side_file",
    "write_token_chunks",
    "write_tokens",
]

#: The ``format`` field of every side file pdjax writes and reads.
FORMAT = "pdjax-tokens"
#: The side file's version; a file of a later version is refused (upgrade pdjax).
VERSION = 1
#: The token types a file may hold, by the name its side file gives (little-endian).
DTYPES: Mapping[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

# Ids become int32 windows, so a vocabulary must fit int32 as well as the file's type.
_MAX_VOCAB = 2**31
# At open, this many tokens in _SAMPLE_BLOCKS evenly spaced blocks (the first and the last
# among them) are checked against the vocabulary: a wrong dtype or vocabulary shows at
# once on any file, at a cost that does not grow with it. Every window is checked again
# when it is read. Module constants, so a test can shrink them.
_SAMPLE_TOKENS = 1 << 20
_SAMPLE_BLOCKS = 64
# The fingerprint hashes this many bytes at the start, the middle and the end of a file.
_FINGERPRINT_BYTES = 1 << 20
# The separator scan (and the chunked writers) handle this many tokens at a time, so
# their memory stays bounded (~12 MiB for uint16) whatever the file's size.
_CHUNK_TOKENS = 1 << 22
# A side file is a few hundred bytes; anything much larger is not one.
_SIDE_MAX_BYTES = 1 << 16


def side_file(path: str | Path) -> Path:
    """The side file that describes the token file ``path``: ``PATH.json``
    (``train.bin`` -> ``train.bin.json``)."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def _example_side(vocab_size: int | str = "V", separator: Any = None) -> str:
    return json.dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "dtype": "uint16",
            "vocab_size": vocab_size,
            "separator": separator,
        }
    )


# -- writing ----------------------------------------------------------------------------------


def _integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DataError(f"{what} must be an integer, got {value!r}")
    return int(value)


def _header(vocab_size: Any, dtype: Any, separator: Any) -> dict[str, Any]:
    """The side file's fields for these settings, checked; ``dtype=None`` picks the
    smallest type that holds every id."""
    vocab = _integer(vocab_size, "vocab_size")
    if not 1 <= vocab <= _MAX_VOCAB:
        raise DataError(f"vocab_size must lie in 1..{_MAX_VOCAB} (ids become int32), got {vocab}")
    if dtype is None:
        dtype = "uint16" if vocab <= 2**16 else "uint32"
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise DataError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    _check_fits(vocab, name, "")
    if separator is not None:
        separator = _integer(separator, "separator")
        if not 0 <= separator < vocab:
            raise DataError(
                f"separator must be a token id in 0..{vocab - 1} (vocab_size {vocab}), "
                f"got {separator}"
            )
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": name,
        "vocab_size": vocab,
        "separator": separator,
    }


def _check_fits(vocab: int, dtype: str, where: str) -> None:
    capacity = int(np.iinfo(DTYPES[dtype]).max) + 1
    if vocab > capacity:
        raise DataError(
            f"{where}vocab_size {vocab} does not fit dtype {dtype}, which holds ids "
            f"0..{capacity - 1}; use dtype uint32 (and tokens written as uint32)"
        )


def _refuse_existing(path: Path, overwrite: bool) -> None:
    refuse_link(path, "token file", DataError)
    if path.is_dir():
        raise DataError(f"cannot write token file {path}: it is a folder; give a file name")
    if not overwrite and os.path.lexists(path):
        raise DataError(
            f"{path} already exists, and pdjax does not replace a file unasked; pass "
            "overwrite=True to replace it, or give another path"
        )


def write_side_file(
    path: str | Path,
    *,
    vocab_size: int,
    dtype: str = "uint16",
    separator: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Describes an existing token file (nanoGPT's ``train.bin``, say) with a side file.

    The token file is not changed; its size must be a whole number of ``dtype`` tokens.
    nanoGPT's GPT-2 files are ``vocab_size=50257, dtype="uint16", separator=50256``.

    Args:
      path: the token file.
      vocab_size: number of token ids; every token must be below it.
      dtype: ``"uint16"`` or ``"uint32"``, as the file was written.
      separator: the id that ends each document, or ``None``.
      overwrite: replace an existing side file.

    Returns:
      The side file written, ``PATH.json``.

    Raises:
      DataError: a bad setting, a missing token file or one whose size is not a whole
        number of tokens, or an existing side file without ``overwrite``.
    """
    path = Path(path)
    header = _header(vocab_size, dtype, separator)
    size = _regular_size(path)
    _whole_tokens(path, size, header["dtype"])
    side = side_file(path)
    _refuse_existing(side, overwrite)
    write_atomic(side, json.dumps(header) + "\n", what="token side file", error=DataError)
    return side


def write_tokens(
    path: str | Path,
    tokens: npt.ArrayLike,
    *,
    vocab_size: int,
    dtype: str | None = None,
    separator: int | None = None,
    overwrite: bool = False,
) -> int:
    """Writes a 1-D sequence of token ids as a token file and its side file.

    Args:
      path: the token file, e.g. ``train.bin``; the side file is ``PATH.json``.
      tokens: integer ids ``(N,)``, each in ``0..vocab_size - 1``.
      vocab_size: number of token ids.
      dtype: ``"uint16"``, ``"uint32"``, or ``None`` for the smallest that holds
        ``vocab_size`` ids.
      separator: the id that ends each document, or ``None`` for one stream.
      overwrite: replace existing files (refused otherwise).

    Returns:
      The number of tokens written.

    Raises:
      DataError: bad settings or tokens (not integers, not 1-D, outside the vocabulary,
        none), an existing file without ``overwrite``, or a failed write. Nothing is
        changed on disk then.
    """
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise DataError(f"tokens must be 1-D (N,), got shape {array.shape}")
    chunks = (array[lo : lo + _CHUNK_TOKENS] for lo in range(0, len(array), _CHUNK_TOKENS))
    return write_token_chunks(
        path, chunks, vocab_size=vocab_size, dtype=dtype, separator=separator, overwrite=overwrite
    )


def write_token_chunks(
    path: str | Path,
    chunks: Iterable[npt.ArrayLike],
    *,
    vocab_size: int,
    dtype: str | None = None,
    separator: int | None = None,
    overwrite: bool = False,
) -> int:
    """Writes token ids given in chunks (never all in memory) as a token file.

    Both files are written atomically: the tokens go to a private temporary file that is
    renamed onto ``path`` only once every chunk was written and checked, then the side
    file (an old side file is removed before the rename, so no side file ever describes
    tokens it was not written for). A failure leaves the old files, if any, as they were.

    Args:
      path: the token file; the side file is ``PATH.json``.
      chunks: 1-D integer arrays, each id in ``0..vocab_size - 1``.
      vocab_size, dtype, separator, overwrite: as for :func:`write_tokens`.

    Returns:
      The number of tokens written.

    Raises:
      DataError: as :func:`write_tokens`.
    """
    path = Path(path)
    header = _header(vocab_size, dtype, separator)
    side = side_file(path)
    _refuse_existing(path, overwrite)
    _refuse_existing(side, overwrite)
    count = 0

    def raw_chunks() -> Iterator[memoryview]:
        nonlocal count
        for i, chunk in enumerate(chunks):
            raw = _checked_chunk(chunk, header, i, count)
            count += len(raw)
            yield memoryview(raw)
        if count == 0:
            raise DataError(f"no tokens to write to {path}; give at least one token")

    def drop_side() -> None:  # no side file may describe tokens it was not written for
        with contextlib.suppress(FileNotFoundError):
            os.unlink(side)

    write_atomic(path, raw_chunks(), what="token file", error=DataError, before_replace=drop_side)
    write_atomic(side, json.dumps(header) + "\n", what="token side file", error=DataError)
    return count


def _checked_chunk(chunk: npt.ArrayLike, header: Mapping[str, Any], i: int, done: int) -> Any:
    array = np.asarray(chunk)
    if array.ndim != 1:
        raise DataError(f"token chunk {i} must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise DataError(f"token ids must be integers, got dtype {array.dtype} in chunk {i}")
    if array.size:
        lo, hi = int(array.min()), int(array.max())
        vocab = header["vocab_size"]
        if lo < 0 or hi >= vocab:
            bad = int(np.argmax((array < 0) | (array >= vocab)))
            raise DataError(
                f"token {int(array[bad])} at offset {done + bad} is outside the vocabulary "
                f"0..{vocab - 1}; pass the right vocab_size"
            )
    return np.ascontiguousarray(array, dtype=DTYPES[header["dtype"]])


def write_random_tokens(
    path: str | Path,
    n_tokens: int,
    vocab_size: int,
    *,
    seed: int = 0,
    separator_every: int | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> int:
    """Writes ``n_tokens`` uniformly random ids as a token file, chunk by chunk (for
    benchmarks: a 1 GB file needs ~12 MiB of memory).

    Without ``separator_every`` the ids are drawn from ``0..vocab_size - 1``. With it, the
    separator is ``vocab_size - 1``: every ``separator_every``-th token (positions
    ``k - 1, 2k - 1, ...``) is the separator and the others are drawn from
    ``0..vocab_size - 2``, so every document holds ``separator_every`` tokens.

    Returns:
      The number of tokens written.

    Raises:
      DataError: as :func:`write_tokens`, or a bad count, seed or ``separator_every``.
    """
    n = _integer(n_tokens, "n_tokens")
    if n < 1:
        raise DataError(f"n_tokens must be at least 1, got {n}")
    vocab = _integer(vocab_size, "vocab_size")
    every = None if separator_every is None else _integer(separator_every, "separator_every")
    if every is not None and (every < 1 or vocab < 2):
        raise DataError(
            f"separator_every must be at least 1 and vocab_size at least 2 (the separator "
            f"and one other id), got {every} and {vocab}"
        )
    rng = generator(_integer(seed, "seed"))
    separator = None if every is None else vocab - 1
    high = vocab if separator is None else vocab - 1

    def chunks() -> Iterator[np.ndarray]:
        for lo in range(0, n, _CHUNK_TOKENS):
            chunk = rng.integers(0, high, size=min(_CHUNK_TOKENS, n - lo), dtype=np.int64)
            if every is not None:
                first = (-(lo + 1)) % every  # first index i with (lo + i + 1) % every == 0
                chunk[first::every] = vocab - 1
            yield chunk

    return write_token_chunks(
        path, chunks(), vocab_size=vocab, dtype=dtype, separator=separator, overwrite=overwrite
    )


# -- opening ----------------------------------------------------------------------------------


def _regular_size(path: Path) -> int:
    try:
        info = os.stat(path)
    except FileNotFoundError as e:
        raise DataError(f"token file {path} does not exist; check the path") from e
    except OSError as e:
        raise DataError(f"cannot read token file {path}: {e.strerror or e}") from e
    if not stat.S_ISREG(info.st_mode):
        raise DataError(f"token file {path} is not a regular file; give a .bin file")
    return info.st_size


def _whole_tokens(path: Path, size: int, dtype: str) -> int:
    itemsize = DTYPES[dtype].itemsize
    count, remainder = divmod(size, itemsize)
    if remainder:
        raise DataError(
            f"token file {path} holds {size} bytes, not a whole number of {dtype} tokens "
            f"({itemsize} bytes each; {remainder} byte(s) left over): it is cut short or "
            f"not a {dtype} token file; fix 'dtype' in {side_file(path)} or re-write the file"
        )
    if count == 0:
        raise DataError(f"token file {path} is empty; write at least one token")
    return count


def declared_vocab_size(path: str | Path) -> int:
    """The vocabulary a token file's side file declares (read and checked; none of the
    tokens is read: :func:`open_tokens` checks them against it). A missing or irregular
    token file is refused first, as :func:`open_tokens` refuses it."""
    _regular_size(Path(path))
    return int(_read_header(Path(path))["vocab_size"])


def _read_header(path: Path) -> dict[str, Any]:
    side = side_file(path)
    if not os.path.lexists(side):
        raise DataError(
            f"token file {path} has no side file {side}, which says what its bytes are. "
            f"Write one beside it, e.g. {_example_side()} (dtype uint16 or uint32, "
            "vocab_size the number of token ids, separator the id ending each document or "
            "null; nanoGPT's GPT-2 files: vocab_size 50257, separator 50256), or call "
            "pdjax.apps.data.tokens.write_side_file(path, vocab_size=..., dtype=...)"
        )
    text = read_regular(side, "token side file", DataError, max_bytes=_SIDE_MAX_BYTES)
    obj = parse_json(text.decode("utf-8", "replace"), f"token side file {side}", DataError)
    reader = FieldReader(
        f"token side file {side}",
        DataError,
        f"it should read like {_example_side()}",
    )
    obj = reader.mapping(obj, "top level")
    reader.unknown_keys(obj, {"format", "version", "dtype", "vocab_size", "separator"}, "")
    if reader.field(obj, "format", "") != FORMAT:
        reader.fail("format", f"expected {FORMAT!r}, got {obj['format']!r}")
    version = reader.integer(reader.field(obj, "version", ""), "version", minimum=1)
    if version > VERSION:
        raise DataError(
            f"token side file {side} has version {version}, newer than this pdjax reads "
            f"({VERSION}); upgrade pdjax"
        )
    dtype = reader.string(reader.field(obj, "dtype", ""), "dtype")
    if dtype not in DTYPES:
        reader.fail("dtype", f"expected one of {sorted(DTYPES)}, got {dtype!r}")
    vocab = reader.integer(reader.field(obj, "vocab_size", ""), "vocab_size", minimum=1)
    if vocab > _MAX_VOCAB:
        reader.fail("vocab_size", f"at most {_MAX_VOCAB} (ids become int32), got {vocab}")
    _check_fits(vocab, dtype, f"token side file {side}: ")
    separator = reader.field(obj, "separator", "", None)
    if separator is not None:
        separator = reader.integer(separator, "separator", minimum=0)
        if separator >= vocab:
            reader.fail("separator", f"must be below vocab_size {vocab}, got {separator}")
    return {"dtype": dtype, "vocab_size": vocab, "separator": separator}


@dataclasses.dataclass(frozen=True, eq=False)
class TokenFile:
    """An open token file: its tokens memory-mapped read-only, never loaded whole.

    Attributes:
      path: the token file.
      dtype: ``"uint16"`` or ``"uint32"``.
      vocab_size: number of token ids (every token is below it).
      separator: the id that ends each document, or ``None``.
      tokens: the memory map ``(num_tokens,)``, read-only; index it for raw tokens, or
        use :meth:`read` for checked int32 ones.
      identity: the fingerprint a checkpoint stores (JSON-able): ``bytes``, ``dtype``,
        ``vocab_size``, ``separator`` and ``sha256``, a SHA-256 of those and of the first,
        middle and last MiB of the file (all of a file of 3 MiB or less), so it costs the
        same on any file; a change elsewhere in a large file goes unseen by it (the
        size and modification time, checked at every read, see those while it is open).
    """

    path: Path
    dtype: str
    vocab_size: int
    separator: int | None
    tokens: np.memmap[Any, np.dtype[Any]]
    identity: Mapping[str, Any]
    _stat: tuple[int, int, int, int]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens in the file."""
        return len(self.tokens)

    def check_unchanged(self) -> None:
        """Raises DataError if the file on disk is not the one opened: another size,
        modification time or inode (rewritten, replaced, appended to, removed). One
        ``os.stat``; :meth:`read` calls it every time."""
        try:
            now = _stat_key(os.stat(self.path))
        except OSError as e:
            raise DataError(
                f"token file {self.path} changed while training: it cannot be read any more "
                f"({e.strerror or e}); put it back, or start a new run on the new file"
            ) from e
        if now != self._stat:
            raise DataError(
                f"token file {self.path} changed while training: it held {self._stat[0]} "
                f"bytes (modified at {self._stat[1]} ns) when opened, now {now[0]} bytes "
                f"(modified at {now[1]} ns{'' if now[2:] == self._stat[2:] else ', replaced'}); "
                "its memory map would mix old and new tokens. Put the old file back, or "
                "start a new run on the new one (a resume checks the file's identity)"
            )

    def read(self, offsets: npt.ArrayLike) -> np.ndarray:
        """The tokens at ``offsets`` (token positions in the file, any shape) as int32,
        after checking that the file is unchanged and the tokens inside the vocabulary.

        Raises:
          DataError: the file changed since it was opened, or a token read is not below
            ``vocab_size`` (the message names the offset and the value).
          IndexError: an offset outside the file.
        """
        self.check_unchanged()
        index = np.asarray(offsets, dtype=np.int64)
        raw = self._read_rows(index)
        if raw.size and int(raw.max()) >= self.vocab_size:
            bad = int(np.argmax(raw.reshape(-1) >= self.vocab_size))
            self._beyond(int(index.reshape(-1)[bad]), int(raw.reshape(-1)[bad]))
        return raw.astype(np.int32)

    def _read_rows(self, index: np.ndarray) -> np.ndarray:
        """The raw tokens at ``index``. Rows of consecutive offsets (a window's) are read
        with ``pread`` into the process's own memory, a few hundred bytes each: reading
        through the map would make the file's pages resident in the process (the kernel
        maps whole cached blocks of the file around each fault, MiBs for a window of
        bytes), so its resident memory would grow with the file. Anything else is read
        from the map."""
        if index.ndim != 2 or not index.size:
            return np.asarray(self.tokens[index])
        if index.shape[1] > 1 and not np.all(np.diff(index, axis=1) == 1):
            return np.asarray(self.tokens[index])
        dtype = DTYPES[self.dtype]
        width = index.shape[1]
        out = np.empty(index.shape, dtype)
        with self._reader() as read:
            for r, lo in enumerate(index[:, 0].tolist()):
                if lo < 0 or lo + width > len(self.tokens):
                    raise IndexError(f"tokens {lo}:{lo + width} lie outside {self.path}")
                out[r] = read(lo, lo + width)
        return out

    def _beyond(self, offset: int, value: int) -> NoReturn:
        _beyond(self.path, self.dtype, self.vocab_size, offset, value)

    @contextlib.contextmanager
    def _reader(self) -> Iterator[Callable[[int, int], np.ndarray]]:
        """``read(lo, hi)``, tokens ``lo:hi`` read with ``pread`` from the file, opened
        afresh and checked to be the one opened (for scans: a ``read`` lets the kernel's
        readahead work, where the map is advised for random access)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise DataError(
                f"token file {self.path} changed while training: it cannot be read any more "
                f"({e.strerror or e}); put it back, or start a new run on the new file"
            ) from e
        try:
            if _stat_key(os.fstat(fd)) != self._stat:
                self.check_unchanged()  # says how it changed, if the path shows it
                raise DataError(
                    f"token file {self.path} changed while training; put the old file "
                    "back, or start a new run on the new one"
                )
            dtype = DTYPES[self.dtype]
            yield lambda lo, hi: _pread(fd, dtype, lo, hi, self.path)
        finally:
            os.close(fd)


def _beyond(path: Path, dtype: str, vocab: int, offset: int, value: int) -> NoReturn:
    raise DataError(
        f"token file {path}: token {value} at offset {offset} (byte "
        f"{offset * DTYPES[dtype].itemsize}) is not below vocab_size {vocab} of "
        f"{side_file(path)}; the side file names the wrong vocabulary or dtype, or the "
        "file is damaged: fix the side file or re-write the tokens"
    )


def _check_block(path: Path, dtype: str, vocab: int, block: np.ndarray, lo: int) -> None:
    """Checks tokens ``block`` (those at ``lo:lo + len(block)``) against the vocabulary."""
    if block.size and int(block.max()) >= vocab:
        bad = int(np.argmax(block >= vocab))
        _beyond(path, dtype, vocab, lo + bad, int(block[bad]))


def _pread(fd: int, dtype: np.dtype[Any], lo: int, hi: int, path: Path) -> np.ndarray:
    """Tokens ``lo:hi`` of the open file ``fd``, read (not mapped) into a fresh array."""
    size = (hi - lo) * dtype.itemsize
    out = bytearray(size)
    view, got = memoryview(out), 0
    try:
        while got < size:
            chunk = os.preadv(fd, [view[got:]], lo * dtype.itemsize + got)
            if chunk == 0:
                raise DataError(
                    f"token file {path} changed while training: it ends before token {hi}; "
                    "put the old file back, or start a new run on the new one"
                )
            got += chunk
    except OSError as e:
        raise DataError(f"cannot read token file {path}: {e.strerror or e}") from e
    return np.frombuffer(out, dtype=dtype)


def _stat_key(info: os.stat_result) -> tuple[int, int, int, int]:
    return (info.st_size, info.st_mtime_ns, info.st_ino, info.st_dev)


def open_tokens(path: str | Path) -> TokenFile:
    """Opens a token file and its side file ``PATH.json``, without reading it whole.

    Checks that the side file is valid, that the size is a whole number of tokens, and
    that ~1M sampled tokens (evenly spaced blocks, the first and the last among them) are
    below ``vocab_size``; windows are checked again as they are read.

    Raises:
      DataError: no such file; a missing or invalid side file (the message shows one to
        write); a vocabulary that does not fit the dtype; a size that is not a whole
        number of tokens (naming the size, the dtype and the remainder); a sampled token
        beyond the vocabulary (naming its offset and value).
    """
    path = Path(path)
    _regular_size(path)
    header = _read_header(path)
    dtype, vocab = header["dtype"], header["vocab_size"]
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise DataError(f"cannot read token file {path}: {e.strerror or e}") from e
    try:
        info = _stat_key(os.fstat(fd))
        n = _whole_tokens(path, info[0], dtype)
        try:
            tokens: np.memmap[Any, np.dtype[Any]] = np.memmap(path, dtype=DTYPES[dtype], mode="r")
        except (ValueError, OSError) as e:
            raise DataError(f"cannot map token file {path}: {e}") from e
        if _stat_key(os.stat(path)) != info or tokens.nbytes != info[0]:
            raise DataError(f"token file {path} changed while it was being opened; try again")
        _advise_random(tokens)
        block = max(1, _SAMPLE_TOKENS // _SAMPLE_BLOCKS)
        if n <= _SAMPLE_TOKENS:
            starts = [0]
            block = n
        else:
            starts = np.linspace(0, n - block, _SAMPLE_BLOCKS).astype(np.int64).tolist()
        for lo in starts:
            _check_block(path, dtype, vocab, _pread(fd, DTYPES[dtype], lo, lo + block, path), lo)
        identity = _identity(fd, info[0], header)
    finally:
        os.close(fd)
    return TokenFile(
        path=path,
        dtype=dtype,
        vocab_size=vocab,
        separator=header["separator"],
        tokens=tokens,
        identity=identity,
        _stat=info,
    )


def _advise_random(tokens: np.memmap[Any, np.dtype[Any]]) -> None:
    """Tells the kernel that the map is read at random places (windows of a shuffled
    batch): without it, every page fault reads ahead the device's readahead (often MiBs)
    around a window of a few KiB, reading the whole file many times over in an epoch that
    does not fit the page cache. ``np.memmap`` keeps its ``mmap`` as ``_mmap``, the only
    handle there is to advise; without one (another numpy), nothing is advised."""
    mapping = getattr(tokens, "_mmap", None)
    advice = getattr(mmap, "MADV_RANDOM", None)
    if mapping is not None and advice is not None:
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(advice)


def _identity(fd: int, size: int, header: Mapping[str, Any]) -> dict[str, Any]:
    piece = _FINGERPRINT_BYTES
    digest = hashlib.sha256(json.dumps(dict(header, bytes=size), sort_keys=True).encode())
    spans = (
        [(0, size)]
        if size <= 3 * piece
        else [(0, piece), (size // 2 - piece // 2, piece), (size - piece, piece)]
    )
    for lo, length in spans:
        for at in range(lo, lo + length, 1 << 16):
            digest.update(os.pread(fd, min(1 << 16, lo + length - at), at))
    return {
        "format": FORMAT,
        "bytes": int(size),
        "dtype": header["dtype"],
        "vocab_size": header["vocab_size"],
        "separator": header["separator"],
        "sha256": digest.hexdigest(),
    }


def check_identity(stored: Mapping[str, Any], file: TokenFile | Mapping[str, Any]) -> None:
    """Refuses to go on with another token file than the one ``stored`` describes (a
    checkpoint's :attr:`TokenFile.identity`).

    Raises:
      DataError: naming the fields that differ, and what to do.
    """
    now = file.identity if isinstance(file, TokenFile) else file
    keys = sorted(set(stored) | set(now))
    differ = [k for k in keys if stored.get(k) != now.get(k)]
    if differ:
        where = f" {file.path}" if isinstance(file, TokenFile) else ""
        detail = "; ".join(f"{k}: {stored.get(k)!r} then, {now.get(k)!r} now" for k in differ)
        raise DataError(
            f"the token file{where} is not the one this run was trained on ({detail}); "
            "resume with the same file, or start a new run"
        )


# -- windows ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Starts:
    """Window start offsets: ``base + step * i`` for ``i < count``, or ``explicit``."""

    count: int
    base: int = 0
    step: int = 1
    explicit: np.ndarray | None = None

    def take(self, index: np.ndarray) -> np.ndarray:
        if self.explicit is not None:
            return np.asarray(self.explicit[index])
        return self.base + self.step * index.astype(np.int64)


class WindowView:
    """Windows of a token file, read lazily: behaves as a read-only int32 array
    ``(N, seq_len)`` for ``len``, ``shape``, ``dtype``, ``ndim`` and indexing, without
    holding the windows in memory.

    ``view[i]`` gives window ``i`` ``(seq_len,)``; ``view[a:b]`` and ``view[idx]`` (a 1-D
    integer array) give ``(k, seq_len)``: fresh int32 arrays read from the file
    (``pread``, window by window), each read checked (:meth:`TokenFile.read`).
    ``np.asarray(view)`` reads every window (fine for small files). A dataset's targets
    are the view of its inputs shifted by one token: ``train_y[i][:-1] == train_x[i][1:]``.
    """

    def __init__(self, file: TokenFile, starts: _Starts, seq_len: int, shift: int) -> None:
        self._file, self._starts = file, starts
        self._seq_len, self._shift = seq_len, shift
        self._columns = np.arange(shift, shift + seq_len, dtype=np.int64)

    @property
    def file(self) -> TokenFile:
        """The open token file the windows are read from."""
        return self._file

    @property
    def shape(self) -> tuple[int, int]:
        return (self._starts.count, self._seq_len)

    @property
    def dtype(self) -> np.dtype[np.int32]:
        return np.dtype(np.int32)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def size(self) -> int:
        return self._starts.count * self._seq_len

    def __len__(self) -> int:
        return self._starts.count

    def offsets(self) -> np.ndarray:
        """The file offset (in tokens) of each window's first token, int64 ``(N,)``."""
        return self._starts.take(np.arange(self._starts.count)) + self._shift

    def setflags(self, *, write: bool | None = None, **_: Any) -> None:
        """Accepts ``write=False`` as numpy arrays do (the view is always read-only), so
        code that freezes arrays can freeze a view too; refuses ``write=True``."""
        if write:
            raise ValueError("a WindowView is read-only: its windows live in the token file")

    def __getitem__(self, key: Any) -> np.ndarray:
        n = self._starts.count
        if isinstance(key, numbers.Integral) and not isinstance(key, bool):
            i = int(key)
            if not -n <= i < n:
                raise IndexError(f"window {i} is out of range for {n} windows")
            row: np.ndarray = self._read(np.array([i % n], dtype=np.int64))[0]
            return row
        if isinstance(key, slice):
            return self._read(np.arange(*key.indices(n), dtype=np.int64))
        if isinstance(key, tuple):
            raise TypeError(
                "a WindowView is indexed along its first axis only (an int, a slice or a 1-D "
                f"integer array), got the tuple {key!r}; read the windows first, e.g. "
                "view[rows][:, cols]"
            )
        index = np.asarray(key)
        if index.ndim != 1 or not (np.issubdtype(index.dtype, np.integer) or index.size == 0):
            raise TypeError(
                "a WindowView is indexed by an int, a slice or a 1-D integer array, got "
                f"{type(key).__name__} {getattr(index, 'dtype', '')} of shape {index.shape}"
            )
        index = index.astype(np.int64)
        if index.size and (index.min() < -n or index.max() >= n):
            raise IndexError(f"window index out of range for {n} windows")
        return self._read(index % max(n, 1))

    def _read(self, index: np.ndarray) -> np.ndarray:
        offsets = self._starts.take(index)[:, None] + self._columns
        return self._file.read(offsets)

    def read_with(self, targets: Any, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(self[index], targets[index])`` for a 1-D int array ``index`` of windows in
        range; where ``targets`` are these windows shifted by one token (a dataset's
        ``train_y`` of its ``train_x``), each window's ``seq_len + 1`` tokens are read
        once, not twice (the training stream reads every microbatch so)."""
        same = (
            isinstance(targets, WindowView)
            and targets._file is self._file
            and targets._starts is self._starts
            and targets._seq_len == self._seq_len
            and targets._shift == self._shift + 1
        )
        index = np.asarray(index, dtype=np.int64)
        if not same:
            return self[index], targets[index]
        columns = np.arange(self._shift, self._shift + self._seq_len + 1, dtype=np.int64)
        tokens = self._file.read(self._starts.take(index)[:, None] + columns)
        return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"WindowView({self._file.path}, shape={self.shape}, shift={self._shift})"


@dataclasses.dataclass(frozen=True)
class _Packed:
    """A region's windows: their starts, the tokens and documents in it, the tokens in
    no window, and its longest document (or the region, with no separator)."""

    starts: _Starts
    tokens: int
    documents: int
    dropped: int
    longest: int


def _pack(file: TokenFile, lo: int, hi: int, seq_len: int) -> _Packed:
    """The windows of tokens ``lo:hi``: without a separator, every ``seq_len`` from ``lo``;
    with one, per document (a run ending with a separator, or with ``hi``), scanning the
    map in chunks of ``_CHUNK_TOKENS`` (which also checks every token's id)."""
    if file.separator is None:
        count = max(0, (hi - lo - 1) // seq_len)
        used = count * seq_len + 1 if count else 0
        return _Packed(_Starts(count, lo, seq_len), hi - lo, 1, hi - lo - used, hi - lo)
    parts: list[np.ndarray] = []
    documents = covered = longest = 0
    doc_start = lo
    with file._reader() as read:
        for a in range(lo, hi, _CHUNK_TOKENS):
            b = min(hi, a + _CHUNK_TOKENS)
            block = read(a, b)
            _check_block(file.path, file.dtype, file.vocab_size, block, a)
            ends = np.flatnonzero(block == file.separator) + (a + 1)
            if b == hi and (len(ends) == 0 or ends[-1] != hi):
                ends = np.append(ends, hi)  # the last document runs to the region's end
            if len(ends) == 0:
                continue
            begins = np.concatenate([[doc_start], ends[:-1]])
            lengths = ends - begins
            counts = np.maximum(0, (lengths - 1) // seq_len)
            first = np.repeat(begins, counts)
            within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            parts.append((first + within * seq_len).astype(np.int64))
            documents += len(ends)
            covered += int((counts * seq_len + (counts > 0)).sum())
            longest = max(longest, int(lengths.max()))
            doc_start = int(ends[-1])
    starts = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return _Packed(
        _Starts(len(starts), explicit=starts), hi - lo, documents, hi - lo - covered, longest
    )


def _nearest_boundary(file: TokenFile, cut: int) -> int | None:
    """The document boundary (just after a separator, inside ``1..n-1``) nearest to
    ``cut`` (the later one on a tie), found by scanning out from it in chunks; None if
    the file holds one document."""
    n, sep = len(file), file.separator
    after = before = None
    with file._reader() as read:
        for a in range(max(cut - 1, 0), n - 1, _CHUNK_TOKENS):
            hits = np.flatnonzero(read(a, min(n - 1, a + _CHUNK_TOKENS)) == sep)
            if len(hits):
                after = a + int(hits[0]) + 1
                break
        for b in range(max(cut - 1, 0), 0, -_CHUNK_TOKENS):
            hits = np.flatnonzero(read(max(0, b - _CHUNK_TOKENS), b) == sep)
            if len(hits):
                before = max(0, b - _CHUNK_TOKENS) + int(hits[-1]) + 1
                break
    if after is None or before is None:
        return after if before is None else before
    return after if after - cut <= cut - before else before


def _too_long(file: TokenFile, packed: _Packed, seq_len: int, split: str) -> DataError:
    fit = packed.longest - 1
    docs = (
        ""
        if file.separator is None
        else f" in {packed.documents} documents, the longest {packed.longest} tokens"
    )
    advice = (
        f"the longest seq_len that works is {fit}"
        if fit >= 1
        else "no seq_len works (no document holds two tokens)"
    )
    return DataError(
        f"seq_len {seq_len} is too long for the {split} split of token file {file.path}: "
        f"it holds {packed.tokens} tokens{docs}, fewer than one window of seq_len + 1; "
        f"{advice}"
    )


def token_dataset(
    path: str | Path,
    seq_len: int,
    *,
    validation: float | str | Path = 0.1,
    name: str | None = None,
) -> Dataset:
    """Next-token windows of a token file, as a :class:`Dataset` of lazy views.

    Args:
      path: the token file (with its side file ``PATH.json``).
      seq_len: tokens per window ``T``, at least 1.
      validation: a fraction in ``(0, 1)``: the test set is the last such share of the
        file's tokens, cut at a window boundary (no separator) or at the document
        boundary nearest to it (with one), so no test window shares a token with a
        training window; or the path of a second token file with the same dtype,
        vocabulary and separator, all of which is the test set.
      name: the dataset's name; default ``f"tokens:{path}"``.

    Returns:
      A :class:`Dataset` whose ``train_x``/``train_y``/``test_x``/``test_y`` are
      :class:`WindowView`\\ s ``(N, T)`` (int32 when read; targets the inputs shifted by
      one token), ``num_classes`` the vocabulary size, and ``info``: ``source``,
      ``dtype``, ``vocab_size``, ``separator``, ``tokens`` (of the file), ``train_tokens``,
      ``test_tokens``, ``dropped_tokens`` (in no window, both splits),
      ``train_documents``/``test_documents``, ``seq_len``, ``validation``, ``identity``
      (:attr:`TokenFile.identity`) and ``validation_identity`` (the second file's, or
      None).

    Raises:
      DataError: as :func:`open_tokens`; a bad ``seq_len`` or ``validation``; a
        ``seq_len`` longer than a split allows (naming its tokens and the longest
        ``seq_len`` that works); a validation file that differs in dtype, vocabulary or
        separator; a file with separators but one document and a fraction to split.
    """
    seq_len = _integer(seq_len, "seq_len")
    if seq_len < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}")
    file = open_tokens(path)
    n = len(file)
    second: TokenFile | None = None
    if isinstance(validation, str | Path):
        second = open_tokens(validation)
        mine = (file.dtype, file.vocab_size, file.separator)
        theirs = (second.dtype, second.vocab_size, second.separator)
        if mine != theirs:
            raise DataError(
                f"validation file {second.path} does not match {file.path}: dtype, "
                f"vocab_size and separator are {theirs} in {side_file(second.path)} but "
                f"{mine} in {side_file(file.path)}; give token files of one tokenizer"
            )
        train = _pack(file, 0, n, seq_len)
        test = _pack(second, 0, len(second), seq_len)
    else:
        if isinstance(validation, bool) or not isinstance(validation, numbers.Real):
            raise DataError(
                f"validation must be a fraction in (0, 1) or a token file's path, got "
                f"{validation!r}"
            )
        fraction = float(validation)
        if not 0.0 < fraction < 1.0:
            raise DataError(f"validation must be a fraction in (0, 1), got {validation!r}")
        cut = n - round(fraction * n)
        if file.separator is None:
            count = max(0, (cut - 1) // seq_len)
            cut = count * seq_len + 1 if count else cut  # the test text starts after the
            # training windows' last token, so the two share none
        else:
            boundary = _nearest_boundary(file, cut)
            if boundary is None:
                raise DataError(
                    f"token file {file.path} holds a single document (no separator "
                    f"{file.separator} before its end), so a validation fraction cannot "
                    "split it at a document boundary; pass validation=PATH of a second "
                    "token file"
                )
            cut = boundary
        train = _pack(file, 0, cut, seq_len)
        test = _pack(file, cut, n, seq_len)
    if train.starts.count == 0:
        raise _too_long(file, train, seq_len, "training")
    if test.starts.count == 0:
        raise _too_long(second or file, test, seq_len, "validation")
    test_file = second or file
    views = (
        WindowView(file, train.starts, seq_len, 0),
        WindowView(file, train.starts, seq_len, 1),
        WindowView(test_file, test.starts, seq_len, 0),
        WindowView(test_file, test.starts, seq_len, 1),
    )
    # Dataset's fields are typed as numpy arrays; a WindowView stands in for one (it has
    # the shape, dtype, indexing and setflags that Dataset and the batching use).
    train_x, train_y, test_x, test_y = (cast("np.ndarray", v) for v in views)
    return Dataset(
        name=name if name is not None else f"tokens:{path}",
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=file.vocab_size,
        info={
            "source": str(path),
            "dtype": file.dtype,
            "vocab_size": file.vocab_size,
            "separator": file.separator,
            "tokens": n,
            "train_tokens": train.tokens,
            "test_tokens": test.tokens,
            "dropped_tokens": train.dropped + test.dropped,
            "train_documents": train.documents if file.separator is not None else None,
            "test_documents": test.documents if file.separator is not None else None,
            "seq_len": seq_len,
            "validation": str(validation) if second is not None else validation,
            "identity": dict(file.identity),
            "validation_identity": dict(second.identity) if second is not None else None,
        },
    )
