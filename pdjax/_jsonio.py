"""Files for pdjax's plain-data boxes (profiles, plans) and outputs: atomic writes and
appends that never go through a symbolic link, files at fixed names opened and read only
when they are regular files (:func:`open_regular`, :func:`read_regular`), checks of output
paths before any work, text reads, and typed field access that turns a bad value into a
clear error (file, field path, what to do)."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from pdjax.errors import PdjaxError

__all__ = [
    "FieldReader",
    "append_text",
    "check_file",
    "check_folder",
    "open_regular",
    "parse_json",
    "probe_writable",
    "read_regular",
    "read_text",
    "refuse_link",
    "write_atomic",
]

# Integers past 2**63 overflow the int64 and float64 arrays the planner builds from them;
# no byte count or layer index of a real model comes near.
MAX_INT = 2**63 - 1


def write_atomic(
    path: str | Path,
    data: str | bytes | Iterable[bytes | memoryview],
    *,
    what: str = "file",
    error: type[PdjaxError] = PdjaxError,
    before_replace: Callable[[], None] | None = None,
) -> None:
    """Writes ``data`` (text as UTF-8, bytes, or an iterable of byte chunks written one
    after the other, never all in memory) to ``path`` through a private temporary file,
    fsync and a rename, so a crash never leaves a half-written file where a good one was.
    An exception raised by the iterable (a chunk found bad) aborts the write as any other
    failure does. ``before_replace`` runs once everything is written and synced, just
    before the rename (a token file removes its stale side file there).

    The temporary file is made by :func:`tempfile.mkstemp` in the target's directory (a
    rename is only atomic within one file system): a fixed name such as ``<path>.tmp`` could
    be a symlink someone planted there (``/tmp`` is shared), which ``open`` would follow.
    A symbolic link at ``path`` itself is refused: writing through it would change a file
    pdjax did not name, and replacing it would delete what pdjax did not write. (A link
    planted after that check is replaced by the rename, never written through.) So is
    anything else than a regular file there (a FIFO, a device, a socket): the rename would
    delete it.

    Raises:
      error: the path cannot be written (a symbolic link, a directory, a FIFO or device,
        a read-only or uncreatable directory, a full disk); the message names the path. No
        temporary file is left behind.
    """
    path = Path(path)
    refuse_link(path, what, error)
    if path.is_dir():  # not a link (refused above): the path itself is a directory
        raise error(f"cannot write {what} {path}: it is a directory; give a file name")
    with contextlib.suppress(OSError):  # missing (or unreadable: the write says why)
        _refuse_irregular(path, os.lstat(path), what, "write", error)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(
            f"cannot write {what} {path}: cannot create the directory {path.parent}: "
            f"{e.strerror or e}"
        ) from e
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name + ".", suffix=".tmp")
    except OSError as e:
        raise error(f"cannot write {what} {path}: {e.strerror or e}") from e
    chunks: Iterable[bytes | memoryview]
    if isinstance(data, str):
        chunks = (data.encode("utf-8"),)
    elif isinstance(data, bytes):
        chunks = (data,)
    else:
        chunks = data
    try:
        # mkstemp makes the file 0600; give it the mode a plain open() would have.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            fd = -1  # the file object owns it now
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise error(f"cannot write {what} {path}: {e.strerror or e}") from e
        raise


def refuse_link(path: str | Path, what: str, error: type[PdjaxError] = PdjaxError) -> None:
    """Raises ``error`` if ``path`` is a symbolic link (pdjax writes neither through one
    nor over one: the link, and what it points to, are not pdjax's)."""
    if os.path.islink(path):
        raise error(
            f"cannot write {what} {path}: it is a symbolic link (to {os.readlink(path)}), "
            "and pdjax does not write through links or replace them; remove the link, or "
            "give another path"
        )


def open_regular(
    path: str | Path,
    flags: int,
    what: str,
    error: type[PdjaxError] = PdjaxError,
    *,
    mode: int = 0o666,
) -> int:
    """Opens a file that pdjax names itself (a lock, a cache entry, a marker, an output
    beside others) with ``os.open(path, flags, mode)``, only if it is a regular file: a
    symbolic link there is never followed (``O_NOFOLLOW``), a FIFO never waited on
    (``O_NONBLOCK``), and anything else than a regular file (a FIFO, a device, a socket, a
    folder) is refused: seen with ``lstat`` before opening (a device is not even opened)
    and with ``fstat`` after (what was opened, should the path change in between).
    ``O_CREAT`` in ``flags`` makes a missing file. Returns the descriptor (the caller
    closes it); its ``O_NONBLOCK`` changes nothing for a regular file.

    Raises:
      error: a symbolic link, not a regular file, or the open failed (missing, no
        permission); the message names ``what``, the path, what is there and what to do.
    """
    path = Path(path)
    verb = "read" if flags & os.O_ACCMODE == os.O_RDONLY else "write"
    try:
        _refuse_irregular(path, os.lstat(path), what, verb, error)
    except FileNotFoundError:
        pass  # O_CREAT makes it; otherwise the open says it is missing
    except OSError as e:
        raise error(f"cannot {verb} {what} {path}: {e.strerror or e}") from e
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    flags |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags, mode)
    except OSError as e:
        if os.path.islink(path):  # a link made since the check above (ELOOP)
            _refuse_irregular(path, os.lstat(path), what, verb, error)
        raise error(f"cannot {verb} {what} {path}: {e.strerror or e}") from e
    try:
        _refuse_irregular(path, os.fstat(fd), what, verb, error)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(
    path: str | Path, what: str, error: type[PdjaxError] = PdjaxError, *, max_bytes: int
) -> bytes:
    """The bytes of the regular file ``path``, which pdjax names itself, opened with
    :func:`open_regular` (no link followed, no FIFO or device read) and at most
    ``max_bytes`` long: a larger file is refused rather than read into memory.

    Raises:
      error: as :func:`open_regular`, or the file is larger than ``max_bytes``, or a read
        failed; the message names ``what`` and the path.
    """
    path = Path(path)
    fd = open_regular(path, os.O_RDONLY, what, error)
    try:
        chunks: list[bytes] = []
        got = -1 if os.fstat(fd).st_size > max_bytes else 0
        while 0 <= got <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    if not 0 <= got <= max_bytes:
        raise error(
            f"cannot read {what} {path}: it holds more than {max_bytes} bytes, more than "
            f"any {what} pdjax writes; is this the right file? Move it away"
        )
    return b"".join(chunks)


