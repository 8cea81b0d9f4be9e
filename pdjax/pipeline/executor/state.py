"""What a pipeline carries between calls (:class:`PipelineState`, a pytree) and what one
call measured (:class:`RunMetrics`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np
import optax

from pdjax.layers import PyTree, Variables
from pdjax.schedules.timeline import Timeline

__all__ = ["PipelineState", "RunMetrics"]


class PipelineState(NamedTuple):
    """Everything a pipeline carries between calls (a pytree; newest weights only).

    Attributes:
      params: per stage, the parameters of each of its layers.
      model_state: per stage, each layer's non-parameter collections (BatchNorm stats).
      opt_state: per stage, the optimizer state.
      updates: per stage, the optimizer updates applied so far (its weight version).
      microbatches: microbatches consumed so far (seeds the per-microbatch RNG).
      rng: the base PRNG key for dropout.
    """

    params: tuple[list[PyTree], ...]
    model_state: tuple[list[Variables], ...]
    opt_state: tuple[optax.OptState, ...]
    updates: tuple[int, ...]
    microbatches: int
    rng: jax.Array


@dataclasses.dataclass
class RunMetrics:
    """What one call of :meth:`Pipeline.step` / :meth:`Pipeline.run` measured.

    Attributes:
      losses: per microbatch, its loss (a device array on the last stage).
      peak_versions: per stage, the most weight versions held at once.
      actions: actions dispatched.
      host_seconds: wall time of the driver's loop over the program (dispatching, and any
        waits: the program's run-ahead bounds and one-at-a-time stages, and a device's
        limit of about 32 programs in flight, which makes a driver that runs that far
        ahead wait for its devices).
      host_cpu_seconds: CPU time of the driver's thread over the same loop: what the
        driver itself costs (host work, and any program XLA's CPU client runs inline on
        the dispatching thread), without its waits; ``host_seconds`` minus this is
        mostly time the driver spent waiting for its devices or for a core.
      timeline: per-action measured spans, when asked for (``timeline=True``).
      peak_bytes: with ``timeline=True``, per device group the most bytes of live arrays
        seen on one of its devices after any action (weights, versions, optimizer state,
        stashes, gradients, activations in transit, and whatever the caller holds there).
      ops: operations of the lowered program this process ran (fused actions count once;
        transfers, waits and per-call set-up count too).
      workarounds: the XLA CPU workarounds in force (``pdjax._xla_cpu``), one line each.
      aux: per microbatch, the loss function's auxiliary outputs when it returns
        ``(loss, aux)`` (device arrays on the last stage), else ``None``.
      all_reduces: with ``collectives=True``, per operation kind (``B``, ``BU``, ``U``...)
        the all-reduce operations in the compiled programs this process ran (an XLA
        all-reduce of several arrays at once counts once).
    """

    losses: list[jax.Array]
    peak_versions: tuple[int, ...]
    actions: int
    host_seconds: float
    host_cpu_seconds: float = 0.0
    timeline: Timeline | None = None
    peak_bytes: tuple[int, ...] | None = None
    ops: int = 0
    workarounds: tuple[str, ...] = ()
    all_reduces: dict[str, int] | None = None
    aux: list[PyTree] | None = None

    @property
    def loss(self) -> float:
        """Mean loss over the microbatches (blocks until they are computed)."""
        return float(np.mean([float(x) for x in self.losses]))

    def mean_aux(self) -> PyTree:
        """The loss function's auxiliary outputs averaged over the microbatches (each
        leaf as a float64 NumPy value; blocks until they are computed), or ``None``."""
        if self.aux is None:
            return None
        return jax.tree.map(lambda *a: np.mean(np.stack(a), axis=0), *jax.device_get(self.aux))
