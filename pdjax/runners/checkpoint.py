"""Checkpoints of a training run: any runner's state (a
:class:`~pdjax.runners.RunnerState`: a :class:`PipelineState`, a
:class:`~pdjax.runners.DPState`...) plus the training loop's own metadata, saved with
orbax and restored bit for bit.

>>> import tempfile, jax, optax
>>> from pdjax.runners import DataParallel
>>> from pdjax.models import get_model
>>> spec = get_model("mlp")
>>> x, y = spec.sample_batch(8)
>>> dp = DataParallel(spec.layers, spec.loss, optax.sgd(0.1), devices=jax.devices()[:1])
>>> state, _ = dp.step(dp.init(jax.random.key(0), x), (x, y))
>>> with tempfile.TemporaryDirectory() as directory, Checkpointer(directory) as ckpt:
...     ckpt.save(1, state, extra={"epoch": 0, "batch": 1})
...     restored, extra = ckpt.restore(dp.init(jax.random.key(1), x))
>>> restored.step, extra
(1, {'epoch': 0, 'batch': 1})

On disk, ``directory/<step>/`` is one orbax ``CheckpointManager`` step with two items:

- ``arrays/``: every array of the state (``StandardSave``, OCDBT), as a flat dict keyed
  by the array's path in the state: ``params.1.0.dense.kernel`` (field, stage, layer in
  the stage, then the layer's own tree), ``opt_state.1.0.mu.0.dense.kernel``,
  ``model_state.0.1.batch_stats.mean``, ``rng``. A typed PRNG key is stored as its
  ``jax.random.key_data`` (``uint32``). A ``DPState`` has no stage level. The arrays are
  those of the state's :data:`~pdjax.runners.protocol.ARRAY_FIELDS`.
- ``meta/metadata``: JSON with the format tag and version, the state's type name, its
  other fields, which are Python ints (:func:`~pdjax.runners.protocol.counter_fields`:
  ``updates`` and ``microbatches`` of a pipeline, ``step`` of data parallelism), the
  layers per stage of a pipeline state (``stage_layers``), the shape, dtype and checksum
  (CRC-32 of its bytes, dtype and shape) of every array (and the implementation of each
  PRNG key, e.g. ``threefry2x32``), and ``extra``.

Every restore checks each array it reads against its checksum, and the metadata for every
field it uses: a damaged step (a flipped bit, a truncated or missing file, edited
metadata) raises :class:`CheckpointError` naming the step, the array or field at fault and
the steps in the folder that verify, instead of restoring wrong values.
:meth:`Checkpointer.verify` runs the same checks without building a state.

Restoring needs a template, a state of the same runner (``pipe.init(...)``, or the same
tree with ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves): the checkpoint's
arrays must match its paths, shapes and dtypes, and are placed with its shardings, so a
run restarts on the devices its (new) runner uses. Optimizer states come back as their
own types (``ScaleByAdamState``, ...), not lists, because the tree structure is the
template's.

Asynchronous schedules (``pipedream``, ``2bw``) checkpoint *drain-then-save*. Each call
of :meth:`Pipeline.run` fills the pipeline and drains it, so a state between calls holds
only the newest weights of each stage: no microbatch in flight, no stashed version. That
is the only state there is to save, so the save boundary is a flush. In an unbroken
PipeDream stream, microbatch ``k`` at stage ``s`` would use the stashed version
``k - (P - s) + 1``; across the boundary the microbatches that would have been in flight
instead start the next call on the newest weights (as at the start of any call), and
``2bw``'s first step after it uses the newest weights rather than the previous ones.
The flush is a property of the calls, not of the save: a run that saves, stops,
restores and goes on with the same calls is bit for bit the run that never stopped.

Crash safety comes from orbax: a step is written into ``<step>.orbax-checkpoint-tmp``
and renamed to ``<step>`` once complete (the rename is the commit), so a process killed
mid-save leaves the previous steps intact, and an unfinished temporary directory is never
listed as a step (even one holding every file); the first save of the next
:class:`Checkpointer` deletes it. :meth:`Checkpointer.save` blocks until its step is
committed.

Several processes (``jax.distributed``): every method is collective — every process
calls it, in the same order, with the same arguments. Process 0 writes and reads the
directory alone (so it need not be shared); :meth:`save` first moves each array that it
does not hold to it (another process's pipeline stage, with ``jax.device_put`` across
processes, the same transport as the activations), and :meth:`restore` sends each
process the arrays it holds. The checkpoint is the same as a single process writes: a run
saved by 2 processes restores in 1 process with the same plan, and the other way round.
The write itself, the commit rename and the retention are orbax's (a
``CheckpointManager`` active on process 0 alone); the others wait for its commit.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from pdjax._sharding import first_device
from pdjax.distributed import allgather_json, broadcast_json, check_cpu_transfers
from pdjax.errors import CheckpointError
from pdjax.pipeline.executor import Pipeline, PipelineState
from pdjax.runners.protocol import ARRAY_FIELDS, RunnerState, counter_fields

__all__ = ["Checkpointer"]

# The format tag and layout version in every checkpoint's ``meta`` item.
_FORMAT = "pdjax.checkpoint"
# 2: parameters stored once per value ("same_as"); 3: a checksum per array ("checksum")
_FORMAT_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)
# The orbax item and file holding the metadata, inside a step's folder.
_META_FILE = ("meta", "metadata")
# A folder name orbax's CheckpointManager takes for a step (its standard name format).
_STEP_NAME = re.compile(r"0|[1-9]\d*")
# A damaged step's error lists the steps that verify, newest first; it stops after this
# many, since verifying a step reads all of it.
_GOOD_STEPS_LISTED = 3

_State = TypeVar("_State", bound=RunnerState)
_ITEMS = ("arrays", "meta")
# What a committed step's folder holds: the two items and orbax's own files.
_STEP_ENTRIES = frozenset({*_ITEMS, "_CHECKPOINT_METADATA", "commit_success.txt"})


def _check_state(state: Any, what: str) -> None:
    """Refuses what is not a runner's state with its arrays in fields of their own."""
    if isinstance(state, RunnerState) and set(ARRAY_FIELDS) <= set(state._fields):
        return
    raise CheckpointError(
        f"{what} must be a PipelineState (from Pipeline.init/run/step) or a DPState (from "
        "DataParallel.init/step), or another runner's state (pdjax.runners.RunnerState: a "
        f"NamedTuple with the fields {', '.join(ARRAY_FIELDS)}), got {type(state).__name__}"
    )


