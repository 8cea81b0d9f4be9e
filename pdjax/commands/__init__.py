"""The CLI's subcommands; each module has ``register(subparsers)`` and ``run(args)``.

Helpers they share: :class:`HelpFormatter` (every parser's), the ``--model`` / ``--config``
options (:func:`add_model_arguments`) and comma-separated lists (:func:`split_list`).
"""

from __future__ import annotations

import argparse
import importlib

__all__ = [
    "COMMANDS",
    "HelpFormatter",
    "add_model_arguments",
    "register_all",
    "split_list",
]

#: Subcommand modules, in the order the help lists them.
COMMANDS = ("profile", "calibrate", "plan", "simulate", "train", "bench")


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
        help="model size for bundled models, tiny or paper; passed to a factory that "
        "takes config as config=",
    )


def split_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``: a comma-separated option (as ``train
    --compare`` reads it)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def register_all(subparsers: argparse._SubParsersAction) -> None:
    """Adds every subcommand to ``subparsers``."""
    for name in COMMANDS:
        importlib.import_module(f"pdjax.commands.{name}").register(subparsers)
