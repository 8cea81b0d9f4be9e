"""Training for real: data, a plan, a runner (pipeline or data parallel), epochs, targets.

:func:`train` is the whole loop behind ``pdjax train``: it loads an offline dataset, builds
the model, makes a plan (profiling and planning on the spot for ``plan="auto"``), runs
epochs with any schedule or the data-parallel baseline, evaluates on the test split after
every epoch, stops at a target accuracy, writes metrics as JSON lines, and checkpoints.

Units of work. ``batch_size`` samples make one optimizer step of the flush schedules, of
``2bw`` and of data parallelism; a pipeline splits it into ``microbatches`` (``M``)
microbatches. PipeDream updates after every microbatch, so it makes ``M`` updates where the
others make one. A pipeline runs a whole epoch in one call (``Pipeline.run``), so
asynchronous schedules stream through the epoch and drain only at its end — where the
loop evaluates and checkpoints (a drain-then-save checkpoint).

Models and data of your own. ``model`` may be ``package.module:factory``
(:func:`pdjax.models.load_model`; the factory gets ``config`` and ``seq_len`` if it takes
them) and ``dataset`` a path to an ``.npz`` file (:func:`pdjax.apps.data.load_npz`), checked
against the model's sample batch before anything runs (:func:`build`, :func:`check`).
A model without an accuracy function is trained and evaluated on its loss alone (its
accuracy reads NaN, null in the metrics file).

Checkpoints and faults. An epoch is checkpointed only when its weights and evaluation are
finite, and its metrics line is written once the checkpoint is committed; a diverged run
names the last step saved. A run saves its plan beside its checkpoints (:data:`PLAN_FILE`)
and beside its metrics, and a resumed run follows it rather than planning again
(``resume_step`` picks an older step). A fresh run never drops another run's metrics: it
refuses a metrics file holding lines of its own run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdjax._jsonio import write_atomic
from pdjax.apps import data as data_lib
from pdjax.errors import CheckpointError, PipelineError, TrainingDiverged
from pdjax.models import ModelSpec, check_model_name, get_model, is_model_ref, load_model
from pdjax.partition import StagePlan
from pdjax.pipeline.executor import Pipeline, even_stages
from pdjax.pipeline.schedules import STALE, stage_groups
from pdjax.runners import DataParallel, Runner

__all__ = [
    "DATASETS",
    "PLAN_TOLERANCE",
    "EpochRecord",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "auto_plan",
    "build",
    "check",
    "check_outputs",
    "evaluate",
    "model_spec",
    "plan_of",
    "require_tensorboard",
    "run_folder",
    "train",
]

SCHEDULE_CHOICES = (
    "pipedream",
    "2bw",
    "1f1b",
    "gpipe",
    "interleaved",
    "zb-h1",
    "zb-h2",
    "zb-v",
    "dp",
    "auto",
)
#: The bundled datasets; any other ``dataset`` is a path to an ``.npz`` file.
DATASETS = ("digits", "text")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (saved next to its metrics).

    Attributes:
      model: a name from :data:`pdjax.models.MODELS`, or ``package.module:factory``
        for a model of your own (:func:`pdjax.models.load_model`).
      config: ``"tiny"`` or ``"paper"`` (a factory that takes ``config`` gets it as is).
      dataset: ``"digits"`` (images), ``"text"`` (characters of Python's own docs), or
        the path of an ``.npz`` file with ``x_train``, ``y_train``, ``x_test``,
        ``y_test`` (:func:`pdjax.apps.data.load_npz`).
      schedule: a pipeline schedule, or ``"dp"`` for the data-parallel baseline.
      devices: how many of ``jax.devices()`` to use.
      plan: ``"auto"`` (profile and plan now), ``"even"`` (equal layer counts, one device
        per stage), or a path to a plan JSON.
      epochs: epochs at most.
      batch_size: samples per optimizer step (``M`` microbatches for a pipeline).
      microbatches: ``M``.
      chunks: ``v`` for ``interleaved``.
      optimizer: ``"adam"``, ``"sgd"`` or ``"momentum"``.
      learning_rate: the optimizer's step size.
      seed: seeds initialisation, dropout and the data order.
      target_accuracy: stop once the test accuracy reaches this (0-1), or None.
      vertical_sync: ``pipedream`` option.
      weight_stashing: ``pipedream`` option.
      seq_len: tokens per window for ``text`` (a factory that takes ``seq_len`` gets it).
      extra_in_flight: ``pipedream`` option: microbatches in flight beyond ``P - s``
        (latency hiding).
      transport: how values cross processes (``auto``, ``device_put``, ``collective``).
      straight: ``plan="auto"`` without replication (a pure pipeline, one stage per
        device), as PipeDream's optimizer offers.
      replication: how replicated stages share their work: ``"plan"`` (each plan stage's
        choice, split when the plan says nothing), ``"split"`` or ``"round-robin"``
        (:class:`~pdjax.pipeline.Pipeline`).
      allow_stale: ``schedule="auto"``: the search may choose ``pipedream`` or ``2bw``.

    ``schedule="auto"`` profiles the model (measured) and lets
    :func:`~pdjax.partition.plan_auto` choose the schedule, the microbatches, the stages
    and their replication for ``batch_size`` samples per step (:func:`resolve_auto`);
    ``microbatches`` and ``chunks`` are then its choice.
    """

    model: str = "cnn"
    config: str = "tiny"
    dataset: str = "digits"
    schedule: str = "pipedream"
    devices: int = 4
    plan: str = "auto"
    epochs: int = 10
    batch_size: int = 64
    microbatches: int = 4
    chunks: int = 2
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    seed: int = 0
    target_accuracy: float | None = None
    vertical_sync: bool = False
    weight_stashing: bool = True
    seq_len: int = 16
    straight: bool = False
    extra_in_flight: int = 0
    transport: str = "auto"
    replication: str = "plan"
    allow_stale: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULE_CHOICES:
            raise PipelineError(
                f"unknown schedule {self.schedule!r}; choose one of {SCHEDULE_CHOICES}"
            )
        check_model_name(self.model)
        if self.dataset not in DATASETS and not (
            self.dataset.endswith(".npz") or Path(self.dataset).is_file()
        ):
            raise PipelineError(
                f"unknown dataset {self.dataset!r}; choose digits or text, or give the path of "
                "an .npz file with x_train, y_train, x_test and y_test"
            )
        if self.optimizer not in ("adam", "sgd", "momentum"):
            raise PipelineError(f"unknown optimizer {self.optimizer!r}; adam, sgd or momentum")
        for name in ("devices", "epochs", "batch_size", "microbatches", "chunks"):
            if getattr(self, name) < 1:
                raise PipelineError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.microbatches:
            raise PipelineError(
                f"batch_size {self.batch_size} is not a multiple of microbatches "
                f"{self.microbatches}: each microbatch must have the same size"
            )
        if not self.learning_rate > 0:
            raise PipelineError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.schedule != "pipedream" and (self.vertical_sync or not self.weight_stashing):
            raise PipelineError(
                "vertical sync and no weight stashing are options of the pipedream schedule"
            )
        if self.extra_in_flight and self.schedule != "pipedream":
            raise PipelineError("extra microbatches in flight are an option of pipedream")
        if self.extra_in_flight < 0:
            raise PipelineError(f"extra_in_flight must be >= 0, got {self.extra_in_flight}")
        if self.allow_stale and self.schedule != "auto":
            raise PipelineError("allowing stale weights is an option of --schedule auto")
        if self.replication not in ("plan", "split", "round-robin"):
            raise PipelineError(
                f"unknown replication {self.replication!r}; choose plan, split or round-robin"
            )
        if self.transport not in ("auto", "device_put", "collective"):
            raise PipelineError(
                f"unknown transport {self.transport!r}; choose auto, device_put or collective"
            )
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise PipelineError(f"target_accuracy must be in (0, 1], got {self.target_accuracy}")

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches

    @property
    def label(self) -> str:
        """A short name for tables: the schedule and its options."""
        name = self.schedule
        if name == "pipedream" and not self.weight_stashing:
            name += " (no stashing)"
        if name == "pipedream" and self.vertical_sync:
            name += " (vertical sync)"
        if self.extra_in_flight:
            name += f" (+{self.extra_in_flight} in flight)"
        if self.replication != "plan":
            name += f" ({self.replication})"
        return name


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """One epoch's measurements.

    Attributes:
      epoch: 1-based epoch number.
      train_loss: mean training loss over the epoch's microbatches (steps for DP).
      test_loss: mean loss on the test split (eval mode).
      test_accuracy: accuracy on the test split (per token for language models; NaN
        for a custom model without an accuracy function).
      seconds: wall time of the epoch's training (evaluation excluded).
      elapsed: cumulative training seconds up to the end of this epoch.
      samples_per_second: training samples / seconds.
      updates: optimizer updates of stage 0 so far.
    """

    epoch: int
    train_loss: float
    test_loss: float
    test_accuracy: float
    seconds: float
    elapsed: float
    samples_per_second: float
    updates: int


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
      config: the run's configuration.
      plan: a text rendering of the stages (or ``"data parallel on N devices"``).
      history: one record per epoch run (restored epochs included after a resume).
      stopped: why the run ended: ``"target"``, ``"epochs"`` or ``"diverged"``.
      target_epoch: the first epoch that reached the target accuracy, or None.
      time_to_target: training seconds until then, or None.
      state: the final runner state.
      resumed_epoch: the epochs a checkpoint held when the run resumed from it, or None
        for a fresh run.
    """

    config: TrainConfig
    plan: str
    history: list[EpochRecord]
    stopped: str
    target_epoch: int | None = None
    time_to_target: float | None = None
    state: Any = None
    resumed_epoch: int | None = None

    @property
    def final_accuracy(self) -> float:
        return self.history[-1].test_accuracy if self.history else float("nan")


def make_optimizer(name: str, learning_rate: float) -> optax.GradientTransformation:
    """The optimizer a CLI name means: ``adam``, ``momentum`` (SGD, 0.9) or ``sgd``."""
    if name == "adam":
        return optax.adam(learning_rate)
    if name == "momentum":
        return optax.sgd(learning_rate, momentum=0.9)
    return optax.sgd(learning_rate)


def _optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    return make_optimizer(cfg.optimizer, cfg.learning_rate)


def run_folder(label: str) -> str:
    """A run's folder name (checkpoints, TensorBoard): its label with non-word characters
    as ``_``, e.g. ``"pipedream_no_stashing_"`` -> ``"pipedream_no_stashing"``."""
    return re.sub(r"\W+", "_", label).strip("_")


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The model of ``cfg``: a bundled one, or a factory's (which gets ``config`` and
    ``seq_len`` if it takes them)."""
    if is_model_ref(cfg.model):
        return load_model(cfg.model, offer={"config": cfg.config, "seq_len": cfg.seq_len})
    return get_model(cfg.model, cfg.config)


