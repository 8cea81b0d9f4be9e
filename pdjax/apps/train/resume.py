"""A run's checkpoints: opening them and the step to resume from (:func:`check_outputs`
refuses up front what :func:`~pdjax.apps.train.train` would), the run's id they hold
(:func:`_identity`), the plan saved beside them (:data:`PLAN_FILE`), the settings and plan
a resumed run keeps (:func:`_settle`), and its state and history restored
(:func:`_resume`)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import jax

from pdjax._jsonio import read_regular
from pdjax.apps import data as data_lib
from pdjax.apps.train.config import EpochRecord, TrainConfig, runs_plan
from pdjax.apps.train.optimizers import DEFAULT_LEARNING_RATE
from pdjax.apps.train.outputs import refuse_mixing, refuse_others
from pdjax.apps.train.planning import auto_choice, resolve_auto
from pdjax.apps.train.wording import setting
from pdjax.errors import CheckpointError, PipelineError
from pdjax.models import ModelSpec
from pdjax.pipeline import Pipeline
from pdjax.schedules.spec import OPTIONS

#: The file in a run's checkpoint directory that holds the plan it runs
#: (:func:`~pdjax.apps.train.train`).
PLAN_FILE = "plan.json"

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class _Identity:
    """Whose a checkpoint is: its run's id, and (``legacy``) the history of a checkpoint
    saved by pdjax before run ids, whose run is given an id made from its settings and
    first epoch (:func:`_legacy_id`), the same at every resume until a step holds it."""

    run_id: str
    legacy: list[dict[str, Any]] | None = None


def check_outputs(
    cfg: TrainConfig,
    checkpoint_dir: str | Path | None = None,
    metrics_path: str | Path | None = None,
    resume_step: int | None = None,
) -> str | None:
    """Refuses, before anything trains, what :func:`~pdjax.apps.train.train` would refuse
    about its outputs: a ``resume_step`` that is not a step of ``checkpoint_dir``, a
    fresh run (nothing to resume) of a run that ``metrics_path`` already holds lines of,
    and a resumed run into a ``metrics_path`` that holds lines of its label with another
    run id (or none).

    Returns:
      The id of the run it resumes, or None for a fresh run (its id is made as it starts).

    Raises:
      CheckpointError: for the step (the message lists the steps there), or a checkpoint
        whose metadata cannot be read.
      PipelineError: for the metrics (the message says what to do).
    """
    with contextlib.ExitStack() as stack:
        ckpt, step = open_checkpoints(stack, checkpoint_dir, resume_step)
        if step is None:
            if metrics_path is not None:
                refuse_mixing(Path(metrics_path), cfg.label, checkpoint_dir)
            return None
        identity = checkpoint_identity(ckpt, step, chosen=resume_step is not None)
    label = _resumed_label(cfg, checkpoint_dir)
    if metrics_path is not None and label is not None:
        refuse_others(Path(metrics_path), label, identity.run_id, checkpoint_dir, identity.legacy)
    return identity.run_id


def _resumed_label(cfg: TrainConfig, checkpoint_dir: str | Path | None) -> str | None:
    """The label of ``cfg``'s run resumed from ``checkpoint_dir``: for ``schedule="auto"``,
    that of the choice its saved plan records (None where only profiling would tell)."""
    if cfg.schedule != "auto":
        return cfg.label
    saved = saved_plan(str(checkpoint_dir))
    if saved is None or cfg.plan not in ("auto", "even"):
        return None
    return auto_choice(cfg, saved, Path(str(checkpoint_dir)) / PLAN_FILE).label


def checkpoint_identity(ckpt: Any, step: int, *, chosen: bool) -> _Identity:
    """The :class:`_Identity` of checkpoint ``step`` of ``ckpt``, from its metadata alone
    (no state is built): its ``extra["run_id"]``, else one made for a checkpoint of pdjax
    before run ids."""
    extra = _hinted(ckpt, step, chosen, lambda: ckpt.extra(step))
    run_id = extra.get("run_id")
    if isinstance(run_id, str) and run_id:
        return _Identity(run_id)
    history = [dict(r) for r in extra.get("history", [])]
    return _Identity(_legacy_id(extra), legacy=history)


def _legacy_id(extra: dict[str, Any]) -> str:
    """The id of a run checkpointed by pdjax before run ids: a hash of its settings and of
    its first epoch's record (whose seconds are the run's own), so every step of the run
    gives the same."""
    history = extra.get("history") or [None]
    text = json.dumps([extra.get("config"), history[0]], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _hinted(ckpt: Any, step: int, chosen: bool, read: Callable[[], _T]) -> _T:
    """``read()`` of checkpoint ``step``; a :class:`CheckpointError` of a step the run
    did not choose (the newest) says how to resume from an earlier one instead."""
    try:
        return read()
    except CheckpointError as e:
        if chosen:
            raise
        earlier = [s for s in ckpt.all_steps() if s < step]
        hint = (
            f"if step {step} is damaged, resume from an earlier one with "
            f"{setting('resume_step')} (steps there: {earlier})"
            if earlier
            else "no earlier step is there to resume from instead"
        )
        e.args = (f"{e}; {hint}", *e.args[1:])  # keeps the error's own class
        raise


def open_checkpoints(
    stack: contextlib.ExitStack, checkpoint_dir: str | Path | None, resume_step: int | None
) -> tuple[Any, int | None]:
    """The checkpointer of ``checkpoint_dir`` (or None) and the step to resume from (None
    for a fresh run)."""
    if checkpoint_dir is None:
        if resume_step is not None:
            raise PipelineError(
                f"{setting('resume_step', resume_step)} picks a checkpoint to resume from: "
                f"give the run's {setting('checkpoint_dir')} too"
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
            else f"no checkpoint: drop {setting('resume_step')} to start the run"
        )
        raise CheckpointError(
            f"{setting('resume_step', resume_step)}: {ckpt.directory} holds {held}"
        )
    return ckpt, resume_step


def saved_plan(checkpoint_dir: str | Path) -> Any:
    """The plan saved in ``checkpoint_dir`` (:data:`PLAN_FILE`), or None; process 0 reads
    it (the others need not share the directory) and every process gets it."""
    from pdjax.distributed import broadcast_json
    from pdjax.errors import PlanError
    from pdjax.partition import Plan

    path = Path(checkpoint_dir) / PLAN_FILE
    got: dict[str, Any] = {}
    if jax.process_index() == 0 and os.path.lexists(path):
        try:  # never through a link, never from a FIFO (pdjax wrote a regular file here)
            text = read_regular(path, "saved plan", PlanError, max_bytes=64 << 20)
            got = {"plan": Plan.from_json(text.decode(errors="replace"), f"plan {path}").to_dict()}
        except PlanError as e:
            got = {"error": str(e)}
    got = broadcast_json(got)
    if "error" in got:
        raise PlanError(
            f"{got['error']}: the plan this run was started with is unreadable; restore "
            f"{path}, or delete it to resume with a plan made again"
        )
    return Plan.from_dict(got["plan"]) if "plan" in got else None


def save_plan(directory: Path, plan: Any) -> Path:
    """Writes ``plan`` as ``directory``/:data:`PLAN_FILE` (from process 0); its path."""
    if jax.process_index() == 0:  # process 0 alone writes the checkpoint directory
        directory.mkdir(parents=True, exist_ok=True)
        plan.save(directory / PLAN_FILE)
    return directory / PLAN_FILE


def settle(
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
            return auto_choice(cfg, saved, Path(str(checkpoint_dir)) / PLAN_FILE), saved, False
        return resolve_auto(cfg, spec, ds), None, False
    if saved is None or not runs_plan(cfg.schedule) or cfg.plan == "even":
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
            f"resume with that plan ({setting('plan', path)}), or start a run with this one "
            f"in another {setting('checkpoint_dir')}"
        )
    return cfg, saved, True


def resume(
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
    # the settings first: another optimizer (or clipping) has a state of another shape,
    # which restoring would refuse in words that do not say which setting changed
    metadata = _hinted(ckpt, step, chosen, lambda: ckpt.extra(step))
    _same_settings(ckpt, metadata, requested, plan_given)
    # a run with another plan (a re-planned one) may cut the stages elsewhere
    pipeline = runner if isinstance(runner, Pipeline) else None
    state, extra = _hinted(
        ckpt, step, chosen, lambda: ckpt.restore(state, step=step, pipeline=pipeline)
    )
    history: list[EpochRecord] = []
    for r in extra["history"]:
        fields: dict[str, Any] = {k: math.nan if v is None else v for k, v in r.items()}
        history.append(EpochRecord(**fields))
    _set_aside_after(ckpt, step)
    return state, history


def _same_settings(
    ckpt: Any, extra: dict[str, Any], requested: TrainConfig, plan_given: bool
) -> None:
    """Refuses a checkpoint (its metadata ``extra``) of a run with other settings."""
    saved = _resumable(extra.get("config", {}))
    ours = _resumable(dataclasses.asdict(requested))
    if requested.lr_schedule != "constant" and requested.decay_steps is None:
        # the schedule's length is the run's updates in its epochs: more would stretch it
        saved["epochs"] = extra.get("config", {}).get("epochs")
        ours["epochs"] = requested.epochs
    if plan_given:  # the same plan under another file name (checked by _settle)
        saved.pop("plan", None)
        ours.pop("plan", None)
    if saved != ours:
        changed = sorted(k for k in ours if saved.get(k) != ours[k])
        raise PipelineError(
            f"{ckpt.directory} holds a checkpoint of a different run (it differs in "
            f"{changed}); use another {setting('checkpoint_dir')}, or the same settings"
        )


def data_identity(ds: data_lib.Dataset) -> dict[str, Any]:
    """What a checkpoint records of its training data beyond the run's settings: the
    dataset's name and, for tokenised text, its tokenizer's fingerprint (the tokenizer is
    trained on the bundled documents, which another Python's documentation or another
    ``tokenizers`` may change: the same settings then mean other token ids)."""
    out: dict[str, Any] = {"dataset": ds.name}
    fingerprint = ds.info.get("tokenizer_fingerprint") if ds.info else None
    if fingerprint is not None:
        out["tokenizer_fingerprint"] = fingerprint
    return out


def refuse_other_data(ckpt: Any, step: int, chosen: bool, ds: data_lib.Dataset) -> None:
    """Refuses checkpoint ``step`` if its tokenizer is not the dataset's, from its
    metadata alone, before any work (a checkpoint without one, of a pdjax before it was
    recorded, is taken as it is).

    Raises:
      PipelineError: naming both fingerprints and what to do.
    """
    extra = _hinted(ckpt, step, chosen, lambda: ckpt.extra(step))
    saved = (extra.get("data") or {}).get("tokenizer_fingerprint")
    ours = data_identity(ds).get("tokenizer_fingerprint")
    if saved is not None and saved != ours:
        raise PipelineError(
            f"{ckpt.directory} was trained with tokenizer {saved}, and the {ds.name} data "
            f"here is tokenised by {ours}: the same token ids would mean other text. "
            "Resume where the checkpoint's tokenizer is made (the same Python documentation "
            f"and tokenizers version), or start a run in another {setting('checkpoint_dir')}"
        )


def _set_aside_after(ckpt: Any, step: int) -> None:
    """Moves the steps after ``step`` into a folder beside them: the run goes on from
    ``step``, and a checkpointer saves only steps above its newest."""
    later = [s for s in ckpt.all_steps() if s > step]
    if not later or jax.process_index() != 0:
        return
    folder = Path(tempfile.mkdtemp(prefix=f"set-aside-after-{step}-", dir=ckpt.directory))
    for s in later:
        os.replace(ckpt.directory / str(s), folder / str(s))


def _resumable(config: dict[str, Any]) -> dict[str, Any]:
    """The settings a resumed run must share with its checkpoint (all but the stopping
    rule: more epochs, or another target, continue the same run); a setting a checkpoint
    of an older pdjax does not hold has its default (that pdjax had only that), and a
    learning rate not given is the default one (an older pdjax wrote it as 0.001)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    full = {k: v for k, v in defaults.items() if k in _ADDED} | dict(config)
    # a checkpoint of a pdjax before ScheduleSpec holds the schedule's options one by one
    flat = {k: full.pop(k) for k in OPTIONS if k in full}
    saved = full.get("options")
    options = (dict(saved) if isinstance(saved, dict) else {}) | flat
    full["options"] = {k: v for k, v in options.items() if v != OPTIONS[k].default}
    if full.get("learning_rate") is None:  # none given: the default (an older pdjax's too)
        full["learning_rate"] = DEFAULT_LEARNING_RATE
    return {k: v for k, v in full.items() if k not in ("epochs", "target_accuracy")}


#: Settings added after checkpoints were first written: an older checkpoint, without
#: them, ran their defaults.
_ADDED = (
    "weight_decay",
    "clip_norm",
    "lr_schedule",
    "warmup_steps",
    "decay_steps",
    "min_stages",
    "vocab_size",
    "precision",
    "epoch_steps",
    "call_steps",
    "validation",
    "buckets",
    "loss_mean",
)
