"""``pdjax plan``: partition a profile over a topology with PipeDream's optimizer.

    pdjax plan --profile vgg16.json --workers 16 --bandwidths 1.25e9
    pdjax plan --profile graph.txt --levels 4x4 --bandwidths 1e10,1.25e9 --cost-model paper
    pdjax plan --profile pipedream:vgg16 --preset cluster-a --json --out plan.json
    pdjax plan --model mypkg.models:build --microbatch-size 16 --workers 4   # profiles it first

``--levels`` and ``--bandwidths`` list the levels innermost first (``4x4``: 4 servers of 4
devices, ``1e10,1.25e9``: 10 GB/s inside a server, 10 Gbit/s between servers).
``--replication`` chooses how a replicated stage shares its work: ``split`` (each microbatch
split across its devices), ``round-robin`` (PipeDream's: whole microbatches per device, one
all-reduce per group; the planner prices it for ``pipedream``), or ``auto`` (default: the
cheaper, round-robin under ``pipedream``, split under the other schedules).

``--calibration`` (``pdjax calibrate``) prices the optimizer's search with measured stages
and all-reduces and, when it measured links, prices each level's transfers from the links
that cross it (the slowest: lowest bandwidth, highest latency) instead of ``--bandwidths``,
which is then refused rather than silently preferred or ignored.

``--model`` (a bundled model or ``package.module:factory``) profiles the model first, at
``--microbatch-size`` samples (default 32), with times measured on this machine's first
device or estimated for ``--device-model``. A plan predicted to be slower than the whole
model on one device (from the same profile and cost model) is printed with a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import IO, Any

from pdjax.apps.commands import (
    MAX_DEVICES,
    MAX_PROFILE_BATCH,
    MAX_SIM_PASSES,
    HelpFormatter,
    PathOption,
    add_model_arguments,
    check_bound,
    check_writable,
    float_range,
    positive_float,
    positive_floats,
    positive_int,
)
from pdjax.errors import PlanError
from pdjax.mesh import describe_mesh
from pdjax.partition import (
    COST_MODELS,
    PRESETS,
    REPLICATION_OPTIONS,
    SCHEDULE_TRAITS,
    Plan,
    Topology,
    auto_choice,
    parse_levels,
    plan_auto,
    plan_balanced_params,
    plan_balanced_time,
    plan_pipedream,
    plan_uniform,
)
from pdjax.partition.choosing.candidates import policy_letters
from pdjax.profile import DEVICE_MODELS, Profile
from pdjax.schedules import IN_FLIGHT, stage_groups

__all__ = ["auto_summary", "calibrated_topology", "register", "render_plan", "run"]

_OPTIMIZER = "pipedream"
"""The partitioner that is PipeDream's optimizer (a partitioner's name, not a schedule's)."""
_PARTITIONERS = (_OPTIMIZER, "uniform", "balanced-time", "balanced-params")
_DEFAULT_BANDWIDTH = 1.25e9
_MODEL_BATCH = 32
#: The planner's dynamic program is O(L^2 W^2) for L layers on W devices: this bound on
#: L^2 W^2 keeps it within about a minute (densenet121's 429 layers on 128 devices).
MAX_PLAN_WORK = 4e9
#: ``--schedule auto`` runs that program and the simulator for every schedule, microbatch
#: count and chunking: tens of seconds at 16 devices already.
MAX_AUTO_DEVICES = 32
#: ``--batch-size`` (auto): plan_auto tries the divisors of the batch, found by trial.
MAX_AUTO_BATCH = 1_000_000
_WHY_DEVICES = (
    f"the planner's dynamic program is O(L^2 W^2) for L layers on W devices; beyond "
    f"{MAX_DEVICES} devices it runs for many minutes"
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``plan`` subcommand."""
    p = subparsers.add_parser(
        "plan",
        help="partition a profile into pipeline stages over a topology",
        description="Run PipeDream's partitioning optimizer (or a simpler partitioner) on a "
        "profile (pdjax JSON, PipeDream graph.txt, or pipedream:NAME for a shipped one), or "
        "on a model profiled now (--model).",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # a prefix is refused, not read as an option
    )
    # the help lists the options in the order these add them
    _add_source_options(p)
    _add_topology_options(p)
    _add_schedule_options(p)
    _add_partitioner_options(p)
    _add_workload_options(p)
    p.add_argument("--json", action="store_true", help="print the plan JSON on stdout")
    p.add_argument("--out", action=PathOption, help="write the plan JSON here")
    p.set_defaults(func=run)


def _add_source_options(p: argparse.ArgumentParser) -> None:
    """What to plan: ``--profile`` or ``--model`` (profiled now, ``--device-model``)."""
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--profile", action=PathOption, help="profile JSON, graph.txt or pipedream:NAME"
    )
    add_model_arguments(p, group=source)
    p.add_argument(
        "--device-model",
        choices=sorted(DEVICE_MODELS),
        help="with --model: estimate seconds with this device's roofline (h100, v100, ...) "
        "instead of measuring on this machine's first device",
    )


def _add_topology_options(p: argparse.ArgumentParser) -> None:
    """The devices planned for: ``--workers``, ``--levels`` or ``--preset``, and links."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--workers",
        action=positive_int(MAX_DEVICES, _WHY_DEVICES, PlanError),
        help=f"one level of this many devices (at most {MAX_DEVICES})",
    )
    where.add_argument("--levels", help="workers per level, innermost first, e.g. 4x4")
    where.add_argument("--preset", choices=sorted(PRESETS), help="one of the papers' clusters")
    p.add_argument(
        "--bandwidths",
        help=f"bytes/s per level, innermost first, comma-separated (default "
        f"{_DEFAULT_BANDWIDTH:g} = 10 Gbit/s for every level; not with a --calibration "
        "that measured links, which price the levels instead)",
    )