def _path_name(path: tuple[Any, ...]) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)


def _stage_layers(state: RunnerState) -> list[int] | None:
    """A pipeline state's layers per stage (the shape of its plan), else None."""
    if not isinstance(state, PipelineState):
        return None
    params: tuple[list[Any], ...] = state.params
    return [len(p) for p in params]


def _array_leaves(state: RunnerState) -> dict[str, Any]:
    """The state's array leaves (or the template's abstract ones), keyed by path, in
    tree order; raises for a leaf that is not an array."""
    out: dict[str, Any] = {}
    cls = type(state)
    for field in state._fields:
        if field not in ARRAY_FIELDS:
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(state, field))[0]:
            name = _path_name((jax.tree_util.GetAttrKey(field), *path))
            if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                raise CheckpointError(
                    f"{name} is a {type(leaf).__name__}, not an array; a {cls.__name__} "
                    "holds arrays outside its int fields "
                    f"{', '.join(counter_fields(state))}"
                )
            if name in out:
                raise CheckpointError(
                    f"two leaves of the state are both named {name!r}; rename the module or "
                    "collection whose name contains a '.'"
                )
            out[name] = leaf
    return out


def _visible_copies(
    tied: Sequence[tuple[str, tuple[tuple[int, tuple[str, ...]], ...]]],
    stage_of: Sequence[int],
) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Per tied group, the copy its optimizer state belongs to under a plan (``stage_of``:
    each layer's stage): the first listed copy on the first stage holding one."""
    out = {}
    for name, copies in tied:
        owner = min(stage_of[i] for i, _ in copies)
        out[name] = next((i, path) for i, path in copies if stage_of[i] == owner)
    return out


def replan_names(
    pipeline: Any,
    template: PipelineState,
    saved_layers: Sequence[int],
    saved: Mapping[str, Any],
) -> dict[str, list[str]]:
    """Where each array of ``template`` (a state of ``pipeline``'s plan) comes from in a
    checkpoint saved under a plan with ``saved_layers`` layers per stage: per template
    array name, the saved names that hold it (several for a value every stage keeps, such
    as an optimizer's step count: they must agree).

    Weights and model state move layer by layer. The optimizer state of each stage is
    searched for the subtrees shaped like the stage's parameters as its optimizer sees them
    (``optax`` keeps ``mu``, ``nu``, momentum... that way): their leaves move with their
    parameters (a tied group's with the group); every other leaf must be in every saved
    stage.

    Raises:
      CheckpointError: for an array with no source (an optimizer whose state is not per
        parameter, e.g. ``optax.masked``, or another model).
    """
    from jax.tree_util import DictKey, GetAttrKey, SequenceKey

    def stage_layer(layers_per_stage: Sequence[int]) -> list[tuple[int, int]]:
        return [(s, j) for s, n in enumerate(layers_per_stage) for j in range(n)]

    old_at = stage_layer(saved_layers)  # global layer -> (old stage, index in it)
    new_counts = [len(p) for p in template.params]
    new_first = np.cumsum([0, *new_counts])[:-1]
    tied = tuple(getattr(pipeline.layers, "tied_leaves", ()))
    old_visible = _visible_copies(tied, [s for s, _ in old_at])
    new_visible = _visible_copies(tied, [s for s, _ in stage_layer(new_counts)])
    group_of = {v: name for name, v in new_visible.items()}
    out: dict[str, list[str]] = {}

    def put(name: str, sources: list[str]) -> None:
        missing = [n for n in sources if n not in saved]
        if not sources or missing:
            raise CheckpointError(
                f"the checkpoint has no source for {name} of the new plan"
                f"{' (looked for ' + ', '.join(missing) + ')' if missing else ''}; the model "
                "or the optimizer differ from the run that saved it, or the optimizer's "
                "state is not kept per parameter (e.g. optax.masked), which pdjax cannot "
                "move between plans: restore it under its own plan"
            )
        out[name] = sources

    def layer_name(field: str, layer: int, rest: tuple[Any, ...]) -> str:
        s, j = old_at[layer]
        return _path_name((GetAttrKey(field), SequenceKey(s), SequenceKey(j), *rest))

    for field in ("params", "model_state"):
        for s, tree in enumerate(getattr(template, field)):
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
                name = _path_name((GetAttrKey(field), SequenceKey(s), *path))
                layer = int(new_first[s]) + path[0].idx
                put(name, [layer_name(field, layer, path[1:])])
    put("rng", ["rng"])
    for s, (params, opt) in enumerate(zip(template.params, template.opt_state, strict=True)):
        stage = pipeline.stages[s]
        hidden = stage.ties.hidden if stage.ties is not None else frozenset()
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        visible = [path for k, (path, _) in enumerate(flat) if k not in hidden]
        view = stage.ties.view(params) if stage.ties is not None else params
        # an optimizer coupled through the global norm sees (parameters, phantom scalar)
        phantom = bool(getattr(stage.optimizer, "needs_exchange", False))
        view_def = jax.tree.structure((view, 0) if phantom else view)

        def shaped(t: Any, d: Any = view_def) -> bool:
            same: bool = jax.tree.structure(t) == d
            return same

        tops = jax.tree_util.tree_flatten_with_path(opt, is_leaf=shaped)[0]
        for prefix, sub in tops:
            here = (GetAttrKey("opt_state"), SequenceKey(s), *prefix)
            if not shaped(sub):  # not per parameter: the same in every saved stage
                put(
                    _path_name(here),
                    [
                        _path_name((GetAttrKey("opt_state"), SequenceKey(o), *prefix))
                        for o in range(len(saved_layers))
                    ],
                )
                continue
            sub_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(sub)[0]]
            if phantom:
                # the phantom's state only drives its own (dropped) update: any stage's does
                inner = sub_paths.pop()
                o = min(s, len(saved_layers) - 1)
                old = (GetAttrKey("opt_state"), SequenceKey(o), *prefix, *inner)
                put(_path_name((*here, *inner)), [_path_name(old)])
                sub_paths = [p[1:] for p in sub_paths]
                prefix_in: tuple[Any, ...] = (SequenceKey(0),)
            else:
                prefix_in = ()
            if len(sub_paths) != len(visible):
                raise CheckpointError(
                    f"opt_state of stage {s}: a subtree shaped like its parameters holds "
                    f"{len(sub_paths)} arrays for {len(visible)} parameters"
                )
            for inner, ppath in zip(sub_paths, visible, strict=True):
                layer = int(new_first[s]) + ppath[0].idx
                keys = tuple(_key_text(k) for k in ppath[1:])
                group = group_of.get((layer, keys))
                rest: tuple[Any, ...] = ppath[1:]
                if group is not None:  # a tied group's state: at its copy in the old plan
                    layer, keys = old_visible[group]
                    rest = tuple(DictKey(k) for k in keys)
                o, j = old_at[layer]
                old = (
                    GetAttrKey("opt_state"),
                    SequenceKey(o),
                    *prefix,
                    *prefix_in,
                    SequenceKey(j),
                    *rest,
                )
                put(_path_name((*here, *prefix_in, *inner)), [_path_name(old)])
    return out