def _row_shape(tree: Any, what: str, cfg: TrainConfig) -> tuple[int, ...]:
    leaves = jax.tree.leaves(tree)
    if len(leaves) != 1:
        raise PipelineError(
            f"{cfg.model} takes {what} as {len(leaves)} arrays; the {cfg.dataset} dataset "
            "gives one array"
        )
    return tuple(np.shape(leaves[0])[1:])


def build(cfg: TrainConfig, spec: ModelSpec | None = None) -> tuple[ModelSpec, data_lib.Dataset]:
    """The model and dataset of ``cfg``, made to fit each other.

    A dataset must fit the model's sample batch: the shapes of its rows, and dtypes that
    convert without loss of meaning (:func:`pdjax.apps.data.fit_to_sample`). ``digits`` comes
    as 8x8x1 images or, for a model taking 64 features, flattened.

    Args:
      cfg: the run.
      spec: the model, if already built (default: :func:`model_spec`).

    Raises:
      PipelineError: a model that cannot take the dataset (an image model on text...).
      DataError: a dataset file that is unreadable or does not fit the model.
      LayerError: a model that cannot be built or imported.
    """
    spec = spec if spec is not None else model_spec(cfg)
    custom = spec.task == "custom"
    sample = jax.tree.map(np.asarray, spec.sample_batch(1))
    if cfg.dataset == "digits":
        if not custom and spec.task != "classification":
            raise PipelineError(
                f"{cfg.model} is a {spec.task} model; the digits dataset needs an image or "
                "MLP classifier (cnn, mlp, ...)"
            )
        shape = _row_shape(sample[0], "inputs", cfg)
        if shape not in ((8, 8, 1), (64,)) or (not custom and spec.num_classes != 10):
            raise PipelineError(
                f"{cfg.model} ({cfg.config}) takes inputs {shape}"
                + ("" if custom else f" with {spec.num_classes} classes")
                + "; digits has (8, 8, 1) images (or 64 features, flattened) with 10 "
                "classes; use --model cnn (or mlp) for digits"
                + (", or a model taking (B, 8, 8, 1) or (B, 64)" if custom else "")
            )
        ds = data_lib.digits(seed=cfg.seed, flatten=shape == (64,))
    elif cfg.dataset == "text":
        if not custom and spec.task != "language_model":
            raise PipelineError(
                f"{cfg.model} is a {spec.task} model; the text dataset needs a language model "
                "(gpt, awd_lm)"
            )
        if custom:
            shape = _row_shape(sample[0], "inputs", cfg)
            if shape != (cfg.seq_len,):
                raise PipelineError(
                    f"{cfg.model}'s sample batch has inputs of rows {shape}; the text dataset "
                    f"gives windows of --seq-len {cfg.seq_len} tokens, int32 (B, "
                    f"{cfg.seq_len}): match --seq-len to the model (a factory taking seq_len "
                    "gets it)"
                )
        ds = data_lib.text(seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=spec.num_classes or None)
        if not custom:  # a bundled language model takes any window up to its context
            return spec, ds
    else:
        ds = data_lib.load_npz(cfg.dataset)
    return spec, data_lib.fit_to_sample(ds, sample, num_classes=spec.num_classes)


def _check_devices(cfg: TrainConfig) -> None:
    devices = jax.devices()
    if cfg.devices > len(devices):
        kind = devices[0].platform
        raise PipelineError(
            f"{cfg.devices} devices requested, {len(devices)} {kind} device"
            f"{'s' if len(devices) > 1 else ''} visible: pass --devices {len(devices)} (or "
            f"fewer), or run where {cfg.devices} are visible. Without an accelerator, "
            f"`pdjax train --devices {cfg.devices}` makes {cfg.devices} CPU devices itself; "
            "from Python, set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{cfg.devices} before JAX starts"
        )


