"""``pdjax`` command line: ``pdjax profile | calibrate | plan | simulate | train | bench
| generate``.

The logic lives in the library; each subcommand in :mod:`pdjax.apps.commands` only parses
arguments, calls it and prints.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from pdjax import __version__
from pdjax.apps.commands import HelpFormatter, OptionError, register_all
from pdjax.distributed import LaunchInterrupted, lost_peer, say
from pdjax.errors import PdjaxError

__all__ = ["DEBUG_ENV", "INTERRUPTED", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser. No parser takes abbreviations (``allow_abbrev=False``
    here and in every command's): ``--local 2`` is refused, not read as
    ``--local-processes 2``."""
    parser = argparse.ArgumentParser(
        prog="pdjax",
        description="PipeDream-style pipeline-parallel training on JAX/Flax: "
        "profile -> plan -> simulate -> train. 'pdjax COMMAND --help' for each command.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"pdjax {__version__}",
        help="print pdjax's version and exit",
    )
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="what to do"
    )
    register_all(subparsers)
    for sub in subparsers.choices.values():  # the commands' own parsers set it too
        sub.formatter_class = HelpFormatter
    return parser


#: The exit status after Ctrl-C (``128 + SIGINT``, as a shell reports it).
INTERRUPTED = 130

#: Set (to anything but ``0``) to print the traceback of a pdjax error, and of what caused
#: it (a model factory's own exception, say), above its one-line message.
DEBUG_ENV = "PDJAX_DEBUG"


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _error(prefix: str, e: BaseException, status: int = 2) -> int:
    """Prints ``e`` as one line (after its traceback with :data:`DEBUG_ENV` set); returns
    ``status``. The line is one write (see :func:`pdjax.distributed.say`)."""
    if _debug():
        traceback.print_exception(e, file=sys.stderr)
    say(f"{prefix}: error: {e}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (2 for a pdjax error, with its message: an
    option out of its bounds, found while parsing, is one too). argparse's own errors
    (an unknown option, a missing value) exit 2 through SystemExit, after its usage line.
    Ctrl-C (KeyboardInterrupt) is one line and :data:`INTERRUPTED` (130); a launcher
    that got a signal ends its processes and exits ``128 +`` the signal's number; a
    worker of a run of several processes that lost another one (JAX's transfer error)
    is one line too (:func:`pdjax.distributed.lost_peer`). ``PDJAX_DEBUG=1`` prints the
    traceback (and its cause's) before the line.

    The command line parsed (``argv``, else ``sys.argv[1:]``) is kept on the namespace as
    ``cli_argv``: what ``pdjax train --local-processes`` starts its workers with."""
    given = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(given)
    except OptionError as e:
        return _error(e.command, e)
    args.cli_argv = given
    prefix = f"pdjax {args.command}"
    try:
        return int(args.func(args) or 0)
    except LaunchInterrupted as e:  # the launcher's signal, after it ended its processes
        return _error(prefix, e, 128 + e.signum)
    except PdjaxError as e:
        return _error(prefix, e)
    except KeyboardInterrupt as e:
        # what the command left is as its own cleanup left it: the checkpoints committed
        # before stay (a step is committed whole), its folder lock is released
        if _debug():
            traceback.print_exception(e, file=sys.stderr)
        say(f"{prefix}: interrupted (Ctrl-C)")
        return INTERRUPTED
    except Exception as e:
        lost = lost_peer(e)  # another process of the run died: one line, not JAX's stack
        if lost is None:
            raise
        return _error(prefix, lost)


if __name__ == "__main__":
    sys.exit(main())
