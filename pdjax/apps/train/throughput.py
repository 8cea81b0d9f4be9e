"""What a run's speed means for its model: tokens per second, perplexity and model FLOPs
utilisation (MFU).

* **Tokens**: a language model's training tokens are its target positions that count in
  the loss (a negative target, padding, does not): :func:`tokens_per_sample` over the
  training split.
* **Model FLOPs** (:func:`model_flops_per_sample`): XLA's cost analysis of one training
  step of the whole model, forward and backward (the optimizer's update left out, as
  MFU usually counts), on one device, per sample. Rematerialisation, replication and the
  pipeline's own programs do not change it: it is the model's work, not what the run
  executed.
* **Peak** (:func:`peak_flops`): an accelerator's dense peak from the roofline presets
  (:data:`pdjax.profile.devices.DEVICE_MODELS`, matched by the device's kind) times the
  devices used. A CPU has no preset: its peak is measured, the better of a matmul on one
  device alone and one on every device at once (JAX's CPU devices share the host's
  cores: the figure is the whole host's, not multiplied by the device count; a run of
  several processes multiplies it by the processes, each measuring its own).

MFU is ``flops_per_sample * samples_per_second / peak``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax._loss import split_loss
from pdjax.apps import data as data_lib
from pdjax.models import ModelSpec
from pdjax.profile.devices import DEVICE_MODELS
from pdjax.profile.programs import cost_analysis

__all__ = ["Peak", "model_flops_per_sample", "peak_flops", "tokens_per_sample"]


def tokens_per_sample(spec: ModelSpec, ds: data_lib.Dataset) -> float | None:
    """A language model's mean training tokens per sample (target positions with a
    non-negative target), or None for a model that is not a language model."""
    if spec.task != "language_model":
        return None
    # a token file's split is a lazy view: its first rows stand for it
    y = ds.train_y if isinstance(ds.train_y, np.ndarray) else np.asarray(ds.train_y[:1024])
    if y.ndim < 2 or not len(y):
        return None
    return float(np.count_nonzero(y >= 0)) / len(y)


def model_flops_per_sample(spec: ModelSpec, x: Any, y: Any) -> float:
    """The model's training FLOPs per sample: XLA's cost analysis of the loss's forward
    and gradient for the batch ``(x, y)`` (lowered, not compiled or run), over its rows.
    NaN when XLA reports no FLOPs, and with a warning when the model cannot be lowered so."""
    rows = int(np.shape(jax.tree.leaves(x)[0])[0])

    def step(variables: Any, x: Any, y: Any, key: jax.Array) -> Any:
        def loss(params: Any) -> jax.Array:
            merged = [{**v, "params": p} for v, p in zip(variables, params, strict=True)]
            out, _ = spec.layers.apply(merged, x, train=True, rng=key)
            return split_loss(spec.loss(out, y))[0]

        return jax.grad(loss)([v.get("params", {}) for v in variables])

    key = jax.random.key(0)
    try:
        variables = jax.eval_shape(spec.layers.init, key, x)
        lowered = jax.jit(step).lower(variables, x, y, key)
        flops = cost_analysis(lowered).get("flops", math.nan)
    except Exception as e:  # a metric: the run's own checks report what fails
        warnings.warn(
            f"MFU is not reported: the model's FLOPs could not be counted ({type(e).__name__}: "
            f"{e})",
            stacklevel=2,
        )
        return math.nan
    return float(flops) / rows if flops and flops > 0 else math.nan


@dataclasses.dataclass(frozen=True)
class Peak:
    """A peak FLOP rate and where it comes from.

    Attributes:
      flops: FLOP/s of all the devices together.
      source: ``"preset h200 x 4"`` or ``"measured matmul (cpu, float32)"``.
    """

    flops: float
    source: str


def peak_flops(devices: list[jax.Device], dtype: str = "float32") -> Peak:
    """The peak FLOP/s of ``devices`` for ``dtype`` (see the module docstring): a roofline
    preset whose name the device kind holds (``"NVIDIA H200"`` -> ``h200``) times the
    device count, or on a CPU a measured matmul rate of the host."""
    device = devices[0]
    kind = device.device_kind.lower().replace(" ", "").replace("-", "")
    for name in sorted(DEVICE_MODELS, key=len, reverse=True):
        if device.platform != "cpu" and name.replace("-", "") in kind:
            one = DEVICE_MODELS[name].flops_per_second(dtype)
            return Peak(one * len(devices), f"preset {name} x {len(devices)}")
    if device.platform == "cpu":  # each process measures its own host's share
        local = [d for d in devices if d.process_index == jax.process_index()]
        processes = len({d.process_index for d in devices})
        rate = _measured_matmul(local or devices[:1], dtype) * processes
        where = f" x {processes} processes" if processes > 1 else ""
        return Peak(rate, f"measured matmul (cpu, {dtype}){where}")
    return Peak(math.nan, f"unknown ({device.device_kind})")


def _measured_matmul(devices: list[jax.Device], dtype: str) -> float:
    """The host's matmul FLOP/s: the better of one device alone and every device at once
    (each runs an ``n x n`` matmul; best of a few rounds)."""
    return max(_matmul_rate(tuple(devices[:1]), dtype), _matmul_rate(tuple(devices), dtype))


@functools.cache
def _matmul_rate(devices: tuple[jax.Device, ...], dtype: str, n: int = 1024) -> float:
    """FLOP/s of one ``n x n`` matmul on each of ``devices`` at once, the best of 5."""
    mm = jax.jit(lambda a: a @ a)
    arrays = [jax.device_put(jnp.ones((n, n), jnp.dtype(dtype)), d) for d in devices]
    jax.block_until_ready([mm(a) for a in arrays])
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready([mm(a) for a in arrays])
        best = min(best, time.perf_counter() - t0)
    return len(devices) * 2.0 * n**3 / best