def check(cfg: TrainConfig, spec: ModelSpec, ds: data_lib.Dataset) -> None:
    """Checks what would fail later without compiling or running anything: sizes against
    the dataset and the devices, the schedule against the model's layers, a plan file,
    and a target accuracy for a model without accuracy.

    Raises:
      PipelineError: saying what to change.
      PlanError: for an unreadable plan file.
    """
    if cfg.batch_size > ds.num_train:
        raise PipelineError(
            f"--batch-size {cfg.batch_size} is larger than {ds.name}'s {ds.num_train} "
            "training samples"
        )
    _check_devices(cfg)
    if cfg.target_accuracy is not None and not spec.has_accuracy:
        raise PipelineError(
            f"--target-accuracy needs an accuracy, and {spec.name} has none: give the model "
            "an accuracy function (CustomModel(accuracy=...)), or drop --target-accuracy"
        )
    L = len(spec.layers)
    if cfg.schedule == "dp":
        if cfg.batch_size % cfg.devices:
            raise PipelineError(
                f"data parallelism splits each batch of {cfg.batch_size} over {cfg.devices} "
                f"devices; pick a --batch-size that is a multiple of {cfg.devices}"
            )
        return
    if cfg.schedule == "interleaved":
        if cfg.devices * cfg.chunks > L:
            raise PipelineError(
                f"interleaved needs {cfg.devices} devices x {cfg.chunks} chunks = "
                f"{cfg.devices * cfg.chunks} stages of at least one layer; {spec.name} has {L} "
                "layers: use fewer --devices or --chunks"
            )
        if cfg.plan not in ("auto", "even") or cfg.straight:
            raise PipelineError(
                "interleaved places equal layer counts, chunk k on device k mod P; it takes "
                "no --plan file and no --straight"
            )
        return
    if cfg.schedule == "zb-v":
        if 2 * cfg.devices > L:
            raise PipelineError(
                f"zb-v places 2 stages per device ({2 * cfg.devices} on {cfg.devices} "
                f"devices) and {spec.name} has {L} layers: use fewer --devices"
            )
        if cfg.plan not in ("auto", "even") or cfg.straight:
            raise PipelineError(
                "zb-v places equal layer counts in a V (stages d and 2P-1-d on device d); "
                "it takes no --plan file and no --straight"
            )
        return
    if cfg.plan not in ("auto", "even"):
        from pdjax.partition import Plan

        if not Path(cfg.plan).is_file():
            raise PipelineError(
                f"--plan takes 'auto', 'even' or a plan JSON file (pdjax plan --out); "
                f"{cfg.plan!r} is not a file"
            )
        plan = Plan.load(cfg.plan)
        if plan.num_layers != L:
            raise PipelineError(
                f"the plan {cfg.plan} covers {plan.num_layers} layers, {spec.name} has {L}: "
                "make the plan from this model's profile"
            )


#: How much slower, predicted on the measured profile, than the measured optimum the plan
#: made from counted costs may be and still be chosen by :func:`auto_plan`. Measured layer
#: times move by a few % from run to run, which swaps plans predicted within that of each
#: other; the counted plan does not move with them.
PLAN_TOLERANCE = 0.05


def auto_plan(
    spec: ModelSpec,
    sample: Any,
    devices: Sequence[jax.Device],
    schedule: str,
    microbatches: int,
    straight: bool = False,
    replication: str = "split",
) -> Any:
    """Profiles ``spec`` on one microbatch (measured on ``devices[0]``) and plans it over
    ``devices`` with PipeDream's optimizer (``pdjax`` cost model). ``replication``:
    ``"split"``, or ``"round-robin"`` / ``"auto"`` (``pipedream`` only: PipeDream's own
    replication, or the planner's pick).

    The runtime splits each microbatch evenly over a split stage's devices, which the
    optimizer does not know. When its plan replicates a split stage over a count that does
    not divide the microbatch, this takes the fastest plan that runs: the optimizer's over
    the first ``n`` devices for each smaller ``n``, and its straight pipeline (one device
    per stage, leaving devices idle where that is faster).

    Measured times are noisy, and plans predicted within a few % of each other swap places
    from run to run. So the same is planned on the profile's counted costs (XLA's FLOPs and
    bytes, fitted to the measured seconds: :func:`_counted_profile`), and that plan, whose
    stages do not follow the noise, is returned when it is predicted on the measured
    profile within :data:`PLAN_TOLERANCE` of the measured plan (recorded as
    ``plan.options["stable"]``); else the measured plan. A run that must repeat a plan
    exactly reads it from a file (``pdjax train`` writes the plan it ran)."""
    from pdjax.errors import PlanError
    from pdjax.profile import profile

    prof = profile(spec.layers, sample, measure=True, device=devices[0], repeats=5)
    args = (devices, schedule, microbatches, straight, replication)
    measured = _runnable_plan(prof, *args)
    counted = _counted_profile(prof)
    if counted is None:
        return measured
    try:
        reference = _measured_as(_runnable_plan(counted, *args), prof)
    except (PlanError, PipelineError):
        return measured
    if reference is None:
        return measured
    if reference.time_per_microbatch > (1 + PLAN_TOLERANCE) * measured.time_per_microbatch:
        return measured
    stable = {"tolerance": PLAN_TOLERANCE, "measured_optimum": measured.time_per_microbatch}
    return dataclasses.replace(reference, options={**reference.options, "stable": stable})


def _runnable_plan(
    prof: Any,
    devices: Sequence[jax.Device],
    schedule: str,
    microbatches: int,
    straight: bool,
    replication: str,
) -> Any:
    """The optimizer's plan of ``prof`` over ``devices``, or where the runtime cannot split
    its microbatches so, the fastest that it can (:func:`auto_plan`)."""
    from pdjax.errors import PlanError
    from pdjax.partition import Topology, plan_pipedream

    def plan(devs: Sequence[jax.Device], pure: bool, fewer: bool = False) -> Any:
        return plan_pipedream(
            prof,
            Topology.from_devices(devs),
            schedule=schedule if schedule != "dp" else "1f1b",
            num_microbatches=microbatches,
            straight=pure,
            fewer_machines=fewer,
            replication=replication if schedule == "pipedream" else "split",
        )

    best = plan(devices, straight)
    if _splits_evenly(best):
        return best
    runnable = []
    for n in range(len(devices) - 1, 0, -1):
        with contextlib.suppress(PlanError):
            runnable.append(plan(devices[:n], False))
    with contextlib.suppress(PlanError):
        runnable.append(plan(devices, True, fewer=True))
    runnable = [p for p in runnable if _splits_evenly(p)]
    if not runnable:
        raise PipelineError(
            f"the plan for {len(devices)} devices replicates a stage over a device count "
            f"that does not divide microbatches of {best.microbatch_size} samples, and no "
            "plan on fewer devices runs: pick --batch-size and --microbatches so that "
            "batch_size / microbatches is a multiple of the replica counts, or pass --straight"
        )
    return min(runnable, key=lambda p: p.time_per_microbatch)


def _counted_profile(prof: Any) -> Any:
    """``prof`` with every layer's seconds made from its counted work: ``a * flops + b *
    bytes accessed``, with ``a, b >= 0`` fitted (least squares) to the measured forward and
    backward seconds of all the layers, the backward's split into input and weight
    gradients by their FLOPs. Two numbers fitted to every layer move little with the
    noise of each; None where a layer has no counts or the fit has nothing to go on."""
    rows, seconds = [], []
    for layer in prof.layers:
        for flops, moved, secs in (
            (layer.forward_flops, layer.forward_bytes_accessed, layer.forward_seconds),
            (layer.backward_flops, layer.backward_bytes_accessed, layer.backward_seconds),
        ):
            if flops is None or moved is None or secs is None:
                return None
            rows.append((flops, moved))
            seconds.append(secs)
    coef = _nonnegative_fit(np.asarray(rows, dtype=np.float64), np.asarray(seconds))
    if coef is None:
        return None
    layers = []
    for layer in prof.layers:
        fwd = float(coef @ (layer.forward_flops, layer.forward_bytes_accessed))
        bwd = float(coef @ (layer.backward_flops, layer.backward_bytes_accessed))
        igr, wgr = layer.input_grad_seconds, layer.weight_grad_seconds
        if igr is not None and wgr is not None:
            i_flops, w_flops = layer.input_grad_flops or 0.0, layer.weight_grad_flops or 0.0
            if i_flops + w_flops > 0:
                igr, wgr = bwd * i_flops / (i_flops + w_flops), bwd * w_flops / (i_flops + w_flops)
            else:  # no work counted in either: the backward is the input gradient's
                igr, wgr = bwd, 0.0
        layers.append(
            dataclasses.replace(
                layer,
                forward_seconds=fwd,
                backward_seconds=bwd,
                input_grad_seconds=igr,
                weight_grad_seconds=wgr,
            )
        )
    return dataclasses.replace(prof, layers=tuple(layers), time_source="counted")


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """``c >= 0`` minimising ``|x c - y|`` for two columns (the better one alone where the
    pair would take a negative coefficient), or None where no column has a positive fit."""
    scale = np.linalg.norm(x, axis=0)
    if not np.all(np.isfinite(x)) or not np.all(np.isfinite(y)) or not np.any(scale > 0):
        return None
    z = x / np.where(scale > 0, scale, 1.0)  # FLOPs and bytes are orders of magnitude apart
    both = np.linalg.lstsq(z, y, rcond=None)[0]
    if np.all(both >= 0) and np.all(scale > 0):
        return np.asarray(both / scale)  # numpy types the quotient Any
    best, residual = None, math.inf
    for j in np.flatnonzero(scale > 0):
        c = float(z[:, j] @ y)  # a unit column: its least-squares coefficient
        r = float(np.sum((y - c * z[:, j]) ** 2))
        if c > 0 and r < residual:
            best, residual = np.where(np.arange(2) == j, c / scale[j], 0.0), r
    return best


