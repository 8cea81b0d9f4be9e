"""The plan a pipeline run follows: ``plan="auto"`` profiles and plans now, stable under
measurement noise (:func:`auto_plan`); ``schedule="auto"`` lets the planner choose the
schedule and microbatches too (:func:`resolve_auto`); else a plan file (:func:`plan_of`).

A run calls its runner with at most ``cfg.calls`` microbatches at a time
(:func:`call_microbatches`), read from the input stream as the call starts, and a
pipeline places every one of their inputs and targets on its first and last stages before
the call's first action. The planner's ``pdjax`` memory model charges them for the call
length it is given, so both planners are given this one (``microbatches_per_call``,
``samples_per_call``): the memory limit then holds for a data set of any size."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pdjax.apps import data as data_lib
from pdjax.apps.train.config import (
    TrainConfig,
    round_robin_by_default,
    runs_plan,
    updates_per_microbatch,
)
from pdjax.apps.train.wording import setting
from pdjax.errors import PipelineError
from pdjax.models import ModelSpec
from pdjax.schedules import FLUSHING, STALE

#: How much slower, predicted on the measured profile, than the measured optimum the plan
#: made from counted costs may be and still be chosen by :func:`auto_plan`. Measured layer
#: times move by a few % from run to run, which swaps plans predicted within that of each
#: other; the counted plan does not move with them.
PLAN_TOLERANCE = 0.05


def epoch_microbatches(cfg: TrainConfig, num_train: int) -> int:
    """``N``, the microbatches of one epoch in a run of ``cfg`` on a training split of
    ``num_train`` samples: ``epoch_steps`` steps of ``cfg.step_microbatches`` where
    given, else a pass over the split (microbatches of ``batch_size /
    step_microbatches`` samples, cut to whole steps unless the schedule updates every
    microbatch), at least 1."""
    m = cfg.step_microbatches
    if cfg.epoch_steps is not None:
        return cfg.epoch_steps * m
    n = num_train // (cfg.batch_size // m)
    if not updates_per_microbatch(cfg.schedule):
        n -= n % m
    return max(n, 1)


def pass_samples(cfg: TrainConfig, ds: data_lib.Dataset) -> int:
    """The samples a pass over ``ds``'s training split trains on: all of them, or with
    ``buckets`` those of the pass's full one-bucket batches (each bucket's remainder waits
    for a later pass: :class:`~pdjax.apps.data.bucket_stream.BucketStream`)."""
    if not cfg.buckets:
        return ds.num_train
    from pdjax.apps.data.bucket_stream import bucket_counts

    counts = bucket_counts(ds, cfg.bucket_lengths)
    return sum(c // cfg.batch_size for c in counts) * cfg.batch_size


def call_microbatches(cfg: TrainConfig, num_train: int) -> int:
    """The microbatches of the longest runtime call of a run of ``cfg``: ``cfg.calls``,
    or an epoch's where that is shorter. Each call's inputs are placed on the devices when
    it starts, so the planner's memory model charges this many (``calls``)."""
    return min(cfg.calls, epoch_microbatches(cfg, num_train))


