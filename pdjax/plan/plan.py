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
import numbers
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pdjax._jsonio import FieldReader, parse_json, read_text, write_atomic
from pdjax.errors import PlanError, ScheduleError
from pdjax.mesh import MeshAxes, describe_mesh, stage_mesh
from pdjax.plan.topology import Level, Topology
from pdjax.schedules.registry import SCHEDULE_KINDS
from pdjax.schedules.spec import ScheduleSpec

if TYPE_CHECKING:
    from pdjax.profile import Profile

__all__ = ["Plan", "StagePlan"]

_FORMAT = "pdjax.plan/2"
_FORMATS = ("pdjax.plan/1", _FORMAT)
"""The formats :meth:`Plan.from_dict` reads: 1 held the schedule's name and
``num_microbatches`` apart (and ``plan_auto``'s other choices in ``options``), 2 holds the
whole :class:`~pdjax.schedules.ScheduleSpec` as ``schedule``."""

AUTO_DECISION = (
    "schedule",
    "microbatches",
    "chunks",
    "extra_in_flight",
    "in_flight_option",
    "remat",
    "policies",
    "stages",
)
"""What format 1 kept of ``plan_auto``'s decision in ``options["auto"]`` (format 2 holds it
in the plan's spec and stages; what stays there is diagnostics)."""

REPLICATION = ("split", "round-robin")
"""How a replicated stage's devices share its microbatches (see :class:`StagePlan`)."""


