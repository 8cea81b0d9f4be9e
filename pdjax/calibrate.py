"""Calibration: what the cost model needs, measured on the devices that will run the plan.

A per-layer profile times each layer alone; a stage runs its layers as one compiled
program, with the runtime's transfers between stages and its all-reduce inside a
replicated stage. :func:`calibrate` measures those directly and writes them as plain data
(:class:`Calibration`, JSON) that ``plan`` and ``simulate`` take next to the profile:

- **stages**: each candidate stage (a layer range, its replica count and replication mode)
  as the runtime's own compiled programs (:class:`~pdjax.pipeline.stage.Stage`: the
  forward that keeps its residuals, the backward from them, the update that writes new
  weights beside the old ones, as a schedule that stashes versions runs it) at the size one
  of its devices runs, each the median of several timed runs after warm-up. A split stage
  on ``r`` devices runs ``b / r`` rows of a ``b``-sample microbatch on each device; a
  round-robin stage runs whole microbatches, ``r`` at a time, so its time per microbatch
  is the whole microbatch's over ``r``. The last stage's forward includes the loss; the
  first stage's backward computes no input gradient (the runtime's programs do the same);
- **links**: for each ordered pair of devices, one direction at a time, seconds to move
  arrays of several sizes through the transport the runtime uses (``jax.device_put``
  within a process; across processes the pipeline's own transport, both sides taking
  part), fitted to ``latency + bytes / bandwidth``. Across processes each send is
  acknowledged by a 4-byte message back, and the fit's intercept is taken as two
  latencies; the host seconds of the sender's call are recorded too (``send_seconds``);
- **all-reduces**: a sum over a device group of ``[r, ...]`` arrays, one part per device,
  as a replicated stage's update does it, for several sizes (fitted as above), and for the
  exact gradient tree of every calibrated replicated stage (``StageMeasure.allreduce``).

A calibration records what it was measured for: the model (layer names and parameter bytes
per layer), the microbatch size, the devices (ids, platform, kind) and the optimizer.
:meth:`Calibration.check` refuses a calibration for another model, plan or device set and
says what differs. Ranges the calibration does not hold are priced from the profile times
the calibration's *profile ratio* (the whole model measured as one program over the
profile's sum, when both are known), so the planner can search every range and the
refinement loop (:func:`refine`) measures only the best plans and their neighbours.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pdjax._jsonio import parse_json, write_atomic
from pdjax.errors import CalibrationError, PlanError

_T = TypeVar("_T")

__all__ = [
    "AllReduceMeasure",
    "Calibration",
    "LinkMeasure",
    "Ranked",
    "StageMeasure",
    "calibrate",
    "candidate_plans",
    "fit_latency_bandwidth",
    "measure_allreduce",
    "measure_link",
    "measure_stages",
    "model_fingerprint",
    "neighbours",
    "plan_stages",
    "rank_plans",
    "refine",
]

FORMAT = "pdjax-calibration"
VERSION = 1
#: Default sizes (bytes) for link and all-reduce fits: 4 KiB to 4 MiB.
SIZES = (4096, 65536, 1 << 20, 4 << 20)


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
        diffs: list[str] = []
        mine = list(self.model.get("layers", []))
        if layers is not None and list(layers) != mine:
            n, m = len(layers), len(mine)
            if n != m:
                diffs.append(f"the model has {n} layers, the calibration {m}")
            else:
                i = next(k for k in range(n) if layers[k] != mine[k])
                diffs.append(
                    f"layer {i} is {layers[i]!r} in the model, {mine[i]!r} in the calibration"
                )
        theirs = self.model.get("param_bytes")
        if param_bytes is not None and theirs and list(param_bytes) != list(theirs):
            if len(param_bytes) == len(theirs):
                i = next(k for k in range(len(theirs)) if param_bytes[k] != theirs[k])
                diffs.append(
                    f"layer {i} has {param_bytes[i]} parameter bytes in the model, "
                    f"{theirs[i]} in the calibration"
                )
        size = microbatch_size if plan is None else plan.microbatch_size
        if size is not None and size != self.microbatch_size:
            diffs.append(
                f"microbatch of {size} samples wanted, the calibration measured "
                f"{self.microbatch_size}"
            )
        if plan is not None:
            used = sorted({d for st in plan.stages for d in st.devices})
            missing = [d for d in used if d not in self.devices]
            if missing:
                diffs.append(
                    f"the plan uses devices {missing} that the calibration did not measure "
                    f"(it has {list(self.devices)})"
                )
            if require_stages:
                absent = [
                    f"{st.first_layer}-{st.last_layer} x{st.replicas}"
                    + ("rr" if st.replication == "round-robin" else "")
                    for st in plan.stages
                    if self.stage(st.first_layer, st.last_layer, st.replicas, st.replication)
                    is None
                ]
                if absent:
                    diffs.append(f"stages {absent} of the plan were not measured")
        if devices is not None:
            ids = [int(d.id) for d in devices]
            missing = [d for d in self.devices if d not in ids]
            if missing:
                diffs.append(f"devices {missing} of the calibration are not among {ids}")
            kinds = {(d.platform, d.device_kind) for d in devices}
            if self.platform and (self.platform, self.device_kind) not in kinds:
                diffs.append(
                    f"the calibration was measured on {self.platform} {self.device_kind!r}, "
                    f"these devices are {sorted(kinds)}"
                )
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


# -- fitting ----------------------------------------------------------------------------------


def fit_latency_bandwidth(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``seconds = latency + size / bandwidth`` (latency >= 0).

    >>> fit_latency_bandwidth([0, 1000, 2000], [1e-3, 2e-3, 3e-3])
    (0.001, 1000000.0)
    """
    import numpy as np

    x, y = np.asarray(sizes, float), np.asarray(seconds, float)
    if len(x) < 2 or np.ptp(x) == 0:
        raise CalibrationError("a latency/bandwidth fit needs at least two distinct sizes")
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0:  # through the origin
        slope, intercept = float(np.dot(x, y) / np.dot(x, x)), 0.0
    if not slope > 0:  # no measurable size dependence: the largest transfer's rate
        slope = float(y[np.argmax(x)] / x.max())
    return round(float(intercept), 12), round(float(1.0 / slope), 3)


