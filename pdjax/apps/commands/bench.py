"""``pdjax bench``: measured throughput of every schedule and of data parallelism, next to
the simulator's prediction for the same plan.

pdjax bench --model cnn --config tiny --devices 4 --batch-size 64 --microbatches 4
pdjax bench --model gpt --plan even --steps 20 --json
pdjax bench --model mypkg.models:build --devices 2 --schedules 1f1b,dp   # a model of your own

It measures the user's own model on the user's own devices, so it is a command of the
installed package. The cluster benchmarks (worker processes on emulated links, time to
accuracy on them) are not: they are scripts of the repository, on its benchmark harness
(``python benchmarks/cluster/run.py``, ``benchmarks/cluster/tta.py``).
"""

from __future__ import annotations

import argparse
import json
import sys

from pdjax.apps.commands import (
    HelpFormatter,
    PathOption,
    add_model_arguments,
    check_readable,
    seed_int,
    split_list,
)
from pdjax.apps.commands.train import (
    BATCH,
    CHUNKS,
    DEVICES,
    MICROBATCHES,
    REPEATS,
    STEPS,
    set_cpu_devices,
)
from pdjax.errors import PdjaxError

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``bench`` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="measured throughput of every schedule and DP vs the simulator",
        description="Time every pipeline schedule and data parallelism on synthetic data "
        "(a warm-up call, then round-robin repeats, medians) and print samples/s measured "
        "next to the simulator's prediction for the same plan, and the driver's host "
        "seconds per dispatched action. (The cluster benchmark, worker processes on "
        "emulated links, is a script of pdjax's repository: benchmarks/cluster/run.py.)",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # a prefix is refused, not read as an option
    )
    add_model_arguments(p, default="cnn")
    _add_run_options(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=run)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """What to run and how long: devices, batch, plan, schedules, steps and repeats."""
    from pdjax.apps.bench import BENCH_SCHEDULES

    p.add_argument("--devices", action=DEVICES, default=4, help="devices to use (CPU: simulated)")
    p.add_argument("--batch-size", action=BATCH, default=64, help="samples per optimizer step")
    p.add_argument(
        "--microbatches", action=MICROBATCHES, default=4, help="M: microbatches per step"
    )
    p.add_argument(
        "--plan",
        action=PathOption,
        default="auto",
        help="'auto' (profile + PipeDream's planner), 'even' (one device per stage), or "
        "plan.json; every schedule runs this plan",
    )
    p.add_argument(
        "--straight", action="store_true", help="--plan auto without replication: a pure pipeline"
    )
    p.add_argument("--chunks", action=CHUNKS, default=2, help="v for interleaved")
    p.add_argument("--steps", action=STEPS, default=10, help="optimizer steps timed per repeat")
    p.add_argument("--repeats", action=REPEATS, default=3, help="round-robin repeats (medians)")
    p.add_argument(
        "--schedules",
        default=",".join((*BENCH_SCHEDULES, "dp")),
        help="comma-separated runners, in order ('dp' is data parallelism)",
    )
    p.add_argument(
        "--seed", action=seed_int, default=0, help="seeds the synthetic batch and weights"
    )


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark and prints the table (or JSON)."""
    if args.plan not in ("auto", "even"):
        check_readable("--plan", args.plan, PdjaxError)
    from pdjax.models import check_model_name

    check_model_name(args.model)
    set_cpu_devices(args.devices)
    from rich.console import Console

    from pdjax.apps.bench import bench, format_table

    err = Console(file=sys.stderr)
    schedules = split_list(args.schedules)

    def on_row(name: str) -> None:
        if not args.json:
            err.print(f"compiling {name} ...")

    result = bench(
        args.model,
        args.config,
        devices=args.devices,
        batch_size=args.batch_size,
        microbatches=args.microbatches,
        plan=args.plan,
        straight=args.straight,
        chunks=args.chunks,
        steps=args.steps,
        repeats=args.repeats,
        schedules=schedules,
        seed=args.seed,
        on_row=on_row,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 180)
    console.print(result.header())
    console.print(format_table(result))
    return 0
