"""``pdjax train``: train a model on an offline dataset with a schedule (or DP), with a
progress bar, per-epoch evaluation, a target accuracy, metrics, plots and checkpoints.

Every setting is checked before anything runs or is written: the schedules and their
options, every output path (tried by creating a file there; a symbolic link is refused),
the model (a bundled one, or imported from ``package.module:factory``), the dataset
(``digits``, ``text`` or an ``.npz`` file, checked against the model's sample batch),
sizes, devices and plan files; the output folder is made by the first epoch's metrics.
On a terminal a progress bar shows the batches; elsewhere (a log file, CI) one line per
epoch. ``metrics.jsonl`` follows the checkpoints, each line bound to its run's id: a
resumed run appends, each line once it is checkpointed, and never deletes or rewrites a
line; a fresh run refuses an ``--out`` whose metrics hold lines of its label, and a
resume one holding lines of another run. Metrics and ``summary.json`` are strict JSON
(NaN and infinities as null). ``--tensorboard DIR`` writes event files per run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdjax.apps.commands import (
    MAX_DEVICES,
    HelpFormatter,
    PathOption,
    add_model_arguments,
    add_option_flags,
    float_range,
    int_range,
    option_values,
    positive_float,
    positive_int,
    seed_int,
    split_list,
)
from pdjax.schedules.spec import VARIANTS

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = ["LAUNCHER_OPTIONS", "epoch_line", "register", "run", "set_cpu_devices", "worker_argv"]

#: Bounds of train's and bench's numeric options (each refused up front, by name).
DEVICES = positive_int(
    MAX_DEVICES,
    "on CPU pdjax simulates that many devices (jax_num_cpu_devices), each compiling its own "
    "programs; beyond this a run does not start in reasonable time",
)
#: A step's batch is allocated at once.
BATCH = positive_int(2**20, "a step's batch is allocated at once")
MICROBATCHES = positive_int(2**20, "a microbatch needs a sample")
CHUNKS = positive_int(1024, "each chunk is a compiled stage of at least one layer")
STEPS = positive_int(100_000, "each step is timed; more would not finish")
REPEATS = positive_int(1000, "each repeat times every schedule")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``train`` subcommand."""
    p = subparsers.add_parser(
        "train",
        help="train a model with a pipeline schedule or data parallelism",
        description="Profile, plan and train a model (bundled, or your own as "
        "package.module:factory) on digits, text or your own .npz file, evaluating every "
        "epoch. --compare runs other schedules (or dp) on the same data, side by side.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # a prefix is refused: see worker_argv
    )
    add_model_arguments(p, default="cnn")
    _add_run_options(p)
    _add_step_options(p)
    _add_pipeline_options(p)
    p.add_argument(
        "--seq-len",
        action=positive_int(2**16, "a window's activations are allocated at once"),
        default=16,
        help="tokens per window (text, text-bpe); passed to a factory that takes seq_len",
    )
    p.add_argument(
        "--buckets",
        default="",
        metavar="L1,L2,...",
        help="text-bpe: whole documents in sequence-length buckets (e.g. 64,128,256), each "
        "padded to the smallest bucket that holds it (longer ones cut at the largest), "
        "every batch from one bucket; the padding each bucket wastes is reported",
    )
    p.add_argument(
        "--loss-mean",
        default="microbatch",
        choices=("microbatch", "tokens"),
        help="with --buckets: average the loss per microbatch, then over the step's "
        "microbatches (default), or over the step's real tokens, each token counting the same",
    )
    p.add_argument(
        "--vocab-size",
        action=positive_int(2**20, "the tokenizer's table is trained and held in memory"),
        default=None,
        metavar="N",
        help="text-bpe: the tokenizer's vocabulary (at least 258; default: 1024 for a "
        "bundled language model, built with it; a model of your own: its num_classes)",
    )
    p.add_argument(
        "--precision",
        default="float32",
        choices=("float32", "bf16", "f16"),
        help="bf16: every layer computes in bfloat16, parameters, optimizer and loss stay "
        "float32; f16: in float16, with dynamic loss scaling (flush schedules only)",
    )
    p.add_argument(
        "--compare",
        default="",
        help="comma-separated schedules to run next to --schedule on the same data, e.g. "
        "'dp' or 'dp,1f1b,pipedream-nostash,pipedream-vsync'",
    )
    _add_output_options(p)
    _add_process_options(p)
    p.set_defaults(func=run)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """What runs: the dataset, the schedule, the devices and the plan."""
    from pdjax.apps.train import SCHEDULE_CHOICES

    p.add_argument(
        "--dataset",
        action=PathOption,
        default="digits",
        metavar="NAME|PATH.npz|tokens:PATH",
        help="digits (8x8 images, or 64 features for a model taking them), text "
        "(characters, for language models), text-bpe (byte-level BPE tokens of the same "
        "documents, packed; needs the text extra), an .npz file with arrays x_train, y_train, "
        "x_test, y_test whose rows fit the model's sample batch, or tokens:PATH, a flat "
        "binary token file (uint16/uint32, described by PATH.json; memory-mapped and "
        "streamed) packed into windows of --seq-len",
    )
    p.add_argument(
        "--validation",
        default="",
        metavar="FRACTION|PATH",
        help="tokens:PATH only: the validation split, the fraction of the file's tokens at "
        "its end (default 0.1) or a second token file",
    )
    p.add_argument(
        "--schedule",
        default="pipedream",
        choices=SCHEDULE_CHOICES,
        help="pipeline schedule, or dp for the data-parallel baseline, or auto: profile and "
        "let plan_auto choose the schedule, microbatches and stages (simulated)",
    )
    p.add_argument(
        "--allow-stale",
        action="store_true",
        help="--schedule auto: the search may choose pipedream or 2bw (stale weights)",
    )
    p.add_argument("--devices", action=DEVICES, default=4, help="devices to use (CPU: simulated)")
    p.add_argument(
        "--plan",
        action=PathOption,
        default="auto",
        help="'auto' (profile + plan now), 'even', or plan.json",
    )
    p.add_argument(
        "--straight",
        action="store_true",
        help="--plan auto without replication: a pure pipeline, one stage per device",
    )
    p.add_argument(
        "--mesh",
        default="",
        metavar="AXIS=N,...",
        help="each stage's devices as a mesh, e.g. fsdp=2,tensor=2 (one for every stage) "
        "or 'tensor=2;fsdp=2' (one per stage): the model's sharding annotations split its "
        "weights, optimizer state and weight versions over fsdp and tensor, the batch over "
        "data and fsdp; with --plan even (devices / mesh size stages), a plan file, or "
        "--schedule dp; 'auto': the planner chooses each stage's mesh (with --schedule auto, "
        "or --plan auto and a schedule that runs a plan's stages)",
    )
    p.add_argument(
        "--fsdp-auto",
        action="store_true",
        help="with --mesh: shard the parameters the model does not annotate over fsdp (ZeRO-3); "
        "--mesh auto does so by itself for a model without annotations",
    )
    p.add_argument(
        "--min-stages",
        action=positive_int(MAX_DEVICES, "each stage needs a device"),
        default=1,
        metavar="N",
        help="--plan auto: the fastest plan of at least N stages (the planner may find one "
        "data-parallel stage fastest, and says so; --min-stages 2 forces a pipeline)",
    )


