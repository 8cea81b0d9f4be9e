"""What a layer costs on a mesh, read from XLA itself: :func:`profile_sharded`.

For each layer and each candidate mesh (``((axis, size), ...)``, :mod:`pdjax.mesh`), the
layer's forward and its backward (weight and input gradients) are compiled as a sharded
stage runs them: parameters on the shardings the model's annotations give
(:mod:`pdjax.layers.sharding`), the batch split over ``data`` and ``fsdp``, the weight
gradients pinned to their parameters' shardings. Nothing is allocated: the programs are
lowered from shapes, so a layer too large for any device here is profiled as well.

Read from each compiled program, per device: the FLOPs and bytes accessed of XLA's cost
analysis, the temporary bytes of its memory analysis, and every collective XLA's
partitioner inserted (:class:`Collective`: its kind, the bytes of its result, and the
mesh axes its device groups span), from the compiled HLO. Identical layers (the same
module, the same shapes, as the profiler compares them) share one compile
per mesh, so a model of 32 identical blocks costs a handful of compiles.

Compiling for a mesh of ``n`` devices needs ``n`` devices of the platform the costs are
for; on CPU, ``jax_num_cpu_devices`` provides them. The costs are XLA's counts for the
programs as compiled here (a CPU's fusion decisions, not an accelerator's); turning
them into seconds on an absent accelerator is the cost model's job.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pdjax.errors import ProfileError
from pdjax.layers import LayerSequence, PyTree
from pdjax.layers.sharding import ShardingRules, StageSharding, make_mesh
from pdjax.mesh import MeshAxes, describe_mesh, mesh_axes, mesh_size
from pdjax.profile.programs import cost_analysis, reuse_key

__all__ = [
    "COLLECTIVES",
    "Collective",
    "ShardedCost",
    "collectives_of",
    "profile_sharded",
    "profile_units",
    "rules_for",
]

#: The HLO collectives read (an asynchronous ``-start`` counts as its collective).
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_OP = re.compile(
    r"=\s*(?P<type>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\("
)
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective XLA inserted into a layer's program.

    Attributes:
      kind: ``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all`` or
        ``collective-permute``.
      nbytes: bytes of its result on one device.
      axes: the mesh axes its device groups span (the devices of a group differ along
        these axes only).
    """

    kind: str
    nbytes: int
    axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ShardedCost:
    """One layer's per-device costs on one mesh (see the module docstring).

    Attributes:
      index, name: the layer's position and name in the model.
      mesh: the mesh, ``((axis, size), ...)``.
      forward_flops, backward_flops: FLOPs per device of the forward and of the backward
        alone (weight and input gradients): the backward program, which runs the forward
        again to reach its residuals, less the forward's.
      forward_bytes, backward_bytes: bytes accessed per device (XLA's cost analysis), the
        backward's likewise less the forward's.
      temp_bytes: the larger of the two programs' temporary bytes per device.
      param_bytes: the layer's parameter bytes one device holds.
      replicated_param_bytes: of those, the bytes of parameters left whole on every device.
      forward_collectives, backward_collectives: what XLA's partitioner inserted (the
        backward's less one of each the forward has: its replay of the forward).
      shared_with: the index of the earlier layer whose programs this one reuses (None:
        compiled for it).
    """

    index: int
    name: str
    mesh: MeshAxes
    forward_flops: float
    backward_flops: float
    forward_bytes: float
    backward_bytes: float
    temp_bytes: int
    param_bytes: int
    replicated_param_bytes: int
    forward_collectives: tuple[Collective, ...]
    backward_collectives: tuple[Collective, ...]
    shared_with: int | None = None

    def collective_bytes(self, axis: str | None = None) -> int:
        """Bytes of every collective (or of those over ``axis``) per device and step."""
        return sum(
            c.nbytes
            for c in (*self.forward_collectives, *self.backward_collectives)
            if axis is None or axis in c.axes
        )


def _type_bytes(text: str) -> int:
    """Bytes of an HLO result type: the largest array of a tuple (an asynchronous
    collective's ``(operand, result)``), else the array."""
    sizes = [
        math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES.get(dtype, 4)
        for dtype, dims in _ARRAY.findall(text)
    ]
    return max(sizes, default=0)


