"""The runner of a run (:func:`make_runner`): data parallelism, or a pipeline over the
plan's stages (equal layer counts for ``interleaved`` and ``zb-v``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax

from pdjax.apps.train.config import TrainConfig
from pdjax.apps.train.model_data import check_devices
from pdjax.apps.train.optimizers import build_optimizer
from pdjax.apps.train.planning import plan_of
from pdjax.apps.train.wording import setting
from pdjax.errors import PipelineError
from pdjax.layers.sharding import ShardingRules
from pdjax.mesh import describe_mesh, mesh_size
from pdjax.models import ModelSpec
from pdjax.partition import Plan
from pdjax.pipeline import Pipeline, even_stages
from pdjax.runners import DataParallel, Runner
from pdjax.schedules import SCHEDULE_KINDS


def _optimizer(cfg: TrainConfig, total_updates: int | None) -> optax.GradientTransformation:
    """``cfg``'s optimizer for a run of ``total_updates`` updates (None: as many as a
    ``warmup-cosine`` schedule needs to run past its warmup, where ``decay_steps`` is not
    given)."""
    return build_optimizer(cfg, cfg.warmup_steps + 1 if total_updates is None else total_updates)


def _stages(cfg: TrainConfig, spec: ModelSpec, sample: Any, plan: Any = None) -> tuple[Any, str]:
    """The plan's stages for a pipeline run, and their description (``plan``: the
    :class:`~pdjax.partition.Plan` to run, else :func:`plan_of`'s)."""
    L = len(spec.layers)
    kind = SCHEDULE_KINDS.get(cfg.schedule)
    width = mesh_size(cfg.meshes[0]) if cfg.meshes else 1  # devices per stage
    if kind is not None and not kind.runs_plan_stages:  # equal chunks, placed by the schedule
        P = cfg.devices // width  # sizes checked by check()
        chunks = kind.chunks_for(cfg.chunks)
        stages = _with_meshes(
            cfg, even_stages(L, P * chunks, width, placement=kind.name, chunks=chunks)
        )
        if kind.semantics.v_shaped:
            text = f"{kind.name}: {len(stages)} chunks of {L} layers in a V over {P} devices"
        else:
            text = f"{kind.name}: {len(stages)} chunks of {L} layers over {P} devices"
        return stages, text
    if plan is None:
        plan = plan_of(cfg, spec, sample)
    if plan is None:
        stages = _with_meshes(cfg, even_stages(L, min(L, cfg.devices // width), width))
        if cfg.meshes:
            each = ", ".join(
                f"{describe_mesh(st.mesh_axes)}"
                for st in stages[: 1 if len(cfg.meshes) == 1 else None]
            )
            return (
                stages,
                f"even: {len(stages)} stages of {L} layers, each on {width} devices ({each})",
            )
        return stages, f"even: {len(stages)} stages of {L} layers, one device each"
    plan = _with_meshes(cfg, plan)
    return plan, plan.describe().splitlines()[0]


def _with_meshes(cfg: TrainConfig, stages: Any) -> Any:
    """``stages`` (a Plan or StagePlans) with ``cfg``'s meshes (one for all, or one per
    stage), refused where a stage's device count is not its mesh's size."""
    meshes = cfg.meshes
    if not meshes:
        return stages
    specs = stages.stages if isinstance(stages, Plan) else tuple(stages)
    if len(meshes) == 1:
        meshes = meshes * len(specs)
    if len(meshes) != len(specs):
        raise PipelineError(
            f"{setting('mesh', cfg.mesh)} gives {len(meshes)} meshes for {len(specs)} stages: "
            "give one for every stage, or one per stage separated by ';'"
        )
    new = []
    for s, (st, mesh) in enumerate(zip(specs, meshes, strict=True)):
        if mesh_size(mesh) != len(st.devices):
            raise PipelineError(
                f"stage {s} has {len(st.devices)} devices and {setting('mesh', cfg.mesh)} "
                f"gives it a mesh of {mesh_size(mesh)} ({describe_mesh(mesh)}); give each "
                "stage a mesh of its device count"
            )
        new.append(dataclasses.replace(st, mesh=mesh))
    if isinstance(stages, Plan):
        return dataclasses.replace(stages, stages=tuple(new))
    return tuple(new)


def _rules(cfg: TrainConfig, plan: Any = None) -> ShardingRules:
    """The sharding rules: ``fsdp="auto"`` with ``fsdp_auto``, or where the planner's mesh
    search chose it (a model without annotations: ``plan.options["meshes"]``)."""
    searched = plan.options.get("meshes") if isinstance(plan, Plan) else None
    chose = isinstance(searched, dict) and searched.get("fsdp") == "auto"
    return ShardingRules(fsdp="auto" if cfg.fsdp_auto or chose else None)


def make_runner(
    cfg: TrainConfig,
    spec: ModelSpec,
    sample: Any,
    plan: Any = None,
    total_updates: int | None = None,
) -> tuple[Runner[Any], str]:
    """The :class:`~pdjax.runners.Runner` for ``cfg`` (a :class:`DataParallel` for
    ``schedule="dp"``, else a :class:`Pipeline`), and its plan's text (``plan``: the
    :class:`~pdjax.partition.Plan` to run, instead of :func:`plan_of`'s).
    ``total_updates``: the run's optimizer updates, the length of a ``warmup-cosine``
    learning rate without ``decay_steps``
    (:func:`~pdjax.apps.train.optimizers.run_updates`). The rest of the training loop is
    written against the protocol alone."""
    check_devices(cfg)
    devices = jax.devices()
    if cfg.loss_mean == "tokens":  # the stream's targets are (targets, weight)
        from pdjax.apps.train.token_loss import token_weighted

        spec = dataclasses.replace(spec, loss_fn=token_weighted(spec.loss))
    if cfg.schedule == "dp":  # the one place that picks the runner
        mesh = cfg.meshes[0] if cfg.meshes else None
        dp = DataParallel(
            spec.layers,
            spec.loss,
            _optimizer(cfg, total_updates),
            devices=devices[: cfg.devices],
            mesh=mesh,
            sharding=_rules(cfg),
        )
        on = f" ({describe_mesh(mesh)})" if mesh is not None else ""
        return dp, f"data parallel on {cfg.devices} devices{on}"
    stages, text = _stages(cfg, spec, sample, plan)
    # a plan's memory policies per stage (plan_auto's choice)
    remat = stages.schedule.remat if isinstance(stages, Plan) else False
    runner = Pipeline(
        spec.layers,
        stages,
        spec.loss,
        _optimizer(cfg, total_updates),
        schedule=cfg.spec.replace(remat=remat),
        devices=devices,
        transport=cfg.transport,
        sharding=_rules(cfg, stages),
    )
    for s, r in enumerate(runner.stage_set.batch_ways):
        if cfg.microbatch_size % r and not runner.stages[s].round_robin:
            raise PipelineError(
                f"the plan replicates stage {s} on {r} devices but a microbatch has "
                f"{cfg.microbatch_size} samples; pick {setting('batch_size')} so that "
                "batch_size / "
                f"microbatches is a multiple of {r}"
            )
    rr = [str(s) for s, st in enumerate(runner.stages) if st.round_robin]
    if rr:
        text += f"; round-robin stage{'s' if len(rr) > 1 else ''} {', '.join(rr)}"
    return runner, text