def _add_schedule_options(p: argparse.ArgumentParser) -> None:
    """How plans are priced: the cost model and schedule (``auto``: searched)."""
    p.add_argument(
        "--cost-model",
        default="pdjax",
        choices=COST_MODELS,
        help="how stage and transfer times are predicted: pdjax's, the paper's equations, or "
        "PipeDream's code",
    )
    p.add_argument(
        "--schedule",
        default="pipedream",
        choices=[*sorted(SCHEDULE_TRAITS), "auto"],
        help="the schedule the in-flight counts, memory and times are for; 'auto': search "
        "the schedule, microbatches, stages, replication and per-stage recomputation too, "
        "ranked by the simulator (plan_auto)",
    )
    p.add_argument(
        "--allow-stale",
        action="store_true",
        help="--schedule auto: also search pipedream and 2bw (stale weights)",
    )
    p.add_argument(
        "--in-flight",
        nargs="+",
        choices=IN_FLIGHT,
        help="--schedule auto: pipedream's groups in flight at round-robin stages to search "
        "(default: full-rate; 'paper': PipeDream's own count, NOAM at the input stage)",
    )
    p.add_argument(
        "--mesh",
        choices=["auto"],
        help="--schedule auto --model: also choose each stage's mesh (data x fsdp x tensor), "
        "priced from the model's sharded layers compiled on this machine's devices "
        "(jax_num_cpu_devices is set to the topology's devices)",
    )
    p.add_argument(
        "--batch-size",
        action=positive_int(
            MAX_AUTO_BATCH, "plan_auto tries every divisor of the batch", PlanError
        ),
        help="--schedule auto: samples per optimizer step (default: the profile's batch "
        "size times the devices)",
    )