def _measured_as(plan: Any, prof: Any) -> Any:
    """``plan``'s stages priced on ``prof`` (:func:`~pdjax.partition.evaluate_partition`),
    or None where the evaluation would place them on other devices."""
    from pdjax.partition import evaluate_partition

    got = evaluate_partition(
        prof,
        plan.topology,
        [(st.first_layer, st.last_layer, st.replicas) for st in plan.stages],
        cost_model=plan.cost_model,
        schedule=plan.schedule,
        num_microbatches=plan.num_microbatches,
        microbatch_size=plan.microbatch_size,
        optimizer_state_factor=float(plan.options.get("optimizer_state_factor", 2.0)),
        memory_limit=plan.memory_limit,
        partitioner=plan.partitioner,
        replication=[st.replication for st in plan.stages],
    )
    if [st.devices for st in got.stages] != [st.devices for st in plan.stages]:
        return None
    return dataclasses.replace(got, options={**plan.options, **got.options})


def _splits_evenly(plan: Any) -> bool:
    """Whether every split stage of ``plan`` has a device count dividing its microbatch."""
    return all(st.round_robin or plan.microbatch_size % st.replicas == 0 for st in plan.stages)


def resolve_auto(cfg: TrainConfig, spec: ModelSpec, ds: data_lib.Dataset) -> TrainConfig:
    """``cfg`` with ``schedule="auto"`` resolved: the model profiled (measured, on a
    microbatch of ``batch_size / devices`` samples) and planned by
    :func:`~pdjax.partition.plan_auto` over the devices for ``batch_size`` samples per
    step; returns the config of its choice (schedule, microbatches, chunks, in-flight
    depth), with ``plan`` the chosen plan's JSON file (a temporary file). It searches the
    schedules whose planned stages the runner takes as they are (``gpipe``, ``1f1b``,
    ``zb-h1``, ``zb-h2``, and with ``allow_stale`` ``pipedream`` and ``2bw``): the runner
    places ``interleaved`` and ``zb-v`` chunks by equal layer counts. Recomputation is not
    chosen without a memory limit (CPU devices have none); where chosen, the runner
    recomputes on the stages the plan names (``plan.options["auto"]["remat"]``).
    Candidates are ranked no faster than the driver and, on in-process CPU devices, their
    shared thread pool allow (:func:`pdjax.apps.bench.host_costs`, measured here first): the
    simulator alone would pick many small microbatches whose dispatch and shared cores it
    does not see.

    Raises:
      PipelineError: a plan file given with ``schedule="auto"``, or a choice the runtime
        cannot run.
    """
    from pdjax.apps.bench import host_costs
    from pdjax.partition import Topology, plan_auto
    from pdjax.profile import profile

    if cfg.plan not in ("auto", "even"):
        raise PipelineError("--schedule auto plans by itself: drop the --plan file")
    devices = jax.devices()[: cfg.devices]
    size = max(1, cfg.batch_size // cfg.devices)
    prof = profile(spec.layers, ds.train_x[:size], measure=True, device=devices[0])
    host = host_costs(spec, (ds.train_x[:size], ds.train_y[:size]), devices)
    # the schedules whose planned stages the runner takes as they are (interleaved and
    # zb-v run equal layer counts here: their plans are for `pdjax plan --schedule auto`)
    names = [n for n in ("gpipe", "1f1b", "zb-h1", "zb-h2") if n in SCHEDULE_CHOICES]
    plan = plan_auto(
        prof,
        Topology.from_devices(devices),
        batch_size=cfg.batch_size,
        schedules=names + (list(STALE) if cfg.allow_stale else []),
        straight=cfg.straight or cfg.plan == "even",
        allow_stale=cfg.allow_stale,
        host=host,
    )
    handle, path = tempfile.mkstemp(prefix="pdjax-plan-auto-", suffix=".json")
    os.close(handle)  # the runner reads the plan from a file
    plan.save(path)
    return _auto_choice(cfg, plan, path)


def _auto_choice(cfg: TrainConfig, plan: Any, path: str | Path) -> TrainConfig:
    """``cfg`` (``schedule="auto"``) as ``plan_auto``'s ``plan`` (saved as ``path``) chose."""
    chosen = plan.options.get("auto")
    if not isinstance(chosen, dict):
        raise PipelineError(
            f"the plan {path} was not made by --schedule auto (it records no choice of "
            "schedule): resume with the settings the run was started with"
        )
    return dataclasses.replace(
        cfg,
        schedule=chosen["schedule"],
        microbatches=chosen["microbatches"],
        extra_in_flight=chosen["extra_in_flight"],
        plan=str(path),
        allow_stale=False,
    )


def _stages(cfg: TrainConfig, spec: ModelSpec, sample: Any, plan: Any = None) -> tuple[Any, str]:
    """The plan's stages for a pipeline run, and their description (``plan``: the
    :class:`~pdjax.partition.Plan` to run, else :func:`plan_of`'s)."""
    L = len(spec.layers)
    if cfg.schedule == "interleaved":
        P = cfg.devices  # sizes checked by check()
        virtual = even_stages(L, P * cfg.chunks)
        stages = tuple(
            StagePlan(s.first_layer, s.last_layer, (i % P,)) for i, s in enumerate(virtual)
        )
        text = f"interleaved: {len(stages)} chunks of {L} layers over {P} devices"
        return stages, text
    if cfg.schedule == "zb-v":
        P = cfg.devices  # sizes checked by check()
        groups = stage_groups("zb-v", P, 2)
        virtual = even_stages(L, 2 * P)
        stages = tuple(
            StagePlan(s.first_layer, s.last_layer, (groups[i],)) for i, s in enumerate(virtual)
        )
        return stages, f"zb-v: {len(stages)} chunks of {L} layers in a V over {P} devices"
    if plan is None:
        plan = plan_of(cfg, spec, sample)
    if plan is None:
        stages = even_stages(L, min(L, cfg.devices))
        return stages, f"even: {len(stages)} stages of {L} layers, one device each"
    return plan, plan.describe().splitlines()[0]


def plan_of(cfg: TrainConfig, spec: ModelSpec, sample: Any) -> Any:
    """The :class:`~pdjax.partition.Plan` a pipeline run of ``cfg`` follows: made now
    (:func:`auto_plan`) for ``plan="auto"``, read from ``cfg.plan``'s file; None where the
    stages follow from the settings alone (``"even"``, ``interleaved``, ``zb-v``, ``dp``)."""
    if cfg.schedule in ("dp", "interleaved", "zb-v") or cfg.plan == "even":
        return None
    if cfg.plan == "auto":
        return auto_plan(
            spec,
            sample,
            jax.devices()[: cfg.devices],
            cfg.schedule,
            cfg.microbatches,
            cfg.straight,
            "round-robin" if cfg.replication == "round-robin" else "split",
        )
    from pdjax.partition import Plan

    return Plan.load(cfg.plan)


def make_runner(
    cfg: TrainConfig, spec: ModelSpec, sample: Any, plan: Any = None
) -> tuple[Runner[Any], str]:
    """The :class:`~pdjax.runners.Runner` for ``cfg`` (a :class:`DataParallel` for
    ``schedule="dp"``, else a :class:`Pipeline`), and its plan's text (``plan``: the
    :class:`~pdjax.partition.Plan` to run, instead of :func:`plan_of`'s). The rest of the
    training loop is written against the protocol alone."""
    _check_devices(cfg)
    devices = jax.devices()
    if cfg.schedule == "dp":  # the one place that picks the runner
        dp = DataParallel(spec.layers, spec.loss, _optimizer(cfg), devices=devices[: cfg.devices])
        return dp, f"data parallel on {cfg.devices} devices"
    stages, text = _stages(cfg, spec, sample, plan)
    runner = Pipeline(
        spec.layers,
        stages,
        spec.loss,
        _optimizer(cfg),
        schedule=cfg.schedule,
        microbatches=cfg.microbatches,
        chunks=cfg.chunks if cfg.schedule == "interleaved" else None,
        vertical_sync=cfg.vertical_sync,
        weight_stashing=cfg.weight_stashing,
        devices=devices,
        extra_in_flight=cfg.extra_in_flight,
        transport=cfg.transport,
        replication=None if cfg.replication == "plan" else cfg.replication,
        # plan_auto's per-stage recomputation, where it chose some to fit a memory limit
        remat=tuple(getattr(stages, "options", {}).get("auto", {}).get("remat", ())) or False,
    )
    for s, r in enumerate(runner.replicas):
        if cfg.microbatch_size % r and not runner.stages[s].round_robin:
            raise PipelineError(
                f"the plan replicates stage {s} on {r} devices but a microbatch has "
                f"{cfg.microbatch_size} samples; pick --batch-size so that batch_size / "
                f"microbatches is a multiple of {r}"
            )
    rr = [str(s) for s, st in enumerate(runner.stages) if st.round_robin]
    if rr:
        text += f"; round-robin stage{'s' if len(rr) > 1 else ''} {', '.join(rr)}"
    return runner, text


def evaluate(
    spec: ModelSpec, variables: list[Any], ds: data_lib.Dataset, batch_size: int = 256
) -> tuple[float, float]:
    """Mean loss and accuracy of ``variables`` on the test split (eval mode, one device).

    A model with its own loss (or accuracy) is evaluated with it, batch by batch, each
    batch's mean weighted by its rows; its accuracy is NaN if it has none."""
    device = jax.local_devices()[0]  # this process's (several processes: each has its own)
    variables = jax.device_put(jax.tree.map(_local_copy, variables), device)
    fn = _eval_fn(spec)
    if _own_metrics(spec):
        total_loss = total_acc = 0.0
        for lo in range(0, ds.num_test, batch_size):
            x, y = ds.test_x[lo : lo + batch_size], ds.test_y[lo : lo + batch_size]
            loss, acc = fn(variables, x, y)
            total_loss += float(loss) * len(x)
            total_acc += float(acc) * len(x)
        return total_loss / ds.num_test, total_acc / ds.num_test
    total_loss = total_acc = count = 0.0
    for x, y, mask in data_lib.eval_batches(ds.test_x, ds.test_y, batch_size):
        loss, acc = fn(variables, x, y, mask)
        total_loss += float(loss)
        total_acc += float(acc)
        count += float(mask.sum())
    return total_loss / count, total_acc / count


def _local_copy(leaf: Any) -> Any:
    """This process's copy of a value replicated over several processes (data
    parallelism's weights): ``device_put`` takes only what this process holds."""
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
        return leaf
    if not leaf.sharding.is_fully_replicated:
        raise PipelineError(
            f"cannot evaluate a weight of shape {leaf.shape} sharded over several processes "
            "on one device; gather it first"
        )
    return leaf.addressable_data(0)


def evaluate_runner(
    spec: ModelSpec, runner: Any, state: Any, ds: data_lib.Dataset, batch_size: int = 256
) -> tuple[float, float]:
    """Mean loss and accuracy of ``runner``'s ``state`` on the test split, in eval mode.

    A pipeline in one process evaluates through its stages
    (:meth:`~pdjax.pipeline.Pipeline.evaluate`: forward only, each stage on its devices,
    nothing gathered); data parallelism and a pipeline across processes evaluate the
    gathered variables on one device (:func:`evaluate`)."""
    if not isinstance(runner, Pipeline) or runner.multiprocess:
        return evaluate(spec, runner.variables(state), ds, batch_size)
    batches = [
        (ds.test_x[lo : lo + batch_size], ds.test_y[lo : lo + batch_size])
        for lo in range(0, ds.num_test, batch_size)
    ]
    got = runner.evaluate(state, batches, metrics=_accuracy_metric(spec))
    return got["loss"], float(got.get("_accuracy", math.nan))


_METRICS: dict[int, tuple[ModelSpec, Callable[..., Any] | None]] = {}


def _accuracy_metric(spec: ModelSpec) -> Callable[..., Any] | None:
    """``spec``'s accuracy as an evaluation metric (one function object per spec, so the
    pipeline's evaluation programs compile once), or None without one."""
    cached = _METRICS.get(id(spec))
    if cached is None or cached[0] is not spec:
        fn = None
        if spec.has_accuracy:

            def fn(outputs: Any, targets: Any) -> dict[str, jax.Array]:
                return {"_accuracy": jnp.asarray(spec.accuracy(outputs, targets), jnp.float32)}

        _METRICS.clear()
        _METRICS[id(spec)] = (spec, fn)
    return _METRICS[id(spec)][1]


_EVAL_FNS: dict[int, tuple[ModelSpec, Callable[..., Any]]] = {}


def _own_metrics(spec: ModelSpec) -> bool:
    return spec.loss_fn is not None or spec.accuracy_fn is not None


def _own_eval(spec: ModelSpec) -> Callable[..., Any]:
    def fn(variables: Any, x: Any, y: Any) -> tuple[jax.Array, jax.Array]:
        out, _ = spec.layers.apply(variables, x, train=False)
        loss = spec.loss(out, y)
        if isinstance(loss, tuple | list):  # (loss, aux)
            loss = loss[0]
        acc = spec.accuracy(out, y) if spec.has_accuracy else jnp.float32(jnp.nan)
        return jnp.asarray(loss, jnp.float32), jnp.asarray(acc, jnp.float32)

    return fn


def _eval_fn(spec: ModelSpec) -> Callable[..., Any]:
    """The jitted evaluation of ``spec`` (cached per spec object, which the cache holds)."""
    cached = _EVAL_FNS.get(id(spec))
    if cached is None or cached[0] is not spec:

        def fn(variables: Any, x: Any, y: Any, mask: Any) -> tuple[jax.Array, jax.Array]:
            out, _ = spec.layers.apply(variables, x, train=False)
            per = optax.softmax_cross_entropy_with_integer_labels(out, y)
            correct = (jnp.argmax(out, axis=-1) == y).astype(jnp.float32)
            axes = tuple(range(1, per.ndim))
            per, correct = per.mean(axis=axes), correct.mean(axis=axes)
            m = mask.astype(jnp.float32)
            return (per * m).sum(), (correct * m).sum()

        _EVAL_FNS.clear()  # one model at a time: keep one compiled evaluation
        _EVAL_FNS[id(spec)] = (spec, jax.jit(_own_eval(spec) if _own_metrics(spec) else fn))
    return _EVAL_FNS[id(spec)][1]


#: The file in a run's checkpoint directory that holds the plan it runs (:func:`train`).
PLAN_FILE = "plan.json"


def train(
    cfg: TrainConfig,
    *,
    checkpoint_dir: str | Path | None = None,
    metrics_path: str | Path | None = None,
    on_epoch: Callable[[EpochRecord], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    warmup: bool = True,
    built: tuple[ModelSpec, data_lib.Dataset] | None = None,
    on_resume: Callable[[int, int], None] | None = None,
    on_start: Callable[[str], None] | None = None,
    tensorboard_dir: str | Path | None = None,
    resume_step: int | None = None,
) -> TrainResult:
    """Trains ``cfg.model`` on ``cfg.dataset``; see the module docstring.

    Args:
      cfg: the run.
      checkpoint_dir: save after every epoch (orbax, step ``e`` after epoch ``e``) when
        the weights and the evaluation are finite; if it already holds a checkpoint of
        this run, resume from its newest step. The plan a run follows (``plan="auto"``,
        a plan file, ``schedule="auto"``) is saved there as :data:`PLAN_FILE` when it
        starts, and a resumed run follows that plan instead of planning again.
      metrics_path: append one JSON line per epoch (``{"run": label, **record}``, strict
        JSON: a NaN or infinite number is written as null), once the epoch's checkpoint
        is committed. With ``checkpoint_dir`` the file follows the checkpoint: a resumed
        run keeps its lines of the epochs the checkpoint holds (and writes those that are
        missing), drops its lines of later epochs, and appends the new ones. A fresh run
        (nothing to resume) refuses a file that already holds lines of its run. Other
        runs' lines are kept. The plan the run follows (where it has one) is written
        beside the file when the run starts, as ``<run>/``:data:`PLAN_FILE` (``<run>``:
        :func:`run_folder` of the label), with or without ``checkpoint_dir``: ``plan=``
        that file runs the same stages again.
      on_epoch: called with each epoch's record (for progress displays).
      on_progress: called with ``(microbatches dispatched, microbatches in the epoch)``.
      warmup: compile every function first, on a throwaway copy of the state, so that
        epoch times (and time to accuracy) measure training, not XLA's compiler.
      built: the model and dataset from :func:`build`, if already made.
      on_resume: called with ``(epochs, step)`` when the run resumes from a checkpoint
        holding that many epochs, ``step`` the optimizer updates (stage 0's) so far.
      on_start: called with the plan's text once every setting is checked and the state is
        made, before compiling (where a display starts).
      tensorboard_dir: write TensorBoard event files under ``tensorboard_dir/<run>``
        (:func:`run_folder` of the label; needs ``tensorboardX``): per epoch (the step),
        ``train/loss``, ``test/loss``, ``test/accuracy``, ``train/samples_per_second``,
        ``train/epoch_seconds``, and the config as text.
      resume_step: resume from this step of ``checkpoint_dir`` instead of the newest. The
        steps after it are moved into a ``set-aside-after-<step>-*`` folder there (kept,
        no longer listed), as the run goes on from the step it resumed.

    Returns:
      The :class:`TrainResult`.

    Raises:
      TrainingDiverged: if a training or test loss, the test accuracy, or a weight is NaN
        or infinite (that epoch is not saved; the message names the last step saved).
      CheckpointError: a ``resume_step`` that is not in ``checkpoint_dir``, or a
        checkpoint that cannot be restored (no older step is tried instead).
      PipelineError: for inconsistent settings, before any training.
      DataError, LayerError: a dataset or model that cannot be loaded or does not fit.
    """
    spec, ds = built if built is not None else build(cfg)
    requested = cfg  # what a checkpoint of this run is compared with
    with contextlib.ExitStack() as stack:  # closes the checkpointer on any exit
        ckpt, step = _open_checkpoints(stack, checkpoint_dir, resume_step)
        saved = None
        if step is not None and checkpoint_dir is not None:  # a step implies a dir
            saved = _saved_plan(checkpoint_dir)
        cfg, plan, plan_given = _settle(requested, spec, ds, saved, checkpoint_dir)
        check(cfg, spec, ds)
        if tensorboard_dir is not None:
            require_tensorboard()
        if metrics_path is not None and step is None:
            _refuse_mixing(Path(metrics_path), cfg.label, checkpoint_dir)
        sample = ds.train_x[: cfg.microbatch_size]
        if plan is None:
            plan = plan_of(cfg, spec, sample)
        runner, plan_text = make_runner(cfg, spec, sample, plan)
        state = runner.init(jax.random.key(cfg.seed), sample)
        history: list[EpochRecord] = []
        if step is not None:
            state, history = _resume(
                ckpt, step, state, runner, requested, plan_given, resume_step is not None
            )
            if on_resume is not None:
                on_resume(len(history), history[-1].updates if history else 0)
        if checkpoint_dir is not None and saved is None and plan is not None:
            _save_plan(Path(checkpoint_dir), plan)
        if metrics_path is not None and plan is not None:
            # with or without checkpoints: a fresh plan="auto" run measures and may plan
            # other stages, so this file is how a run is repeated on the same ones
            _save_plan(Path(metrics_path).parent / run_folder(cfg.label), plan)
        if metrics_path is not None and ckpt is not None:
            _sync_metrics(Path(metrics_path), cfg.label, history)
        if on_start is not None:
            on_start(plan_text)
        start_epoch = len(history)
        if warmup and start_epoch < cfg.epochs:
            _warm_up(runner, state, ds, cfg, on_progress is not None)
        result = TrainResult(
            cfg,
            plan_text,
            history,
            "epochs",
            state=state,
            resumed_epoch=start_epoch if step is not None and history else None,
        )
        board = None
        _mark_target(result)
        if result.target_epoch is not None:
            result.stopped = "target"
            return result
        for epoch in range(start_epoch, cfg.epochs):
            elapsed = history[-1].elapsed if history else 0.0
            state, record = _train_epoch(
                cfg, spec, runner, state, ds, epoch, elapsed, ckpt, on_progress
            )
            history.append(record)
            result.state = state
            if ckpt is not None:
                ckpt.save(
                    record.epoch,
                    state,
                    {
                        "config": dataclasses.asdict(requested),
                        "history": [dataclasses.asdict(r) for r in history],
                    },
                )
            # after the commit, so no line names an epoch no checkpoint holds; a crash in
            # between leaves the line to the resume (_sync_metrics writes missing ones)
            if metrics_path is not None:
                _append_metrics(Path(metrics_path), cfg.label, [record])
            if tensorboard_dir is not None:
                if board is None:
                    folder = Path(tensorboard_dir) / run_folder(cfg.label)
                    board = stack.enter_context(contextlib.closing(_TensorBoard(folder, cfg)))
                board.write(record)
            if on_epoch is not None:
                on_epoch(record)
            _mark_target(result)
            if result.target_epoch is not None:
                result.stopped = "target"
                break
        return result


def check_outputs(
    cfg: TrainConfig,
    checkpoint_dir: str | Path | None = None,
    metrics_path: str | Path | None = None,
    resume_step: int | None = None,
) -> None:
    """Refuses, before anything trains, what :func:`train` would refuse about its outputs:
    a ``resume_step`` that is not a step of ``checkpoint_dir``, and a fresh run (nothing
    to resume) of a run that ``metrics_path`` already holds lines of.

    Raises:
      CheckpointError: for the step (the message lists the steps there).
      PipelineError: for the metrics (the message says what to do).
    """
    with contextlib.ExitStack() as stack:
        _, step = _open_checkpoints(stack, checkpoint_dir, resume_step)
    if metrics_path is not None and step is None:
        _refuse_mixing(Path(metrics_path), cfg.label, checkpoint_dir)


def _open_checkpoints(
    stack: contextlib.ExitStack, checkpoint_dir: str | Path | None, resume_step: int | None
) -> tuple[Any, int | None]:
    """The checkpointer of ``checkpoint_dir`` (or None) and the step to resume from (None
    for a fresh run)."""
    if checkpoint_dir is None:
        if resume_step is not None:
            raise PipelineError(
                f"--resume-step {resume_step} picks a checkpoint to resume from: give the "
                "run's --checkpoint-dir too"
            )
        return None, None
    from pdjax.runners import Checkpointer

    ckpt = stack.enter_context(Checkpointer(checkpoint_dir))
    steps = ckpt.all_steps()
    if resume_step is None:
        return ckpt, steps[-1] if steps else None
    if resume_step not in steps:
        held = (
            f"the steps {steps} (step e after epoch e): pick one of them"
            if steps
            else "no checkpoint: drop --resume-step to start the run"
        )
        raise CheckpointError(f"--resume-step {resume_step}: {ckpt.directory} holds {held}")
    return ckpt, resume_step


def _saved_plan(checkpoint_dir: str | Path) -> Any:
    """The plan saved in ``checkpoint_dir`` (:data:`PLAN_FILE`), or None; process 0 reads
    it (the others need not share the directory) and every process gets it."""
    from pdjax.distributed import broadcast_json
    from pdjax.errors import PlanError
    from pdjax.partition import Plan

    path = Path(checkpoint_dir) / PLAN_FILE
    got: dict[str, Any] = {}
    if jax.process_index() == 0 and path.is_file():
        try:
            got = {"plan": Plan.load(path).to_dict()}
        except PlanError as e:
            got = {"error": str(e)}
    got = broadcast_json(got)
    if "error" in got:
        raise PlanError(
            f"{got['error']}: the plan this run was started with is unreadable; restore "
            f"{path}, or delete it to resume with a plan made again"
        )
    return Plan.from_dict(got["plan"]) if "plan" in got else None


def _save_plan(directory: Path, plan: Any) -> None:
    if jax.process_index() == 0:  # process 0 alone writes the checkpoint directory
        directory.mkdir(parents=True, exist_ok=True)
        plan.save(directory / PLAN_FILE)


def _settle(
    requested: TrainConfig,
    spec: ModelSpec,
    ds: data_lib.Dataset,
    saved: Any,
    checkpoint_dir: str | Path | None,
) -> tuple[TrainConfig, Any, bool]:
    """The settings of the run (``schedule="auto"`` resolved), the saved plan it follows
    (None: it makes its own), and whether a plan file was given that matches the saved one.
    A resumed run follows its saved plan: measured profiles are noisy, so planning again
    may cut the model elsewhere."""
    cfg = requested
    if cfg.schedule == "auto":
        if saved is not None and cfg.plan in ("auto", "even"):
            return _auto_choice(cfg, saved, Path(str(checkpoint_dir)) / PLAN_FILE), saved, False
        return resolve_auto(cfg, spec, ds), None, False
    if saved is None or cfg.schedule in ("dp", "interleaved", "zb-v") or cfg.plan == "even":
        return cfg, None, False
    if cfg.plan == "auto":
        return cfg, saved, False
    if not Path(cfg.plan).is_file():
        return cfg, None, False  # check() says so
    from pdjax.partition import Plan

    if Plan.load(cfg.plan).to_dict() != saved.to_dict():
        path = Path(str(checkpoint_dir)) / PLAN_FILE
        raise PipelineError(
            f"the plan {cfg.plan} differs from {path}, the plan this run was started with: "
            f"resume with that plan (--plan {path}), or start a run with this one in "
            "another --checkpoint-dir"
        )
    return cfg, saved, True


def _resume(
    ckpt: Any,
    step: int,
    state: Any,
    runner: Any,
    requested: TrainConfig,
    plan_given: bool,
    chosen: bool,
) -> tuple[Any, list[EpochRecord]]:
    """``state`` and the history restored from ``step``, checked to be of the same run;
    the steps after it are set aside."""
    try:
        # a run with another plan (a re-planned one) may cut the stages elsewhere
        state, extra = ckpt.restore(
            state, step=step, pipeline=runner if isinstance(runner, Pipeline) else None
        )
    except CheckpointError as e:
        if chosen:
            raise
        earlier = [s for s in ckpt.all_steps() if s < step]
        hint = (
            f"if step {step} is damaged, resume from an earlier one with --resume-step "
            f"(steps there: {earlier})"
            if earlier
            else "no earlier step is there to resume from instead"
        )
        e.args = (f"{e}; {hint}", *e.args[1:])  # keeps the error's own class
        raise
    saved = _resumable(extra.get("config", {}))
    ours = _resumable(dataclasses.asdict(requested))
    if plan_given:  # the same plan under another file name (checked by _settle)
        saved.pop("plan", None)
        ours.pop("plan", None)
    if saved != ours:
        changed = sorted(k for k in ours if saved.get(k) != ours[k])
        raise PipelineError(
            f"{ckpt.directory} holds a checkpoint of a different run (it differs in "
            f"{changed}); use another --checkpoint-dir, or the same settings"
        )
    history: list[EpochRecord] = []
    for r in extra["history"]:
        fields: dict[str, Any] = {k: math.nan if v is None else v for k, v in r.items()}
        history.append(EpochRecord(**fields))
    _set_aside_after(ckpt, step)
    return state, history


def _set_aside_after(ckpt: Any, step: int) -> None:
    """Moves the steps after ``step`` into a folder beside them: the run goes on from
    ``step``, and a checkpointer saves only steps above its newest."""
    later = [s for s in ckpt.all_steps() if s > step]
    if not later or jax.process_index() != 0:
        return
    folder = Path(tempfile.mkdtemp(prefix=f"set-aside-after-{step}-", dir=ckpt.directory))
    for s in later:
        os.replace(ckpt.directory / str(s), folder / str(s))


def _train_epoch(
    cfg: TrainConfig,
    spec: ModelSpec,
    runner: Any,
    state: Any,
    ds: data_lib.Dataset,
    epoch: int,
    elapsed: float,
    ckpt: Any,
    on_progress: Callable[[int, int], None] | None,
) -> tuple[Any, EpochRecord]:
    """Trains and evaluates epoch ``epoch`` (0-based).

    Raises:
      TrainingDiverged: for a non-finite loss, accuracy or weight.
    """
    batches = _epoch_batches(cfg, runner, ds, epoch)
    b = cfg.batch_size // runner.microbatches
    if not batches:
        raise PipelineError(
            f"the {ds.name} training split has {ds.num_train} samples, too few for one "
            f"step of {cfg.batch_size}"
        )
    t0 = time.perf_counter()
    callback = None
    if on_progress is not None:

        def callback(k: int, _loss: jax.Array, n: int = len(batches)) -> None:
            on_progress(k + 1, n)

    state, metrics = runner.run(state, batches, on_loss=callback)
    losses = metrics.losses
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    train_loss = float(np.mean([float(x) for x in losses]))
    if not math.isfinite(train_loss):
        raise _diverged(cfg, epoch + 1, f"the training loss became {train_loss}", ckpt)
    test_loss, test_acc = evaluate_runner(spec, runner, state, ds)
    if not math.isfinite(test_loss):
        raise _diverged(cfg, epoch + 1, f"the test loss became {test_loss}", ckpt)
    if spec.has_accuracy and not math.isfinite(test_acc):
        raise _diverged(cfg, epoch + 1, f"the test accuracy became {test_acc}", ckpt)
    if not _finite_weights(runner, state):
        raise _diverged(cfg, epoch + 1, "the weights hold NaN or infinite values", ckpt)
    samples = len(batches) * b
    updates = state.updates[0]
    return state, EpochRecord(
        epoch=epoch + 1,
        train_loss=train_loss,
        test_loss=test_loss,
        test_accuracy=test_acc,
        seconds=seconds,
        elapsed=elapsed + seconds,
        samples_per_second=samples / seconds,
        updates=int(updates),
    )


def _finite_weights(runner: Any, state: Any) -> bool:
    """Whether every floating value of the weights and model state is finite."""
    tree: list[dict[str, Any]] | tuple[Any, Any]  # per-layer variables, or (params, state)
    if isinstance(runner, Pipeline) and runner.multiprocess:
        tree = runner.variables(state)  # collective: each process gets every stage
    else:
        tree = (state.params, state.model_state)
    checks = [
        jnp.isfinite(x).all()
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return all(bool(c) for c in checks)


def _diverged(cfg: TrainConfig, epoch: int, what: str, ckpt: Any) -> TrainingDiverged:
    if ckpt is None:
        kept = "no checkpoint was saved (no checkpoint directory)"
    else:
        last = ckpt.latest_step()
        kept = (
            f"the last good checkpoint is step {last} (after epoch {last}), "
            f"{ckpt.directory / str(last)}"
            if last is not None
            else f"no checkpoint was saved in {ckpt.directory}"
        )
    return TrainingDiverged(
        f"training diverged in epoch {epoch} ({cfg.label}, lr {cfg.learning_rate}): {what}; "
        f"epoch {epoch} is not saved, and {kept}. Lower --lr"
        + (
            " and train in another --checkpoint-dir (a run resumes only with the settings "
            "it was saved with)"
            if ckpt is not None
            else ""
        )
    )


def _epoch_batches(
    cfg: TrainConfig, runner: Runner[Any], ds: data_lib.Dataset, epoch: int
) -> list[Any]:
    """Epoch ``epoch``'s stream of microbatches for ``runner`` (``runner.microbatches``
    to an update): whole updates of them, except for ``pipedream``, which updates per
    microbatch."""
    size = cfg.batch_size // runner.microbatches
    batches = list(ds.train_batches(size, seed=cfg.seed, epoch=epoch))
    if cfg.schedule != "pipedream":
        batches = batches[: len(batches) - len(batches) % runner.microbatches]
    return batches


def _warm_up(
    runner: Runner[Any], state: Any, ds: data_lib.Dataset, cfg: TrainConfig, progress: bool
) -> None:
    """Compiles what an epoch runs, on a copy of the state: a pipeline's program is lowered
    and bound per number of microbatches in a call (and per progress callback), so the
    warm-up runs the first epoch's call (every runner alike)."""
    copy = jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, state)
    batches = _epoch_batches(cfg, runner, ds, 0)
    on_loss = (lambda k, loss: None) if progress else None
    jax.block_until_ready(runner.run(copy, batches, on_loss=on_loss)[0])


def _json_number(value: Any) -> Any:
    """``value`` for strict JSON: a NaN or infinite number becomes None (null)."""
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def _metrics_line(label: str, record: EpochRecord) -> str:
    values = {k: _json_number(v) for k, v in dataclasses.asdict(record).items()}
    return json.dumps({"run": label, **values}, allow_nan=False)


def _append_metrics(path: Path, label: str, records: Sequence[EpochRecord]) -> None:
    if not records:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(_metrics_line(label, r) + "\n" for r in records)
    with path.open("a+b") as f:  # appends, wherever it seeks to read
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":  # a write that a crash cut off: start a line of our own
                text = "\n" + text
        f.write(text.encode())


def _metrics_runs(path: Path) -> set[str]:
    """The runs with lines in the metrics file ``path``."""
    runs = set()
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and isinstance(entry.get("run"), str):
                runs.add(entry["run"])
    return runs


def _refuse_mixing(path: Path, label: str, checkpoint_dir: str | Path | None) -> None:
    """Refuses a fresh run of ``label`` into a metrics file holding lines of such a run."""
    if label not in _metrics_runs(path):
        return
    where = (
        f"{checkpoint_dir} holds no checkpoint to resume it from"
        if checkpoint_dir is not None
        else "there is no --checkpoint-dir to resume it from"
    )
    raise PipelineError(
        f"{path} already holds metrics of a {label!r} run, and {where}: a new run would mix "
        f"its epochs with the old ones. Choose another --out (or move {path.name} away); to "
        "go on with the earlier run instead, pass the --checkpoint-dir it saved to"
    )


def _sync_metrics(path: Path, label: str, history: Sequence[EpochRecord]) -> None:
    """Makes ``label``'s lines in the metrics file those of ``history`` (a checkpoint's):
    keeps its lines of those epochs, drops its others (later epochs, duplicates), appends
    the missing ones. Other lines stay as they are, but for a last line cut off by a crash.
    The file is rewritten only to drop, atomically (a crash leaves the old file or the new)."""
    text = path.read_text() if path.is_file() else ""
    lines = text.splitlines()
    keep: list[str] = []
    seen: set[int] = set()
    dropped = False
    for i, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            if i == len(lines) - 1 and not text.endswith("\n"):
                dropped = True  # a write that a crash cut off
            else:
                keep.append(line)
            continue
        if not isinstance(entry, dict) or entry.get("run") != label:
            keep.append(line)
            continue
        epoch = entry.get("epoch")
        if isinstance(epoch, int) and 1 <= epoch <= len(history) and epoch not in seen:
            seen.add(epoch)
            keep.append(line)
        else:
            dropped = True
    if dropped:
        write_atomic(
            path, "".join(line + "\n" for line in keep), what="metrics file", error=PipelineError
        )
    _append_metrics(path, label, [r for r in history if r.epoch not in seen])


def require_tensorboard() -> None:
    """Checks that ``tensorboardX`` can be imported.

    Raises:
      PipelineError: saying how to install it.
    """
    try:
        import tensorboardX  # noqa: F401
    except ImportError as e:
        raise PipelineError(
            "--tensorboard writes event files with tensorboardX, which is not installed: "
            "pip install 'pdjax[tensorboard]' (or pip install tensorboardX)"
        ) from e


class _TensorBoard:
    """One run's TensorBoard event files (tensorboardX), one step per epoch."""

    def __init__(self, folder: Path, cfg: TrainConfig) -> None:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=str(folder))
        text = json.dumps(dataclasses.asdict(cfg), indent=1)
        self._writer.add_text("config", f"```\n{text}\n```", 0)

    def write(self, record: EpochRecord) -> None:
        w, step = self._writer, record.epoch
        w.add_scalar("train/loss", record.train_loss, step)
        w.add_scalar("test/loss", record.test_loss, step)
        if math.isfinite(record.test_accuracy):
            w.add_scalar("test/accuracy", record.test_accuracy, step)
        w.add_scalar("train/samples_per_second", record.samples_per_second, step)
        w.add_scalar("train/epoch_seconds", record.seconds, step)
        w.flush()

    def close(self) -> None:
        self._writer.close()


def _resumable(config: dict[str, Any]) -> dict[str, Any]:
    """The settings a resumed run must share with its checkpoint (all but the stopping
    rule: more epochs, or another target, continue the same run)."""
    return {k: v for k, v in config.items() if k not in ("epochs", "target_accuracy")}


def _mark_target(result: TrainResult) -> None:
    target = result.config.target_accuracy
    if target is None:
        return
    for record in result.history:
        if record.test_accuracy >= target:
            result.target_epoch = record.epoch
            result.time_to_target = record.elapsed
            return