def auto_plan(
    spec: ModelSpec,
    sample: Any,
    devices: Sequence[jax.Device],
    schedule: str,
    microbatches: int,
    straight: bool = False,
    replication: str = "split",
    min_stages: int = 1,
    calls: int | None = None,
) -> Any:
    """Profiles ``spec`` on one microbatch (measured on ``devices[0]``) and plans it over
    ``devices`` with PipeDream's optimizer (``pdjax`` cost model). ``replication``:
    ``"split"``, or ``"round-robin"`` / ``"auto"`` (``pipedream`` only: PipeDream's own
    replication, or the planner's pick).

    The runtime splits each microbatch evenly over a split stage's devices, which the
    optimizer does not know. When its plan replicates a split stage over a count that does
    not divide the microbatch, this takes the fastest plan that runs: the optimizer's over
    the first ``n`` devices for each smaller ``n``, and its straight pipeline (one device
    per stage, leaving devices idle where that is faster).

    Measured times are noisy, and plans predicted within a few % of each other swap places
    from run to run. So the same is planned on the profile's counted costs (XLA's FLOPs and
    bytes, fitted to the measured seconds: :func:`_counted_profile`), and that plan, whose
    stages do not follow the noise, is returned when it is predicted on the measured
    profile within :data:`PLAN_TOLERANCE` of the measured plan (recorded as
    ``plan.options["stable"]``); else the measured plan. A run that must repeat a plan
    exactly reads it from a file (``pdjax train`` writes the plan it ran).

    ``min_stages``: the fastest plan of at least that many stages, among the optimizer's
    over the first ``n`` devices for each ``n`` and the straight pipelines of
    ``min_stages .. P`` stages (PipeDream's optimizer has no bound on the stage count).
    A plan of one stage (data parallelism) where ``schedule`` is a pipeline's records the
    choice and the best pipeline's prediction as ``plan.options["single_stage"]``
    (:func:`single_stage_note`).

    ``calls``: the microbatches of one runtime call (:func:`epoch_microbatches`), which
    the optimizer's memory model charges (its inputs and targets are placed up front);
    None: its default, the shortest steady call."""
    from pdjax.errors import PlanError
    from pdjax.profile import profile

    prof = profile(spec.layers, sample, measure=True, device=devices[0], repeats=5)
    args = (devices, schedule, microbatches, straight, replication, calls)
    chosen = _stable_plan(prof, args, min_stages)
    if len(chosen.stages) > 1:
        return chosen
    try:  # what a pipeline was predicted to take, for the note
        pipeline = _runnable_plan(prof, *args, min_stages=2)
    except (PlanError, PipelineError):
        pipeline = None
    single = {
        "asked": schedule,
        "chosen": "data parallelism",
        "devices": chosen.stages[0].replicas,
        "predicted": chosen.time_per_microbatch,
        "pipeline_predicted": None if pipeline is None else pipeline.time_per_microbatch,
        "pipeline_stages": None if pipeline is None else len(pipeline.stages),
    }
    return dataclasses.replace(chosen, options={**chosen.options, "single_stage": single})


def _stable_plan(prof: Any, args: tuple[Any, ...], min_stages: int) -> Any:
    """The plan :func:`auto_plan` returns: the counted profile's where it is predicted
    within :data:`PLAN_TOLERANCE` of the measured optimum, else the measured one."""
    from pdjax.errors import PlanError

    measured = _runnable_plan(prof, *args, min_stages=min_stages)
    counted = _counted_profile(prof)
    if counted is None:
        return measured
    try:
        reference = _measured_as(_runnable_plan(counted, *args, min_stages=min_stages), prof)
    except (PlanError, PipelineError):
        return measured
    if reference is None:
        return measured
    if reference.time_per_microbatch > (1 + PLAN_TOLERANCE) * measured.time_per_microbatch:
        return measured
    stable = {"tolerance": PLAN_TOLERANCE, "measured_optimum": measured.time_per_microbatch}
    return dataclasses.replace(reference, options={**reference.options, "stable": stable})


def single_stage_note(plan: Any) -> str | None:
    """What a plan of one data-parallel stage made for a pipeline schedule says on the
    console and in the summary: what was asked, what was chosen and why (the predicted
    times), and how to force a pipeline; None for any other plan."""
    single = getattr(plan, "options", {}).get("single_stage")
    if not isinstance(single, dict):
        return None
    asked, n = single["asked"], single["devices"]
    stage = f"a single data-parallel stage on {n} devices" if n > 1 else "a single stage"
    text = (
        f"no pipeline: {setting('schedule', asked)} asked for one, and the planner "
        f"({setting('plan', 'auto')}) found {stage} fastest, "
        f"{single['predicted'] * 1e3:.4g} ms per microbatch predicted"
    )
    if single.get("pipeline_predicted") is None:
        return text + "; no pipeline of 2 stages or more runs on these devices and layers"
    k = single["pipeline_stages"]
    return (
        f"{text} against {single['pipeline_predicted'] * 1e3:.4g} ms for its best pipeline "
        f"({k} stages); pass {setting('min_stages', 2)} (or {setting('straight', True)}) to "
        "run a pipeline"
    )


