"""A checkpoint folder's entries: which are pdjax's, deleting only those, and the lock of
the one run that writes the folder.

pdjax recognises what it wrote by its content, never by a name alone: each step folder,
from the moment orbax creates its temporary folder, holds the marker file
:data:`_MARKER` (``{"format": "pdjax.checkpoint", "step": N}``), written first. A step
of format version 1 to 3 (before the marker) is recognised by its metadata's format tag.
Anything else is left alone, whatever its name. The marker is a file of its own, not the
metadata, because it exists before anything else is written: the temporary folder of a
save that crashed at any point, and a step whose metadata was damaged, are still pdjax's
(the first is cleaned up, the second reported as damaged with the steps that verify).

Retention (``max_to_keep``) and the cleanup of unfinished saves are pdjax's own (orbax's,
which go by name, are off): a step is first renamed out of the steps
(``<step>.pdjax-deleting-...``) so that no reader lists a half-deleted step, then emptied
with its marker removed last, so that a folder left by a deletion cut short is still
recognisably pdjax's, and removed by the next writer.

Every file here at a fixed name (the marker, the metadata read for its format tag, the
lock) is opened only if it is a regular file (:func:`pdjax._jsonio.open_regular`): a
symbolic link there is never followed, a FIFO never waited on, a device never read, and
reads are bounded in size.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import orbax.checkpoint as ocp

from pdjax._jsonio import open_regular, read_regular
from pdjax.errors import CheckpointError
from pdjax.runners.checkpoint.format import FORMAT, META_FILE

# The file that marks a folder as a pdjax step (or the temporary folder of one).
_MARKER = "pdjax-step.json"
# The writer's lock file, in the checkpoint folder.
_LOCK_FILE = "pdjax.lock"
# The format tag of the lock file's content.
_LOCK_FORMAT = "pdjax.checkpoint.lock"
# The most bytes read of a marker or a lock file (pdjax writes a line of JSON), and of a
# step's metadata read for its format tag (a few hundred bytes per array).
_SMALL_FILE = 1 << 16
_META_BYTES = 1 << 28
# A folder name orbax's CheckpointManager takes for a step (its standard name format).
_STEP_NAME = re.compile(r"0|[1-9]\d*")
# orbax's temporary folder of a step being written (``-<timestamp>`` in some versions).
TMP_SUFFIX: str = ocp.path.atomicity.TMP_DIR_SUFFIX
_UNFINISHED = re.compile(rf"(0|[1-9]\d*){re.escape(TMP_SUFFIX)}(-\d+)?")
# A step being deleted by pdjax's retention.
_DELETING = re.compile(r"(0|[1-9]\d*)\.pdjax-deleting-\d+-\d+")


def _read_json(file: Path, max_bytes: int = _SMALL_FILE) -> Any:
    """The JSON in ``file``, or None when it is missing, unreadable, not a regular file
    (a link, a FIFO, a device) or larger than ``max_bytes``."""
    try:
        return json.loads(read_regular(file, "file", CheckpointError, max_bytes=max_bytes))
    except (CheckpointError, ValueError):  # UnicodeDecodeError, JSONDecodeError: ValueErrors
        return None


def _marker_step(folder: Path) -> int | None:
    """The step that ``folder``'s pdjax marker names, or None without a pdjax marker."""
    got = _read_json(folder / _MARKER)
    if not isinstance(got, dict) or got.get("format") != FORMAT:
        return None
    step = got.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _has_pdjax_meta(folder: Path, item: str = META_FILE[0]) -> bool:
    """Whether ``folder`` holds metadata with pdjax's format tag (a step of any version)."""
    got = _read_json(folder / item / META_FILE[1], _META_BYTES)
    return isinstance(got, dict) and got.get("format") == FORMAT


def _is_dir(entry: Path) -> bool:
    return entry.is_dir() and not entry.is_symlink()


def _is_pdjax_step(entry: Path) -> bool:
    """Whether a step-named folder is pdjax's: it holds pdjax's marker (whatever step the
    marker names: a folder renamed to another step is pdjax's, and damaged) or, written
    before markers existed, metadata with pdjax's format tag."""
    return _is_dir(entry) and (_marker_step(entry) is not None or _has_pdjax_meta(entry))


def _is_pdjax_leftover(entry: Path) -> bool:
    """Whether ``entry`` is the temporary folder of an unfinished pdjax save of step N
    (``N.orbax-checkpoint-tmp``, marked as step N), or a step whose deletion was cut
    short (``N.pdjax-deleting-...``, marked as step N)."""
    match = _UNFINISHED.fullmatch(entry.name) or _DELETING.fullmatch(entry.name)
    if match is None or not _is_dir(entry):
        return False
    marked = _marker_step(entry)
    if marked is not None:
        return marked == int(match[1])
    if not (entry / _MARKER).exists():  # written before markers: its metadata's tag
        return any(_has_pdjax_meta(entry, item) for item in ("meta", "meta" + TMP_SUFFIX))
    return False