def _add_partitioner_options(p: argparse.ArgumentParser) -> None:
    """Which partitioner, and what it may do: stages, replication, devices, memory."""
    p.add_argument(
        "--partitioner",
        default="pipedream",
        choices=_PARTITIONERS,
        help="PipeDream's optimizer, or a simpler partitioner (needs --stages)",
    )
    p.add_argument(
        "--stages",
        action=positive_int(MAX_DEVICES, "a stage needs a device", PlanError),
        help="stages for the simpler partitioners",
    )
    p.add_argument(
        "--replication",
        default="auto",
        choices=REPLICATION_OPTIONS,
        help="how a replicated stage shares its work: split (each microbatch split across "
        "its devices, one all-reduce per update), round-robin (PipeDream's: whole "
        "microbatches per device, one all-reduce per group of r under pipedream), or auto "
        "(the cheaper: round-robin under pipedream, where it all-reduces less; split otherwise)",
    )
    p.add_argument("--straight", action="store_true", help="no replication")
    p.add_argument("--fewer-machines", action="store_true", help="may leave devices idle")
    p.add_argument(
        "--memory-limit", action=positive_float(error=PlanError), help="bytes per device"
    )


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    """The step planned for: microbatches, their size, optimizer state, measured costs."""
    p.add_argument(
        "--microbatches",
        action=positive_int(MAX_SIM_PASSES, "the schedules are priced per microbatch", PlanError),
        help="microbatches per step (default: devices)",
    )
    p.add_argument(
        "--microbatch-size",
        action=positive_int(error=PlanError),
        help=f"samples per microbatch (default: the profile's batch; with --model {_MODEL_BATCH})",
    )
    p.add_argument(
        "--optimizer-state-factor",
        action=float_range(
            0.0, 1000.0, why="optimizers keep a few copies of the weights", error=PlanError
        ),
        default=2.0,
        help="optimizer state bytes per parameter byte (Adam 2, SGD 0)",
    )
    p.add_argument(
        "--calibration",
        action=PathOption,
        help="a calibration JSON (pdjax calibrate) for this model and microbatch size: "
        "measured stage seconds and all-reduces replace the profile's where measured, and "
        "its measured links (the slowest crossing each level) replace --bandwidths",
    )


def _bandwidths(text: str | None, levels: int) -> list[float]:
    if text is None:
        return [_DEFAULT_BANDWIDTH] * levels
    return positive_floats(
        "--bandwidths", text, unit="bytes/s per level", noun="bandwidth", error=PlanError,
        count=levels,
    )  # fmt: skip


def topology_from_args(args: argparse.Namespace) -> Topology:
    """The topology the arguments describe."""
    if args.preset:
        if args.bandwidths:
            raise PlanError("--preset fixes the bandwidths; drop --bandwidths")
        return Topology.preset(args.preset, memory_per_device=args.memory_limit)
    workers = (args.workers,) if args.workers is not None else parse_levels(args.levels)
    check_bound("--levels", math.prod(workers), MAX_DEVICES, _WHY_DEVICES, PlanError)
    return Topology.from_levels(
        workers,
        _bandwidths(args.bandwidths, len(workers)),
        memory_per_device=args.memory_limit,
    )


