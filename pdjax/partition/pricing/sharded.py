"""Seconds of a sharded layer on an absent accelerator: its per-device FLOPs and bytes
through a roofline (:class:`~pdjax.profile.devices.DeviceModel`), and each collective XLA
inserted (:class:`~pdjax.profile.sharded.Collective`) priced on the topology level its
mesh axes span.

A stage's devices, in the plan's order, form its mesh row-major (the last axis over
neighbouring devices: :func:`pdjax.layers.sharding.make_mesh`). A collective over axes
``A`` runs within groups of devices that differ only along ``A``; its link is the slowest
topology level any group spans (:meth:`~pdjax.plan.Topology.link_level`). Over ``n``
devices, a ring moves, per device:

* ``all-reduce``: ``2 (n - 1) / n`` of its result, in ``2 (n - 1)`` messages;
* ``all-gather``: ``(n - 1) / n`` of its result (the gathered array), in ``n - 1``;
* ``reduce-scatter``: ``n - 1`` times its result (the scattered piece), in ``n - 1``;
* ``all-to-all``: ``(n - 1) / n`` of its result, in ``n - 1``;
* ``collective-permute``: its result, in one message.

Collectives are charged in full, after the compute (not overlapped with it): XLA's CPU
runtime runs them in order, and an accelerator's overlap depends on its scheduler.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from pdjax.errors import PlanError
from pdjax.mesh import MeshAxes, mesh_size
from pdjax.plan.topology import Topology
from pdjax.profile.devices import DeviceModel
from pdjax.profile.sharded import Collective, ShardedCost

__all__ = ["ShardedSeconds", "collective_seconds", "sharded_seconds"]


def _ring(kind: str, n: int) -> tuple[float, int]:
    """Bytes moved per device as a multiple of the result's, and messages, over ``n``."""
    if kind == "all-reduce":
        return 2 * (n - 1) / n, 2 * (n - 1)
    if kind in ("all-gather", "all-to-all"):
        return (n - 1) / n, n - 1
    if kind == "reduce-scatter":
        return float(n - 1), n - 1
    return 1.0, 1  # collective-permute


@dataclasses.dataclass(frozen=True)
class ShardedSeconds:
    """A sharded layer's seconds per microbatch on one device of its stage."""

    forward: float
    backward: float
    forward_collectives: float
    backward_collectives: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.forward_collectives + self.backward_collectives


def _groups(mesh: MeshAxes, axes: Sequence[str]) -> list[list[int]]:
    """The groups of mesh positions that differ only along ``axes``."""
    names = [n for n, _ in mesh]
    shape = [s for _, s in mesh]
    ids = np.arange(mesh_size(mesh)).reshape(shape)
    along = [names.index(a) for a in axes if a in names]
    others = [k for k in range(len(shape)) if k not in along]
    moved = np.transpose(ids, others + along)
    return [list(map(int, g)) for g in moved.reshape(-1, math.prod(shape[k] for k in along))]


def collective_seconds(
    collective: Collective,
    mesh: MeshAxes,
    positions: Sequence[int],
    topology: Topology,
) -> float:
    """Seconds of one collective of a stage on ``positions`` (topology positions, in the
    stage's device order) with mesh ``mesh`` (see the module docstring).

    Raises:
      PlanError: a collective over an axis the mesh lacks, or positions that are not the
        mesh's size.
    """
    if len(positions) != mesh_size(mesh):
        raise PlanError(f"the stage has {len(positions)} devices, its mesh spans {mesh_size(mesh)}")
    sizes = dict(mesh)
    missing = [a for a in collective.axes if a not in sizes]
    if missing:
        raise PlanError(f"a collective over axis {missing[0]!r}, which the mesh lacks")
    n = math.prod(sizes[a] for a in collective.axes)
    if n <= 1 or collective.nbytes == 0:
        return 0.0
    level = 0
    for group in _groups(mesh, collective.axes):
        for a, b in itertools.combinations(group, 2):
            level = max(level, topology.link_level(positions[a], positions[b]))
    link = topology.levels[level]
    volume, messages = _ring(collective.kind, n)
    return volume * collective.nbytes / link.bandwidth + messages * link.latency


def sharded_seconds(
    cost: ShardedCost,
    device: DeviceModel,
    topology: Topology,
    positions: Sequence[int],
    dtype: str = "float32",
) -> ShardedSeconds:
    """A layer's seconds on one device of a stage with ``cost.mesh`` on ``positions``: its
    forward and backward through ``device``'s roofline, its collectives on the links
    their axes span (see the module docstring)."""
    return ShardedSeconds(
        forward=device.seconds(cost.forward_flops, cost.forward_bytes, dtype),
        backward=device.seconds(cost.backward_flops, cost.backward_bytes, dtype),
        forward_collectives=sum(
            collective_seconds(c, cost.mesh, positions, topology) for c in cost.forward_collectives
        ),
        backward_collectives=sum(
            collective_seconds(c, cost.mesh, positions, topology) for c in cost.backward_collectives
        ),
    )
