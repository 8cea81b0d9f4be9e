"""The CLI's subcommands; each module has ``register(subparsers)`` and ``run(args)``."""

from __future__ import annotations

import argparse
import importlib

__all__ = ["COMMANDS", "register_all"]

#: Subcommand modules, in the order the help lists them.
COMMANDS = ("profile", "calibrate", "plan", "simulate", "train", "bench")


def register_all(subparsers: argparse._SubParsersAction) -> None:
    """Adds every subcommand to ``subparsers``."""
    for name in COMMANDS:
        importlib.import_module(f"pdjax.commands.{name}").register(subparsers)