def check_size(args: argparse.Namespace, topology: Topology, layers: int | None = None) -> None:
    """Refuses a search that cannot finish in about a minute (the bounds say why); with
    ``layers`` (the profile's), also the dynamic program's ``L^2 W^2``.

    Raises:
      PlanError: naming the option, the bound and why.
    """
    devices = topology.num_devices
    if args.stages is not None and layers is not None:
        why = f"each stage needs a layer, and the profile has {layers}"
        check_bound("--stages", args.stages, layers, why, PlanError)
    option = "--workers" if args.workers is not None else "--levels"
    if args.preset:
        option = "--preset"
    if args.schedule == "auto":
        why = (
            "--schedule auto runs the planner and the simulator for every schedule, "
            "microbatch count and chunking; plan bigger clusters with a fixed --schedule"
        )
        check_bound(f"{option} (devices)", devices, MAX_AUTO_DEVICES, why, PlanError)
        if args.microbatches:
            why = "plan_auto simulates every microbatch on every device"
            check_bound("--microbatches x devices", args.microbatches * devices,
                        MAX_SIM_PASSES, why, PlanError)  # fmt: skip
    if args.model is not None:
        why = "the model is profiled now, on a sample batch of this many samples"
        size = args.microbatch_size or _MODEL_BATCH
        check_bound("--microbatch-size", size, MAX_PROFILE_BATCH, why, PlanError)
    if layers is not None:
        why = (
            f"the planner's dynamic program is O(L^2 W^2) and {layers} layers on {devices} "
            f"devices would run for many minutes (L^2 W^2 at most {MAX_PLAN_WORK:.0e}); plan "
            "for fewer devices"
        )
        check_bound(f"{option} (L^2 W^2)", float(layers) ** 2 * devices**2, MAX_PLAN_WORK,
                    why, PlanError)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Plans and prints (or writes) the result. Raises PdjaxError on bad input."""
    check_writable("--out", args.out, PlanError)
    topology = topology_from_args(args)  # validate the cheap arguments first
    cal = _load_calibration(args)
    topology = calibrated_topology(args, topology, cal)
    check_size(args, topology)
    _check_mesh(args, topology, cal)
    profile = _load_profile(args)
    check_size(args, topology, len(profile.layers))
    common = _pricing(args, profile, topology, cal)
    meshes = _search_meshes(args, topology) if args.mesh == "auto" else None
    plan = _make_plan(args, profile, topology, common, cal, meshes)
    # Record the profile in the file (plan_pipedream and plan_auto do not yet), so that
    # `pdjax simulate` refuses this plan with another model's profile of equal layer count.
    plan = plan.with_profile_hash(profile)
    _report(args, plan)
    return 0


def _check_mesh(args: argparse.Namespace, topology: Topology, cal: Any) -> None:
    """``--mesh auto`` needs ``--schedule auto``, ``--model`` (its layers are compiled on
    each mesh) and no calibration; it makes this process's CPU devices as many as the
    topology's, before JAX starts.

    Raises:
      PlanError: naming the option to change.
    """
    if args.mesh is None:
        return
    if args.schedule != "auto":
        raise PlanError("--mesh auto is chosen with everything else: add --schedule auto")
    if args.model is None:
        raise PlanError(
            "--mesh auto compiles the model's layers on each mesh: give --model, not --profile"
        )
    if cal is not None:
        raise PlanError("--calibration measured replicated stages: drop it with --mesh auto")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", max(topology.num_devices, 1))
    except RuntimeError:  # JAX started already (a caller in this process): use its devices
        pass


def _search_meshes(args: argparse.Namespace, topology: Topology) -> Any:
    """The units ``--mesh auto`` searches, each layer compiled on each, at the profile's
    microbatch."""
    from pdjax.models import get_model
    from pdjax.partition.choosing.meshes import search_meshes

    spec = get_model(args.model, args.config)
    size = args.microbatch_size or _MODEL_BATCH
    return search_meshes(spec.layers, spec.sample_input(size), topology)


def _load_profile(args: argparse.Namespace) -> Profile:
    """``--model`` profiled now, or the ``--profile`` file."""
    if args.model is not None:
        return _profile_model(args)
    if args.device_model:
        raise PlanError("--device-model prices a model profiled now: give --model")
    return Profile.load(args.profile)


def _load_calibration(args: argparse.Namespace) -> Any:
    """The ``--calibration`` (a :class:`~pdjax.calibrate.Calibration`), or None.

    Raises:
      PlanError: ``--calibration`` with a partitioner other than the optimizer.
      CalibrationError: a file that is not a calibration this pdjax reads.
    """
    if not args.calibration:
        return None
    if args.partitioner != _OPTIMIZER:
        raise PlanError("--calibration prices the optimizer's search: use --partitioner pipedream")
    from pdjax.calibrate import Calibration

    return Calibration.load(args.calibration)


def calibrated_topology(args: argparse.Namespace, topology: Topology, cal: Any) -> Topology:
    """``topology`` with each level's bandwidth and latency taken from the measured links of
    ``cal`` (a :class:`~pdjax.calibrate.Calibration`, or None) that cross that level.

    A level is crossed by the links between two of the topology's devices whose innermost
    common group is that level's (:meth:`Topology.link_level`), in either direction. Where
    those links differ, the level takes the slowest: the lowest bandwidth and the highest
    latency among them, each on its own, since a cut or an all-reduce at that level may
    land on any of its links and the stage that waits for it waits for the slowest. A
    level of one worker joins no two devices, so no transfer is priced at it; it keeps its
    bandwidth. A calibration without links (or no calibration) leaves ``topology`` as it is.

    Args:
      args: the parsed ``pdjax plan`` arguments (``--bandwidths``, ``--preset``).
      topology: the devices planned for, from ``--workers``, ``--levels`` or ``--preset``.
      cal: the ``--calibration``, or None.

    Returns:
      The topology the planner prices cuts and all-reduces on, named ``"calibrated"`` when
      its levels are measured.

    Raises:
      PlanError: links in the calibration and ``--bandwidths`` (or ``--preset``, which fixes
        its bandwidths) too; devices planned for that the calibration did not measure; a
        level that no measured link crosses.
    """
    if cal is None or not cal.links:
        return topology
    source = f"--calibration {args.calibration}"
    if args.bandwidths:
        raise PlanError(
            f"{source} holds measured links, which price the transfers between stages, and "
            "--bandwidths prices them too: drop --bandwidths to plan with the measured "
            "links, or drop --calibration to plan with --bandwidths"
        )
    if args.preset:
        raise PlanError(
            f"{source} holds measured links, and --preset fixes its own bandwidths: plan "
            "the calibrated devices with --workers or --levels instead of --preset"
        )
    ids = [topology.device_id(p) for p in range(topology.num_devices)]
    missing = sorted(set(ids) - set(cal.devices))
    if missing:
        raise PlanError(
            f"{source} measured devices {list(cal.devices)}, but the plan is for devices "
            f"{ids}: {missing} were not measured. Plan for the calibrated devices "
            f"(--workers {len(cal.devices)}) or calibrate on all {len(ids)} "
            f"(pdjax calibrate --devices {len(ids)})"
        )
    crossing: dict[int, list[Any]] = {k: [] for k in range(topology.num_levels)}
    for ln in cal.links:
        if ln.src in ids and ln.dst in ids:
            k = topology.link_level(topology.position(ln.src), topology.position(ln.dst))
            crossing[k].append(ln)
    levels = []
    for k, level in enumerate(topology.levels):
        links = crossing[k]
        if level.workers == 1:
            levels.append(level)
            continue
        if not links:
            size = topology.group_size(k)
            a, b = ids[0], ids[size]  # the first devices of two units of level k
            raise PlanError(
                f"{source} measured no link across level {k} of {topology.describe()} (e.g. "
                f"between devices {a} and {b}); calibrate with a plan that uses such a link "
                "(pdjax calibrate --devices measures every pair)"
            )
        levels.append(
            dataclasses.replace(
                level,
                bandwidth=min(ln.bandwidth for ln in links),
                latency=max(ln.latency for ln in links),
            )
        )
    return dataclasses.replace(topology, levels=tuple(levels), name="calibrated")


def _pricing(
    args: argparse.Namespace, profile: Profile, topology: Topology, cal: Any
) -> dict[str, Any]:
    """The partitioners' pricing keywords, with the measured stages and all-reduces of
    ``cal`` (the ``--calibration``, or None), which is checked against the profile."""
    common: dict[str, Any] = dict(
        cost_model=args.cost_model,
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        microbatch_size=args.microbatch_size,
        optimizer_state_factor=args.optimizer_state_factor,
        replication=args.replication,
    )
    if cal is None:
        return common
    size = args.microbatch_size or profile.batch_size
    cal.check(layers=[layer.name for layer in profile.layers], microbatch_size=size)
    M = args.microbatches or topology.num_devices
    common["stage_seconds"] = cal.stage_seconds(args.schedule, M)
    common["allreduce_seconds"] = cal.allreduce_function()
    return common


def _make_plan(
    args: argparse.Namespace,
    profile: Profile,
    topology: Topology,
    common: dict[str, Any],
    cal: Any,
    meshes: Any = None,
) -> Plan:
    """The plan of the partitioner (or ``plan_auto``) the arguments choose."""
    if args.schedule != "auto" and (
        args.allow_stale or args.batch_size is not None or args.in_flight is not None
    ):
        raise PlanError(
            "--allow-stale, --batch-size and --in-flight are options of --schedule auto"
        )
    if args.schedule == "auto":
        if args.partitioner != _OPTIMIZER:
            raise PlanError("--schedule auto searches the stages itself: drop --partitioner")
        batch, counts = args.batch_size, [args.microbatches] if args.microbatches else None
        if cal is not None:  # its stages were measured at one microbatch size: keep it
            batch, counts = _calibrated_batch(args, cal.microbatch_size, topology.num_devices)
        return plan_auto(
            profile,
            topology,
            batch_size=batch,
            allow_stale=args.allow_stale,
            microbatches=counts,
            memory_limit=args.memory_limit,
            straight=args.straight,
            cost_model=args.cost_model,
            optimizer_state_factor=args.optimizer_state_factor,
            calibration=cal,
            in_flight=tuple(args.in_flight or ("full-rate",)),
            meshes=meshes,
        )
    if args.partitioner == _OPTIMIZER:
        if args.stages is not None:
            raise PlanError("--stages is for the simpler partitioners; the optimizer picks them")
        return plan_pipedream(
            profile,
            topology,
            straight=args.straight,
            fewer_machines=args.fewer_machines,
            **common,
        )
    make = {
        "uniform": plan_uniform,
        "balanced-time": plan_balanced_time,
        "balanced-params": plan_balanced_params,
    }[args.partitioner]
    return make(profile, topology, args.stages, **common)


def _report(args: argparse.Namespace, plan: Plan) -> None:
    """Writes ``--out``, prints the plan (JSON or tables) and warns if it is slower than
    one device."""
    if args.out:
        plan.save(args.out)
    if args.json:
        print(plan.to_json())
    else:
        render_plan(plan)
        if "auto" in plan.options:
            render_auto(plan)
        if args.out:
            print(f"plan written to {args.out}")
    warning = slower_than_one_device(plan)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def _calibrated_batch(args: argparse.Namespace, size: int, devices: int) -> tuple[int, list[int]]:
    """``--schedule auto --calibration``: the batch and the one microbatch count whose
    microbatches have the calibrated ``size`` (``--batch-size``, else ``--microbatches`` or
    one microbatch per device, of ``size`` samples each).

    Raises:
      PlanError: a batch that is not a whole number of calibrated microbatches, or a
        ``--microbatches`` that does not split it into them.
    """
    if args.batch_size is None:
        M = args.microbatches or devices
        return M * size, [M]
    if args.batch_size % size:
        raise PlanError(
            f"--calibration measured microbatches of {size} samples: --batch-size "
            f"{args.batch_size} must be a multiple of {size} (or calibrate at another size)"
        )
    M = args.batch_size // size
    if args.microbatches and args.microbatches != M:
        raise PlanError(
            f"--calibration measured microbatches of {size} samples: --batch-size "
            f"{args.batch_size} makes {M} of them, not --microbatches {args.microbatches}"
        )
    return args.batch_size, [M]


def _profile_model(args: argparse.Namespace) -> Profile:
    """``--model``: the model profiled at ``--microbatch-size`` samples."""
    from pdjax.models import get_model
    from pdjax.profile import get_device_model, profile

    size = args.microbatch_size or _MODEL_BATCH
    if size < 1:
        raise PlanError(f"--microbatch-size must be >= 1, got {size}")
    spec = get_model(args.model, args.config)
    device_model = get_device_model(args.device_model) if args.device_model else None
    return profile(
        spec.layers,
        spec.sample_input(size),
        measure=device_model is None,
        device_model=device_model,
        meta={"model": args.model, "config": args.config},
    )


def render_auto(plan: Plan, file: IO[str] | None = None) -> None:
    """What ``plan_auto`` chose, and the best candidate of every other schedule."""
    from rich.console import Console
    from rich.table import Table

    from pdjax._units import fmt_bytes, fmt_seconds

    chosen = auto_choice(plan)
    assert chosen is not None, "render_auto is for plan_auto's plans"
    table = Table(title="schedules searched (simulated, per sample)")
    for col in ("schedule", "M", "stages", "remat", "time / sample", "peak memory", ""):
        table.add_column(col)
    rows = [(chosen["schedule"], chosen, "chosen")]
    rows += [(name, alt, "") for name, alt in plan.options["alternatives"].items()]
    for name, c, mark in rows:
        if "none" in c:
            table.add_row(name, "", "", "", "", "", f"none fits: {c['none'][:60]}")
            continue
        label = c["schedule"] + (f" v={c['chunks']}" if c["chunks"] > 1 else "")
        label += f" +{c['extra_in_flight']}" if c["extra_in_flight"] else ""
        label += _in_flight_label(c)
        table.add_row(
            label,
            str(c["microbatches"]),
            "-".join(str(r) for _, _, r in c["stages"]),
            _policy_text(c),
            fmt_seconds(c["time_per_sample"]),
            fmt_bytes(c["peak_memory"]),
            mark,
        )
    Console(file=file).print(table)
    searched = plan.options.get("meshes")
    if isinstance(searched, dict):
        render_meshes(searched, file)


def render_meshes(searched: dict[str, Any], file: IO[str] | None = None) -> None:
    """The best plan of each unit mesh ``plan_auto`` searched (``options["meshes"]``)."""
    from rich.console import Console
    from rich.table import Table

    from pdjax._units import fmt_bytes, fmt_seconds

    table = Table(title="meshes searched (each stage: data x this unit; simulated, per sample)")
    for col in ("unit", "best plan", "time / sample", "peak memory / device"):
        table.add_column(col)
    for r in searched["searched"]:
        if "none" in r:
            table.add_row(r["unit"], f"none fits: {r['none'][:90]}", "", "")
        else:
            table.add_row(
                r["unit"],
                r["label"],
                fmt_seconds(r["time_per_sample"]),
                fmt_bytes(r["peak_memory"]),
            )
    console = Console(file=file, width=140)
    console.print(table)
    if searched.get("note"):
        console.print(f"note: {searched['note']}")


def slower_than_one_device(plan: Plan) -> str | None:
    """A warning if ``plan`` is predicted slower per microbatch (so per sample) than the
    whole model on one device, from the same profile and cost model; else None."""
    one, ours = plan.single_device_time, plan.time_per_microbatch
    auto = auto_choice(plan)
    if auto is not None and "time_per_sample" in auto:
        # plan_auto's choice: its simulated time (fill and drain included), not the dynamic
        # program's pricing, which may be another schedule's
        ours = float(auto["time_per_sample"]) * plan.microbatch_size
    if not (one > 0 and ours > one * (1 + 1e-9)):
        return None
    from pdjax._units import fmt_seconds

    return (
        f"this plan ({plan.config} on {plan.num_devices} devices) is predicted SLOWER than one "
        f"device: {fmt_seconds(ours)} per microbatch of {plan.microbatch_size} samples "
        f"against {fmt_seconds(one)} for the whole model on one device ({ours / one:.3g}x "
        "the time): its transfers or all-reduces cost more than splitting the work saves. "
        "Try --fewer-machines (may use fewer devices), faster --bandwidths, a larger "
        "--microbatch-size, or train on one device"
    )


def render_plan(plan: Plan, file: IO[str] | None = None) -> None:
    """Prints a plan as a table of stages and a summary (rich). A ``plan_auto`` plan's
    in-flight counts and memory are its chosen configuration's, simulated (the stages'
    own figures are the dynamic program's, which prunes on another pricing)."""
    from rich.console import Console
    from rich.table import Table

    from pdjax._units import fmt_bytes, fmt_seconds

    auto = auto_choice(plan)
    table = Table(
        title=f"{plan.config} ({plan.partitioner}, {plan.cost_model} cost model, "
        f"{plan.schedule.kind} schedule)"
    )
    columns = [
        ("stage", "right"),
        ("layers", "left"),
        ("replicas", "right"),
        ("replication / mesh", "left"),
        ("devices", "left"),
        ("compute / device", "right"),
        ("in flight", "right"),
        ("memory / device", "right"),
    ]
    if auto is not None:
        columns[-2:] = [
            ("remat", "left"),
            ("in flight (simulated)", "right"),
            ("peak memory / device (simulated)", "right"),
        ]
        in_flight = _group_in_flight(auto, plan.num_stages)
    for header, justify in columns:
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for s, st in enumerate(plan.stages):
        devices = ",".join(str(d) for d in st.devices)
        if len(devices) > 30:
            devices = devices[:27] + "..."
        row = [
            str(s),
            f"{st.first_layer}-{st.last_layer}",
            str(st.replicas),
            (describe_mesh(st.mesh) if st.mesh is not None else st.replication)
            if st.replicas > 1
            else "-",
            devices,
            fmt_seconds(st.compute_seconds),
        ]
        if auto is None:
            row += [str(st.in_flight), fmt_bytes(st.memory_bytes)]
        else:
            row += [
                _stage_policy(auto, s),
                in_flight[s],
                fmt_bytes(auto["group_peak_memory"][s]),
            ]
        table.add_row(*row)
    console = Console(file=file or sys.stdout, width=140)
    console.print(table)
    console.print(f"topology: {plan.topology.describe()}", highlight=False)
    if auto is None:
        console.print(plan.describe(), highlight=False)
        return
    console.print(plan.describe().split("\n")[0], highlight=False)
    console.print(auto_summary(plan), highlight=False)


