"""The :class:`Checkpointer`: saves, restores, verifies and lists the steps of a
checkpoint directory through orbax (whose rename of a finished step is the commit), on
process 0 alone when there are several; the writer holds the folder's lock, and deletes
old steps and the leftovers of unfinished saves itself, only those pdjax wrote.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from pdjax.distributed import allgather_json, broadcast_json, check_cpu_transfers
from pdjax.errors import CheckpointError
from pdjax.pipeline import Pipeline, PipelineState
from pdjax.runners.checkpoint.arrays import (
    State,
    add_checksums,
    array_leaves,
    assemble,
    check_state,
    counters,
    is_key,
    jsonable,
    own_copy,
    same_values,
    stage_layers,
    state_manifest,
)
from pdjax.runners.checkpoint.folder import (
    TMP_SUFFIX,
    MarkedTemporaryPath,
    PdjaxSteps,
    WriterLock,
    check_folder,
    check_target,
    delete_step,
    remove_leftovers,
)
from pdjax.runners.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    ITEMS,
    META_FILE,
    Damage,
    array_checksum,
    check_meta,
    meta_checksums,
    shape_str,
)
from pdjax.runners.checkpoint.reads import (
    drop_late_wakeups,
    failed_array,
    quiet_abandoned_reads,
    reason,
)
from pdjax.runners.checkpoint.replan import (
    check_moved_shapes,
    check_replannable,
    one_stage_view,
    read_targets,
    replan_names,
    replanned_leaves,
)
from pdjax.runners.checkpoint.transfer import collective_transfers, gather_to_0, move
from pdjax.runners.dp import DPState
from pdjax.runners.protocol import RunnerState, counter_fields

# A damaged step's error lists the steps that verify, newest first; it stops after this
# many, since verifying a step reads all of it.
_GOOD_STEPS_LISTED = 3


# How a checkpoint that does not match its template came to be, and what to do.
_MISMATCH_HINT = (
    "; the model, the plan (stages, layers per stage) or the optimizer differ from "
    "the run that saved it: build the template with the same ones"
)


def _no_such_array(where: str, name: str, theirs: Mapping[str, Any]) -> CheckpointError:
    """The error for a saved array ``name`` that the template has no place for: a restore
    would drop it (e.g. Adam's moments restored into an SGD run)."""
    return CheckpointError(
        f"{where} does not match the template: the checkpoint has {name} "
        f"({shape_str(theirs)}), the template has no such array{_MISMATCH_HINT}"
    )


def _phantom_left_behind(name: str, saved: Mapping[str, Any], used: set[str]) -> bool:
    """Whether saved array ``name``, which a move into another plan leaves unread, is the
    phantom scalar of a stage coupled through the global norm, whose state that move may
    drop (it drives only the phantom's own dropped update; see
    :mod:`~pdjax.runners.checkpoint.replan`): a scalar at ``opt_state.<stage>.<R>.1``
    where ``R`` is a per-parameter state (kept over ``(parameters, phantom)``) that the
    move does read, from some saved stage. Any other saved array the new plan does not
    read would be lost."""
    field, _, rest = name.partition(".")
    _, _, rest = rest.partition(".")
    if field != "opt_state" or not rest.endswith(".1") or saved[name]["shape"]:
        return False
    state = f"{rest[: -len('.1')]}."
    return any(n.startswith("opt_state.") and n.split(".", 2)[2].startswith(state) for n in used)


def _is_ours(e: Exception) -> bool:
    return isinstance(e, CheckpointError)


@contextlib.contextmanager
def _quiet_orbax_errors() -> Iterator[None]:
    """Drops orbax's ERROR log records while a save runs: a failed save logs its error
    four times, each with the whole traceback, before it raises; pdjax raises one
    CheckpointError instead, which holds the original error as its cause."""

    def keep(record: logging.LogRecord) -> bool:
        from_orbax = f"{os.sep}orbax{os.sep}checkpoint{os.sep}" in record.pathname
        return record.levelno < logging.ERROR or not from_orbax

    logger = logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _out_of_space(e: BaseException) -> bool:
    """Whether a failed write ran out of disk space: an ``ENOSPC`` OSError, or
    TensorStore's ``RESOURCE_EXHAUSTED`` (a ValueError) in ``e`` or what it came from."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno == errno.ENOSPC:
            return True
        if "RESOURCE_EXHAUSTED" in str(cur) or "No space left on device" in str(cur):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class Checkpointer:
    """Saves and restores training states in ``directory``, one sub-directory per step.

    Args:
      directory: where the checkpoints live; created by the first :meth:`save` (or
        :meth:`claim`).
      max_to_keep: keep the newest this many steps, deleting older ones after each save
        (``None`` keeps all).

    Raises:
      CheckpointError: for ``max_to_keep < 1``, or a ``directory`` holding folders named
        like steps (``1/``, ``2/``) that are not pdjax checkpoints (orbax would take them
        for steps). Other files there are left alone.

    One run writes a folder at a time: the first :meth:`save` (or :meth:`claim`) takes
    the folder's lock (the file ``pdjax.lock`` there, with the writer's pid and host),
    which :meth:`close` releases, and deletes what unfinished saves (and deletions) of
    pdjax left. Reading takes no lock and deletes nothing, so an evaluator may watch a
    running trainer's directory. Only folders pdjax wrote are ever deleted (each step
    holds pdjax's marker file). Use as a context manager, or call :meth:`close`, to
    release the lock and stop orbax's background threads.
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int | None = 3) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise CheckpointError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        self.directory = Path(directory).absolute()
        self._max_to_keep = max_to_keep
        self._writing = False
        # several processes: process 0 alone reads and writes the directory
        self._process = jax.process_index()
        self._multi = jax.process_count() > 1
        if self._multi and not collective_transfers():
            check_cpu_transfers("a checkpoint across processes (gathered on process 0)")
        self._manager = None
        self._lock = WriterLock(self.directory)  # process 0's
        self._from_0(lambda: check_folder(self.directory))
        self._manager = self._new_manager()

    def _new_manager(self) -> ocp.CheckpointManager | None:
        if self._process != 0:
            return None
        return ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                # pdjax deletes old steps (and crashed saves' temporary folders) itself,
                # only those it wrote: orbax's retention and cleanup go by name.
                max_to_keep=None,
                cleanup_tmp_directories=False,
                # lists only folders that hold pdjax's marker (or metadata) as steps
                step_name_format=PdjaxSteps(),
                # marks each step's temporary folder as pdjax's as it is made
                temporary_path_class=MarkedTemporaryPath,
                # Created by the first save, so restoring from a mistyped path does not
                # leave an empty directory behind.
                create=False,
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    primary_host=0, active_processes={0}
                ),
            ),
            item_names=ITEMS,
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Waits for pending work, releases orbax's resources and the folder's lock."""
        try:
            if self._manager is not None:
                self._manager.close()
        finally:
            self._lock.release()

    def claim(self) -> None:
        """Takes the folder for writing (as :meth:`save` does first): creates it, takes
        its lock, and deletes the leftovers of pdjax's unfinished saves there. Again is a
        no-op; :meth:`close` releases it. A training loop calls it before any work, so
        that a second run on the same folder is refused at its start.

        Raises:
          CheckpointError: another run (or another :class:`Checkpointer`) holds the
            folder's lock; the message names its pid and host.
        """
        self._from_0(self._claim_local)

    def _claim_local(self) -> None:
        """Process 0: :meth:`claim`."""
        if self._lock.held:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock.take()
        try:
            remove_leftovers(self.directory)
        except OSError as e:
            self._lock.release()
            raise CheckpointError(
                f"cannot delete what an unfinished pdjax save left in {self.directory} "
                f"({e}); delete it by hand (a *.orbax-checkpoint-tmp or *.pdjax-deleting-* "
                "folder holding pdjax-step.json)"
            ) from e
        if not self._writing:  # a manager made before the directory existed
            assert self._manager is not None
            self._manager.close()
            self._manager = self._new_manager()
            self._writing = True

    # -- listing ----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The committed steps in the directory, ascending (re-read from disk)."""

        def read() -> list[int]:
            assert self._manager is not None
            self._manager.reload()
            return sorted(int(step) for step in self._manager.all_steps())

        steps: list[int] = self._from_0(read)
        return steps

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- saving -----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: RunnerState,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Saves ``state`` and ``extra`` as checkpoint ``step``; returns once it is committed.

        Args:
          step: the checkpoint's number, above every step already in the directory (e.g.
            the optimizer updates so far).
          state: a runner's state (:class:`~pdjax.runners.RunnerState`: a
            :class:`PipelineState`, a ``DPState``). Its arrays are read, not consumed, so
            the state can be used (or donated) afterwards.
          extra: the training loop's JSON-able metadata (epoch, batch index, metric history,
            data seed, ...): string keys; numpy scalars are stored as Python numbers and
            tuples come back as lists.

        Raises:
          CheckpointError: for a step that is not above the newest saved one, a state of
            another type or with deleted (donated) arrays, an ``extra`` that JSON
            cannot hold, a folder another run writes (see :meth:`claim`), something
            pdjax did not write where the step would go, or a failed write (a full
            disk: the message says how much the step needs and how much is free). A
            failed save removes its unfinished folder; the steps saved before stay.
        """
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise CheckpointError(f"step must be an int >= 0, got {step!r}")
        step = int(step)
        check_state(state, "state")

        extra = jsonable({} if extra is None else extra, "extra")
        arrays, manifest = state_manifest(state)
        self.claim()
        steps = self.all_steps()
        if steps and step <= steps[-1]:
            raise CheckpointError(
                f"cannot save step {step} in {self.directory}: it holds steps {steps}, and "
                "steps must increase; save with a larger step, or delete the newer steps "
                "(or use another directory) to branch off an older one"
            )
        self._from_0(lambda: check_target(self.directory, step))
        if not self._multi:  # a tied parameter's copies (equal bits) are stored once
            for name, first in same_values(arrays).items():
                manifest[name]["same_as"] = first
                del arrays[name]
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "state": type(state).__name__,
            "ints": counters(state),
            "arrays": manifest,
            "extra": extra,
        }
        layers = stage_layers(state)
        if layers is not None:  # the plan's shape, to restore into another plan
            meta["stage_layers"] = layers
        if self._multi:
            arrays = gather_to_0(arrays)

        def write() -> None:
            assert self._manager is not None
            add_checksums(manifest, arrays)
            meta["checksums"] = meta_checksums(meta)
            with _quiet_orbax_errors():
                try:
                    saved = self._manager.save(
                        step,
                        args=ocp.args.Composite(
                            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
                        ),
                    )
                    self._manager.wait_until_finished()
                except Exception as e:  # a full disk, an I/O error: TensorStore's ValueError
                    # the writes orbax abandoned at the first failure finish later, each
                    # waking its closed event loop (a traceback apiece): dropped
                    drop_late_wakeups()
                    raise self._failed_save(step, meta, e) from e
            if not saved:  # orbax declines silently (e.g. another process saved it meanwhile)
                raise CheckpointError(
                    f"orbax did not save step {step} in {self.directory} "
                    f"(steps there now: {sorted(self._manager.all_steps())})"
                )
            self._retain(step)

        self._from_0(write)  # the others wait for process 0's commit (or its error)

    def _failed_save(self, step: int, meta: Mapping[str, Any], e: Exception) -> CheckpointError:
        """Process 0, after a failed write: removes the unfinished folder of ``step`` and
        returns the error to raise (for a full disk, what the step needs and what is free)."""
        try:  # a fresh manager: orbax's may still hold the failed save
            assert self._manager is not None
            self._manager.close()
        except Exception:  # the same failure, raised again by its background thread
            pass
        self._manager = self._new_manager()
        where = f"cannot save step {step} in {self.directory}"
        try:
            removed = remove_leftovers(self.directory, step)
        except OSError as gone:
            removed = [f"(not: {gone}; delete {step}{TMP_SUFFIX} by hand)"]
        assert self._manager is not None
        self._manager.reload()
        kept = sorted(self._manager.all_steps())
        after = (
            f"removed its unfinished folder {', '.join(removed)}; " if removed else ""
        ) + f"the steps saved before are intact ({kept or 'none'})"
        if _is_ours(e):
            return CheckpointError(f"{e}; {after}")
        if not _out_of_space(e):
            return CheckpointError(f"{where}: {reason(e)}; {after}")
        need = len(json.dumps(meta)) + sum(
            int(np.prod(entry["shape"])) * np.dtype(entry["dtype"]).itemsize
            for entry in meta["arrays"].values()
            if "same_as" not in entry
        )
        free = shutil.disk_usage(self.directory).free
        return CheckpointError(
            f"{where}: the disk is full: the step needs about {need:,} bytes (before "
            f"compression), and {free:,} bytes are free there ({reason(e)}); {after}; free "
            "some space (or keep fewer steps: max_to_keep), or checkpoint to another disk"
        )

    def _retain(self, step: int) -> None:
        """Process 0, after saving ``step``: deletes pdjax's steps beyond the newest
        ``max_to_keep``."""
        assert self._manager is not None
        if self._max_to_keep is None:
            return
        self._manager.reload()
        old = sorted(self._manager.all_steps())[: -self._max_to_keep]
        try:
            for s in old:
                delete_step(self.directory, s)
        except OSError as e:
            raise CheckpointError(
                f"saved step {step} in {self.directory}, but cannot delete its old step "
                f"{s} (max_to_keep={self._max_to_keep}): {e}"
            ) from e
        finally:
            self._manager.reload()

    # -- restoring --------------------------------------------------------------------------

    def restore(
        self,
        template: State,
        step: int | None = None,
        *,
        pipeline: Pipeline | None = None,
    ) -> tuple[State, dict[str, Any]]:
        """Restores checkpoint ``step`` (default: the newest) into ``template``'s layout.

        Every array is read by orbax onto the template's sharding of it: each device reads
        its own part, so a state saved on one mesh restores on another (``fsdp 2 x
        tensor 2`` into ``tensor 2``, or into replicated stages) with nothing gathered
        whole in host memory, and each array is checked against its checksum shard by
        shard (:func:`~pdjax.runners.checkpoint.format.array_checksum`).

        A pipeline checkpoint restores into *another plan* of the same model and optimizer
        (other stage cuts, replicas, meshes or device count) when ``pipeline`` is the
        :class:`Pipeline` the template belongs to: weights, model state and optimizer state
        (Adam's moments, with their parameters) are moved layer by layer
        (:func:`replan_names`), each onto its new stage's sharding; the stages' update
        counts must agree (they do after any flush schedule, ``pipedream`` and ``2bw``),
        and become every new stage's.

        A pipeline checkpoint also restores into data parallelism: a
        :class:`~pdjax.runners.DPState` template (``DataParallel.init``, any mesh) is
        filled as a pipeline of one stage holding every layer (no ``pipeline`` needed):
        the weights and model state layer by layer, the per-parameter optimizer state
        with its parameters, the other optimizer leaves (a step count) from the saved
        stages, which must agree; ``step`` becomes the stages' update count (DP's step
        is one update). A global-norm coupling's phantom state is dropped (data
        parallelism sees the whole model). Refused (:class:`CheckpointError`, naming
        why) where that is not exact: optimizer state that is not per parameter (e.g.
        ``optax.masked``, whose state is not shaped like the parameters), stages whose
        other optimizer leaves differ, stages at different update counts. Dropout then
        draws from the DP step (``fold_in(rng, step)``), where the pipeline drew from
        the microbatch count: the same keys when the pipeline ran one microbatch per
        update.

        Args:
          template: a state of the runner to restore into: e.g. ``pipe.init(...)`` of a
            new :class:`Pipeline` with the same model, plan and optimizer, or the same tree
            with ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves (its int fields
            are ignored). Its values are not used; its shardings say where each restored
            array goes.
          step: the step to restore; ``None`` for the newest.
          pipeline: the template's pipeline, to restore a checkpoint saved under another
            plan (one process); not needed for a ``DPState`` template.

        Returns:
          ``(state, extra)``: the saved state, bit for bit (arrays, ints, PRNG key), of
          ``template``'s type and tree structure and on its shardings; and the ``extra``
          given to :meth:`save` (``{}`` if none).

        Raises:
          CheckpointError: if the directory holds no checkpoint, ``step`` is not there,
            the checkpoint does not match the template (names the first array that
            differs, with both shapes, or a saved array the template has no place for,
            such as Adam's moments restored into an SGD run, under the same plan or
            another), a move into another plan or into data parallelism that cannot be
            exact (see above), or the step is damaged (see :meth:`verify`).
        """
        check_state(template, "template")
        step = self._pick_step(step)
        expect = (type(template).__name__, counter_fields(template))
        meta = self._from_0(lambda: self._read_meta(step, expect=expect))
        ints = meta["ints"]
        wanted = array_leaves(template)
        saved_layers = meta.get("stage_layers")
        mine = stage_layers(template)  # None but for a pipeline's (as saved_layers)
        if saved_layers is not None and mine is not None and saved_layers != mine:
            assert isinstance(template, PipelineState)  # what _stage_layers took it for
            replanned = self._restore_replanned(template, step, meta, pipeline)
            return cast(tuple[State, dict[str, Any]], replanned)
        if saved_layers is not None and isinstance(template, DPState):
            into_dp = self._restore_into_dp(template, step, meta)
            return cast(tuple[State, dict[str, Any]], into_dp)
        self._check_match(step, type(template).__name__, meta, wanted)
        abstract: dict[str, jax.ShapeDtypeStruct] = {}
        for name, leaf in wanted.items():
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                raise CheckpointError(
                    f"the template's {name} has no sharding; pass a state of the runner "
                    "(e.g. pipe.init(...)) or jax.ShapeDtypeStruct leaves with sharding=..."
                )
            data = jax.eval_shape(jax.random.key_data, leaf) if is_key(leaf) else leaf
            # jax leaves ShapeDtypeStruct.__init__ unannotated
            abstract[name] = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
        restored = (
            self._read_arrays_multi(step, abstract, meta["arrays"])
            if self._multi
            else self._read_arrays(step, abstract, meta["arrays"])
        )
        leaves = []
        for name, leaf in wanted.items():
            impl = meta["arrays"][name].get("key_impl")
            array = restored[name]
            if isinstance(leaf, jax.Array) and not leaf.committed:
                # Pipeline.init's rng is uncommitted, so jit moves it to every stage's
                # devices; orbax commits what it restores, which jit would then refuse.
                array = jnp.asarray(np.asarray(array))
            leaves.append(array if impl is None else jax.random.wrap_key_data(array, impl=impl))
        return assemble(template, leaves, ints), meta["extra"]

    def extra(self, step: int | None = None) -> dict[str, Any]:
        """The ``extra`` saved with checkpoint ``step`` (default: the newest), read from its
        metadata alone (no state is built, no array read), after the metadata's checks
        (its checksums, and that it is ``step``'s).

        Raises:
          CheckpointError: if the directory holds no checkpoint, ``step`` is not there, or
            its metadata is damaged (naming the field, and the steps that verify).
        """
        step = self._pick_step(step)
        meta = self._from_0(lambda: self._read_meta(step))
        return dict(meta["extra"])

    def verify(self, step: int | None = None) -> None:
        """Checks that checkpoint ``step`` (default: the newest) is intact, without building
        a state: its metadata is complete, matches its checksums and is that of
        ``step``, and every array reads back with the checksum it was saved with. Steps
        saved by pdjax before checksums (format versions 1 and 2) are only checked to
        read, and the metadata of version 3 has no checksum. Reads the whole step into
        host memory.

        :meth:`restore` runs the same checks on the arrays it reads, so a training loop
        needs this only to find the newest good step before it restores.

        Raises:
          CheckpointError: if the directory holds no checkpoint or ``step`` is not there;
            or, for a damaged step, naming the step, the array (or metadata field) at
            fault, and the other steps there that verify, to restore one of them instead.
        """
        step = self._pick_step(step)
        self._from_0(lambda: self._verify_local(step, explain=True))

    def _pick_step(self, step: int | None) -> int:
        """``step``, or the newest for None; raises when there is none."""
        steps = self.all_steps()
        if not steps:
            where = "" if self.directory.is_dir() else " (the directory does not exist)"
            raise CheckpointError(f"no checkpoint in {self.directory}{where}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; available steps: {steps}"
            )
        return step

    def _verify_local(self, step: int, *, explain: bool) -> None:
        """Process 0: reads step ``step``'s metadata and every stored array, checked."""
        meta = self._read_meta(step, explain=explain)
        saved: Mapping[str, Mapping[str, Any]] = meta["arrays"]
        stored = {
            n: np.empty(e["shape"], np.dtype(e["dtype"]))
            for n, e in saved.items()
            if "same_as" not in e
        }
        self._read_arrays(step, stored, saved, explain=explain)

    def _damage_error(self, step: int, damage: Damage) -> CheckpointError:
        """The error for a damaged step: what is wrong, and the steps to restore instead
        (process 0; verifies the others, newest first, up to ``_GOOD_STEPS_LISTED``)."""
        assert self._manager is not None
        self._manager.reload()
        good: list[int] = []
        others = sorted((s for s in self._manager.all_steps() if s != step), reverse=True)
        checked = 0
        for other in others:
            if len(good) == _GOOD_STEPS_LISTED:
                break
            checked += 1
            try:
                self._verify_local(other, explain=False)
            except (Damage, CheckpointError):
                continue
            good.append(other)
        where = f"step {step} in {self.directory}"
        if good:
            more = " (older ones not checked)" if checked < len(others) else ""
            way_out = (
                f"the steps there that verify, newest first: {good}{more}; resume from one "
                f"with restore(..., step={good[0]}) in Python, or --resume-step {good[0]} "
                f"on the command line, and move the damaged {self.directory / str(step)} out "
                "of the folder"
            )
        else:
            held = (
                f"its other steps {sorted(others)} are damaged too"
                if others
                else ("it holds no other step")
            )
            way_out = f"{held}, so start the run afresh in a new folder"
        return CheckpointError(f"{where} is damaged: {damage}; {way_out}")

    def _restore_replanned(
        self, template: PipelineState, step: int, meta: Mapping[str, Any], pipeline: Any
    ) -> tuple[PipelineState, dict[str, Any]]:
        """Restores a pipeline checkpoint saved under another plan (see :meth:`restore`)."""
        leaves = self._moved_leaves(template, step, meta, pipeline)
        updates = list(meta["ints"]["updates"])
        ints = {**meta["ints"], "updates": [updates[0]] * len(template.params)}
        return assemble(template, leaves, ints), meta["extra"]

    def _restore_into_dp(
        self, template: DPState, step: int, meta: Mapping[str, Any]
    ) -> tuple[DPState, dict[str, Any]]:
        """Restores a pipeline checkpoint into data parallelism, as into a pipeline of one
        stage (see :meth:`restore`)."""
        view, one_stage = one_stage_view(template)
        leaves = self._moved_leaves(view, step, meta, one_stage)
        updates = list(meta["ints"]["updates"])
        return assemble(template, leaves, {"step": updates[0]}), meta["extra"]

    def _moved_leaves(
        self, template: PipelineState, step: int, meta: Mapping[str, Any], pipeline: Any
    ) -> list[Any]:
        """The template's array leaves from a checkpoint of a pipeline of another plan
        (:mod:`.replan`), each read onto its new sharding."""
        where = f"step {step} in {self.directory}"
        check_replannable(where, meta, template, pipeline, multi=self._multi)
        saved: Mapping[str, Mapping[str, Any]] = meta["arrays"]
        sources = replan_names(pipeline, template, list(meta["stage_layers"]), saved)
        used = {n for names in sources.values() for n in names}
        for name, theirs in saved.items():
            if name not in used and not _phantom_left_behind(name, saved, used):
                raise _no_such_array(where, name, theirs)
        check_moved_shapes(where, template, sources, saved)
        targets = read_targets(template, sources, saved)
        aliased = {saved[n]["same_as"] for n in targets if "same_as" in saved[n]}
        for name, entry in saved.items():  # orbax restores whole items: the rest to host
            if name not in targets and name not in aliased and "same_as" not in entry:
                targets[name] = np.empty(entry["shape"], np.dtype(entry["dtype"]))
        read = self._read_arrays(step, targets, saved)
        return replanned_leaves(where, template, sources, read, saved)

    def _read_arrays(
        self,
        step: int,
        abstract: Mapping[str, Any],
        saved: Mapping[str, Any] | None = None,
        *,
        explain: bool = True,
    ) -> dict[str, Any]:
        """Reads ``abstract``'s arrays (host arrays, or ``jax.ShapeDtypeStruct`` with a
        sharding: each device reads its part) and checks them against the ``saved``
        manifest's checksums, shard by shard; one stored once for several names
        (``same_as``) is read once and copied to each (a buffer of its own, moved device
        to device). A damaged step raises :class:`CheckpointError` (``explain``) or
        :class:`_Damage`."""
        assert self._manager is not None
        saved = saved or {}
        aliases = {n: e["same_as"] for n, e in saved.items() if "same_as" in e and n in abstract}
        stored = {n: a for n, a in abstract.items() if n not in aliases}
        for alias, src in aliases.items():
            if src not in stored:  # read onto the first of its aliases' shardings
                entry = saved[src]
                shape, dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
                sharding = getattr(abstract[alias], "sharding", None)
                stored[src] = (
                    np.empty(shape, dtype)
                    if sharding is None
                    else jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                )
        try:
            failed = None
            with quiet_abandoned_reads():
                try:
                    out = self._manager.restore(
                        step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(stored))
                    )["arrays"]
                except Exception as e:  # TensorStore's errors carry no type to tell apart
                    name = failed_array(e, list(stored))
                    what = f"array {name}" if name else "its arrays"
                    failed = f"{what} cannot be read ({reason(e)})"
                if failed is not None:
                    gc.collect()
            if failed is not None:  # raised here: the error no longer holds orbax's reads
                drop_late_wakeups()
                raise Damage(failed)
            for name in stored:
                want = saved.get(name, {}).get("checksum")
                if want is not None and array_checksum(out[name]) != want:
                    raise Damage(
                        f"array {name} does not match its checksum (its bytes on disk "
                        "changed after the save)"
                    )
        except Damage as damage:
            if not explain:
                raise
            raise self._damage_error(step, damage) from damage
        for name, src in aliases.items():
            sharding = getattr(abstract[name], "sharding", None)
            if sharding is None:
                out[name] = np.array(out[src])
            else:
                out[name] = own_copy(out[src], sharding)
        return {n: out[n] for n in abstract}

    def _read_arrays_multi(
        self,
        step: int,
        abstract: Mapping[str, jax.ShapeDtypeStruct],
        saved: Mapping[str, Any],
    ) -> dict[str, jax.Array]:
        """Several processes: process 0 reads every array (into host memory) and sends each
        process the ones whose shardings include its devices."""
        names = list(abstract)
        me = self._process
        needs = np.array(
            [any(d.process_index == me for d in abstract[n].sharding.device_set) for n in names],
            dtype=np.bool_,
        )
        table = np.array(allgather_json(needs.tolist()), dtype=np.bool_).reshape(-1, len(names))
        host = self._from_0(
            lambda: self._read_arrays(
                step, {n: np.empty(a.shape, a.dtype) for n, a in abstract.items()}, saved
            ),
            share=False,
        )
        out: dict[str, jax.Array] = {}
        for j, name in enumerate(names):
            a = abstract[name]
            whole = np.asarray(host[name]) if me == 0 else None
            for q in range(1, table.shape[0]):
                if table[q, j] and me in (0, q):
                    got = move(whole, a, src=0, dst=q)
                    whole = whole if me == 0 else got
            if table[me, j]:
                assert whole is not None
                out[name] = jax.make_array_from_callback(a.shape, a.sharding, whole.__getitem__)
            else:  # another process's array: shapes only here
                out[name] = jax.make_array_from_single_device_arrays(
                    a.shape, a.sharding, [], dtype=a.dtype
                )
        return out

    def _from_0(self, fn: Callable[[], Any], *, share: bool = True) -> Any:
        """Runs ``fn`` on process 0 and returns its (JSON-able) result on every process;
        an error there is raised on every process, as a :class:`CheckpointError`. One
        process: just ``fn()``. ``share=False``: the others only learn that it worked
        (and get None)."""
        if not self._multi:
            return fn()
        value, reply, error = None, None, None
        if self._process == 0:
            try:
                value = fn()
                reply = {"value": value if share else None}
            except Exception as e:  # re-raised below, once the others know
                error = e
                reply = {"error": str(e) if _is_ours(e) else f"{type(e).__name__}: {e}"}
        got = broadcast_json(reply)
        if error is not None:
            raise error
        if "error" in got:
            raise CheckpointError(got["error"] + " (on process 0, which reads and writes)")
        return value if self._process == 0 else got["value"]

    def _read_meta(
        self,
        step: int,
        *,
        explain: bool = True,
        expect: tuple[str, tuple[str, ...]] | None = None,
    ) -> dict[str, Any]:
        """Step ``step``'s metadata, checked to hold every field a restore uses (``expect``:
        the template's state type and counters, see :func:`_check_meta`). A damaged one
        raises :class:`CheckpointError` (``explain``) or :class:`_Damage`."""
        assert self._manager is not None
        file = self.directory / str(step) / Path(*META_FILE)
        try:
            # orbax opens the file by name: a link (to a device), a FIFO or a device there
            # would be read forever or waited on; pdjax wrote a regular file
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISREG(os.lstat(file).st_mode):
                    raise Damage(
                        f"its metadata {file} is not a regular file (a link, a FIFO or a "
                        "device: pdjax writes none of those)"
                    )
            try:
                meta = self._manager.restore(
                    step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                )["meta"]
            except Exception as e:  # a missing file, or not JSON
                raise Damage(f"its metadata {file} cannot be read ({reason(e)})") from e
            check_meta(meta, file, expect, step)
        except Damage as damage:
            if not explain:
                raise
            raise self._damage_error(step, damage) from damage
        return dict(meta)

    def _check_match(
        self, step: int, state: str, meta: Mapping[str, Any], wanted: Mapping[str, Any]
    ) -> None:
        where = f"step {step} in {self.directory}"
        if meta["state"] != state:
            raise CheckpointError(
                f"{where} holds a {meta['state']}, the template is a {state}; "
                "restore it with a template from the same kind of runner"
            )
        saved: Mapping[str, Mapping[str, Any]] = meta["arrays"]
        for name, leaf in wanted.items():
            if is_key(leaf):
                data = jax.eval_shape(jax.random.key_data, leaf)
                mine = {"shape": list(data.shape), "dtype": str(data.dtype)}
            else:
                mine = {"shape": list(leaf.shape), "dtype": str(leaf.dtype)}
            theirs = saved.get(name)
            if theirs is None:
                raise CheckpointError(
                    f"{where} does not match the template: the template has {name} "
                    f"({shape_str(mine)}), the checkpoint has no such array{_MISMATCH_HINT}"
                )
            if list(theirs["shape"]) != mine["shape"] or theirs["dtype"] != mine["dtype"]:
                raise CheckpointError(
                    f"{where} does not match the template: {name} is "
                    f"{shape_str(theirs)} in the checkpoint and {shape_str(mine)} in the "
                    f"template{_MISMATCH_HINT}"
                )
        for name, theirs in saved.items():
            if name not in wanted:
                raise _no_such_array(where, name, theirs)

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r})"
