"""The runner of a run (:func:`make_runner`): data parallelism, or a pipeline over the
plan's stages (equal layer counts for ``interleaved`` and ``zb-v``)."""

from __future__ import annotations

from typing import Any

import jax
import optax

from pdjax.apps.train.config import TrainConfig
from pdjax.apps.train.model_data import check_devices
from pdjax.apps.train.optimizers import build_optimizer
from pdjax.apps.train.planning import plan_of
from pdjax.apps.train.wording import setting
from pdjax.errors import PipelineError
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
    if kind is not None and not kind.runs_plan_stages:  # equal chunks, placed by the schedule
        P = cfg.devices  # sizes checked by check()
        chunks = kind.chunks_for(cfg.chunks)
        stages = even_stages(L, P * chunks, placement=kind.name, chunks=chunks)
        if kind.semantics.v_shaped:
            text = f"{kind.name}: {len(stages)} chunks of {L} layers in a V over {P} devices"
        else:
            text = f"{kind.name}: {len(stages)} chunks of {L} layers over {P} devices"
        return stages, text
    if plan is None:
        plan = plan_of(cfg, spec, sample)
    if plan is None:
        stages = even_stages(L, min(L, cfg.devices))
        return stages, f"even: {len(stages)} stages of {L} layers, one device each"
    return plan, plan.describe().splitlines()[0]


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
    if cfg.schedule == "dp":  # the one place that picks the runner
        dp = DataParallel(
            spec.layers, spec.loss, _optimizer(cfg, total_updates), devices=devices[: cfg.devices]
        )
        return dp, f"data parallel on {cfg.devices} devices"
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
    )
    for s, r in enumerate(runner.replicas):
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
