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

from pdjax._jsonio import FieldReader, describe_value, parse_json, read_text, write_atomic
from pdjax.errors import CalibrationError
from pdjax.pipeline.transport import TRANSPORTS
from pdjax.schedules import SEMANTICS

__all__ = ["AllReduceMeasure", "Calibration", "LinkMeasure", "StageMeasure"]

FORMAT = "pdjax-calibration"
VERSION = 1

#: The longest time a calibration file may hold (seconds; about 11.6 days): no stage,
#: transfer or update of one microbatch comes near it, and the planner's sums of times
#: beyond it could overflow to infinity (two times of 1e308 s do).
MAX_SECONDS = 1e6
#: The slowest link or all-reduce a calibration file may hold (bytes per second): below
#: it a transfer's time, ``latency + bytes / bandwidth``, can overflow to infinity.
MIN_BANDWIDTH = 1.0
#: The largest :attr:`Calibration.profile_ratio`: the whole model measured as one
#: program against the profile's per-layer sum; a ratio beyond it is a damaged file.
MAX_PROFILE_RATIO = 1e6


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

        row = SEMANTICS.get(schedule)
        per_microbatch = row is not None and row.updates_per_microbatch

        def seconds(first: int, last: int, replicas: int, replication: str) -> float | None:
            m = self.stage(first, last, replicas, replication)
            if m is None:
                return None
            if per_microbatch:
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
    def from_json(cls, data: Any, what: str = "calibration") -> Calibration:
        """The calibration ``data`` (parsed JSON) holds, every field checked.

        Args:
          data: what :meth:`to_json` wrote, parsed.
          what: the file, for messages (e.g. ``"cal.json"``).

        Raises:
          CalibrationError: naming ``what``, the field path (``stages[2].forward``) and what
            is wrong: another format or version, a missing or unknown field, a wrongly
            typed value, a negative or non-finite time or one above :data:`MAX_SECONDS`, a
            bandwidth below :data:`MIN_BANDWIDTH`, a count below 1, a stage outside
            the model, a link or all-reduce over devices not measured, an entry twice.
        """
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise CalibrationError(
                f"{what} is not a pdjax calibration (no format {FORMAT!r}); make one with "
                "pdjax calibrate"
            )
        version = data.get("version")
        if isinstance(version, bool) or version != VERSION:
            raise CalibrationError(
                f"{what} has version {describe_value(version)}; this pdjax reads {VERSION}: "
                "re-create it with pdjax calibrate"
            )
        return _Reader(what).calibration(data)

    def save(self, path: str | Path) -> Path:
        write_atomic(
            path, json.dumps(self.to_json(), indent=1), what="calibration", error=CalibrationError
        )
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """The calibration in the file ``path`` (what :meth:`save` and ``pdjax calibrate``
        write), every field checked (:meth:`from_json`).

        Raises:
          CalibrationError: naming the file (and the line or field): missing, unreadable,
            not UTF-8, not JSON, or a field :meth:`from_json` refuses; "re-create it with
            pdjax calibrate".
        """
        path = Path(path)
        if not path.is_file():
            raise CalibrationError(f"no calibration file at {path}; make one with pdjax calibrate")
        what = f"calibration {path}"
        try:
            data = parse_json(
                read_text(path, "calibration", CalibrationError), what, CalibrationError
            )
        except CalibrationError as e:
            if isinstance(e.__cause__, OSError):
                raise
            text = str(e)
            advice = f" If so, {_ADVICE}" if text.endswith("?") else f"; {_ADVICE}"
            raise CalibrationError(text + advice) from e.__cause__
        return cls.from_json(data, what)

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


_ADVICE = "re-create it with pdjax calibrate"
_TOP = {
    "format", "version", "model", "microbatch_size", "devices", "platform", "device_kind",
    "optimizer", "stages", "links", "allreduces", "profile_ratio",
}  # fmt: skip
_MODEL = {"layers", "param_bytes"}
_STAGE = {f.name for f in dataclasses.fields(StageMeasure)}
_LINK = {f.name for f in dataclasses.fields(LinkMeasure)}
_ALLREDUCE = {f.name for f in dataclasses.fields(AllReduceMeasure)}
_REPLICATION = ("split", "round-robin")
_TRANSPORTS = tuple(TRANSPORTS)


