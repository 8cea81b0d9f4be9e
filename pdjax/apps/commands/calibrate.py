"""``pdjax calibrate``: measure what the cost model needs on the devices that will run::

    pdjax calibrate --model vgg16 --microbatch-size 32 --plan plan.json --out cal.json
    pdjax calibrate --model vgg16 --microbatch-size 32 --profile p.json --devices 4 \\
                    --refine --schedule 1f1b --out cal.json --plan-out best.json

With ``--plan``: the plan's stages (``--neighbours``: also every plan with one cut moved by
one layer), the links between its stages' devices both ways, and the all-reduce of each
replicated stage, on this machine's devices (the plan's device ids). With ``--refine``:
plans from the per-layer profile (the planner's best few and their neighbours) on these
devices, calibrated, then ranked by the simulator on the calibrated costs; the best is
written to ``--plan-out``. ``pdjax plan --calibration`` and ``pdjax simulate
--calibration`` read the file.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pdjax.apps.commands import (
    MAX_DEVICES,
    MAX_PROFILE_BATCH,
    MAX_SIM_PASSES,
    HelpFormatter,
    PathOption,
    add_model_arguments,
    check_readable,
    check_writable,
    positive_float,
    positive_int,
    seed_int,
)
from pdjax.apps.commands.profile import MAX_REPEATS, WHY_BATCH
from pdjax.errors import CalibrationError

__all__ = ["register", "run"]


_WHY_DEVICES = (
    "on CPU pdjax simulates that many devices (jax_num_cpu_devices), each compiling its "
    "own programs"
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``calibrate`` subcommand."""
    p = subparsers.add_parser(
        "calibrate",
        help="measure stages, links and all-reduces on these devices for plan and simulate",
        description="Time candidate stages as compiled programs, the links between their "
        "devices and their all-reduces, and write a calibration JSON.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # a prefix is refused, not read as an option
    )
    add_model_arguments(p, required=True)
    p.add_argument(
        "--microbatch-size",
        action=positive_int(MAX_PROFILE_BATCH, WHY_BATCH),
        required=True,
        help="samples per microbatch",
    )
    p.add_argument(
        "--optimizer",
        default="adam",
        choices=("adam", "sgd", "momentum"),
        help="the optimizer whose update is timed with each stage",
    )
    p.add_argument(
        "--lr", action=positive_float(), default=1e-3, help="learning rate (the update is timed)"
    )
    p.add_argument(
        "--devices",
        action=positive_int(MAX_DEVICES, _WHY_DEVICES),
        help="devices to use (CPU: simulated); default all",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--plan", action=PathOption, help="calibrate this plan's stages (plan JSON)")
    what.add_argument("--refine", action="store_true", help="plan, calibrate the best few, re-rank")
    p.add_argument("--neighbours", action="store_true", help="with --plan: also moved cuts")
    p.add_argument(
        "--profile", action=PathOption, help="with --refine: the per-layer profile to plan from"
    )
    p.add_argument("--schedule", default="pipedream", help="with --refine: the schedule")
    p.add_argument(
        "--microbatches",
        action=positive_int(MAX_SIM_PASSES, "the plans are simulated per microbatch"),
        help="with --refine: microbatches per step",
    )
    p.add_argument("--calibration", action=PathOption, help="an earlier calibration to extend")
    p.add_argument(
        "--repeats",
        action=positive_int(MAX_REPEATS),
        default=5,
        help="timed runs per measurement (median)",
    )
    p.add_argument("--seed", action=seed_int, default=0, help="seeds the sample batch and weights")
    p.add_argument(
        "--out", action=PathOption, required=True, help="write the calibration JSON here"
    )
    p.add_argument("--plan-out", action=PathOption, help="with --refine: write the best plan here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measures and writes the calibration. Raises PdjaxError on bad input."""
    _check_args(args)
    devices = _devices(args)
    from pdjax import calibrate as cal_lib
    from pdjax.models import get_model

    spec = get_model(args.model, args.config)
    sample = spec.sample_batch(args.microbatch_size, args.seed)
    from pdjax.apps.train import make_optimizer

    opt = make_optimizer(args.optimizer, args.lr)
    earlier = cal_lib.Calibration.load(args.calibration) if args.calibration else None
    if args.refine:
        cal = _refine(args, spec, sample, opt, devices=devices, earlier=earlier)
    else:
        cal = _calibrate_plan(args, spec, sample, opt, devices=devices)
        if earlier is not None:
            cal = earlier.merge(cal)
    cal.save(args.out)
    print(f"calibration written to {args.out}: {len(cal.stages)} stages, {len(cal.links)} "
          f"links, {len(cal.allreduces)} all-reduce fits")  # fmt: skip
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """Refuses, before any work, options that cannot go together, files that cannot be
    written, and input files that cannot be read."""
    if args.microbatch_size < 1:
        raise CalibrationError("--microbatch-size must be >= 1")
    check_writable("--out", args.out, CalibrationError)
    check_writable("--plan-out", args.plan_out, CalibrationError)
    for option in ("--plan", "--profile", "--calibration"):
        check_readable(option, getattr(args, option[2:]), CalibrationError)
    if args.refine and not args.profile:
        raise CalibrationError("--refine plans from a profile: give --profile (pdjax profile)")


def _devices(args: argparse.Namespace) -> list[Any]:
    """The first ``--devices`` devices (simulated on CPU), or all."""
    from pdjax.apps.commands.train import set_cpu_devices

    if args.devices:  # before jax.devices() starts the backends and fixes their count
        set_cpu_devices(args.devices)
    import jax

    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    if args.devices and len(devices) < args.devices:
        raise CalibrationError(f"--devices {args.devices}: only {len(devices)} are visible")
    return list(devices)


def _refine(
    args: argparse.Namespace,
    spec: Any,
    sample: Any,
    opt: Any,
    *,
    devices: list[Any],
    earlier: Any,
) -> Any:
    """``--refine``: plans from ``--profile``, calibrated and ranked (printed; the best
    written to ``--plan-out``); returns the calibration."""
    from pdjax import calibrate as cal_lib
    from pdjax.partition import Topology
    from pdjax.profile import Profile

    ranked, cal = cal_lib.refine(
        profile=Profile.load(args.profile),
        topology=Topology.from_devices(devices),
        layers=spec.layers,
        sample=sample,
        loss=spec.loss,
        optimizer=opt,
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        devices=devices,
        calibration=earlier,
        repeats=args.repeats,
        log=print,
    )
    _render(ranked)
    if args.plan_out:
        ranked[0].plan.save(args.plan_out)
        print(f"best plan written to {args.plan_out}")
    return cal


def _calibrate_plan(
    args: argparse.Namespace, spec: Any, sample: Any, opt: Any, *, devices: list[Any]
) -> Any:
    """``--plan``: its stages (and ``--neighbours``'), links and all-reduces measured on
    the devices it names."""
    from pdjax import calibrate as cal_lib
    from pdjax.partition import Plan

    plan = Plan.load(args.plan)
    if plan.num_layers != len(spec.layers):
        raise CalibrationError(
            f"the plan {args.plan} covers {plan.num_layers} layers, {args.model} "
            f"({args.config}) has {len(spec.layers)}: calibrate the model it was made for"
        )
    plans = [plan, *_neighbours(args, plan, spec, sample)]
    by_id = {int(d.id): d for d in devices}
    ids = sorted({d for q in plans for s in q.stages for d in s.devices})
    topo_ids = plan.topology.device_ids
    if topo_ids is None:  # positions: the devices in order
        by_id = dict(enumerate(devices))
    missing = [d for d in ids if d not in by_id]
    if missing:
        raise CalibrationError(
            f"the plan uses devices {missing}; here: {sorted(by_id)} (use --devices)"
        )
    cal = cal_lib.calibrate(
        spec.layers, sample, spec.loss, opt, cal_lib.plan_stages(plans),
        devices=[by_id[d] for d in ids], repeats=args.repeats, log=print,
    )  # fmt: skip
    if topo_ids is None:  # record the plan's ids (positions), not the devices'
        cal = _renumber(cal, {int(by_id[d].id): d for d in ids})
    return cal


def _neighbours(args: argparse.Namespace, plan: Any, spec: Any, sample: Any) -> list[Any]:
    """``--neighbours``: every plan with one of ``plan``'s cuts moved by one layer (none
    without the option)."""
    if not args.neighbours:
        return []
    from pdjax import calibrate as cal_lib
    from pdjax.partition import evaluate_partition
    from pdjax.profile import Profile

    return [
        evaluate_partition(
            Profile.load(args.profile) if args.profile else _flat_profile(spec, sample),
            plan.topology, layout, schedule=plan.schedule.kind,
            num_microbatches=plan.num_microbatches,
            microbatch_size=plan.microbatch_size, partitioner="neighbour",
        )
        for layout in cal_lib.neighbours(plan)
    ]  # fmt: skip


def _flat_profile(spec: Any, sample: Any) -> Any:
    """A counted profile (no timing) for neighbours' layouts when none is given."""
    from pdjax.profile import profile

    return profile(spec.layers, sample[0])


def _renumber(cal: Any, ids: dict[int, int]) -> Any:
    """The calibration with device ids mapped through ``ids``."""
    import dataclasses

    return dataclasses.replace(
        cal,
        devices=tuple(ids.get(d, d) for d in cal.devices),
        links=tuple(
            dataclasses.replace(ln, src=ids.get(ln.src, ln.src), dst=ids.get(ln.dst, ln.dst))
            for ln in cal.links
        ),
        allreduces=tuple(
            dataclasses.replace(a, devices=tuple(ids.get(d, d) for d in a.devices))
            for a in cal.allreduces
        ),
    )


def _render(ranked: list[Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="plans ranked by the simulator on calibrated costs")
    for header in ("rank", "plan", "simulated ms/mb", "planner ms/mb", "profile-only ms/mb"):
        table.add_column(header, justify="right" if header != "plan" else "left")
    for k, r in enumerate(ranked):
        table.add_row(
            str(k + 1), r.plan.config, f"{1e3 * r.simulated:.2f}",
            f"{1e3 * r.plan.time_per_microbatch:.2f}", f"{1e3 * r.uncalibrated:.2f}",
        )  # fmt: skip
    Console(file=sys.stdout, width=140).print(table)