def _whole(name: str, value: Any) -> int:
    """``value`` as an ``int``: a Python or NumPy integer; bools, floats (``0.0``, ``3.0``)
    and strings are refused rather than converted (the runtime slices layers with it)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise PlanError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}; write whole "
            "numbers, e.g. StagePlan(0, 3, (0,))"
        )
    return int(value)


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
        stashed activations, and under ``pdjax`` what the runtime holds besides: the
        gradient sum, the call's starting weights, its inputs placed up front, values in
        transit, zero bubble's cotangents; see :mod:`pdjax.partition.pricing.cost`), with the
        plan's exact in-flight count: under the ``pdjax`` cost model for the stage's
        replication mode, PipeDream's whole microbatches per replica (the ``paper``
        formula) under the others.
      replication: how the stage's devices share its work: ``"split"`` (each microbatch
        split across them; the default) or ``"round-robin"`` (PipeDream's: each device takes
        whole microbatches, ``r`` consecutive ones at once, and the stage all-reduces once
        per such group under ``pipedream``). A one-device stage is ``"split"``.
      mesh: the stage's devices as a mesh, ``((axis, size), ...)`` outermost first
        (:func:`pdjax.mesh.mesh_axes`: ``data``, ``fsdp``, other names, ``tensor``
        last, so ``tensor`` runs over neighbouring devices); ``None`` is ``((data, r),)``,
        the replication every plan before meshes meant. A mesh with an axis other than
        ``data`` shards the stage's weights (:mod:`pdjax.layers.sharding`).

    The planner fills in the three predictions; a stage written by hand for
    :class:`~pdjax.pipeline.Pipeline` (``StagePlan(0, 1, (0,))``: layers 0-1 on device 0,
    or :func:`~pdjax.pipeline.even_stages`) leaves them at their defaults (one microbatch
    in flight, no seconds, no bytes: nothing predicted).
    """

    first_layer: int
    last_layer: int
    devices: tuple[int, ...]
    in_flight: int = 1
    compute_seconds: float = 0.0
    memory_bytes: float = 0.0
    replication: str = "split"
    mesh: MeshAxes | None = None

    def __post_init__(self) -> None:
        for name in ("first_layer", "last_layer", "in_flight"):
            object.__setattr__(self, name, _whole(f"StagePlan {name}", getattr(self, name)))
        if isinstance(self.devices, str | bytes) or not isinstance(self.devices, Iterable):
            raise PlanError(
                f"StagePlan devices must be a tuple of device indices, e.g. (0,) or (0, 1), "
                f"got {type(self.devices).__name__} {self.devices!r}"
            )
        devices = tuple(_whole("StagePlan devices entry", d) for d in self.devices)
        object.__setattr__(self, "devices", devices)
        for name in ("compute_seconds", "memory_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise PlanError(f"StagePlan {name} must be a number, got {value!r}")
            if not (math.isfinite(float(value)) and float(value) >= 0):
                raise PlanError(f"StagePlan {name} must be finite and >= 0, got {value!r}")
        if self.first_layer > self.last_layer or self.first_layer < 0:
            raise PlanError(
                f"bad layer range {self.first_layer}-{self.last_layer}: a stage holds layers "
                "first_layer..last_layer (inclusive), 0 <= first_layer <= last_layer"
            )
        if min(devices, default=0) < 0 or len(set(devices)) != len(devices):
            raise PlanError(
                f"stage {self.first_layer}-{self.last_layer}: devices {list(devices)} must be "
                "distinct indices >= 0"
            )
        if self.in_flight < 1:
            raise PlanError(f"StagePlan in_flight must be >= 1, got {self.in_flight}")
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
        where = f"stage {self.first_layer}-{self.last_layer}"
        # the plain data-parallel mesh {data: r} is the default, kept as None
        object.__setattr__(
            self, "mesh", stage_mesh(self.mesh, len(devices), self.round_robin, where)
        )

    @property
    def mesh_axes(self) -> MeshAxes:
        """The stage's mesh, ``(("data", r),)`` when it is not sharded."""
        return self.mesh if self.mesh is not None else (("data", len(self.devices)),)

    @property
    def sharded(self) -> bool:
        """Whether the stage's weights are split over its mesh (an axis besides ``data``)."""
        return self.mesh is not None

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
      schedule: what the plan runs, the :class:`~pdjax.schedules.ScheduleSpec` its
        in-flight counts and memory are for: the kind, ``M`` microbatches per step (flush
        schedules, ``2bw``), chunks and the kind's options;
        :func:`~pdjax.partition.plan_auto` writes its choice here (with the memory policy
        per stage), and :class:`~pdjax.pipeline.Pipeline` runs it.
      partitioner: what made the plan (``"pipedream"``, ``"uniform"``, ``"balanced-time"``,
        ``"balanced-params"``, ``"manual"``).
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
      profile_hash: :meth:`Profile.content_hash` of the profile the plan was made from, or
        None (plans written before it was recorded): :meth:`check_profile` compares it with
        the profile a plan is used with.
    """

    stages: tuple[StagePlan, ...]
    num_layers: int
    topology: Topology
    cost_model: str
    schedule: ScheduleSpec
    partitioner: str
    microbatch_size: int
    time_per_microbatch: float
    single_device_time: float
    data_parallel_time: float
    noam: int
    memory_limit: float | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    profile_source: str = ""
    profile_hash: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "options", dict(self.options))
        if not isinstance(self.schedule, ScheduleSpec):
            raise PlanError(
                f"a plan's schedule is a ScheduleSpec, got {type(self.schedule).__name__} "
                f"{self.schedule!r}; write schedule=ScheduleSpec({self.schedule!r}, "
                "microbatches=M)"
            )
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        for s, stage in enumerate(self.stages):
            if not isinstance(stage, StagePlan):
                raise PlanError(
                    f"plan stage {s} is a {type(stage).__name__}, not a StagePlan; write "
                    "StagePlan(first_layer, last_layer, devices) per stage"
                )
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
    def num_microbatches(self) -> int:
        """``M``, microbatches per step (the schedule's)."""
        return self.schedule.microbatches

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

    def with_profile_hash(self, profile: Profile) -> Plan:
        """A copy that records ``profile``'s :meth:`~Profile.content_hash`: the profile the
        plan was made from (planners call this; :meth:`check_profile` reads it)."""
        return dataclasses.replace(self, profile_hash=profile.content_hash())

    def check_profile(
        self, profile: Profile, *, plan_file: str | None = None, profile_file: str | None = None
    ) -> None:
        """Raises PlanError if ``profile`` is not the one the plan was made from: another
        layer count, or (for plans that record it) another :meth:`Profile.content_hash`. Two
        models with the same layer count would otherwise pass, and the plan's stages would
        be priced with costs it was not made for.

        Args:
          profile: the profile the plan is about to be used with.
          plan_file, profile_file: their files, for the message.
        """
        plan_name = f"the plan {plan_file}" if plan_file else "the plan"
        prof_name = f"the profile {profile_file}" if profile_file else "the profile"
        redo = (
            f"pass the profile the plan was made from, or re-plan: pdjax plan --profile "
            f"{profile_file or 'PROFILE'} ... --out {plan_file or 'PLAN'}"
        )
        if self.num_layers != len(profile.layers):
            raise PlanError(
                f"{plan_name} covers {self.num_layers} layers but {prof_name} has "
                f"{len(profile.layers)}; {redo}"
            )
        if self.profile_hash is not None and self.profile_hash != profile.content_hash():
            raise PlanError(
                f"{plan_name} was made from another profile (content hash "
                f"{self.profile_hash[:12]}, from {self.profile_source or 'unknown source'!r}) "
                f"than {prof_name} (hash {profile.content_hash()[:12]}): same layer count, "
                f"other costs; {redo}"
            )

    def describe(self) -> str:
        """A readable rendering, e.g.
        ``"15-1: stage 0 = layers 0-30 x15, stage 1 = layers 31-40 x1"`` and the predictions.
        """
        parts = [
            f"stage {s} = layers {st.first_layer}-{st.last_layer} x{st.replicas}"
            + (" round-robin" if st.round_robin else "")
            + (f" ({describe_mesh(st.mesh)})" if st.mesh is not None else "")
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
        if not self.fits_memory and self.memory_limit is not None:
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
            "schedule": self.schedule.to_dict(),
            "partitioner": self.partitioner,
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
            "profile_hash": self.profile_hash,
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
                    **({"mesh": dict(st.mesh)} if st.mesh is not None else {}),
                }
                for st in self.stages
            ],
        }

    @classmethod
    def from_dict(cls, data: Any, what: str = "plan JSON") -> Plan:
        """Inverse of :meth:`to_dict`. Every field is checked (types, finite non-negative
        numbers, at least one microbatch and replica, stages that cover the layers in
        order on distinct devices of the topology); ``what`` (e.g. ``"plan p.json"``) and
        the field's path (``stages[1].in_flight``) name a bad one.

        Raises:
          PlanError: data that is not a pdjax plan, or a field that is missing or wrong.
        """
        if not isinstance(data, Mapping):
            raise PlanError(
                f'{what}: expected a JSON object with "format": {_FORMAT!r}, got '
                f"{type(data).__name__ if data is not None else 'null'}"
            )
        if data.get("format") not in _FORMATS:
            raise PlanError(
                f"{what}: not a pdjax plan (format {data.get('format')!r}, expected {_FORMAT!r})"
            )
        r = FieldReader(
            f"{what}: malformed pdjax plan",
            PlanError,
            "fix that field, or make the plan again (pdjax plan ... --out FILE)",
        )
        topology = _topology_from_dict(r, r.field(data, "topology", ""))
        raw_stages = r.array(r.field(data, "stages", ""), "stages")
        stages = tuple(_stage_from_dict(r, st, f"stages[{i}]") for i, st in enumerate(raw_stages))
        _check_devices(r, stages, topology)
        options = r.plain(r.mapping(r.field(data, "options", "", {}), "options"), "options")
        if "optimizer_state_factor" in options:  # read as a number by the simulator
            r.number(options["optimizer_state_factor"], "options.optimizer_state_factor")
        limit = r.optional_number(r.field(data, "memory_limit", "", None), "memory_limit")
        if limit is not None and limit <= 0:
            r.fail("memory_limit", f"must be positive bytes or null, got {limit!r}")
        digest = r.field(data, "profile_hash", "", None)  # None: a plan from before hashes
        fields: dict[str, Any] = dict(  # each value already checked by its reader
            num_layers=_int(r, data, "num_layers", 1),
            cost_model=r.string(r.field(data, "cost_model", ""), "cost_model"),
            partitioner=r.string(r.field(data, "partitioner", ""), "partitioner"),
            microbatch_size=_int(r, data, "microbatch_size", 1),
            time_per_microbatch=_float(r, data, "time_per_microbatch"),
            single_device_time=_float(r, data, "single_device_time"),
            data_parallel_time=_float(r, data, "data_parallel_time"),
            noam=_int(r, data, "noam", 1),
            profile_source=r.string(r.field(data, "profile_source", "", ""), "profile_source"),
            profile_hash=None if digest is None else r.string(digest, "profile_hash"),
        )
        if data["format"] == _FORMAT:
            raw = r.mapping(r.field(data, "schedule", ""), "schedule")
            try:
                spec = ScheduleSpec.from_dict(raw, "schedule")
            except ScheduleError as e:
                r.fail("schedule", str(e))
        else:
            spec, options = _spec_of_format_1(r, data, options)
        try:
            return cls(
                stages=stages,
                topology=topology,
                memory_limit=limit,
                options=options,
                schedule=spec,
                **fields,
            )
        except PlanError as e:  # the constructor's own checks: coverage, shared devices
            raise PlanError(f"{what}: stages: {e}; {r.advice}") from e

    def to_json(self) -> str:
        """Exact JSON (floats round-trip through ``repr``)."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str, what: str = "plan JSON") -> Plan:
        """Reads :meth:`to_json` output.

        Raises:
          PlanError: for text that is not JSON or not a pdjax plan.
        """
        return cls.from_dict(parse_json(text, what, PlanError), what)

    def save(self, path: str | Path) -> None:
        """Writes the JSON to ``path`` atomically (a temporary file, then a rename).

        Raises:
          PlanError: the path cannot be written (the message names it).
        """
        write_atomic(path, self.to_json(), what="plan", error=PlanError)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Reads a plan JSON (:meth:`save`).

        Raises:
          PlanError: an unreadable file, not JSON, or not a valid pdjax plan.
        """
        path = Path(path)
        return cls.from_json(read_text(path, "plan", PlanError), f"plan {path}")


