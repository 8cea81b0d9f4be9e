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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdjax import data as data_lib
from pdjax.baselines import DataParallel
from pdjax.errors import PdjaxError, PipelineError
from pdjax.models import ModelSpec, get_model
from pdjax.pipeline.executor import Pipeline, StageSpec, even_stages

__all__ = [
    "EpochRecord",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "auto_plan",
    "build",
    "evaluate",
    "train",
]

SCHEDULE_CHOICES = ("pipedream", "2bw", "1f1b", "gpipe", "interleaved", "zb-h1", "dp")


class TrainingDiverged(PdjaxError):
    """The training loss became NaN or infinite; the last good checkpoint is kept."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (saved next to its metrics).

    Attributes:
      model: a name from :data:`pdjax.models.MODELS`.
      config: ``"tiny"`` or ``"paper"``.
      dataset: ``"digits"`` (images) or ``"text"`` (characters of Python's own docs).
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
      seq_len: tokens per window for ``text``.
      extra_in_flight: ``pipedream`` option: microbatches in flight beyond ``P - s``
        (latency hiding).
      transport: how values cross processes (``auto``, ``device_put``, ``collective``).
      straight: ``plan="auto"`` without replication (a pure pipeline, one stage per
        device), as PipeDream's optimizer offers.
      replication: how replicated stages share their work: ``"plan"`` (each plan stage's
        choice, split when the plan says nothing), ``"split"`` or ``"round-robin"``
        (:class:`~pdjax.pipeline.Pipeline`).
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

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULE_CHOICES:
            raise PipelineError(
                f"unknown schedule {self.schedule!r}; choose one of {SCHEDULE_CHOICES}"
            )
        if self.dataset not in ("digits", "text"):
            raise PipelineError(f"unknown dataset {self.dataset!r}; choose digits or text")
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
      test_accuracy: accuracy on the test split (per token for language models).
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
    """

    config: TrainConfig
    plan: str
    history: list[EpochRecord]
    stopped: str
    target_epoch: int | None = None
    time_to_target: float | None = None
    state: Any = None

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


def _dataset(cfg: TrainConfig, spec_vocab: int | None = None) -> data_lib.Dataset:
    if cfg.dataset == "digits":
        return data_lib.digits(seed=cfg.seed, flatten=cfg.model == "mlp")
    return data_lib.text(seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=spec_vocab)


def build(cfg: TrainConfig) -> tuple[ModelSpec, data_lib.Dataset]:
    """The model and dataset of ``cfg``, made to fit each other.

    Raises:
      PipelineError: a model that cannot take the dataset (an image model on text...).
    """
    spec = get_model(cfg.model, cfg.config)
    if cfg.dataset == "digits":
        if spec.task != "classification":
            raise PipelineError(
                f"{cfg.model} is a {spec.task} model; the digits dataset needs an image or "
                "MLP classifier (cnn, mlp, ...)"
            )
        ds = _dataset(cfg)
        sample = spec.sample_input(1)
        if np.shape(sample)[1:] != ds.train_x.shape[1:] or spec.num_classes != ds.num_classes:
            raise PipelineError(
                f"{cfg.model} ({cfg.config}) takes inputs {np.shape(sample)[1:]} with "
                f"{spec.num_classes} classes, {ds.name} has {ds.train_x.shape[1:]} with "
                f"{ds.num_classes}; use --model cnn (or mlp) for digits"
            )
        return spec, ds
    if spec.task != "language_model":
        raise PipelineError(
            f"{cfg.model} is a {spec.task} model; the text dataset needs a language model "
            "(gpt, awd_lm)"
        )
    ds = _dataset(cfg, spec_vocab=spec.num_classes)
    return spec, ds


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
    replication, or the planner's pick)."""
    from pdjax.partition import Topology, plan_pipedream
    from pdjax.profile import profile

    prof = profile(spec.layers, sample, measure=True, device=devices[0], repeats=5)
    topology = Topology.from_devices(devices)
    return plan_pipedream(
        prof,
        topology,
        schedule=schedule if schedule != "dp" else "1f1b",
        num_microbatches=microbatches,
        straight=straight,
        replication=replication if schedule == "pipedream" else "split",
    )