def _refuse_irregular(
    path: Path, info: os.stat_result, what: str, verb: str, error: type[PdjaxError]
) -> None:
    """Raises ``error`` unless ``info`` (``lstat`` or ``fstat`` of ``path``) is a regular
    file's."""
    if stat.S_ISREG(info.st_mode):
        return
    if stat.S_ISLNK(info.st_mode):
        try:
            target = f" (to {os.readlink(path)})"
        except OSError:
            target = ""
        raise error(
            f"cannot {verb} {what} {path}: it is a symbolic link{target}, and pdjax does "
            "not follow a link at a file it names itself; remove the link, or give "
            "another path"
        )
    kind = next((name for test, name in _KINDS if test(info.st_mode)), "something else")
    raise error(
        f"cannot {verb} {what} {path}: it is {kind}, not a regular file; move it away, or "
        "give another path"
    )


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def append_text(
    path: str | Path, text: str, *, what: str = "file", error: type[PdjaxError] = PdjaxError
) -> None:
    """Appends ``text`` to the regular file ``path`` (made if missing), never through a
    symbolic link (``O_NOFOLLOW``), in one ``write`` at the end (``O_APPEND``). A last line
    that a crash cut off (no newline at the end) is kept: ``text`` starts on a new line
    after it.

    Raises:
      error: a symbolic link, something else than a regular file, or a failed write;
        the message names the path.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(f"cannot write {what} {path}: {e.strerror or e}") from e
    fd = open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, what, error)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            text = "\n" + text  # a write that a crash cut off: start a line of our own
        raw = text.encode("utf-8")
        written = os.write(fd, raw)
        if written != len(raw):
            raise OSError(errno.EIO, f"wrote {written} of {len(raw)} bytes")
    except OSError as e:
        raise error(f"cannot write {what} {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)


def check_folder(
    folder: str | Path,
    option: str,
    error: type[PdjaxError] = PdjaxError,
    *,
    link: bool = False,
) -> None:
    """Refuses, before any work, a folder that a command would write in: a symbolic link
    there (pdjax writes in the folder named, not in one a link leads to; ``link=True``
    lets a link to a folder through), a file there, one under a file (or under a link to
    nothing), or one whose nearest existing folder cannot be written
    (:func:`probe_writable`). Only ``folder`` itself is looked at: links among its parents
    are followed, as for any path.

    Raises:
      error: naming ``option``, the folder, what is wrong and what to do.
    """
    folder = Path(folder)
    if not link and os.path.islink(folder):
        raise error(
            f"{option} {folder}: it is a symbolic link (to {os.readlink(folder)}), and pdjax "
            "does not write in a folder through a link; give the folder itself, or another "
            "path"
        )
    if os.path.lexists(folder) and not folder.is_dir():
        kind = "a link to nothing" if folder.is_symlink() else "a file"
        raise error(f"{option} {folder}: that is {kind}; give a folder")
    probe_writable(folder, folder, option, error)


def probe_writable(
    start: Path, shown: Path, option: str, error: type[PdjaxError] = PdjaxError
) -> None:
    """Refuses ``start``'s nearest existing folder (``start`` itself, or the first of its
    parents that exists) if it is not a folder or cannot be written, by making and
    deleting a private temporary file there: ``os.access`` answers for the real user id
    and says yes to root for a read-only folder. Messages name ``option`` and ``shown``.

    Raises:
      error: naming ``option``, ``shown``, the folder and what to do.
    """
    existing = start
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        kind = "a link to nothing" if existing.is_symlink() else "not a folder"
        raise error(
            f"{option} {shown}: {existing} is {kind}, so nothing can be written there; "
            "give another path"
        )
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".pdjax-write-test-")
    except OSError as e:
        raise error(
            f"{option} {shown}: cannot write in {existing} ({e.strerror or e}); give a "
            "folder you can write in"
        ) from e
    os.close(fd)
    os.unlink(probe)


def check_file(path: str | Path, option: str, error: type[PdjaxError] = PdjaxError) -> None:
    """Refuses, before any work, a file that a command would write or append to: a
    symbolic link, a folder, or something else than a regular file, there already. (Its
    folder is :func:`check_folder`'s, or :func:`probe_writable`'s.)

    Raises:
      error: naming ``option``, the path, what is wrong and what to do.
    """
    path = Path(path)
    _refuse_link_option(path, option, error)
    if path.is_dir():
        raise error(f"{option} {path}: that is a folder; give a file name")
    if os.path.lexists(path) and not path.is_file():
        raise error(f"{option} {path}: that is not a regular file; give another path")


def _refuse_link_option(path: Path, option: str, error: type[PdjaxError]) -> None:
    """Raises ``error`` naming ``option`` if ``path`` is a symbolic link."""
    if os.path.islink(path):
        raise error(
            f"{option} {path}: it is a symbolic link (to {os.readlink(path)}), and pdjax "
            "does not write through links or replace them; give another path"
        )


def _umask() -> int:
    # The only portable way to read the umask is to set it and put it back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_text(
    path: str | Path,
    what: str,
    error: type[PdjaxError],
    *,
    decode_error: type[PdjaxError] | None = None,
) -> str:
    """The UTF-8 text of ``path``; ``error`` naming ``what`` and the path (and for bytes that
    are not UTF-8, the line; ``decode_error`` then, if given) instead of a raw OSError or
    UnicodeDecodeError."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise (decode_error or error)(
            f"{path}:{line}: {what} is not UTF-8 text (byte 0x{data[e.start]:02x}); "
            "is this the right file?"
        ) from e


