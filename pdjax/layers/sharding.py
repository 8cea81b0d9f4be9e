"""Sharding inside a stage: a stage's devices as a mesh, and each parameter's place on it.

A stage (or a :class:`~pdjax.runners.dp.DataParallel` run) whose devices form a mesh with
axes beyond ``data`` is *sharded*: its weights, optimizer state and every stashed weight
version are split over the mesh as the model's own annotations say, its batch is split
over ``data`` and ``fsdp``, and its programs are compiled with those shardings so that
XLA's SPMD partitioner inserts the gathers, reduce-scatters and all-reduces (pdjax writes
no collective inside a stage).

Axes. :data:`AXES` are the default names, ``data`` (replicas of the weights, each on its
rows of the batch), ``fsdp`` (the batch split as ``data``, the weights too: ZeRO-3) and
``tensor`` (the weights split within each layer, Megatron-style); a model's rules may name
any others. A mesh is written outermost first; the last axis runs over neighbouring
devices of the plan's device list, which follows the topology, so ``tensor`` (placed last)
sits on the fastest level.

Where each parameter goes, first match wins:

1. ``ShardingRules.spec_fn(path, leaf)``, a :class:`~jax.sharding.PartitionSpec` of mesh
   axes (``None``: go on to the annotations);
2. the parameter's logical axis names: linen's ``nn.with_logical_partitioning`` boxes (or
   ``nn.with_partitioning``, whose names are mesh axes), or an nnx variable's
   ``out_sharding`` metadata (``nnx.with_partitioning``), each name mapped to mesh axes by
   :attr:`ShardingRules.rules` (MaxText-style pairs such as ``("embed", "fsdp")``; the
   first rule whose mesh axes are all in the mesh and unused by the leaf's other
   dimensions wins; a rule's mesh axis may be ``None``: replicated);
3. unannotated: replicated, or with ``fsdp="auto"`` split over ``fsdp`` along its largest
   dimension that ``fsdp`` divides (ZeRO-3).

Optimizer state leaves take the sharding of the parameter whose path ends theirs and whose
shape they have (Adam's moments); other leaves (step counts, scalars, factored
statistics) are replicated.

A mesh as plain data (``((axis, size), ...)``, :func:`mesh_axes`, :func:`parse_mesh`) is
:mod:`pdjax.mesh`'s, re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from flax.core import meta
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdjax.errors import PipelineError
from pdjax.layers.tied import unboxed
from pdjax.mesh import (
    AXES,
    MeshAxes,
    MeshError,
    describe_mesh,
    is_sharded,
    mesh_axes,
    mesh_size,
    parse_mesh,
)

__all__ = [
    "AXES",
    "DEFAULT_RULES",
    "MeshAxes",
    "MeshError",
    "ShardingError",
    "ShardingRules",
    "StageSharding",
    "describe_mesh",
    "is_sharded",
    "make_mesh",
    "mesh_axes",
    "mesh_size",
    "parse_mesh",
]

#: Logical-axis rules in MaxText's style: the batch over ``data`` and ``fsdp``, embedding
#: dimensions over ``fsdp``, heads, MLP and vocabulary dimensions over ``tensor``, norms
#: replicated. The names are the Llama family's (:mod:`pdjax.models.llama`).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("norm", None),
)


class ShardingError(PipelineError, ValueError):
    """A rule or annotation pdjax cannot shard a stage by (before any compile)."""


def make_mesh(devices: Sequence[jax.Device], axes: MeshAxes, names: Iterable[str] = ()) -> Mesh:
    """The :class:`~jax.sharding.Mesh` of ``devices`` (in order) with ``axes``, the last
    axis over neighbouring devices; every name of :data:`AXES` and ``names`` that
    ``axes`` lacks is added with size 1, so rules that name it resolve.

    Raises:
      MeshError: if the mesh's size is not the number of devices.
    """
    if mesh_size(axes) != len(devices):
        raise MeshError(
            f"mesh {describe_mesh(axes)} spans {mesh_size(axes)} devices, the stage has "
            f"{len(devices)}: the sizes must multiply to the stage's device count"
        )
    have = [n for n, _ in axes]
    extra = [n for n in (*AXES, *names) if n not in have]
    extra = list(dict.fromkeys(extra))
    shape = [s for _, s in axes] + [1] * len(extra)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), (*have, *extra))


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """How a model's parameters map onto a stage's mesh (see the module docstring).

    Args:
      rules: ``(logical name, mesh axis | tuple of mesh axes | None)`` pairs, first
        match wins; ``"batch"`` names the axes the batch is split over.
      fsdp: ``"auto"`` splits each unannotated parameter over ``fsdp`` along its largest
        dimension ``fsdp`` divides; ``None`` keeps unannotated parameters replicated.
      spec_fn: ``(path, leaf) -> PartitionSpec | None`` of mesh axes, asked first for
        every parameter (``path``: the layer's name, then the keys within its
        parameters; ``leaf``: its shape and dtype).
      warn_bytes: a parameter at least this large left replicated on a sharded stage
        warns, with its bytes.
    """

    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = DEFAULT_RULES
    fsdp: str | None = None
    spec_fn: Callable[[tuple[str, ...], Any], Any] | None = None
    warn_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        rules = tuple(tuple(r) for r in self.rules)
        for r in rules:
            ok = len(r) == 2 and isinstance(r[0], str)
            target = r[1] if ok else None
            targets = target if isinstance(target, tuple) else (target,)
            if not ok or not all(t is None or isinstance(t, str) for t in targets):
                raise ShardingError(
                    f"a rule is (logical name, mesh axis | (mesh axes...) | None), got {r!r}"
                )
        object.__setattr__(self, "rules", rules)
        if self.fsdp not in (None, "auto"):
            raise ShardingError(f"fsdp must be None or 'auto', got {self.fsdp!r}")

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Every mesh axis the rules name."""
        names: list[str] = []
        for _, target in self.rules:
            for t in target if isinstance(target, tuple) else (target,):
                if t is not None and t not in names:
                    names.append(t)
        return tuple(names)

    def batch_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """The mesh axes a batch is split over: the ``"batch"`` rule's (``data`` and
        ``fsdp`` by default), those the mesh has."""
        for name, target in self.rules:
            if name == "batch":
                axes = target if isinstance(target, tuple) else (target,)
                return tuple(a for a in axes if a is not None and a in mesh.axis_names)
        return tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)

    def mesh_spec(self, names: Sequence[str | None], mesh: Mesh, where: str) -> P:
        """The mesh :class:`PartitionSpec` of a leaf's logical names."""
        used: set[str] = set()
        out: list[Any] = []
        for name in names:
            if name is None:
                out.append(None)
                continue
            candidates = [t for n, t in self.rules if n == name]
            if not candidates:
                if name in mesh.axis_names:  # nn.with_partitioning names mesh axes itself
                    candidates = [name]
                else:
                    raise ShardingError(
                        f"{where}: logical axis {name!r} has no rule and is no mesh axis "
                        f"({', '.join(mesh.axis_names)}); add a rule ({name!r}, mesh axis "
                        "or None) to ShardingRules.rules"
                    )
            chosen: Any = None
            for target in candidates:
                axes = target if isinstance(target, tuple) else (target,)
                if target is None:
                    break
                missing = [a for a in axes if a not in mesh.axis_names]
                if missing:
                    raise ShardingError(
                        f"{where}: logical axis {name!r} maps to mesh axis {missing[0]!r}, "
                        f"which the stage's mesh ({', '.join(mesh.axis_names)}) lacks; name "
                        "it in the mesh or change the rule"
                    )
                named = {a for a in axes if a is not None}
                if not used & named:
                    chosen = target
                    used |= named
                    break
            out.append(chosen)
        return P(*out)