class _Reader(FieldReader):
    """Reads a calibration's parsed JSON field by field (see :meth:`Calibration.from_json`)."""

    def __init__(self, what: str) -> None:
        super().__init__(what, CalibrationError, _ADVICE)

    def calibration(self, data: Mapping[str, Any]) -> Calibration:
        self.unknown_keys(data, _TOP, "")
        model = self.model(self.field(data, "model", ""))
        devices = self.device_ids(self.field(data, "devices", ""), "devices", known=None)
        ratio = self.field(data, "profile_ratio", "", None)
        if ratio is not None and self.number(ratio, "profile_ratio") <= 0:
            self.fail("profile_ratio", f"must be above 0, got {ratio!r}")
        if ratio is not None and ratio > MAX_PROFILE_RATIO:
            self.fail(
                "profile_ratio",
                f"must be at most {MAX_PROFILE_RATIO:g} (the whole model measured against the "
                f"profile's sum), got {ratio!r}",
            )
        stages = tuple(
            self.stage(s, f"stages[{i}]", len(model["layers"]))
            for i, s in enumerate(self.array(self.field(data, "stages", "", []), "stages"))
        )
        links = tuple(
            self.link(ln, f"links[{i}]", devices)
            for i, ln in enumerate(self.array(self.field(data, "links", "", []), "links"))
        )
        allreduces = tuple(
            self.allreduce(a, f"allreduces[{i}]", devices)
            for i, a in enumerate(self.array(self.field(data, "allreduces", "", []), "allreduces"))
        )
        self.unique([s.key for s in stages], "stages", "a stage (first, last, replicas, mode)")
        self.unique([(ln.src, ln.dst) for ln in links], "links", "a link (src, dst)")
        self.unique([tuple(sorted(a.devices)) for a in allreduces], "allreduces", "a device group")
        return Calibration(
            model=model,
            microbatch_size=self.integer(
                self.field(data, "microbatch_size", ""), "microbatch_size", minimum=1
            ),
            devices=devices,
            platform=self.string(self.field(data, "platform", "", ""), "platform"),
            device_kind=self.string(self.field(data, "device_kind", "", ""), "device_kind"),
            optimizer=self.string(self.field(data, "optimizer", "", ""), "optimizer"),
            stages=stages,
            links=links,
            allreduces=allreduces,
            profile_ratio=None if ratio is None else float(ratio),
        )

    def model(self, value: Any) -> dict[str, Any]:
        model = self.mapping(value, "model")
        self.unknown_keys(model, _MODEL, "model")
        layers = [
            self.string(n, f"model.layers[{i}]")
            for i, n in enumerate(self.array(self.field(model, "layers", "model"), "model.layers"))
        ]
        if not layers:
            self.fail("model.layers", "expected at least one layer name, got none")
        sizes = self.array(self.field(model, "param_bytes", "model"), "model.param_bytes")
        if len(sizes) != len(layers):
            self.fail(
                "model.param_bytes",
                f"expected one entry per layer ({len(layers)}), got {len(sizes)}",
            )
        param_bytes = [
            self.integer(n, f"model.param_bytes[{i}]", minimum=0) for i, n in enumerate(sizes)
        ]
        return {"layers": layers, "param_bytes": param_bytes}

    def device_ids(self, value: Any, path: str, known: tuple[int, ...] | None) -> tuple[int, ...]:
        ids = tuple(
            self.integer(d, f"{path}[{i}]", minimum=0)
            for i, d in enumerate(self.array(value, path))
        )
        if not ids:
            self.fail(path, "expected at least one device id, got none")
        if len(set(ids)) != len(ids):
            self.fail(path, f"a device is listed twice in {list(ids)}")
        if known is not None and not set(ids) <= set(known):
            missing = sorted(set(ids) - set(known))
            self.fail(path, f"devices {missing} are not among the calibration's {list(known)}")
        return ids

    def seconds(self, obj: Mapping[str, Any], key: str, path: str, default: Any) -> float:
        return self.time(self.field(obj, key, path, default), f"{path}.{key}")

    def time(self, value: Any, path: str) -> float:
        """A measured time: a finite number of seconds from 0 to :data:`MAX_SECONDS`."""
        seconds = float(self.number(value, path))
        if seconds > MAX_SECONDS:
            self.fail(
                path,
                f"{seconds:g} s is not a time pdjax measures (at most {MAX_SECONDS:g} s, about "
                "11.6 days, for one microbatch); the planner's sums of such times overflow",
            )
        return seconds

    def choice(self, value: Any, path: str, choices: tuple[str, ...]) -> str:
        if self.string(value, path) not in choices:
            self.fail(path, f"expected one of {list(choices)}, got {value!r}")
        return str(value)

    def stage(self, value: Any, path: str, num_layers: int) -> StageMeasure:
        obj = self.mapping(value, path)
        self.unknown_keys(obj, _STAGE, path)
        first = self.integer(self.field(obj, "first", path), f"{path}.first", minimum=0)
        last = self.integer(self.field(obj, "last", path), f"{path}.last", minimum=first)
        if last >= num_layers:
            self.fail(f"{path}.last", f"layer {last} is past the model's {num_layers} layers")
        replicas = self.integer(self.field(obj, "replicas", path, 1), f"{path}.replicas", minimum=1)
        mode = self.choice(
            self.field(obj, "replication", path, "split"), f"{path}.replication", _REPLICATION
        )
        if replicas == 1 and mode != "split":
            self.fail(f"{path}.replication", f"a stage on one device is 'split', got {mode!r}")
        allreduce = self.field(obj, "allreduce", path, None)
        return StageMeasure(
            first=first,
            last=last,
            replicas=replicas,
            replication=mode,
            forward=self.seconds(obj, "forward", path, 0.0),
            backward=self.seconds(obj, "backward", path, 0.0),
            update=self.seconds(obj, "update", path, 0.0),
            allreduce=None if allreduce is None else self.time(allreduce, f"{path}.allreduce"),
            rows=self.integer(self.field(obj, "rows", path, 0), f"{path}.rows", minimum=0),
        )

    def fit(
        self, obj: Mapping[str, Any], path: str
    ) -> tuple[float, float, tuple[int, ...], tuple[float, ...]]:
        """``(latency, bandwidth, sizes, seconds)`` of a link's or all-reduce's fit."""
        latency = self.time(self.field(obj, "latency", path), f"{path}.latency")
        bandwidth = float(self.number(self.field(obj, "bandwidth", path), f"{path}.bandwidth"))
        if bandwidth <= 0:
            self.fail(f"{path}.bandwidth", f"must be above 0 bytes/s, got {bandwidth!r}")
        if bandwidth < MIN_BANDWIDTH:  # bytes / bandwidth would overflow to infinity
            self.fail(
                f"{path}.bandwidth",
                f"must be at least {MIN_BANDWIDTH:g} byte/s (no link measured is slower; "
                f"the time of a transfer over it overflows), got {bandwidth!r}",
            )
        sizes = tuple(
            self.integer(n, f"{path}.sizes[{i}]", minimum=0)
            for i, n in enumerate(self.array(self.field(obj, "sizes", path, []), f"{path}.sizes"))
        )
        seconds = self.array(self.field(obj, "seconds", path, []), f"{path}.seconds")
        if len(seconds) != len(sizes):
            self.fail(
                f"{path}.seconds", f"expected one per size ({len(sizes)}), got {len(seconds)}"
            )
        times = tuple(self.time(s, f"{path}.seconds[{i}]") for i, s in enumerate(seconds))
        return latency, bandwidth, sizes, times

    def link(self, value: Any, path: str, devices: tuple[int, ...]) -> LinkMeasure:
        obj = self.mapping(value, path)
        self.unknown_keys(obj, _LINK, path)
        src = self.integer(self.field(obj, "src", path), f"{path}.src", minimum=0)
        dst = self.integer(self.field(obj, "dst", path), f"{path}.dst", minimum=0)
        for name, d in (("src", src), ("dst", dst)):
            if d not in devices:
                self.fail(
                    f"{path}.{name}", f"device {d} is not among the calibration's {list(devices)}"
                )
        if src == dst:
            self.fail(path, f"a link from device {src} to itself")
        latency, bandwidth, sizes, seconds = self.fit(obj, path)
        return LinkMeasure(
            src=src,
            dst=dst,
            latency=latency,
            bandwidth=bandwidth,
            send_seconds=self.seconds(obj, "send_seconds", path, 0.0),
            sizes=sizes,
            seconds=seconds,
            transport=self.choice(
                self.field(obj, "transport", path, "device_put"), f"{path}.transport", _TRANSPORTS
            ),
        )

    def allreduce(self, value: Any, path: str, devices: tuple[int, ...]) -> AllReduceMeasure:
        obj = self.mapping(value, path)
        self.unknown_keys(obj, _ALLREDUCE, path)
        group = self.device_ids(self.field(obj, "devices", path), f"{path}.devices", devices)
        latency, bandwidth, sizes, seconds = self.fit(obj, path)
        return AllReduceMeasure(group, latency, bandwidth, sizes, seconds)

    def unique(self, keys: list[Any], path: str, what: str) -> None:
        seen: set[Any] = set()
        for i, k in enumerate(keys):
            if k in seen:
                self.fail(f"{path}[{i}]", f"{what} measured twice: {k}")
            seen.add(k)


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
