"""How a message names a setting: the way its reader gave it.

The training loop is a library call (:func:`pdjax.apps.train.train` of a
:class:`~pdjax.apps.train.TrainConfig`); ``pdjax train`` is a thin layer over it. A
message of the library names a setting as a Python keyword (``batch_size``,
``batch_size=33``, ``plan='auto'``); while a command runs (:func:`command_line`) the same
message names the command line's flag (``--batch-size``, ``--batch-size 33``,
``--plan auto``). :func:`setting` renders either; :data:`FLAGS` holds the names that
differ between the two.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from pathlib import PurePath
from typing import Any

__all__ = ["FLAGS", "command_line", "in_command_line", "setting"]

#: Keywords whose flag is not ``--`` and the keyword with ``-`` for ``_``: a
#: :class:`~pdjax.apps.train.TrainConfig` field, or an argument of
#: :func:`~pdjax.apps.train.train` (or of the output checks), and the flag of ``pdjax train``
#: that gives it. A schedule option (:data:`pdjax.schedules.spec.OPTIONS`) is given as
#: ``options={name: value}`` in Python; its flag comes from the spec's table (a bool on by
#: default as ``--no-name``).
FLAGS = {
    "learning_rate": "--lr",
    "metrics_path": "--out",
    "tensorboard_dir": "--tensorboard",
}

_COMMAND_LINE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "pdjax_command_line_wording", default=False
)


def in_command_line() -> bool:
    """Whether messages name flags now (inside :func:`command_line`)."""
    return _COMMAND_LINE.get()


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Messages made inside name the command line's flags (a command's ``run``), reset
    after."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def _option(name: str) -> Any:
    """The schedule option ``name`` (None: not one)."""
    from pdjax.schedules.spec import OPTIONS

    return OPTIONS.get(name)


def flag(name: str, value: Any = None) -> str:
    """The flag of keyword ``name`` (for a schedule option that is on by default and
    given ``False``: ``--no-name``)."""
    option = _option(name)
    if option is not None and option.default is True:
        return f"--no-{name.replace('_', '-')}"
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def _text(value: Any) -> str:
    """``value`` as the command line spells it (a float as ``%g``)."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _python(value: Any) -> str:
    """``value`` as Python spells it (a float as ``%g``, a path as its string's repr)."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, PurePath):
        return repr(str(value))
    return repr(value)


def setting(name: str, value: Any = None, *, quote: bool = False) -> str:
    """Setting ``name`` (a keyword), with ``value`` if given, as the reader gave it.

    In Python (the default): ``batch_size``, ``batch_size=33``, ``plan='auto'``,
    ``straight=True``, ``learning_rate=0.5``, ``options={'weight_stashing': False}``.
    Inside :func:`command_line`: ``--batch-size``, ``--batch-size 33``, ``--plan auto``,
    ``--straight`` (a flag of a boolean setting takes no value), ``--lr 0.5``,
    ``--no-weight-stashing``. ``quote``: the command line's value quoted as Python's
    (``--optimizer 'pkg.mod:fn'``), where a value of the user's own is named."""
    option = _option(name)
    if in_command_line():
        if isinstance(value, bool) or (value is None and option is not None):
            return flag(name, value)
        text = flag(name)
        if value is None:
            return text
        return f"{text} {repr(str(value)) if quote else _text(value)}"
    if option is not None:
        return f"options[{name!r}]" if value is None else f"options={{{name!r}: {value!r}}}"
    return name if value is None else f"{name}={_python(value)}"
