"""Timing helpers shared by the measurements: the median of timed runs, a call given up
after a timeout (a peer process that never answers), and the latency/bandwidth fit."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pdjax.errors import CalibrationError

_T = TypeVar("_T")

__all__ = ["fit_latency_bandwidth"]


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


def with_timeout(what: str, timeout: float, fn: Callable[[], _T]) -> _T:
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
