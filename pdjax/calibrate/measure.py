"""The whole calibration in one process (:func:`calibrate`): the stages, the links between
every ordered pair of devices and the all-reduces of the replicated stages, as one
:class:`~pdjax.calibrate.Calibration`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pdjax.calibrate.calibration import AllReduceMeasure, Calibration, LinkMeasure, StageMeasure
from pdjax.calibrate.links import SIZES, measure_allreduce, measure_link
from pdjax.calibrate.stages import measure_stages, model_fingerprint
from pdjax.errors import CalibrationError

__all__ = ["calibrate"]


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
        link_list = _all_links(devices, sizes=sizes, repeats=repeats, log=log)
    ar_list: list[AllReduceMeasure] = []
    if allreduces:
        ar_list, measured = _stage_allreduces(
            layers, x, devices, measured, sizes=sizes, repeats=repeats
        )
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


def _all_links(
    devices: Sequence[Any], *, sizes: Sequence[int], repeats: int, log: Callable[[str], None]
) -> list[LinkMeasure]:
    """Every ordered pair of ``devices`` measured (those this process takes part in)."""
    link_list: list[LinkMeasure] = []
    for a in devices:
        for c in devices:
            if a is not c:
                m = measure_link(a, c, sizes=sizes, repeats=repeats)
                if m is not None:
                    link_list.append(m)
                    log(f"link {a.id} -> {c.id}: {m.latency * 1e6:.1f} us + "
                        f"{m.bandwidth / 1e9:.2f} GB/s")  # fmt: skip
    return link_list


def _stage_allreduces(
    layers: Any,
    x: Any,
    devices: Sequence[Any],
    measured: list[StageMeasure],
    *,
    sizes: Sequence[int],
    repeats: int,
) -> tuple[list[AllReduceMeasure], list[StageMeasure]]:
    """For each replica count among the ``measured`` stages, the all-reduce over the first
    that many ``devices`` (a fit, and each such stage's own gradient tree): ``(fits,
    measured with their all-reduce seconds)``."""
    import jax

    ar_list: list[AllReduceMeasure] = []
    shapes = jax.eval_shape(layers.init, jax.random.key(0), x)
    for r in sorted({m.replicas for m in measured if m.replicas > 1}):
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
    return ar_list, measured