def _add_step_options(p: argparse.ArgumentParser) -> None:
    """How long and how it steps: epochs, batch and microbatches, the optimizer, the seed
    and the target accuracy."""
    p.add_argument(
        "--epochs",
        action=positive_int(100_000, "each epoch trains on the whole dataset"),
        default=10,
        help="epochs at most",
    )
    p.add_argument(
        "--epoch-steps",
        action=positive_int(10**9, "an epoch is trained, evaluated and saved as a whole"),
        default=None,
        metavar="N",
        help="steps in an epoch (default: a pass over the training split); the input "
        "stream runs on across epochs, so --epochs x --epoch-steps bounds a run on data of "
        "any size, and each epoch is evaluated and checkpointed",
    )
    p.add_argument(
        "--call-steps",
        action=positive_int(10**6, "a call's inputs are placed on the devices at once"),
        default=None,
        metavar="N",
        help="the most steps one runtime call takes (default 16): each call's inputs are "
        "read and placed as it starts, and the planner prices calls of this length",
    )
    p.add_argument("--batch-size", action=BATCH, default=64, help="samples per optimizer step")
    p.add_argument(
        "--microbatches", action=MICROBATCHES, default=4, help="M: microbatches per step"
    )
    p.add_argument(
        "--chunks", action=CHUNKS, default=2, help="v: model chunks per device (interleaved)"
    )
    _add_optimizer_options(p)
    p.add_argument(
        "--seed",
        action=seed_int,
        default=0,
        help="seeds initialisation, dropout, data order and split",
    )
    p.add_argument(
        "--target-accuracy",
        action=float_range(0.0, 1.0, lo_open=True),
        help="stop at this test accuracy (0-1]",
    )