def _runnable_plan(
    prof: Any,
    devices: Sequence[jax.Device],
    schedule: str,
    microbatches: int,
    straight: bool,
    replication: str,
    calls: int | None = None,
    *,
    min_stages: int = 1,
) -> Any:
    """The optimizer's plan of ``prof`` over ``devices``, or where the runtime cannot split
    its microbatches so, or it has fewer than ``min_stages`` stages, the fastest that
    runs (:func:`auto_plan`); ``calls``: the runtime call's microbatches, for the memory
    terms."""
    from pdjax.errors import PlanError
    from pdjax.partition import Topology, plan_pipedream

    def plan(devs: Sequence[jax.Device], pure: bool, fewer: bool = False) -> Any:
        return plan_pipedream(
            prof,
            Topology.from_devices(devs),
            schedule=schedule if schedule != "dp" else "1f1b",
            num_microbatches=microbatches,
            straight=pure,
            fewer_machines=fewer,
            replication=replication if round_robin_by_default(schedule) else "split",
            microbatches_per_call=calls,
        )

    def enough(p: Any) -> bool:
        return _splits_evenly(p) and len(p.stages) >= min_stages

    best = plan(devices, straight)
    if enough(best):
        return best
    runnable = []
    for n in range(len(devices) - 1, 0, -1):
        with contextlib.suppress(PlanError):
            runnable.append(plan(devices[:n], False))
    with contextlib.suppress(PlanError):
        runnable.append(plan(devices, True, fewer=True))
    for n in range(min_stages, len(devices) + 1) if min_stages > 1 else ():
        with contextlib.suppress(PlanError):  # a straight pipeline of n stages
            runnable.append(plan(devices[:n], True))
    runnable = [p for p in runnable if enough(p)]
    if not runnable and min_stages > 1:
        raise PipelineError(
            f"{setting('min_stages', min_stages)}: no plan of {min_stages} stages or more "
            f"runs on {len(devices)} devices (each stage needs a layer, and a replicated "
            f"stage a device count dividing the microbatch): lower {setting('min_stages')}, "
            f"or pick {setting('batch_size')} and {setting('microbatches')} so that "
            "batch_size / microbatches divides"
        )
    if not runnable:
        raise PipelineError(
            f"the plan for {len(devices)} devices replicates a stage over a device count "
            f"that does not divide microbatches of {best.microbatch_size} samples, and no "
            f"plan on fewer devices runs: pick {setting('batch_size')} and "
            f"{setting('microbatches')} so that batch_size / microbatches is a multiple of "
            f"the replica counts, or pass {setting('straight', True)}"
        )
    return min(runnable, key=lambda p: p.time_per_microbatch)


def _counted_profile(prof: Any) -> Any:
    """``prof`` with every layer's seconds made from its counted work: ``a * flops + b *
    bytes accessed``, with ``a, b >= 0`` fitted (least squares) to the measured forward and
    backward seconds of all the layers, the backward's split into input and weight
    gradients by their FLOPs. Two numbers fitted to every layer move little with the
    noise of each; None where a layer has no counts or the fit has nothing to go on."""
    rows, seconds = [], []
    for layer in prof.layers:
        for flops, moved, secs in (
            (layer.forward_flops, layer.forward_bytes_accessed, layer.forward_seconds),
            (layer.backward_flops, layer.backward_bytes_accessed, layer.backward_seconds),
        ):
            if flops is None or moved is None or secs is None:
                return None
            rows.append((flops, moved))
            seconds.append(secs)
    coef = _nonnegative_fit(np.asarray(rows, dtype=np.float64), np.asarray(seconds))
    if coef is None:
        return None
    layers = []
    for layer in prof.layers:
        fwd = float(coef @ (layer.forward_flops, layer.forward_bytes_accessed))
        bwd = float(coef @ (layer.backward_flops, layer.backward_bytes_accessed))
        igr, wgr = layer.input_grad_seconds, layer.weight_grad_seconds
        if igr is not None and wgr is not None:
            i_flops, w_flops = layer.input_grad_flops or 0.0, layer.weight_grad_flops or 0.0
            if i_flops + w_flops > 0:
                igr, wgr = bwd * i_flops / (i_flops + w_flops), bwd * w_flops / (i_flops + w_flops)
            else:  # no work counted in either: the backward is the input gradient's
                igr, wgr = bwd, 0.0
        layers.append(
            dataclasses.replace(
                layer,
                forward_seconds=fwd,
                backward_seconds=bwd,
                input_grad_seconds=igr,
                weight_grad_seconds=wgr,
            )
        )
    return dataclasses.replace(prof, layers=tuple(layers), time_source="counted")


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """``c >= 0`` minimising ``|x c - y|`` for two columns (the better one alone where the
    pair would take a negative coefficient), or None where no column has a positive fit."""
    scale = np.linalg.norm(x, axis=0)
    if not np.all(np.isfinite(x)) or not np.all(np.isfinite(y)) or not np.any(scale > 0):
        return None
    z = x / np.where(scale > 0, scale, 1.0)  # FLOPs and bytes are orders of magnitude apart
    both = np.linalg.lstsq(z, y, rcond=None)[0]
    if np.all(both >= 0) and np.all(scale > 0):
        return np.asarray(both / scale)  # numpy types the quotient Any
    best, residual = None, math.inf
    for j in np.flatnonzero(scale > 0):
        c = float(z[:, j] @ y)  # a unit column: its least-squares coefficient
        r = float(np.sum((y - c * z[:, j]) ** 2))
        if c > 0 and r < residual:
            best, residual = np.where(np.arange(2) == j, c / scale[j], 0.0), r
    return best