def _key_text(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _assemble(template: _State, leaves: list[Any], ints: Mapping[str, Any]) -> _State:
    """A state of ``template``'s type from its array leaves (in ``template``'s tree order)
    and ints."""
    it = iter(leaves)
    fields: dict[str, Any] = {}
    for field in template._fields:
        if field not in ARRAY_FIELDS:
            value = ints[field]
            fields[field] = tuple(value) if isinstance(value, list) else value
        else:
            template_leaves, treedef = jax.tree.flatten(getattr(template, field))
            values = [next(it) for _ in template_leaves]
            fields[field] = jax.tree.unflatten(treedef, values)
    return cast(_State, cast(Any, template)._replace(**fields))


def _counters(state: RunnerState) -> dict[str, Any]:
    """The state's counters as JSON (an int, or a list of ints); raises for another value."""
    out = {}
    for field in counter_fields(state):
        value = getattr(state, field)
        values = value if isinstance(value, tuple) else (value,)
        if not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in values):
            raise CheckpointError(
                f"{field} is a {type(value).__name__}; a {type(state).__name__} holds Python "
                f"ints (or tuples of them) outside its array fields {', '.join(ARRAY_FIELDS)}"
            )
        out[field] = _jsonable(value, field)
    return out


def _manifest(state: RunnerState) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The arrays to save (a PRNG key as its key data) and their manifest entries (shape,
    dtype, key implementation), keyed by path."""
    arrays: dict[str, Any] = {}
    manifest: dict[str, dict[str, Any]] = {}
    for name, leaf in _array_leaves(state).items():
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise CheckpointError(
                f"{name} has been deleted: the state was donated to a later step "
                "(DataParallel donates by default); save the newest state, before "
                "passing it on, or build the runner with donate=False"
            )
        entry: dict[str, Any] = {}
        if _is_key(leaf):
            entry["key_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        entry.update(shape=list(np.shape(leaf)), dtype=str(leaf.dtype))
        arrays[name] = leaf
        manifest[name] = entry
    return arrays, manifest


def _add_checksums(manifest: Mapping[str, dict[str, Any]], arrays: Mapping[str, Any]) -> None:
    """Adds each array's checksum to its manifest entry, from the host bytes orbax is
    given (on process 0, after the gather); an entry stored as another (``same_as``: equal
    bits, dtype and shape) gets that one's."""
    for name, entry in manifest.items():
        if name in arrays:
            entry["checksum"] = _checksum(arrays[name])
    for entry in manifest.values():
        if "same_as" in entry:
            entry["checksum"] = manifest[entry["same_as"]]["checksum"]


