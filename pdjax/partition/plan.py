"""The `Plan`: stages, their devices, and what the cost model predicts for them.

A plan is plain data (a frozen dataclass with an exact JSON round trip): the planner writes
it, a user may edit it, the schedule and the runtime read it. Its text rendering reads like
PipeDream's configurations::

    15-1 on 16 devices (pipedream-code, pipedream): stage 0 = layers 0-30 x15, ...

A replicated stage that takes whole microbatches round-robin (PipeDream's replication)
rather than splitting each microbatch across its devices shows ``rr`` after its replica
count: ``15rr-1``, ``stage 0 = layers 0-30 x15 round-robin``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdjax._jsonio import parse_json, write_atomic
from pdjax.errors import PlanError
from pdjax.partition.topology import Topology

__all__ = ["Plan", "StagePlan"]

_FORMAT = "pdjax.plan/1"

REPLICATION = ("split", "round-robin")
"""How a replicated stage's devices share its microbatches (see :class:`StagePlan`)."""


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage: a contiguous range of layers on a group of devices.

    Attributes:
      first_layer: index of the stage's first layer in the profile.
      last_layer: index of its last layer (inclusive).
      devices: ids of the devices the stage is replicated on (data-parallel).
      in_flight: microbatches in flight at the stage under the plan's schedule.
      compute_seconds: forward + backward seconds per microbatch on one of its devices
        (the stage's compute divided by its replicas).
      memory_bytes: predicted bytes per device (weights x versions + optimizer state +
        stashed activations; see :mod:`pdjax.partition.cost`), with the plan's exact
        in-flight count: under the ``pdjax`` cost model for the stage's replication mode,
        PipeDream's whole microbatches per replica (the ``paper`` formula) under the others.
      replication: how the stage's devices share its work: ``"split"`` (each microbatch
        split across them; the default) or ``"round-robin"`` (PipeDream's: each device takes
        whole microbatches, ``r`` consecutive ones at once, and the stage all-reduces once
        per such group under ``pipedream``). A one-device stage is ``"split"``.
    """

    first_layer: int
    last_layer: int
    devices: tuple[int, ...]
    in_flight: int
    compute_seconds: float
    memory_bytes: float
    replication: str = "split"

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
        if self.first_layer > self.last_layer or self.first_layer < 0:
            raise PlanError(f"bad layer range {self.first_layer}-{self.last_layer}")
        if not self.devices:
            raise PlanError(f"stage {self.first_layer}-{self.last_layer} has no devices")
        if self.replication not in REPLICATION:
            raise PlanError(
                f"stage {self.first_layer}-{self.last_layer}: replication must be one of "
                f"{REPLICATION}, got {self.replication!r}"
            )
        if self.replication == "round-robin" and len(self.devices) == 1:
            raise PlanError(
                f"stage {self.first_layer}-{self.last_layer} is round-robin on one device; "
                "a one-device stage is 'split'"
            )

    @property
    def round_robin(self) -> bool:
        """True if the stage takes whole microbatches round-robin."""
        return self.replication == "round-robin"

    @property
    def replicas(self) -> int:
        """Devices the stage is replicated on."""
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A pipeline-parallel configuration and its predicted performance.

    Attributes:
      stages: the stages, in pipeline order; together they hold layers ``0..L-1``.
      num_layers: ``L``, layers in the profile.
      topology: the topology planned for.
      cost_model: ``"pdjax"``, ``"paper"`` or ``"pipedream-code"``.
      schedule: the schedule the in-flight counts and memory are for.
      partitioner: what made the plan (``"pipedream"``, ``"uniform"``, ``"balanced-time"``,
        ``"balanced-params"``, ``"manual"``).
      num_microbatches: ``M``, microbatches per step (flush schedules, ``2bw``).
      microbatch_size: samples per microbatch.
      time_per_microbatch: predicted seconds per microbatch in steady state (the slowest
        stage or link).
      single_device_time: predicted seconds per microbatch of the whole model on one device.
      data_parallel_time: predicted seconds per microbatch of data parallelism over all the
        topology's devices, under the same cost model (PipeDream's DP model).
      noam: PipeDream's NOAM, ``ceil(devices used / replicas of stage 0)``, for comparison
        with :attr:`StagePlan.in_flight`.
      memory_limit: the per-device limit (bytes) the plan was made under, or None.
      options: the planner's other options (``straight``, ``fewer_machines``,
        ``optimizer_state_factor``, ...).
      profile_source: where the profile came from (file name, model), for the record.
    """

    stages: tuple[StagePlan, ...]
    num_layers: int
    topology: Topology
    cost_model: str
    schedule: str
    partitioner: str
    num_microbatches: int
    microbatch_size: int
    time_per_microbatch: float
    single_device_time: float
    data_parallel_time: float
    noam: int
    memory_limit: float | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    profile_source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "options", dict(self.options))
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        expected = 0
        for stage in self.stages:
            if stage.first_layer != expected:
                raise PlanError(
                    f"stages must cover the layers contiguously: a stage starts at layer "
                    f"{stage.first_layer}, expected {expected}"
                )
            expected = stage.last_layer + 1
        if expected != self.num_layers:
            raise PlanError(f"the stages end at layer {expected - 1}, not {self.num_layers - 1}")
        seen: set[int] = set()
        for stage in self.stages:
            if seen & set(stage.devices):
                raise PlanError(f"devices {sorted(seen & set(stage.devices))} hold two stages")
            seen |= set(stage.devices)

    # -- derived ------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_devices(self) -> int:
        """Devices the plan uses (at most the topology's)."""
        return sum(stage.replicas for stage in self.stages)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(stage.replicas for stage in self.stages)

    @property
    def replication(self) -> tuple[str, ...]:
        """Per stage, ``"split"`` or ``"round-robin"``: pass it to the schedule generator
        with :attr:`replicas` (``generate(..., replicas=plan.replicas,
        replication=plan.replication)``)."""
        return tuple(stage.replication for stage in self.stages)

    @property
    def config(self) -> str:
        """PipeDream's notation: replicas per stage joined by ``-``, e.g. ``"15-1"``; a
        round-robin stage's count is followed by ``rr`` (``"15rr-1"``)."""
        return "-".join(f"{st.replicas}{'rr' if st.round_robin else ''}" for st in self.stages)

    @property
    def in_flight(self) -> tuple[int, ...]:
        return tuple(stage.in_flight for stage in self.stages)

    @property
    def memory_per_device(self) -> tuple[float, ...]:
        """Predicted bytes per device, per stage."""
        return tuple(stage.memory_bytes for stage in self.stages)

    @property
    def fits_memory(self) -> bool:
        """True if every device stays within :attr:`memory_limit` (or there is none)."""
        if self.memory_limit is None:
            return True
        return max(self.memory_per_device) <= self.memory_limit

    @property
    def speedup_over_single_device(self) -> float:
        return _ratio(self.single_device_time, self.time_per_microbatch)

    @property
    def speedup_over_data_parallel(self) -> float:
        return _ratio(self.data_parallel_time, self.time_per_microbatch)

    def stage_of_layer(self, layer: int) -> int:
        """The index of the stage holding ``layer``."""
        for s, stage in enumerate(self.stages):
            if stage.first_layer <= layer <= stage.last_layer:
                return s
        raise PlanError(f"layer {layer} is outside 0..{self.num_layers - 1}")

    def describe(self) -> str:
        """A readable rendering, e.g.
        ``"15-1: stage 0 = layers 0-30 x15, stage 1 = layers 31-40 x1"`` and the predictions.
        """
        parts = [
            f"stage {s} = layers {st.first_layer}-{st.last_layer} x{st.replicas}"
            + (" round-robin" if st.round_robin else "")
            for s, st in enumerate(self.stages)
        ]
        head = f"{self.config}: " + ", ".join(parts)
        tail = (
            f"{self.time_per_microbatch * 1e3:.4g} ms per microbatch "
            f"({self.cost_model} cost model, {self.schedule} schedule, "
            f"{self.num_devices} of {self.topology.num_devices} devices); "
            f"speedup {self.speedup_over_single_device:.3g}x over one device, "
            f"{self.speedup_over_data_parallel:.3g}x over data parallelism; "
            f"in flight {list(self.in_flight)} (NOAM {self.noam}); "
            f"peak memory {max(self.memory_per_device) / 1e9:.3g} GB per device"
        )
        if not self.fits_memory:
            tail += f" -- EXCEEDS the {self.memory_limit / 1e9:.3g} GB limit"
        return f"{head}\n{tail}"

    def __str__(self) -> str:
        return self.describe()

    # -- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "config": self.config,
            "num_layers": self.num_layers,
            "cost_model": self.cost_model,
            "schedule": self.schedule,
            "partitioner": self.partitioner,
            "num_microbatches": self.num_microbatches,
            "microbatch_size": self.microbatch_size,
            "time_per_microbatch": self.time_per_microbatch,
            "single_device_time": self.single_device_time,
            "data_parallel_time": self.data_parallel_time,
            # Derived, for readers of the file; from_dict recomputes them.
            "speedup_over_single_device": _finite(self.speedup_over_single_device),
            "speedup_over_data_parallel": _finite(self.speedup_over_data_parallel),
            "noam": self.noam,
            "memory_limit": self.memory_limit,
            "options": dict(self.options),
            "profile_source": self.profile_source,
            "topology": self.topology.to_dict(),
            "stages": [
                {
                    "first_layer": st.first_layer,
                    "last_layer": st.last_layer,
                    "replicas": st.replicas,
                    "devices": list(st.devices),
                    "in_flight": st.in_flight,
                    "compute_seconds": st.compute_seconds,
                    "memory_bytes": st.memory_bytes,
                    "replication": st.replication,
                }
                for st in self.stages
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        if data.get("format") != _FORMAT:
            raise PlanError(
                f"not a pdjax plan (format {data.get('format')!r}, expected {_FORMAT!r})"
            )
        try:
            stages = tuple(
                StagePlan(
                    first_layer=int(st["first_layer"]),
                    last_layer=int(st["last_layer"]),
                    devices=tuple(st["devices"]),
                    in_flight=int(st["in_flight"]),
                    compute_seconds=float(st["compute_seconds"]),
                    memory_bytes=float(st["memory_bytes"]),
                    # Plans written before round-robin replication split every stage.
                    replication=st.get("replication", "split"),
                )
                for st in data["stages"]
            )
            return cls(
                stages=stages,
                num_layers=int(data["num_layers"]),
                topology=Topology.from_dict(data["topology"]),
                cost_model=data["cost_model"],
                schedule=data["schedule"],
                partitioner=data["partitioner"],
                num_microbatches=int(data["num_microbatches"]),
                microbatch_size=int(data["microbatch_size"]),
                time_per_microbatch=float(data["time_per_microbatch"]),
                single_device_time=float(data["single_device_time"]),
                data_parallel_time=float(data["data_parallel_time"]),
                noam=int(data["noam"]),
                memory_limit=data.get("memory_limit"),
                options=data.get("options", {}),
                profile_source=data.get("profile_source", ""),
            )
        except KeyError as e:
            raise PlanError(f"the plan JSON lacks the field {e.args[0]!r}") from e

    def to_json(self) -> str:
        """Exact JSON (floats round-trip through ``repr``)."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str, what: str = "plan JSON") -> Plan:
        """Reads :meth:`to_json` output.

        Raises:
          PlanError: for text that is not JSON or not a pdjax plan.
        """
        return cls.from_dict(parse_json(text, what, PlanError))

    def save(self, path: str | Path) -> None:
        """Writes the JSON to ``path`` atomically (a temporary file, then a rename)."""
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise PlanError(f"cannot read plan {path}: {e.strerror}") from e
        return cls.from_json(text, f"plan {path}")


def _ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return math.inf if a > 0 else 1.0


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