def check_folder(directory: Path) -> None:
    """Refuses a folder holding step-named entries that pdjax did not write: orbax would
    take them for steps."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory} is a file, not a folder; give the Checkpointer an empty or new folder"
        )
    strangers = [
        entry.name
        for entry in sorted(directory.iterdir())
        if _STEP_NAME.fullmatch(entry.name) and not _is_pdjax_step(entry)
    ]
    if strangers:
        raise CheckpointError(
            f"{directory} holds {', '.join(repr(n) for n in strangers)}, named like "
            f"checkpoint steps but without pdjax's marker ({_MARKER}) or metadata "
            f"({'/'.join(META_FILE)}): not pdjax checkpoints, which orbax would take for "
            "steps; pick an empty or new folder for the checkpoints, or move them out of "
            "this one"
        )


def _remove_entry(entry: Path) -> None:
    if _is_dir(entry):
        shutil.rmtree(entry)
    else:
        entry.unlink()


def _remove_pdjax_folder(folder: Path) -> None:
    """Deletes a folder pdjax wrote (a step, or a leftover): its metadata, then its
    marker, last, so that a deletion cut short leaves a folder still recognisably pdjax's."""
    last = ("meta", "meta" + TMP_SUFFIX, _MARKER)
    for entry in sorted(folder.iterdir()):
        if entry.name not in last:
            _remove_entry(entry)
    for name in last:
        if (folder / name).exists() or (folder / name).is_symlink():
            _remove_entry(folder / name)
    folder.rmdir()


def delete_step(directory: Path, step: int) -> None:
    """Deletes pdjax's step ``step`` (retention): renamed out of the steps first, so that
    no reader lists it half deleted. Leaves alone a step folder that is not pdjax's."""
    folder = directory / str(step)
    if not _is_pdjax_step(folder):
        return
    doomed = directory / f"{step}.pdjax-deleting-{os.getpid()}-{time.time_ns()}"
    os.rename(folder, doomed)
    _remove_pdjax_folder(doomed)


def remove_leftovers(directory: Path, step: int | None = None) -> list[str]:
    """Deletes the leftovers of pdjax's unfinished saves and deletions (of ``step`` only,
    if given); returns their names. Only the writer (holding the lock) calls it."""
    removed = []
    for entry in sorted(directory.iterdir()):
        match = _UNFINISHED.fullmatch(entry.name) or _DELETING.fullmatch(entry.name)
        if match is None or (step is not None and int(match[1]) != step):
            continue
        if _is_pdjax_leftover(entry):
            _remove_pdjax_folder(entry)
            removed.append(entry.name)
    return removed


def check_target(directory: Path, step: int) -> None:
    """Refuses to save ``step`` where something pdjax did not write is in the way: a
    folder or file named ``step`` (orbax would replace an empty folder), or orbax's
    temporary folder of ``step`` (orbax deletes it before writing)."""
    where = f"cannot save step {step} in {directory}"
    final = directory / str(step)
    if final.exists() or final.is_symlink():
        raise CheckpointError(
            f"{where}: it holds {final.name}, which is not a pdjax checkpoint (put there "
            "after this Checkpointer opened the folder?); move it out of the folder, or "
            "save under another step"
        )
    for entry in sorted(directory.iterdir()):
        match = _UNFINISHED.fullmatch(entry.name)
        if match is None or int(match[1]) != step or _is_pdjax_leftover(entry):
            continue
        raise CheckpointError(
            f"{where}: it holds {entry.name}, which is not pdjax's (it has no pdjax marker "
            f"{_MARKER} of step {step}); orbax writes step {step} in a folder of that "
            "name and would delete it first: move it out of the folder, or save under "
            "another step"
        )


