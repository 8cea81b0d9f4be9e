"""Timing of compiled calls, shared by the profiler and the calibration (imports nothing
from pdjax)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["median_seconds"]


def median_seconds(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` (each waited on with
    ``jax.block_until_ready``), after ``warmup`` untimed calls."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
