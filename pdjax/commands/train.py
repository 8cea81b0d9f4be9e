"""``pdjax train``: train a model on an offline dataset with a schedule (or DP), with a
progress bar, per-epoch evaluation, a target accuracy, metrics, plots and checkpoints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

__all__ = ["register", "run", "set_cpu_devices"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``train`` subcommand."""
    from pdjax.models import MODELS
    from pdjax.train import SCHEDULE_CHOICES

    p = subparsers.add_parser(
        "train",
        help="train a model with a pipeline schedule or data parallelism",
        description="Profile, plan and train a model on digits or text, evaluating every "
        "epoch. --compare runs other schedules (or dp) on the same data, side by side.",
    )
    p.add_argument("--model", default="cnn", choices=MODELS)
    p.add_argument("--config", default="tiny", choices=("tiny", "paper"))
    p.add_argument("--dataset", default="digits", choices=("digits", "text"))
    p.add_argument("--schedule", default="pipedream", choices=SCHEDULE_CHOICES)
    p.add_argument("--devices", type=int, default=4, help="devices to use (CPU: simulated)")
    p.add_argument(
        "--plan", default="auto", help="'auto' (profile + plan now), 'even', or plan.json"
    )
    p.add_argument(
        "--straight", action="store_true", help="--plan auto without replication: a pure pipeline"
    )
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="samples per optimizer step")
    p.add_argument("--microbatches", type=int, default=4, help="M: microbatches per step")
    p.add_argument("--chunks", type=int, default=2, help="v for interleaved")
    p.add_argument("--optimizer", default="adam", choices=("adam", "sgd", "momentum"))
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-accuracy", type=float, help="stop at this test accuracy (0-1)")
    p.add_argument("--vertical-sync", action="store_true", help="pipedream: vertical sync")
    p.add_argument(
        "--no-weight-stashing", action="store_true", help="pipedream without weight stashing"
    )
    p.add_argument(
        "--extra-in-flight",
        type=int,
        default=0,
        metavar="E",
        help="pipedream: E more microbatches in flight per stage (hides transfer latency; "
        "one more stashed version and activation each)",
    )
    p.add_argument(
        "--replication",
        default="plan",
        choices=("plan", "split", "round-robin"),
        help="replicated stages: split each microbatch over the devices, or PipeDream's "
        "round-robin (whole microbatches, one per device, one update per group under "
        "pipedream); plan: as the plan says (default)",
    )
    p.add_argument("--seq-len", type=int, default=16, help="tokens per window (text)")
    p.add_argument(
        "--compare",
        default="",
        help="comma-separated schedules to run next to --schedule on the same data, e.g. "
        "'dp' or 'dp,1f1b,pipedream-nostash,pipedream-vsync'",
    )
    p.add_argument("--checkpoint-dir", help="save every epoch here; resume if it holds one")
    p.add_argument("--out", default="out/train", help="folder for metrics.jsonl and plots")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    g = p.add_argument_group(
        "several processes",
        "one pipeline across processes (jax.distributed): run the same command in every "
        "process, or set PDJAX_COORDINATOR/PDJAX_NUM_PROCESSES/PDJAX_PROCESS_ID (or JAX_*); "
        "--devices counts the devices of all processes",
    )
    g.add_argument("--num-processes", type=int, help="processes in the run")
    g.add_argument(
        "--transport",
        default="auto",
        choices=("auto", "device_put", "collective"),
        help="how activations cross processes (auto: device_put up to 2 processes on CPU, "
        "collectives beyond)",
    )
    g.add_argument("--process-id", type=int, help="this process, 0..N-1")
    g.add_argument("--coordinator", help="HOST:PORT of process 0 (the coordination service)")
    g.add_argument(
        "--local-processes",
        type=int,
        metavar="N",
        help="try it here: start N processes of this command on 127.0.0.1, --devices/N "
        "CPU devices each",
    )
    g.add_argument(
        "--pin-cores", action="store_true", help="with --local-processes: process i on core i"
    )
    p.set_defaults(func=run)


def set_cpu_devices(n: int) -> None:
    """Asks for ``n`` CPU devices if JAX's backends are not started yet (a no-op after)."""
    import jax

    try:
        if jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already initialised: keep what is there
        pass


def _variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = {"schedule": args.schedule}
    if args.schedule == "pipedream":
        base.update(
            vertical_sync=args.vertical_sync,
            weight_stashing=not args.no_weight_stashing,
            extra_in_flight=args.extra_in_flight,
        )
    runs = [base]
    for name in filter(None, (c.strip() for c in args.compare.split(","))):
        if name == "pipedream-nostash":
            runs.append({"schedule": "pipedream", "weight_stashing": False})
        elif name == "pipedream-vsync":
            runs.append({"schedule": "pipedream", "vertical_sync": True})
        else:
            runs.append({"schedule": name})
    return runs


