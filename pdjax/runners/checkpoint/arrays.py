"""A runner's state as the named arrays and the metadata a checkpoint stores, and back.

Each array is named by its path in the state (``params.1.0.dense.kernel``); a PRNG key is
stored as its key data. The manifest entry of each array (shape, dtype, key
implementation, checksum) and the counters and ``extra`` as JSON go into the step's
metadata (:mod:`.format`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.errors import CheckpointError
from pdjax.pipeline import PipelineState
from pdjax.runners.checkpoint.format import array_checksum, distinct_blocks
from pdjax.runners.protocol import ARRAY_FIELDS, RunnerState, counter_fields

State = TypeVar("State", bound=RunnerState)


def check_state(state: Any, what: str) -> None:
    """Refuses what is not a runner's state with its arrays in fields of their own."""
    if isinstance(state, RunnerState) and set(ARRAY_FIELDS) <= set(state._fields):
        return
    raise CheckpointError(
        f"{what} must be a PipelineState (from Pipeline.init/run/step) or a DPState (from "
        "DataParallel.init/step), or another runner's state (pdjax.runners.RunnerState: a "
        f"NamedTuple with the fields {', '.join(ARRAY_FIELDS)}), got {type(state).__name__}"
    )


# Not pdjax._trees.key_str: names stored in checkpoints, so a custom key is kept as str(key).
def path_name(path: tuple[Any, ...]) -> str:
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


def stage_layers(state: RunnerState) -> list[int] | None:
    """A pipeline state's layers per stage (the shape of its plan), else None."""
    if not isinstance(state, PipelineState):
        return None
    params: tuple[list[Any], ...] = state.params
    return [len(p) for p in params]


def array_leaves(state: RunnerState) -> dict[str, Any]:
    """The state's array leaves (or the template's abstract ones), keyed by path, in
    tree order; raises for a leaf that is not an array."""
    out: dict[str, Any] = {}
    cls = type(state)
    for field in state._fields:
        if field not in ARRAY_FIELDS:
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(state, field))[0]:
            name = path_name((jax.tree_util.GetAttrKey(field), *path))
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


def assemble(template: State, leaves: list[Any], ints: Mapping[str, Any]) -> State:
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
    return cast(State, cast(Any, template)._replace(**fields))


def counters(state: RunnerState) -> dict[str, Any]:
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
        out[field] = jsonable(value, field)
    return out


def state_manifest(state: RunnerState) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The arrays to save (a PRNG key as its key data) and their manifest entries (shape,
    dtype, key implementation), keyed by path."""
    arrays: dict[str, Any] = {}
    manifest: dict[str, dict[str, Any]] = {}
    for name, leaf in array_leaves(state).items():
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise CheckpointError(
                f"{name} has been deleted: the state was donated to a later step "
                "(DataParallel donates by default); save the newest state, before "
                "passing it on, or build the runner with donate=False"
            )
        entry: dict[str, Any] = {}
        if is_key(leaf):
            entry["key_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        entry.update(shape=list(np.shape(leaf)), dtype=str(leaf.dtype))
        arrays[name] = leaf
        manifest[name] = entry
    return arrays, manifest


def add_checksums(manifest: Mapping[str, dict[str, Any]], arrays: Mapping[str, Any]) -> None:
    """Adds each array's checksum to its manifest entry, from the host bytes orbax is
    given (on process 0, after the gather); an entry stored as another (``same_as``: equal
    bits, dtype and shape) gets that one's."""
    for name, entry in manifest.items():
        if name in arrays:
            entry["checksum"] = array_checksum(arrays[name])
    for entry in manifest.values():
        if "same_as" in entry:
            entry["checksum"] = manifest[entry["same_as"]]["checksum"]


def same_values(arrays: Mapping[str, Any]) -> dict[str, str]:
    """Parameters bit for bit equal to an earlier one (a tied parameter's copies, also any
    other equal arrays: storing them once loses nothing): name -> the first one's name.

    A sharded array is compared shard by shard (never gathered): its digest covers each
    distinct shard's place and bytes, so it equals another's only when both are split
    alike; equal values split differently are stored twice, which loses nothing."""
    groups: dict[Any, list[str]] = {}
    for name, a in arrays.items():
        if name.startswith("params.") and not is_key(a):
            groups.setdefault((tuple(np.shape(a)), str(a.dtype)), []).append(name)
    out: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        seen: dict[bytes, str] = {}
        for name in names:
            first = seen.setdefault(_digest(arrays[name]), name)
            if first != name and same_bits(arrays[first], arrays[name]):
                out[name] = first
    return out


def _pieces(a: Any) -> list[tuple[Any, Any]]:
    """``a`` as (place, piece) pairs, each piece fetched to host memory only when read:
    a sharded array's distinct shards, anything else whole."""
    blocks = distinct_blocks(a)
    if blocks is None:
        return [(None, a)]
    return [((start, tuple(shard.data.shape)), shard.data) for start, shard in blocks]


def _host_bytes(piece: Any) -> np.ndarray:
    data = np.ascontiguousarray(np.asarray(piece))
    return data.reshape(-1).view(np.uint8)


def _digest(a: Any) -> bytes:
    """SHA-256 of ``a``'s pieces (:func:`_pieces`): their places and bytes."""
    digest = hashlib.sha256()
    for place, piece in _pieces(a):
        digest.update(repr(place).encode())
        # numpy declares ndarray a Buffer (__buffer__) only for Python >= 3.12
        digest.update(_host_bytes(piece))  # type: ignore[arg-type]
    return digest.digest()


def same_bits(a: Any, b: Any, *, gather: bool = False) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes, compared piece by piece (a sharded
    array shard by shard, never gathered). Arrays split differently count as different,
    unless ``gather``: then they are compared whole in host memory."""
    if np.shape(a) != np.shape(b) or np.dtype(a.dtype) != np.dtype(b.dtype):
        return False
    pa, pb = _pieces(a), _pieces(b)
    if [p for p, _ in pa] != [p for p, _ in pb]:
        if not gather:
            return False
        pa, pb = [(None, a)], [(None, b)]
    return all(
        np.array_equal(_host_bytes(x), _host_bytes(y))
        for (_, x), (_, y) in zip(pa, pb, strict=True)
    )


@jax.jit
def _copy(array: jax.Array) -> jax.Array:
    return jnp.copy(array)


def own_copy(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``value`` on ``sharding`` in buffers of its own, shared with nothing: the runners
    donate the arrays of the states they are given, so two leaves of a state must not
    share one (``jax.device_put`` returns an array already on ``sharding`` itself).
    Moved device to device, never through one host array."""
    array: jax.Array = _copy(jax.device_put(value, sharding))
    if not array.sharding.is_equivalent_to(sharding, array.ndim):
        array = jax.device_put(array, sharding)
    return array


def is_key(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def jsonable(value: Any, where: str) -> Any:
    """``value`` as plain JSON types (numpy scalars become Python numbers)."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(
                    f"{where} has the key {k!r} ({type(k).__name__}); JSON keys are strings"
                )
            out[k] = jsonable(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which JSON cannot hold; extra takes dicts, "
        "lists, str, int, float, bool and None (convert device arrays with float(x) or "
        "x.tolist())"
    )
