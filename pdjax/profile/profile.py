"""The `Profile`: per-layer costs of a model, as plain data.

A profile is what the planner and the simulator read. Each :class:`LayerProfile` holds the
counts XLA reports for one layer (FLOPs, bytes accessed), sizes (parameters, output
activation, residuals the backward keeps), and seconds — measured on a device, estimated
from a :class:`~pdjax.profile.devices.DeviceModel`, or read from a PipeDream ``graph.txt``.

All sizes are bytes for the whole profiled batch; all times are seconds for that batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdjax._jsonio import FieldReader, parse_json, read_text, write_atomic
from pdjax._units import fmt_bytes, fmt_count, fmt_seconds
from pdjax.errors import GraphFormatError, ProfileError

__all__ = ["LayerProfile", "PolicyCost", "Profile"]

_FORMAT = "pdjax.profile/1"


def _fmt_seconds(s: float | None) -> str:
    """:func:`~pdjax._units.fmt_seconds`, with nanoseconds below a microsecond (a device
    model's times of a small layer)."""
    if s is not None and 0 < s < 1e-6:
        return f"{s * 1e9:.1f} ns"
    return fmt_seconds(s)


@dataclasses.dataclass(frozen=True)
class PolicyCost:
    """What one layer keeps and recomputes under a named memory policy
    (:data:`pdjax._memory_policy.CHECKPOINTED`), for the profile's batch.

    Attributes:
      policy: the policy's name (``"dots"``, ``"dots-no-batch"``, ``"offload"``).
      residual_bytes: device bytes its VJP keeps beyond the parameters and the layer's
        input (as :attr:`LayerProfile.residual_bytes` for ``"none"``).
      host_bytes: bytes it keeps in host memory instead (offloaded).
      recompute: the share of the forward its backward computes again, 0..1: the extra
        FLOPs (transcendentals included) of the backward under the policy over the plain
        backward, relative to the forward's (XLA's counts of the lowered programs, all
        three alike); the planner charges that share of the forward's seconds. Bytes
        accessed are not counted: recomputed elementwise work fuses on the device, and
        XLA's counts of unfused programs overstate it. ``"full"`` is 1 and ``"none"`` 0
        by definition.
    """

    policy: str
    residual_bytes: int
    host_bytes: int = 0
    recompute: float = 0.0


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """Costs of one layer for one batch of ``Profile.batch_size`` samples.

    Attributes:
      name: the layer's name (unique in the profile).
      kind: what the layer is (module class name, or PipeDream's layer repr).
      forward_flops: FLOPs of the forward pass (XLA cost analysis), or None if unknown.
      backward_flops: FLOPs of the backward pass alone (forward+backward minus forward).
      forward_bytes_accessed: bytes the forward reads and writes (XLA cost analysis).
      backward_bytes_accessed: the same for the backward alone.
      param_bytes: bytes of the layer's trainable parameters.
      state_bytes: bytes of its non-trainable state (e.g. BatchNorm statistics).
      input_bytes: bytes of the layer's input activation.
      output_bytes: bytes of the layer's output activation (what crosses a cut after it).
      residual_bytes: bytes the backward keeps from the forward beyond the parameters and
        the layer's input (XLA's residuals).
      peak_bytes: the larger footprint of the compiled forward and backward (arguments,
        outputs and temporaries, from ``memory_analysis()``), or None.
      forward_seconds: forward time, or None if neither measured nor estimated.
      backward_seconds: backward time, or None.
      output_shape: a readable rendering of the output's shapes and dtypes.
      input_grad_flops: FLOPs of the backward's input gradient alone (zero bubble's ``I``:
        the layer's pullback keeping only the input's cotangent), or None if not counted.
        0 for a layer whose input needs no gradient (the first layer, integer inputs).
      weight_grad_flops: FLOPs of the backward's weight gradient alone (``W``: the
        pullback keeping only the parameters' cotangents), or None. 0 without parameters.
      input_grad_seconds: the time of that input gradient alone (measured or estimated
        like ``backward_seconds``), or None.
      weight_grad_seconds: the time of that weight gradient alone, or None.
      policies: what each named memory policy keeps and recomputes (:class:`PolicyCost`);
        empty where not profiled (a ``graph.txt`` profile): the planner then chooses
        between keeping everything and recomputing the whole forward only.

    ``I`` and ``W`` are separate programs, as zero bubble runs them: their FLOPs sum to
    ``backward_flops`` where the two share no work (a dense or convolution layer), and to
    more where ``W`` must go back through the layer's interior to reach inner weights (a
    transformer block). Their ratio is what :func:`pdjax.partition.weight_grad_fraction`
    reads.
    """

    name: str
    kind: str = ""
    forward_flops: float | None = None
    backward_flops: float | None = None
    forward_bytes_accessed: float | None = None
    backward_bytes_accessed: float | None = None
    param_bytes: int = 0
    state_bytes: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    residual_bytes: int = 0
    peak_bytes: int | None = None
    forward_seconds: float | None = None
    backward_seconds: float | None = None
    output_shape: str = ""
    input_grad_flops: float | None = None
    weight_grad_flops: float | None = None
    input_grad_seconds: float | None = None
    weight_grad_seconds: float | None = None
    policies: tuple[PolicyCost, ...] = ()

    def policy(self, name: str) -> PolicyCost | None:
        """The layer's :class:`PolicyCost` under memory policy ``name``: profiled for a
        named policy (None where not), and by definition for ``"none"`` (its residuals,
        nothing recomputed) and ``"full"`` (nothing kept, the whole forward again)."""
        if name == "none":
            return PolicyCost(name, self.residual_bytes, 0, 0.0)
        if name == "full":
            return PolicyCost(name, 0, 0, 1.0)
        return next((p for p in self.policies if p.policy == name), None)

    @property
    def stash_bytes(self) -> int:
        """Bytes held per in-flight batch between forward and backward: input + residuals."""
        return self.input_bytes + self.residual_bytes

    @property
    def seconds(self) -> float | None:
        """Forward + backward seconds, or None if either is unknown."""
        if self.forward_seconds is None or self.backward_seconds is None:
            return None
        return self.forward_seconds + self.backward_seconds


@dataclasses.dataclass(frozen=True, repr=False)
class Profile:
    """Per-layer costs of a model: the input of the planner.

    Layers are in a topological order. ``edges`` are the data dependencies ``(i, j)``
    (layer ``j`` consumes the output of layer ``i``); a layer sequence is the chain
    ``(0, 1), (1, 2), ...``. PipeDream profiles of branching networks (ResNet, GNMT,
    Inception) keep their DAG edges.

    Attributes:
      layers: the layers, topologically ordered.
      edges: dependencies between layer indices.
      batch_size: samples in the profiled batch (all bytes and seconds are for it).
      time_source: where the seconds come from: ``"measured:<device>"``,
        ``"model:<preset>"``, ``"graph.txt"`` or ``"none"``.
      dtype: the dtype of the parameters (e.g. ``"float32"``).
      meta: free-form provenance (model, config, jax version, source file, ...).

    ``print(profile)`` shows a per-layer table (:meth:`__str__`); ``repr`` is one line.
    """

    layers: tuple[LayerProfile, ...]
    edges: tuple[tuple[int, int], ...]
    batch_size: int
    time_source: str = "none"
    dtype: str = "float32"
    meta: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "edges", tuple((int(a), int(b)) for a, b in self.edges))
        object.__setattr__(self, "meta", dict(self.meta))
        if not self.layers:
            raise ProfileError("a profile needs at least one layer")
        if self.batch_size <= 0:
            raise ProfileError(f"batch_size must be positive, got {self.batch_size}")
        n = len(self.layers)
        for a, b in self.edges:
            if not (0 <= a < n and 0 <= b < n):
                raise ProfileError(f"edge ({a}, {b}) names a layer outside 0..{n - 1}")
            if a >= b:
                raise ProfileError(
                    f"edge ({a}, {b}) goes backwards: layers must be in a topological "
                    "order (a cycle, or an unsorted profile)"
                )

    @classmethod
    def chain(cls, layers: Sequence[LayerProfile], **kwargs: Any) -> Profile:
        """A profile of a layer sequence: edges ``(i, i+1)``."""
        edges = tuple((i, i + 1) for i in range(len(layers) - 1))
        return cls(layers=tuple(layers), edges=edges, **kwargs)

    # -- text --------------------------------------------------------------------------

    def __repr__(self) -> str:
        shape = "chain" if self.is_chain else f"DAG, {len(self.edges)} edges"
        return (
            f"Profile({len(self.layers)} layers, {shape}, batch_size={self.batch_size}, "
            f"dtype={self.dtype!r}, time_source={self.time_source!r})"
        )

    def __str__(self) -> str:
        """A table: one row per layer (FLOPs of forward and backward, parameter and output
        bytes, and seconds where known) and a row of totals, in readable units."""
        layers = self.layers
        timed = any(
            layer.forward_seconds is not None or layer.backward_seconds is not None
            for layer in layers
        )
        header = ["#", "layer", "fwd FLOPs", "bwd FLOPs", "params", "output"]
        if timed:
            header += ["fwd time", "bwd time"]
        rows = []
        for i, layer in enumerate(layers):
            row = [
                str(i),
                layer.name,
                fmt_count(layer.forward_flops),
                fmt_count(layer.backward_flops),
                fmt_bytes(layer.param_bytes),
                fmt_bytes(layer.output_bytes),
            ]
            if timed:
                row += [_fmt_seconds(layer.forward_seconds), _fmt_seconds(layer.backward_seconds)]
            rows.append(row)

        def total(values: list[Any]) -> float | None:
            return None if any(v is None for v in values) else float(sum(values))

        totals = [
            "",
            "total",
            fmt_count(total([layer.forward_flops for layer in layers])),
            fmt_count(total([layer.backward_flops for layer in layers])),
            fmt_bytes(sum(layer.param_bytes for layer in layers)),
            "",
        ]
        if timed:
            totals += [
                _fmt_seconds(total([layer.forward_seconds for layer in layers])),
                _fmt_seconds(total([layer.backward_seconds for layer in layers])),
            ]
        widths = [max(len(r[c]) for r in (header, *rows, totals)) for c in range(len(header))]

        def line(cells: list[str]) -> str:
            # names left-aligned, numbers right-aligned
            return "  ".join(
                cell.ljust(w) if c == 1 else cell.rjust(w)
                for c, (cell, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        rule = "-" * len(line(["-" * w for w in widths]))
        shape = "" if self.is_chain else f", DAG of {len(self.edges)} edges"
        title = (
            f"Profile: {len(layers)} layers{shape}, batch size {self.batch_size}, "
            f"{self.dtype}, times: {self.time_source}"
        )
        body = [line(header), rule, *(line(r) for r in rows), rule, line(totals)]
        return "\n".join([title, *body])

    # -- derived views -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def is_chain(self) -> bool:
        """True if every layer feeds exactly the next one."""
        return set(self.edges) == {(i, i + 1) for i in range(len(self.layers) - 1)}

    @property
    def has_times(self) -> bool:
        return all(layer.seconds is not None for layer in self.layers)

    def _times(self, attr: str) -> np.ndarray:
        values = [getattr(layer, attr) for layer in self.layers]
        missing = [layer.name for layer, v in zip(self.layers, values, strict=True) if v is None]
        if missing:
            raise ProfileError(
                f"the profile has no {attr} for layers {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; profile with measure=True "
                "(CLI: --measure) or a device model (--device-model h100)"
            )
        return np.asarray(values, dtype=np.float64)

    def forward_seconds(self) -> np.ndarray:
        """Per-layer forward seconds, shape ``(L,)``. Raises ProfileError if unknown."""
        return self._times("forward_seconds")

    def backward_seconds(self) -> np.ndarray:
        """Per-layer backward seconds, shape ``(L,)``. Raises ProfileError if unknown."""
        return self._times("backward_seconds")

    def param_bytes(self) -> np.ndarray:
        """Per-layer parameter bytes, shape ``(L,)``."""
        return np.asarray([layer.param_bytes for layer in self.layers], dtype=np.float64)

    def output_bytes(self) -> np.ndarray:
        """Per-layer output activation bytes, shape ``(L,)``."""
        return np.asarray([layer.output_bytes for layer in self.layers], dtype=np.float64)

    def cut_bytes(self) -> np.ndarray:
        """Bytes crossing a cut after layer ``s`` (layers ``0..s`` on one side), shape ``(L,)``.

        For a chain this is ``output_bytes[s]``. For a DAG it is the total output of every
        layer in ``0..s`` with an edge to a layer after ``s`` (each counted once). The last
        entry is 0: nothing is cut after the last layer.
        """
        n = len(self.layers)
        out = np.zeros(n, dtype=np.float64)
        last_use: dict[int, int] = {}
        for a, b in self.edges:
            last_use[a] = max(last_use.get(a, a), b)
        sizes = self.output_bytes()
        for s in range(n - 1):
            out[s] = sum(sizes[a] for a, last in last_use.items() if a <= s < last)
        return out

    def total_seconds(self) -> float:
        """Forward + backward seconds of the whole model."""
        return float(self.forward_seconds().sum() + self.backward_seconds().sum())

    def replace_times(
        self, forward: Sequence[float], backward: Sequence[float], time_source: str
    ) -> Profile:
        """A copy with new per-layer seconds. The seconds of the input and weight gradients
        alone, which came with the old ones, are dropped (their FLOPs stay)."""
        if len(forward) != len(self.layers) or len(backward) != len(self.layers):
            raise ProfileError("need one forward and one backward time per layer")
        layers = tuple(
            dataclasses.replace(
                layer,
                forward_seconds=float(f),
                backward_seconds=float(b),
                input_grad_seconds=None,
                weight_grad_seconds=None,
            )
            for layer, f, b in zip(self.layers, forward, backward, strict=True)
        )
        return dataclasses.replace(self, layers=layers, time_source=time_source)

    # -- JSON --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "batch_size": self.batch_size,
            "time_source": self.time_source,
            "dtype": self.dtype,
            "meta": dict(self.meta),
            "edges": [list(e) for e in self.edges],
            "layers": [_layer_dict(layer) for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: Any, what: str = "profile JSON") -> Profile:
        """Inverse of :meth:`to_dict`. Every field is checked: types, finite non-negative
        sizes, times and counts, edges inside the layers; ``what`` (e.g. ``"profile
        p.json"``) and the field's path (``layers[3].forward_seconds``) name a bad one.

        Raises:
          ProfileError: for data that is not a pdjax profile, or a field that is missing or
            wrong.
        """
        if not isinstance(data, Mapping):
            raise ProfileError(
                f'{what}: expected a JSON object with "format": {_FORMAT!r}, got '
                f"{_json_kind(data)}; for PipeDream's graph.txt use pdjax.profile.read_graph_txt"
            )
        if data.get("format") != _FORMAT:
            raise ProfileError(
                f"{what}: not a pdjax profile (format {data.get('format')!r}, expected "
                f"{_FORMAT!r}); for PipeDream's graph.txt use pdjax.profile.read_graph_txt"
            )
        r = FieldReader(
            f"{what}: malformed pdjax profile",
            ProfileError,
            "fix that field, or profile the model again (pdjax profile --out FILE)",
        )
        layers = tuple(
            _layer_from_dict(r, raw, f"layers[{i}]")
            for i, raw in enumerate(r.array(r.field(data, "layers", ""), "layers"))
        )
        if not layers:
            r.fail("layers", "a profile needs at least one layer")
        edges = []
        for i, raw in enumerate(r.array(r.field(data, "edges", ""), "edges")):
            pair = r.array(raw, f"edges[{i}]", length=2)
            a, b = (r.integer(v, f"edges[{i}][{k}]", minimum=0) for k, v in enumerate(pair))
            if max(a, b) >= len(layers):
                r.fail(f"edges[{i}]", f"({a}, {b}) names a layer outside 0..{len(layers) - 1}")
            if a >= b:
                r.fail(
                    f"edges[{i}]",
                    f"({a}, {b}) goes backwards: layers must be in a topological order",
                )
            edges.append((a, b))
        return cls(
            layers=layers,
            edges=tuple(edges),
            batch_size=r.integer(r.field(data, "batch_size", ""), "batch_size", minimum=1),
            time_source=r.string(r.field(data, "time_source", "", "none"), "time_source"),
            dtype=r.string(r.field(data, "dtype", "", "float32"), "dtype"),
            meta=r.plain(r.mapping(r.field(data, "meta", "", {}), "meta"), "meta"),
        )

    def content_hash(self) -> str:
        """SHA-256 (hex) of what a plan depends on: the layers, their costs, the edges, the
        batch size and the dtype, in a canonical JSON. ``meta`` and ``time_source`` (labels:
        the same profile read from another path has another ``meta["source"]``) are left
        out, and every number is hashed as a float, so a profile and its JSON round trip
        hash alike. A :class:`~pdjax.partition.Plan` records it as ``profile_hash``."""
        cached = self.__dict__.get("_content_hash")
        if cached is None:

            def canon(v: Any) -> Any:
                return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v

            body = {
                "batch_size": self.batch_size,
                "dtype": self.dtype,
                "edges": [list(e) for e in self.edges],
                "layers": [
                    {k: canon(v) for k, v in _layer_dict(layer).items()} for layer in self.layers
                ],
            }
            text = json.dumps(body, sort_keys=True, separators=(",", ":"))
            cached = hashlib.sha256(text.encode()).hexdigest()
            # A frozen dataclass: cache past __setattr__. Fields never change, and
            # dataclasses.replace builds a new instance without this entry.
            self.__dict__["_content_hash"] = cached
        return cached

    def to_json(self) -> str:
        """Exact JSON (floats round-trip through ``repr``)."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str, what: str = "profile JSON") -> Profile:
        """Reads :meth:`to_json` output.

        Raises:
          ProfileError: for text that is not JSON or not a pdjax profile.
        """
        return cls.from_dict(parse_json(text, what, ProfileError), what)

    def save(self, path: str | Path) -> None:
        """Writes the JSON to ``path`` atomically (a temporary file, then a rename).

        Raises:
          ProfileError: the path cannot be written (the message names it).
        """
        write_atomic(path, self.to_json(), what="profile", error=ProfileError)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Reads a pdjax profile JSON, a PipeDream ``graph.txt`` (by content), or
        ``"pipedream:NAME"``: one of PipeDream's published profiles shipped with pdjax.

        Raises:
          ProfileError: an unreadable, empty or malformed file, or JSON that is not a pdjax
            profile (``GraphFormatError``, a subclass, for a bad ``graph.txt``).
        """
        if isinstance(path, str) and path.startswith("pipedream:"):
            from pdjax.profile.graph_txt import published_profile

            return published_profile(path.split(":", 1)[1])
        path = Path(path)
        # Bytes that are not UTF-8 are most likely a damaged graph.txt (JSON would be too).
        text = read_text(path, "profile", ProfileError, decode_error=GraphFormatError)
        what = f"profile {path}"
        body = text.strip()
        if not body:
            raise ProfileError(
                f"{what} is empty; give a pdjax profile JSON (pdjax profile --out FILE) or a "
                "PipeDream graph.txt"
            )
        # A graph.txt starts with a node line; anything else that parses as JSON is meant
        # as a profile JSON, and must then be one (an empty file, `null` or `[1, 2]` once
        # fell through to the graph.txt reader and came back as a profile of nothing).
        if not body.startswith("node"):
            try:
                data = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                if body[0] in '{["':
                    parse_json(text, what, ProfileError)  # raises, naming the position
            else:
                return cls.from_dict(data, what)
        from pdjax.profile.graph_txt import parse_graph_txt

        return parse_graph_txt(text, source=str(path), require_connected=True)


#: A layer's counts and times (FLOPs, bytes accessed, seconds) that a profile may lack;
#: :func:`pdjax.partition.mix_profiles` averages them over buckets.
COST_FIELDS = (
    "forward_flops",
    "backward_flops",
    "forward_bytes_accessed",
    "backward_bytes_accessed",
    "forward_seconds",
    "backward_seconds",
    "input_grad_flops",
    "weight_grad_flops",
    "input_grad_seconds",
    "weight_grad_seconds",
)
_BYTES = ("param_bytes", "state_bytes", "input_bytes", "output_bytes", "residual_bytes")
_STRINGS = ("name", "kind", "output_shape")


def _layer_from_dict(r: FieldReader, raw: Any, path: str) -> LayerProfile:
    """One layer record, every field checked: strings, and counts, sizes and times that are
    finite and not negative (a negative time once came out as a plan of "t = -300 ms")."""
    raw = r.mapping(raw, path)
    r.unknown_keys(raw, {f.name for f in dataclasses.fields(LayerProfile)}, path)
    values: dict[str, Any] = {"name": r.string(r.field(raw, "name", path), f"{path}.name")}
    for key in _STRINGS[1:]:
        if key in raw:
            values[key] = r.string(raw[key], f"{path}.{key}")
    for key in COST_FIELDS:
        if key in raw:
            values[key] = r.optional_number(raw[key], f"{path}.{key}")
    for key in _BYTES:
        if key in raw:
            values[key] = r.integer(raw[key], f"{path}.{key}", minimum=0)
    if raw.get("peak_bytes") is not None:
        values["peak_bytes"] = r.integer(raw["peak_bytes"], f"{path}.peak_bytes", minimum=0)
    if "policies" in raw:
        values["policies"] = tuple(
            _policy_from_dict(r, p, f"{path}.policies[{k}]")
            for k, p in enumerate(r.array(raw["policies"], f"{path}.policies"))
        )
    return LayerProfile(**values)


def _layer_dict(layer: LayerProfile) -> dict[str, Any]:
    """A layer's JSON record: its fields, without ``policies`` where none were profiled
    (so that a profile without them reads, writes and hashes as before they existed)."""
    out = dataclasses.asdict(layer)
    if not layer.policies:
        del out["policies"]
    return out


def _policy_from_dict(r: FieldReader, raw: Any, path: str) -> PolicyCost:
    """One :class:`PolicyCost` record, checked."""
    raw = r.mapping(raw, path)
    r.unknown_keys(raw, {f.name for f in dataclasses.fields(PolicyCost)}, path)
    recompute = r.optional_number(r.field(raw, "recompute", path), f"{path}.recompute")
    if recompute is None or recompute > 1:
        r.fail(f"{path}.recompute", f"must be a number in 0..1, got {recompute!r}")
    return PolicyCost(
        policy=r.string(r.field(raw, "policy", path), f"{path}.policy"),
        residual_bytes=r.integer(
            r.field(raw, "residual_bytes", path), f"{path}.residual_bytes", minimum=0
        ),
        host_bytes=r.integer(r.field(raw, "host_bytes", path), f"{path}.host_bytes", minimum=0),
        recompute=float(recompute),
    )


def _json_kind(value: Any) -> str:
    names = {type(None): "null", bool: "a boolean", str: "a string", list: "a list"}
    return names.get(type(value), f"a {type(value).__name__}")
