"""The command tests' CLI shortcut: one subcommand's parser, parsed and run without
``pdjax.apps.cli.main``'s error handling, so a test sees the exception itself."""

from __future__ import annotations

import argparse
import importlib


def run_command(command: str, *argv: str) -> int:
    """Runs ``pdjax COMMAND ARGV...`` with only ``command`` registered; returns its code."""
    parser = argparse.ArgumentParser(prog="pdjax")
    module = importlib.import_module(f"pdjax.apps.commands.{command}")
    module.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([command, *argv])
    code: int = args.func(args)
    return code