def _stages(cfg: TrainConfig, spec: ModelSpec, sample: Any) -> tuple[Any, str]:
    """The plan's stages for a pipeline run, and their description."""
    devices = jax.devices()[: cfg.devices]
    L = len(spec.layers)
    if cfg.schedule == "interleaved":
        P = cfg.devices
        if P * cfg.chunks > L:
            raise PipelineError(
                f"interleaved needs {P} devices x {cfg.chunks} chunks = {P * cfg.chunks} "
                f"stages of at least one layer; {spec.name} has {L} layers: use fewer "
                "--devices or --chunks"
            )
        if cfg.plan not in ("auto", "even") or cfg.straight:
            raise PipelineError(
                "interleaved places equal layer counts, chunk k on device k mod P; it takes "
                "no --plan file and no --straight"
            )
        virtual = even_stages(L, P * cfg.chunks)
        stages = tuple(
            StageSpec(s.first_layer, s.last_layer, (i % P,)) for i, s in enumerate(virtual)
        )
        text = f"interleaved: {len(stages)} chunks of {L} layers over {P} devices"
        return stages, text
    if cfg.plan == "auto":
        plan = auto_plan(
            spec,
            sample,
            devices,
            cfg.schedule,
            cfg.microbatches,
            cfg.straight,
            "round-robin" if cfg.replication == "round-robin" else "split",
        )
        return plan, plan.describe().splitlines()[0]
    if cfg.plan == "even":
        stages = even_stages(L, min(L, cfg.devices))
        return stages, f"even: {len(stages)} stages of {L} layers, one device each"
    from pdjax.partition import Plan

    plan = Plan.load(cfg.plan)
    return plan, plan.describe().splitlines()[0]


