"""The CLI's subcommands; each module has ``register(subparsers)`` and ``run(args)``.

Helpers they share: :class:`HelpFormatter` (every parser's), the ``--model`` / ``--config``
options (:func:`add_model_arguments`), comma-separated lists (:func:`split_list`,
:func:`positive_floats`), and bounded numeric options: argparse ``action=`` classes
(:func:`int_range`, :func:`positive_int`, :func:`float_range`, :func:`positive_float`,
:data:`seed_int`) raising :class:`OptionError` with the option, the bound and why, and
:func:`check_bound` for bounds that depend on several options. Paths: every path option
takes ``action=``:class:`PathOption` (an empty or blank path is refused, not read as "off"),
and :func:`check_writable` and :func:`check_readable` check output and input files before
any work. Every parser is made with ``allow_abbrev=False``: an option is spelled out in
full (``--local 2`` is refused, not read as ``--local-processes 2``).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdjax._jsonio import check_file, check_folder, probe_writable
from pdjax.errors import OptionError, PdjaxError

__all__ = [
    "COMMANDS",
    "MAX_DEVICES",
    "MAX_NAME",
    "MAX_PROFILE_BATCH",
    "MAX_SEED",
    "MAX_SIM_PASSES",
    "HelpFormatter",
    "OptionError",
    "PathOption",
    "add_model_arguments",
    "add_option_flags",
    "check_bound",
    "check_readable",
    "check_writable",
    "float_range",
    "int_range",
    "option_values",
    "positive_float",
    "positive_floats",
    "positive_int",
    "register_all",
    "seed_int",
    "split_list",
]

#: Subcommand modules, in the order the help lists them.
COMMANDS = ("profile", "calibrate", "plan", "simulate", "train", "bench", "generate")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``argparse.ArgumentDefaultsHelpFormatter`` (each option's help ends with its
    default) that leaves out defaults that say nothing: ``None`` and ``""``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == "":
            return action.help
        return super()._get_help_string(action)


def _model_help() -> str:
    from pdjax.models import MODELS

    return (
        f"a bundled model ({', '.join(MODELS)}), or your own as package.module:factory "
        "(or path/to/file.py:factory): a function returning a pdjax.models.ModelSpec or "
        "CustomModel(layers=pdjax.sequential(...), loss=..., sample_batch=(x, y), "
        "accuracy=...), imported with the current directory on the path; it gets "
        "config= (and for train seq_len=) if it takes them"
    )


def add_model_arguments(
    parser: argparse.ArgumentParser,
    *,
    default: str | None = None,
    required: bool = False,
    group: argparse._MutuallyExclusiveGroup | None = None,
) -> None:
    """Adds ``--model`` (a bundled name or ``package.module:factory``, checked when the
    command runs, not by argparse; into ``group`` if given) and ``--config``."""
    (group or parser).add_argument(
        "--model",
        default=default,
        required=required,
        metavar="MODEL",
        help=_model_help(),
    )
    parser.add_argument(
        "--config",
        default="tiny",
        help="model size for bundled models, tiny or paper (llama: also small); passed to "
        "a factory that takes config as config=",
    )


def split_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``: a comma-separated option (as ``train
    --compare`` reads it)."""
    return [part.strip() for part in text.split(",") if part.strip()]


# -- numeric options ----------------------------------------------------------------------
# argparse ``action=`` classes: a bad value raises :class:`OptionError` out of parse_args,
# and ``pdjax.apps.cli.main`` prints one line naming the option, the bound and why (exit 2)
# instead of a traceback or a run that cannot finish.

#: The most devices a command simulates on CPU (``jax_num_cpu_devices``) or plans for.
MAX_DEVICES = 512
#: The most microbatch-stage passes (``M x steps x P x v``) a schedule may simulate: the
#: simulator plays a few thousand per second, so this many take about half a minute.
MAX_SIM_PASSES = 100_000
#: The most samples in a batch profiled now (``--batch-size``, ``--microbatch-size``): the
#: sample batch and every layer's activations are allocated at once.
MAX_PROFILE_BATCH = 4096
#: The largest seed: numpy's and JAX's generators take unsigned 32-bit seeds.
MAX_SEED = 2**32 - 1