def _add_optimizer_options(p: argparse.ArgumentParser) -> None:
    """The optimizer: its kind (or your own), learning rate and schedule, weight decay
    and gradient clipping."""
    g = p.add_argument_group(
        "optimizer", "the optimizer, its learning rate schedule and gradient clipping"
    )
    g.add_argument(
        "--optimizer",
        default="adam",
        metavar="NAME|pkg.module:fn",
        help="adam, adamw, sgd, momentum (sgd with momentum 0.9), or your own: a function "
        "returning an optax.GradientTransformation (given learning_rate, a number or "
        "schedule, if it takes it; called once), or one such object, imported as --model "
        "factories are",
    )
    g.add_argument(
        "--lr",
        action=positive_float(),
        metavar="LR",
        help="learning rate (a schedule's peak; default 1e-3); an optimizer of your own "
        "that takes no learning_rate keeps its own",
    )
    g.add_argument(
        "--weight-decay",
        action=float_range(0.0, 1e6),
        metavar="W",
        help="adamw: decoupled weight decay (default: optax's, 1e-4)",
    )
    g.add_argument(
        "--clip-norm",
        action=positive_float(),
        metavar="C",
        help="clip the gradients to global norm C before the optimizer",
    )
    g.add_argument(
        "--lr-schedule",
        default="constant",
        choices=("constant", "warmup-cosine"),
        help="constant, or warmup-cosine: linear from 0 to --lr over --warmup-steps updates, "
        "then a cosine decay to 0 at the end of the run (or of --decay-steps)",
    )
    g.add_argument(
        "--warmup-steps",
        action=int_range(0, 10**9, "a schedule's updates are counted in 32 bits"),
        default=0,
        metavar="N",
        help="warmup-cosine: warmup updates",
    )
    g.add_argument(
        "--decay-steps",
        action=positive_int(10**9, "a schedule's updates are counted in 32 bits"),
        metavar="N",
        help="warmup-cosine: the schedule's length in updates, warmup included, at least the "
        "run's (default: the run's updates, stage 0's)",
    )


def _add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """Options of the pipeline: the schedule kinds' own (PipeDream's: the spec's table,
    :data:`pdjax.schedules.spec.OPTIONS`) and how replicated stages share their work."""
    add_option_flags(p)
    p.add_argument(
        "--replication",
        default="plan",
        choices=("plan", "split", "round-robin"),
        help="replicated stages: split each microbatch over the devices, or PipeDream's "
        "round-robin (whole microbatches, one per device, one update per group under "
        "pipedream); plan: as the plan says",
    )


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """What a run writes and shows: checkpoints (and the step to resume from), metrics,
    plots, TensorBoard files and progress."""
    p.add_argument(
        "--checkpoint-dir",
        action=PathOption,
        help="save every epoch here (a folder per run, with the plan it runs); resume a run "
        "found there from its newest step, with its saved plan, appending to its metrics",
    )
    p.add_argument(
        "--resume-step",
        type=int,
        metavar="N",
        help="with --checkpoint-dir: resume from step N (saved after epoch N) instead of "
        "the newest; the steps after N are moved into a set-aside-after-N-* folder there",
    )
    p.add_argument(
        "--out",
        action=PathOption,
        default="out/train",
        help="folder for metrics.jsonl, summary.json and plots",
    )
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument(
        "--tensorboard",
        action=PathOption,
        metavar="DIR",
        help="also write TensorBoard event files, DIR/<run>: train and test loss, test "
        "accuracy, samples/s and seconds per epoch (needs tensorboardX: pip install "
        "'pdjax[tensorboard]')",
    )
    p.add_argument(
        "--progress",
        default="auto",
        choices=("auto", "bar", "lines"),
        help="a progress bar over each epoch's batches (bar), one line per epoch (lines), or "
        "a bar on a terminal and lines elsewhere (auto)",
    )


