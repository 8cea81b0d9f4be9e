"""The profile as the planner reads it: per-layer costs of one microbatch as arrays
(:class:`ModelArrays`), with PipeDream's conventions for input layers and unused outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

from pdjax.errors import PlanError, ProfileError
from pdjax.profile import Profile

__all__ = ["ModelArrays", "check_profile", "model_arrays"]


def _is_input(layer_kind: str) -> bool:
    return layer_kind.startswith("Input")


@dataclasses.dataclass(frozen=True)
class ModelArrays:
    """Per-layer costs for one microbatch, as the planner uses them (private).

    PipeDream's conventions are applied as its optimizer does: an ``Input`` source layer
    (data loading) costs nothing and has no activation of its own to send, and no cut may
    come right after it (it stays with its consumer); ``__getitem__`` sinks (unused outputs
    of LSTMs in the GNMT profiles) cost nothing and do not hold activations across cuts.

    Attributes:
      compute: forward + backward seconds per layer, shape ``(L,)``.
      params: parameter bytes per layer.
      stash: bytes held per in-flight microbatch (input + residuals).
      act: output activation bytes per layer (``pipedream-code``'s memory rule).
      cut: bytes crossing a cut after each layer; ``cut[L-1] = 0``.
      cut_ok: whether a cut may follow each layer; ``cut_ok[L-1]`` is False.
      scale: microbatch size / profiled batch size.
    """

    compute: np.ndarray
    params: np.ndarray
    stash: np.ndarray
    act: np.ndarray
    cut: np.ndarray
    cut_ok: np.ndarray
    scale: float

    @property
    def num_layers(self) -> int:
        return len(self.compute)

    def range_sum(self, values: np.ndarray) -> np.ndarray:
        """``(L, L)`` array of ``sum(values[i..j])`` at ``[i, j]`` (meaningless for i > j)."""
        prefix: npt.NDArray[np.float64] = np.concatenate(
            [[0.0], np.cumsum(values, dtype=np.float64)]
        )
        return prefix[None, 1:] - prefix[:-1, None]


def check_profile(profile: Profile) -> None:
    """Raises PlanError for a profile the planner cannot use (no layers, a cycle, no times)."""
    layers = getattr(profile, "layers", ())
    if len(layers) == 0:
        raise PlanError("the profile has no layers; profile a model with at least one layer")
    n = len(layers)
    for a, b in getattr(profile, "edges", ()):
        if not (0 <= a < n and 0 <= b < n):
            raise PlanError(f"the profile's edge ({a}, {b}) names a layer outside 0..{n - 1}")
        if a >= b:
            raise PlanError(
                f"the profile's edge ({a}, {b}) goes backwards: the graph has a cycle or its "
                "layers are not in a topological order; re-read it with "
                "pdjax.profile.read_graph_txt, which sorts it"
            )
    if getattr(profile, "batch_size", 0) <= 0:
        raise PlanError(f"the profile's batch_size must be positive, got {profile.batch_size}")


def model_arrays(profile: Profile, microbatch_size: int | None = None) -> ModelArrays:
    """The profile's per-layer costs for one microbatch (see :class:`ModelArrays`).

    Raises:
      PlanError: a bad profile, missing times, or a non-positive microbatch size.
    """
    # Kept on the profile, per microbatch size (the planner asks for the same arrays
    # thousands of times): a Profile is a frozen dataclass and the arrays depend on its
    # fields alone (as its own content_hash cache; dataclasses.replace makes a new one).
    # Each call gets its own copies, which the caller may change.
    kept: dict[Any, ModelArrays] | None = None
    if isinstance(getattr(profile, "__dict__", None), dict):
        kept = profile.__dict__.setdefault("_model_arrays", {})
    key = (type(microbatch_size), microbatch_size)
    arrays = None if kept is None else kept.get(key)
    if arrays is None:
        arrays = _model_arrays(profile, microbatch_size)
        if kept is not None:
            kept[key] = arrays
    return dataclasses.replace(
        arrays,
        compute=arrays.compute.copy(),
        params=arrays.params.copy(),
        stash=arrays.stash.copy(),
        act=arrays.act.copy(),
        cut=arrays.cut.copy(),
        cut_ok=arrays.cut_ok.copy(),
    )


def _model_arrays(profile: Profile, microbatch_size: int | None) -> ModelArrays:
    """:func:`model_arrays`, computed."""
    check_profile(profile)
    if microbatch_size is None:
        microbatch_size = profile.batch_size
    if microbatch_size <= 0:
        raise PlanError(f"microbatch_size must be positive, got {microbatch_size}")
    scale = microbatch_size / profile.batch_size
    try:
        seconds = profile.forward_seconds() + profile.backward_seconds()
    except ProfileError as e:
        raise PlanError(f"cannot plan without per-layer times: {e}") from e
    layers = profile.layers
    n = len(layers)
    has_pred = np.zeros(n, dtype=bool)
    for _, b in profile.edges:
        has_pred[b] = True
    has_succ = np.zeros(n, dtype=bool)
    for a, _ in profile.edges:
        has_succ[a] = True
    is_input = np.array(
        [_is_input(layer.kind) and not has_pred[i] for i, layer in enumerate(layers)]
    )
    dropped_sink = np.array(
        [layer.kind.startswith("__getitem__") and not has_succ[i] for i, layer in enumerate(layers)]
    )
    free = is_input | dropped_sink
    if not np.all(np.isfinite(seconds)) or np.any(seconds < 0):
        raise PlanError("the profile has negative or non-finite layer times")
    compute = np.where(free, 0.0, seconds) * scale
    params = np.where(free, 0.0, profile.param_bytes())
    outputs = np.where(free, 0.0, profile.output_bytes())
    stash = np.where(free, 0.0, [float(layer.stash_bytes) for layer in layers]) * scale
    act = outputs * scale
    # Bytes crossing a cut after s: each producer's output counts for s in [a, last use).
    diff = np.zeros(n + 1)
    last_use: dict[int, int] = {}
    for a, b in profile.edges:
        if dropped_sink[b]:
            continue
        last_use[a] = max(last_use.get(a, a), b)
    for a, last in last_use.items():
        diff[a] += outputs[a]
        diff[last] -= outputs[a]
    cut = np.cumsum(diff[:n]) * scale
    cut[n - 1] = 0.0
    cut = np.maximum(cut, 0.0)  # cumulative sums may leave -0.0 or 1e-9 residues
    cut_ok = ~is_input
    cut_ok[n - 1] = False
    return ModelArrays(
        compute=compute, params=params, stash=stash, act=act, cut=cut, cut_ok=cut_ok, scale=scale
    )