def _spec_of_format_1(
    r: FieldReader, data: Mapping[str, Any], options: dict[str, Any]
) -> tuple[ScheduleSpec, dict[str, Any]]:
    """The spec of a format-1 plan, and its options without the decision the spec now
    holds: the schedule's name and ``num_microbatches``, ``options["in_flight"]``, and
    ``plan_auto``'s choice in ``options["auto"]`` (its diagnostics stay there)."""
    name = r.string(r.field(data, "schedule", ""), "schedule")
    settings: dict[str, Any] = {"microbatches": _int(r, data, "num_microbatches", 1)}
    options = dict(options)
    if "in_flight" in options:
        settings["in_flight"] = options.pop("in_flight")
    auto = options.get("auto")
    if isinstance(auto, Mapping):
        if auto.get("schedule", name) != name:
            r.fail("options.auto.schedule", f"{auto['schedule']!r} differs from {name!r}")
        for key, field in (("chunks", "chunks"), ("extra_in_flight", "extra_in_flight"),
                           ("in_flight_option", "in_flight")):  # fmt: skip
            if key in auto:
                settings[field] = auto[key]
        kind = SCHEDULE_KINDS.get(name)
        if kind is not None and "chunks" in settings:  # zb-v's candidates recorded 1
            settings["chunks"] = kind.chunks_for(settings["chunks"])
        if "policies" in auto or "remat" in auto:
            settings["remat"] = tuple(auto.get("policies") or auto["remat"])
        options["auto"] = {k: v for k, v in auto.items() if k not in AUTO_DECISION}
    try:
        return ScheduleSpec(name, **settings), options
    except ScheduleError as e:
        r.fail("schedule", str(e))


