"""Orbax read failures, made readable: the array a failed read is about and one line on
why, and the silencing of the reads orbax abandons when another read fails (which would
otherwise print their whole TensorStore specs to stderr).
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def quiet_abandoned_reads() -> Iterator[None]:
    """Silences the reads orbax abandons when another read of the same restore fails: it
    drops their coroutines unfinished, and each, collected, prints its whole TensorStore
    spec to stderr as an "Exception ignored". Collects them here, so that a damaged step
    reports its one :class:`CheckpointError` (the caller collects them, with ``gc.collect``,
    once it has let go of the error); every other unraisable error still prints."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if getattr(unraisable.object, "__qualname__", "") == _ABANDONED_READ:
            return
        if _late_wakeup(unraisable):
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _late_wakeup(unraisable: Any) -> bool:
    """Whether ``unraisable`` is an abandoned read's TensorStore future finishing after
    orbax closed its event loop: TensorStore's own thread calls the dead loop's
    ``call_soon_threadsafe``, straight from native code (no Python caller), which raises
    "Event loop is closed". It can come at any time after the failed restore returned."""
    e = unraisable.exc_value
    if not isinstance(e, RuntimeError) or str(e) != "Event loop is closed":
        return False
    tb = e.__traceback__
    return tb is not None and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"


def drop_late_wakeups() -> None:
    """Once a restore has abandoned reads, silences their late wake-ups (see
    :func:`_late_wakeup`) for the rest of the process: installed once, on top of the
    hook in place then; every other unraisable error still reaches it."""
    global _late_wakeups_dropped
    if _late_wakeups_dropped:
        return
    _late_wakeups_dropped = True
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _late_wakeup(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook


_late_wakeups_dropped = False


# The orbax coroutine (one array chunk's read) whose abandoned instances are silenced.
_ABANDONED_READ = "_read_array_index_and_device_put"


def _error_texts(e: BaseException) -> list[str]:
    """The messages of ``e`` and the exceptions it was raised from."""
    texts, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        texts.append(str(cur))
        cur = cur.__cause__ or cur.__context__
    return texts


def failed_array(e: BaseException, names: Sequence[str]) -> str | None:
    """The array a TensorStore read error is about (its messages name the array's key in
    the OCDBT database, ``"<name>/<chunk>"``), if it is one of ``names``."""
    for text in _error_texts(e):
        for found in re.findall(r"Error reading \"([^\"]+)/[^/\"]*\"|'path': '([^']+)/'", text):
            name: str = found[0] or found[1]
            if name in names:
                return name
    return None


def reason(e: BaseException) -> str:
    """One line on why a read failed: TensorStore's own status line when there is one
    (orbax wraps it in a dump of the whole TensorStore spec), else the first line."""
    texts = _error_texts(e)
    line = next((t for t in texts if re.match(r"[A-Z_]+: ", t)), texts[-1] or type(e).__name__)
    lines = line.split("See full TensorStore details")[0].strip().splitlines()
    line = lines[0] if lines else type(e).__name__
    return line if len(line) <= 300 else line[:297] + "..."