def run(args: argparse.Namespace) -> int:
    """Trains every requested variant and prints a summary table."""
    if getattr(args, "local_processes", None):
        return _launch_local(args)
    if not _join(args):
        set_cpu_devices(args.devices)
    from rich.console import Console

    from pdjax.train import TrainConfig

    console = Console(width=None if sys.stdout.isatty() else 140)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()
    common = dict(
        model=args.model,
        config=args.config,
        dataset=args.dataset,
        devices=args.devices,
        plan=args.plan,
        epochs=args.epochs,
        batch_size=args.batch_size,
        microbatches=args.microbatches,
        chunks=args.chunks,
        optimizer=args.optimizer,
        learning_rate=args.lr,
        seed=args.seed,
        target_accuracy=args.target_accuracy,
        seq_len=args.seq_len,
        straight=args.straight,
        transport=args.transport,
        replication=args.replication,
    )
    # every configuration is checked before the first run trains
    configs = [TrainConfig(**{**common, **variant}) for variant in _variants(args)]
    results = []
    for cfg in configs:
        ckpt = None
        if args.checkpoint_dir:
            folder = re.sub(r"\W+", "_", cfg.label).strip("_")
            ckpt = os.path.join(args.checkpoint_dir, folder)
        results.append(_train_one(cfg, console, ckpt, metrics_path))
    _summary(console, results)
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps([_result_dict(r) for r in results], indent=1))
    console.print(f"metrics: {metrics_path}  summary: {summary_path}")
    if not args.no_plots:
        from pdjax.plots import plot_training

        paths = plot_training(results, out)
        console.print("plots: " + "  ".join(str(p) for p in paths))
    return 0


def _join(args: argparse.Namespace) -> bool:
    """Joins a multi-process run given by flags or environment; False for a single one."""
    from pdjax.distributed import DistributedConfig, config_from_env, initialize

    if getattr(args, "coordinator", None):
        n = args.num_processes or 1
        config = DistributedConfig(args.coordinator, n, args.process_id or 0)
    else:
        config = config_from_env()
    if config is None or config.num_processes == 1:
        return False
    if args.plan == "auto" or args.compare:
        from pdjax.distributed import DistributedError

        raise DistributedError(
            "several processes need one plan in every process: give --plan even or a "
            "plan.json (made with pdjax plan), and no --compare"
        )
    if config.cpu_devices is None:  # on CPU: --devices over all processes
        config = dataclasses.replace(
            config, cpu_devices=max(1, args.devices // config.num_processes)
        )
    initialize(config)
    if config.process_id > 0:  # process 0 writes the results; the others beside them
        args.out = os.path.join(args.out, f"process{config.process_id}")
        args.no_plots = True
    return True


def _launch_local(args: argparse.Namespace) -> int:
    """``--local-processes N``: this command in N processes on 127.0.0.1."""
    from pdjax.distributed import launch_local

    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--local-processes":
            skip = True
        elif not (a.startswith("--local-processes=") or a == "--pin-cores"):
            argv.append(a)
    n = args.local_processes
    return launch_local(
        ["-m", "pdjax", *argv], n, pin=args.pin_cores, cpu_devices=max(1, args.devices // n)
    )


def _train_one(cfg: Any, console: Any, ckpt: str | None, metrics_path: Path) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from pdjax.train import train

    console.rule(f"{cfg.label}: {cfg.model} ({cfg.config}) on {cfg.dataset}")
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task(f"{cfg.label} epoch 1", total=None, info="")

        def on_progress(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        def on_epoch(record: Any) -> None:
            progress.update(
                task,
                description=f"{cfg.label} epoch {record.epoch} done",
                info=f"loss {record.train_loss:.3f}  acc {record.test_accuracy:.3f}  "
                f"{record.samples_per_second:,.0f} samples/s",
            )

        result = train(
            cfg,
            checkpoint_dir=ckpt,
            metrics_path=metrics_path,
            on_epoch=on_epoch,
            on_progress=on_progress,
        )
    console.print(f"plan: {result.plan}")
    return result


def _result_dict(result: Any) -> dict[str, Any]:
    return {
        "run": result.config.label,
        "plan": result.plan,
        "stopped": result.stopped,
        "target_epoch": result.target_epoch,
        "time_to_target": result.time_to_target,
        "config": dataclasses.asdict(result.config),
        "history": [dataclasses.asdict(r) for r in result.history],
    }


def _summary(console: Any, results: list[Any]) -> None:
    from rich.table import Table

    table = Table(title="summary (epoch times exclude compilation and evaluation)")
    for col in (
        "run",
        "plan",
        "epochs",
        "final acc",
        "epochs to target",
        "s/epoch",
        "time to target",
        "samples/s",
    ):
        table.add_column(col, justify="left" if col in ("run", "plan") else "right")
    for r in results:
        h = r.history
        mean_epoch = sum(x.seconds for x in h) / len(h) if h else float("nan")
        sps = sum(x.samples_per_second for x in h) / len(h) if h else float("nan")
        table.add_row(
            r.config.label,
            r.plan,
            str(len(h)),
            f"{r.final_accuracy:.3f}",
            "-" if r.target_epoch is None else str(r.target_epoch),
            f"{mean_epoch:.2f}",
            "-" if r.time_to_target is None else f"{r.time_to_target:.2f} s",
            f"{sps:,.0f}",
        )
    console.print(table)
    if any(r.config.target_accuracy for r in results):
        missed = [r.config.label for r in results if r.target_epoch is None]
        if missed:
            print(
                f"target accuracy {results[0].config.target_accuracy} not reached by: "
                + ", ".join(missed),
                file=sys.stderr,
            )
