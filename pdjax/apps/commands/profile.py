"""``pdjax profile``: profile a model (bundled, or ``package.module:factory``) and print its
per-layer table."""

from __future__ import annotations

import argparse
import sys
from typing import IO

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdjax._units import fmt_bytes, fmt_count, fmt_seconds
from pdjax.apps.commands import (
    MAX_PROFILE_BATCH,
    HelpFormatter,
    PathOption,
    add_model_arguments,
    check_writable,
    float_range,
    positive_int,
    seed_int,
)
from pdjax.errors import ProfileError
from pdjax.profile import DEVICE_MODELS, Profile, profile

__all__ = ["register", "render_profile", "run"]


WHY_BATCH = "the sample batch and every layer's activations are allocated at once"
#: ``--repeats``: timed runs per measurement.
MAX_REPEATS = 1000


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``profile`` subcommand."""
    p = subparsers.add_parser(
        "profile",
        help="per-layer FLOPs, bytes and times of a model",
        description="Profile a model with XLA's cost analysis (and optionally measured "
        "times) and print a per-layer table.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # a prefix is refused, not read as an option
    )
    add_model_arguments(p, required=True)
    p.add_argument(
        "--batch-size",
        action=positive_int(MAX_PROFILE_BATCH, WHY_BATCH),
        default=32,
        help="samples in the profiled batch",
    )
    p.add_argument("--measure", action="store_true", help="time forward/backward on a device")
    p.add_argument(
        "--device-model",
        choices=(*sorted(DEVICE_MODELS), "measured"),
        help="estimate seconds with this device's roofline (or 'measured' = --measure)",
    )
    p.add_argument(
        "--efficiency",
        action=float_range(0.0, 1.0, lo_open=True),
        default=1.0,
        help="fraction of the device's peaks (0-1]",
    )
    p.add_argument(
        "--repeats",
        action=positive_int(MAX_REPEATS),
        default=5,
        help="timed runs per layer (median)",
    )
    p.add_argument("--eval", action="store_true", help="profile eval mode instead of train")
    p.add_argument("--seed", action=seed_int, default=0, help="PRNG seed for initialisation")
    p.add_argument("--out", action=PathOption, help="write the profile JSON here")
    p.add_argument("--json", action="store_true", help="print the profile JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Profiles ``args.model`` and prints (or writes) the result."""
    from pdjax.models import get_model
    from pdjax.profile import get_device_model

    if args.batch_size < 1:
        raise ProfileError(f"--batch-size must be >= 1, got {args.batch_size}")
    check_writable("--out", args.out, ProfileError)
    spec = get_model(args.model, args.config)
    rng = jax.random.key(args.seed)
    sample = spec.sample_input(args.batch_size)
    model = None
    if args.device_model and args.device_model != "measured":
        model = get_device_model(args.device_model, efficiency=args.efficiency)
    console = Console(stderr=True)  # progress on stderr: --json output stays clean
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(
        *columns,
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        prof = profile(
            spec.layers,
            sample,
            rng=rng,
            train=not args.eval,
            measure=args.measure or args.device_model == "measured",
            device_model=model,
            repeats=args.repeats,
            meta={"model": args.model, "config": args.config},
            progress=bar,
        )
    if args.out:
        prof.save(args.out)
    if args.json:
        print(prof.to_json())
    else:
        render_profile(prof, title=f"{args.model} ({args.config}), batch {args.batch_size}")
        if args.out:
            print(f"profile written to {args.out}")
    return 0


def render_profile(prof: Profile, title: str = "", file: IO[str] | None = None) -> None:
    """Prints a per-layer table of ``prof`` with totals (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None, show_footer=True)
    layers = prof.layers
    fwd_flops = sum(layer.forward_flops or 0 for layer in layers)
    bwd_flops = sum(layer.backward_flops or 0 for layer in layers)
    params = sum(layer.param_bytes for layer in layers)
    stash = sum(layer.stash_bytes for layer in layers)
    has_times = prof.has_times
    cols = [
        ("#", "", "right"),
        ("layer", "total", "left"),
        ("output", "", "left"),
        ("fwd FLOPs", fmt_count(fwd_flops), "right"),
        ("bwd FLOPs", fmt_count(bwd_flops), "right"),
        ("params", fmt_bytes(params), "right"),
        ("activation", "", "right"),
        ("stash", fmt_bytes(stash), "right"),
    ]
    if has_times:
        cols += [
            ("fwd time", fmt_seconds(float(prof.forward_seconds().sum())), "right"),
            ("bwd time", fmt_seconds(float(prof.backward_seconds().sum())), "right"),
        ]
    for header, footer, justify in cols:
        table.add_column(header, footer=footer, justify=justify)  # type: ignore[arg-type]
    for i, layer in enumerate(layers):
        row = [
            str(i),
            layer.name,
            layer.output_shape or "-",
            fmt_count(layer.forward_flops),
            fmt_count(layer.backward_flops),
            fmt_bytes(layer.param_bytes),
            fmt_bytes(layer.output_bytes),
            fmt_bytes(layer.stash_bytes),
        ]
        if has_times:
            row += [fmt_seconds(layer.forward_seconds), fmt_seconds(layer.backward_seconds)]
        table.add_row(*row)
    console = Console(file=file or sys.stdout, width=160)
    console.print(table)
    console.print(f"times: {prof.time_source}; batch size {prof.batch_size}; {len(layers)} layers")