def _add_process_options(p: argparse.ArgumentParser) -> None:
    """One pipeline across processes (jax.distributed), as an option group of its own."""
    from pdjax.apps.train import TRANSPORT_CHOICES

    g = p.add_argument_group(
        "several processes",
        "one pipeline across processes (jax.distributed): run the same command in every "
        "process, or set PDJAX_COORDINATOR/PDJAX_NUM_PROCESSES/PDJAX_PROCESS_ID (or JAX_*); "
        "--devices counts the devices of all processes",
    )
    g.add_argument(
        "--num-processes",
        action=positive_int(MAX_DEVICES, "a process has at least one device"),
        help="processes in the run",
    )
    g.add_argument(
        "--transport",
        default="auto",
        choices=TRANSPORT_CHOICES,
        help="how activations cross processes (auto: device_put up to 2 processes on CPU, "
        "collectives beyond)",
    )
    g.add_argument(
        "--process-id",
        action=int_range(0, MAX_DEVICES - 1, "a process has at least one device"),
        help="this process, 0..N-1",
    )
    g.add_argument("--coordinator", help="HOST:PORT of process 0 (the coordination service)")
    g.add_argument(
        "--local-processes",
        action=positive_int(64, "each is a Python process with JAX on this machine"),
        metavar="N",
        help="try it here: start N processes of this command on 127.0.0.1, --devices/N "
        "CPU devices each",
    )
    g.add_argument(
        "--pin-cores", action="store_true", help="with --local-processes: process i on core i"
    )


def set_cpu_devices(n: int) -> None:
    """Asks for ``n`` CPU devices if JAX's backends are not started yet (a no-op after)."""
    import jax

    try:
        # jax sets its options as attributes at run time and leaves update() unannotated
        if jax.config.jax_num_cpu_devices < n:  # type: ignore[attr-defined]
            jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already initialised: keep what is there
        pass


def _variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    # the pipedream options go with --schedule, whatever it is: TrainConfig refuses them
    # for another schedule rather than ignoring them
    base = {
        "schedule": args.schedule,
        "options": option_values(args),
        "allow_stale": args.allow_stale,
    }
    runs: list[dict[str, Any]] = [base]
    for name in split_list(args.compare):
        if name in VARIANTS:
            options = dict(VARIANTS[name])
            runs.append({"schedule": options.pop("kind"), "options": options})
        else:
            runs.append({"schedule": name})
    return runs


def run(args: argparse.Namespace) -> int:
    """Checks every requested variant, trains each and prints a summary table. The
    library's messages name this command's flags meanwhile (``--batch-size 33``, not
    ``batch_size=33``: :mod:`pdjax.apps.train.wording`)."""
    from pdjax.apps.train.wording import command_line

    with command_line():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "local_processes", None):
        return _launch_local(args)
    if not _join(args):
        set_cpu_devices(args.devices)
    import jax
    from rich.console import Console

    from pdjax._allocator import fix_thresholds
    from pdjax.apps.train import (
        METRICS_FILE,
        build,
        check,
        check_output_paths,
        check_outputs,
        check_results,
        require_tensorboard,
        run_folder,
    )

    # Before the dataset and the runs allocate: the thresholds the cluster workers get
    # from their environment (pdjax._allocator), so that a stage's time does not depend
    # on what the process freed before it.
    allocator = fix_thresholds(jax.default_backend())
    # Every configuration is checked before the first run trains, and before anything is
    # written: settings, output paths, model, dataset, sizes, devices, plan files.
    configs = _configs(args)
    out = Path(args.out)
    check_output_paths(
        out,
        [cfg.label for cfg in configs],
        plots=not args.no_plots,
        # process 0 alone writes the checkpoints (the others need not share the folder)
        checkpoint_dir=args.checkpoint_dir if jax.process_index() == 0 else None,
        tensorboard=args.tensorboard,
    )
    if args.tensorboard:
        require_tensorboard()
    built = build(configs[0])  # the variants differ only in how they train
    for cfg in configs:
        check(cfg, *built)

    metrics_path = out / METRICS_FILE
    folders = [
        os.path.join(args.checkpoint_dir, run_folder(cfg.label)) if args.checkpoint_dir else None
        for cfg in configs
    ]
    run_ids = [  # earlier outputs are never dropped, nor mixed with this run's
        check_outputs(cfg, ckpt, metrics_path, args.resume_step)
        for cfg, ckpt in zip(configs, folders, strict=True)
    ]
    labels = [cfg.label for cfg in configs]
    check_results(out, list(zip(labels, run_ids, strict=True)), plots=not args.no_plots)

    bar = args.progress == "bar" or (args.progress == "auto" and sys.stdout.isatty())
    console = Console(width=None if sys.stdout.isatty() else 140)
    print(f"allocator: {allocator}", flush=True)
    results = [
        _train_one(
            cfg,
            console,
            ckpt=ckpt,
            metrics_path=metrics_path,
            built=built,
            bar=bar,
            tensorboard=args.tensorboard,
            resume_step=args.resume_step,
        )
        for cfg, ckpt in zip(configs, folders, strict=True)
    ]
    _summary(console, results)
    _write_results(console, args, results, metrics_path, allocator)
    return 0