def _ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return math.inf if a > 0 else 1.0


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# -- reading plan files -----------------------------------------------------------------


def _int(r: FieldReader, data: Mapping[str, Any], key: str, minimum: int) -> int:
    return r.integer(r.field(data, key, ""), key, minimum=minimum)


def _float(r: FieldReader, data: Mapping[str, Any], key: str) -> float:
    return float(r.number(r.field(data, key, ""), key))


def _stage_from_dict(r: FieldReader, raw: Any, path: str) -> StagePlan:
    """One stage record: layer indices, distinct device ids, at least one microbatch in
    flight, and seconds and bytes that are finite and not negative."""
    raw = r.mapping(raw, path)
    devices = [
        r.integer(d, f"{path}.devices[{k}]", minimum=0)
        for k, d in enumerate(r.array(r.field(raw, "devices", path), f"{path}.devices"))
    ]
    if not devices:
        r.fail(f"{path}.devices", "a stage needs at least one device")
    if len(set(devices)) != len(devices):
        r.fail(f"{path}.devices", f"a device is listed twice in {devices}")
    if "replicas" in raw:  # derived, for readers; an edit that disagrees is a mistake
        replicas = r.integer(raw["replicas"], f"{path}.replicas", minimum=1)
        if replicas != len(devices):
            r.fail(f"{path}.replicas", f"{replicas}, but {len(devices)} devices are listed")
    first = r.integer(r.field(raw, "first_layer", path), f"{path}.first_layer", minimum=0)
    last = r.integer(r.field(raw, "last_layer", path), f"{path}.last_layer", minimum=0)
    if last < first:
        r.fail(path, f"last_layer {last} is before first_layer {first}")
    values: dict[str, Any] = dict(  # each value already checked by its reader
        in_flight=r.integer(r.field(raw, "in_flight", path), f"{path}.in_flight", minimum=1),
        compute_seconds=float(
            r.number(r.field(raw, "compute_seconds", path), f"{path}.compute_seconds")
        ),
        memory_bytes=float(r.number(r.field(raw, "memory_bytes", path), f"{path}.memory_bytes")),
        # Plans written before round-robin replication split every stage.
        replication=r.string(raw.get("replication", "split"), f"{path}.replication"),
    )
    if "mesh" in raw:  # plans before sharded stages had none: {data: replicas}
        mesh = r.mapping(raw["mesh"], f"{path}.mesh")
        values["mesh"] = tuple(
            (str(k), r.integer(v, f"{path}.mesh.{k}", minimum=1)) for k, v in mesh.items()
        )
    try:
        return StagePlan(first_layer=first, last_layer=last, devices=tuple(devices), **values)
    except PlanError as e:  # its own checks: the replication mode
        r.fail(path, str(e))


