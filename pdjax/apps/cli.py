"""``pdjax`` command line: ``pdjax profile | calibrate | plan | simulate | train | bench``.

The logic lives in the library; each subcommand in :mod:`pdjax.apps.commands` only parses
arguments, calls it and prints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pdjax import __version__
from pdjax.apps.commands import HelpFormatter, OptionError, register_all
from pdjax.errors import PdjaxError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser."""
    parser = argparse.ArgumentParser(
        prog="pdjax",
        description="PipeDream-style pipeline-parallel training on JAX/Flax: "
        "profile -> plan -> simulate -> train. 'pdjax COMMAND --help' for each command.",
        formatter_class=HelpFormatter,
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


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (2 for a pdjax error, with its message: an
    option out of its bounds, found while parsing, is one too). argparse's own errors
    (an unknown option, a missing value) exit 2 through SystemExit, after its usage line."""
    try:
        args = build_parser().parse_args(argv)
    except OptionError as e:
        print(f"{e.command}: error: {e}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except PdjaxError as e:
        print(f"pdjax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