def parse_json(text: str, what: str, error: type[PdjaxError]) -> Any:
    """``json.loads`` that raises ``error`` naming ``what`` (e.g. "profile p.json")."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON: {e}") from e
    except RecursionError as e:
        raise error(f"{what}: JSON nested too deeply to read") from e


_MISSING: Any = object()


def describe_value(value: Any) -> str:
    """A short description of a JSON value for messages: its type and a bounded repr."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and len(str(abs(value))) > 30:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    names: dict[type, str] = {str: "string", list: "list", dict: "object"}
    return f"{names.get(type(value), type(value).__name__)} {text}"


class FieldReader:
    """Typed access to parsed JSON that raises ``error`` with the file and the field path
    (``layers[3].forward_seconds``) and what to do, instead of the TypeError or
    OverflowError a wrongly typed value would raise later (or the wrong result it would
    give silently: a negative time, a NaN size).

    Args:
      what: the file, e.g. ``"profile p.json"``.
      error: the error class to raise.
      advice: what to do, appended to every message (e.g. "re-create it with pdjax profile").
    """

    def __init__(self, what: str, error: type[PdjaxError], advice: str) -> None:
        self.what, self.error, self.advice = what, error, advice

    def fail(self, path: str, problem: str) -> NoReturn:
        raise self.error(f"{self.what}: {path}: {problem}; {self.advice}")

    def field(self, obj: Mapping[str, Any], key: str, path: str, default: Any = _MISSING) -> Any:
        """``obj[key]`` (``obj`` already checked to be a mapping), or ``default``."""
        if key in obj:
            return obj[key]
        if default is _MISSING:
            # "KeyError" keeps the wording of the messages older pdjax gave for this case.
            full = f"{path}.{key}" if path else key
            raise self.error(f"{self.what}: KeyError: missing field {full!r}; {self.advice}")
        return default

    def mapping(self, value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            self.fail(path, f"expected an object, got {describe_value(value)}")
        return value

    def array(self, value: Any, path: str, length: int | None = None) -> list[Any]:
        if not isinstance(value, list | tuple):
            self.fail(path, f"expected a list, got {describe_value(value)}")
        if length is not None and len(value) != length:
            self.fail(path, f"expected {length} entries, got {len(value)}")
        return list(value)

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            self.fail(path, f"expected a string, got {describe_value(value)}")
        return value

    def integer(self, value: Any, path: str, *, minimum: int | None = None) -> int:
        """An integer (a float with an integral value counts), at least ``minimum``."""
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"expected an integer, got {describe_value(value)}")
        if abs(value) > MAX_INT:
            self.fail(path, f"an integer of {len(str(abs(value)))} digits is too large")
        if minimum is not None and value < minimum:
            self.fail(path, f"must be at least {minimum}, got {value}")
        return value

    def number(self, value: Any, path: str, *, minimum: float | None = 0.0) -> float | int:
        """A finite number (int or float, returned as given so round trips stay exact), at
        least ``minimum`` (None: any sign)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(path, f"expected a number, got {describe_value(value)}")
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int too large for a float
            finite = False
        if not finite:
            self.fail(path, f"expected a finite number, got {describe_value(value)}")
        if minimum is not None and value < minimum:
            self.fail(path, f"must be at least {minimum:g}, got {value!r}")
        return value

    def optional_number(self, value: Any, path: str, *, minimum: float | None = 0.0) -> Any:
        return None if value is None else self.number(value, path, minimum=minimum)

    def plain(self, value: Any, path: str) -> Any:
        """Free-form JSON (a profile's ``meta``, a plan's ``options``): anything, as long as
        it writes back as strict JSON: no NaN or infinity, which ``json.loads`` accepts but
        the files' writers refuse."""
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(path, f"expected a finite number, got {describe_value(value)}")
        if isinstance(value, Mapping):
            for k, v in value.items():
                self.plain(v, f"{path}.{k}")
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                self.plain(v, f"{path}[{i}]")
        return value

    def unknown_keys(self, obj: Mapping[str, Any], known: set[str], path: str) -> None:
        unknown = sorted(str(k) for k in set(obj) - known)
        if unknown:
            self.fail(path or "top level", f"unknown fields {unknown}")
