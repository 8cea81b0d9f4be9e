"""``pdjax bench``: measured throughput of every schedule and of data parallelism, next to
the simulator's prediction for the same plan.

pdjax bench --model cnn --config tiny --devices 4 --batch-size 64 --microbatches 4
pdjax bench --model gpt --plan even --steps 20 --json
pdjax bench --model mypkg.models:build --devices 2 --schedules 1f1b,dp   # a model of your own
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdjax.apps.commands import (
    HelpFormatter,
    PathOption,
    add_model_arguments,
    check_readable,
    check_writable,
    positive_float,
    positive_floats,
    positive_int,
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

#: ``--rates``, ``--fast-rate``: Mbit/s, at most 10 Tbit/s (faster than any link emulated).
MAX_RATE = 1e7

#: ``--seeds``: each seed is a whole set of runs.
seed_count = positive_int(16, "each seed is a whole set of training runs (tens of minutes)")

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``bench`` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="measured throughput of every schedule and DP vs the simulator",
        description="Time every pipeline schedule and data parallelism on synthetic data "
        "(a warm-up call, then round-robin repeats, medians) and print samples/s measured "
        "next to the simulator's prediction for the same plan, and the driver's host "
        "seconds per dispatched action.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # a prefix is refused, not read as an option
    )
    add_model_arguments(p, default="cnn")
    _add_run_options(p)
    _add_cluster_options(p)
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


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    """The group of ``--cluster`` options (and ``--tta``'s within it)."""
    c = p.add_argument_group(
        "a cluster on one machine",
        "--cluster: 2 worker processes, one core each, on emulated links (network namespaces "
        "and tc, as root; else loopback): PipeDream, 1F1B and data parallelism against one "
        "worker, measured next to the planner's and the simulator's predictions "
        "(pdjax.apps.cluster). Of the options above only --repeats, --seed and --json apply.",
    )
    c.add_argument("--cluster", action="store_true", help="run the cluster benchmark")
    c.add_argument(
        "--rates",
        default="",
        help="link rates in Mbit/s for every model (comma-separated; default: "
        "pdjax.apps.cluster.RATES, 1 and 10 Gbit/s for mlp-512, 100 Mbit/s and 1 Gbit/s "
        "for vgg-fc)",
    )
    c.add_argument(
        "--fast-rate",
        action=positive_float(MAX_RATE, _WHY_RATE),
        default=10000.0,
        help="Mbit/s for experiment (a)",
    )
    c.add_argument("--loopback", action="store_true", help="no link emulation, even as root")
    c.add_argument(
        "--tta",
        action="store_true",
        help="with --cluster: time to accuracy instead (pdjax.apps.cluster_tta): one worker, DP x2 "
        "and the planner's pipedream, 1f1b and 2bw pipelines train VGG on digits and a GPT "
        "on text to a target accuracy, per link (--rates, default 100, 1000 and 10000 "
        "Mbit/s) and seed; resumes from the runs already in --out",
    )
    c.add_argument(
        "--seeds",
        action=seed_count,
        default=2,
        help="with --tta: runs per configuration, seeds --seed, --seed + 1, ...",
    )
    c.add_argument(
        "--studies",
        default="",
        help="with --tta: comma-separated, of pdjax.apps.cluster_tta.STUDIES (default: all)",
    )
    c.add_argument(
        "--out",
        action=PathOption,
        default=None,
        help="folder for cluster.json/.md/.png (default out/cluster), or for --tta its runs "
        "and tta.md/.json/*.png (default out/cluster-tta)",
    )


_WHY_RATE = "10 Tbit/s, faster than any link emulated"


def _rates(text: str) -> list[float]:
    """``--rates``: Mbit/s, comma-separated, each finite, > 0 and at most :data:`MAX_RATE`."""
    if not text.strip():
        return []
    rates = positive_floats("--rates", text, unit="Mbit/s", noun="rate")
    if max(rates) > MAX_RATE:
        raise PdjaxError(f"--rates {text!r}: each must be <= {MAX_RATE:g} Mbit/s ({_WHY_RATE})")
    return rates


#: What ``--cluster`` (and ``--cluster --tta``) write into ``--out``.
_CLUSTER_FILES = ("cluster.json", "cluster.md", "cluster.png", "cluster-ranking.png")
_TTA_FILES = ("tta.md", "tta.json")


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark and prints the table (or JSON)."""
    _rates(args.rates)  # checked up front, with or without --cluster
    if args.tta and not args.cluster:
        raise PdjaxError("--tta is an option of --cluster: pdjax bench --cluster --tta")
    _check_paths(args)
    if args.cluster and args.tta:
        return _run_tta(args)
    if args.cluster:
        return _run_cluster(args)
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


def _check_paths(args: argparse.Namespace) -> None:
    """Refuses, before any work, an ``--out`` without ``--cluster`` (where nothing would
    be written), one that could not be written, and a ``--plan`` file that cannot be
    read."""
    if args.out is not None and not args.cluster:
        raise PdjaxError(
            f"--out {args.out}: only --cluster writes files; drop --out, or add --cluster"
        )
    if args.cluster:
        out = args.out or ("out/cluster-tta" if args.tta else "out/cluster")
        check_writable("--out", out, PdjaxError, folder=True)
        for name in _TTA_FILES if args.tta else _CLUSTER_FILES:
            check_writable("--out", str(Path(out) / name), PdjaxError)
    elif args.plan not in ("auto", "even"):
        check_readable("--plan", args.plan, PdjaxError)


def _run_tta(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console

    from pdjax.apps.cluster_tta import LINKS, STUDIES, report, run_tta

    studies = split_list(args.studies) or list(STUDIES)
    unknown = [s for s in studies if s not in STUDIES]
    if unknown:
        raise PdjaxError(f"--studies: unknown {unknown}; choose from {list(STUDIES)}")
    out = args.out or "out/cluster-tta"
    err = Console(file=sys.stderr)
    t0 = time.monotonic()
    run_tta(
        out,
        studies=studies,
        rates_mbit=_rates(args.rates) or LINKS,
        seeds=range(args.seed, args.seed + args.seeds),
        emulate=False if args.loopback else None,
        log=lambda line: err.print(f"[{time.monotonic() - t0:5.0f} s] {line}"),
    )
    paths = report(out, seconds=time.monotonic() - t0)
    if args.json:
        print(paths[1].read_text())
    else:
        print(paths[0].read_text())
        err.print("wrote " + "  ".join(str(p) for p in paths))
    return 0


def _run_cluster(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdjax.apps.cluster import MICROBATCH, format_markdown, run_cluster, write_results

    err = Console(file=sys.stderr)
    rates = _rates(args.rates)
    result = run_cluster(
        rates_mbit={m: rates for m in MICROBATCH} if rates else None,
        fast_mbit=args.fast_rate,
        repeats=args.repeats,
        seed=args.seed,
        emulate=False if args.loopback else None,
        log=lambda line: err.print(line),
    )
    paths = write_results(result, args.out or "out/cluster")
    if args.json:
        print(result.to_json())
    else:
        print(format_markdown(result))
        err.print("wrote " + "  ".join(str(p) for p in paths))
    return 0
