"""``pdjax plan``: partition a profile over a topology with PipeDream's optimizer.

    pdjax plan --profile vgg16.json --workers 16 --bandwidths 1.25e9
    pdjax plan --profile graph.txt --levels 4x4 --bandwidths 1e10,1.25e9 --cost-model paper
    pdjax plan --profile pipedream:vgg16 --preset cluster-a --json --out plan.json

``--levels`` and ``--bandwidths`` list the levels innermost first (``4x4``: 4 servers of 4
devices, ``1e10,1.25e9``: 10 GB/s inside a server, 10 Gbit/s between servers).
``--replication`` chooses how a replicated stage shares its work: ``split`` (each microbatch
split across its devices), ``round-robin`` (PipeDream's: whole microbatches per device, one
all-reduce per group; the planner prices it for ``pipedream``), or ``auto`` (default: the
cheaper, round-robin under ``pipedream``, split under the other schedules).
"""

from __future__ import annotations

import argparse
import sys

from pdjax.errors import PlanError
from pdjax.partition import (
    COST_MODELS,
    PRESETS,
    REPLICATION_OPTIONS,
    SCHEDULES,
    Plan,
    Topology,
    parse_levels,
    plan_balanced_params,
    plan_balanced_time,
    plan_pipedream,
    plan_uniform,
)
from pdjax.profile import Profile

__all__ = ["register", "render_plan", "run"]