def _measured_as(plan: Any, prof: Any) -> Any:
    """``plan``'s stages priced on ``prof`` (:func:`~pdjax.partition.evaluate_partition`),
    or None where the evaluation would place them on other devices."""
    from pdjax.partition import evaluate_partition

    got = evaluate_partition(
        prof,
        plan.topology,
        [(st.first_layer, st.last_layer, st.replicas) for st in plan.stages],
        cost_model=plan.cost_model,
        schedule=plan.schedule.kind,
        num_microbatches=plan.num_microbatches,
        microbatch_size=plan.microbatch_size,
        optimizer_state_factor=float(plan.options.get("optimizer_state_factor", 2.0)),
        memory_limit=plan.memory_limit,
        partitioner=plan.partitioner,
        replication=[st.replication for st in plan.stages],
        microbatches_per_call=plan.options.get("microbatches_per_call"),
        meshes=[st.mesh for st in plan.stages],
    )
    if [st.devices for st in got.stages] != [st.devices for st in plan.stages]:
        return None
    return dataclasses.replace(got, options={**plan.options, **got.options})


def _splits_evenly(plan: Any) -> bool:
    """Whether every split stage of ``plan`` has a device count dividing its microbatch."""
    return all(st.round_robin or plan.microbatch_size % st.replicas == 0 for st in plan.stages)


