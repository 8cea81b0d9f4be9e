"""The host's share of a step, measured: the driver's seconds per dispatched action
(:func:`driver_seconds_per_action`), how much work in-process CPU devices' shared thread
pool gets through at once (:func:`pool_concurrency`), and both as the planner's
:class:`pdjax.partition.HostCosts` (:func:`host_costs`).

Everything here is re-exported by :mod:`pdjax.apps.bench`, the module to import.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from pdjax.models import ModelSpec
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline, even_stages
from pdjax.schedules import ScheduleSpec

__all__ = ["driver_seconds_per_action", "host_costs", "pool_concurrency"]


def shared_pool(devices: Sequence[jax.Device]) -> bool:
    """Whether the devices are in-process CPU devices, which share one thread pool."""
    return len(devices) > 1 and all(d.platform == "cpu" for d in devices)


def pool_concurrency(
    spec: ModelSpec, sample: tuple[Any, Any], devices: Sequence[jax.Device], rounds: int = 30
) -> float:
    """How much work in-process CPU devices get through at once: the seconds of ``2 n``
    forward-backward passes of the whole model on one device, over the seconds of ``n`` on
    each of two devices dispatched together (1.0: programs run one at a time; up to the
    cores). 1.0 where the devices do not share a pool."""
    if not shared_pool(devices):
        return 1.0
    x, y = sample
    params = jax.jit(spec.layers.init)(jax.random.key(0), x)

    def loss(v: Any, x: Any, y: Any) -> Any:
        return spec.loss(spec.layers.apply(v, x, train=False)[0], y)

    step = jax.jit(jax.grad(loss))
    args = [jax.device_put((params, x, y), d) for d in devices[:2]]

    def timed(plan: Sequence[int]) -> float:
        jax.block_until_ready([step(*args[d]) for d in (0, 1)])  # compiled, warm
        t0 = time.perf_counter()
        jax.block_until_ready([step(*args[d]) for d in plan])
        return time.perf_counter() - t0

    serial = statistics.median(timed([0] * (2 * rounds)) for _ in range(5))
    together = statistics.median(timed([0, 1] * rounds) for _ in range(5))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
    return min(max(serial / together, 1.0), float(cores))


def driver_seconds_per_action(devices: Sequence[jax.Device], seed: int = 0) -> float:
    """The driver's host seconds per dispatched action where compute is next to nothing:
    8 dense layers of width 16 as one stage per device (at most 8), ``1f1b`` with
    ``M = 16``; the median of ``RunMetrics.host_seconds / actions`` over 5 calls after a
    warm-up."""
    import flax.linen as nn

    from pdjax.layers import sequential

    width, n = 16, max(1, min(8, len(devices)))
    layers = sequential([nn.Dense(width) for _ in range(8)])
    x = np.zeros((64, width), np.float32)

    def loss(out: Any, y: Any) -> Any:
        return ((out - y) ** 2).mean()

    pipe = Pipeline(
        layers,
        tuple(
            StagePlan(st.first_layer, st.last_layer, (i,)) for i, st in enumerate(even_stages(8, n))
        ),
        loss,
        optax.sgd(1e-3),
        schedule=ScheduleSpec("1f1b", microbatches=16),
        devices=list(devices),
    )
    batch = pipe.split_batch((x, x))
    state = pipe.init(jax.random.key(seed), batch[0][0])
    out = []
    for k in range(6):
        state, metrics = pipe.run(state, batch)
        jax.block_until_ready(state)
        if k:
            out.append(metrics.host_seconds / metrics.actions)
    return statistics.median(out)


def host_costs(spec: ModelSpec, sample: tuple[Any, Any], devices: Sequence[jax.Device]) -> Any:
    """:class:`pdjax.partition.HostCosts` measured on ``devices``: the driver's seconds per
    action, and for in-process CPU devices the shared pool's concurrency on ``spec``'s
    forward-backward over ``sample`` (:func:`pool_concurrency`)."""
    from pdjax.partition import HostCosts

    concurrency = pool_concurrency(spec, sample, devices) if shared_pool(devices) else None
    return HostCosts(driver_seconds_per_action(devices), concurrency)