def _topology_from_dict(r: FieldReader, raw: Any) -> Topology:
    """The plan's topology record, checked field by field (``topology.levels[0].workers``)
    before :class:`Topology` checks the values."""
    raw = r.mapping(raw, "topology")
    if raw.get("format") != "pdjax.topology/1":
        r.fail("topology.format", f"expected 'pdjax.topology/1', got {raw.get('format')!r}")
    levels = []
    for k, lvl in enumerate(r.array(r.field(raw, "levels", "topology"), "topology.levels")):
        path = f"topology.levels[{k}]"
        lvl = r.mapping(lvl, path)
        r.unknown_keys(lvl, {f.name for f in dataclasses.fields(Level)}, path)
        bandwidth = r.number(r.field(lvl, "bandwidth", path), f"{path}.bandwidth")
        if bandwidth <= 0:
            r.fail(f"{path}.bandwidth", f"must be positive bytes/s, got {bandwidth!r}")
        levels.append(
            Level(
                workers=r.integer(r.field(lvl, "workers", path), f"{path}.workers", minimum=1),
                bandwidth=bandwidth,
                name=r.string(lvl.get("name", ""), f"{path}.name"),
                latency=r.number(lvl.get("latency", 0.0), f"{path}.latency"),
            )
        )
    memory = r.optional_number(raw.get("memory_per_device"), "topology.memory_per_device")
    ids = raw.get("device_ids")
    if ids is not None:
        ids = tuple(
            r.integer(d, f"topology.device_ids[{k}]", minimum=0)
            for k, d in enumerate(r.array(ids, "topology.device_ids"))
        )
    name = r.string(raw.get("name", ""), "topology.name")
    try:
        return Topology(levels=tuple(levels), memory_per_device=memory, name=name, device_ids=ids)
    except PlanError as e:  # its own checks: a zero memory limit, device_ids of another length
        r.fail("topology", str(e))


def _check_devices(r: FieldReader, stages: tuple[StagePlan, ...], topology: Topology) -> None:
    """Every stage's devices must be devices of the plan's topology."""
    known = topology.device_ids
    for s, stage in enumerate(stages):
        for d in stage.devices:
            if (d not in known) if known is not None else (d >= topology.num_devices):
                r.fail(
                    f"stages[{s}].devices",
                    f"device {d} is not one of the topology's {topology.num_devices} devices",
                )