class _BoundedAction(argparse.Action):
    """Stores an int or a finite float within bounds (set by :func:`_bounded`)."""

    kind: type[int] | type[float] = int
    lo: float | None = None
    hi: float | None = None
    lo_open = False
    why = ""
    error: type[OptionError] = OptionError

    @classmethod
    def bound(cls) -> str:
        what = "an integer" if cls.kind is int else "a finite number"
        parts = []
        for op, x in ((">" if cls.lo_open else ">=", cls.lo), ("<=", cls.hi)):
            if x is not None:
                parts.append(f"{op} {x if cls.kind is int else format(x, 'g')}")
        return f"{' and '.join(parts)} ({what}" if parts else f"{what} ("

    @classmethod
    def parse(cls, text: str) -> int | float | None:
        """The value, or None if it is not one of ``kind`` within the bounds."""
        try:
            value = cls.kind(text.strip())
        except (TypeError, ValueError, OverflowError):
            return None
        if not math.isfinite(value):
            return None
        if cls.lo is not None and not (value > cls.lo if cls.lo_open else value >= cls.lo):
            return None
        if cls.hi is not None and value > cls.hi:
            return None
        return value

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        text = str(values)
        value = self.parse(text)
        if value is None:
            shown = text if len(text) <= 40 else text[:37] + "..."
            why = f"; {self.why})" if self.why else ")"
            option = option_string or self.dest
            message = f"{option} must be {self.bound()}{why}, got {shown!r}"
            raise self.error(message, parser.prog)
        setattr(namespace, self.dest, value)


def _bounded(
    kind: type[int] | type[float],
    lo: float | None,
    hi: float | None,
    *,
    lo_open: bool = False,
    why: str = "",
    error: type[PdjaxError] | None = None,
) -> type[argparse.Action]:
    attrs = {"kind": kind, "lo": lo, "hi": hi, "lo_open": lo_open, "why": why}
    if error is not None:  # raised as an OptionError that is also the command's error
        attrs["error"] = type(error.__name__, (OptionError, error), {})
    return type("BoundedAction", (_BoundedAction,), attrs)


def int_range(
    lo: int, hi: int | None = None, why: str = "", error: type[PdjaxError] | None = None
) -> type[argparse.Action]:
    """An argparse ``action=``: an integer in ``lo..hi`` (``why``: the reason for ``hi``;
    ``error``: a PdjaxError subclass the OptionError is also an instance of)."""
    return _bounded(int, lo, hi, why=why, error=error)


def positive_int(
    hi: int | None = None, why: str = "", error: type[PdjaxError] | None = None
) -> type[argparse.Action]:
    """An argparse ``action=``: an integer ``>= 1`` (and ``<= hi``)."""
    return _bounded(int, 1, hi, why=why, error=error)


def float_range(
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    why: str = "",
    error: type[PdjaxError] | None = None,
) -> type[argparse.Action]:
    """An argparse ``action=``: a finite float in ``[lo, hi]`` (``(lo, hi]`` with
    ``lo_open``); NaN and infinities are refused."""
    return _bounded(float, lo, hi, lo_open=lo_open, why=why, error=error)


def positive_float(
    hi: float | None = None, why: str = "", error: type[PdjaxError] | None = None
) -> type[argparse.Action]:
    """An argparse ``action=``: a finite float ``> 0`` (and ``<= hi``)."""
    return _bounded(float, 0.0, hi, lo_open=True, why=why, error=error)


def add_option_flags(p: Any, names: Sequence[str] | None = None) -> None:
    """The flags of the schedule kinds' own options (:data:`pdjax.schedules.spec.OPTIONS`,
    ``names`` of them, default all), one each, written from the spec's table: a bool that
    is off by default as ``--name``, one on by default as ``--no-name``, an integer as
    ``--name N`` (bounded), a text as ``--name`` with its choices. Each lands on ``args``
    under the option's own name (:func:`option_values` reads them)."""
    from pdjax.schedules.spec import OPTIONS, option_owners

    for name in names or OPTIONS:
        option, flag = OPTIONS[name], name.replace("_", "-")
        text = f"{option_owners(name)}: {option.help}"
        if option.default is False:
            p.add_argument(f"--{flag}", dest=name, action="store_true", help=text)
        elif option.default is True:
            off = f"{option_owners(name)}: {option.off or 'off'}"
            p.add_argument(f"--no-{flag}", dest=name, action="store_false", help=off)
        elif option.choices is not None:
            p.add_argument(
                f"--{flag}", dest=name, default=option.default, choices=option.choices, help=text
            )
        else:
            action = int_range(option.default, option.most, option.why)
            p.add_argument(
                f"--{flag}", dest=name, action=action, default=option.default, metavar="N",
                help=text,
            )  # fmt: skip


def option_values(args: Any, names: Sequence[str] | None = None) -> dict[str, Any]:
    """The values :func:`add_option_flags`' flags put on ``args`` (``names`` of them)."""
    from pdjax.schedules.spec import OPTIONS

    return {name: getattr(args, name) for name in names or OPTIONS}


#: ``--seed``: an unsigned 32-bit integer.
seed_int = int_range(0, MAX_SEED, "seeds are unsigned 32-bit integers")


def positive_floats(
    option: str,
    text: str,
    *,
    unit: str,
    noun: str = "value",
    error: type[PdjaxError] = PdjaxError,
    count: int | None = None,
) -> list[float]:
    """A comma-separated option of finite numbers > 0 (``--bandwidths``, ``--rates``);
    empty parts are skipped.

    Raises:
      error: a part is not a number, or not finite and > 0, or (with ``count``) there are
        not ``count`` of them.
    """
    parts = split_list(text)
    values: list[float] = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise error(
                f"{option} {text!r}: each {noun} must be a positive finite number, got "
                f"{part!r}; give {unit}, comma-separated (e.g. 1e10,1.25e9)"
            )
        values.append(value)
    if not values:
        raise error(f"{option} {text!r}: give at least one number ({unit}), comma-separated")
    if count is not None and len(values) != count:
        raise error(f"{option} gives {len(values)} values for {count} level(s); give one each")
    return values


