"""The pipeline's stage set (:class:`StageSet`): its stages on their devices, the device
groups they form, the processes that hold them and the tied groups across them, built once
by :func:`build_stages` from the plan and the constructor's options."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import optax

from pdjax import _xla_cpu
from pdjax._memory_policy import check_available
from pdjax.distributed import check_cpu_transfers
from pdjax.errors import PipelineError
from pdjax.layers import LayerSequence
from pdjax.layers.sharding import ShardingRules
from pdjax.mesh import describe_mesh
from pdjax.pipeline.executor.config import (
    plan_stage_devices,
    replication_of,
    scale,
    tied_stage_groups,
)
from pdjax.pipeline.lowering import Placement, StagePlace
from pdjax.pipeline.stage import LossFn, Stage
from pdjax.pipeline.transport import Transport, auto_transport, make_transport
from pdjax.plan.plan import Plan, StagePlan
from pdjax.schedules import ROUND_ROBIN, semantics, stage_groups

__all__ = ["Replication", "StageSet", "build_stages", "place"]


@dataclasses.dataclass(frozen=True)
class StageSet:
    """The stages of a pipeline and where they run; fixed at construction.

    Attributes:
      stages: per stage, its programs (:class:`~pdjax.pipeline.stage.Stage`).
      specs: per stage, its plan (layers and devices).
      chunks: stages per device group.
      num_groups: device groups ``P``.
      stage_device: the device group of each stage (the schedule's ``stage_device``).
      replicas: per device group, its devices.
      batch_ways: per device group, the row blocks a microbatch is split into (its
        devices, or a sharded stage's batch axes).
      process_index: this process.
      owners: per stage, the processes that hold its devices.
      local: per stage, whether this process holds some of its devices.
      tied_stages: per tied group, its name and the stages holding its copies.
    """

    stages: tuple[Stage, ...]
    specs: tuple[StagePlan, ...]
    chunks: int
    num_groups: int
    stage_device: tuple[int, ...]
    replicas: tuple[int, ...]
    batch_ways: tuple[int, ...]
    process_index: int
    owners: tuple[frozenset[int], ...]
    local: tuple[bool, ...]
    tied_stages: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def multiprocess(self) -> bool:
        """Whether some stages run (also) in other processes (``jax.distributed``)."""
        return any(owners != {self.process_index} for owners in self.owners)

    @property
    def tied_across(self) -> tuple[tuple[int, ...], ...]:
        """The stages of each tied group with copies on several stages."""
        return tuple(h for _, h in self.tied_stages if len(h) > 1)

    @property
    def modes(self) -> tuple[str, ...]:
        """Per device group, ``"round-robin"`` or ``"split"`` as the stages run now."""
        return tuple(
            "round-robin" if st.round_robin else "split" for st in self.stages[: self.num_groups]
        )

    @property
    def schedule_replication(self) -> tuple[str, ...] | None:
        """The schedule's per-group modes (``None`` when no stage is round-robin)."""
        if not any(st.round_robin for st in self.stages):
            return None
        return self.modes


@dataclasses.dataclass
class Replication:
    """How the device groups share their work: per group ``"split"`` or
    ``"round-robin"`` (:attr:`modes`), whether the caller asked (else the plan did), and
    notes on the plan's choices that run otherwise."""

    modes: tuple[str, ...]
    asked: bool
    notes: list[str]


def build_stages(
    layers: LayerSequence,
    specs: tuple[StagePlan, ...],
    plan: Plan | Sequence[StagePlan],
    devices: Sequence[jax.Device] | None,
    *,
    schedule: str,
    microbatches: int,
    chunks: int,
    remat: tuple[str, ...],
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    replication: str | Sequence[str] | None,
    sharding: ShardingRules | None = None,
) -> tuple[StageSet, Replication]:
    """The stage set of a plan (``specs``, its stages; their device ids among ``devices``)
    under ``schedule``, and its replication modes; refuses a plan the schedule cannot
    run."""
    if len(specs) % chunks:
        if semantics(schedule).v_shaped:
            raise PipelineError(
                f"zb-v needs an even number 2P of stages in the plan (stages 0..P-1 down "
                f"the device groups, P..2P-1 back up); the plan has {len(specs)}"
            )
        raise PipelineError(
            f"interleaved with chunks={chunks} needs a multiple of {chunks} "
            f"stages, the plan has {len(specs)}"
        )
    num_groups = len(specs) // chunks
    stage_device = stage_groups(schedule, num_groups, chunks)
    rep, round_robin = _round_robin(schedule, microbatches, specs, num_groups, replication)
    stage_devices = plan_stage_devices(plan, specs, devices)
    stages = []
    for s, spec in enumerate(specs):
        g = stage_device[s]
        group_spec = specs[g]
        if tuple(spec.devices) != tuple(group_spec.devices):
            where = "min(s, 2P - 1 - s), the V" if semantics(schedule).v_shaped else "s % P"
            raise PipelineError(
                f"{schedule} stage {s} must use the devices of stage {g} "
                f"({tuple(group_spec.devices)}: stage s runs on the device group of stage "
                f"{where}), got {tuple(spec.devices)}"
            )
        check_available(remat[s], stage_devices[s], PipelineError, f" (stage {s})")
        stages.append(
            Stage(
                index=s,
                layers=layers.layers[spec.first_layer : spec.last_layer + 1],
                first_layer=spec.first_layer,
                devices=list(stage_devices[s]),
                optimizer=optimizer,
                loss_fn=loss_fn if s == len(specs) - 1 else None,
                remat=remat[s],
                scale=scale(schedule, microbatches, len(spec.devices), round_robin[g]),
                round_robin=round_robin[g],
                mesh=spec.mesh,
                rules=sharding,
            )
        )
    # multi-controller runs (jax.distributed): the stages this process drives; per stage,
    # the processes that hold its devices (a replicated stage may span several: each of
    # them runs the stage's programs, SPMD)
    process_index = jax.process_index()
    owners = tuple(frozenset(d.process_index for d in st.devices) for st in stages)
    spanning = [s for s, st in enumerate(stages) if st.sharded and len(owners[s]) > 1]
    if spanning:
        s = spanning[0]
        raise PipelineError(
            f"stage {s} is sharded ({describe_mesh(stages[s].mesh_axes)}) over devices of "
            f"processes {sorted(owners[s])}: a sharded stage runs within one process (its "
            "collectives are XLA's, inside one program); give each sharded stage the "
            "devices of one process, or drop its mesh (a replicated stage may span processes)"
        )
    stage_set = StageSet(
        stages=tuple(stages),
        specs=specs,
        chunks=chunks,
        num_groups=num_groups,
        stage_device=stage_device,
        replicas=tuple(len(spec.devices) for spec in specs[:num_groups]),
        batch_ways=tuple(st.batch_ways for st in stages[:num_groups]),
        process_index=process_index,
        owners=owners,
        local=tuple(process_index in o for o in owners),
        tied_stages=tied_stage_groups(layers, specs),
    )
    return stage_set, rep


def _round_robin(
    schedule: str,
    microbatches: int,
    specs: Sequence[StagePlan],
    num_groups: int,
    replication: str | Sequence[str] | None,
) -> tuple[Replication, list[bool]]:
    """The replication modes per device group and whether each runs round-robin,
    refusing round-robin where the schedule or ``M`` cannot run it."""
    row = semantics(schedule)
    modes = replication_of(replication, specs, num_groups)
    # the plan's choice (not the caller's) falls back to split where round-robin cannot
    # run; for flush schedules and 2bw the two compute the same
    rep = Replication(modes, replication is not None, [])
    if not rep.asked and not row.round_robin:
        if "round-robin" in rep.modes:
            rep.notes.append(
                f"the plan's round-robin stages run split: {schedule} has no round-robin form"
            )
        rep.modes = ("split",) * num_groups
    round_robin = [
        mode == "round-robin" and len(spec.devices) > 1
        for mode, spec in zip(rep.modes, specs, strict=False)
    ]
    if any(round_robin) and not row.round_robin:
        raise PipelineError(
            f"round-robin replication runs with {', '.join(ROUND_ROBIN)}, not "
            f"{schedule}; use replication='split'"
        )
    for s, rr in enumerate(round_robin):
        r = len(specs[s].devices)
        if rr and not row.updates_per_microbatch and microbatches % r:
            raise PipelineError(
                f"stage {s} is round-robin over {r} devices (whole groups of {r} "
                f"microbatches): microbatches (M={microbatches}) must be a multiple "
                f"of {r}"
            )
    return rep, round_robin


def place(
    stage_set: StageSet, transport: str, schedule: str, microbatches: int
) -> tuple[Placement, Transport, _xla_cpu.Workarounds]:
    """The placement the lowering reads, the transport (``auto``: ``device_put`` unless
    the pipeline spans more than 2 processes on CPU) and the XLA CPU workarounds in
    force."""
    stages = stage_set.stages
    platform = stages[0].devices[0].platform
    processes = sorted({p for owners in stage_set.owners for p in owners})
    if transport == "auto":
        transport = auto_transport(platform, len(processes))
    placement = Placement(
        tuple(
            StagePlace(tuple(int(d.id) for d in st.devices), tuple(sorted(owners)))
            for st, owners in zip(stages, stage_set.owners, strict=True)
        ),
        platform,
        transport,
        jax.process_count(),
    )
    made = make_transport(transport)
    multiprocess = stage_set.multiprocess
    workarounds = _xla_cpu.for_pipeline(
        platform,
        tuple(len(st.devices) for st in stages),
        1 if semantics(schedule).updates_per_microbatch else microbatches,
        stage_set.num_groups,
        collectives=multiprocess and made.collectives,
    )
    if multiprocess and made.cross_process_device_put:
        check_cpu_transfers("a pipeline across processes")
    return placement, made, workarounds
