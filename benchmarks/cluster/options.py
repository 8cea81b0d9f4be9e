"""The command line the cluster benchmarks share: none. ``--help`` prints what a benchmark
does and exits instead of starting a run of many minutes, and any argument is refused."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def parse_no_options(description: str | None, argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (the process's arguments when None) for a benchmark without options."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.parse_args(argv)