def _configs(args: argparse.Namespace) -> list[Any]:
    """The :class:`~pdjax.apps.train.TrainConfig` of each variant (:func:`_variants`),
    each a run of its own: two variants of one label (one run folder) are refused, as they
    would share their checkpoints and metrics."""
    from pdjax.apps.train import TrainConfig, run_folder
    from pdjax.apps.train.config import runs_plan
    from pdjax.errors import PipelineError

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
        weight_decay=args.weight_decay,
        clip_norm=args.clip_norm,
        lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        decay_steps=args.decay_steps,
        min_stages=args.min_stages,
        seed=args.seed,
        target_accuracy=args.target_accuracy,
        seq_len=args.seq_len,
        vocab_size=args.vocab_size,
        precision=args.precision,
        straight=args.straight,
        transport=args.transport,
        replication=args.replication,
        mesh=args.mesh,
        fsdp_auto=args.fsdp_auto,
        epoch_steps=args.epoch_steps,
        call_steps=args.call_steps,
        validation=args.validation,
        buckets=args.buckets,
        loss_mean=args.loss_mean,
    )
    variants = _variants(args)
    for variant in variants[1:]:  # --min-stages restricts the plans of those that run one
        if not runs_plan(variant["schedule"]):
            variant["min_stages"] = 1
    configs = [TrainConfig(**{**common, **variant}) for variant in variants]
    seen: dict[str, str] = {}
    for cfg in configs:
        folder = run_folder(cfg.label)
        if folder in seen:
            twice = (
                f"the run {cfg.label!r} is asked for twice"
                if seen[folder] == cfg.label
                else f"the runs {seen[folder]!r} and {cfg.label!r} share the folder {folder!r}"
            )
            raise PipelineError(
                f"--schedule {args.schedule} --compare {args.compare}: {twice}, and each run "
                "needs its own checkpoints and metrics; drop the repeat from --compare"
            )
        seen[folder] = cfg.label
    return configs


def _write_results(
    console: Any,
    args: argparse.Namespace,
    results: list[Any],
    metrics_path: Path,
    allocator: str,
) -> None:
    """Writes ``summary.json`` (each run's entry with ``allocator``, the process's malloc
    settings: :func:`pdjax._allocator.fix_thresholds`) and the plots (unless
    ``--no-plots``) into ``--out`` (atomically, never through a symbolic link), and says
    where they and the metrics are."""
    from pdjax._jsonio import write_atomic
    from pdjax.apps.train import SUMMARY_FILE
    from pdjax.errors import PipelineError

    out = Path(args.out)
    summary_path = out / SUMMARY_FILE
    summary = [{**_result_dict(r), "allocator": allocator} for r in results]
    text = json.dumps(_strict_json(summary), indent=1, allow_nan=False)
    write_atomic(summary_path, text, what="summary", error=PipelineError)
    console.print(f"metrics: {metrics_path}  summary: {summary_path}", highlight=False)
    if args.tensorboard:
        console.print(f"tensorboard: tensorboard --logdir {args.tensorboard}", highlight=False)
    if not args.no_plots:
        if any(math.isfinite(h.test_accuracy) for r in results for h in r.history):
            from pdjax.apps.plots import plot_training

            paths = plot_training(results, out)
            console.print("plots: " + "  ".join(str(p) for p in paths), highlight=False)
        else:
            console.print("plots: none (the model has no accuracy to plot)", highlight=False)


def _join(args: argparse.Namespace) -> bool:
    """Joins a multi-process run given by flags or environment; False for a single one.
    A process that ``--local-processes`` started ends itself when its launcher dies
    (:func:`pdjax.distributed.watch_launcher`)."""
    from pdjax.distributed import DistributedConfig, config_from_env, initialize, watch_launcher

    watch_launcher()
    config: DistributedConfig | None
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
        args.tensorboard = None
    return True


