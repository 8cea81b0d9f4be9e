"""What a training run is: its settings (:class:`TrainConfig`), an epoch's measurements
(:class:`EpochRecord`) and its result (:class:`TrainResult`), and the names made from
them (the optimizer, the run's folder)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from pdjax.apps.train.optimizers import DEFAULT_LEARNING_RATE, check_settings
from pdjax.apps.train.wording import setting
from pdjax.errors import PipelineError
from pdjax.mesh import MeshAxes, MeshError, mesh_size, parse_mesh
from pdjax.models import check_model_name
from pdjax.pipeline.transport import TRANSPORTS
from pdjax.schedules import SCHEDULE_KINDS, SCHEDULES, ScheduleSpec
from pdjax.schedules.spec import OPTIONS, option_owners

SCHEDULE_CHOICES = (*SCHEDULES, "dp", "auto")
"""``schedule``: every registered schedule, data parallelism, or ``auto`` (planned)."""
TRANSPORT_CHOICES = ("auto", *TRANSPORTS)
"""``auto`` (``device_put`` up to 2 processes on CPU, collectives beyond) or a transport."""
#: The bundled datasets; any other ``dataset`` is a path to an ``.npz`` file, or
#: :data:`TOKENS_PREFIX` and the path of a token file.
DATASETS = ("digits", "text", "text-bpe")
#: ``dataset="tokens:PATH"``: a flat binary token file (:mod:`pdjax.apps.data.tokens`).
TOKENS_PREFIX = "tokens:"
#: The most steps a runtime call takes by default (``call_steps``).
CALL_STEPS = 16
#: ``precision``: float32 throughout, or bfloat16 or float16 compute with float32
#: parameters (float16 with dynamic loss scaling).
PRECISIONS = ("float32", "bf16", "f16")


def runs_plan(schedule: str) -> bool:
    """Whether a run of ``schedule`` follows a plan's stages: not data parallelism (``dp``)
    nor a chunked schedule, which cuts the model into equal chunks of its own."""
    kind = SCHEDULE_KINDS.get(schedule)
    return schedule != "dp" if kind is None else kind.runs_plan_stages


def round_robin_by_default(schedule: str) -> bool:
    """Whether ``schedule`` replicates round-robin by default (``dp``, ``auto``: no)."""
    kind = SCHEDULE_KINDS.get(schedule)
    return kind is not None and kind.round_robin_by_default


def updates_per_microbatch(schedule: str) -> bool:
    """Whether ``schedule`` updates after every microbatch (``dp``, ``auto``: no)."""
    kind = SCHEDULE_KINDS.get(schedule)
    return kind is not None and kind.semantics.updates_per_microbatch


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (saved next to its metrics).

    Attributes:
      model: a name from :data:`pdjax.models.MODELS`, or ``package.module:factory``
        for a model of your own (:func:`pdjax.models.load_model`).
      config: ``"tiny"`` or ``"paper"`` (a factory that takes ``config`` gets it as is).
      dataset: ``"digits"`` (images), ``"text"`` (characters of Python's own docs),
        ``"text-bpe"`` (the same documents as byte-level BPE tokens, packed:
        :func:`pdjax.apps.data.bpe.text_bpe`), or the path of an ``.npz`` file with
        ``x_train``, ``y_train``, ``x_test``, ``y_test``
        (:func:`pdjax.apps.data.load_npz`).
      schedule: a pipeline schedule, or ``"dp"`` for the data-parallel baseline.
      devices: how many of ``jax.devices()`` to use.
      plan: ``"auto"`` (profile and plan now), ``"even"`` (equal layer counts, one device
        per stage), or a path to a plan JSON.
      epochs: epochs at most.
      batch_size: samples per optimizer step (``M`` microbatches for a pipeline).
      microbatches: ``M``.
      chunks: ``v`` for ``interleaved``.
      optimizer: ``"adam"``, ``"adamw"``, ``"sgd"``, ``"momentum"``, or
        ``package.module:fn``, a function returning an :class:`optax.GradientTransformation`
        (given ``learning_rate``, a number or a schedule, if it takes it), or naming one:
        :mod:`pdjax.apps.train.optimizers`.
      learning_rate: the optimizer's step size (a schedule's peak); None: none given, 1e-3
        (:data:`~pdjax.apps.train.optimizers.DEFAULT_LEARNING_RATE`) for a named optimizer
        or a function that takes ``learning_rate``, while an optimizer of your own that
        takes none keeps its own (and refuses one given).
      weight_decay: ``adamw``'s decoupled weight decay (None: optax's default, 1e-4).
      clip_norm: clip the gradients to this global norm before the optimizer (None: no
        clipping).
      lr_schedule: ``"constant"``, or ``"warmup-cosine"``: linear from 0 to
        ``learning_rate`` over ``warmup_steps`` updates, then a cosine decay to 0.
      warmup_steps: ``warmup-cosine``'s warmup, in optimizer updates.
      decay_steps: ``warmup-cosine``'s length in optimizer updates, warmup included (None:
        the run's updates in ``epochs`` epochs, stage 0's).
      min_stages: ``plan="auto"``: the planner's fastest plan of at least this many
        stages (1: any, a single data-parallel stage too).
      seed: seeds initialisation, dropout and the data order.
      target_accuracy: stop once the test accuracy reaches this (0-1), or None.
      seq_len: tokens per window for ``text`` and ``text-bpe`` (a factory that takes
        ``seq_len`` gets it).
      vocab_size: ``text-bpe``'s tokenizer vocabulary (None: a bundled language model is
        built with 1024 tokens; a model of your own gets its own ``num_classes``).
      precision: ``"float32"``; ``"bf16"``: every layer computes in bfloat16 with its
        parameters, optimizer and loss in float32 (:mod:`pdjax.precision`); ``"f16"``:
        the same in float16, the optimizer under dynamic loss scaling
        (:func:`pdjax.precision.loss_scaled`), for the flush schedules only.
      options: the schedule kind's own options set away from their defaults, as
        :class:`~pdjax.schedules.ScheduleSpec` takes them (``{"extra_in_flight": 1}``;
        :data:`pdjax.schedules.spec.OPTIONS`): checked against the schedule (:attr:`spec`).
      transport: how values cross processes (``auto``, ``device_put``, ``collective``).
      straight: ``plan="auto"`` without replication (a pure pipeline, one stage per
        device), as PipeDream's optimizer offers.
      replication: how replicated stages share their work: ``"plan"`` (each plan stage's
        choice, split when the plan says nothing), ``"split"`` or ``"round-robin"``
        (:class:`~pdjax.pipeline.Pipeline`).
      allow_stale: ``schedule="auto"``: the search may choose ``pipedream`` or ``2bw``.
      mesh: each stage's devices as a mesh (:mod:`pdjax.layers.sharding`):
        ``"fsdp=2,tensor=2"`` for every stage, or one per stage separated by ``;``; with
        ``plan="even"`` the run has ``devices`` / the mesh's size stages; with
        ``schedule="dp"`` one mesh over all devices. The model's annotations place the
        parameters (:data:`~pdjax.layers.sharding.DEFAULT_RULES`). ``"auto"``: the
        planner chooses each stage's mesh with the rest
        (:mod:`pdjax.partition.choosing.meshes`), with ``schedule="auto"`` or
        ``plan="auto"``.
      fsdp_auto: shard the parameters the model does not annotate over the mesh's
        ``fsdp`` axis, along their largest dimension it divides (ZeRO-3).
      epoch_steps: steps (batches of ``batch_size`` samples) in an epoch, the unit that is
        trained, evaluated, checkpointed and recorded; None: a pass over the training
        split (its samples // ``batch_size`` steps). The input stream runs on across
        epochs (:mod:`pdjax.apps.data.stream`): ``epochs * epoch_steps`` steps bound a
        run on a data set of any size.
      call_steps: the most steps one runtime call takes (``call_steps * microbatches``
        microbatches, ``call_steps * batch_size`` samples): each call's inputs are read
        and placed when it starts, so this bounds the input memory on the devices whatever
        the data set's size, and the planner prices calls of this length; None:
        :data:`CALL_STEPS`.
      buckets: sequence-length buckets for ``text-bpe`` (``"64,128,256"``; empty: packed
        windows of ``seq_len``): whole documents, each padded on the right to the smallest
        bucket that holds it (longer ones cut at the largest), every batch from one bucket
        (:mod:`pdjax.apps.data.bucket_stream`); an epoch is a pass of full batches.
      loss_mean: ``"microbatch"`` (each microbatch's mean over its real targets, the
        update averaging the microbatches: the default) or ``"tokens"`` (the mean over the
        batch's real tokens, each counting the same whichever microbatch holds it:
        :func:`pdjax.apps.train.token_loss.token_weighted`), with ``buckets`` only
        (packed windows have no padding: the two are the same there).
      validation: a token file's validation split (``dataset="tokens:PATH"`` only): the
        fraction of its tokens at its end (``"0.1"``, the default where empty) or the
        path of a second token file.

    ``schedule="auto"`` profiles the model (measured) and lets
    :func:`~pdjax.partition.plan_auto` choose the schedule, the microbatches, the stages
    and their replication for ``batch_size`` samples per step
    (:func:`~pdjax.apps.train.resolve_auto`); ``microbatches`` and ``chunks`` are then its
    choice.
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
    learning_rate: float | None = None
    seed: int = 0
    target_accuracy: float | None = None
    seq_len: int = 16
    straight: bool = False
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    transport: str = "auto"
    replication: str = "plan"
    allow_stale: bool = False
    weight_decay: float | None = None
    clip_norm: float | None = None
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_stages: int = 1
    vocab_size: int | None = None
    precision: str = "float32"
    mesh: str = ""
    fsdp_auto: bool = False
    epoch_steps: int | None = None
    call_steps: int | None = None
    validation: str = ""
    buckets: str = ""
    loss_mean: str = "microbatch"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULE_CHOICES:
            raise PipelineError(
                f"unknown schedule {self.schedule!r}; choose one of {SCHEDULE_CHOICES}"
            )
        check_model_name(self.model)
        if (
            self.dataset not in DATASETS
            and not self.dataset.startswith(TOKENS_PREFIX)
            and not (self.dataset.endswith(".npz") or Path(self.dataset).is_file())
        ):
            raise PipelineError(
                f"unknown dataset {self.dataset!r}; choose digits, text or text-bpe, give "
                "the path of an .npz file with x_train, y_train, x_test and y_test, or "
                "tokens:PATH for a token file"
            )
        self._check_stream()
        if self.precision not in PRECISIONS:
            raise PipelineError(
                f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
        self._check_loss_scaling()
        if self.vocab_size is not None and self.dataset != "text-bpe":
            raise PipelineError(
                "vocab_size is the text-bpe tokenizer's size; the "
                f"{self.dataset} dataset has none: drop {setting('vocab_size')}"
            )
        if self.vocab_size is not None and self.vocab_size < 258:
            raise PipelineError(
                f"vocab_size {self.vocab_size}: a byte-level BPE tokenizer needs at least 258 "
                "tokens (256 bytes and 2 special tokens)"
            )
        check_settings(self)
        for name in ("devices", "epochs", "batch_size", "microbatches", "chunks"):
            if getattr(self, name) < 1:
                raise PipelineError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.microbatches:
            raise PipelineError(
                f"batch_size {self.batch_size} is not a multiple of microbatches "
                f"{self.microbatches}: each microbatch must have the same size"
            )
        if self.allow_stale and self.schedule != "auto":
            raise PipelineError(
                f"allowing stale weights is an option of {setting('schedule', 'auto')}"
            )
        if self.replication not in ("plan", "split", "round-robin"):
            raise PipelineError(
                f"unknown replication {self.replication!r}; choose plan, split or round-robin"
            )
        if self.transport not in TRANSPORT_CHOICES:
            *first, last = TRANSPORT_CHOICES
            raise PipelineError(
                f"unknown transport {self.transport!r}; choose {', '.join(first)} or {last}"
            )
        self._check_options()
        self._check_mesh()
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise PipelineError(f"target_accuracy must be in (0, 1], got {self.target_accuracy}")
        self._check_min_stages()

    def _check_stream(self) -> None:
        """``epoch_steps``, ``call_steps`` and ``validation``."""
        for name in ("epoch_steps", "call_steps"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise PipelineError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if not isinstance(self.validation, str):
            raise PipelineError(
                f"validation must be a string (a fraction or a path), got {self.validation!r}"
            )
        if self.loss_mean not in ("microbatch", "tokens"):
            raise PipelineError(
                f"unknown loss_mean {self.loss_mean!r}; choose microbatch or tokens"
            )
        if self.buckets:
            self.bucket_lengths  # noqa: B018 (read to be checked)
            if self.dataset != "text-bpe":
                raise PipelineError(
                    f"{setting('buckets')} keeps the documents of text-bpe apart; the "
                    f"{self.dataset} dataset comes as windows of one length: use "
                    f"{setting('dataset', 'text-bpe')}, or drop {setting('buckets')}"
                )
        elif self.loss_mean == "tokens":
            raise PipelineError(
                f"{setting('loss_mean', 'tokens')} weighs each microbatch by its real "
                "(unpadded) tokens, which only buckets vary: with packed windows it is the "
                f"default mean; give {setting('buckets')} or drop {setting('loss_mean')}"
            )
        if self.validation and not self.dataset.startswith(TOKENS_PREFIX):
            raise PipelineError(
                f"{setting('validation')} splits a token file (tokens:PATH); the "
                f"{self.dataset} dataset has its own test split: drop it"
            )

    @property
    def bucket_lengths(self) -> tuple[int, ...]:
        """:attr:`buckets` as lengths: positive integers, strictly ascending (empty: none)."""
        if not self.buckets:
            return ()
        try:
            lengths = tuple(int(part) for part in self.buckets.split(","))
        except ValueError:
            lengths = ()
        if not lengths or any(n < 1 for n in lengths) or list(lengths) != sorted(set(lengths)):
            raise PipelineError(
                f"{setting('buckets', self.buckets, quote=True)}: bucket lengths are whole "
                "numbers of positions, positive and strictly ascending, separated by commas "
                "(64,128,256)"
            )
        return lengths

    @property
    def step_microbatches(self) -> int:
        """The microbatches of one step as the runner takes them: ``microbatches``, or 1
        for data parallelism (``dp``), whose microbatch is the whole batch."""
        return 1 if self.schedule == "dp" else self.microbatches

    @property
    def calls(self) -> int:
        """The most microbatches of one runtime call: :attr:`call_steps` (or
        :data:`CALL_STEPS`) steps of :attr:`step_microbatches`."""
        return (self.call_steps or CALL_STEPS) * self.step_microbatches

    def _check_options(self) -> None:
        """The schedule's options as its spec checks them (those set to their defaults
        dropped, so that equal settings compare equal); none for ``dp`` and ``auto``."""
        if not isinstance(self.options, dict) or set(self.options) - set(OPTIONS):
            raise PipelineError(
                f"options must be a dict of schedule options among {sorted(OPTIONS)}, got "
                f"{self.options!r}"
            )
        changed = {k: v for k, v in self.options.items() if v != OPTIONS[k].default}
        object.__setattr__(self, "options", changed)
        if self.schedule in SCHEDULE_KINDS:
            self.spec  # noqa: B018 (made to be checked)
        elif changed:
            name = next(iter(changed))
            raise PipelineError(
                f"{name} is an option of {option_owners(name)}, not of "
                f"{setting('schedule', self.schedule)}"
            )

    @property
    def meshes(self) -> tuple[MeshAxes, ...]:
        """The stages' meshes (one for every stage, or one per stage); empty: none."""
        if not self.mesh or self.mesh == "auto":
            return ()
        return tuple(parse_mesh(part) for part in self.mesh.split(";"))

    def _check_mesh(self) -> None:
        """A mesh is read, fits the devices, and goes with stages it can shape: an even
        plan, a plan file, an interleaved or zb-v run, or data parallelism."""
        if not isinstance(self.mesh, str):
            raise PipelineError(
                f"mesh must be a string such as 'data=2,tensor=2', got {self.mesh!r}"
            )
        if self.fsdp_auto and not self.mesh:  # ("auto" may shard: the search says)
            raise PipelineError(
                f"{setting('fsdp_auto', True)} shards parameters over a mesh's fsdp axis: "
                f"give one, e.g. {setting('mesh', 'fsdp=4')}"
            )
        if not self.mesh:
            return
        if self.mesh == "auto":
            if self.schedule == "auto" or (self.plan == "auto" and runs_plan(self.schedule)):
                return
            raise PipelineError(
                f"{setting('mesh', 'auto')} lets the planner choose each stage's mesh: use "
                f"it with {setting('schedule', 'auto')}, or {setting('plan', 'auto')} and a "
                "schedule that runs a plan's stages (gpipe, 1f1b, zb-h1, zb-h2, pipedream, "
                "2bw); give a mesh such as 'fsdp=2,tensor=2' for the others"
            )
        try:
            meshes = self.meshes
        except MeshError as e:
            raise PipelineError(str(e)) from None
        sizes = {mesh_size(m) for m in meshes}
        if self.schedule == "auto" or (self.plan == "auto" and runs_plan(self.schedule)):
            raise PipelineError(
                f"{setting('mesh', self.mesh)} shapes the stages of an even plan or a plan "
                f"file; the planner chooses meshes itself with {setting('mesh', 'auto')}: "
                f"pass that, or {setting('plan', 'even')} or {setting('plan', 'plan.json')} "
                "with a schedule of its own"
            )
        if len(sizes) > 1 and (self.plan == "even" or not runs_plan(self.schedule)):
            raise PipelineError(
                f"{setting('mesh', self.mesh)}: the stages of an even plan have equal device "
                "counts, so their meshes must have equal sizes; give one mesh for every stage"
            )
        size = max(sizes)
        if self.schedule == "dp" and (len(meshes) > 1 or size != self.devices):
            raise PipelineError(
                f"data parallelism runs one mesh over all {self.devices} devices; "
                f"{setting('mesh', self.mesh)} spans {size}: give one mesh whose sizes multiply "
                f"to {self.devices}"
            )
        if self.devices % size:
            raise PipelineError(
                f"{setting('mesh', self.mesh)} spans {size} devices, which does not divide "
                f"{setting('devices', self.devices)}: each stage takes {size} devices"
            )

    def _check_loss_scaling(self) -> None:
        """float16 trains with dynamic loss scaling, which is exact only where every stage
        updates from the gradients of one weight version: the flush schedules."""
        if self.precision != "f16":
            return
        kind = SCHEDULE_KINDS.get(self.schedule)
        stale = kind is not None and kind.semantics.stale
        if self.schedule == "dp" or stale or self.allow_stale:
            what = (
                setting("allow_stale", True)
                if self.allow_stale
                else setting("schedule", self.schedule)
            )
            raise PipelineError(
                f"{setting('precision', 'f16')} trains with dynamic loss scaling: every "
                "stage scales, unscales and skips an overflowing step together, with the "
                f"scale its gradients were made with; {what} cannot do that exactly (stale "
                "weight versions, or data parallelism, which has no loss scaling): use a "
                "flush schedule (gpipe, 1f1b, interleaved, zb-h1, ...), or "
                f"{setting('precision', 'bf16')}"
            )

    def _check_min_stages(self) -> None:
        n = self.min_stages
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PipelineError(f"min_stages must be an integer >= 1, got {n!r}")
        if n == 1:
            return
        if self.plan != "auto" or not runs_plan(self.schedule) or self.schedule == "auto":
            raise PipelineError(
                f"{setting('min_stages', n)} restricts the plan {setting('plan', 'auto')} "
                f"makes for a pipeline schedule; {setting('schedule', self.schedule)} "
                f"{setting('plan', self.plan)} makes none: use {setting('plan', 'auto')} with "
                "a schedule that runs a plan's stages (1f1b, gpipe, pipedream, ...), or drop "
                f"{setting('min_stages')}"
            )
        if n > self.devices:
            raise PipelineError(
                f"{setting('min_stages', n)} needs at least {n} devices (one stage per "
                f"device at least), and the run has {setting('devices', self.devices)}: pass "
                f"{setting('devices', n)} or more, or a smaller {setting('min_stages')}"
            )

    @classmethod
    def from_saved(cls, config: dict[str, Any]) -> TrainConfig:
        """The config a run saved (its checkpoint's or summary's ``config``), also one of a
        pdjax before :class:`~pdjax.schedules.ScheduleSpec`, which held the schedule's
        options one by one; settings this pdjax does not know are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        flat = {k: config[k] for k in OPTIONS if k in config}
        fields = {k: v for k, v in config.items() if k in names}
        fields["options"] = dict(fields.get("options") or {}) | flat
        return cls(**fields)

    @property
    def lr(self) -> float:
        """The learning rate (a schedule's peak): :attr:`learning_rate`, or the default."""
        return DEFAULT_LEARNING_RATE if self.learning_rate is None else self.learning_rate

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches

    @property
    def spec(self) -> ScheduleSpec:
        """The :class:`~pdjax.schedules.ScheduleSpec` a pipeline run of this config runs
        (not for ``dp`` or ``auto``, which name no schedule): its kind, ``M``, ``chunks``
        where the kind takes them, the kind's options and the replication."""
        kind = SCHEDULE_KINDS[self.schedule]
        return ScheduleSpec(
            self.schedule,
            microbatches=self.microbatches,
            chunks=self.chunks if kind.chunks is None else None,
            replication=None if self.replication == "plan" else self.replication,
            **self.options,
        )

    @property
    def label(self) -> str:
        """A short name for tables: the schedule and its options."""
        name = self.schedule
        for option, value in self.options.items():  # checked: the schedule's own
            name += f" ({OPTIONS[option].label.format(value)})"
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
      tokens_per_second: training target tokens / seconds, padding left out (language
        models; NaN otherwise).
      perplexity: ``exp(test_loss)`` for a language model (NaN otherwise).
      mfu: model FLOPs utilisation: the model's training FLOPs per sample (XLA's cost
        analysis of one forward and backward) times ``samples_per_second``, over the
        devices' peak (:func:`pdjax.apps.train.throughput.peak_flops`); NaN where unknown.
    """

    epoch: int
    train_loss: float
    test_loss: float
    test_accuracy: float
    seconds: float
    elapsed: float
    samples_per_second: float
    updates: int
    tokens_per_second: float = math.nan
    perplexity: float = math.nan
    mfu: float = math.nan


@dataclasses.dataclass
class TrainResult:
    """What :func:`~pdjax.apps.train.train` returns.

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
      run_id: the run's id (32 hex digits): made when it started fresh, kept in its
        checkpoints, written in each of its metrics lines.
      optimizer: the optimizer in words (its learning rate, schedule and clipping:
        :func:`~pdjax.apps.train.optimizers.describe`).
      plan_note: where ``plan="auto"`` chose a single data-parallel stage for a pipeline
        schedule, what was asked, what was chosen and the predicted times
        (:func:`~pdjax.apps.train.planning.single_stage_note`); else None.
    """

    config: TrainConfig
    plan: str
    history: list[EpochRecord]
    stopped: str
    target_epoch: int | None = None
    time_to_target: float | None = None
    state: Any = None
    resumed_epoch: int | None = None
    run_id: str | None = None
    optimizer: str = ""
    plan_note: str | None = None

    @property
    def final_accuracy(self) -> float:
        return self.history[-1].test_accuracy if self.history else float("nan")


def run_folder(label: str) -> str:
    """A run's folder name (checkpoints, TensorBoard): its label with non-word characters
    as ``_``, e.g. ``"pipedream_no_stashing_"`` -> ``"pipedream_no_stashing"``."""
    return re.sub(r"\W+", "_", label).strip("_")
