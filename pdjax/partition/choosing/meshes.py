"""The planner's mesh search: which mesh each stage's devices form.

A stage on ``n`` devices can be any mesh ``data d x fsdp f x tensor t`` with ``d f t = n``
(:mod:`pdjax.mesh`). :func:`plan_auto` searches them when given a :class:`MeshSearch`
(:func:`search_meshes`): for every **unit** ``fsdp f x tensor t`` the topology allows it
plans the whole model again, with every other choice it makes (cuts, replication,
schedule, ``M``, memory policies, in-flight depth), on a topology whose devices are the
units, and keeps the fastest plan that fits the memory cap. A stage of ``d`` units is then
the mesh ``data d x fsdp f x tensor t``: its data ways are chosen per stage, its unit is
the same for every stage of a plan.

**Units.** A unit is ``f t`` consecutive devices (its devices are the mesh's innermost,
so ``tensor`` runs over neighbours), so ``f t`` must tile the topology (divide the
innermost level's workers, or be a whole number of its groups, and so on outwards:
:func:`coarse_topology`); ``tensor`` stays within the innermost level (``t`` divides its
workers); ``tensor`` is searched only for a model whose parameters are annotated (with no
annotation only ``data`` and ``fsdp`` are, ``fsdp="auto"``, and the plan says so).

**Costs of a unit, from XLA.** :func:`search_meshes` compiles every layer's sharded forward
and backward on every unit (:func:`pdjax.profile.sharded.profile_sharded`; identical
layers share one compile). :func:`unit_profile` turns one unit's costs into a profile of
the model on that unit, per device:

=======================  ===================================================================
seconds                  the profile's seconds times the device's share of the FLOPs XLA
                         counts in the sharded program (of its bytes accessed for a layer
                         without FLOPs), plus every collective XLA inserted, priced on the
                         topology level its mesh axes span
                         (:func:`~pdjax.partition.pricing.sharded.collective_seconds`), not
                         overlapped with the compute
``param_bytes``          one device's share, from the shardings the rules give (a leaf the
                         rules leave whole is counted whole)
activations              input, output, residual and each memory policy's bytes divided by
                         ``f``: the runtime splits a stage's batch over ``data`` and
                         ``fsdp`` and keeps its values between layers whole along
                         ``tensor``; the activations a tensor-parallel layer splits inside
                         itself are counted whole (an over-count: a plan that fits on
                         paper fits)
=======================  ===================================================================

A unit's layers are compiled for the least multiple of the profile's batch that ``f``
divides (each device computes its own rows) and scaled back to the profile's batch; every
stage's microbatch must split over its ``d f`` batch ways. The planner scales a unit's
seconds with the microbatch as it scales the profile's; a collective of the weights (an
``fsdp`` gather) does not grow with the batch, so profile at the microbatch size the plan
will run (``pdjax plan --microbatch-size``) for the closest price.

Everything the planner already does is then unchanged: the dynamic program, the
simulator and the memory model see a topology of units and a profile of per-device
costs; a stage's data ways are its replicas there (``split`` only: round-robin is not
run on a mesh), with the gradient's all-reduce over them priced on the units' links.
:func:`expand` turns the chosen plan back into one on the devices
(:attr:`StagePlan.mesh <pdjax.plan.StagePlan.mesh>` per stage), and
:func:`sharded_costs` prices a sharded plan for the simulator the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pdjax.errors import PlanError
from pdjax.mesh import MeshAxes, describe_mesh, mesh_axes, mesh_size
from pdjax.plan.plan import Plan, StagePlan
from pdjax.plan.topology import Level, Topology
from pdjax.profile import Profile
from pdjax.profile.sharded import ShardedCost

__all__ = [
    "MeshSearch",
    "coarse_topology",
    "coarsen",
    "describe_unit",
    "expand",
    "search_meshes",
    "sharded_costs",
    "unit_meshes",
    "unit_of",
    "unit_profile",
]

#: The replicated unit: one device, the plan's stages replicated as before.
ONE: MeshAxes = ()


@dataclasses.dataclass(frozen=True)
class MeshSearch:
    """What :func:`plan_auto` needs to choose meshes (made by :func:`search_meshes`).

    Attributes:
      costs: per unit (``((axis, size), ...)`` of ``fsdp`` and ``tensor``), every layer's
        :class:`~pdjax.profile.sharded.ShardedCost` on it, at the profile's batch.
      annotated: whether the model's parameters carry logical axis names (else ``tensor``
        is not searched).
      fsdp: the rules' ``fsdp`` (``"auto"`` for an unannotated model: ZeRO-3 along each
        parameter's largest divisible dimension), which the runtime must use too.
      rows: per unit, the batch its costs were compiled for (absent: the profile's):
        the least multiple of the sample's rows that its ``fsdp`` divides, so that each
        device computes its own rows; :func:`unit_profile` scales them to the profile's
        batch.
      replicated: whether the replicated unit is searched too.
      collectives: the links the collectives inside a stage run on, one level per
        topology level (None: the topology's own). In-process CPU devices run them as
        memory copies on shared cores, far from a transfer's link
        (:func:`pdjax.calibrate.links.collective_level` measures them).
    """

    costs: Mapping[MeshAxes, Sequence[ShardedCost]]
    annotated: bool
    fsdp: str | None = None
    rows: Mapping[MeshAxes, int] = dataclasses.field(default_factory=dict)
    replicated: bool = True
    collectives: tuple[Level, ...] | None = None

    def units(self) -> list[MeshAxes]:
        """The searched units, the replicated one first (unless :attr:`replicated` is
        False)."""
        return [ONE] * self.replicated + [u for u in self.costs if u != ONE]

    def only(self, *units: MeshAxes | dict[str, int]) -> MeshSearch:
        """This search restricted to ``units`` (``()`` or ``{}``: the replicated one), e.g.
        to price one layout against the search's choice.

        Raises:
          PlanError: a unit this search did not compile.
        """
        keep = [_unit_axes(u.items() if isinstance(u, dict) else u) for u in units]
        missing = [u for u in keep if u != ONE and u not in self.costs]
        if missing:
            raise PlanError(
                f"no costs for {describe_unit(missing[0])}: search_meshes did not compile it"
            )
        return dataclasses.replace(
            self,
            costs={u: self.costs[u] for u in keep if u != ONE},
            rows={u: n for u, n in self.rows.items() if u in keep},
            replicated=ONE in keep,
        )


def _unit_axes(pairs: Any) -> MeshAxes:
    """A unit in pdjax's order from ``(axis, size)`` pairs: its axes of size > 1 besides
    ``data``; ``()`` (:data:`ONE`) for none."""
    kept = [(n, int(s)) for n, s in pairs if n != "data" and int(s) > 1]
    return mesh_axes(kept) if kept else ONE


def _unit(fsdp: int, tensor: int) -> MeshAxes:
    return _unit_axes((("fsdp", fsdp), ("tensor", tensor)))


def coarse_topology(topology: Topology, size: int) -> Topology | None:
    """The topology whose devices are units of ``size`` consecutive devices of
    ``topology``, or None where such units do not tile it (``size`` must divide the
    innermost level's workers, or be a whole number of its groups, and so on outwards).
    A unit's links to the others are those of the level its neighbours are across; the
    memory per device is unchanged (units are priced per device).

    >>> t = Topology.from_levels([4, 2], [1e11, 1e10])
    >>> [lvl.workers for lvl in coarse_topology(t, 2).levels]
    [2, 2]
    >>> [lvl.workers for lvl in coarse_topology(t, 4).levels], coarse_topology(t, 3)
    ([2], None)
    """
    rest = int(size)
    levels: list[Level] = []
    for lvl in topology.levels:
        if rest == 1:
            levels.append(lvl)
        elif lvl.workers % rest == 0:
            if lvl.workers // rest > 1:
                levels.append(dataclasses.replace(lvl, workers=lvl.workers // rest))
            rest = 1
        elif rest % lvl.workers == 0:
            rest //= lvl.workers
        else:
            return None
    if rest != 1:
        return None
    if not levels:  # one unit holds every device
        levels = [dataclasses.replace(topology.levels[-1], workers=1)]
    return Topology(tuple(levels), topology.memory_per_device, topology.name)


def unit_meshes(
    topology: Topology, *, annotated: bool, max_size: int | None = None
) -> list[MeshAxes]:
    """Every unit ``fsdp f x tensor t`` (besides the replicated one) that tiles
    ``topology`` (:func:`coarse_topology`), with ``t`` dividing the innermost level's
    workers and ``t = 1`` unless ``annotated``; at most ``max_size`` devices.

    >>> [describe_unit(u) for u in unit_meshes(Topology.flat(4, 1e10), annotated=True)]
    ['fsdp 2', 'tensor 2', 'fsdp 4', 'fsdp 2 x tensor 2', 'tensor 4']
    """
    n = topology.num_devices
    inner = topology.levels[0].workers
    out = []
    for size in range(2, n + 1):
        if n % size or (max_size is not None and size > max_size):
            continue
        if coarse_topology(topology, size) is None:
            continue
        for t in range(1, size + 1):
            if size % t or inner % t or (t > 1 and not annotated):
                continue
            out.append(_unit(size // t, t))
    return out


def search_meshes(
    layers: Any,
    sample: Any,
    topology: Topology,
    *,
    rules: Any = None,
    devices: Sequence[Any] | None = None,
    max_size: int | None = None,
    collectives: Sequence[Level] | None = None,
) -> MeshSearch:
    """Every unit the topology allows (:func:`unit_meshes`), with every layer's costs on it
    compiled from ``sample`` (one microbatch: the profile's batch). Without annotations
    only ``fsdp`` units are searched, with ``fsdp="auto"`` rules.

    Args:
      layers, sample: the model's layers and one microbatch of its input.
      topology: the devices the plan is for.
      rules: :class:`~pdjax.layers.sharding.ShardingRules` (default: the default rules for
        an annotated model, ``fsdp="auto"`` for another).
      devices: the devices to compile for (default ``jax.devices()``): as many as the
        largest unit (on CPU, ``jax_num_cpu_devices``).
      max_size: the largest unit searched (default: every device).
      collectives: :attr:`MeshSearch.collectives`.

    Raises:
      ProfileError: fewer devices here than the largest unit, before anything compiles.
    """
    from pdjax.profile.sharded import profile_units, rules_for

    rules, annotated = rules_for(layers, sample, rules)
    units = unit_meshes(topology, annotated=annotated, max_size=max_size)
    costs, rows = profile_units(layers, sample, units, rules=rules, devices=devices)
    links = None if collectives is None else tuple(collectives)
    return MeshSearch(costs, annotated, rules.fsdp, rows, True, links)


def _ratio(
    sharded: float, whole: float | None, sharded_b: float, whole_b: float | None, ways: int
) -> float:
    """One device's share of a layer's work: of its FLOPs, else of its bytes accessed,
    else ``1 / ways``."""
    if whole and whole > 0:
        return sharded / whole
    if whole_b and whole_b > 0:
        return sharded_b / whole_b
    return 1.0 / ways


def unit_profile(
    profile: Profile,
    costs: Sequence[ShardedCost],
    topology: Topology,
    unit: MeshAxes,
    rows: int | None = None,
    collectives: Sequence[Level] | None = None,
) -> Profile:
    """The model's profile on one device of ``unit`` (the module docstring's table): its
    layers' seconds, parameter and activation bytes per device.

    Raises:
      PlanError: costs of another model (a layer count or name that differs), or a
        profile without seconds.
    """
    if unit == ONE:
        return profile
    if len(costs) != len(profile.layers):
        raise PlanError(
            f"the mesh costs have {len(costs)} layers and the profile {len(profile.layers)}: "
            "profile the same model"
        )
    if collectives is not None:  # the collectives' own links, level by level
        if [lvl.workers for lvl in collectives] != [lvl.workers for lvl in topology.levels]:
            raise PlanError("the collectives' levels must have the topology's workers")
        topology = dataclasses.replace(topology, levels=tuple(collectives))
    compiled = rows or profile.batch_size
    split = dict(unit).get("fsdp", 1)  # the rows of a microbatch are split this many ways
    ways = mesh_size(unit)
    positions = list(range(ways))
    from pdjax.partition.pricing.sharded import collective_seconds

    per = profile.batch_size / compiled  # the costs' batch to the profile's
    layers = []
    for lp, c in zip(profile.layers, costs, strict=True):
        if lp.name != c.name and not lp.name.endswith(c.name):
            raise PlanError(f"layer {lp.name!r} of the profile is {c.name!r} in the mesh costs")
        if lp.forward_seconds is None or lp.backward_seconds is None:
            raise PlanError(f"layer {lp.name!r} has no seconds: profile with times first")
        f_ratio = _ratio(
            c.forward_flops, lp.forward_flops, c.forward_bytes, lp.forward_bytes_accessed, ways
        )
        b_ratio = _ratio(
            c.backward_flops, lp.backward_flops, c.backward_bytes, lp.backward_bytes_accessed, ways
        )
        f_comm = sum(
            collective_seconds(k, unit, positions, topology) for k in c.forward_collectives
        )
        b_comm = sum(
            collective_seconds(k, unit, positions, topology) for k in c.backward_collectives
        )
        f_ratio, b_ratio = f_ratio * per, b_ratio * per
        fwd = lp.forward_seconds * f_ratio + f_comm * per
        bwd = lp.backward_seconds * b_ratio + b_comm * per
        grow = bwd / lp.backward_seconds if lp.backward_seconds > 0 else 1.0
        layers.append(
            dataclasses.replace(
                lp,
                forward_flops=c.forward_flops * per,
                backward_flops=c.backward_flops * per,
                forward_bytes_accessed=c.forward_bytes * per,
                backward_bytes_accessed=c.backward_bytes * per,
                param_bytes=c.param_bytes,
                input_bytes=math.ceil(lp.input_bytes / split),
                output_bytes=math.ceil(lp.output_bytes / split),
                residual_bytes=math.ceil(lp.residual_bytes / split),
                peak_bytes=None,
                forward_seconds=fwd,
                backward_seconds=bwd,
                input_grad_flops=_times(lp.input_grad_flops, b_ratio),
                weight_grad_flops=_times(lp.weight_grad_flops, b_ratio),
                input_grad_seconds=_times(lp.input_grad_seconds, grow),
                weight_grad_seconds=_times(lp.weight_grad_seconds, grow),
                policies=tuple(
                    dataclasses.replace(
                        p,
                        residual_bytes=math.ceil(p.residual_bytes / split),
                        host_bytes=math.ceil(p.host_bytes / split),
                    )
                    for p in lp.policies
                ),
            )
        )
    meta = {**profile.meta, "unit": describe_mesh(unit)}
    return dataclasses.replace(profile, layers=tuple(layers), meta=meta)


def _times(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def unit_of(stage: StagePlan) -> MeshAxes:
    """A stage's unit: its mesh without ``data`` (``()`` for a replicated stage)."""
    return ONE if stage.mesh is None else _unit_axes(stage.mesh)


def expand(plan: Plan, topology: Topology, unit: MeshAxes) -> Plan:
    """``plan``, made on the topology of ``unit``s (:func:`coarse_topology`), on the
    devices of ``topology``: each stage's ``d`` units become its ``d x size(unit)``
    devices, its mesh ``data d x unit``. Its seconds and bytes are per device already."""
    if unit == ONE:
        return plan
    g = mesh_size(unit)
    stages = []
    for st in plan.stages:
        if st.replication != "split":
            raise PlanError(f"a {st.replication} stage cannot be a mesh")
        units = [plan.topology.position(d) for d in st.devices]
        positions = [u * g + k for u in units for k in range(g)]
        d = len(units)
        mesh = mesh_axes([("data", d), *unit]) if d > 1 else unit
        stages.append(
            dataclasses.replace(
                st, devices=tuple(topology.device_id(p) for p in positions), mesh=mesh
            )
        )
    return dataclasses.replace(plan, stages=tuple(stages), topology=topology)


def coarsen(plan: Plan) -> tuple[Plan, MeshAxes]:
    """The inverse of :func:`expand`: ``plan`` on the topology of its stages' unit, and
    that unit.

    Raises:
      PlanError: stages of different units (:func:`sharded_costs` prices one unit per
        plan), or a stage whose devices are not whole aligned units.
    """
    units = {unit_of(st) for st in plan.stages}
    if len(units) != 1:
        raise PlanError(
            "the stages have different meshes besides data ("
            + ", ".join(describe_mesh(u) or "replicated" for u in sorted(units))
            + "): the mesh pricing takes one unit per plan"
        )
    (unit,) = units
    if unit == ONE:
        return plan, unit
    g = mesh_size(unit)
    coarse = coarse_topology(plan.topology, g)
    if coarse is None:
        raise PlanError(f"units of {g} devices do not tile the plan's topology")
    stages = []
    for st in plan.stages:
        positions = [plan.topology.position(d) for d in st.devices]
        units_of = sorted({p // g for p in positions})
        if sorted(positions) != [u * g + k for u in units_of for k in range(g)]:
            raise PlanError(
                f"stage {st.first_layer}-{st.last_layer}: devices are not whole units of {g}"
            )
        stages.append(dataclasses.replace(st, devices=tuple(units_of), mesh=None))
    return dataclasses.replace(plan, stages=tuple(stages), topology=coarse), unit


def sharded_costs(plan: Plan, profile: Profile, search: MeshSearch, **kwargs: Any) -> Any:
    """The simulator's costs of a plan whose stages share a unit (:func:`coarsen`),
    priced from that unit's profile (:func:`unit_profile`), as :func:`plan_auto` priced
    it; a replicated plan is priced as before (:func:`~pdjax.partition.costs_from_plan`)."""
    from pdjax.partition.choosing.simulator_costs import costs_from_plan

    coarse, unit = coarsen(plan)
    if unit == ONE:
        return costs_from_plan(plan, profile, **kwargs)
    if unit not in search.costs:
        raise PlanError(
            f"no mesh costs for {describe_mesh(unit)}: search_meshes did not compile it"
        )
    mine = unit_profile(
        profile, search.costs[unit], plan.topology, unit, search.rows.get(unit), search.collectives
    )
    return costs_from_plan(coarse, mine, **kwargs)


def describe_unit(unit: MeshAxes) -> str:
    """``"fsdp 2 x tensor 2"``, or ``"replicated"`` for ``()``."""
    return describe_mesh(unit) if unit else "replicated"