def _stage_policy(auto: dict[str, Any], s: int) -> str:
    """Stage ``s``'s memory policy in a ``plan_auto`` choice (a plan written before
    policies holds ``remat`` flags only: ``full`` or ``none``)."""
    policies = auto.get("policies")
    if policies:
        return str(policies[s])
    return "full" if auto["remat"][s] else "none"


def _policy_text(candidate: dict[str, Any]) -> str:
    """A candidate's memory policies, one letter per stage (:func:`policy_letters`)."""
    return policy_letters([_stage_policy(candidate, s) for s in range(len(candidate["remat"]))])


def _group_in_flight(auto: dict[str, Any], P: int) -> list[str]:
    """Per plan stage, the simulated peak microbatches in flight of its (virtual) stages,
    ``+``-joined where a device group holds several (``interleaved``, ``zb-v``)."""
    counts = auto["in_flight"]
    if len(counts) == P:
        return [str(n) for n in counts]
    where = stage_groups(auto["schedule"], P, len(counts) // P)  # e.g. zb-v's V
    return [
        "+".join(str(n) for n, g in zip(counts, where, strict=True) if g == d) for d in range(P)
    ]


def _in_flight_label(candidate: dict[str, Any]) -> str:
    """`` in_flight=paper`` for a candidate of PipeDream's own count, else nothing (a plan
    written before the option records none: full rate)."""
    option = candidate.get("in_flight_option", "full-rate")
    return "" if option == "full-rate" else f" in_flight={option}"


def auto_summary(plan: Plan) -> str:
    """The chosen configuration of a ``plan_auto`` plan, as the simulator priced it: time
    per sample, in flight, peak memory per device (and per device group) and the limit."""
    from pdjax._units import fmt_bytes, fmt_seconds

    a = auto_choice(plan)
    assert a is not None, "auto_summary is for plan_auto's plans"
    name = a["schedule"] + (f" v={a['chunks']}" if a["chunks"] > 1 else "")
    name += f" +{a['extra_in_flight']}" if a["extra_in_flight"] else ""
    name += _in_flight_label(a)
    remat = [s for s, r in enumerate(a["remat"]) if r]
    kept = ", ".join(f"{s}: {_stage_policy(a, s)}" for s in remat)
    groups = ", ".join(fmt_bytes(b) for b in a["group_peak_memory"])
    text = (
        f"{name}, {a['microbatches']} microbatches of {plan.microbatch_size} samples, "
        f"recomputation on {'stages ' + str(remat) if remat else 'no stage'}"
        + (f" (memory policies {kept})" if remat else "")
        + " (simulated): "
        f"{fmt_seconds(a['time_per_sample'])} per sample; in flight "
        f"[{', '.join(_group_in_flight(a, plan.num_stages))}]; peak memory "
        f"{fmt_bytes(a['peak_memory'])} per device ({a['peak_memory']:.4g} bytes; per stage "
        f"{groups})"
    )
    limit = a.get("memory_limit")
    if limit is not None:
        text += f"; fits the limit of {limit:.4g} bytes"
    return text
