"""What :class:`Pipeline <pdjax.pipeline.Pipeline>`'s constructor reads and checks: the
plan's stages (:func:`even_stages`, :func:`_stages_of`), their devices, and the options
(integers, memory policies, replication modes, the schedule's options)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax

from pdjax._memory_policy import memory_policies
from pdjax.errors import PipelineError
from pdjax.layers import LayerSequence
from pdjax.plan.plan import Plan, StagePlan
from pdjax.schedules import SCHEDULES, Schedule, ScheduleSpec, schedule_kind, semantics, validate

__all__ = ["even_stages"]


def even_stages(
    num_layers: int,
    num_stages: int,
    replicas: int = 1,
    first_device: int = 0,
    *,
    placement: str | None = None,
    chunks: int | None = None,
) -> tuple[StagePlan, ...]:
    """Splits ``num_layers`` layers into ``num_stages`` near-equal contiguous stages, stage
    ``s`` on devices ``first_device + s*replicas ..`` (``replicas`` each): a plan for
    :class:`Pipeline <pdjax.pipeline.Pipeline>`, its devices indices into the pipeline's.

    >>> [(s.first_layer, s.last_layer, s.devices) for s in even_stages(5, 2)]
    [(0, 2, (0,)), (3, 4, (1,))]

    A chunked schedule runs several stages per device group: ``placement`` names the
    schedule whose placement the stages follow (its kind's
    :attr:`~pdjax.schedules.ScheduleKind.placement`): ``"interleaved"`` puts stage ``s`` on
    group ``s % P`` (with ``chunks=v``, as given to the pipeline: ``P = num_stages / v``),
    ``"zb-v"`` the V, stage ``s`` on group ``min(s, 2P - 1 - s)`` (``P = num_stages / 2``);
    group ``g`` is devices ``first_device + g*replicas ..``. A schedule of one stage per
    group places them as without ``placement``.

    >>> [s.devices[0] for s in even_stages(8, 4, placement="zb-v")]
    [0, 1, 1, 0]
    >>> [s.devices[0] for s in even_stages(8, 4, placement="interleaved", chunks=2)]
    [0, 1, 0, 1]

    Raises:
      PipelineError: for an argument that is not an integer (``num_layers``,
        ``num_stages``, ``replicas`` >= 1, ``first_device`` >= 0), more stages than
        layers, an unknown ``placement``, ``chunks`` without a chunked placement (or not
        the schedule's own count), ``interleaved`` without ``chunks``, or a stage count
        that is not a multiple of the chunks.
    """
    args = {"num_layers": num_layers, "num_stages": num_stages, "replicas": replicas}
    for name, value in {**args, "first_device": first_device}.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise PipelineError(
                f"even_stages {name} must be an integer, got {type(value).__name__} {value!r}"
            )
    if replicas < 1:
        raise PipelineError(f"replicas must be >= 1, got {replicas}")
    if first_device < 0:
        raise PipelineError(f"first_device must be >= 0, got {first_device}")
    if not 1 <= num_stages <= num_layers:
        raise PipelineError(
            f"num_stages must be in 1..{num_layers} (one layer at least per stage), "
            f"got {num_stages}"
        )
    groups = _placed_groups(num_stages, placement, chunks)
    bounds = [-(-s * num_layers // num_stages) for s in range(num_stages + 1)]  # ceil
    return tuple(
        StagePlan(
            first_layer=bounds[s],
            last_layer=bounds[s + 1] - 1,
            devices=tuple(
                range(
                    first_device + groups[s] * replicas, first_device + (groups[s] + 1) * replicas
                )
            ),
        )
        for s in range(num_stages)
    )


def _placed_groups(num_stages: int, placement: Any, chunks: Any) -> tuple[int, ...]:
    """The device group of each stage of :func:`even_stages` under ``placement``."""
    if placement is None:
        if chunks is not None:
            raise PipelineError(
                f"even_stages chunks={chunks!r} goes with a chunked placement: pass "
                "placement='interleaved' (or 'zb-v') too, or drop chunks"
            )
        return tuple(range(num_stages))
    if not isinstance(placement, str) or placement not in SCHEDULES:
        raise PipelineError(
            f"even_stages placement must be a schedule name, one of {', '.join(SCHEDULES)} "
            f"(its stages' placement: 'interleaved' s % P, 'zb-v' the V), got {placement!r}"
        )
    kind = schedule_kind(placement)
    if kind.chunks is None:  # the caller's v
        if chunks is None:
            raise PipelineError(
                f"even_stages placement={placement!r} takes the chunks per device group: "
                f"pass chunks=v, the same as the pipeline's (num_stages = P * v)"
            )
        v = integer("even_stages chunks", chunks, 1)
    else:
        if chunks is not None and chunks != kind.chunks:
            raise PipelineError(
                f"{placement} runs {kind.chunks} stage{'s' if kind.chunks > 1 else ''} per "
                f"device group: even_stages chunks must be {kind.chunks} or None, got {chunks!r}"
            )
        v = kind.chunks
    if num_stages % v:
        raise PipelineError(
            f"even_stages placement={placement!r} puts {v} stages on each device group "
            f"({kind.placement.rule}): num_stages must be a multiple of {v}, got {num_stages}"
        )
    return kind.stage_groups(num_stages // v, v)


def check_cover(specs: Sequence[StagePlan], num_layers: int) -> None:
    """Refuses stages that do not cover the model's layers contiguously, in order."""
    if not specs:
        raise PipelineError("the plan has no stages")
    expected = 0
    for s, spec in enumerate(specs):
        if spec.first_layer != expected or spec.last_layer < spec.first_layer:
            raise PipelineError(
                f"stage {s} holds layers {spec.first_layer}-{spec.last_layer}, expected it "
                f"to start at layer {expected}: stages must cover layers 0-{num_layers - 1} "
                "contiguously, in order"
            )
        if not spec.devices:
            raise PipelineError(f"stage {s} has no devices")
        expected = spec.last_layer + 1
    if expected != num_layers:
        raise PipelineError(
            f"the plan's stages cover layers 0-{expected - 1}, the model has {num_layers} "
            f"layers (0-{num_layers - 1})"
        )


def stages_of(plan: Plan | Sequence[StagePlan]) -> tuple[StagePlan, ...]:
    """The stages of ``plan`` (a :class:`~pdjax.partition.Plan`, or its stages alone);
    anything else is refused naming what to pass."""
    if isinstance(plan, Plan):
        return plan.stages
    what = "pdjax.partition.Plan or a sequence of pdjax.partition.StagePlan"
    how = (
        "e.g. pdjax.even_stages(num_layers, num_stages), or StagePlan(first_layer, "
        "last_layer, devices) per stage (StagePlan(0, 1, (0,)): layers 0-1 on device 0)"
    )
    if isinstance(plan, (str, bytes)) or not isinstance(plan, Sequence):
        raise PipelineError(f"plan must be a {what}, got a {type(plan).__name__}; {how}")
    for s, stage in enumerate(plan):
        if not isinstance(stage, StagePlan):
            raise PipelineError(
                f"plan stage {s} is a {type(stage).__name__}, not a StagePlan: pass a {what} "
                f"({how})"
            )
    return tuple(plan)


def check_scope(optimizer_scope: Any) -> None:
    """Refuses an ``optimizer_scope`` other than ``"model"`` or ``"stage"``."""
    if optimizer_scope not in ("model", "stage"):
        raise PipelineError(f"optimizer_scope must be 'model' or 'stage', got {optimizer_scope!r}")


def schedule_of(
    plan: Any, schedule: ScheduleSpec | Schedule | None
) -> tuple[Schedule | None, ScheduleSpec]:
    """What a pipeline runs: a given :class:`Schedule` (validated here) with its spec, or
    the spec given, or the plan's; ``ScheduleSpec("1f1b")`` for stages without one."""
    if schedule is None:
        spec = plan.schedule if isinstance(plan, Plan) else ScheduleSpec("1f1b")
        return None, spec
    if isinstance(schedule, ScheduleSpec):
        return None, schedule
    if isinstance(schedule, Schedule):
        validate(schedule)
        return schedule, schedule.spec
    hint = (
        f"schedule=ScheduleSpec({schedule!r}, microbatches=M)"
        if isinstance(schedule, str)
        else "a ScheduleSpec or a Schedule"
    )
    raise PipelineError(
        f"schedule must be a ScheduleSpec, a Schedule or None (the plan's), got "
        f"{type(schedule).__name__} {schedule!r}; pass {hint}"
    )


def integer(name: str, value: Any, least: int, most: int | None = None, why: str = "") -> int:
    """``value`` of the constructor argument ``name`` as an ``int`` >= ``least`` (and <=
    ``most``, ``why`` saying why). Bools, floats and strings are refused rather than rounded:
    ``microbatches=2.5`` or ``"2"`` is a mistake that would otherwise surface as a raw
    error deep in the schedule."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise PipelineError(
            f"{name} must be an integer >= {least}, got {value!r}"
            f" ({type(value).__name__}); pass a whole number such as {max(least, 1)}"
        )
    number = int(value)
    if most is not None and number > most:
        digits = len(str(number))
        shown = f"an integer of {digits} digits" if digits > 20 else str(number)
        raise PipelineError(f"{name} must be at most {most}, got {shown}{why}")
    return number


def remat_policies(remat: Any, num_stages: int) -> tuple[str, ...]:
    """``remat`` as one memory policy per stage (:mod:`pdjax._memory_policy`): a bool
    (``True`` is ``"full"``) or a policy name for every stage, or one of them per stage."""
    return memory_policies(remat, num_stages, PipelineError)


def tied_stage_groups(
    layers: LayerSequence, specs: Sequence[StagePlan]
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Per tied group of ``layers``, its name and the stages (``specs``) holding copies."""
    stage_of = {
        i: s for s, sp in enumerate(specs) for i in range(sp.first_layer, sp.last_layer + 1)
    }
    return tuple(
        (name, tuple(sorted({stage_of[i] for i, _ in leaves})))
        for name, leaves in layers.tied_leaves
    )


def replication_of(
    replication: str | Sequence[str] | None, specs: Sequence[StagePlan], groups: int
) -> tuple[str, ...]:
    """Per device group ``"split"`` or ``"round-robin"`` (see :class:`Pipeline`)."""
    if replication is None:
        modes = tuple(spec.replication for spec in specs[:groups])
    elif isinstance(replication, str):
        modes = (replication,) * groups
    elif isinstance(replication, Sequence):
        modes = tuple(replication)
    else:
        raise PipelineError(
            f"replication must be 'split', 'round-robin', one of them per stage, or None, "
            f"got {replication!r}"
        )
    if len(modes) != groups:
        raise PipelineError(
            f"replication has {len(modes)} entries for {groups} stages; give one per stage "
            "or one word for all"
        )
    for mode in modes:
        if mode not in ("split", "round-robin"):
            raise PipelineError(f"replication must be 'split' or 'round-robin', got {mode!r}")
    return modes


def plan_stage_devices(
    plan: Plan | Sequence[StagePlan],
    specs: Sequence[StagePlan],
    devices: Sequence[jax.Device] | None,
) -> list[list[jax.Device]]:
    """Per stage, the devices its plan ids name among ``devices`` (default
    ``jax.devices()``; see :class:`Pipeline`): by ``jax.Device.id`` for a plan whose
    ``topology.device_ids`` is set (:meth:`pdjax.partition.Topology.from_devices`), else
    by index into ``devices``."""
    visible = list(jax.devices() if devices is None else devices)
    for s, spec in enumerate(specs):
        ids = tuple(spec.devices)
        if len(set(ids)) != len(ids) or any(d < 0 for d in ids):
            raise PipelineError(f"stage {s} lists devices {ids}: ids must be distinct and >= 0")
    wanted = sorted({int(d) for spec in specs for d in spec.devices})
    topology_ids = plan.topology.device_ids if isinstance(plan, Plan) else None
    if topology_ids is not None:  # real jax.Device ids
        by_id = {int(d.id): d for d in visible}
        missing = [d for d in wanted if d not in by_id]
        if missing:
            raise PipelineError(
                f"the plan places stages on device ids {_id_list(missing)}, which are not "
                f"among the visible devices (ids {_id_list(sorted(by_id))}): the plan was made "
                f"on real devices (its topology's device_ids are {_id_list(topology_ids)}) "
                "and names them by jax.Device.id. Pass devices= holding those devices (the "
                "processes that have them must take part), or re-plan on these devices "
                "(Topology.from_devices(devices))"
            )
        return [[by_id[int(d)] for d in spec.devices] for spec in specs]
    if wanted and wanted[-1] >= len(visible):
        raise PipelineError(
            f"the plan uses device ids up to {wanted[-1]} but only {len(visible)} devices are "
            "visible (its ids are indices into the devices: a hand-written plan or a topology "
            "without device_ids); on CPU set jax.config.update('jax_num_cpu_devices', N) (or "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N) before using JAX"
        )
    return [[visible[int(d)] for d in spec.devices] for spec in specs]


def _id_list(ids: Sequence[int]) -> str:
    """``[0-3, 6]`` for ids 0, 1, 2, 3, 6: runs of consecutive ids as ranges."""
    parts: list[str] = []
    ordered = list(ids)
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            a, b = ordered[start], ordered[i - 1]
            parts.append(str(a) if a == b else f"{a}-{b}")
            start = i
    return "[" + ", ".join(parts) + "]"


def scale(schedule: str, microbatches: int, replicas: int, round_robin: bool) -> float:
    """The factor on a stage's summed gradients before its update: the mean over the
    microbatches one update applies (``M``; a round-robin group under ``pipedream``)."""
    if semantics(schedule).updates_per_microbatch:
        return 1.0 / replicas if round_robin else 1.0
    return 1.0 / microbatches