def _launch_local(args: argparse.Namespace) -> int:
    """``--local-processes N``: this command in N processes on 127.0.0.1, each given the
    command line :func:`pdjax.apps.cli.main` parsed (``args.cli_argv``, not ``sys.argv``)
    without the launcher's own options (:func:`worker_argv`)."""
    from pdjax.distributed import DistributedError, config_from_env, launch_local

    given = getattr(args, "cli_argv", None)
    if given is None:
        raise DistributedError(
            "--local-processes starts this command again in each process and needs the "
            "command line it was given: run it through pdjax.apps.cli.main (python -m pdjax)"
        )
    if config_from_env() is not None:  # a worker that would launch again
        raise DistributedError(
            "--local-processes: this process is already one of a multi-process run "
            "(PDJAX_COORDINATOR or JAX_COORDINATOR_ADDRESS is set) and would start processes "
            "of its own; drop --local-processes, or unset those variables"
        )
    n = args.local_processes
    return launch_local(
        ["-m", "pdjax", *worker_argv(given)],
        n,
        pin=args.pin_cores,
        cpu_devices=max(1, args.devices // n),
    )


#: The launcher's own options, which no worker gets: ``option -> whether it takes a value``.
LAUNCHER_OPTIONS = {"--local-processes": True, "--pin-cores": False}


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The command line of a worker of ``pdjax train --local-processes N``: ``argv`` (the
    launcher's, from the subcommand on) without :data:`LAUNCHER_OPTIONS`, in either
    spelling (``--local-processes 2``, ``--local-processes=2``), so that no worker launches
    again. Every parser refuses abbreviations (``allow_abbrev=False``): these are the only
    spellings argparse takes."""
    out: list[str] = []
    words = iter(argv)
    for word in words:
        option, eq, _ = word.partition("=")
        if option not in LAUNCHER_OPTIONS:
            out.append(word)
        elif LAUNCHER_OPTIONS[option] and not eq:
            next(words, None)  # its value
    return out


def epoch_line(cfg: Any, record: Any) -> str:
    """One epoch as a log line: ``"pipedream epoch 2/10: train loss 0.4321, test loss
    0.3810, test accuracy 0.912, 5,120 samples/s, 0.41 s"``."""
    parts = [f"train loss {record.train_loss:.4f}", f"test loss {record.test_loss:.4f}"]
    if math.isfinite(record.perplexity):
        parts.append(f"perplexity {record.perplexity:.2f}")
    if math.isfinite(record.test_accuracy):
        parts.append(f"test accuracy {record.test_accuracy:.3f}")
    parts.append(f"{record.samples_per_second:,.0f} samples/s")
    if math.isfinite(record.tokens_per_second):
        parts.append(f"{record.tokens_per_second:,.0f} tokens/s")
    if math.isfinite(record.mfu):
        parts.append(f"MFU {100 * record.mfu:.2f}%")
    parts.append(f"{record.seconds:.2f} s")
    return f"{cfg.label} epoch {record.epoch}/{cfg.epochs}: " + ", ".join(parts)


def _train_one(
    cfg: Any,
    console: Any,
    ckpt: str | None,
    metrics_path: Path,
    built: Any,
    bar: bool,
    tensorboard: str | None,
    resume_step: int | None = None,
) -> Any:
    """Trains one variant; a progress bar (``bar``) or one line per epoch on stdout."""
    from pdjax.apps.train import train

    title = f"{cfg.label}: {cfg.model} ({cfg.config}) on {cfg.dataset}"
    if bar:
        console.rule(title)
    else:
        print(f"== {title}", flush=True)
    display = _Display(cfg, console, ckpt, bar)
    try:
        return train(
            cfg,
            checkpoint_dir=ckpt,
            metrics_path=metrics_path,
            on_epoch=display.on_epoch,
            on_progress=display.on_progress if bar else None,
            built=built,
            on_resume=display.on_resume,
            on_start=display.on_start,
            tensorboard_dir=tensorboard,
            resume_step=resume_step,
        )
    finally:
        display.stop()


class _Display:
    """One variant's progress on the console, its methods :func:`~pdjax.apps.train.train`'s
    callbacks: a progress bar over each epoch's batches (``bar``), started once every
    setting is checked, or one line per epoch."""

    def __init__(self, cfg: Any, console: Any, ckpt: str | None, bar: bool) -> None:
        self._cfg, self._console, self._ckpt, self._bar = cfg, console, ckpt, bar
        self._progress: Progress | None = None
        self._task: Any = None
        self._epoch = 1  # the epoch running (for the bar)

    def on_resume(self, epochs: int, step: int) -> None:
        self._epoch = epochs + 1
        print(f"resuming from checkpoint step {step} (epoch {epochs}): {self._ckpt}", flush=True)

    def on_start(self, plan: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        print(f"plan: {plan}", flush=True)
        if self._bar:  # every setting is checked by now: no error comes under a bar
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                console=self._console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                f"{self._cfg.label} compiling", total=None, info=""
            )

    def on_progress(self, done: int, total: int) -> None:
        if self._progress is not None:
            description = f"{self._cfg.label} epoch {self._epoch}/{self._cfg.epochs}"
            self._progress.update(self._task, completed=done, total=total, description=description)

    def on_epoch(self, record: Any) -> None:
        cfg = self._cfg
        self._epoch = record.epoch + 1
        line = epoch_line(cfg, record)
        if self._progress is None:
            print(line, flush=True)
            return
        self._progress.console.print(line, highlight=False, markup=False)
        acc = record.test_accuracy
        self._progress.update(
            self._task,
            description=f"{cfg.label} epoch {record.epoch}/{cfg.epochs} done",
            info=f"loss {record.train_loss:.3f}"
            + (f"  acc {acc:.3f}" if math.isfinite(acc) else "")
            + f"  {record.samples_per_second:,.0f} samples/s",
        )

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _strict_json(value: Any) -> Any:
    """``value`` with every NaN or infinite number as None (null), so that the JSON is
    strict (a model without accuracy has NaN accuracies)."""
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _result_dict(result: Any) -> dict[str, Any]:
    return {
        "run": result.config.label,
        "run_id": result.run_id,
        "plan": result.plan,
        "plan_note": result.plan_note,
        "optimizer": result.optimizer,
        "stopped": result.stopped,
        "target_epoch": result.target_epoch,
        "time_to_target": result.time_to_target,
        "config": dataclasses.asdict(result.config),
        "history": [dataclasses.asdict(r) for r in result.history],
    }


def _summary(console: Any, results: list[Any]) -> None:
    from rich.table import Table

    table = Table(title="summary (epoch times exclude compilation and evaluation)")
    lm = any(math.isfinite(x.perplexity) for r in results for x in r.history)
    columns = ["run", "plan", "epochs", "final acc", "epochs to target", "s/epoch"]
    columns += ["time to target", "samples/s", "MFU"]
    if lm:
        columns += ["final perplexity", "tokens/s"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("run", "plan") else "right")
    for r in results:
        h = r.history
        mean_epoch = sum(x.seconds for x in h) / len(h) if h else float("nan")
        sps = sum(x.samples_per_second for x in h) / len(h) if h else float("nan")
        mfu = sum(x.mfu for x in h) / len(h) if h else float("nan")
        extra = [f"{100 * mfu:.2f}%" if math.isfinite(mfu) else "-"]
        if lm:
            tps = sum(x.tokens_per_second for x in h) / len(h) if h else float("nan")
            ppl = h[-1].perplexity if h else float("nan")
            extra += [f"{ppl:.2f}" if math.isfinite(ppl) else "-", f"{tps:,.0f}"]
        table.add_row(
            r.config.label,
            r.plan,
            str(len(h)),
            f"{r.final_accuracy:.3f}" if math.isfinite(r.final_accuracy) else "-",
            "-" if r.target_epoch is None else str(r.target_epoch),
            f"{mean_epoch:.2f}",
            "-" if r.time_to_target is None else f"{r.time_to_target:.2f} s",
            f"{sps:,.0f}",
            *extra,
        )
    console.print(table)
    for r in results:
        if r.plan_note:
            console.print(f"{r.config.label}: {r.plan_note}", highlight=False, markup=False)
    if any(r.config.target_accuracy for r in results):
        missed = [r.config.label for r in results if r.target_epoch is None]
        if missed:
            print(
                f"target accuracy {results[0].config.target_accuracy} not reached by: "
                + ", ".join(missed),
                file=sys.stderr,
            )
