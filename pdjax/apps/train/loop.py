"""The training loop (:func:`train`): a run set up from its settings and its checkpoints
(:func:`_set_up`), then epochs trained, evaluated, checked for divergence and committed
(checkpoint first, then the metrics line) until the last epoch or the target accuracy.

The training data is streamed (:class:`~pdjax.apps.data.stream.TrainStream`): an epoch
is ``N`` microbatches (:func:`~pdjax.apps.train.planning.epoch_microbatches`), taken from
the stream in runtime calls of at most ``cfg.calls`` microbatches, each read and placed as
its call starts, so host and device memory hold a bounded number of calls' inputs
whatever the data set's size. A checkpoint keeps the stream's position (its ``input``
metadata), and a resumed run continues at the next microbatch of the same order."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax._jsonio import check_file, check_folder, refuse_link
from pdjax.apps import data as data_lib
from pdjax.apps.data.stream import TrainStream, split_identity
from pdjax.apps.train.config import (
    EpochRecord,
    TrainConfig,
    TrainResult,
    run_folder,
)
from pdjax.apps.train.evaluation import evaluate_runner
from pdjax.apps.train.model_data import build, check, checked
from pdjax.apps.train.optimizers import describe as describe_optimizer
from pdjax.apps.train.optimizers import run_updates, step_settings
from pdjax.apps.train.outputs import (
    TensorBoard,
    append_metrics,
    new_run_id,
    refuse_mixing,
    refuse_others,
    require_tensorboard,
    sync_metrics,
)
from pdjax.apps.train.planning import (
    call_microbatches,
    epoch_microbatches,
    pass_samples,
    plan_of,
    single_stage_note,
)
from pdjax.apps.train.resume import (
    checkpoint_identity,
    data_identity,
    open_checkpoints,
    refuse_other_data,
    resume,
    save_plan,
    saved_plan,
    settle,
)
from pdjax.apps.train.runner import make_runner
from pdjax.apps.train.throughput import (
    Peak,
    model_flops_per_sample,
    peak_flops,
    tokens_per_sample,
)
from pdjax.apps.train.wording import setting
from pdjax.errors import PipelineError, TrainingDiverged
from pdjax.models import ModelSpec
from pdjax.runners import Runner


@dataclasses.dataclass(frozen=True)
class _Hooks:
    """The caller's callbacks (:func:`train`'s arguments of the same names)."""

    on_epoch: Callable[[EpochRecord], None] | None = None
    on_progress: Callable[[int, int], None] | None = None
    on_resume: Callable[[int, int], None] | None = None
    on_start: Callable[[str], None] | None = None


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """Where a run writes: its checkpointer (None: no checkpoints) of ``checkpoint_dir``,
    its metrics file and its TensorBoard folder (None: not written)."""

    ckpt: Any
    checkpoint_dir: str | Path | None
    metrics_path: Path | None
    tensorboard_dir: Path | None


@dataclasses.dataclass(frozen=True)
class _Run:
    """A run ready to train: the settings asked for (``requested``, what its checkpoints
    are compared with) and those it runs (``cfg``: ``schedule="auto"`` resolved), its model,
    data, runner and plan's text, and the state and history it starts from (``resumed``:
    restored from a checkpoint), and its id (made fresh, or its checkpoint's). The loop
    appends each epoch's record to ``history``."""

    run_id: str
    requested: TrainConfig
    cfg: TrainConfig
    spec: ModelSpec
    ds: data_lib.Dataset
    runner: Runner[Any]
    plan_text: str
    plan_note: str | None
    state: Any
    history: list[EpochRecord]
    resumed: bool
    speed: _Speed
    stream: TrainStream


@dataclasses.dataclass(frozen=True)
class _Speed:
    """What turns a run's samples per second into tokens per second and MFU
    (:mod:`pdjax.apps.train.throughput`): None or NaN where it does not apply."""

    tokens_per_sample: float | None
    flops_per_sample: float
    peak: Peak

    @staticmethod
    def of(cfg: TrainConfig, spec: ModelSpec, ds: data_lib.Dataset) -> _Speed:
        b = cfg.microbatch_size
        flops = model_flops_per_sample(spec, ds.train_x[:b], ds.train_y[:b])
        dtype = {"bf16": "bfloat16", "f16": "float16"}.get(cfg.precision, "float32")
        peak = peak_flops(jax.devices()[: cfg.devices], dtype)
        return _Speed(tokens_per_sample(spec, ds), flops, peak)


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
      metrics_path: append one JSON line per epoch (``{"run": label, "run_id": id,
        **record}``, strict JSON: a NaN or infinite number is written as null), once the
        epoch's checkpoint is committed. The file is only appended to, never through a
        symbolic link, and read by the rule of :func:`~pdjax.apps.train.read_metrics` (a
        line of run id R and epoch e replaces R's earlier lines of epochs e and later). A
        run's id is made when it starts fresh and saved in its checkpoints: a resumed run
        first appends the epochs its checkpoint holds that the file lacks (or holds
        otherwise, or past it), then the new ones. A fresh run (nothing to resume) refuses
        a file that already holds lines of its label, a resumed one a file holding lines
        of its label with another run id (or none), before any work. The plan the run
        follows (where it has one) is written
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
        made, before compiling (where a display starts); where ``plan="auto"`` chose a
        single data-parallel stage for a pipeline schedule, the text has a second line,
        ``note: ...``, saying so (:attr:`TrainResult.plan_note`).
      tensorboard_dir: write TensorBoard event files under ``tensorboard_dir/<run>``
        (:func:`run_folder` of the label; needs ``tensorboardX``): per epoch (the step),
        ``train/loss``, ``test/loss``, ``test/accuracy``, ``train/samples_per_second``,
        ``train/epoch_seconds``, where they apply ``train/tokens_per_second``,
        ``test/perplexity`` and ``train/mfu``, and the config as text.
      resume_step: resume from this step of ``checkpoint_dir`` instead of the newest. The
        steps after it are moved into a ``set-aside-after-<step>-*`` folder there (kept,
        no longer listed), as the run goes on from the step it resumed.

    Returns:
      The :class:`TrainResult` (with the run's id).

    Raises:
      TrainingDiverged: if a training or test loss, the test accuracy, a weight or a value
        of the optimizer state is NaN or infinite (that epoch is not saved; the message
        names the last step saved).
      CheckpointError: a ``resume_step`` that is not in ``checkpoint_dir``, a
        checkpoint that cannot be restored (no older step is tried instead), or a
        ``checkpoint_dir`` that another run writes (its lock, :meth:`Checkpointer.claim`,
        is taken before any work).
      PipelineError: for inconsistent settings, an output that cannot be written (a
        symbolic link, a folder under a file, a folder that is not writable), or metrics
        of another run (see ``metrics_path``), before any training.
      DataError, LayerError: a dataset or model that cannot be loaded or does not fit.
    """
    spec, ds = built if built is not None else build(cfg)
    # the settings are checked once, before any work: here for a config made in Python,
    # by the command line (every variant before the first trains) for its own
    if not checked(cfg, spec, ds):
        check(cfg, spec, ds)
    hooks = _Hooks(
        on_epoch=on_epoch, on_progress=on_progress, on_resume=on_resume, on_start=on_start
    )
    with contextlib.ExitStack() as stack:  # closes the checkpointer on any exit
        outputs, step = _open_outputs(
            stack, checkpoint_dir, metrics_path, tensorboard_dir, resume_step
        )
        run = _set_up(
            requested=cfg,
            spec=spec,
            ds=ds,
            outputs=outputs,
            step=step,
            chosen=resume_step is not None,
            hooks=hooks,
        )
        return _run_epochs(run, outputs, hooks, warmup=warmup)


def _open_outputs(
    stack: contextlib.ExitStack,
    checkpoint_dir: str | Path | None,
    metrics_path: str | Path | None,
    tensorboard_dir: str | Path | None,
    resume_step: int | None,
) -> tuple[_Outputs, int | None]:
    """A run's outputs, its checkpointer opened in ``stack``, and the step to resume from
    (None for a fresh run: :func:`_open_checkpoints`). The metrics file and TensorBoard
    folder are checked first (:func:`~pdjax._jsonio.check_folder`, ``check_file``)."""
    if metrics_path is not None:
        check_folder(Path(metrics_path).parent, "metrics_path", PipelineError)
        check_file(metrics_path, "metrics_path", PipelineError)
    if tensorboard_dir is not None:
        check_folder(tensorboard_dir, "tensorboard_dir", PipelineError)
    ckpt, step = open_checkpoints(stack, checkpoint_dir, resume_step)
    if ckpt is not None:  # a second run writing the folder is refused before any work
        ckpt.claim()
    outputs = _Outputs(
        ckpt=ckpt,
        checkpoint_dir=checkpoint_dir,
        metrics_path=None if metrics_path is None else Path(metrics_path),
        tensorboard_dir=None if tensorboard_dir is None else Path(tensorboard_dir),
    )
    return outputs, step


def _set_up(
    requested: TrainConfig,
    spec: ModelSpec,
    ds: data_lib.Dataset,
    outputs: _Outputs,
    *,
    step: int | None,
    chosen: bool,
    hooks: _Hooks,
) -> _Run:
    """The run of ``requested``, ready to train: its settings settled and checked, its plan
    read or made, its runner and state made (restored from checkpoint ``step``, None for a
    fresh run; ``chosen``: a step the caller picked), its id made or read, its plan
    written and its metrics synced with its checkpoint, and ``on_start`` called."""
    saved = None
    if step is not None and outputs.checkpoint_dir is not None:  # a step implies a dir
        saved = saved_plan(outputs.checkpoint_dir)
    cfg, plan, plan_given = settle(requested, spec, ds, saved, outputs.checkpoint_dir)
    if cfg is not requested:  # schedule="auto" resolved: the planner's settings, new
        check(cfg, spec, ds)
    if outputs.tensorboard_dir is not None:
        require_tensorboard()
    if step is None:
        run_id = new_run_id()
        if outputs.metrics_path is not None:
            refuse_mixing(outputs.metrics_path, cfg.label, outputs.checkpoint_dir)
    else:
        identity = checkpoint_identity(outputs.ckpt, step, chosen=chosen)
        refuse_other_data(outputs.ckpt, step, chosen, ds)
        run_id = identity.run_id
        if outputs.metrics_path is not None:
            refuse_others(
                outputs.metrics_path,
                cfg.label,
                run_id,
                outputs.checkpoint_dir,
                identity.legacy,
            )
        if identity.legacy is not None:
            warnings.warn(
                f"step {step} of {outputs.ckpt.directory} was saved by a pdjax without run "
                f"ids: the run is given the id {run_id} (made from its settings and first "
                "epoch), which its metrics lines and new checkpoints carry from now on",
                stacklevel=3,
            )
    stream = _stream(cfg, ds, outputs, step)  # a saved input state checked before any work
    sample = np.asarray(ds.train_x[: cfg.microbatch_size])
    if plan is None:  # planned for the run's calls, each placed as it starts
        plan = plan_of(cfg, spec, sample, calls=call_microbatches(cfg, pass_samples(cfg, ds)))
    note = single_stage_note(plan)
    runner, plan_text = make_runner(
        cfg, spec, sample, plan, total_updates=run_updates(cfg, pass_samples(cfg, ds))
    )
    state = runner.init(jax.random.key(cfg.seed), sample)
    history: list[EpochRecord] = []
    if step is not None:
        state, history = resume(
            ckpt=outputs.ckpt,
            step=step,
            state=state,
            runner=runner,
            requested=requested,
            plan_given=plan_given,
            chosen=chosen,
        )
        if hooks.on_resume is not None:
            hooks.on_resume(len(history), history[-1].updates if history else 0)
    if plan is not None:
        written = _write_plan(outputs, cfg.label, plan, saved=saved is not None)
        if requested.schedule == "auto" and saved is None and written is not None:
            cfg = _plan_among_outputs(cfg, written)
    if outputs.metrics_path is not None and step is not None:
        sync_metrics(outputs.metrics_path, cfg.label, run_id, history)
    padding = bucket_padding(cfg, ds)
    if padding is not None:
        plan_text = f"{plan_text}\n{padding}"
    if hooks.on_start is not None:
        hooks.on_start(plan_text if note is None else f"{plan_text}\nnote: {note}")
    return _Run(
        run_id=run_id,
        requested=requested,
        cfg=cfg,
        spec=spec,
        ds=ds,
        runner=runner,
        plan_text=plan_text,
        plan_note=note,
        state=state,
        history=history,
        resumed=step is not None,
        speed=_Speed.of(cfg, spec, ds),
        stream=stream,
    )


def bucket_padding(cfg: TrainConfig, ds: data_lib.Dataset) -> str | None:
    """What a run with ``buckets`` says of its padding: the share of computed positions
    that are padding per bucket and overall, against one length (the largest bucket's);
    None without buckets."""
    if not cfg.buckets:
        return None
    padding = ds.info["padding"]
    each = ", ".join(
        f"{b['length']}: {b['examples']} examples, {100 * b['padding_fraction']:.1f}%"
        for b in padding["buckets"]
    )
    cut = ds.info.get("cut_documents", {}).get("train")
    return (
        f"buckets {cfg.buckets}: {100 * padding['bucketed']:.1f}% of the training positions "
        f"are padding ({each}), against {100 * padding['one_length']:.1f}% at one length "
        f"({cfg.bucket_lengths[-1]})"
        + (f"; {cut} documents longer than {cfg.bucket_lengths[-1]} are cut" if cut else "")
    )


def make_stream(cfg: TrainConfig, ds: data_lib.Dataset, state: Any = None) -> Any:
    """The training stream of a run of ``cfg`` on ``ds``: one-bucket batches with
    ``buckets`` (:class:`~pdjax.apps.data.bucket_stream.BucketStream`, token-weighted
    targets with ``loss_mean="tokens"``), else shuffled microbatches
    (:class:`~pdjax.apps.data.stream.TrainStream`); from ``state`` (None: the start)."""
    identity = split_identity(ds)
    if cfg.buckets:
        from pdjax.apps.data.bucket_stream import BucketStream

        return BucketStream(
            ds,
            cfg.bucket_lengths,
            cfg.batch_size,
            cfg.step_microbatches,
            seed=cfg.seed,
            identity=identity,
            state=state,
            token_weights=cfg.loss_mean == "tokens",
        )
    size = cfg.batch_size // cfg.step_microbatches
    return TrainStream(ds.train_x, ds.train_y, size, seed=cfg.seed, identity=identity, state=state)


def _stream(cfg: TrainConfig, ds: data_lib.Dataset, outputs: _Outputs, step: int | None) -> Any:
    """The run's training stream: from the start for a fresh run, else from the input
    state saved with checkpoint ``step`` (refused there if it is of other data). A
    checkpoint of a pdjax before streamed input holds none: its run continues after the
    ``step * N`` microbatches its epochs took, in the stream's order (not the order that
    pdjax drew, which it had no state of), and says so."""
    saved = None
    if step is not None:
        saved = (outputs.ckpt.extra(step) or {}).get("input")
    stream = make_stream(cfg, ds, saved)
    if step is not None and saved is None:
        warnings.warn(
            f"step {step} of {outputs.ckpt.directory} holds no input state (a pdjax before "
            "streamed input saved it): the run goes on from the microbatch after its "
            f"{step} epochs in this pdjax's order, not the order the run began in",
            stacklevel=4,
        )
        stream.skip(step * epoch_microbatches(cfg, pass_samples(cfg, ds)))
    return stream


def _write_plan(outputs: _Outputs, label: str, plan: Any, *, saved: bool) -> Path | None:
    """Writes the plan a run follows into its checkpoint directory (unless one is ``saved``
    there already) and beside its metrics file, as ``<run>/``:data:`PLAN_FILE`. Returns
    the copy beside the metrics, else the checkpoint directory's, else None (none written)."""
    written = None
    if outputs.checkpoint_dir is not None and not saved:
        written = save_plan(Path(outputs.checkpoint_dir), plan)
    if outputs.metrics_path is not None:
        # with or without checkpoints: a fresh plan="auto" run measures and may plan
        # other stages, so this file is how a run is repeated on the same ones
        folder = outputs.metrics_path.parent / run_folder(label)
        refuse_link(folder, "the plan in", PipelineError)
        written = save_plan(folder, plan)
    return written


def _plan_among_outputs(cfg: TrainConfig, written: Path) -> TrainConfig:
    """``cfg`` of a fresh ``schedule="auto"`` run naming the copy of its plan that
    :func:`_write_plan` wrote among the run's outputs; the temporary file ``resolve_auto``
    kept it in is deleted. Without outputs that file stays: it is the plan's one copy."""
    if not written.is_file():  # another process writes the outputs: keep the temporary one
        return cfg
    Path(cfg.plan).unlink(missing_ok=True)
    return dataclasses.replace(cfg, plan=str(written))


def _run_epochs(run: _Run, outputs: _Outputs, hooks: _Hooks, *, warmup: bool) -> TrainResult:
    """Trains ``run`` (:func:`_train_epochs`); its input stream's threads stop on any exit."""
    try:
        return _train_epochs(run, outputs, hooks, warmup=warmup)
    finally:
        run.stream.close()


def _train_epochs(run: _Run, outputs: _Outputs, hooks: _Hooks, *, warmup: bool) -> TrainResult:
    """Trains ``run`` (compiled first with ``warmup``: :func:`_warm_up`) from the epoch it
    starts at to its last, or to the first epoch at its target accuracy, committing each
    (:func:`_commit`) before the next."""
    cfg, history = run.cfg, run.history
    start_epoch = len(history)
    if warmup and start_epoch < cfg.epochs:
        _warm_up(run.runner, run.state, run.ds, cfg, hooks.on_progress is not None)
    result = TrainResult(
        config=cfg,
        plan=run.plan_text,
        plan_note=run.plan_note,
        history=history,
        stopped="epochs",
        state=run.state,
        resumed_epoch=start_epoch if run.resumed and history else None,
        run_id=run.run_id,
        optimizer=describe_optimizer(cfg, run_updates(cfg, pass_samples(cfg, run.ds))),
    )
    _mark_target(result)
    if result.target_epoch is not None:
        result.stopped = "target"
        return result
    with contextlib.ExitStack() as stack:  # closes the TensorBoard files on any exit
        board = None
        if outputs.tensorboard_dir is not None:
            folder = outputs.tensorboard_dir / run_folder(cfg.label)
            board = stack.enter_context(contextlib.closing(TensorBoard(folder, cfg)))
        state = run.state
        for epoch in range(start_epoch, cfg.epochs):
            state, record = _train_epoch(
                cfg=cfg,
                spec=run.spec,
                runner=run.runner,
                state=state,
                ds=run.ds,
                stream=run.stream,
                epoch=epoch,
                elapsed=history[-1].elapsed if history else 0.0,
                ckpt=outputs.ckpt,
                on_progress=hooks.on_progress,
                speed=run.speed,
            )
            history.append(record)
            result.state = state
            _commit(run, outputs, state, board)
            if hooks.on_epoch is not None:
                hooks.on_epoch(record)
            _mark_target(result)
            if result.target_epoch is not None:
                result.stopped = "target"
                break
    return result


def _commit(run: _Run, outputs: _Outputs, state: Any, board: TensorBoard | None) -> None:
    """Saves the epoch just trained (the last of ``run.history``, ``state`` after it): its
    checkpoint, then its metrics line and its TensorBoard step."""
    record = run.history[-1]
    if outputs.ckpt is not None:
        outputs.ckpt.save(
            record.epoch,
            state,
            {
                "config": dataclasses.asdict(run.requested),
                "history": [dataclasses.asdict(r) for r in run.history],
                "run_id": run.run_id,
                "data": data_identity(run.ds),
                "input": run.stream.state(),
            },
        )
    # after the commit, so no line names an epoch no checkpoint holds; a crash in
    # between leaves the line to the resume (_sync_metrics writes missing ones)
    if outputs.metrics_path is not None:
        append_metrics(outputs.metrics_path, run.cfg.label, run.run_id, [record])
    if board is not None:
        board.write(record)


def _train_epoch(
    cfg: TrainConfig,
    spec: ModelSpec,
    runner: Any,
    state: Any,
    ds: data_lib.Dataset,
    stream: TrainStream,
    epoch: int,
    elapsed: float,
    ckpt: Any,
    on_progress: Callable[[int, int], None] | None,
    speed: _Speed,
) -> tuple[Any, EpochRecord]:
    """Trains and evaluates epoch ``epoch`` (0-based): its microbatches taken from
    ``stream`` in calls of at most ``cfg.calls`` (:func:`_calls`).

    Raises:
      TrainingDiverged: for a non-finite loss, accuracy, weight or optimizer value.
    """
    n = epoch_microbatches(cfg, pass_samples(cfg, ds))
    b = cfg.batch_size // runner.microbatches
    if pass_samples(cfg, ds) < cfg.batch_size:
        raise PipelineError(
            f"the {ds.name} training split has {ds.num_train} samples, too few for one "
            f"step of {cfg.batch_size}"
        )
    t0 = time.perf_counter()
    losses: list[jax.Array] = []
    for count in _calls(n, cfg.calls):
        callback = None
        if on_progress is not None:

            def callback(k: int, _loss: jax.Array, done: int = len(losses)) -> None:
                on_progress(done + k + 1, n)

        state, metrics = runner.run(state, stream.take(count), on_loss=callback)
        losses.extend(metrics.losses)
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
    if not _finite(state.params, state.model_state):
        raise _diverged(cfg, epoch + 1, "the weights hold NaN or infinite values", ckpt)
    if not _finite(getattr(state, "opt_state", ())):
        raise _diverged(cfg, epoch + 1, "the optimizer state holds NaN or infinite values", ckpt)
    samples = n * b
    updates = state.updates[0]
    sps = samples / seconds
    tokens = speed.tokens_per_sample
    return state, EpochRecord(
        epoch=epoch + 1,
        train_loss=train_loss,
        test_loss=test_loss,
        test_accuracy=test_acc,
        seconds=seconds,
        elapsed=elapsed + seconds,
        samples_per_second=sps,
        updates=int(updates),
        tokens_per_second=math.nan if tokens is None else tokens * sps,
        perplexity=math.exp(min(test_loss, 700.0)) if spec.task == "language_model" else math.nan,
        mfu=speed.flops_per_sample * sps / speed.peak.flops,
    )


def _finite(*trees: Any) -> bool:
    """Whether every floating value of ``trees`` (a state's weights, model state or
    optimizer state) is finite: one jitted reduction per device, over the shards of every
    leaf it holds (each shard once, on the device of its first replica), and one bool per
    device to the host. In a run of several processes each checks what it holds and every
    process gets the same answer (collective)."""
    shards: dict[Any, list[jax.Array]] = {}
    ok = True
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array):
            if jnp.issubdtype(leaf.dtype, jnp.inexact):
                for shard in leaf.addressable_shards:
                    if shard.replica_id == 0:
                        shards.setdefault(shard.device, []).append(shard.data)
        elif isinstance(leaf, np.ndarray | np.floating | float):  # on the host already
            if np.issubdtype(np.asarray(leaf).dtype, np.inexact):
                ok = ok and bool(np.isfinite(leaf).all())
    checks = [_all_finite(arrays) for arrays in shards.values()]  # dispatched, then read
    ok = ok and all(bool(c) for c in checks)
    if jax.process_count() > 1:
        from pdjax.distributed import allgather_json

        ok = all(allgather_json(ok))
    return ok


@jax.jit
def _all_finite(arrays: list[jax.Array]) -> jax.Array:
    """Whether every value of ``arrays`` (on one device) is finite."""
    return jnp.stack([jnp.isfinite(a).all() for a in arrays]).all()


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
    settings = step_settings(cfg)  # named, none blamed: any may be the cause
    which = (
        f"{settings[0]}, which may be too large for this model: try a smaller value"
        if len(settings) == 1
        else f"{', '.join(settings[:-1])} and {settings[-1]}, any of which may be too large "
        "for this model: try smaller values"
    )
    clip = "" if cfg.clip_norm is not None else f", or clip the gradients ({setting('clip_norm')})"
    return TrainingDiverged(
        f"training diverged in epoch {epoch} ({cfg.label}): {what}; epoch {epoch} is not "
        f"saved, and {kept}. The optimizer's steps are sized by {which}{clip}"
        + (
            f", and train in another {setting('checkpoint_dir')} (a run resumes only with the "
            "settings it was saved with)"
            if ckpt is not None
            else ""
        )
    )


def _calls(n: int, longest: int) -> list[int]:
    """The lengths of the runtime calls of an epoch of ``n`` microbatches: as many of
    ``longest`` as fit, then the rest."""
    full, rest = divmod(n, longest)
    return [longest] * full + ([rest] if rest else [])


def _warm_up(
    runner: Runner[Any], state: Any, ds: data_lib.Dataset, cfg: TrainConfig, progress: bool
) -> None:
    """Compiles what an epoch runs, on a copy of the state: a pipeline's program is lowered
    and bound per number of microbatches in a call (and per progress callback), so the
    warm-up runs a call of each length an epoch has (every runner alike), of microbatches
    from a fresh stream (the run's own is not touched); with ``buckets``, a call of one
    step at every bucket length too (the first microbatch, cropped)."""
    counts = sorted(set(_calls(epoch_microbatches(cfg, pass_samples(cfg, ds)), cfg.calls)))
    on_loss = (lambda k, loss: None) if progress else None
    fresh = make_stream(cfg, ds)
    try:
        calls = [fresh.take(count) for count in counts]
    finally:
        fresh.close()
    first = calls[0][0]
    longest = np.shape(first[0])[1] if cfg.buckets else None
    for length in cfg.bucket_lengths:
        if longest is not None and length <= longest:
            calls.append([_cropped(first, length)] * cfg.step_microbatches)
    for batches in calls:
        copy = jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, state)
        jax.block_until_ready(runner.run(copy, batches, on_loss=on_loss)[0])


def _cropped(microbatch: Any, length: int) -> Any:
    """A text microbatch ``(inputs, targets)`` (targets possibly ``(targets, weight)``)
    cut to its first ``length`` positions."""
    x, y = microbatch
    if isinstance(y, tuple):
        return x[:, :length], (y[0][:, :length], y[1])
    return x[:, :length], y[:, :length]


def _mark_target(result: TrainResult) -> None:
    target = result.config.target_accuracy
    if target is None:
        return
    for record in result.history:
        if record.test_accuracy >= target:
            result.target_epoch = record.epoch
            result.time_to_target = record.elapsed
            return