def make_runner(cfg: TrainConfig, spec: ModelSpec, sample: Any) -> tuple[Any, str]:
    """A :class:`Pipeline` or :class:`DataParallel` for ``cfg``, and its plan's text."""
    devices = jax.devices()
    if cfg.devices > len(devices):
        raise PipelineError(
            f"{cfg.devices} devices requested, {len(devices)} visible; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={cfg.devices} (the pdjax "
            "CLI does this for you with --devices)"
        )
    if cfg.schedule == "dp":
        runner = DataParallel(
            spec.layers, spec.loss, _optimizer(cfg), devices=devices[: cfg.devices]
        )
        return runner, f"data parallel on {cfg.devices} devices"
    stages, text = _stages(cfg, spec, sample)
    runner = Pipeline(
        spec.layers,
        stages,
        spec.loss,
        _optimizer(cfg),
        schedule=cfg.schedule,
        microbatches=cfg.microbatches,
        chunks=cfg.chunks if cfg.schedule == "interleaved" else 1,
        vertical_sync=cfg.vertical_sync,
        weight_stashing=cfg.weight_stashing,
        devices=devices,
        extra_in_flight=cfg.extra_in_flight,
        transport=cfg.transport,
        replication=None if cfg.replication == "plan" else cfg.replication,
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
    """Mean loss and accuracy of ``variables`` on the test split (eval mode, one device)."""
    device = jax.local_devices()[0]  # this process's (several processes: each has its own)
    variables = jax.device_put(variables, device)
    fn = _eval_fn(spec)
    total_loss = total_acc = count = 0.0
    for x, y, mask in data_lib.eval_batches(ds.test_x, ds.test_y, batch_size):
        loss, acc = fn(variables, x, y, mask)
        total_loss += float(loss)
        total_acc += float(acc)
        count += float(mask.sum())
    return total_loss / count, total_acc / count


_EVAL_FNS: dict[int, tuple[ModelSpec, Callable[..., Any]]] = {}


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
        _EVAL_FNS[id(spec)] = (spec, jax.jit(fn))
    return _EVAL_FNS[id(spec)][1]


def train(
    cfg: TrainConfig,
    *,
    checkpoint_dir: str | Path | None = None,
    metrics_path: str | Path | None = None,
    on_epoch: Callable[[EpochRecord], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    warmup: bool = True,
) -> TrainResult:
    """Trains ``cfg.model`` on ``cfg.dataset``; see the module docstring.

    Args:
      cfg: the run.
      checkpoint_dir: save after every epoch (orbax); if it already holds a checkpoint of
        this run, resume from it.
      metrics_path: append one JSON line per epoch.
      on_epoch: called with each epoch's record (for progress displays).
      on_progress: called with ``(microbatches dispatched, microbatches in the epoch)``.
      warmup: compile every function first, on a throwaway copy of the state, so that
        epoch times (and time to accuracy) measure training, not XLA's compiler.

    Returns:
      The :class:`TrainResult`.

    Raises:
      TrainingDiverged: if a training loss is NaN or infinite (the previous epoch's
        checkpoint, if any, is kept).
      PipelineError: for inconsistent settings, before any training.
    """
    spec, ds = build(cfg)
    if cfg.batch_size > ds.num_train:
        raise PipelineError(
            f"--batch-size {cfg.batch_size} is larger than {ds.name}'s {ds.num_train} "
            "training samples"
        )
    b = cfg.microbatch_size
    sample = ds.train_x[:b]
    runner, plan_text = make_runner(cfg, spec, sample)
    rng = jax.random.key(cfg.seed)
    state = runner.init(rng, sample)
    history: list[EpochRecord] = []
    start_epoch = 0
    with contextlib.ExitStack() as stack:  # closes the checkpointer on any exit
        ckpt = None
        if checkpoint_dir is not None:
            from pdjax.pipeline.checkpoint import Checkpointer

            ckpt = stack.enter_context(Checkpointer(checkpoint_dir))
            if ckpt.latest_step() is not None:
                state, extra = ckpt.restore(state)
                saved, ours = (
                    _resumable(extra.get("config", {})),
                    _resumable(dataclasses.asdict(cfg)),
                )
                if saved != ours:
                    changed = sorted(k for k in ours if saved.get(k) != ours[k])
                    raise PipelineError(
                        f"{checkpoint_dir} holds a checkpoint of a different run (it differs in "
                        f"{changed}); use another --checkpoint-dir, or the same settings"
                    )
                history = [EpochRecord(**r) for r in extra["history"]]
                start_epoch = len(history)

        if warmup and start_epoch < cfg.epochs:
            _warm_up(runner, state, ds, cfg, on_progress is not None)
        result = TrainResult(cfg, plan_text, history, "epochs", state=state)
        _mark_target(result)
        if result.target_epoch is not None:
            result.stopped = "target"
            return result
        elapsed = history[-1].elapsed if history else 0.0
        is_dp = cfg.schedule == "dp"
        for epoch in range(start_epoch, cfg.epochs):
            batches = list(
                ds.train_batches(b if not is_dp else cfg.batch_size, seed=cfg.seed, epoch=epoch)
            )
            if not is_dp and cfg.schedule not in ("pipedream",):
                batches = batches[: len(batches) - len(batches) % cfg.microbatches]
            if not batches:
                raise PipelineError(
                    f"the {ds.name} training split has {ds.num_train} samples, too few for one "
                    f"step of {cfg.batch_size}"
                )
            t0 = time.perf_counter()
            if is_dp:
                losses = []
                for i, batch in enumerate(batches):
                    state, metrics = runner.step(state, batch)
                    losses.extend(metrics.losses)
                    if on_progress is not None:
                        on_progress(i + 1, len(batches))
            else:
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
                raise TrainingDiverged(
                    f"training loss became {train_loss} in epoch {epoch + 1} ({cfg.label}, "
                    f"lr {cfg.learning_rate}); lower --lr"
                    + (f"; the last good checkpoint stays in {checkpoint_dir}" if ckpt else "")
                )
            elapsed += seconds
            test_loss, test_acc = evaluate(spec, runner.variables(state), ds)
            samples = len(batches) * (cfg.batch_size if is_dp else b)
            updates = state.step if is_dp else state.updates[0]
            record = EpochRecord(
                epoch=epoch + 1,
                train_loss=train_loss,
                test_loss=test_loss,
                test_accuracy=test_acc,
                seconds=seconds,
                elapsed=elapsed,
                samples_per_second=samples / seconds,
                updates=int(updates),
            )
            history.append(record)
            result.state = state
            if metrics_path is not None:
                path = Path(metrics_path)
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as f:
                    f.write(json.dumps({"run": cfg.label, **dataclasses.asdict(record)}) + "\n")
            if ckpt is not None:
                ckpt.save(
                    epoch + 1,
                    state,
                    {
                        "config": dataclasses.asdict(cfg),
                        "history": [dataclasses.asdict(r) for r in history],
                    },
                )
            if on_epoch is not None:
                on_epoch(record)
            _mark_target(result)
            if result.target_epoch is not None:
                result.stopped = "target"
                break
        return result


def _warm_up(
    runner: Any, state: Any, ds: data_lib.Dataset, cfg: TrainConfig, progress: bool
) -> None:
    """Compiles what an epoch runs, on a copy of the state: a pipeline's program is lowered
    and bound per number of microbatches in a call (and per progress callback), so the
    warm-up runs one epoch's worth (of the first epoch's length)."""
    copy = jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, state)
    if cfg.schedule == "dp":
        x, y = ds.train_x[: cfg.batch_size], ds.train_y[: cfg.batch_size]
        jax.block_until_ready(runner.step(copy, (x, y)))
    else:
        batches = list(ds.train_batches(cfg.microbatch_size, seed=cfg.seed, epoch=0))
        if cfg.schedule != "pipedream":
            batches = batches[: len(batches) - len(batches) % cfg.microbatches]
        on_loss = (lambda k, loss: None) if progress else None
        jax.block_until_ready(runner.run(copy, batches, on_loss=on_loss)[0])


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