def check_bound(
    option: str, value: float, bound: float, why: str, error: type[PdjaxError] = PdjaxError
) -> None:
    """Raises ``error`` naming ``option``, ``value``, ``bound`` and ``why`` if ``value``
    exceeds ``bound``."""
    if value > bound:

        def show(x: float) -> str:
            whole = isinstance(x, int) or (float(x).is_integer() and x < 1e15)
            return f"{x:,}" if whole else f"{x:.4g}"

        raise error(f"{option}: {show(value)} is above the bound of {show(bound)}: {why}")


#: The longest name (one part of a path) file systems take, in bytes (ext4, XFS, APFS, NTFS).
MAX_NAME = 255


class PathOption(argparse.Action):
    """An argparse ``action=`` for every option that takes a path: refuses (raising
    :class:`OptionError` while parsing, before any work) an empty or blank path, which
    would otherwise quietly turn the option off or name the current folder, and one no
    file system takes: a NUL character in it, or a name longer than :data:`MAX_NAME`
    bytes."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        text = str(values)
        option = option_string or self.dest
        if not text.strip():
            what = "an empty path" if not text else "a blank path"
            raise OptionError(
                f"{option} {text!r}: {what}; give a path, or leave {option} out", parser.prog
            )
        if "\0" in text:
            raise OptionError(
                f"{option} {text[:40]!r}: a path cannot hold a NUL character; give another path",
                parser.prog,
            )
        try:
            longest = max(len(os.fsencode(part)) for part in Path(text).parts)
        except UnicodeError:
            raise OptionError(
                f"{option} {text[:40]!r}: not a name this system can encode; give another path",
                parser.prog,
            ) from None
        if longest > MAX_NAME:
            raise OptionError(
                f"{option} {text[:40]!r}...: a name in it is {longest} bytes long, and file "
                f"systems take {MAX_NAME} at most; give another path",
                parser.prog,
            )
        setattr(namespace, self.dest, text)


def check_writable(
    option: str,
    path: str | None,
    error: type[PdjaxError] = OptionError,
    *,
    folder: bool = False,
) -> None:
    """Raises ``error`` (before any work) if the file ``path`` given with ``option`` (with
    ``folder``: the folder) could not be written: a symbolic link (pdjax neither writes
    through one nor replaces it), a folder where a file goes (a file where a folder goes),
    something else than a regular file, or a path whose nearest existing folder is a file,
    a link to nothing, or cannot be written in. Writability is tried, not guessed: a
    private file is made there and removed (``os.access`` says yes to root for a read-only
    folder, and knows nothing of read-only mounts). Missing folders are fine: the writers
    create them. ``path`` None: nothing to check.
    """
    if path is None:
        return
    _check_name(option, path, error)
    try:
        _check_writable(option, Path(path), error, folder=folder)
    except OSError as e:  # a name too long, a loop of links, ...
        raise error(f"{option} {path}: {e.strerror or e}; give another path") from e


def _check_name(option: str, path: str, error: type[PdjaxError]) -> None:
    """Refuses a path that names no file: empty or blank, holding a NUL character, or
    one this system cannot encode (the checks after would take it for a missing file)."""
    if not path.strip() or "\0" in path:
        raise error(f"{option} {path[:40]!r}: not a path; give a file name")
    try:
        os.fsencode(path)
    except UnicodeEncodeError as e:
        raise error(
            f"{option} {path[:40]!r}: not a name this system can encode; give another path"
        ) from e


def _check_writable(option: str, target: Path, error: type[PdjaxError], *, folder: bool) -> None:
    if folder:
        check_folder(target, option, error, link=False)
    else:
        check_file(target, option, error)
        probe_writable(target.parent, target, option, error)


def check_readable(option: str, path: str | None, error: type[PdjaxError] = OptionError) -> None:
    """Raises ``error`` (before any work) if the input file ``path`` given with ``option``
    cannot be read: missing, a folder, or not openable. ``None`` and ``pipedream:NAME`` (a
    shipped profile) are not files and pass."""
    if path is None or path.startswith("pipedream:"):
        return
    _check_name(option, path, error)
    try:
        if Path(path).is_dir():
            raise error(f"{option} {path}: that is a folder; give a file")
        with open(path, "rb"):
            pass
    except OSError as e:
        raise error(f"{option} {path}: cannot read it ({e.strerror or e}); give a file") from e


def register_all(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds every subcommand to ``subparsers``."""
    for name in COMMANDS:
        importlib.import_module(f"pdjax.apps.commands.{name}").register(subparsers)
