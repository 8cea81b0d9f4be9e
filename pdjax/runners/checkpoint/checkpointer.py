"""The :class:`Checkpointer`: saves, restores, verifies and lists the steps of a
checkpoint directory through orbax (whose rename of a finished step is the commit), on
process 0 alone when there are several.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from pdjax.distributed import allgather_json, broadcast_json, check_cpu_transfers
from pdjax.errors import CheckpointError
from pdjax.pipeline.executor import Pipeline, PipelineState
from pdjax.runners.checkpoint.arrays import (
    _add_checksums,
    _array_leaves,
    _assemble,
    _check_state,
    _counters,
    _is_key,
    _jsonable,
    _manifest,
    _same_values,
    _stage_layers,
    _State,
)
from pdjax.runners.checkpoint.format import (
    _FORMAT,
    _FORMAT_VERSION,
    _ITEMS,
    _META_FILE,
    _check_folder,
    _check_meta,
    _checksum,
    _Damage,
    _shape_str,
)
from pdjax.runners.checkpoint.reads import (
    _drop_late_wakeups,
    _failed_array,
    _quiet_abandoned_reads,
    _reason,
)
from pdjax.runners.checkpoint.replan import _check_replannable, _replanned_leaves, replan_names
from pdjax.runners.checkpoint.transfer import _collective_transfers, _gather_to_0, _move
from pdjax.runners.protocol import RunnerState, counter_fields

# A damaged step's error lists the steps that verify, newest first; it stops after this
# many, since verifying a step reads all of it.
_GOOD_STEPS_LISTED = 3


def _is_ours(e: Exception) -> bool:
    return isinstance(e, CheckpointError)


class Checkpointer:
    """Saves and restores training states in ``directory``, one sub-directory per step.

    Args:
      directory: where the checkpoints live; created by the first :meth:`save`.
      max_to_keep: keep the newest this many steps, deleting older ones after each save
        (``None`` keeps all).

    Raises:
      CheckpointError: for ``max_to_keep < 1``, or a ``directory`` holding folders named
        like steps (``1/``, ``2/``) that are not pdjax checkpoints (the retention would
        delete them). Other files there are left alone.

    The first :meth:`save` also deletes the unfinished temporary directories that crashed
    saves left; reading never does, so an evaluator may watch a running trainer's
    directory. Use as a context manager, or call :meth:`close`, to stop orbax's
    background threads.
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
        if self._multi and not _collective_transfers():
            check_cpu_transfers("a checkpoint across processes (gathered on process 0)")
        self._manager = None
        self._from_0(lambda: _check_folder(self.directory))
        self._manager = self._new_manager()

    def _new_manager(self) -> ocp.CheckpointManager | None:
        if self._process != 0:
            return None
        return ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self._max_to_keep,
                # Created by the first save, so restoring from a mistyped path does not
                # leave an empty directory behind.
                create=False,
                # Deletes the <step>.orbax-checkpoint-tmp directories of crashed saves. Only
                # a writer does: a reader (an evaluator watching a running trainer's
                # directory) would delete the save in progress.
                cleanup_tmp_directories=self._writing,
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    primary_host=0, active_processes={0}
                ),
            ),
            item_names=_ITEMS,
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Waits for pending work and releases orbax's resources."""
        if self._manager is not None:
            self._manager.close()

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
            another type or with deleted (donated) arrays, or an ``extra`` that JSON
            cannot hold.
        """
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise CheckpointError(f"step must be an int >= 0, got {step!r}")
        step = int(step)
        _check_state(state, "state")

        extra = _jsonable({} if extra is None else extra, "extra")
        steps = self.all_steps()
        if steps and step <= steps[-1]:
            raise CheckpointError(
                f"cannot save step {step} in {self.directory}: it holds steps {steps}, and "
                "steps must increase; save with a larger step, or delete the newer steps "
                "(or use another directory) to branch off an older one"
            )
        arrays, manifest = _manifest(state)
        if not self._multi:  # a tied parameter's copies (equal bits) are stored once
            for name, first in _same_values(arrays).items():
                manifest[name]["same_as"] = first
                del arrays[name]
        meta = {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "state": type(state).__name__,
            "ints": _counters(state),
            "arrays": manifest,
            "extra": extra,
        }
        layers = _stage_layers(state)
        if layers is not None:  # the plan's shape, to restore into another plan
            meta["stage_layers"] = layers
        if self._multi:
            arrays = _gather_to_0(arrays)

        def write() -> None:
            assert self._manager is not None
            _add_checksums(manifest, arrays)
            if not self._writing:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._manager.close()
                self._writing = True
                self._manager = self._new_manager()
                assert self._manager is not None
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
                ),
            )
            self._manager.wait_until_finished()
            if not saved:  # orbax declines silently (e.g. another process saved it meanwhile)
                raise CheckpointError(
                    f"orbax did not save step {step} in {self.directory} "
                    f"(steps there now: {sorted(self._manager.all_steps())})"
                )

        self._from_0(write)  # the others wait for process 0's commit (or its error)

    # -- restoring --------------------------------------------------------------------------

    def restore(
        self, template: _State, step: int | None = None, *, pipeline: Pipeline | None = None
    ) -> tuple[_State, dict[str, Any]]:
        """Restores checkpoint ``step`` (default: the newest) into ``template``'s layout.

        A pipeline checkpoint restores into *another plan* of the same model and optimizer
        (other stage cuts, replicas or device count) when ``pipeline`` is the
        :class:`Pipeline` the template belongs to: weights, model state and optimizer state
        are moved layer by layer (:func:`replan_names`); the stages' update counts must
        agree (they do after any flush schedule, ``pipedream`` and ``2bw``).

        Args:
          template: a state of the runner to restore into: e.g. ``pipe.init(...)`` of a
            new :class:`Pipeline` with the same model, plan and optimizer, or the same tree
            with ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves (its int fields
            are ignored). Its values are not used; its shardings say where each restored
            array goes.
          step: the step to restore; ``None`` for the newest.
          pipeline: the template's pipeline, to restore a checkpoint saved under another
            plan (one process).

        Returns:
          ``(state, extra)``: the saved state, bit for bit (arrays, ints, PRNG key), of
          ``template``'s type and tree structure and on its shardings; and the ``extra``
          given to :meth:`save` (``{}`` if none).

        Raises:
          CheckpointError: if the directory holds no checkpoint, ``step`` is not there,
            the checkpoint does not match the template (names the first array that
            differs, with both shapes), or the step is damaged (see :meth:`verify`).
        """
        _check_state(template, "template")
        step = self._pick_step(step)
        expect = (type(template).__name__, counter_fields(template))
        meta = self._from_0(lambda: self._read_meta(step, expect=expect))
        ints = meta["ints"]
        wanted = _array_leaves(template)
        saved_layers = meta.get("stage_layers")
        mine = _stage_layers(template)  # None but for a pipeline's (as saved_layers)
        if saved_layers is not None and mine is not None and saved_layers != mine:
            assert isinstance(template, PipelineState)  # what _stage_layers took it for
            replanned = self._restore_replanned(template, step, meta, pipeline)
            return cast(tuple[_State, dict[str, Any]], replanned)
        self._check_match(step, type(template).__name__, meta, wanted)
        abstract: dict[str, jax.ShapeDtypeStruct] = {}
        for name, leaf in wanted.items():
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                raise CheckpointError(
                    f"the template's {name} has no sharding; pass a state of the runner "
                    "(e.g. pipe.init(...)) or jax.ShapeDtypeStruct leaves with sharding=..."
                )
            data = jax.eval_shape(jax.random.key_data, leaf) if _is_key(leaf) else leaf
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
        return _assemble(template, leaves, ints), meta["extra"]

    def verify(self, step: int | None = None) -> None:
        """Checks that checkpoint ``step`` (default: the newest) is intact, without building
        a state: its metadata is complete, and every array reads back with the checksum
        it was saved with. Steps saved by pdjax before checksums (format versions 1 and 2)
        are only checked to read. Reads the whole step into host memory.

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

    def _damage_error(self, step: int, damage: _Damage) -> CheckpointError:
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
            except (_Damage, CheckpointError):
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
        where = f"step {step} in {self.directory}"
        _check_replannable(where, meta, template, pipeline, multi=self._multi)
        saved: Mapping[str, Mapping[str, Any]] = meta["arrays"]
        sources = replan_names(pipeline, template, list(meta["stage_layers"]), saved)
        host = self._read_arrays(  # all of them, into host memory (orbax reads whole items)
            step,
            {n: np.empty(e["shape"], np.dtype(e["dtype"])) for n, e in saved.items()},
            saved,
        )
        leaves = _replanned_leaves(where, template, sources, host, saved)
        updates = list(meta["ints"]["updates"])
        ints = {**meta["ints"], "updates": [updates[0]] * len(template.params)}
        return _assemble(template, leaves, ints), meta["extra"]

    def _read_arrays(
        self,
        step: int,
        abstract: Mapping[str, Any],
        saved: Mapping[str, Any] | None = None,
        *,
        explain: bool = True,
    ) -> dict[str, Any]:
        """Reads ``abstract``'s arrays and checks them against the ``saved`` manifest's
        checksums; one stored once for several names (``same_as``) is read once and copied
        to each (a buffer of its own). A damaged step raises :class:`CheckpointError`
        (``explain``) or :class:`_Damage`."""
        assert self._manager is not None
        saved = saved or {}
        aliases = {n: e["same_as"] for n, e in saved.items() if "same_as" in e and n in abstract}
        stored = {n: a for n, a in abstract.items() if n not in aliases}
        for src in set(aliases.values()) - set(stored):
            e = saved[src]
            stored[src] = np.empty(e["shape"], np.dtype(e["dtype"]))
        try:
            failed = None
            with _quiet_abandoned_reads():
                try:
                    out = self._manager.restore(
                        step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(stored))
                    )["arrays"]
                except Exception as e:  # TensorStore's errors carry no type to tell apart
                    name = _failed_array(e, list(stored))
                    what = f"array {name}" if name else "its arrays"
                    failed = f"{what} cannot be read ({_reason(e)})"
                if failed is not None:
                    gc.collect()
            if failed is not None:  # raised here: the error no longer holds orbax's reads
                _drop_late_wakeups()
                raise _Damage(failed)
            for name in stored:
                want = saved.get(name, {}).get("checksum")
                if want is not None and _checksum(out[name]) != want:
                    raise _Damage(
                        f"array {name} does not match its checksum (its bytes on disk "
                        "changed after the save)"
                    )
        except _Damage as damage:
            if not explain:
                raise
            raise self._damage_error(step, damage) from damage
        for name, src in aliases.items():
            value = np.asarray(out[src])
            sharding = getattr(abstract[name], "sharding", None)
            out[name] = value.copy() if sharding is None else jax.device_put(value, sharding)
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
                    got = _move(whole, a, src=0, dst=q)
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
        file = self.directory / str(step) / Path(*_META_FILE)
        try:
            try:
                meta = self._manager.restore(
                    step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                )["meta"]
            except Exception as e:  # a missing file, or not JSON
                raise _Damage(f"its metadata {file} cannot be read ({_reason(e)})") from e
            _check_meta(meta, file, expect)
        except _Damage as damage:
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
        hint = (
            "; the model, the plan (stages, layers per stage) or the optimizer differ from "
            "the run that saved it: build the template with the same ones"
        )
        for name, leaf in wanted.items():
            if _is_key(leaf):
                data = jax.eval_shape(jax.random.key_data, leaf)
                mine = {"shape": list(data.shape), "dtype": str(data.dtype)}
            else:
                mine = {"shape": list(leaf.shape), "dtype": str(leaf.dtype)}
            theirs = saved.get(name)
            if theirs is None:
                raise CheckpointError(
                    f"{where} does not match the template: the template has {name} "
                    f"({_shape_str(mine)}), the checkpoint has no such array{hint}"
                )
            if list(theirs["shape"]) != mine["shape"] or theirs["dtype"] != mine["dtype"]:
                raise CheckpointError(
                    f"{where} does not match the template: {name} is "
                    f"{_shape_str(theirs)} in the checkpoint and {_shape_str(mine)} in the "
                    f"template{hint}"
                )
        for name, theirs in saved.items():
            if name not in wanted:
                raise CheckpointError(
                    f"{where} does not match the template: the checkpoint has {name} "
                    f"({_shape_str(theirs)}), the template has no such array{hint}"
                )

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r})"
