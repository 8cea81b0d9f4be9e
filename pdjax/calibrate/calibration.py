"""The :class:`Calibration` data type and its measures (:class:`StageMeasure`,
:class:`LinkMeasure`, :class:`AllReduceMeasure`): plain data, look-ups for the planner's
hooks, the checks that refuse a calibration for another model, plan or device set, and
JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pdjax._jsonio import parse_json, write_atomic
from pdjax.errors import CalibrationError

__all__ = ["AllReduceMeasure", "Calibration", "LinkMeasure", "StageMeasure"]

FORMAT = "pdjax-calibration"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class StageMeasure:
    """Seconds of one candidate stage, per microbatch, on one of its devices.

    Attributes:
      first, last: the stage's layers (inclusive).
      replicas: devices the stage runs on.
      replication: ``"split"`` or ``"round-robin"`` (a one-device stage is ``"split"``).
      forward: seconds of the forward (the last stage: with the loss).
      backward: seconds of the backward (forward and backward together, less the forward).
      update: seconds of one optimizer update of the stage's weights (no all-reduce).
      allreduce: seconds of one all-reduce of the stage's gradients over its devices, as the
        runtime does it (None for one device, or not measured).
      rows: samples per device per program the times were measured at.
    """

    first: int
    last: int
    replicas: int = 1
    replication: str = "split"
    forward: float = 0.0
    backward: float = 0.0
    update: float = 0.0
    allreduce: float | None = None
    rows: int = 0

    @property
    def key(self) -> tuple[int, int, int, str]:
        return (self.first, self.last, self.replicas, self.replication)

    @property
    def compute(self) -> float:
        """Forward plus backward seconds per microbatch."""
        return self.forward + self.backward


@dataclasses.dataclass(frozen=True)
class LinkMeasure:
    """One direction of one link: ``seconds(n) = latency + n / bandwidth``.

    Attributes:
      src, dst: device ids.
      latency: seconds per message.
      bandwidth: bytes per second.
      send_seconds: host seconds the sender's call takes per message (across processes).
      sizes, seconds: the measured points (bytes, median seconds) the fit is made from.
      transport: ``"device_put"`` or ``"collective"``.
    """

    src: int
    dst: int
    latency: float
    bandwidth: float
    send_seconds: float = 0.0
    sizes: tuple[int, ...] = ()
    seconds: tuple[float, ...] = ()
    transport: str = "device_put"

    def time(self, nbytes: float) -> float:
        """Predicted seconds to move ``nbytes`` one way."""
        return self.latency + nbytes / self.bandwidth


@dataclasses.dataclass(frozen=True)
class AllReduceMeasure:
    """The all-reduce over one device group: ``seconds(n) = latency + n / bandwidth``."""

    devices: tuple[int, ...]
    latency: float
    bandwidth: float
    sizes: tuple[int, ...] = ()
    seconds: tuple[float, ...] = ()

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured costs for one model, microbatch size, optimizer and device set (JSON).

    Attributes:
      model: the model's fingerprint (:func:`model_fingerprint`): ``layers`` (names) and
        ``param_bytes`` (per layer).
      microbatch_size: samples per microbatch.
      devices: ids of the devices measured on.
      platform, device_kind: of those devices.
      optimizer: a description of the optimizer (its update was timed).
      stages, links, allreduces: the measurements.
      profile_ratio: the whole model measured as one program over the profile's per-layer
        sum (forward and backward), for ranges not measured; None when not known.
    """

    model: dict[str, Any]
    microbatch_size: int
    devices: tuple[int, ...]
    platform: str = ""
    device_kind: str = ""
    optimizer: str = ""
    stages: tuple[StageMeasure, ...] = ()
    links: tuple[LinkMeasure, ...] = ()
    allreduces: tuple[AllReduceMeasure, ...] = ()
    profile_ratio: float | None = None

    # -- look-ups -----------------------------------------------------------------------

    def stage(
        self, first: int, last: int, replicas: int = 1, replication: str = "split"
    ) -> StageMeasure | None:
        """The measure of a stage, or None."""
        mode = "split" if replicas == 1 else replication
        for st in self.stages:
            if st.key == (first, last, replicas, mode):
                return st
        return None

    def link(self, src: int, dst: int) -> LinkMeasure | None:
        """The measure of the direction ``src -> dst`` (device ids), or None."""
        for ln in self.links:
            if (ln.src, ln.dst) == (src, dst):
                return ln
        return None

    def allreduce(self, devices: Iterable[int]) -> AllReduceMeasure | None:
        """The fitted all-reduce over exactly ``devices`` (ids, any order), or None."""
        want = sorted(devices)
        for ar in self.allreduces:
            if sorted(ar.devices) == want:
                return ar
        return None

    def allreduce_seconds(self, nbytes: float, devices: Iterable[int]) -> float | None:
        """Seconds of one all-reduce of ``nbytes`` over ``devices``, from the fit."""
        ar = self.allreduce(devices)
        return None if ar is None else ar.time(nbytes)

    def stage_seconds(
        self, schedule: str, num_microbatches: int = 1
    ) -> Callable[[int, int, int, str], float | None]:
        """The planner's hook (``plan_pipedream(stage_seconds=...)``): ``(first, last,
        replicas, replication) -> seconds per microbatch`` of a measured stage on one of
        its devices, forward + backward + its share of the update under ``schedule``
        (every microbatch under ``pipedream``, once per group of ``replicas`` when
        round-robin there, once per ``num_microbatches`` otherwise); None if not measured.
        The all-reduce is not included (:meth:`allreduce_function`)."""

        def seconds(first: int, last: int, replicas: int, replication: str) -> float | None:
            m = self.stage(first, last, replicas, replication)
            if m is None:
                return None
            if schedule == "pipedream":
                share = 1.0 / replicas if m.replication == "round-robin" else 1.0
            else:
                share = 1.0 / max(1, num_microbatches)
            return m.compute + m.update * share

        return seconds

    def allreduce_function(self) -> Callable[[float, Any], float | None]:
        """The planner's hook (``plan_pipedream(allreduce_seconds=...)``): ``(param_bytes,
        devices or a device count) -> seconds`` of one all-reduce: a measured stage's own
        gradient tree when one of that size and device count was timed, else the fit of a
        device group of that count; None when neither was measured."""
        sizes = list(self.model.get("param_bytes", []))

        def seconds(param_bytes: float, devices: Any) -> float | None:
            count = devices if isinstance(devices, int) else len(tuple(devices))
            for m in self.stages:
                if m.allreduce is not None and m.replicas == count and sizes:
                    if sum(sizes[m.first : m.last + 1]) == round(param_bytes):
                        return m.allreduce
            for ar in self.allreduces:
                if len(ar.devices) == count:
                    return ar.time(param_bytes)
            return None

        return seconds

    # -- checks -------------------------------------------------------------------------

    def check(
        self,
        *,
        layers: Sequence[str] | None = None,
        param_bytes: Sequence[int] | None = None,
        microbatch_size: int | None = None,
        plan: Any = None,
        devices: Sequence[Any] | None = None,
        require_stages: bool = False,
    ) -> None:
        """Refuses this calibration for another model, plan or device set.

        Args:
          layers: the model's layer names (a profile's or a layer sequence's).
          param_bytes: parameter bytes per layer (checked when both sides know them).
          microbatch_size: samples per microbatch the costs are wanted for.
          plan: a :class:`~pdjax.partition.Plan`: its microbatch size, and its devices must
            be among the calibration's; with ``require_stages`` every stage must have been
            measured.
          devices: JAX devices the plan will run on: ids, platform and kind must match.

        Raises:
          CalibrationError: naming every difference found.
        """
        diffs = _model_diffs(self, layers, param_bytes)
        size = microbatch_size if plan is None else plan.microbatch_size
        if size is not None and size != self.microbatch_size:
            diffs.append(
                f"microbatch of {size} samples wanted, the calibration measured "
                f"{self.microbatch_size}"
            )
        if plan is not None:
            diffs += _plan_diffs(self, plan, require_stages)
        if devices is not None:
            diffs += _device_diffs(self, devices)
        if diffs:
            raise CalibrationError(
                "the calibration does not fit: "
                + "; ".join(diffs)
                + ". Calibrate again for this model, plan and devices (pdjax calibrate)"
            )

    # -- JSON ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {"format": FORMAT, "version": VERSION, **data}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], what: str = "calibration") -> Calibration:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise CalibrationError(f"{what} is not a pdjax calibration (no format {FORMAT!r})")
        if data.get("version") != VERSION:
            raise CalibrationError(
                f"{what} has version {data.get('version')!r}; this pdjax reads {VERSION}"
            )
        try:
            return cls(
                model=dict(data["model"]),
                microbatch_size=int(data["microbatch_size"]),
                devices=tuple(int(d) for d in data["devices"]),
                platform=str(data.get("platform", "")),
                device_kind=str(data.get("device_kind", "")),
                optimizer=str(data.get("optimizer", "")),
                stages=tuple(StageMeasure(**s) for s in data.get("stages", ())),
                links=tuple(
                    LinkMeasure(
                        **{
                            **ln,
                            "sizes": tuple(ln.get("sizes", ())),
                            "seconds": tuple(ln.get("seconds", ())),
                        }
                    )
                    for ln in data.get("links", ())
                ),
                allreduces=tuple(
                    AllReduceMeasure(
                        **{
                            **a,
                            "devices": tuple(a["devices"]),
                            "sizes": tuple(a.get("sizes", ())),
                            "seconds": tuple(a.get("seconds", ())),
                        }
                    )
                    for a in data.get("allreduces", ())
                ),
                profile_ratio=data.get("profile_ratio"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationError(f"{what} is malformed: {e}") from e

    def save(self, path: str | Path) -> Path:
        write_atomic(
            path, json.dumps(self.to_json(), indent=1), what="calibration", error=CalibrationError
        )
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        path = Path(path)
        if not path.is_file():
            raise CalibrationError(f"no calibration file at {path}; make one with pdjax calibrate")
        return cls.from_json(
            parse_json(path.read_text(), f"calibration {path}", CalibrationError), str(path)
        )

    def merge(self, other: Calibration) -> Calibration:
        """This calibration with ``other``'s measurements added (``other``'s win). Both
        must be for the same model, microbatch size and platform."""
        self.check(
            layers=other.model.get("layers"),
            param_bytes=other.model.get("param_bytes"),
            microbatch_size=other.microbatch_size,
        )
        stages = {s.key: s for s in self.stages} | {s.key: s for s in other.stages}
        links = {(x.src, x.dst): x for x in self.links} | {(x.src, x.dst): x for x in other.links}
        ars = {tuple(sorted(a.devices)): a for a in self.allreduces} | {
            tuple(sorted(a.devices)): a for a in other.allreduces
        }
        return dataclasses.replace(
            self,
            devices=tuple(sorted(set(self.devices) | set(other.devices))),
            stages=tuple(stages.values()),
            links=tuple(links.values()),
            allreduces=tuple(ars.values()),
            profile_ratio=other.profile_ratio
            if other.profile_ratio is not None
            else self.profile_ratio,
        )

    def with_profile_ratio(self, profile: Any) -> Calibration:
        """Sets :attr:`profile_ratio` from the whole model's one-device measure (if held)
        against ``profile``'s sum of forward and backward seconds."""
        whole = self.stage(0, len(self.model.get("layers", [])) - 1)
        if whole is None:
            return self
        scale = self.microbatch_size / profile.batch_size
        total = (sum(profile.forward_seconds()) + sum(profile.backward_seconds())) * scale
        if not total > 0:
            return self
        return dataclasses.replace(self, profile_ratio=whole.compute / total)


def _model_diffs(
    cal: Calibration, layers: Sequence[str] | None, param_bytes: Sequence[int] | None
) -> list[str]:
    """How a model's layer names and parameter bytes differ from ``cal``'s, in words."""
    diffs: list[str] = []
    mine = list(cal.model.get("layers", []))
    if layers is not None and list(layers) != mine:
        n, m = len(layers), len(mine)
        if n != m:
            diffs.append(f"the model has {n} layers, the calibration {m}")
        else:
            i = next(k for k in range(n) if layers[k] != mine[k])
            diffs.append(f"layer {i} is {layers[i]!r} in the model, {mine[i]!r} in the calibration")
    theirs = cal.model.get("param_bytes")
    if param_bytes is not None and theirs and list(param_bytes) != list(theirs):
        if len(param_bytes) == len(theirs):
            i = next(k for k in range(len(theirs)) if param_bytes[k] != theirs[k])
            diffs.append(
                f"layer {i} has {param_bytes[i]} parameter bytes in the model, "
                f"{theirs[i]} in the calibration"
            )
    return diffs


def _plan_diffs(cal: Calibration, plan: Any, require_stages: bool) -> list[str]:
    """The plan's devices ``cal`` did not measure, and (``require_stages``) its stages
    ``cal`` does not hold, in words."""
    diffs: list[str] = []
    used = sorted({d for st in plan.stages for d in st.devices})
    missing = [d for d in used if d not in cal.devices]
    if missing:
        diffs.append(
            f"the plan uses devices {missing} that the calibration did not measure "
            f"(it has {list(cal.devices)})"
        )
    if require_stages:
        absent = [
            f"{st.first_layer}-{st.last_layer} x{st.replicas}"
            + ("rr" if st.replication == "round-robin" else "")
            for st in plan.stages
            if cal.stage(st.first_layer, st.last_layer, st.replicas, st.replication) is None
        ]
        if absent:
            diffs.append(f"stages {absent} of the plan were not measured")
    return diffs


def _device_diffs(cal: Calibration, devices: Sequence[Any]) -> list[str]:
    """``cal``'s devices missing from ``devices``, and a platform or kind that differs."""
    diffs: list[str] = []
    ids = [int(d.id) for d in devices]
    missing = [d for d in cal.devices if d not in ids]
    if missing:
        diffs.append(f"devices {missing} of the calibration are not among {ids}")
    kinds = {(d.platform, d.device_kind) for d in devices}
    if cal.platform and (cal.platform, cal.device_kind) not in kinds:
        diffs.append(
            f"the calibration was measured on {cal.platform} {cal.device_kind!r}, "
            f"these devices are {sorted(kinds)}"
        )
    return diffs