_PARTITIONERS = ("pipedream", "uniform", "balanced-time", "balanced-params")
_DEFAULT_BANDWIDTH = 1.25e9


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``plan`` subcommand."""
    p = subparsers.add_parser(
        "plan",
        help="partition a profile into pipeline stages over a topology",
        description="Run PipeDream's partitioning optimizer (or a simpler partitioner) on a "
        "profile (pdjax JSON, PipeDream graph.txt, or pipedream:NAME for a shipped one).",
    )
    p.add_argument("--profile", required=True, help="profile JSON, graph.txt or pipedream:NAME")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--workers", type=int, help="one level of this many devices")
    where.add_argument("--levels", help="workers per level, innermost first, e.g. 4x4")
    where.add_argument("--preset", choices=sorted(PRESETS), help="one of the papers' clusters")
    p.add_argument(
        "--bandwidths",
        help=f"bytes/s per level, innermost first, comma-separated (default "
        f"{_DEFAULT_BANDWIDTH:g} = 10 Gbit/s for every level)",
    )
    p.add_argument("--cost-model", default="pdjax", choices=COST_MODELS)
    p.add_argument("--schedule", default="pipedream", choices=sorted(SCHEDULES))
    p.add_argument("--partitioner", default="pipedream", choices=_PARTITIONERS)
    p.add_argument("--stages", type=int, help="stages for the simpler partitioners")
    p.add_argument(
        "--replication",
        default="auto",
        choices=REPLICATION_OPTIONS,
        help="how a replicated stage shares its work: split (each microbatch split across "
        "its devices, one all-reduce per update), round-robin (PipeDream's: whole "
        "microbatches per device, one all-reduce per group of r under pipedream), or auto "
        "(default: round-robin under pipedream, where it all-reduces less; split otherwise)",
    )
    p.add_argument("--straight", action="store_true", help="no replication")
    p.add_argument("--fewer-machines", action="store_true", help="may leave devices idle")
    p.add_argument("--memory-limit", type=float, help="bytes per device")
    p.add_argument("--microbatches", type=int, help="microbatches per step (default: devices)")
    p.add_argument("--microbatch-size", type=int, help="samples per microbatch")
    p.add_argument(
        "--optimizer-state-factor",
        type=float,
        default=2.0,
        help="optimizer state bytes per parameter byte (Adam 2, SGD 0)",
    )
    p.add_argument(
        "--calibration",
        help="a calibration JSON (pdjax calibrate) for this model and microbatch size: "
        "measured stage seconds and all-reduces replace the profile's where measured",
    )
    p.add_argument("--json", action="store_true", help="print the plan JSON on stdout")
    p.add_argument("--out", help="write the plan JSON here")
    p.set_defaults(func=run)


def _bandwidths(text: str | None, levels: int) -> list[float]:
    if text is None:
        return [_DEFAULT_BANDWIDTH] * levels
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise PlanError(
            f"--bandwidths {text!r}: expected bytes/s per level, comma-separated (e.g. 1e10,1.25e9)"
        ) from None
    if len(values) != levels:
        raise PlanError(f"--bandwidths gives {len(values)} values for {levels} level(s)")
    return values


def topology_from_args(args: argparse.Namespace) -> Topology:
    """The topology the arguments describe."""
    if args.preset:
        if args.bandwidths:
            raise PlanError("--preset fixes the bandwidths; drop --bandwidths")
        return Topology.preset(args.preset, memory_per_device=args.memory_limit)
    workers = (args.workers,) if args.workers is not None else parse_levels(args.levels)
    return Topology.from_levels(
        workers,
        _bandwidths(args.bandwidths, len(workers)),
        memory_per_device=args.memory_limit,
    )


def run(args: argparse.Namespace) -> int:
    """Plans and prints (or writes) the result. Raises PdjaxError on bad input."""
    topology = topology_from_args(args)  # validate the cheap arguments first
    profile = Profile.load(args.profile)
    common = dict(
        cost_model=args.cost_model,
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        microbatch_size=args.microbatch_size,
        optimizer_state_factor=args.optimizer_state_factor,
        replication=args.replication,
    )
    if args.calibration:
        if args.partitioner != "pipedream":
            raise PlanError(
                "--calibration prices the optimizer's search: use --partitioner pipedream"
            )
        from pdjax.calibrate import Calibration

        cal = Calibration.load(args.calibration)
        size = args.microbatch_size or profile.batch_size
        cal.check(layers=[layer.name for layer in profile.layers], microbatch_size=size)
        M = args.microbatches or topology.num_devices
        common["stage_seconds"] = cal.stage_seconds(args.schedule, M)
        common["allreduce_seconds"] = cal.allreduce_function()
    if args.partitioner == "pipedream":
        if args.stages is not None:
            raise PlanError("--stages is for the simpler partitioners; the optimizer picks them")
        plan = plan_pipedream(
            profile,
            topology,
            straight=args.straight,
            fewer_machines=args.fewer_machines,
            **common,
        )
    else:
        make = {
            "uniform": plan_uniform,
            "balanced-time": plan_balanced_time,
            "balanced-params": plan_balanced_params,
        }[args.partitioner]
        plan = make(profile, topology, args.stages, **common)
    if args.out:
        plan.save(args.out)
    if args.json:
        print(plan.to_json())
    else:
        render_plan(plan)
        if args.out:
            print(f"plan written to {args.out}")
    return 0


def render_plan(plan: Plan, file: object = None) -> None:
    """Prints a plan as a table of stages and a summary (rich)."""
    from rich.console import Console
    from rich.table import Table

    from pdjax._units import fmt_bytes, fmt_seconds

    table = Table(
        title=f"{plan.config} ({plan.partitioner}, {plan.cost_model} cost model, "
        f"{plan.schedule} schedule)"
    )
    for header, justify in (
        ("stage", "right"),
        ("layers", "left"),
        ("replicas", "right"),
        ("replication", "left"),
        ("devices", "left"),
        ("compute / device", "right"),
        ("in flight", "right"),
        ("memory / device", "right"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for s, st in enumerate(plan.stages):
        devices = ",".join(str(d) for d in st.devices)
        if len(devices) > 30:
            devices = devices[:27] + "..."
        table.add_row(
            str(s),
            f"{st.first_layer}-{st.last_layer}",
            str(st.replicas),
            st.replication if st.replicas > 1 else "-",
            devices,
            fmt_seconds(st.compute_seconds),
            str(st.in_flight),
            fmt_bytes(st.memory_bytes),
        )
    console = Console(file=file or sys.stdout, width=140)
    console.print(table)
    console.print(f"topology: {plan.topology.describe()}", highlight=False)
    console.print(plan.describe(), highlight=False)
