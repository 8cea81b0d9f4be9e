"""A hand-written calibration of a 4-layer model on 2 devices (two stages, both links),
shared by the calibration and plan_auto tests."""

from __future__ import annotations

from typing import Any

from pdjax.calibrate import Calibration, LinkMeasure, StageMeasure


def fixed_calibration(**kw: Any) -> Calibration:
    """The calibration, with any field replaced by ``kw``."""
    stages = (
        StageMeasure(0, 1, 1, "split", forward=0.010, backward=0.020, update=0.004),
        StageMeasure(2, 3, 1, "split", forward=0.030, backward=0.050, update=0.002),
        StageMeasure(0, 3, 1, "split", forward=0.040, backward=0.070, update=0.006),
    )
    links = (
        LinkMeasure(0, 1, latency=1e-4, bandwidth=1e6, send_seconds=2e-5),
        LinkMeasure(1, 0, latency=3e-4, bandwidth=5e5, send_seconds=4e-5),
    )
    base: dict[str, Any] = dict(
        model={"layers": [f"l{i}" for i in range(4)], "param_bytes": [4000] * 4},
        microbatch_size=8, devices=(0, 1), platform="cpu", device_kind="cpu",
        stages=stages, links=links, profile_ratio=2.0,
    )  # fmt: skip
    return Calibration(**{**base, **kw})