def _path_names(path: Sequence[Any]) -> tuple[str, ...]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def _metadata_names(var: Any) -> tuple[str | None, ...] | None:
    md = var.get_metadata() if hasattr(var, "get_metadata") else {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = md.get(key)
        if names is not None:
            return tuple(names)
    return None


def layer_axes(layer: Any) -> dict[tuple[str, ...], tuple[str | None, ...]]:
    """The logical names a layer's parameters declare, by their path within the layer's
    ``"params"``: an nnx layer's (its variables' metadata), a :func:`pdjax.split_model`
    layer's (the model's boxes or variables); empty for other layers (a linen layer's
    names ride in its values, as boxes)."""
    inner = getattr(layer, "layer", None)  # PrecisionLayer
    if inner is not None and not hasattr(layer, "_template"):
        return layer_axes(inner)
    from flax import nnx

    template = getattr(layer, "_template", None)
    out: dict[tuple[str, ...], tuple[str | None, ...]] = {}
    if template is not None:
        for path, var in nnx.to_flat_state(template):
            names = _metadata_names(var)
            if names is not None and isinstance(var, nnx.Param):
                out[tuple(map(str, path))] = names
        return out
    splitter = getattr(layer, "splitter", None)
    var_spec = getattr(splitter, "var_spec", None)  # a split linen model's init, abstract
    if var_spec is not None:
        for path, node in jax.tree_util.tree_flatten_with_path(var_spec, is_leaf=_is_box)[0]:
            keys = _path_names(path)
            if _is_box(node) and keys and keys[0] == "params":
                names = tuple(getattr(node, "names", ()) or ())
                # the layers hold a box's value under the box's own keys (e.g. "value")
                for sub, _ in jax.tree_util.tree_flatten_with_path(node)[0]:
                    out[(*keys[1:], *_path_names(sub))] = names
        return out
    entries = getattr(splitter, "entries", None)
    if entries:
        for _, lp, var in entries:
            names = _metadata_names(var)
            if names is not None and lp and lp[0] == "params":
                out[tuple(lp[1:])] = names
    return out


def _is_box(node: Any) -> bool:
    return isinstance(node, meta.AxisMetadata)


def _leaf_shape(node: Any) -> tuple[tuple[int, ...], Any]:
    value = unboxed(node)  # no sharding constraint applied
    leaves = jax.tree.leaves(value)
    leaf = leaves[0] if leaves else value
    return tuple(np.shape(leaf)), getattr(leaf, "dtype", np.dtype("float32"))


@dataclasses.dataclass
class LeafPlace:
    """Where one parameter went: its path, shape, bytes and mesh spec."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    nbytes: int
    spec: P

    @property
    def replicated(self) -> bool:
        return all(a is None for a in self.spec)


class StageSharding:
    """One sharded stage's placement of its parameters and optimizer state on ``mesh``.

    Built from the stage's layers and (abstract) parameters by :meth:`resolve`, which
    checks every annotation, divisibility and the mesh before anything compiles.
    """

    def __init__(self, mesh: Mesh, rules: ShardingRules) -> None:
        self.mesh = mesh
        self.rules = rules
        self.replicated = NamedSharding(mesh, P())
        batch = rules.batch_axes(mesh)
        self.batch = NamedSharding(mesh, P(batch if len(batch) != 1 else batch[0]))
        #: the number of row blocks a batch is split into
        self.batch_ways = math.prod(mesh.shape[a] for a in batch)
        self.params: list[Any] = []  # per layer: a prefix tree of NamedSharding
        self.leaves: list[LeafPlace] = []
        self._by_path: dict[tuple[Any, ...], tuple[tuple[int, ...], NamedSharding]] = {}

    def resolve(self, layers: Sequence[Any], params: Sequence[Any], where: str) -> StageSharding:
        """Decides every parameter's sharding (see the module docstring).

        Raises:
          ShardingError: an unknown logical axis or a mesh axis the mesh lacks (naming the
            leaf and the axis), a dimension its mesh axes do not divide (the leaf's path,
            the dimension, its size, the axes' size), tensor > 1 on a stage none of whose
            parameters is annotated.
        """
        rules, mesh = self.rules, self.mesh
        annotated = False
        self.params, self.leaves, self._by_path = [], [], {}
        for j, (layer, p) in enumerate(zip(layers, params, strict=True)):
            named = layer_axes(layer)
            flat, treedef = jax.tree_util.tree_flatten_with_path(p, is_leaf=_is_box)
            shardings = []
            for path, node in flat:
                keys = _path_names(path)
                shape, dtype = _leaf_shape(node)
                leaf_where = f"{where} parameter {'/'.join((layer.name, *keys))}"
                spec = None
                if rules.spec_fn is not None:
                    spec = rules.spec_fn((layer.name, *keys), jax.ShapeDtypeStruct(shape, dtype))
                    annotated = annotated or spec is not None
                    for axis in _spec_axes(spec):
                        if axis not in mesh.axis_names:
                            raise ShardingError(
                                f"{leaf_where}: spec_fn names mesh axis {axis!r}, which the "
                                f"stage's mesh ({', '.join(mesh.axis_names)}) lacks"
                            )
                if spec is None:
                    names: Any = None
                    if _is_box(node):
                        names = tuple(getattr(node, "names", ()) or ())
                    elif keys in named:
                        names = named[keys]
                    if names is not None:
                        annotated = True
                        if len(names) != len(shape):
                            raise ShardingError(
                                f"{leaf_where}: {len(names)} axis names {names} for a leaf of "
                                f"shape {shape}: name every dimension (None: not split)"
                            )
                        spec = rules.mesh_spec(names, mesh, leaf_where)
                    elif rules.fsdp == "auto":
                        spec = _auto_fsdp(shape, mesh.shape.get("fsdp", 1))
                    else:
                        spec = P()
                _check_divisible(spec, shape, mesh, leaf_where)
                sharding = NamedSharding(mesh, spec)
                shardings.append(sharding)
                nbytes = math.prod(shape) * np.dtype(dtype).itemsize
                self.leaves.append(LeafPlace((layer.name, *keys), shape, nbytes, spec))
                full = (jax.tree_util.SequenceKey(j), *path)
                for sub, _ in jax.tree_util.tree_flatten_with_path(node)[0]:
                    self._by_path[(*full, *sub)] = (shape, sharding)
            self.params.append(jax.tree_util.tree_unflatten(treedef, shardings))
        tensor = mesh.shape.get("tensor", 1)
        if tensor > 1 and not annotated:
            raise ShardingError(
                f"{where} has tensor {tensor} but none of its parameters is annotated, so "
                "tensor parallelism would split nothing: annotate the model "
                "(nn.with_logical_partitioning, nnx.with_partitioning) or pass "
                "ShardingRules(spec_fn=...), or use fsdp with ShardingRules(fsdp='auto')"
            )
        used = set(rules.batch_axes(mesh)) | {
            a for leaf in self.leaves for a in _spec_axes(leaf.spec)
        }
        for axis, size in mesh.shape.items():
            if size > 1 and axis not in used:
                raise ShardingError(
                    f"{where}: mesh axis {axis!r} (size {size}) splits neither the batch nor "
                    "any parameter, so its devices would repeat each other's work; map a "
                    f"logical axis to it in ShardingRules.rules, or leave it out of the mesh"
                )
        for leaf in self.leaves:
            if leaf.replicated and leaf.nbytes >= rules.warn_bytes:
                warnings.warn(
                    f"{where}: parameter {'/'.join(leaf.path)} ({leaf.nbytes:,} bytes) "
                    "stays replicated on every device of the sharded stage; annotate it or "
                    "pass ShardingRules(fsdp='auto')",
                    stacklevel=3,
                )
        return self

    def like_params(self, tree: Any, offset: tuple[Any, ...] = ()) -> Any:
        """Shardings for ``tree`` (optimizer state, gradients): each leaf takes the
        sharding of the parameter whose path ends its path (after ``offset``) and whose
        shape it has, else replicated."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        out = []
        for path, leaf in flat:
            full = (*offset, *path)
            sharding = self.replicated
            for start in range(len(full)):
                hit = self._by_path.get(tuple(full[start:]))
                if hit is not None and hit[0] == tuple(np.shape(leaf)):
                    sharding = hit[1]
                    break
            out.append(sharding)
        return jax.tree_util.tree_unflatten(treedef, out)

    def per_device_bytes(self) -> tuple[int, int]:
        """``(sharded parameters' bytes per device, replicated parameters' bytes)``."""
        sharded = replicated = 0
        for leaf in self.leaves:
            if leaf.replicated:
                replicated += leaf.nbytes
            else:
                ways = math.prod(
                    self.mesh.shape[a]
                    for axis in leaf.spec
                    if axis is not None
                    for a in (axis if isinstance(axis, tuple) else (axis,))
                )
                sharded += leaf.nbytes // ways
        return sharded, replicated


def _spec_axes(spec: Any) -> list[str]:
    if spec is None:
        return []
    out = []
    for axis in spec:
        for a in axis if isinstance(axis, tuple) else (axis,):
            if a is not None:
                out.append(a)
    return out


def _auto_fsdp(shape: tuple[int, ...], ways: int) -> P:
    """ZeRO-3: the largest dimension ``ways`` divides, over ``fsdp`` (else replicated)."""
    if ways <= 1:
        return P()
    dims = [d for d in range(len(shape)) if shape[d] % ways == 0 and shape[d] >= ways]
    if not dims:
        return P()
    best = max(dims, key=lambda d: (shape[d], -d))
    return P(*[("fsdp" if d == best else None) for d in range(len(shape))])


def _check_divisible(spec: P, shape: tuple[int, ...], mesh: Mesh, where: str) -> None:
    if len(spec) > len(shape):
        raise ShardingError(f"{where}: spec {spec} has more entries than the leaf's shape {shape}")
    for d, axis in enumerate(spec):
        if axis is None:
            continue
        axes = axis if isinstance(axis, tuple) else (axis,)
        ways = math.prod(mesh.shape[a] for a in axes)
        if shape[d] % ways:
            raise ShardingError(
                f"{where}: dimension {d} has size {shape[d]}, which mesh axis "
                f"{'x'.join(axes)} (size {ways}) does not divide; change the mesh, the rule "
                "or the model's size"
            )
