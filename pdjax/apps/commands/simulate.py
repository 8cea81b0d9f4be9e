"""``pdjax simulate``: play schedules against a plan's costs (or unit costs) and compare them.

pdjax simulate --unit-costs 1,1,1 --stages 4 --schedule all --microbatches 8 --png out.png
pdjax simulate --plan plan.json --profile profile.json --schedule 1f1b --microbatches 8
pdjax simulate --unit-costs 1,1,1 --stages 4 --schedule 1f1b,pipedream,pipedream-nostash

``--schedule`` takes one schedule, ``all``, or a comma-separated list (as ``pdjax train
--compare``), where ``pipedream-nostash`` and ``pipedream-vsync`` are ``pipedream`` without
weight stashing and with vertical sync. With several schedules, one that cannot run is a
row saying why; a single one that cannot run is an error.

With a plan, ``--replication`` says how its replicated stages run: ``auto`` (default) as
the plan records them for the schedule it was planned for, and for another schedule
round-robin under ``pipedream`` (one all-reduce per group instead of per microbatch) and
split under the rest (where both modes all-reduce once per step); ``split`` or
``round-robin`` force one mode on every replicated stage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pdjax._units import fmt_bytes, fmt_seconds
from pdjax.apps.commands import (
    MAX_DEVICES,
    MAX_SIM_PASSES,
    HelpFormatter,
    PathOption,
    add_option_flags,
    check_bound,
    check_writable,
    option_values,
    positive_int,
    split_list,
)
from pdjax.errors import PlanError, ScheduleError
from pdjax.partition import Plan
from pdjax.partition.choosing import simulator_costs as _costs
from pdjax.profile import Profile
from pdjax.schedules import SCHEDULE_KINDS, SCHEDULES, STREAMING, Schedule, generate
from pdjax.schedules.spec import OPTIONS
from pdjax.schedules.spec import VARIANTS as SPEC_VARIANTS
from pdjax.simulator import (
    PipelineCosts,
    Simulation,
    simulate,
    stream_length,
    unit_costs,
)

__all__ = ["costs_from_files", "parse_schedules", "register", "run"]

#: ``--schedule`` names beyond :data:`SCHEDULES` (the spec's named variants, as ``pdjax
#: train --compare`` reads them).
VARIANTS = SPEC_VARIANTS


def costs_from_files(
    plan_path: str, profile_path: str, *, chunks: int = 1
) -> tuple[PipelineCosts, tuple[int, ...]]:
    """Reads a Plan and its Profile from their files and returns per-stage costs and
    replicas per stage (the ``simulate`` command's costs).

    Args:
        plan_path: plan JSON (``pdjax plan --out``).
        profile_path: the profile it was made from: JSON, ``graph.txt`` or
            ``pipedream:NAME``.
        chunks: ``v`` for ``interleaved`` (``P v`` virtual stages, see
            :func:`pdjax.partition.costs_from_plan`).

    Raises:
        PlanError, ProfileError: unreadable files, or a profile that does not match the plan.
    """
    plan, profile = _load(plan_path, profile_path)
    return _costs.costs_from_plan(plan, profile, chunks=chunks), plan.replicas


def _load(plan_path: str, profile_path: str) -> tuple[Plan, Profile]:
    plan = Plan.load(plan_path)
    profile = Profile.load(profile_path)
    if plan.num_layers != len(profile.layers):
        raise PlanError(
            f"the plan {plan_path} covers {plan.num_layers} layers but the profile "
            f"{profile_path} has {len(profile.layers)}; pass the profile the plan was made from"
        )
    # Same layer count is not enough: another model's profile would price the stages wrongly.
    plan.check_profile(profile, plan_file=plan_path, profile_file=profile_path)
    return plan, profile


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``simulate`` subcommand."""
    p = subparsers.add_parser(
        "simulate",
        help="step time, bubble and memory of pipeline schedules",
        description="Play pipeline schedules against a plan's costs (or unit costs) and "
        "print step time, bubble fraction and peak memory per device group.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # a prefix is refused, not read as an option
    )
    # the help lists the options in the order these add them
    _add_cost_options(p)
    _add_schedule_options(p)
    _add_size_options(p)
    _add_plan_pricing_options(p)
    add_option_flags(p)
    p.add_argument(
        "--trace", action=PathOption, metavar="OUT.json", help="write a Chrome/Perfetto trace"
    )
    p.add_argument(
        "--png", action=PathOption, metavar="OUT.png", help="write a Gantt chart (needs matplotlib)"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.set_defaults(func=run)


def _add_cost_options(p: argparse.ArgumentParser) -> None:
    """Where the costs come from: ``--plan`` and ``--profile``, or ``--unit-costs``."""
    p.add_argument("--plan", action=PathOption, help="plan JSON (from pdjax plan)")
    p.add_argument("--profile", action=PathOption, help="profile JSON the plan was made from")
    p.add_argument(
        "--unit-costs",
        metavar="F,I,W",
        help="seconds of forward, input-grad and weight-grad per stage (backward = I + W), "
        "free transfers; replaces the plan (needs --stages)",
    )
    p.add_argument(
        "--stages",
        action=positive_int(MAX_DEVICES, "a stage is a device group, and the simulator's "
                            "per-group accounting grows with stages x passes", ScheduleError),
        help="P, stages (device groups) for --unit-costs",
    )  # fmt: skip


def _add_schedule_options(p: argparse.ArgumentParser) -> None:
    """Which schedules: ``--schedule`` names, or a torch CSV (read or written)."""
    p.add_argument(
        "--schedule",
        default="1f1b",
        metavar="NAME[,NAME...]",
        help=f"schedule(s) to simulate side by side, comma-separated: {', '.join(SCHEDULES)}, "
        f"{', '.join(VARIANTS)}; or all",
    )
    p.add_argument(
        "--schedule-csv",
        action=PathOption,
        metavar="FILE",
        help="simulate this schedule in torch.distributed.pipelining's CSV format (one row "
        "per rank) instead of --schedule; its ranks give P",
    )
    p.add_argument(
        "--csv-name",
        default="1f1b",
        help="--schedule-csv: the flush semantics to validate it with (gpipe, 1f1b, "
        "interleaved, zb-h1, ...)",
    )
    p.add_argument(
        "--write-csv",
        action=PathOption,
        metavar="FILE",
        help="write the (one) generated schedule in torch.distributed.pipelining's CSV format",
    )


def _add_size_options(p: argparse.ArgumentParser) -> None:
    """How much to play: microbatches, steps, chunks and the stream (bounded by _count)."""
    p.add_argument("--microbatches", action=_count, default=8, help="M, microbatches per step")
    p.add_argument(
        "--steps",
        action=_count,
        default=1,
        help="optimizer steps of the flush schedules to lay out one after the other "
        "(zb-h2 and zb-v gain across steps: the next step starts behind the last)",
    )
    p.add_argument(
        "--chunks",
        action=positive_int(
            256, "the simulator's work grows with the square of P x v", ScheduleError
        ),
        default=2,
        help="v, model chunks per group (interleaved)",
    )
    p.add_argument(
        "--stream",
        action=_count,
        help="N, microbatches streamed by pipedream and 2bw (default: a multiple of M, "
        "at least 4 M and 2 P)",
    )


def _add_plan_pricing_options(p: argparse.ArgumentParser) -> None:
    """With ``--plan``: how its replicated stages run, and measured costs."""
    p.add_argument(
        "--replication",
        default="auto",
        choices=("auto", "split", "round-robin"),
        help="with --plan: how replicated stages share their work. split: each microbatch "
        "split across the stage's devices; round-robin (PipeDream's; gpipe, 1f1b, pipedream, "
        "2bw): whole microbatches per device, r at once, one all-reduce per group under "
        "pipedream; auto: as the plan records for its own schedule, else "
        "round-robin under pipedream and split under the others",
    )
    p.add_argument(
        "--calibration",
        action=PathOption,
        help="with --plan: a calibration JSON (pdjax calibrate) for this model, microbatch size "
        "and devices: measured stages, links and all-reduces replace the profile's estimates",
    )
    p.add_argument(
        "--partial",
        action="store_true",
        help="with --calibration: price stages it did not measure from the profile (times its "
        "profile ratio) instead of refusing",
    )


#: ``--stages``, ``--microbatches``, ``--steps``, ``--chunks``, ``--stream``: each at most
#: :data:`MAX_SIM_PASSES`; their product is checked by :func:`check_size`.
_count = positive_int(
    MAX_SIM_PASSES, "the simulator plays every microbatch on every stage", ScheduleError
)
#: ``--unit-costs``: seconds per pass, at most this (a step's sums stay finite).
_MAX_UNIT_COST = 1e9


def _parse_unit_costs(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or any(not 0 <= v <= _MAX_UNIT_COST for v in values):
        raise ScheduleError(
            f"--unit-costs takes three numbers >= 0, 'F,I,W', finite seconds up to "
            f"{_MAX_UNIT_COST:g} each (e.g. 1,1,1); got {text!r}"
        )
    return values  # narrowed to three floats by the length check


def check_size(
    args: argparse.Namespace, name: str, stages: int, stream: int, played: int = 0
) -> int:
    """The microbatch-stage passes of schedule ``name`` (``M x steps x P x v``; ``N x P``
    for the stream ``N`` of pipedream and 2bw); refuses more than :data:`MAX_SIM_PASSES`
    together with the ``played`` passes of the schedules simulated before it.

    Raises:
      ScheduleError: naming the options, the bound and why.
    """
    if name in STREAMING:
        option, passes = "--stream (default 4 x --microbatches) x --stages", stream * stages
    else:
        kind = SCHEDULE_KINDS.get(name)
        v = 1 if kind is None else kind.chunks_for(args.chunks)
        option = "--microbatches x --steps x --stages" + (" x --chunks" if v > 1 else "")
        passes = args.microbatches * args.steps * stages * v
    why = (
        f"{name} would play {passes:,} microbatch-stage passes"
        + (f" after {played:,} by the schedules before it" if played else "")
        + f"; the simulator plays a few thousand a second, so more than {MAX_SIM_PASSES:,} "
        "in all would not finish in about a minute"
    )
    check_bound(option, played + passes, MAX_SIM_PASSES, why, ScheduleError)
    return passes


def _default_stream(stages: int, microbatches: int) -> int:
    steps = max(4, -(-2 * stages // microbatches))
    return steps * microbatches


def parse_schedules(text: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """``--schedule``: ``all`` or comma-separated names, as ``(name, schedule, options)``
    (options None: as the command-line flags say; a named variant's own).

    Raises:
      ScheduleError: for an unknown or repeated name, or none.
    """
    names = split_list(text)
    if names == ["all"]:
        return [(n, n, None) for n in SCHEDULES]
    known = (*SCHEDULES, *VARIANTS)
    unknown = [n for n in names if n not in known]
    if unknown or not names or len(set(names)) != len(names):
        what = f"unknown {unknown}" if unknown else "repeated or no schedules"
        raise ScheduleError(
            f"--schedule {text!r}: {what}; give one or more of {', '.join(known)}, "
            "comma-separated (e.g. 1f1b,pipedream), or all"
        )
    out: list[tuple[str, str, dict[str, Any] | None]] = []
    for n in names:
        if n in VARIANTS:
            options = dict(VARIANTS[n])
            out.append((n, options.pop("kind"), options))
        else:
            out.append((n, n, None))
    return out


@dataclass(frozen=True)
class _CostSource:
    """What the schedules are played against: ``stages`` (P), the plan's replicas per
    stage and the plan (None with ``--unit-costs``), and ``costs_for(chunks)``."""

    stages: int
    replicas: tuple[int, ...] | None
    plan: Plan | None
    costs_for: Callable[[int], PipelineCosts]


def _simulations(args: argparse.Namespace) -> list[tuple[str, Simulation | str]]:
    """Each requested schedule with its simulation, or the reason it cannot run."""
    requested, from_csv = _requested(args)
    if args.write_csv and len(requested) != 1:
        raise ScheduleError("--write-csv writes one schedule: give one --schedule")
    if args.calibration and not args.plan:
        raise ScheduleError("--calibration prices a plan's stages: give --plan and --profile")
    source = _cost_source(args)
    results: list[tuple[str, Simulation | str]] = []
    played = 0  # microbatch-stage passes simulated so far (check_size bounds them)
    for label, name, options in requested:
        try:
            mode = _replication(args.replication, source.plan, name)
            stream = _stream(args, name, source, mode)
            if from_csv is not None:
                schedule = from_csv
            else:
                # one too big is a row among several
                played += check_size(args, name, source.stages, stream, played)
                schedule = generate(
                    name,
                    source.stages,
                    args.microbatches,
                    stream=stream,
                    chunks=args.chunks,
                    steps=args.steps,
                    **(option_values(args) if options is None else options),
                    replicas=source.replicas,
                    replication=mode,
                )
            if args.write_csv:
                _write_csv(schedule, args.write_csv)
            results.append((label, simulate(schedule, source.costs_for(schedule.chunks))))
        except ScheduleError as e:
            if len(requested) == 1:
                raise
            results.append((label, str(e)))
    return results


def _requested(
    args: argparse.Namespace,
) -> tuple[list[tuple[str, str, dict[str, Any] | None]], Schedule | None]:
    """The schedules to play (as :func:`parse_schedules`) and the ``--schedule-csv`` one
    (None without it), which replaces them and sets ``args.stages`` to its ranks."""
    requested = parse_schedules(args.schedule)
    if not args.schedule_csv:
        return requested, None
    from pdjax.schedules.torch_csv import read_torch_csv

    from_csv = read_torch_csv(args.schedule_csv, name=args.csv_name)
    if args.stages is None:
        args.stages = from_csv.num_groups
    elif args.stages != from_csv.num_groups:
        raise ScheduleError(
            f"--stages {args.stages} disagrees with the {from_csv.num_groups} ranks of "
            f"{args.schedule_csv}"
        )
    return [(f"{args.schedule_csv} ({args.csv_name})", args.csv_name, None)], from_csv


def _cost_source(args: argparse.Namespace) -> _CostSource:
    """``--unit-costs`` with ``--stages``, or ``--plan`` with ``--profile`` (and
    ``--calibration``).

    Raises:
      ScheduleError: neither or both, or a ``--stages`` that disagrees.
      PlanError, ProfileError: unreadable files, or a profile that does not match the plan.
    """
    if args.unit_costs is not None:
        if args.plan or args.profile:
            raise ScheduleError("give either --unit-costs (with --stages) or --plan/--profile")
        if args.stages is None:
            raise ScheduleError("--unit-costs needs --stages P (the number of stages, >= 1)")
        if args.stages < 1:
            raise ScheduleError(f"--stages must be >= 1; got {args.stages}")
        f, i, w = _parse_unit_costs(args.unit_costs)
        stages = args.stages

        def unit(chunks: int) -> PipelineCosts:
            return unit_costs(stages, f, i, w, chunks=chunks)

        return _CostSource(stages=stages, replicas=None, plan=None, costs_for=unit)
    if args.plan and args.profile:
        return _plan_costs(args)
    raise ScheduleError(
        "pdjax simulate needs costs: --plan PLAN.json --profile PROFILE.json, or "
        "--unit-costs F,I,W --stages P"
    )


def _plan_costs(args: argparse.Namespace) -> _CostSource:
    """``--plan`` priced from ``--profile`` (and ``--calibration``, ``--partial``)."""
    plan, profile = _load(args.plan, args.profile)
    calibration = None
    if args.calibration:
        from pdjax.calibrate import Calibration

        calibration = Calibration.load(args.calibration)
    stages = plan.num_stages
    if args.stages is not None and args.stages != stages:
        raise ScheduleError(
            f"--stages {args.stages} disagrees with the plan's {stages} stages (P); drop "
            f"--stages or use --unit-costs"
        )

    def priced(chunks: int) -> PipelineCosts:
        if calibration is not None:
            return _costs.costs_from_plan(
                plan, profile, chunks=chunks, calibration=calibration, partial=args.partial
            )
        return _costs.costs_from_plan(plan, profile, chunks=chunks)

    return _CostSource(stages=stages, replicas=plan.replicas, plan=plan, costs_for=priced)


def _stream(
    args: argparse.Namespace, name: str, source: _CostSource, mode: tuple[str, ...] | None
) -> int:
    """``--stream``, else the default stream of ``name`` (round-robin's where any stage is)."""
    given: int | None = args.stream
    if given is not None:
        return given
    microbatches = max(1, args.microbatches)
    if mode and "round-robin" in mode:
        return stream_length(
            name, source.stages, microbatches, replicas=source.replicas, replication=mode
        )
    return _default_stream(source.stages, microbatches)


def _write_csv(schedule: Schedule, path: str) -> None:
    """``--write-csv``: the schedule in torch.distributed.pipelining's CSV format."""
    from pdjax.schedules.torch_csv import write_torch_csv

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_torch_csv(schedule, path)


def _replication(option: str, plan: Plan | None, name: str) -> tuple[str, ...] | None:
    """The replication modes to generate ``name`` with (None: every stage split)."""
    if plan is None or option == "split":
        return None
    if option == "round-robin":
        return ("round-robin",) * plan.num_stages
    if name == plan.schedule.kind:
        return plan.replication
    kind = SCHEDULE_KINDS.get(name)
    return ("round-robin",) * plan.num_stages if kind and kind.round_robin_by_default else None


def _label(sim: Simulation) -> str:
    s = sim.schedule
    kind = SCHEDULE_KINDS.get(s.name)
    if kind is not None:
        return kind.label(s)
    return s.name + (" rr" if "round-robin" in s.replication else "")


def _note(sim: Simulation) -> str:
    s = sim.schedule
    if s.name in STREAMING:
        where = "steady state" if sim.steady_state else "whole run (stream too short)"
        return f"{where}, stream N={s.num_microbatches}"
    return f"M={s.microbatches_per_step}, {s.num_steps} step(s)"


def run(args: argparse.Namespace) -> int:
    """Simulates the requested schedules; prints a table (or JSON) and writes pictures."""
    for option, path in [("--trace", args.trace), ("--png", args.png)]:
        check_writable(option, path, ScheduleError)
    check_writable("--write-csv", args.write_csv, ScheduleError)
    if args.png:
        _check_chart_name(args.png)
    results = _simulations(args)
    sims = [r for _, r in results if isinstance(r, Simulation)]
    if args.trace and sims:
        from pdjax.simulator import write_chrome_trace

        Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
        write_chrome_trace([s.timeline for s in sims], args.trace)
    if args.png and sims:
        from pdjax.simulator import plot_gantt

        titles = [
            f"{_label(s)}: step {s.step_time:.4g} s, {s.time_per_microbatch:.4g} s/microbatch, "
            f"bubble {s.bubble_fraction:.1%} ({_note(s)})"
            for s in sims
        ]
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot_gantt([s.timeline for s in sims], args.png, titles=titles)
    if args.json:
        rows = [
            {"name": name, **_summary(r)}
            if isinstance(r, Simulation)
            else {"name": name, "schedule": name, "error": r}
            for name, r in results
        ]
        print(json.dumps({"schedules": rows}, indent=1))
        return 0
    _print_table(results)
    for flag, path in [("trace", args.trace), ("Gantt chart", args.png)]:
        if path and sims:
            print(f"{flag} written to {path}")
    return 0


def _check_chart_name(path: str) -> None:
    """Refuses a ``--png`` whose suffix names no format matplotlib writes (it picks the
    format by the suffix, and without one would write ``path.png``, another file)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # plot_gantt says what to install
        return
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        raise ScheduleError(
            f"--png {path}: the chart's format is its name's suffix, one of "
            f"{', '.join(sorted(formats))}; give a name ending in .png (or another of them)"
        )


def _summary(sim: Simulation) -> dict[str, object]:
    """The simulation's summary with the schedule's options."""
    spec = sim.schedule.spec
    return {**sim.summary(), **{name: getattr(spec, name) for name in OPTIONS}}


def _runs(cells: Sequence[str]) -> str:
    """``['0 B', '0 B', '1 KiB'] -> '0 B x2, 1 KiB'``: per-group values, runs collapsed."""
    out: list[str] = []
    count = 0
    for i, cell in enumerate(cells):
        count += 1
        if i + 1 == len(cells) or cells[i + 1] != cell:
            out.append(cell if count == 1 else f"{cell} x{count}")
            count = 0
    return ", ".join(out)


def _print_table(
    results: Sequence[tuple[str, Simulation | str]], file: IO[str] | None = None
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="simulated schedules")
    for header, justify in [
        ("schedule", "left"),
        ("step time", "right"),
        ("per microbatch", "right"),
        ("bubble", "right"),
        ("peak memory per group", "left"),
        ("in flight per stage", "left"),
        ("note", "left"),
    ]:
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for name, r in results:
        if isinstance(r, str):
            table.add_row(name, "-", "-", "-", "-", "-", f"not run: {r}")
            continue
        table.add_row(
            _label(r),
            fmt_seconds(r.step_time),
            fmt_seconds(r.time_per_microbatch),
            f"{r.bubble_fraction:.1%}",
            _runs([fmt_bytes(b) for b in r.peak_memory]),
            _runs([str(n) for n in r.peak_in_flight]),
            _note(r),
        )
    Console(file=file or sys.stdout, width=160).print(table)