def _same_values(arrays: Mapping[str, Any]) -> dict[str, str]:
    """Parameters bit for bit equal to an earlier one (a tied parameter's copies, also any
    other equal arrays: storing them once loses nothing): name -> the first one's name."""
    groups: dict[Any, list[str]] = {}
    for name, a in arrays.items():
        if name.startswith("params.") and not _is_key(a):
            groups.setdefault((tuple(np.shape(a)), str(a.dtype)), []).append(name)
    out: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        seen: dict[bytes, str] = {}
        for name in names:
            data = np.ascontiguousarray(np.asarray(arrays[name]))
            # numpy declares ndarray a Buffer (__buffer__) only for Python >= 3.12
            digest = hashlib.sha256(data.view(np.uint8).reshape(-1)).digest()  # type: ignore[arg-type]
            first = seen.setdefault(digest, name)
            if first != name and np.array_equal(np.asarray(arrays[first]), data):
                out[name] = first
    return out


def _is_key(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _jsonable(value: Any, where: str) -> Any:
    """``value`` as plain JSON types (numpy scalars become Python numbers)."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(
                    f"{where} has the key {k!r} ({type(k).__name__}); JSON keys are strings"
                )
            out[k] = _jsonable(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which JSON cannot hold; extra takes dicts, "
        "lists, str, int, float, bool and None (convert device arrays with float(x) or "
        "x.tolist())"
    )


def _is_ours(e: Exception) -> bool:
    return isinstance(e, CheckpointError)


def _whole(leaf: Any) -> Any:
    """A local array holding all of ``leaf`` (an addressable replica, or ``leaf`` itself
    for host arrays), or None when this process holds none."""
    if not isinstance(leaf, jax.Array):
        return leaf
    for shard in leaf.addressable_shards:
        if shard.data.shape == leaf.shape:
            return shard.data
    return None


def _move(value: Any, spec: Any, *, src: int, dst: int) -> np.ndarray | None:
    """``value`` (an array of ``spec``'s shape and dtype, real on process ``src``) sent to
    process ``dst``; the two processes call it together. Returns it on ``dst`` (as host
    memory), None on ``src``. Through ``jax.device_put``, or, with more than 2 processes on
    CPU (where JAX's CPU transfers cannot tell receivers apart), an XLA collective."""
    if _collective_transfers():
        from pdjax.pipeline.transport import Collective

        global _LINKS
        _LINKS = _LINKS or Collective()
        a, b = first_device(src), first_device(dst)
        if jax.process_index() == src:
            _LINKS._single(
                jax.device_put(value, a), a, b, spec.shape, spec.dtype, send=True
            ).block_until_ready()
            return None
        return np.asarray(_LINKS._single(None, a, b, spec.shape, spec.dtype, send=False))
    from_, to = (
        jax.sharding.SingleDeviceSharding(first_device(src)),
        jax.sharding.SingleDeviceSharding(first_device(dst)),
    )
    if jax.process_index() == src:
        jax.device_put(jax.device_put(value, from_), to).block_until_ready()
        return None
    remote = jax.make_array_from_single_device_arrays(spec.shape, from_, [], dtype=spec.dtype)
    return np.asarray(jax.device_put(remote, to))


_LINKS: Any = None  # the collective links of checkpoint transfers (made on first use)


def _collective_transfers() -> bool:
    if jax.process_count() <= 2:
        return False
    platform: str = jax.devices()[0].platform
    return platform == "cpu"


def _gather_to_0(arrays: Mapping[str, Any]) -> dict[str, Any]:
    """Several processes: every array in host memory on process 0 (empty elsewhere). Each
    comes from process 0 when it holds all of it, else from the first process that does.
    Every process calls it, with the same names in the same order."""
    names = list(arrays)
    whole = {n: _whole(arrays[n]) for n in names}
    has = np.array([whole[n] is not None for n in names], dtype=np.bool_)
    table = np.array(allgather_json(has.tolist()), dtype=np.bool_).reshape(-1, len(names))
    me = jax.process_index()
    out: dict[str, Any] = {}
    for j, name in enumerate(names):
        holders = np.flatnonzero(table[:, j])
        if holders.size == 0:
            raise CheckpointError(
                f"no process holds all of {name} (sharded across processes); pdjax "
                "checkpoints hold whole arrays: replicate it, or shard within one process"
            )
        src = int(holders[0])
        if src == 0:
            if me == 0:
                out[name] = np.asarray(whole[name])
        elif me in (0, src):
            got = _move(whole[name], arrays[name], src=src, dst=0)
            if me == 0:
                out[name] = got
    return out


def _shape_str(entry: Mapping[str, Any]) -> str:
    return f"{entry['dtype']}{list(entry['shape'])}"


class _Damage(Exception):
    """A step whose files are damaged (what is wrong, without the way out): the public
    methods turn it into a :class:`CheckpointError` that also lists the steps that verify."""


def _checksum(array: Any) -> str:
    """The checksum of an array's host bytes (C order), its dtype and its shape. CRC-32:
    any flipped bit or burst of up to 32 changes it, and it runs at memory speed."""
    data = np.ascontiguousarray(np.asarray(array))
    crc = zlib.crc32(f"{data.dtype.str}{list(data.shape)}".encode())
    # numpy declares ndarray a Buffer (__buffer__) only for Python >= 3.12
    crc = zlib.crc32(data.reshape(-1).view(np.uint8), crc)  # type: ignore[arg-type]
    return f"crc32:{crc:08x}"


def _check_folder(directory: Path) -> None:
    """Refuses a folder holding step-named entries that pdjax did not write: orbax would
    list them as steps, and the retention (``max_to_keep``) would delete them."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory} is a file, not a folder; give the Checkpointer an empty or new folder"
        )
    strangers = [
        entry.name
        for entry in sorted(directory.iterdir())
        if _STEP_NAME.fullmatch(entry.name) and not _is_pdjax_step(entry)
    ]
    if strangers:
        raise CheckpointError(
            f"{directory} holds {', '.join(repr(n) for n in strangers)}, named like "
            f"checkpoint steps but without pdjax's {'/'.join(_META_FILE)} file: not pdjax "
            "checkpoints, which a Checkpointer here would take for steps and delete to keep "
            "max_to_keep; pick an empty or new folder for the checkpoints (a step folder "
            "left by an interrupted pdjax save or cleanup may be deleted by hand)"
        )


def _is_pdjax_step(entry: Path) -> bool:
    """Whether a step-named entry is a pdjax step: it holds pdjax's metadata file, or,
    having lost it (damaged, or partly deleted), holds nothing but a step's own entries,
    so that restoring reports the damage and offers the intact steps."""
    if entry.joinpath(*_META_FILE).is_file():
        return True
    held = set(os.listdir(entry)) if entry.is_dir() else set()
    return bool(held) and held <= _STEP_ENTRIES


def _check_meta(meta: Any, file: Path, expect: tuple[str, tuple[str, ...]] | None) -> None:
    """Raises :class:`_Damage` naming ``file`` and the field, for metadata that a restore
    could not use (a missing field, a wrong type, an unknown dtype or PRNG key).
    ``expect``: the template's state type name and counters, which a step of that type
    must all hold (without a template, the counters it holds are checked)."""

    def bad(field: str, problem: str) -> None:
        raise _Damage(f"its metadata {file} {problem} (field {field!r})")

    if not isinstance(meta, Mapping):
        bad("<top level>", f"is a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != _FORMAT:
        bad("format", f"lacks pdjax's format tag {_FORMAT!r}: pdjax did not write it")
    version = meta.get("version")
    if version not in _READABLE_VERSIONS:
        raise CheckpointError(
            f"{file} has checkpoint format version {version!r}; this pdjax reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))}: restore it with the pdjax that "
            "wrote it (a newer one?)"
        )
    state = meta.get("state")
    if not (isinstance(state, str) and state.isidentifier()):
        bad("state", "names no state type (such as PipelineState or DPState)")
    ints = meta.get("ints")
    if not isinstance(ints, Mapping):
        bad("ints", "is missing or not an object")
    counters = list(ints)
    if expect is not None and expect[0] == state:
        counters += [name for name in expect[1] if name not in ints]
    for name in counters:
        value = ints.get(name)
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            bad(f"ints.{name}", "is missing or not an int (or a list of ints)")
    for field in ("arrays", "extra"):
        if not isinstance(meta.get(field), Mapping):
            bad(field, "is missing or not an object")
    layers = meta.get("stage_layers")
    if layers is not None and not (
        isinstance(layers, list) and all(isinstance(n, int) and n >= 0 for n in layers)
    ):
        bad("stage_layers", "is not a list of layer counts")
    for name, entry in meta["arrays"].items():
        problem = _entry_problem(entry, meta["arrays"], needs_checksum=version >= 3)
        if problem is not None:
            bad(f"arrays.{name}.{problem[0]}", problem[1])


def _entry_problem(
    entry: Any, arrays: Mapping[str, Any], *, needs_checksum: bool
) -> tuple[str, str] | None:
    """What is wrong with one array's manifest entry, as (its field, the problem)."""
    if not isinstance(entry, Mapping):
        return "", "is not an object"
    shape = entry.get("shape")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        return "shape", "is missing or not a list of sizes"
    try:
        dtype = np.dtype(entry.get("dtype"))
    except TypeError:
        return "dtype", f"is {entry.get('dtype')!r}, not a dtype"
    impl = entry.get("key_impl")
    if impl is not None:
        # jax leaves ShapeDtypeStruct.__init__ unannotated
        data = jax.ShapeDtypeStruct(tuple(shape), dtype)
        try:  # abstract: checks the name, and the key data's shape for it, allocating nothing
            jax.eval_shape(lambda d: jax.random.wrap_key_data(d, impl=str(impl)), data)
        except (TypeError, ValueError) as e:
            return "key_impl", f"is {impl!r}, not a PRNG key implementation for this data ({e})"
    first = entry.get("same_as")
    if first is not None:
        target = arrays.get(first) if isinstance(first, str) else None
        if not isinstance(target, Mapping) or "same_as" in target:
            return "same_as", f"names {first!r}, which is no stored array"
        if target.get("shape") != shape or target.get("dtype") != entry.get("dtype"):
            return "same_as", f"names {first!r}, of another shape or dtype"
    checksum = entry.get("checksum")
    if checksum is None and needs_checksum:
        return "checksum", "is missing"
    if checksum is not None and not re.fullmatch(r"crc32:[0-9a-f]{8}", str(checksum)):
        return "checksum", f"is {checksum!r}, not a crc32:<8 hex digits> checksum"
    return None


@contextlib.contextmanager
def _quiet_abandoned_reads() -> Iterator[None]:
    """Silences the reads orbax abandons when another read of the same restore fails: it
    drops their coroutines unfinished, and each, collected, prints its whole TensorStore
    spec to stderr as an "Exception ignored". Collects them here, so that a damaged step
    reports its one :class:`CheckpointError` (the caller collects them, with ``gc.collect``,
    once it has let go of the error); every other unraisable error still prints."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if getattr(unraisable.object, "__qualname__", "") == _ABANDONED_READ:
            return
        if _late_wakeup(unraisable):
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _late_wakeup(unraisable: Any) -> bool:
    """Whether ``unraisable`` is an abandoned read's TensorStore future finishing after
    orbax closed its event loop: TensorStore's own thread calls the dead loop's
    ``call_soon_threadsafe``, straight from native code (no Python caller), which raises
    "Event loop is closed". It can come at any time after the failed restore returned."""
    e = unraisable.exc_value
    if not isinstance(e, RuntimeError) or str(e) != "Event loop is closed":
        return False
    tb = e.__traceback__
    return tb is not None and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"


def _drop_late_wakeups() -> None:
    """Once a restore has abandoned reads, silences their late wake-ups (see
    :func:`_late_wakeup`) for the rest of the process: installed once, on top of the
    hook in place then; every other unraisable error still reaches it."""
    global _late_wakeups_dropped
    if _late_wakeups_dropped:
        return
    _late_wakeups_dropped = True
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _late_wakeup(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook


_late_wakeups_dropped = False


# The orbax coroutine (one array chunk's read) whose abandoned instances are silenced.
_ABANDONED_READ = "_read_array_index_and_device_put"


def _error_texts(e: BaseException) -> list[str]:
    """The messages of ``e`` and the exceptions it was raised from."""
    texts, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        texts.append(str(cur))
        cur = cur.__cause__ or cur.__context__
    return texts


def _failed_array(e: BaseException, names: Sequence[str]) -> str | None:
    """The array a TensorStore read error is about (its messages name the array's key in
    the OCDBT database, ``"<name>/<chunk>"``), if it is one of ``names``."""
    for text in _error_texts(e):
        for found in re.findall(r"Error reading \"([^\"]+)/[^/\"]*\"|'path': '([^']+)/'", text):
            name: str = found[0] or found[1]
            if name in names:
                return name
    return None


def _reason(e: BaseException) -> str:
    """One line on why a read failed: TensorStore's own status line when there is one
    (orbax wraps it in a dump of the whole TensorStore spec), else the first line."""
    texts = _error_texts(e)
    line = next((t for t in texts if re.match(r"[A-Z_]+: ", t)), texts[-1] or type(e).__name__)
    lines = line.split("See full TensorStore details")[0].strip().splitlines()
    line = lines[0] if lines else type(e).__name__
    return line if len(line) <= 300 else line[:297] + "..."


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
        saved_layers = list(meta["stage_layers"])
        mine = [len(p) for p in template.params]
        if pipeline is None:
            raise CheckpointError(
                f"{where} was saved under another plan (layers per stage {saved_layers}; "
                f"the template's {mine}): pass pipeline=<the template's Pipeline> to "
                "restore(...) to move it into this plan"
            )
        if self._multi:
            raise CheckpointError(
                f"{where} was saved under another plan; restoring into a different plan "
                "runs in one process: restore and save it there once, then resume"
            )
        if sum(saved_layers) != len(pipeline.layers):
            raise CheckpointError(
                f"{where} holds {sum(saved_layers)} layers, the pipeline's model has "
                f"{len(pipeline.layers)}: it is another model"
            )
        ints = meta["ints"]
        updates = list(ints["updates"])
        if len(set(updates)) != 1:
            raise CheckpointError(
                f"{where} has stages at different update counts {updates} (their weights "
                "are different versions), so it cannot be cut into other stages; restore "
                "it under its own plan"
            )
        saved: Mapping[str, Mapping[str, Any]] = meta["arrays"]
        sources = replan_names(pipeline, template, saved_layers, saved)
        wanted = _array_leaves(template)
        host = self._read_arrays(  # all of them, into host memory (orbax reads whole items)
            step,
            {n: np.empty(e["shape"], np.dtype(e["dtype"])) for n, e in saved.items()},
            saved,
        )
        leaves = []
        for name, leaf in wanted.items():
            names = sources[name]
            value = np.asarray(host[names[0]])
            for other in names[1:]:
                if not np.array_equal(value, np.asarray(host[other])):
                    raise CheckpointError(
                        f"{where}: {name} of the new plan would come from {names[0]} and "
                        f"{other}, which differ; the optimizer state of this optimizer "
                        "cannot be moved between plans"
                    )
            entry = saved[names[0]]
            mine = jax.eval_shape(jax.random.key_data, leaf) if _is_key(leaf) else leaf
            if list(entry["shape"]) != list(mine.shape) or entry["dtype"] != str(mine.dtype):
                raise CheckpointError(
                    f"{where}: {name} ({_shape_str({'shape': mine.shape, 'dtype': mine.dtype})}) "
                    f"would come from {names[0]} ({_shape_str(entry)}); the model or the "
                    "optimizer differ from the run that saved it"
                )
            sharding = getattr(leaf, "sharding", None)
            if isinstance(leaf, jax.Array) and not leaf.committed:
                array = jnp.asarray(value)
            else:
                array = jax.device_put(value, sharding)
            impl = entry.get("key_impl")
            leaves.append(array if impl is None else jax.random.wrap_key_data(array, impl=impl))
        ints = {**ints, "updates": [updates[0]] * len(template.params)}
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