def _groups(line: str, n: int) -> list[list[int]]:
    """The device groups of a collective's HLO line (partition ids ``0 .. n-1``)."""
    m = _GROUPS_IOTA.search(line)
    if m is not None:
        shape = [int(v) for v in m.group(1).split(",")]
        dims = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return [list(map(int, g)) for g in ids.reshape(shape)]
    m = _GROUPS_LIST.search(line)
    if m is not None and m.group(1):
        groups = re.findall(r"\{([0-9,]*)\}", m.group(1))
        return [[int(v) for v in g.split(",") if v] for g in groups]
    m = _PAIRS.search(line)
    if m is not None:
        return [[int(a), int(b)] for a, b in re.findall(r"\{([0-9]+),([0-9]+)\}", m.group(1))]
    return [list(range(n))]  # no groups: every device


def _axes(groups: list[list[int]], mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which the members of a group differ."""
    shape = tuple(mesh.devices.shape)
    coords = [np.unravel_index(np.asarray(g, dtype=np.int64), shape) for g in groups if g]
    return tuple(
        name
        for k, name in enumerate(mesh.axis_names)
        if shape[k] > 1 and any(len(set(c[k].tolist())) > 1 for c in coords)
    )


def collectives_of(hlo: str, mesh: Mesh) -> tuple[Collective, ...]:
    """The collectives of a compiled program's HLO text (``compiled.as_text()``), with the
    mesh axes their device groups span (partition ``i`` is ``mesh.devices.flat[i]``)."""
    out = []
    n = mesh.devices.size
    for line in hlo.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        groups = _groups(line, n)
        out.append(Collective(m.group("op"), _type_bytes(m.group("type")), _axes(groups, mesh)))
    return tuple(out)


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


def _rows(spec: PyTree, layout: StageSharding) -> PyTree:
    """Shardings for a batch: its leaves split by rows over the batch axes where they
    divide, else whole on every device."""
    ways = layout.batch_ways

    def one(a: Any) -> NamedSharding:
        if ways > 1 and np.ndim(a) and np.shape(a)[0] % ways == 0:
            return layout.batch
        return layout.replicated

    return jax.tree.map(one, spec)


def _float_leaf(a: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(a), jnp.inexact))


def profile_sharded(
    layers: LayerSequence,
    sample: PyTree,
    meshes: Sequence[MeshAxes | dict[str, int]],
    *,
    rules: ShardingRules | None = None,
    devices: Sequence[jax.Device] | None = None,
    train: bool = True,
) -> list[list[ShardedCost]]:
    """Every layer's costs on every mesh: ``costs[i][k]`` is layer ``i`` on
    ``meshes[k]`` (see the module docstring).

    Args:
      layers: the model's layers.
      sample: one microbatch of input (arrays or ``jax.ShapeDtypeStruct``): its rows are
        what a stage on each mesh takes, split over the mesh's batch axes.
      meshes: the candidate meshes, each ``((axis, size), ...)`` or a dict.
      rules: how parameters map onto a mesh (default ``ShardingRules()``).
      devices: the devices to compile for (default ``jax.devices()``): the first
        ``size`` of them make a mesh of that size.
      train: profile the training-mode forward (dropout on).

    Raises:
      ProfileError: a mesh larger than the devices given, before anything compiles; a
        mesh or annotation the sharding cannot place (its
        :class:`~pdjax.layers.sharding.ShardingError`, naming the layer).
    """
    rules = rules if rules is not None else ShardingRules()
    devices = list(jax.devices() if devices is None else devices)
    axes_list = [mesh_axes(m.items() if isinstance(m, dict) else m) for m in meshes]
    for axes in axes_list:
        if mesh_size(axes) > len(devices):
            raise ProfileError(
                f"mesh {describe_mesh(axes)} spans {mesh_size(axes)} devices and only "
                f"{len(devices)} are given; on CPU set jax_num_cpu_devices (or XLA_FLAGS "
                "--xla_force_host_platform_device_count) before JAX starts"
            )
    key = jax.random.key(0)
    x_spec = _abstract(sample)
    shapes = []  # per layer: (params, rest, x, y) as shapes
    for i, layer in enumerate(layers.layers):
        variables = jax.eval_shape(layer.init, jax.random.fold_in(key, i), x_spec)
        params = variables.get("params", {})
        rest = {k: v for k, v in variables.items() if k != "params"}
        y_spec = jax.eval_shape(
            lambda v, x, layer=layer: layer.apply(v, x, train=train, rng=key)[0], variables, x_spec
        )
        shapes.append((params, rest, x_spec, y_spec))
        x_spec = y_spec
    out: list[list[ShardedCost]] = [[] for _ in layers.layers]
    for axes in axes_list:
        mesh = make_mesh(devices[: mesh_size(axes)], axes, rules.axis_names)
        done: list[tuple[Any, ShardedCost]] = []
        for i, layer in enumerate(layers.layers):
            params, rest, x, y = shapes[i]
            reuse = reuse_key(layer, train, True, (params, rest, x))
            found = next((c for k, c in done if reuse is not None and _equal(k, reuse)), None)
            if found is not None:
                out[i].append(
                    dataclasses.replace(found, index=i, name=layer.name, shared_with=found.index)
                )
                continue
            cost = _layer_cost(layer, i, params, rest, x, y, mesh, axes, rules, train, key)
            done.append((reuse, cost))
            out[i].append(cost)
    return out


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a key whose parts do not compare
        return False


def _layer_cost(
    layer: Any,
    i: int,
    params: PyTree,
    rest: PyTree,
    x: PyTree,
    y: PyTree,
    mesh: Mesh,
    axes: MeshAxes,
    rules: ShardingRules,
    train: bool,
    key: jax.Array,
) -> ShardedCost:
    layout = StageSharding(mesh, rules)
    try:
        layout.resolve([layer], [params], f"layer {i} ({layer.name}) on {describe_mesh(axes)}")
    except ValueError as e:
        raise ProfileError(str(e)) from e
    p_sh = layout.params[0]
    rep = layout.replicated
    rest_sh = jax.tree.map(lambda _: rep, rest)
    x_sh, y_sh = _rows(x, layout), _rows(y, layout)
    rng = jax.random.fold_in(key, i)

    def apply(p: PyTree, r: PyTree, x: PyTree) -> PyTree:
        out = layer.apply({**r, "params": p}, x, train=train, rng=rng)[0]
        return jax.lax.with_sharding_constraint(out, y_sh)

    def backward(p: PyTree, r: PyTree, x: PyTree, ct: PyTree) -> PyTree:
        _, pullback = jax.vjp(lambda p, x: apply(p, r, x), p, x)
        gp, gx = pullback(ct)
        return jax.lax.with_sharding_constraint(gp, p_sh), gx

    ct = jax.tree.map(
        lambda a: a if _float_leaf(a) else jax.ShapeDtypeStruct(np.shape(a), jax.dtypes.float0),
        y,
    )
    fwd = jax.jit(apply, in_shardings=(p_sh, rest_sh, x_sh)).lower(params, rest, x).compile()
    bwd = (
        jax.jit(backward, in_shardings=(p_sh, rest_sh, x_sh, y_sh))
        .lower(params, rest, x, ct)
        .compile()
    )
    f, b = cost_analysis(fwd), cost_analysis(bwd)
    sharded, whole = layout.per_device_bytes()
    temp = 0
    for compiled in (fwd, bwd):
        memory = compiled.memory_analysis()
        temp = max(temp, int(getattr(memory, "temp_size_in_bytes", 0) or 0))
    # the backward program runs the forward again to reach its residuals: its own share is
    # the difference (as LayerProfile's backward is forward+backward minus forward)
    forward_collectives = collectives_of(fwd.as_text() or "", mesh)
    backward_collectives = _without(collectives_of(bwd.as_text() or "", mesh), forward_collectives)
    ff, fb = float(f.get("flops", 0.0)), float(f.get("bytes accessed", 0.0))
    return ShardedCost(
        index=i,
        name=layer.name,
        mesh=axes,
        forward_flops=ff,
        backward_flops=max(float(b.get("flops", 0.0)) - ff, 0.0),
        forward_bytes=fb,
        backward_bytes=max(float(b.get("bytes accessed", 0.0)) - fb, 0.0),
        temp_bytes=temp,
        param_bytes=sharded + whole,
        replicated_param_bytes=whole,
        forward_collectives=forward_collectives,
        backward_collectives=backward_collectives,
    )


def _without(
    collectives: tuple[Collective, ...], forward: tuple[Collective, ...]
) -> tuple[Collective, ...]:
    """``collectives`` less one of each of ``forward``'s (the backward program's replay of
    the forward), where present."""
    rest = list(collectives)
    for c in forward:
        if c in rest:
            rest.remove(c)
    return tuple(rest)


def _annotated(layers: LayerSequence, sample: PyTree) -> bool:
    """Whether any layer's parameters declare logical axis names (nnx metadata,
    :func:`pdjax.split_model`'s, or linen boxes in the initial variables)."""
    from flax import linen as nn

    from pdjax.layers.sharding import layer_axes

    if any(layer_axes(layer) for layer in layers.layers):
        return True
    x = _abstract(sample)
    key = jax.random.key(0)
    for layer in layers.layers:
        variables = jax.eval_shape(layer.init, key, x)
        boxed = jax.tree.leaves(variables, is_leaf=lambda v: isinstance(v, nn.Partitioned))
        if any(isinstance(v, nn.Partitioned) for v in boxed):
            return True
        x = jax.eval_shape(
            lambda v, x, layer=layer: layer.apply(v, x, train=True, rng=key)[0], variables, x
        )
    return False


