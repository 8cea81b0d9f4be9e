"""The `Topology`: how many workers there are and how fast they talk, level by level.

A topology is a hierarchy of levels, innermost first. Level 0 groups ``workers`` devices
(e.g. the GPUs of one server) joined by ``bandwidth`` bytes/s; level 1 groups ``workers``
level-0 groups (servers) joined by its own bandwidth, and so on. Four servers of four GPUs
with 10 GB/s inside a server and 10 Gbit/s between servers are::

    Topology.from_levels([4, 4], [1e10, 1.25e9])

Devices are numbered in order, innermost level fastest: devices ``0..3`` are server 0,
``4..7`` server 1, ... A plan's device ids are these numbers (or ``device_ids[n]`` when the
topology was built from real devices).

Bandwidths are bytes per second per link, as in PipeDream's optimizer (``-b``); the
papers' clusters are in :data:`PRESETS`. A level may also give a per-message ``latency``
(seconds, default 0): the ``pdjax`` cost model charges it once per activation (or gradient)
transfer across a cut at that level and ``2 (m - 1)`` times per ring all-reduce over ``m``
units (:mod:`pdjax.partition.pricing.cost`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pdjax.errors import PlanError

__all__ = ["PRESETS", "Level", "Topology", "parse_levels"]

_FORMAT = "pdjax.topology/1"

#: Default bandwidth (bytes/s) between local devices for :meth:`Topology.from_devices`:
#: about PCIe 3.0 x16 in practice, the intra-server link of the SOSP'19 paper's Cluster-A,
#: and close to the ~9 GB/s a ``jax.device_put`` reaches between CPU devices.
DEFAULT_LOCAL_BANDWIDTH = 1e10


@dataclasses.dataclass(frozen=True)
class Level:
    """One level of a hierarchical topology.

    Attributes:
      workers: how many units of the level below (devices, for the innermost level) this
        level joins into one group.
      bandwidth: bytes/s of the link between two of those units.
      name: a label for messages and renderings (``"gpu"``, ``"server"``, ...).
      latency: seconds per message on the level's links (default 0): charged once per
        transfer across a cut and once per step of a ring all-reduce by the ``pdjax`` cost
        model. Topology JSON written without it reads as 0.
    """

    workers: int
    bandwidth: float
    name: str = ""
    latency: float = 0.0


@dataclasses.dataclass(frozen=True)
class Topology:
    """Workers and bandwidths, innermost level first, and a per-device memory limit.

    Attributes:
      levels: the levels, innermost first; the number of devices is the product of their
        ``workers``.
      memory_per_device: bytes one device may use for a stage, or None for no limit.
      name: a label (a preset's name, ``"local"``, ...).
      device_ids: ids of the real devices behind positions ``0..N-1`` (from
        :meth:`from_devices`), or None: plans then use the positions as ids.

    Raises:
      PlanError: no levels, a level with fewer than one worker, a bandwidth that is not a
        positive finite number, a non-positive memory limit, or ``device_ids`` of the wrong
        length.

    >>> topo = Topology.from_levels([4, 4], [1e10, 1.25e9])
    >>> topo.num_devices, topo.group_size(1)
    (16, 4)
    """

    levels: tuple[Level, ...]
    memory_per_device: float | None = None
    name: str = ""
    device_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        raw = tuple(lvl if isinstance(lvl, Level) else Level(*lvl) for lvl in self.levels)
        if not raw:
            raise PlanError("a topology needs at least one level, e.g. Topology.flat(4, 1.25e9)")
        levels = []
        for k, lvl in enumerate(raw):
            w, bw = lvl.workers, lvl.bandwidth
            if isinstance(w, bool) or not isinstance(w, int | float) or int(w) != w:
                raise PlanError(f"level {k}: workers must be an integer, got {w!r}")
            if w < 1:
                raise PlanError(f"level {k}: workers must be at least 1, got {w}")
            if isinstance(bw, bool) or not isinstance(bw, int | float) or not bw > 0:
                raise PlanError(
                    f"level {k}: bandwidth must be a positive number of bytes/s, got {bw!r} "
                    "(10 Gbit/s is 1.25e9)"
                )
            if not math.isfinite(bw):
                raise PlanError(f"level {k}: bandwidth must be finite, got {bw!r}")
            lat = lvl.latency
            if (
                isinstance(lat, bool)
                or not isinstance(lat, int | float)
                or not lat >= 0
                or not math.isfinite(lat)
            ):
                raise PlanError(
                    f"level {k}: latency must be a finite number of seconds >= 0, got {lat!r}"
                )
            levels.append(Level(int(w), float(bw), lvl.name, float(lat)))
        object.__setattr__(self, "levels", tuple(levels))
        mem = self.memory_per_device
        if mem is not None:
            if not mem > 0 or not math.isfinite(mem):
                raise PlanError(f"memory_per_device must be positive bytes or None, got {mem!r}")
            object.__setattr__(self, "memory_per_device", float(mem))
        if self.device_ids is not None:
            ids = tuple(int(d) for d in self.device_ids)
            if len(ids) != self.num_devices:
                raise PlanError(
                    f"{len(ids)} device_ids given for a topology of {self.num_devices} devices"
                )
            object.__setattr__(self, "device_ids", ids)

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def flat(
        cls, workers: int, bandwidth: float, *, memory_per_device: float | None = None
    ) -> Topology:
        """One level of ``workers`` devices joined by ``bandwidth`` bytes/s."""
        return cls((Level(workers, bandwidth),), memory_per_device=memory_per_device)

    @classmethod
    def from_levels(
        cls,
        workers: Sequence[int],
        bandwidths: Sequence[float],
        *,
        memory_per_device: float | None = None,
        name: str = "",
        latencies: Sequence[float] | None = None,
    ) -> Topology:
        """Levels from explicit numbers, innermost first.

        Args:
          workers: workers per level, innermost first (``[4, 4]``: 4 servers of 4 GPUs).
          bandwidths: bytes/s per level, in the same order.
          memory_per_device: bytes per device, or None.
          name: a label.
          latencies: seconds per message per level, in the same order; None: all 0.

        Raises:
          PlanError: the lists differ in length, or a value is invalid.
        """
        if len(workers) != len(bandwidths):
            raise PlanError(
                f"{len(workers)} levels of workers but {len(bandwidths)} bandwidths; "
                "give one bandwidth (bytes/s) per level, innermost first"
            )
        if latencies is None:
            latencies = [0.0] * len(workers)
        if len(latencies) != len(workers):
            raise PlanError(
                f"{len(workers)} levels of workers but {len(latencies)} latencies; give one "
                "latency (seconds per message) per level, innermost first"
            )
        levels = tuple(
            Level(w, b, "", lat) for w, b, lat in zip(workers, bandwidths, latencies, strict=True)
        )
        return cls(levels, memory_per_device=memory_per_device, name=name)

    @classmethod
    def preset(cls, name: str, *, memory_per_device: float | None = None) -> Topology:
        """One of the papers' clusters, by name (see :data:`PRESETS`), without a memory limit
        unless ``memory_per_device`` (bytes) is given.

        Raises:
          PlanError: an unknown name (the message lists the known ones).
        """
        key = name.lower()
        if key not in PRESETS:
            raise PlanError(f"unknown topology preset {name!r}; known: {', '.join(PRESETS)}")
        workers, bandwidths, _ = PRESETS[key]
        return cls.from_levels(workers, bandwidths, memory_per_device=memory_per_device, name=key)

    @classmethod
    def from_devices(
        cls,
        devices: Sequence[Any] | None = None,
        *,
        bandwidth: float = DEFAULT_LOCAL_BANDWIDTH,
        memory_per_device: float | None = None,
    ) -> Topology:
        """One level over the given JAX devices (default: ``jax.devices()``).

        Args:
          devices: JAX devices; None means ``jax.devices()`` (imports JAX lazily: the rest
            of the planner does not need it).
          bandwidth: bytes/s between two devices; the default,
            :data:`DEFAULT_LOCAL_BANDWIDTH` (1e10), is a PCIe-class link.
          memory_per_device: bytes per device; None reads the smallest
            ``memory_stats()["bytes_limit"]`` the devices report, and leaves no limit when
            they report none (CPU).

        Returns:
          A one-level topology whose ``device_ids`` are the devices' ids.
        """
        if devices is None:
            import jax

            devices = jax.devices()
        devices = list(devices)
        if not devices:
            raise PlanError("no devices given")
        if memory_per_device is None:
            limits = []
            for d in devices:
                try:
                    stats = d.memory_stats()
                except Exception:  # backends without memory stats (CPU) raise or return None
                    stats = None
                if stats and stats.get("bytes_limit"):
                    limits.append(float(stats["bytes_limit"]))
            memory_per_device = min(limits) if len(limits) == len(devices) else None
        return cls(
            (Level(len(devices), bandwidth, str(devices[0].platform)),),
            memory_per_device=memory_per_device,
            name="local",
            device_ids=tuple(int(d.id) for d in devices),
        )

    # -- derived ------------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        """All devices: the product of the levels' workers."""
        return math.prod(lvl.workers for lvl in self.levels)

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    def group_size(self, level: int) -> int:
        """Devices in one unit of ``level`` (1 for level 0, the server size for level 1...)."""
        return math.prod(lvl.workers for lvl in self.levels[:level])

    def device_id(self, position: int) -> int:
        """The id of the device at ``position`` (0..N-1) in the topology's order."""
        return self.device_ids[position] if self.device_ids is not None else position

    def position(self, device: int) -> int:
        """The position (0..N-1) of the device with id ``device``: the inverse of
        :meth:`device_id`.

        Raises:
          PlanError: for an id the topology does not hold.
        """
        if self.device_ids is None:
            position = device
        elif device in self.device_ids:
            position = self.device_ids.index(device)
        else:
            raise PlanError(f"device {device} is not one of the topology's {self.device_ids}")
        if not 0 <= position < self.num_devices:
            raise PlanError(f"device {device} is outside the topology's {self.num_devices}")
        return position

    def link_level(self, a: int, b: int) -> int:
        """The innermost level whose group holds device positions ``a`` and ``b``."""
        for k in range(self.num_levels):
            size = self.group_size(k + 1)
            if a // size == b // size:
                return k
        return self.num_levels - 1

    def with_memory(self, memory_per_device: float | None) -> Topology:
        """A copy with another per-device memory limit."""
        return dataclasses.replace(self, memory_per_device=memory_per_device)

    def describe(self) -> str:
        """E.g. ``"4x4 devices (1e+10, 1.25e+09 B/s)"``."""
        shape = "x".join(str(lvl.workers) for lvl in self.levels)
        bws = ", ".join(f"{lvl.bandwidth:.3g}" for lvl in self.levels)
        lat = ""
        if any(lvl.latency for lvl in self.levels):
            lat = "; latency " + ", ".join(f"{lvl.latency:.3g}" for lvl in self.levels) + " s"
        mem = "" if self.memory_per_device is None else f", {self.memory_per_device:.3g} B/device"
        label = f"{self.name}: " if self.name else ""
        return f"{label}{shape} devices ({bws} B/s{lat}{mem})"

    # -- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "levels": [dataclasses.asdict(lvl) for lvl in self.levels],
            "memory_per_device": self.memory_per_device,
            "name": self.name,
            "device_ids": None if self.device_ids is None else list(self.device_ids),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        if data.get("format") != _FORMAT:
            raise PlanError(f"not a pdjax topology (format {data.get('format')!r})")
        ids = data.get("device_ids")
        return cls(
            levels=tuple(Level(**lvl) for lvl in data["levels"]),
            memory_per_device=data.get("memory_per_device"),
            name=data.get("name", ""),
            device_ids=None if ids is None else tuple(ids),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Topology:
        return cls.from_dict(json.loads(text))


#: The papers' clusters: name -> (workers per level innermost first, bytes/s per level,
#: description). Intra-server figures are nominal (PCIe 3.0 x16 ~10 GB/s; NVLink on a
#: p3.16xlarge ~100 GB/s between GPU pairs). V100s have 16 GB, a Titan X 12 GB: pass
#: ``memory_per_device`` to plan under that limit.
PRESETS: dict[str, tuple[tuple[int, ...], tuple[float, ...], str]] = {
    "4x4-v100-10gbps": (
        (4, 4),
        (1e10, 1.25e9),
        "SOSP'19 Cluster-A: 4 servers x 4 V100 (PCIe), 10 Gbit/s between servers",
    ),
    "2x8-v100-25gbps": (
        (8, 2),
        (1e11, 3.125e9),
        "SOSP'19 Cluster-B: 2 servers x 8 V100 (NVLink), 25 Gbit/s between servers",
    ),
    "4x1-titanx-40gbps": (
        (4,),
        (5e9,),
        "SOSP'19 Cluster-C: 4 servers x 1 Titan X, 40 Gbit/s between servers",
    ),
    # Part of Cluster-A, as the SOSP'19 paper's Table 1 runs GNMT and AWD-LM on it.
    "1x4-v100-10gbps": (
        (4,),
        (1e10,),
        "SOSP'19 Cluster-A, one server: 4 V100 (PCIe), no link between servers",
    ),
    "3x4-v100-10gbps": (
        (4, 3),
        (1e10, 1.25e9),
        "SOSP'19 Cluster-A, three servers: 3 servers x 4 V100 (PCIe), 10 Gbit/s between servers",
    ),
}
PRESETS["cluster-a"] = PRESETS["4x4-v100-10gbps"]
PRESETS["cluster-b"] = PRESETS["2x8-v100-25gbps"]
PRESETS["cluster-c"] = PRESETS["4x1-titanx-40gbps"]


def parse_levels(text: str) -> tuple[int, ...]:
    """Parses ``"4x4"`` / ``"8x2"`` (workers per level, innermost first) into a tuple.

    Raises:
      PlanError: not positive integers separated by ``x``.
    """
    try:
        workers = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        workers = ()
    if not workers or any(w < 1 for w in workers):
        raise PlanError(
            f"--levels {text!r}: expected workers per level, innermost first, joined by 'x' "
            "(e.g. 4x4 for 4 servers of 4 devices)"
        )
    return workers