def _write_marker(folder: Path, step: int) -> None:
    """Writes the marker in ``folder``, orbax's new temporary folder (never through a link
    there, never into a FIFO or device)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = open_regular(folder / _MARKER, flags, "the checkpoint marker", CheckpointError)
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps({"format": FORMAT, "step": step}).encode())


class MarkedTemporaryPath(ocp.path.atomicity.AtomicRenameTemporaryPath):  # type: ignore[misc]
    """orbax's atomic-rename temporary folder of a step, marked as pdjax's (the marker
    is written first, before any of the step's items), and never made over a folder that
    is not pdjax's (orbax would delete it). The folders of a step's items are orbax's own."""

    async def create(self) -> Any:
        final = Path(self.get_final())
        if _STEP_NAME.fullmatch(final.name) is None:  # an item's folder, inside a step
            return await super().create()
        tmp = Path(self.get())
        if (tmp.exists() or tmp.is_symlink()) and not _is_pdjax_leftover(tmp):
            raise CheckpointError(
                f"cannot save step {final.name} in {final.parent}: it holds {tmp.name}, "
                "which is not pdjax's; move it out of the folder, or save under another step"
            )
        path = await super().create()
        await asyncio.to_thread(_write_marker, tmp, int(final.name))
        return path


class PdjaxSteps(ocp.path.step.NameFormat):  # type: ignore[misc]
    """orbax's standard step names (``0``, ``1``, ...), listing only pdjax's steps: a
    folder of another name, or without pdjax's marker or metadata, is no step to orbax."""

    def __init__(self) -> None:
        self._standard = ocp.path.step.standard_name_format(temporary_path_cls=MarkedTemporaryPath)

    def build_name(self, step: int) -> str:
        return str(self._standard.build_name(step))

    def find_all(self, base_path: Any) -> Iterator[Any]:
        return (m for m in self._standard.find_all(base_path) if _is_pdjax_step(Path(m.path)))

    def find_step(self, base_path: Any, step: int) -> Any:
        found = self._standard.find_step(base_path, step)
        if not _is_pdjax_step(Path(found.path)):
            raise ValueError(f"no pdjax step {step} in {base_path}")
        return found


class WriterLock:
    """The advisory lock of the one run that writes a checkpoint folder: ``flock`` on the
    file :data:`_LOCK_FILE` there, which holds the holder's pid and host. The lock goes
    with the process that holds it (even killed), so a file left behind blocks nobody;
    the file is removed when the lock is released. Only a regular file is a lock file: a
    symbolic link there (pdjax would write through it), a FIFO or a device is refused."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / _LOCK_FILE
        self._file: IO[bytes] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def take(self) -> None:
        """Takes the lock (once; again is a no-op); raises naming the holder when another
        process (or another Checkpointer) holds it."""
        if self._file is not None:
            return
        for _ in range(10):
            fd = open_regular(
                self.path,
                os.O_RDWR | os.O_CREAT,
                "the checkpoint lock file",
                CheckpointError,
                mode=0o644,
            )
            file = os.fdopen(fd, "r+b")
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = self._holder(file)
                file.close()
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise self._taken(holder) from e
                warnings.warn(  # ENOLCK, EOPNOTSUPP: a filesystem without locks
                    f"cannot lock {self.path} ({e.strerror}): nothing stops another run "
                    "from writing this checkpoint folder at the same time",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return
            if self._is_ours(file):
                break
            file.close()  # the holder removed the file as we opened it: again, on the new one
        else:
            raise CheckpointError(f"cannot lock {self.path}: it keeps being replaced")
        text = file.read(_SMALL_FILE + 1).decode(errors="replace")
        if text.strip() and self._content(text) is None:
            file.close()
            raise CheckpointError(
                f"{self.path} is not pdjax's lock file (pdjax writes one there while a run "
                "saves checkpoints); move it out of the folder"
            )
        file.seek(0)
        file.truncate()
        me = {"format": _LOCK_FORMAT, "pid": os.getpid(), "host": socket.gethostname()}
        file.write(json.dumps(me).encode())
        file.flush()
        self._file = file

    def release(self) -> None:
        """Removes the lock file and releases the lock (if held)."""
        if self._file is None:
            return
        file, self._file = self._file, None
        try:
            if self._is_ours(file):
                self.path.unlink()
        finally:
            file.close()

    def _is_ours(self, file: IO[bytes]) -> bool:
        """Whether the open ``file`` is the one at :attr:`path` now (not a link to it)."""
        with contextlib.suppress(FileNotFoundError):
            mine, there = os.fstat(file.fileno()), os.lstat(self.path)
            return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)
        return False

    @staticmethod
    def _content(text: str) -> dict[str, Any] | None:
        try:
            got = json.loads(text)
        except ValueError:
            return None
        return got if isinstance(got, dict) and got.get("format") == _LOCK_FORMAT else None

    def _holder(self, file: IO[bytes]) -> dict[str, Any]:
        return self._content(file.read(_SMALL_FILE).decode(errors="replace")) or {}

    def _taken(self, holder: Mapping[str, Any]) -> CheckpointError:
        """The refusal of a second writer, naming the lock's holder."""
        who = (
            f"pid {holder['pid']} on host {holder['host']}"
            if "pid" in holder and "host" in holder
            else "a process that has not written its name in the lock file yet"
        )
        if (holder.get("pid"), holder.get("host")) == (os.getpid(), socket.gethostname()):
            return CheckpointError(
                f"{self.path.parent} is being written by another Checkpointer of this "
                f"process ({who}, holding the lock {self.path}): close() it before writing "
                "with this one, or write with that one"
            )
        return CheckpointError(
            f"{self.path.parent} is being written by another run ({who}, holding the lock "
            f"{self.path}): two runs saving into one folder would delete each other's "
            "saves; wait for that run to end (or stop it), or give this one another folder"
        )