def _median_seconds(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- what a calibration is for ----------------------------------------------------------------


def model_fingerprint(layers: Any, sample: Any) -> dict[str, Any]:
    """``{"layers": names, "param_bytes": per layer}`` of a layer sequence (shapes only)."""
    import jax
    import numpy as np

    shapes = jax.eval_shape(layers.init, jax.random.key(0), sample)
    sizes = [
        int(sum(np.prod(a.shape, dtype=np.int64) * a.dtype.itemsize
                for a in jax.tree.leaves(v.get("params", {}))))
        for v in shapes
    ]  # fmt: skip
    return {"layers": list(layers.names), "param_bytes": sizes}


# -- stages -----------------------------------------------------------------------------------


def measure_stages(
    layers: Any,
    sample: Any,
    loss: Callable[[Any, Any], Any],
    optimizer: Any,
    stages: Iterable[tuple[int, int, int, str]],
    *,
    device: Any = None,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    log: Callable[[str], None] = lambda s: None,
) -> list[StageMeasure]:
    """Times each stage ``(first, last, replicas, replication)`` on ``device``.

    ``sample`` is one microbatch ``(x, y)``. A split stage on ``r`` devices is timed at
    ``b / r`` rows (one device's share; ``b`` must divide); a round-robin one at ``b`` rows,
    divided by ``r``. See the module doc for what each program holds.
    """
    import jax
    import jax.numpy as jnp

    from pdjax.layers import LayerSequence
    from pdjax.pipeline.stage import Stage

    device = device or jax.devices()[0]
    x, y = sample
    b = int(jax.tree.leaves(x)[0].shape[0])
    L = len(layers)
    # the weights and every layer's input, once, at the whole microbatch
    with jax.default_device(device):
        variables = jax.jit(layers.init)(jax.random.key(seed), x)
        acts = [jax.device_put(x, device)]
        for i, layer in enumerate(layers.layers):
            act, _ = jax.jit(lambda v, a, layer=layer: layer.apply(v, a, train=False))(
                variables[i], acts[-1]
            )
            acts.append(act)
    key = jax.device_put(jax.random.key(seed + 1), device)
    out: list[StageMeasure] = []
    for first, last, r, mode in stages:
        if not (0 <= first <= last < L):
            raise CalibrationError(f"stage {first}-{last} is outside the model's {L} layers")
        mode = "split" if r == 1 else mode
        if mode not in ("split", "round-robin"):
            raise CalibrationError(f"replication must be 'split' or 'round-robin'; got {mode!r}")
        if mode == "split" and b % r:
            raise CalibrationError(
                f"stage {first}-{last} split over {r} devices: the microbatch ({b}) must be a "
                f"multiple of {r}"
            )
        rows = b // r if mode == "split" else b
        sub = LayerSequence(tuple(layers.layers[first : last + 1]))
        params = [v.get("params", {}) for v in variables[first : last + 1]]
        rest = [{k: a for k, a in v.items() if k != "params"} for v in variables[first : last + 1]]
        xin = jax.tree.map(lambda a, n=rows: a[:n], acts[first])
        tgt = jax.tree.map(lambda a, n=rows: jnp.asarray(a[:n]), y)
        is_last, is_first = last == L - 1, first == 0

        # the runtime's own programs for this stage, on one device (unfused: F, B, U)
        stage = Stage(
            0 if is_first else 1, sub.layers, first, (device,), optimizer,
            loss if is_last else None,
        )  # fmt: skip
        w, st, key_ = jax.device_put((params, rest, key), device)
        xin = jax.device_put(xin, device)
        tail: tuple[Any, ...] = (jax.device_put(tgt, device),) if is_last else ()
        f_prog, b_prog = stage.program("F"), stage.program("B")
        _, _, kept = f_prog(w, st, xin, key_, *tail)
        if is_last:
            ct: tuple[Any, ...] = ()
        else:
            ct = (jax.device_put(
                jax.tree.map(lambda a, n=rows: jnp.ones_like(a[:n]) * 1e-3, acts[last + 1]),
                device,
            ),)  # fmt: skip
        t_f = _median_seconds(functools.partial(f_prog, w, st, xin, key_, *tail), warmup, repeats)
        t_b = _median_seconds(functools.partial(b_prog, w, xin, kept, *ct), warmup, repeats)
        t_u = 0.0
        if jax.tree.leaves(params):
            # U takes the gradient sum and the optimizer state (donated) and returns new
            # weights beside the old ones, which the schedule may still read: fresh inputs
            # for every call, made outside the timed region
            u_prog = stage.program("U")
            grads = b_prog(w, xin, kept, *ct)[0]
            opt0 = jax.jit(stage.optimizer.init)(w)
            inputs = [jax.tree.map(jnp.copy, (grads, opt0)) for _ in range(warmup + repeats)]
            jax.block_until_ready(inputs)
            times = []
            for g_i, o_i in inputs:
                t0 = time.perf_counter()
                jax.block_until_ready(u_prog(g_i, w, o_i))
                times.append(time.perf_counter() - t0)
            t_u = statistics.median(times[warmup:])
        per = 1.0 / r if mode == "round-robin" else 1.0
        m = StageMeasure(
            first, last, r, mode, round(t_f * per, 9), round(t_b * per, 9),
            round(t_u, 9), None, rows,
        )  # fmt: skip
        log(f"stage {first}-{last} x{r} {mode}: F {m.forward * 1e3:.2f} ms, "
            f"B {m.backward * 1e3:.2f} ms, U {m.update * 1e3:.2f} ms")  # fmt: skip
        out.append(m)
    return out


# -- links ------------------------------------------------------------------------------------


def _with_timeout(what: str, timeout: float, fn: Callable[[], _T]) -> _T:
    """Runs ``fn`` in a thread; raises CalibrationError naming ``what`` after ``timeout``
    seconds (the thread is left behind: a transfer blocked in JAX cannot be cancelled)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name=f"pdjax-calibrate {what}")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise CalibrationError(
            f"{what} could not be measured within {timeout:g} s: is the peer process "
            "running and reachable (coordinator address, PDJAX_TRANSFER_HOST, firewall)?"
        )
    if "error" in box:
        raise box["error"]
    value: _T = box["value"]
    return value


def measure_link(
    src: Any,
    dst: Any,
    *,
    sizes: Sequence[int] = SIZES,
    repeats: int = 5,
    warmup: int = 2,
    transport: str = "device_put",
    timeout: float = 60.0,
) -> LinkMeasure | None:
    """One direction ``src -> dst`` (JAX devices), fitted to ``latency + n / bandwidth``.

    Within a process: ``jax.device_put`` of a float32 array of each size, to completion.
    Across processes (every process calls this, in the same order): the pipeline's
    transport (``transport``), the receiver acknowledging each message with 4 bytes; the
    sender's timings are taken, and returned on the sender's process (None elsewhere).

    Raises:
      CalibrationError: the link did not complete within ``timeout`` seconds.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    what = f"link {src.id} -> {dst.id}"
    me = jax.process_index()
    if src.process_index == dst.process_index:
        if src.process_index != me:
            return None
        points = []
        for n in sizes:
            a = jax.device_put(jnp.ones(max(1, n // 4), jnp.float32), src)
            to = jax.sharding.SingleDeviceSharding(dst)
            secs = _with_timeout(
                what,
                timeout,
                functools.partial(
                    _median_seconds, functools.partial(jax.device_put, a, to), warmup, repeats
                ),
            )
            points.append(secs)
        lat, bw = fit_latency_bandwidth(sizes, points)
        return LinkMeasure(
            int(src.id), int(dst.id), lat, bw, 0.0, tuple(sizes),
            tuple(round(p, 9) for p in points), "device_put",
        )  # fmt: skip
    from pdjax.pipeline.transport import make_transport

    tr = make_transport(transport)
    sending, receiving = src.process_index == me, dst.process_index == me
    if not (sending or receiving):
        return None
    points, hosts = [], []
    ack_shape = (1,)
    for n in sizes:
        shape = (max(1, n // 4),)
        a = jax.device_put(np.ones(shape, np.float32), src) if sending else None
        ok = jax.device_put(np.ones(ack_shape, np.float32), dst) if receiving else None

        def once(a: Any = a, ok: Any = ok, shape: Any = shape) -> tuple[float, float]:
            t0 = time.perf_counter()
            if sending:
                tr._single(a, src, dst, shape, jnp.float32, send=True)
                t1 = time.perf_counter()
                jax.block_until_ready(
                    tr._single(None, dst, src, ack_shape, jnp.float32, send=False)
                )
            else:
                got = tr._single(None, src, dst, shape, jnp.float32, send=False)
                jax.block_until_ready(got)
                t1 = time.perf_counter()
                tr._single(ok, dst, src, ack_shape, jnp.float32, send=True)
            return time.perf_counter() - t0, t1 - t0

        def timed(once: Any = once) -> tuple[float, float]:
            for _ in range(warmup):
                once()
            runs = [once() for _ in range(repeats)]
            tr.drain()
            return (
                statistics.median(r[0] for r in runs),
                statistics.median(r[1] for r in runs),
            )

        total, host = _with_timeout(what, timeout, timed)
        points.append(total)
        hosts.append(host)
    if not sending:
        return None
    intercept, bw = fit_latency_bandwidth(sizes, points)
    return LinkMeasure(
        int(src.id), int(dst.id), round(intercept / 2, 12), bw,
        round(statistics.median(hosts), 9), tuple(sizes), tuple(round(p, 9) for p in points),
        transport,
    )  # fmt: skip


# -- all-reduces ------------------------------------------------------------------------------


def _allreduce_fn(devices: Sequence[Any], tree: Any) -> Callable[[], Any]:
    """A call that sums ``tree``-shaped ``[r, ...]`` parts over ``devices`` (one part per
    device) into a replicated result, as a replicated stage's update does."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("data",))
    r = len(devices)
    sharded = NamedSharding(mesh, P("data"))

    def place(leaf: Any) -> Any:
        shape = (r, *leaf.shape)
        return jax.make_array_from_callback(
            shape, sharded, lambda index: np.ones(shape, leaf.dtype)[index]
        )

    parts = jax.tree.map(place, tree)
    total = jax.jit(
        lambda t: jax.tree.map(lambda a: jnp.sum(a, axis=0), t),
        out_shardings=NamedSharding(mesh, P()),
    )
    return lambda: total(parts)


def measure_allreduce(
    devices: Sequence[Any],
    *,
    sizes: Sequence[int] = SIZES,
    trees: Mapping[Any, Any] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    timeout: float = 120.0,
) -> tuple[AllReduceMeasure, dict[Any, float]]:
    """The all-reduce over ``devices`` (every process holding one calls this), fitted over
    float32 arrays of ``sizes`` bytes, and timed for each tree of ``trees`` (shapes; e.g.
    a stage's gradients): ``(fit, {key: seconds})``."""
    import jax

    what = f"all-reduce over devices {[d.id for d in devices]}"
    points = []
    for n in sizes:
        part = jax.ShapeDtypeStruct((max(1, n // 4),), "float32")
        call = _allreduce_fn(devices, part)
        points.append(
            _with_timeout(what, timeout, functools.partial(_median_seconds, call, warmup, repeats))
        )
    lat, bw = fit_latency_bandwidth(sizes, points)
    exact = {}
    for k, tree in (trees or {}).items():
        call = _allreduce_fn(devices, tree)
        exact[k] = round(
            _with_timeout(what, timeout, functools.partial(_median_seconds, call, warmup, repeats)),
            9,
        )
    fit = AllReduceMeasure(
        tuple(int(d.id) for d in devices), lat, bw, tuple(sizes),
        tuple(round(p, 9) for p in points),
    )  # fmt: skip
    return fit, exact


# -- the whole thing, in one process ----------------------------------------------------------


def _optimizer_name(optimizer: Any) -> str:
    return getattr(optimizer, "__name__", None) or type(optimizer).__name__


def calibrate(
    layers: Any,
    sample: Any,
    loss: Callable[[Any, Any], Any],
    optimizer: Any,
    stages: Iterable[tuple[int, int, int, str]],
    *,
    devices: Sequence[Any] | None = None,
    links: bool = True,
    allreduces: bool = True,
    repeats: int = 5,
    sizes: Sequence[int] = SIZES,
    profile: Any = None,
    log: Callable[[str], None] = lambda s: None,
) -> Calibration:
    """Measures ``stages`` (``(first, last, replicas, replication)``), the links between
    every ordered pair of ``devices`` and the all-reduce over each replicated stage's
    first ``replicas`` devices, in this process (see the module doc).

    Args:
      layers: the model's :class:`~pdjax.layers.LayerSequence`.
      sample: one microbatch ``(x, y)``.
      loss: ``loss(outputs, targets)``.
      optimizer: the optax optimizer the pipeline will run (its update is timed).
      stages: the candidate stages; the whole model on one device is always added (for the
        profile ratio).
      devices: the devices (default ``jax.devices()``).
      profile: a :class:`~pdjax.profile.Profile` of the same model, for the profile ratio.
    """
    import jax

    devices = list(devices or jax.devices())
    x = sample[0]
    b = int(jax.tree.leaves(x)[0].shape[0])
    L = len(layers)
    wanted = list(dict.fromkeys([*stages, (0, L - 1, 1, "split")]))
    measured = measure_stages(
        layers, sample, loss, optimizer, wanted, device=devices[0], repeats=repeats, log=log
    )
    link_list: list[LinkMeasure] = []
    if links and len(devices) > 1:
        for a in devices:
            for c in devices:
                if a is not c:
                    m = measure_link(a, c, sizes=sizes, repeats=repeats)
                    if m is not None:
                        link_list.append(m)
                        log(f"link {a.id} -> {c.id}: {m.latency * 1e6:.1f} us + "
                            f"{m.bandwidth / 1e9:.2f} GB/s")  # fmt: skip
    ar_list: list[AllReduceMeasure] = []
    if allreduces:
        shapes = jax.eval_shape(layers.init, jax.random.key(0), x)
        for r in sorted({st[2] for st in wanted if st[2] > 1}):
            if r > len(devices):
                raise CalibrationError(f"a stage on {r} devices, only {len(devices)} given")
            trees = {
                m.key: [v.get("params", {}) for v in shapes[m.first : m.last + 1]]
                for m in measured
                if m.replicas == r
            }
            fit, exact = measure_allreduce(devices[:r], sizes=sizes, trees=trees, repeats=repeats)
            ar_list.append(fit)
            measured = [
                dataclasses.replace(m, allreduce=exact[m.key]) if m.key in exact else m
                for m in measured
            ]
    cal = Calibration(
        model=model_fingerprint(layers, x),
        microbatch_size=b,
        devices=tuple(int(d.id) for d in devices),
        platform=devices[0].platform,
        device_kind=devices[0].device_kind,
        optimizer=_optimizer_name(optimizer),
        stages=tuple(measured),
        links=tuple(link_list),
        allreduces=tuple(ar_list),
    )
    return cal.with_profile_ratio(profile) if profile is not None else cal


def plan_stages(plans: Iterable[Any]) -> list[tuple[int, int, int, str]]:
    """The distinct stages ``(first, last, replicas, replication)`` of ``plans``."""
    out = []
    for plan in plans:
        for st in plan.stages:
            mode = "split" if st.replicas == 1 else st.replication
            out.append((st.first_layer, st.last_layer, st.replicas, mode))
    return list(dict.fromkeys(out))


def neighbours(plan: Any) -> list[list[tuple[int, int, int]]]:
    """Layouts ``[(first, last, replicas), ...]`` next to ``plan``'s: each cut moved by one
    layer either way (replicas kept)."""
    stages = [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages]
    out = []
    for k in range(len(stages) - 1):
        for step in (-1, 1):
            a, b = list(stages[k]), list(stages[k + 1])
            a[1] += step
            b[0] += step
            if a[0] <= a[1] and b[0] <= b[1]:
                new = list(stages)
                new[k], new[k + 1] = tuple(a), tuple(b)
                out.append(new)
    return out


def candidate_plans(
    profile: Any,
    topology: Any,
    *,
    schedule: str = "pipedream",
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    neighbour_steps: bool = True,
) -> list[Any]:
    """The planner's best few plans from the profile alone, and their neighbours.

    The dynamic program's choice, its straight (unreplicated) choice, the choice when
    devices may stay idle, and, for each, every plan with one cut moved by one layer
    (:func:`neighbours`); distinct layouts only.
    """
    from pdjax.partition import evaluate_partition, plan_pipedream

    common: dict[str, Any] = {"schedule": schedule, "num_microbatches": num_microbatches,
                              "microbatch_size": microbatch_size}  # fmt: skip
    seeds = []
    for straight, fewer in ((False, False), (True, False), (False, True)):
        try:
            seeds.append(
                plan_pipedream(profile, topology, straight=straight, fewer_machines=fewer, **common)
            )
        except PlanError:  # a variant may have no plan (memory): skip it
            continue
    if not seeds:
        raise CalibrationError("the planner found no plan to refine")
    out: dict[tuple[Any, ...], Any] = {}
    for plan in seeds:
        out.setdefault(_layout_key(plan), plan)
    if neighbour_steps:
        for plan in list(out.values()):
            modes = [st.replication for st in plan.stages]
            for layout in neighbours(plan):
                try:
                    q = evaluate_partition(profile, topology, layout, replication=modes,
                                           partitioner="neighbour", **common)  # fmt: skip
                except PlanError:  # a neighbour may be invalid (a forbidden cut)
                    continue
                out.setdefault(_layout_key(q), q)
    return list(out.values())


def _layout_key(plan: Any) -> tuple[Any, ...]:
    return tuple((s.first_layer, s.last_layer, s.devices, s.replication) for s in plan.stages)


@dataclasses.dataclass(frozen=True)
class Ranked:
    """One candidate plan after calibration.

    Attributes:
      plan: the plan re-evaluated with calibrated stage costs (its ``time_per_microbatch``
        is the planner's calibrated prediction).
      simulated: the simulator's seconds per microbatch for a stream of the schedule, from
        calibrated costs.
      uncalibrated: the plan's prediction from the profile alone.
    """

    plan: Any
    simulated: float
    uncalibrated: float


def rank_plans(
    plans: Sequence[Any],
    profile: Any,
    calibration: Calibration,
    *,
    microbatches: int | None = None,
) -> list[Ranked]:
    """Re-ranks ``plans`` by the simulator on calibrated costs (fastest first).

    Each plan is re-evaluated with the calibration's stage seconds and all-reduces and
    simulated for its own schedule over a stream long enough for its steady state.
    """
    from pdjax.partition import evaluate_partition
    from pdjax.pipeline.costs import costs_from_plan
    from pdjax.pipeline.schedules import generate
    from pdjax.pipeline.simulate import simulate, stream_length

    out = []
    for plan in plans:
        layout = [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages]
        M = plan.num_microbatches
        again = evaluate_partition(
            profile, plan.topology, layout, schedule=plan.schedule, num_microbatches=M,
            microbatch_size=plan.microbatch_size, partitioner=plan.partitioner,
            replication=[s.replication for s in plan.stages],
            stage_seconds=calibration.stage_seconds(plan.schedule, M),
            allreduce_seconds=calibration.allreduce_function(),
        )  # fmt: skip
        costs = costs_from_plan(again, profile, calibration=calibration, partial=True)
        replicas, modes = plan.replicas, plan.replication
        if plan.schedule == "pipedream":
            n = microbatches or stream_length(
                "pipedream", len(layout), replicas=replicas, replication=modes
            )
            sched = generate("pipedream", len(layout), n, replicas=replicas, replication=modes)
        else:
            steps = max(1, (microbatches or 4 * M) // M)
            n = steps * M
            sched = generate(plan.schedule, len(layout), M, steps=steps, replicas=replicas,
                             replication=modes)  # fmt: skip
        sim = simulate(sched, costs).makespan / n
        out.append(Ranked(again, sim, plan.time_per_microbatch))
    return sorted(out, key=lambda r: r.simulated)


def refine(
    profile: Any,
    topology: Any,
    layers: Any,
    sample: Any,
    loss: Callable[[Any, Any], Any],
    optimizer: Any,
    *,
    schedule: str = "pipedream",
    num_microbatches: int | None = None,
    devices: Sequence[Any] | None = None,
    calibration: Calibration | None = None,
    repeats: int = 5,
    log: Callable[[str], None] = lambda s: None,
) -> tuple[list[Ranked], Calibration]:
    """The refinement loop: plan from the per-layer profile, calibrate the best few plans
    and their neighbours on ``devices``, re-rank them by the simulator on calibrated costs.

    ``topology`` must describe ``devices`` (``Topology.from_devices(devices)``: its device
    ids are theirs); ``sample`` is one microbatch. Measurements already in ``calibration``
    are kept, the missing ones added. Returns the ranked plans (fastest first) and the
    calibration.
    """
    import jax

    devices = list(devices or jax.devices())
    by_id = {int(d.id): d for d in devices}
    b = int(jax.tree.leaves(sample[0])[0].shape[0])
    plans = candidate_plans(profile, topology, schedule=schedule,
                            num_microbatches=num_microbatches, microbatch_size=b)  # fmt: skip
    log(f"{len(plans)} candidate plans: " + ", ".join(p.config for p in plans))
    stages = plan_stages(plans)
    if calibration is not None:
        calibration.check(layers=list(layers.names), microbatch_size=b)
        stages = [st for st in stages if calibration.stage(*st) is None]
    ids = sorted({d for p in plans for s in p.stages for d in s.devices})
    missing = [d for d in ids if d not in by_id]
    if missing:
        raise CalibrationError(
            f"the plans use device ids {missing} that are not among the devices given "
            f"({sorted(by_id)}); build the topology with Topology.from_devices(devices)"
        )
    new = calibrate(layers, sample, loss, optimizer, stages, devices=[by_id[d] for d in ids],
                    links=False, allreduces=False, repeats=repeats, profile=profile,
                    log=log)  # fmt: skip
    link_list, ar_list = [], []
    pairs = {(p.stages[k].devices[0], p.stages[k + 1].devices[0])
             for p in plans for k in range(len(p.stages) - 1)}  # fmt: skip
    for a, c in sorted(pairs | {(c, a) for a, c in pairs}):
        if calibration is None or calibration.link(a, c) is None:
            m = measure_link(by_id[a], by_id[c], repeats=repeats)
            if m is not None:
                link_list.append(m)
    shapes = jax.eval_shape(layers.init, jax.random.key(0), sample[0])
    groups: dict[tuple[int, ...], dict[Any, Any]] = {}
    for p in plans:
        for s in p.stages:
            if s.replicas > 1:
                key = (s.first_layer, s.last_layer, s.replicas, s.replication)
                tree = [v.get("params", {}) for v in shapes[s.first_layer : s.last_layer + 1]]
                groups.setdefault(tuple(s.devices), {})[key] = tree
    measured = {m.key: m for m in new.stages}
    for group, trees in groups.items():
        fit, exact = measure_allreduce([by_id[d] for d in group], trees=trees, repeats=repeats)
        ar_list.append(fit)
        for key, secs in exact.items():
            if key in measured:
                measured[key] = dataclasses.replace(measured[key], allreduce=secs)
    new = dataclasses.replace(new, stages=tuple(measured.values()), links=tuple(link_list),
                              allreduces=tuple(ar_list))  # fmt: skip
    cal = new if calibration is None else calibration.merge(new)
    return rank_plans(plans, profile, cal, microbatches=None), cal
