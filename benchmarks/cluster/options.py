"""The command lines of the cluster benchmarks. ``--help`` prints what a benchmark does and
exits instead of starting a run of many minutes; a bad value is refused before any work,
with one line and exit status 2.

``run.py`` and ``tta.py`` take the options that ``pdjax bench --cluster`` (and ``--tta``)
had before the harness left the installed package; ``auto.py`` takes none.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from pdjax.apps.commands import (
    PathOption,
    check_writable,
    positive_float,
    positive_floats,
    positive_int,
    seed_int,
    split_list,
)
from pdjax.errors import PdjaxError

#: ``--rates``, ``--fast-rate``: Mbit/s, at most 10 Tbit/s (faster than any link emulated).
MAX_RATE = 1e7
_WHY_RATE = "10 Tbit/s, faster than any link emulated"

#: The repository's results folder, where the runs behind docs/results.md are written.
RESULTS = Path(__file__).resolve().parents[1] / "results"

#: What ``run.py`` and ``tta.py`` write into ``--out``.
CLUSTER_FILES = ("cluster.json", "cluster.md", "cluster.png", "cluster-ranking.png")
TTA_FILES = ("tta.md", "tta.json")


def parse_no_options(description: str | None, argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (the process's arguments when None) for a benchmark without options."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.parse_args(argv)


def _parser(description: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )


def _parse(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, files: Sequence[str]
) -> argparse.Namespace:
    """Parses, then checks ``--rates`` and that ``--out`` and its ``files`` can be
    written; any refusal is argparse's one error line and exit status 2."""
    try:
        args = parser.parse_args(argv)
        args.rates = rates(args.rates)
        check_writable("--out", args.out, PdjaxError, folder=True)
        for name in files:
            check_writable("--out", str(Path(args.out) / name), PdjaxError)
    except PdjaxError as e:
        parser.error(str(e))
    return args


def _common(p: argparse.ArgumentParser, out: Path, rates_help: str) -> None:
    p.add_argument(
        "--rates", default="", help=f"link rates in Mbit/s, comma-separated ({rates_help})"
    )
    p.add_argument("--seed", action=seed_int, default=0, help="seeds the weights and the data")
    p.add_argument("--loopback", action="store_true", help="no link emulation, even as root")
    p.add_argument("--out", action=PathOption, default=str(out), help="folder for the results")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def rates(text: str) -> list[float]:
    """``--rates``: Mbit/s, comma-separated, each finite, > 0 and at most :data:`MAX_RATE`
    (empty: the benchmark's own)."""
    if not text.strip():
        return []
    got = positive_floats("--rates", text, unit="Mbit/s", noun="rate")
    if max(got) > MAX_RATE:
        raise PdjaxError(f"--rates {text!r}: each must be <= {MAX_RATE:g} Mbit/s ({_WHY_RATE})")
    return got


def parse_cluster(description: str | None, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``run.py``'s options (the cluster benchmark)."""
    p = _parser(description)
    _common(p, RESULTS, "default: each model's, benchmarks.harness.cluster.RATES")
    p.add_argument(
        "--fast-rate",
        action=positive_float(MAX_RATE, _WHY_RATE),
        default=10000.0,
        help="Mbit/s for experiment (a) (default: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        action=positive_int(1000, "each repeat times every runner"),
        default=3,
        help="round-robin repeats, medians (default: %(default)s)",
    )
    return _parse(p, argv, CLUSTER_FILES)


def parse_tta(description: str | None, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``tta.py``'s options (time to accuracy on the cluster); ``--studies`` is checked
    against the studies by the script."""
    p = _parser(description)
    _common(p, RESULTS / "cluster-tta", "default: 100, 1000 and 10000")
    p.add_argument(
        "--seeds",
        action=positive_int(16, "each seed is a whole set of training runs (tens of minutes)"),
        default=2,
        help="runs per configuration, seeds --seed, --seed + 1, ... (default: %(default)s)",
    )
    p.add_argument("--studies", default="", help="comma-separated (default: all)")
    args = _parse(p, argv, TTA_FILES)
    args.studies = split_list(args.studies)
    return args