def rules_for(
    layers: LayerSequence, sample: PyTree, rules: ShardingRules | None = None
) -> tuple[ShardingRules, bool]:
    """The rules to place ``layers`` by, and whether they can split a parameter over
    ``tensor``: the model's annotations (or the caller's ``spec_fn``) can; without them
    only ``fsdp="auto"`` splits parameters. ``rules`` None: the default rules for an
    annotated model, ``fsdp="auto"`` for another."""
    annotated = _annotated(layers, sample) or (rules is not None and rules.spec_fn is not None)
    if rules is None:
        rules = ShardingRules() if annotated else ShardingRules(fsdp="auto")
    return rules, annotated


def _rows_of(sample: PyTree) -> int:
    sizes = {int(np.shape(a)[0]) for a in jax.tree.leaves(sample) if np.ndim(a)}
    if len(sizes) != 1:
        raise ProfileError(f"the sample's leaves disagree on their rows ({sorted(sizes)})")
    return sizes.pop()


def _with_rows(sample: PyTree, rows: int) -> PyTree:
    """``sample``'s shapes with ``rows`` rows (abstract: nothing is allocated)."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            (rows, *np.shape(a)[1:]) if np.ndim(a) else (), jnp.result_type(a)
        ),
        sample,
    )


def profile_units(
    layers: LayerSequence,
    sample: PyTree,
    units: Sequence[MeshAxes],
    *,
    rules: ShardingRules,
    devices: Sequence[jax.Device] | None = None,
) -> tuple[dict[MeshAxes, tuple[ShardedCost, ...]], dict[MeshAxes, int]]:
    """Every layer's costs on every unit (:func:`profile_sharded`), each unit compiled
    for the least multiple of the sample's rows that its ``fsdp`` divides (each device
    computes rows of its own): ``(costs per unit, rows per unit)``."""
    batch = _rows_of(sample)
    rows = {u: math.lcm(batch, dict(u).get("fsdp", 1)) for u in units}
    found: dict[MeshAxes, tuple[ShardedCost, ...]] = {}
    for n in sorted(set(rows.values())):
        mine = [u for u in units if rows[u] == n]
        costs = profile_sharded(layers, _with_rows(sample, n), mine, rules=rules, devices=devices)
        found.update({u: tuple(layer[k] for layer in costs) for k, u in enumerate(mine)})
    return {u: found[u] for u in units}, rows