def _call_samples(cfg: TrainConfig, num_train: int) -> int:
    """The samples of the longest runtime call, whatever the microbatches: ``call_steps``
    steps, or an epoch's where that is shorter (``schedule="auto"`` chooses ``M``)."""
    steps = cfg.epoch_steps or max(1, num_train // cfg.batch_size)
    return min(cfg.calls // cfg.step_microbatches, steps) * cfg.batch_size


def resolve_auto(cfg: TrainConfig, spec: ModelSpec, ds: data_lib.Dataset) -> TrainConfig:
    """``cfg`` with ``schedule="auto"`` resolved: the model profiled (measured, on a
    microbatch of ``batch_size / devices`` samples) and planned by
    :func:`~pdjax.partition.plan_auto` over the devices for ``batch_size`` samples per
    step; returns the config of its choice (schedule, microbatches, chunks, in-flight
    depth), with ``plan`` the chosen plan's JSON file (a temporary file, which
    :func:`~pdjax.apps.train.train` replaces by the copy it writes among a run's outputs).
    It searches the schedules whose planned stages the runner takes as they are (``gpipe``,
    ``1f1b``, ``zb-h1``, ``zb-h2``, and with ``allow_stale`` ``pipedream`` and ``2bw``): the
    runner places ``interleaved`` and ``zb-v`` chunks by equal layer counts. Recomputation
    is not chosen without a memory limit (CPU devices have none); where chosen, the runner
    runs the memory policy the plan's spec names per stage.
    Candidates are ranked no faster than the driver and, on in-process CPU devices, their
    shared thread pool allow (:func:`pdjax.apps.bench.host_costs`, measured here first): the
    simulator alone would pick many small microbatches whose dispatch and shared cores it
    does not see. Each candidate must fit the devices' memory for the run's longest
    runtime call (``samples_per_call``: ``call_steps`` steps, their inputs placed
    when the call starts).

    Raises:
      PipelineError: a plan file given with ``schedule="auto"``, or a choice the runtime
        cannot run.
    """
    from pdjax.apps.bench import host_costs
    from pdjax.partition import Topology, plan_auto
    from pdjax.profile import profile

    if cfg.plan not in ("auto", "even"):
        raise PipelineError(
            f"{setting('schedule', 'auto')} plans by itself: drop the {setting('plan')} file"
        )
    devices = jax.devices()[: cfg.devices]
    size = max(1, cfg.batch_size // cfg.devices)
    prof = profile(spec.layers, ds.train_x[:size], measure=True, device=devices[0])
    host = host_costs(spec, (ds.train_x[:size], ds.train_y[:size]), devices)
    # the flush schedules whose planned stages the runner takes as they are (chunked ones
    # run equal layer counts here: their plans are for `pdjax plan --schedule auto`)
    names = [n for n in FLUSHING if runs_plan(n)]
    topology = Topology.from_devices(devices)
    plan = plan_auto(
        prof,
        topology,
        batch_size=cfg.batch_size,
        schedules=names + (list(STALE) if cfg.allow_stale else []),
        straight=cfg.straight or cfg.plan == "even",
        allow_stale=cfg.allow_stale,
        host=host,
        samples_per_call=_call_samples(cfg, pass_samples(cfg, ds)),
        meshes=_mesh_search(cfg, spec, ds.train_x[:size], topology, devices),
    )
    handle, path = tempfile.mkstemp(prefix="pdjax-plan-auto-", suffix=".json")
    os.close(handle)  # the runner reads the plan from a file
    plan.save(path)
    return auto_choice(cfg, plan, path)


def auto_choice(cfg: TrainConfig, plan: Any, path: str | Path) -> TrainConfig:
    """``cfg`` (``schedule="auto"``) as ``plan_auto``'s ``plan`` (saved as ``path``) chose."""
    from pdjax.partition import auto_choice as chosen_by_planner

    if chosen_by_planner(plan) is None:
        raise PipelineError(
            f"the plan {path} was not made by {setting('schedule', 'auto')} (it records no "
            "choice of "
            "schedule): resume with the settings the run was started with"
        )
    spec = plan.schedule
    return dataclasses.replace(
        cfg,
        schedule=spec.kind,
        microbatches=spec.microbatches,
        options=spec.changed,
        plan=str(path),
        allow_stale=False,
        mesh="" if cfg.mesh == "auto" else cfg.mesh,  # the plan's stages carry the meshes
    )


def _mesh_search(
    cfg: TrainConfig, spec: ModelSpec, sample: Any, topology: Any, devices: list[Any]
) -> Any:
    """With ``mesh="auto"``, every layer compiled on every unit mesh the devices allow
    (:func:`~pdjax.partition.choosing.meshes.search_meshes`), for ``sample`` (one
    microbatch); else None."""
    if cfg.mesh != "auto":
        return None
    from pdjax.layers.sharding import ShardingRules
    from pdjax.partition.choosing.meshes import search_meshes

    rules = ShardingRules(fsdp="auto") if cfg.fsdp_auto else None
    return search_meshes(spec.layers, sample, topology, rules=rules, devices=devices)


def _mesh_plan(cfg: TrainConfig, spec: ModelSpec, sample: Any, calls: int | None) -> Any:
    """``plan="auto"`` with ``mesh="auto"`` and a schedule of the user's: the model
    profiled (measured) and :func:`~pdjax.partition.plan_auto` searching the stages,
    their meshes and memory policies for that schedule and microbatch count only."""
    from pdjax.partition import Topology, plan_auto
    from pdjax.profile import profile

    devices = jax.devices()[: cfg.devices]
    size = cfg.microbatch_size
    rows = jax.tree.map(lambda a: a[:size], sample)
    prof = profile(spec.layers, rows, measure=True, device=devices[0])
    topology = Topology.from_devices(devices)
    return plan_auto(
        prof,
        topology,
        batch_size=cfg.batch_size,
        schedules=[cfg.schedule],
        allow_stale=cfg.schedule in STALE,
        microbatches=[cfg.microbatches],
        straight=cfg.straight,
        samples_per_call=None if calls is None else calls * size,
        meshes=_mesh_search(cfg, spec, rows, topology, devices),
    )


def plan_of(cfg: TrainConfig, spec: ModelSpec, sample: Any, calls: int | None = None) -> Any:
    """The :class:`~pdjax.partition.Plan` a pipeline run of ``cfg`` follows: made now
    (:func:`auto_plan`, for runtime calls of ``calls`` microbatches:
    :func:`epoch_microbatches`) for ``plan="auto"``, read from ``cfg.plan``'s file; None
    where the stages follow from the settings alone (``"even"``, ``interleaved``,
    ``zb-v``, ``dp``)."""
    if not runs_plan(cfg.schedule) or cfg.plan == "even":
        return None
    if cfg.plan == "auto" and cfg.mesh == "auto":
        return _mesh_plan(cfg, spec, sample, calls)
    if cfg.plan == "auto":
        return auto_plan(
            spec,
            sample,
            devices=jax.devices()[: cfg.devices],
            schedule=cfg.schedule,
            microbatches=cfg.microbatches,
            straight=cfg.straight,
            replication="round-robin" if cfg.replication == "round-robin" else "split",
            min_stages=cfg.min_stages,
            calls=calls,
        )
    from pdjax.partition import Plan

    return Plan.load(cfg.plan)
