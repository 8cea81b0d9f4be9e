"""A stage's mesh as plain data: ``((axis, size), ...)``, outermost first.

The plan records one per stage (:attr:`pdjax.plan.StagePlan.mesh`); the runtime turns it
into a :class:`jax.sharding.Mesh` (:mod:`pdjax.layers.sharding`).

>>> mesh_axes({"tensor": 2, "fsdp": 2})
(('fsdp', 2), ('tensor', 2))
>>> describe_mesh((("fsdp", 2), ("tensor", 2)))
'fsdp 2 x tensor 2'
>>> parse_mesh("data=2,tensor=2")
(('data', 2), ('tensor', 2))
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import numpy as np

from pdjax.errors import PlanError

__all__ = [
    "AXES",
    "MeshAxes",
    "MeshError",
    "describe_mesh",
    "is_sharded",
    "mesh_axes",
    "mesh_size",
    "parse_mesh",
    "stage_mesh",
]

#: The default mesh axis names, outermost first (``tensor`` on the fastest level).
AXES = ("data", "fsdp", "tensor")

#: A mesh as ``((axis, size), ...)``, outermost first.
MeshAxes = tuple[tuple[str, int], ...]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RANK = {"data": 0, "fsdp": 1, "tensor": 3}  # other names: between fsdp and tensor


class MeshError(PlanError, ValueError):
    """A mesh pdjax cannot read or place (a name, a size, a device count)."""


def mesh_axes(axes: Mapping[str, int] | Iterable[tuple[str, int]]) -> MeshAxes:
    """A mesh's axes in pdjax's order: ``data``, ``fsdp``, other names as given,
    ``tensor`` last (the last axis runs over neighbouring devices of the stage's device
    list, which follows the topology: ``tensor`` on the fastest level); axes of size 1
    are left out (they split nothing), and a mesh of nothing but size-1 axes is
    ``(("data", 1),)``.

    Raises:
      MeshError: for a name that is not an identifier, a repeated name, or a size that is
        not a positive integer.
    """
    pairs = list(axes.items()) if isinstance(axes, Mapping) else list(axes)
    seen: set[str] = set()
    for pair in pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise MeshError(f"a mesh axis is a (name, size) pair, got {pair!r}")
        name, size = pair
        if not isinstance(name, str) or not _NAME.match(name):
            raise MeshError(
                f"mesh axis name {name!r} must be an identifier, e.g. data, fsdp, tensor"
            )
        if name in seen:
            raise MeshError(f"mesh axis {name!r} is given twice")
        seen.add(name)
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise MeshError(f"mesh axis {name}'s size must be a positive integer, got {size!r}")
    ordered = sorted(
        ((str(n), int(s)) for n, s in pairs if int(s) > 1), key=lambda p: _RANK.get(p[0], 2)
    )
    return tuple(ordered) or (("data", 1),)


def parse_mesh(text: str) -> MeshAxes:
    """``"data=2,tensor=2"`` as :func:`mesh_axes`.

    Raises:
      MeshError: naming the malformed part and the form to use.
    """
    pairs = []
    for part in str(text).split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not size.strip().isdigit():
            raise MeshError(
                f"mesh {text!r}: {part.strip()!r} is not AXIS=SIZE; write e.g. "
                "data=2,tensor=2 (axes data, fsdp, tensor, or the names your rules use)"
            )
        pairs.append((name.strip(), int(size)))
    return mesh_axes(pairs)


def mesh_size(axes: MeshAxes) -> int:
    """The devices a mesh spans."""
    return math.prod(size for _, size in axes)


def is_sharded(axes: MeshAxes | None) -> bool:
    """Whether a mesh splits anything but the batch (an axis other than ``data``)."""
    return axes is not None and any(name != "data" and size > 1 for name, size in axes)


def describe_mesh(axes: MeshAxes) -> str:
    """``"fsdp 2 x tensor 2"``."""
    return " x ".join(f"{name} {size}" for name, size in axes)


def stage_mesh(
    mesh: MeshAxes | Mapping[str, int] | None, devices: int, round_robin: bool, where: str
) -> MeshAxes | None:
    """A stage's mesh as a plan keeps it: :func:`mesh_axes`, or None where it splits
    nothing but the batch (``{data: r}``, the replicated stage).

    Raises:
      MeshError: naming ``where`` (e.g. ``"stage 0-3"``), for a mesh pdjax cannot read,
        one whose sizes do not multiply to the stage's ``devices``, or a sharded
        round-robin stage.
    """
    if mesh is None:
        return None
    try:
        axes = mesh_axes(mesh)
    except MeshError as e:
        raise MeshError(f"{where}: {e}") from None
    if mesh_size(axes) != devices:
        raise MeshError(
            f"{where}: mesh {describe_mesh(axes)} spans {mesh_size(axes)} devices, the stage "
            f"has {devices}; the axis sizes must multiply to its device count"
        )
    if is_sharded(axes) and round_robin:
        raise MeshError(
            f"{where}: a round-robin stage takes whole microbatches per device and cannot "
            f"be sharded ({describe_mesh(axes)}); use replication='split'"
        )
    return axes if is_sharded(axes) else None
