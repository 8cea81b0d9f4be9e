"""Where the GPU check's pipeline stages go: all on device 0, or spread if refused."""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax

import pdjax
from pdjax.errors import PipelineError
from pdjax.models import ModelSpec
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline
from pdjax.schedules import ScheduleSpec

from .sizes import Sizes


def shared_plan(num_layers: int, num_stages: int) -> tuple[StagePlan, ...]:
    """``even_stages`` layer ranges, every stage on device 0: the pipeline's own work
    with nothing to overlap, so its slowdown against one jit is pure machinery."""
    return tuple(
        StagePlan(s.first_layer, s.last_layer, (0,))
        for s in pdjax.even_stages(num_layers, num_stages)
    )


def spread_plan(num_layers: int, num_stages: int, num_devices: int) -> tuple[StagePlan, ...]:
    """The fallback if a runtime refuses stages sharing a device: stage ``s`` on device
    ``s % num_devices`` (still all on device 0 when only one is visible)."""
    return tuple(
        StagePlan(s.first_layer, s.last_layer, (i % num_devices,))
        for i, s in enumerate(pdjax.even_stages(num_layers, num_stages))
    )


def make_pipeline(
    spec: ModelSpec,
    optimizer: optax.GradientTransformation,
    schedule: str,
    sizes: Sizes,
    pipeline_cls: Callable[..., Pipeline] = Pipeline,
) -> tuple[Pipeline, str]:
    """A pipeline of ``spec`` with all stages on device 0, and a note on the placement.

    If the runtime refuses stages that share a device, falls back to
    :func:`spread_plan` and says why in the note (the results carry it).
    """

    def build(plan: tuple[StagePlan, ...]) -> Pipeline:
        return pipeline_cls(
            spec.layers,
            plan,
            spec.loss,
            optimizer,
            schedule=ScheduleSpec(schedule, microbatches=sizes.microbatches),
        )

    try:
        return build(shared_plan(len(spec.layers), sizes.stages)), "all stages on device 0"
    except PipelineError as e:
        n = len(jax.devices())
        plan = spread_plan(len(spec.layers), sizes.stages, n)
        note = f"stages sharing device 0 refused ({e}); stage s on device s % {n}: " + ", ".join(
            str(s.devices[0]) for s in plan
        )
        return build(plan), note
