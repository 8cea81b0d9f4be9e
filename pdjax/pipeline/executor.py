"""The runtime: a pipeline of stages on devices, run as lowered programs.

A call (:meth:`Pipeline.step`, :meth:`Pipeline.run`) takes the validated schedule for its
number of microbatches, lowers it once (:func:`pdjax.pipeline.program.lower`, cached) into
this process's flat list of operations, binds each operation to a function once (a stage
program, a transfer of the pipeline's :mod:`~pdjax.pipeline.transport`, a wait), and then
the interpreter only calls them in order on a register file: every weight version,
activation, residual and gradient was given its slot, its producer, its readers and the
point where it is dropped at lowering time. Dispatch is asynchronous, so the device
groups overlap: the driver runs ahead, and each device works as soon as its inputs are
ready.

Semantics (``shared/DESIGN.md``, "Schedules and their semantics") come from the schedule:
every ``F``/``B``/``I``/``W`` reads the weight version its action names, ``U`` applies the
summed gradients to the newest version and makes the next one. Flush schedules and ``2bw``
scale the summed gradients of a step by ``1 / M`` (the mean over microbatches);
``pipedream`` applies each microbatch's gradient alone.

Per microbatch ``k`` (counted over the pipeline's life), layer ``i`` draws dropout from
``fold_in(fold_in(rng, k), i)``. BatchNorm statistics are updated by each microbatch's
forward, in the order the stage runs the forwards (microbatch order in every schedule),
so statistics are microbatch statistics, as in gradient accumulation.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdjax import _xla_cpu, export
from pdjax._sharding import held
from pdjax.distributed import allgather_json, check_cpu_transfers
from pdjax.errors import PdjaxError, PipelineError
from pdjax.layers import LayerSequence, PyTree, Variables
from pdjax.pipeline.optim import StageOptimizer
from pdjax.pipeline.program import Op, Placement, Program, StagePlace, lower
from pdjax.pipeline.schedules import (
    FLUSHING,
    ROUND_ROBIN,
    SCHEDULES,
    STALE,
    STREAMING,
    Schedule,
    generate,
    stage_groups,
    validate,
)
from pdjax.pipeline.stage import LossFn, Stage, StageTies, split_loss, with_aux
from pdjax.pipeline.timeline import Span, Timeline
from pdjax.pipeline.transport import make_transport

__all__ = ["Pipeline", "PipelineState", "RunMetrics", "StageSpec", "even_stages"]


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """Where a stage is: layers ``first_layer..last_layer`` (inclusive) on ``devices``.

    The same fields as :class:`pdjax.partition.StagePlan`; either works as a plan stage.
    A sequence of stages handed to :class:`Pipeline` (rather than a whole
    :class:`~pdjax.partition.Plan`) names its devices by index into the pipeline's
    ``devices`` (default ``jax.devices()``): ``(0, 1)`` is the first two of them,
    whatever their ``jax.Device.id``.
    """

    first_layer: int
    last_layer: int
    devices: tuple[int, ...]


def even_stages(
    num_layers: int, num_stages: int, replicas: int = 1, first_device: int = 0
) -> tuple[StageSpec, ...]:
    """Splits ``num_layers`` layers into ``num_stages`` near-equal contiguous stages, stage
    ``s`` on devices ``first_device + s*replicas ..`` (``replicas`` each).

    >>> [(s.first_layer, s.last_layer, s.devices) for s in even_stages(5, 2)]
    [(0, 2, (0,)), (3, 4, (1,))]
    """
    if replicas < 1:
        raise PipelineError(f"replicas must be >= 1, got {replicas}")
    if not 1 <= num_stages <= num_layers:
        raise PipelineError(
            f"num_stages must be in 1..{num_layers} (one layer at least per stage), "
            f"got {num_stages}"
        )
    bounds = [-(-s * num_layers // num_stages) for s in range(num_stages + 1)]  # ceil
    return tuple(
        StageSpec(
            bounds[s],
            bounds[s + 1] - 1,
            tuple(range(first_device + s * replicas, first_device + (s + 1) * replicas)),
        )
        for s in range(num_stages)
    )


class PipelineState(NamedTuple):
    """Everything a pipeline carries between calls (a pytree; newest weights only).

    Attributes:
      params: per stage, the parameters of each of its layers.
      model_state: per stage, each layer's non-parameter collections (BatchNorm stats).
      opt_state: per stage, the optimizer state.
      updates: per stage, the optimizer updates applied so far (its weight version).
      microbatches: microbatches consumed so far (seeds the per-microbatch RNG).
      rng: the base PRNG key for dropout.
    """

    params: tuple[list[PyTree], ...]
    model_state: tuple[list[Variables], ...]
    opt_state: tuple[optax.OptState, ...]
    updates: tuple[int, ...]
    microbatches: int
    rng: jax.Array


@dataclasses.dataclass
class RunMetrics:
    """What one call of :meth:`Pipeline.step` / :meth:`Pipeline.run` measured.

    Attributes:
      losses: per microbatch, its loss (a device array on the last stage).
      peak_versions: per stage, the most weight versions held at once.
      actions: actions dispatched.
      host_seconds: wall time of the driver's loop over the program (dispatching; on CPU
        also what XLA runs inline on the dispatching thread, and any waits the program
        holds: run-ahead bounds, one-at-a-time stages).
      timeline: per-action measured spans, when asked for (``timeline=True``).
      peak_bytes: with ``timeline=True``, per device group the most bytes of live arrays
        seen on one of its devices after any action (weights, versions, optimizer state,
        stashes, gradients, activations in transit, and whatever the caller holds there).
      ops: operations of the lowered program this process ran (fused actions count once;
        transfers, waits and per-call set-up count too).
      workarounds: the XLA CPU workarounds in force (``pdjax._xla_cpu``), one line each.
      aux: per microbatch, the loss function's auxiliary outputs when it returns
        ``(loss, aux)`` (device arrays on the last stage), else ``None``.
      all_reduces: with ``collectives=True``, per operation kind (``B``, ``BU``, ``U``...)
        the all-reduce operations in the compiled programs this process ran (an XLA
        all-reduce of several arrays at once counts once).
    """

    losses: list[jax.Array]
    peak_versions: tuple[int, ...]
    actions: int
    host_seconds: float
    timeline: Timeline | None = None
    peak_bytes: tuple[int, ...] | None = None
    ops: int = 0
    workarounds: tuple[str, ...] = ()
    all_reduces: dict[str, int] | None = None
    aux: list[PyTree] | None = None

    @property
    def loss(self) -> float:
        """Mean loss over the microbatches (blocks until they are computed)."""
        return float(np.mean([float(x) for x in self.losses]))

    def mean_aux(self) -> PyTree:
        """The loss function's auxiliary outputs averaged over the microbatches (each
        leaf as a float64 NumPy value; blocks until they are computed), or ``None``."""
        if self.aux is None:
            return None
        return jax.tree.map(lambda *a: np.mean(np.stack(a), axis=0), *jax.device_get(self.aux))


def _track_live_bytes(peaks: list[int], group_of_device: Mapping[jax.Device, int]) -> None:
    """Raises ``peaks[g]`` to the live bytes of the fullest device of each group ``g``."""
    per_device: dict[jax.Device, int] = {}
    for array in jax.live_arrays():
        if array.is_deleted():
            continue
        for shard in array.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    for device, used in per_device.items():
        g = group_of_device.get(device)
        if g is not None and used > peaks[g]:
            peaks[g] = used


class Pipeline:
    """A model split into stages on devices, trained with a pipeline schedule.

    Args:
      layers: the model.
      plan: the stages: a :class:`pdjax.partition.Plan`, or a sequence of objects with
        ``first_layer``, ``last_layer`` (inclusive) and ``devices`` such as
        :func:`even_stages`. For ``interleaved`` with ``chunks=v`` give ``P * v`` stages;
        stage ``s`` runs on the devices of stage ``s % P``. For ``zb-v`` give ``2P``
        stages, placed in a V: stage ``s`` runs on the devices of stage ``min(s, 2P - 1 -
        s)`` (stages ``P .. 2P - 1`` go back over the groups of stages ``P - 1 .. 0``; the
        schedule's ``stage_device``). How stage devices are read:
        a ``Plan`` whose topology has ``device_ids`` (planned on
        :meth:`Topology.from_devices <pdjax.partition.Topology.from_devices>`, also after
        a JSON round trip) names real devices by ``jax.Device.id``, looked up among
        ``devices`` in any order; a ``Plan`` without them (``Topology.flat``,
        ``from_levels``, presets: topology positions) and a plain sequence of stages (even
        ``plan.stages`` alone) name devices by index into ``devices``.
      loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean loss of a microbatch.
      optimizer: any optax ``GradientTransformation``; each stage keeps its own state.
      schedule: one of ``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``, ``zb-h2``,
        ``zb-v`` (flush: use :meth:`step`), ``pipedream``, ``2bw`` (streaming: use
        :meth:`run`).
      microbatches: ``M``, microbatches per optimizer step (flush schedules and ``2bw``).
      chunks: ``v`` for ``interleaved``; ``zb-v`` runs 2 (its V; ``None``, the default,
        means 2 for ``zb-v`` and 1 otherwise).
      vertical_sync: ``pipedream`` option (every stage uses stage 0's version).
      weight_stashing: ``pipedream`` option (``False``: the backward uses the newest weights).
      remat: recompute each stage's forward in its backward instead of keeping residuals:
        every stage (``True``), or per stage, one flag each (as
        :func:`~pdjax.partition.plan_auto` chooses them, ``plan.options["auto"]["remat"]``).
      devices: the devices the plan's ids refer to (default ``jax.devices()``): indexed
        by position, or searched by ``jax.Device.id`` for a plan with ``device_ids``.
      transport: how values cross processes (``pdjax.pipeline.transport``):
        ``device_put``, ``collective``, or ``auto`` (``device_put`` unless the pipeline
        spans more than 2 processes on CPU, where only ``collective`` works).
      extra_in_flight: ``pipedream`` option: microbatches in flight per stage beyond
        ``P - s`` (not at the last stage), to hide transfer latency on the round trip;
        each costs one more stashed weight version and activation per stage and one more
        update of staleness (:func:`pdjax.pipeline.schedules.pipedream`).
      replication: how a replicated stage's devices share its work: ``"split"`` (each
        microbatch split across them) or ``"round-robin"`` (PipeDream's: each device
        takes whole microbatches, ``r`` consecutive ones at once, the gradients
        all-reduced once per group; under ``pipedream`` the stage updates once per group
        of ``r`` with their mean gradient; :func:`~pdjax.pipeline.schedules.pipedream`);
        one word for every stage, or one per stage; ``None``: each plan stage's
        ``replication`` attribute, else ``"split"``. Round-robin runs with ``gpipe``,
        ``1f1b``, ``pipedream`` and ``2bw``, in one process, on layers without model
        state.
      grad_allreduce: where a replicated stage's gradients are all-reduced. ``"update"``
        (default): each device sums its own part of every microbatch's gradient and the
        update all-reduces the sum once, for stages whose layers compute row by row
        (checked on the real weights before the first run,
        :meth:`~pdjax.pipeline.stage.Stage.check_parts`; the others, e.g. with BatchNorm
        or dropout, fall back to ``"backward"``: see :attr:`grad_allreduce_at`).
        ``"backward"``: every backward all-reduces its gradient (the whole microbatch's
        programs, XLA's data parallelism).
      optimizer_scope: ``"model"`` (default): the optimizer means one update of the whole
        model, as in sequential training. An optimizer that treats each parameter on its
        own runs per stage as it is; one coupled through the gradients' global norm
        (``optax.clip_by_global_norm``) gets the norm exchanged between stages (one scalar
        per stage and update; flush schedules and ``2bw``); any other coupling raises when
        the state is built (:mod:`pdjax.pipeline.optim`). ``"stage"``: run the optimizer on
        each stage alone, knowingly (e.g. clipping each stage by its own norm).

    Tied parameters (``sequential(..., tied=...)``) train as one parameter: every copy
    starts as the group's first listed leaf, the group's gradient is the sum of its
    copies' (from every stage holding one), the optimizer sees it once (global-norm
    clipping counts it once), and the copies stay bit for bit equal. Copies on one stage
    are summed within its update (any schedule). Copies on several stages exchange their
    gradients and the new value at each update (the first stage holding a copy updates the
    group; :mod:`pdjax.pipeline.program`): flush schedules (``gpipe``, ``1f1b``,
    ``interleaved``, ``zb-h1``, ``zb-h2``, ``zb-v``), in one process, with
    ``optimizer_scope="model"``.

    Raises:
      PipelineError: before any device work, for ``microbatches`` or ``chunks`` that is
        not an integer >= 1 (``extra_in_flight``: >= 0), a plan that does not cover the
        model, too few devices, a device id not among ``devices``, an unknown schedule,
        or tied copies on several stages with ``pipedream`` or ``2bw`` (whose stages
        update at their own times, so the copies cannot stay one parameter), across
        processes, or with ``optimizer_scope="stage"``.
    """

    def __init__(
        self,
        layers: LayerSequence,
        plan: Any,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        *,
        schedule: str = "1f1b",
        microbatches: int = 1,
        chunks: int | None = None,
        vertical_sync: bool = False,
        weight_stashing: bool = True,
        remat: bool | Sequence[bool] = False,
        devices: Sequence[jax.Device] | None = None,
        transport: str = "auto",
        optimizer_scope: Literal["model", "stage"] = "model",
        extra_in_flight: int = 0,
        grad_allreduce: str = "update",
        replication: str | Sequence[str] | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise PipelineError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
        microbatches = _integer("microbatches", microbatches, 1)
        if chunks is None:
            chunks = 2 if schedule == "zb-v" else 1
        chunks = _integer("chunks", chunks, 1)
        extra_in_flight = _integer("extra_in_flight", extra_in_flight, 0)
        if schedule != "pipedream" and (vertical_sync or not weight_stashing):
            raise PipelineError(
                "vertical_sync and weight_stashing=False are options of the pipedream "
                f"schedule, not of {schedule}"
            )
        if extra_in_flight and schedule != "pipedream":
            raise PipelineError(
                f"extra_in_flight={extra_in_flight} is an option of pipedream, not of {schedule}"
            )
        self.extra_in_flight = extra_in_flight
        if grad_allreduce not in ("update", "backward"):
            raise PipelineError(
                f"grad_allreduce must be 'update' or 'backward', got {grad_allreduce!r}"
            )
        self.grad_allreduce = grad_allreduce
        self._parts_checked = False
        self._settled = False
        if schedule == "zb-v" and chunks != 2:
            raise PipelineError(
                f"zb-v runs two chunks per device group (a V over 2P stages): chunks must be "
                f"2, got {chunks}"
            )
        if schedule not in ("interleaved", "zb-v") and chunks != 1:
            raise PipelineError(f"chunks={chunks} is an option of interleaved, not of {schedule}")
        self.layers = layers
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.chunks = chunks
        self.vertical_sync = vertical_sync
        self.weight_stashing = weight_stashing
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        specs = tuple(getattr(plan, "stages", plan))
        self.stage_specs = specs
        self._check_cover(specs, len(layers))
        remat = _remat_flags(remat, len(specs))
        if len(specs) % self.chunks:
            if schedule == "zb-v":
                raise PipelineError(
                    f"zb-v needs an even number 2P of stages in the plan (stages 0..P-1 down "
                    f"the device groups, P..2P-1 back up); the plan has {len(specs)}"
                )
            raise PipelineError(
                f"interleaved with chunks={self.chunks} needs a multiple of {self.chunks} "
                f"stages, the plan has {len(specs)}"
            )
        self.num_groups = len(specs) // self.chunks
        #: the device group of each stage (the schedule's ``stage_device``); group ``d``
        #: runs on the devices of plan stage ``d``
        self.stage_device = stage_groups(schedule, self.num_groups, self.chunks)
        self.replication = _replication_of(replication, specs, self.num_groups)
        # the plan's choice (not the caller's) falls back to split where round-robin cannot
        # run; for flush schedules and 2bw the two compute the same
        self._replication_asked = replication is not None
        self.replication_notes: list[str] = []
        if not self._replication_asked and schedule not in ROUND_ROBIN:
            if "round-robin" in self.replication:
                self.replication_notes.append(
                    f"the plan's round-robin stages run split: {schedule} has no round-robin form"
                )
            self.replication = ("split",) * self.num_groups
        round_robin = [
            mode == "round-robin" and len(spec.devices) > 1
            for mode, spec in zip(self.replication, specs, strict=False)
        ]
        if any(round_robin):
            if schedule not in ROUND_ROBIN:
                raise PipelineError(
                    f"round-robin replication runs with {', '.join(ROUND_ROBIN)}, not "
                    f"{schedule}; use replication='split'"
                )
            for s, rr in enumerate(round_robin):
                r = len(specs[s].devices)
                if rr and schedule != "pipedream" and microbatches % r:
                    raise PipelineError(
                        f"stage {s} is round-robin over {r} devices (whole groups of {r} "
                        f"microbatches): microbatches (M={microbatches}) must be a multiple "
                        f"of {r}"
                    )
        stage_devices = _stage_devices(plan, specs, devices)
        self.stages: list[Stage] = []
        for s, spec in enumerate(specs):
            g = self.stage_device[s]
            group_spec = specs[g]
            if tuple(spec.devices) != tuple(group_spec.devices):
                where = "s % P" if schedule == "interleaved" else "min(s, 2P - 1 - s), the V"
                raise PipelineError(
                    f"{schedule} stage {s} must use the devices of stage {g} "
                    f"({tuple(group_spec.devices)}: stage s runs on the device group of stage "
                    f"{where}), got {tuple(spec.devices)}"
                )
            self.stages.append(
                Stage(
                    s,
                    layers.layers[spec.first_layer : spec.last_layer + 1],
                    spec.first_layer,
                    stage_devices[s],
                    optimizer,
                    loss_fn if s == len(specs) - 1 else None,
                    remat=remat[s],
                    scale=_scale(schedule, microbatches, len(spec.devices), round_robin[g]),
                    round_robin=round_robin[g],
                )
            )
        self.replicas = tuple(len(spec.devices) for spec in specs[: self.num_groups])
        if schedule == "2bw" and microbatches < self.num_groups:
            raise PipelineError(
                f"2bw needs microbatches (M) >= stages (P) so that step t can use W(t-1) at "
                f"every stage; got M={microbatches}, P={self.num_groups}"
            )
        self._schedules: dict[tuple[int, int], Schedule] = {}
        # multi-controller runs (jax.distributed): the stages this process drives
        self.process_index = jax.process_index()
        # per stage, the processes that hold its devices (a replicated stage may span
        # several: each of them runs the stage's programs, SPMD)
        self.owners = tuple(frozenset(d.process_index for d in st.devices) for st in self.stages)
        self.local = tuple(self.process_index in owners for owners in self.owners)
        self._specs: dict[Any, list[Any]] = {}
        self.remat = remat
        if optimizer_scope not in ("model", "stage"):
            raise PipelineError(
                f"optimizer_scope must be 'model' or 'stage', got {optimizer_scope!r}"
            )
        self.optimizer_scope = optimizer_scope
        #: per tied group: its name and the stages holding its copies (ascending)
        self.tied_stages = _tied_stages(layers, specs)
        self._check_tied()
        self.stage_optimizer: StageOptimizer | None = None  # decided on the first state
        self.coupled = False
        platform = self.stages[0].devices[0].platform
        processes = sorted({p for owners in self.owners for p in owners})
        if transport == "auto":
            many = platform == "cpu" and len(processes) > 2
            transport = "collective" if many else "device_put"
        self.placement = Placement(
            tuple(
                StagePlace(tuple(int(d.id) for d in st.devices), tuple(sorted(owners)))
                for st, owners in zip(self.stages, self.owners, strict=True)
            ),
            platform,
            transport,
            jax.process_count(),
        )
        self.transport = make_transport(transport)
        self.workarounds = _xla_cpu.for_pipeline(
            platform,
            tuple(len(st.devices) for st in self.stages),
            1 if schedule == "pipedream" else microbatches,
            self.num_groups,
            collectives=self.multiprocess and transport == "collective",
        )
        self._programs: dict[Any, Program] = {}
        self._bound: dict[Any, Any] = {}
        self._rng_cache: tuple[jax.Array, dict[str, jax.Array]] | None = None
        self._on_loss: Callable[[int, jax.Array], None] | None = None
        self._splitters: dict[Any, Any] = {}
        # What the API checks once and then trusts (_check_state, _check_items): the
        # layouts of the states this pipeline made, the last one first; the shapes of the
        # sample init saw (for messages); per layout of an item (or of a call's items)
        # found to fit the weights of the state layout _fits_layout, its rows.
        self._state_layouts: list[Any] = []
        self._init_shapes: str | None = None
        self._fits: dict[Any, Any] = {}
        self._fits_layout: Any = None
        if self.multiprocess and transport == "device_put":
            check_cpu_transfers("a pipeline across processes")

    @property
    def _tied_across(self) -> tuple[tuple[int, ...], ...]:
        """The stages of each tied group with copies on several stages."""
        return tuple(h for _, h in self.tied_stages if len(h) > 1)

    def _check_tied(self) -> None:
        """Refuses tied copies on several stages where they cannot stay one parameter."""
        across = [(name, h) for name, h in self.tied_stages if len(h) > 1]
        if not across:
            return
        name, h = across[0]
        what = f"the tied parameter {name!r} has copies on stages {list(h)}"
        if self.schedule_name in STALE:
            raise PipelineError(
                f"{what}, but under {self.schedule_name} each stage updates at its own time "
                "and keeps its own weight versions, so the copies would drift apart; tied "
                f"parameters across stages train with the flush schedules ({', '.join(FLUSHING)}), "
                "or put all copies on one stage (any schedule)"
            )
        if self.optimizer_scope == "stage":
            raise PipelineError(
                f"{what}; with optimizer_scope='stage' each stage's optimizer would treat "
                "its copy apart (clipping by its own norm, say), so the copies would drift "
                "apart; use optimizer_scope='model', or put all copies on one stage"
            )
        if self.multiprocess:
            raise PipelineError(
                f"{what}, whose gradients and new values the stages exchange at each "
                "update; that runs in one process for now: put the stages holding the "
                "copies in one process, or all copies on one stage"
            )

    def _settle_ties(self, stage_params: Sequence[PyTree]) -> None:
        """Gives each stage its :class:`~pdjax.pipeline.stage.StageTies` (the leaves of its
        tied copies in its parameters), once, before the optimizer is analysed."""
        if not self.tied_stages or any(st.ties is not None for st in self.stages):
            return
        where = [
            {
                (path[0].idx, tuple(_key_str(k) for k in path[1:])): n
                for n, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(p)[0])
            }
            for p in stage_params
        ]
        for s, (stage, spec) in enumerate(zip(self.stages, self.stage_specs, strict=True)):
            names, copies, holders = [], [], []
            for (name, leaves), (_, h) in zip(
                self.layers.tied_leaves, self.tied_stages, strict=True
            ):
                mine = tuple(
                    where[s][(i - spec.first_layer, path)]
                    for i, path in leaves
                    if spec.first_layer <= i <= spec.last_layer
                )
                if mine:
                    names.append(name)
                    copies.append(mine)
                    holders.append(h)
            if names:
                stage.ties = StageTies(s, tuple(names), tuple(copies), tuple(holders))

    def _settle_replication(self, state: PipelineState) -> None:
        """Before the first run: a round-robin stage whose layers keep model state
        (BatchNorm statistics, which ``r`` microbatches at once would update unlike ``r``
        in turn) raises when the caller asked for round-robin, and runs split when only
        the plan did (its schedules and programs are made anew)."""
        if self._settled:
            return
        changed = False
        for s, st in enumerate(self.stages):
            if not (st.round_robin and jax.tree.leaves(state.model_state[s])):
                continue
            if self._replication_asked:
                raise PipelineError(
                    f"stage {s} is round-robin (r={st.num_replicas} whole microbatches at "
                    "once) but its layers keep model state (e.g. BatchNorm statistics), which "
                    "r microbatches would update at once, unlike r in turn; use "
                    "replication='split' for this stage"
                )
            st.round_robin = False
            st.scale = _scale(self.schedule_name, self.microbatches, st.num_replicas, False)
            st.whole_reason = "not checked yet"
            self.replication_notes.append(
                f"the plan's round-robin stage {s} runs split: its layers keep model state"
            )
            changed = True
        self._settled = True
        if changed:
            self.replication = tuple(
                "round-robin" if st.round_robin else "split"
                for st in self.stages[: self.num_groups]
            )
            self._schedules.clear()
            self._programs.clear()
            self._bound.clear()

    @property
    def _schedule_replication(self) -> tuple[str, ...] | None:
        """The schedule's per-group modes (``None`` when no stage is round-robin)."""
        if not any(st.round_robin for st in self.stages):
            return None
        return tuple(
            "round-robin" if st.round_robin else "split" for st in self.stages[: self.num_groups]
        )

    @property
    def grad_allreduce_at(self) -> tuple[str, ...]:
        """Per stage, where its gradients are all-reduced: ``"-"`` (one device),
        ``"update"``, or ``"backward: <why>"``; decided at the first step or run."""
        out = []
        for st in self.stages:
            if st.num_replicas == 1:
                out.append("-")
            elif st.round_robin:
                out.append("update (round-robin)")
            elif st.per_device:
                out.append("update")
            else:
                out.append(f"backward: {st.whole_reason}")
        return tuple(out)

    def _check_parts(self, state: PipelineState, x: PyTree) -> None:
        """Decides, once and before any stage program is built, which replicated stages
        sum their gradients per device (:meth:`Stage.check_parts`)."""
        if self._parts_checked:
            return
        replicated = [
            s for s, st in enumerate(self.stages) if st.num_replicas > 1 and not st.round_robin
        ]
        if not replicated:
            self._parts_checked = True
            return
        if self.grad_allreduce == "backward":
            for s in replicated:
                self.stages[s].whole_reason = "asked for (grad_allreduce='backward')"
            self._parts_checked = True
            return
        inputs = [_abstract(x), *self._stage_outputs(state, x)]
        for s in replicated:
            stage = self.stages[s]
            if not self.local[s]:
                continue
            dev = next(d for d in stage.devices if d.process_index == self.process_index)
            params, model_state = jax.tree.map(
                partial(_shard_on, device=dev), (state.params[s], state.model_state[s])
            )
            stage.check_parts(params, model_state, inputs[s])
        if self.multiprocess:  # every owner of a stage must build the same programs
            mine = {s: self.stages[s].per_device for s in replicated if self.local[s]}
            for theirs in allgather_json(mine):
                for s, ok in theirs.items():
                    stage = self.stages[int(s)]
                    if not ok and stage.per_device:
                        stage.per_device = False
                        stage.whole_reason = "another process's check of this stage failed"
        self._parts_checked = True  # only once every check has run (a failure re-checks)

    @property
    def multiprocess(self) -> bool:
        """Whether some stages run (also) in other processes (``jax.distributed``)."""
        return any(owners != {self.process_index} for owners in self.owners)

    @staticmethod
    def _check_cover(specs: Sequence[Any], num_layers: int) -> None:
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

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    # -- state ------------------------------------------------------------------------------

    def check_shapes(self, sample: PyTree, variables: Sequence[Variables] | None = None) -> Any:
        """Traces the model stage by stage on ``sample`` (shapes only, no FLOPs), with
        ``variables`` (per layer; default: those init would make for ``sample``), and
        returns the shapes of the model's output.

        Raises:
          PipelineError: naming the stage, the layer and the input shapes that fail.
        """
        specs = _abstract(sample)
        if variables is None:
            variables, _ = jax.eval_shape(
                partial(_init_layers, self.layers.layers, 0), jax.random.key(0), specs
            )
        x = specs
        for s, spec in enumerate(self.stage_specs):
            for i in range(spec.first_layer, spec.last_layer + 1):
                layer = self.layers.layers[i]
                try:
                    x = jax.eval_shape(
                        lambda v, x, layer=layer: layer.apply(v, x)[0], variables[i], x
                    )
                except PdjaxError:
                    raise
                except Exception as e:
                    what = "the inputs" if i == 0 else "the output of the layer before it"
                    raise PipelineError(
                        f"stage {s}, layer {i} ({layer.name}) cannot take {what}, shapes "
                        f"[{_shapes_text(x)}]: {type(e).__name__}: {e}"
                    ) from e
        if self.tied_stages:
            self.layers.check_tied(variables)
        return x

    def init(self, rng: jax.Array, sample: PyTree) -> PipelineState:
        """Initialises every layer from ``rng`` on a sample microbatch and places the stages.

        ``rng`` also seeds dropout (through ``fold_in(rng, 1)``).
        """
        self.check_shapes(sample)
        self._init_shapes = _shapes_text(sample)
        key = jax.random.fold_in(rng, 0)
        if self.multiprocess:  # every process builds the whole model (same key, same values)
            variables = jax.jit(self.layers.init)(key, sample)
        else:  # each stage's layers on its own devices, never the whole model on one
            variables = []
            x = sample
            for stage, spec in zip(self.stages, self.stage_specs, strict=True):
                vs, x = self._init_stage(stage, spec.first_layer)(
                    stage.place_weights(key), stage.place_weights(x)
                )
                variables += vs
        return self.state_from_variables(variables, jax.random.fold_in(rng, 1))

    def _init_stage(self, stage: Stage, first: int) -> Any:
        """Jitted: a stage's layers initialised as :meth:`LayerSequence.init` does (layer
        ``i`` from ``fold_in(key, i)``, fed the layer before's output), on its devices."""
        return jax.jit(partial(_init_layers, stage.layers, first), out_shardings=stage.replicated)

    def state_from_variables(
        self, variables: Sequence[Variables] | Mapping[str, Any], rng: jax.Array
    ) -> PipelineState:
        """A fresh state from given variables (pre-trained, restored): a per-layer list, or
        the merged tree of :meth:`LayerSequence.merge`. Optimizer state starts anew."""
        if isinstance(variables, Mapping):
            variables = self.layers.split(variables)
        if len(variables) != len(self.layers):
            raise PipelineError(
                f"got variables for {len(variables)} layers, the model has {len(self.layers)}"
            )
        if self.tied_stages:  # every copy starts as its group's first listed leaf
            self.layers.check_tied(variables)
            variables = self.layers.tie(variables)
        stage_params = [
            [v.get("params", {}) for v in variables[sp.first_layer : sp.last_layer + 1]]
            for sp in self.stage_specs
        ]
        self._settle_ties(_abstract(stage_params))
        # the optimizer sees each stage's parameters less its tied copies but one per group
        self._analyse_optimizer(
            [
                st.ties.view(_abstract(p)) if st.ties is not None else p
                for st, p in zip(self.stages, stage_params, strict=True)
            ]
        )
        optimizer = self.stage_optimizer
        assert optimizer is not None
        params, model_state, opt_state = [], [], []
        for s, (stage, spec) in enumerate(zip(self.stages, self.stage_specs, strict=True)):
            vs = variables[spec.first_layer : spec.last_layer + 1]
            # another process's stage: global arrays with no shard here (shapes only: they
            # size the transfers; orbax saves each process's own shards)
            place = stage.place_weights if self.local[s] else partial(_remote, stage.replicated)
            p = place([v.get("params", {}) for v in vs])
            if stage.ties is not None and self.local[s]:
                p = _unaliased(p, [])  # tied copies here: one buffer each (donated apart)
            params.append(p)
            model_state.append(place([{k: x for k, x in v.items() if k != "params"} for v in vs]))
            init: Callable[[PyTree], optax.OptState] = (
                optimizer.init if self.local[s] else partial(jax.eval_shape, optimizer.init)
            )
            if stage.ties is not None:
                init = _compose(init, stage.ties.view)
            o = place(init(p))
            # an optimizer state that holds the parameters' own buffers (cocob, dog,
            # schedule-free keep the initial parameters) would be donated with them
            opt_state.append(_unaliased(o, p) if self.local[s] else o)
        state = PipelineState(
            params=tuple(params),
            model_state=tuple(model_state),
            opt_state=tuple(opt_state),
            updates=(0,) * self.num_stages,
            microbatches=0,
            rng=rng,
        )
        self._accept_layout(_state_layout(state))
        return state

    def _analyse_optimizer(self, stage_params: Sequence[PyTree]) -> None:
        """Decides, once, how the optimizer runs per stage (:mod:`pdjax.pipeline.optim`):
        as it is, with the gradients' global norm exchanged, or not at all (raises)."""
        if self.stage_optimizer is not None:
            return
        opt = StageOptimizer(self.optimizer, _abstract(stage_params), scope=self.optimizer_scope)
        if opt.needs_exchange and self.schedule_name == "pipedream":
            raise PipelineError(
                "the optimizer couples the stages through the gradients' global norm "
                f"({opt.coupling.summary if opt.coupling else ''}); under pipedream every "
                "stage updates after each microbatch, so one microbatch's global norm would "
                "hold every stage's update until its gradient reached stage 0, which stalls "
                "the pipeline. Use a flush schedule (1f1b, gpipe, ...) or 2bw for the exact "
                "global norm, or Pipeline(..., optimizer_scope='stage') to clip each stage by "
                "its own gradients' norm"
            )
        self.stage_optimizer = opt
        self.coupled = opt.needs_exchange
        for stage in self.stages:
            stage.optimizer = opt
        self._programs.clear()
        self._bound.clear()

    def variables(self, state: PipelineState) -> list[Variables]:
        """The per-layer variables (params and state) of the newest weights.

        In a multi-process run (:attr:`multiprocess`) this is collective: every process
        must call it, and each gets all the variables, another process's stages copied to
        its own first device."""
        out: list[Variables] = []
        pairs: Iterable[tuple[list[PyTree], list[Variables]]]
        pairs = zip(state.params, state.model_state, strict=True)
        if self.multiprocess:
            pairs = (
                self._broadcast(s, (p, ms)) for s, (p, ms) in enumerate(pairs)
            )  # in stage order, the same in every process
        for params, model_state in pairs:
            for p, ms in zip(params, model_state, strict=True):
                out.append({**ms, "params": p})
        return out

    def params(self, state: PipelineState) -> dict[str, Any]:
        """The full parameter tree ``{layer name: params}`` of the newest weights."""
        return self.layers.merge(self.variables(state))["params"]

    def update_nnx(
        self, state: PipelineState, model: Any = None, *, device: jax.Device | None = None
    ) -> Any:
        """Writes the newest weights and model state into the nnx modules the layers were
        built from, on one ``device`` (:func:`pdjax.export.update_nnx`); returns
        ``model`` (the user's whole model, checked to hold them)."""
        return export.update_nnx(self.layers, self.variables(state), model, device=device)

    def linen_variables(
        self,
        state: PipelineState,
        names: Sequence[str | None] | Mapping[str, str] | None = None,
        *,
        device: jax.Device | None = None,
    ) -> dict[str, dict[str, Any]]:
        """The newest variables as the user's linen tree ``{collection: {submodule name:
        ...}}`` on one ``device`` (:func:`pdjax.export.linen_variables`; default names:
        the layers' names)."""
        return export.linen_variables(self.layers, self.variables(state), names, device=device)

    # -- schedules ----------------------------------------------------------------------------

    def schedule(self, num_microbatches: int) -> Schedule:
        """The validated schedule for a call over ``num_microbatches`` microbatches."""
        key = (num_microbatches, self.microbatches)
        if key not in self._schedules:
            M = self.microbatches
            name = self.schedule_name
            if name == "pipedream":
                sched = generate(
                    name,
                    self.num_groups,
                    num_microbatches,
                    vertical_sync=self.vertical_sync,
                    weight_stashing=self.weight_stashing,
                    replicas=self.replicas,
                    extra_in_flight=self.extra_in_flight,
                    replication=self._schedule_replication,
                )
            elif name == "2bw":
                sched = generate(
                    name,
                    self.num_groups,
                    M,
                    stream=num_microbatches,
                    replicas=self.replicas,
                    replication=self._schedule_replication,
                )
            else:
                if num_microbatches % M:
                    raise PipelineError(
                        f"{name} runs whole steps of {M} microbatches; got {num_microbatches}"
                    )
                sched = generate(
                    name,
                    self.num_groups,
                    M,
                    steps=num_microbatches // M,
                    chunks=self.chunks,
                    replicas=self.replicas,
                    replication=self._schedule_replication,
                )
            validate(sched)
            self._schedules[key] = sched
        return self._schedules[key]

    # -- checks of what a call is given -------------------------------------------------------

    def _accept_layout(self, layout: Any) -> None:
        """Trusts states of ``layout`` from now on (the newest is compared first)."""
        if layout not in self._state_layouts:
            self._state_layouts.insert(0, layout)

    def _check_state(self, state: Any, x: PyTree) -> None:
        """Refuses, before any device work, a state this pipeline cannot run: not a
        :class:`PipelineState`, consumed, or laid out otherwise than the states this
        pipeline makes (another plan, model or optimizer). Once per call: lengths, then
        the state's tree structures and shapes against the layouts already trusted;
        ``x`` (an input microbatch) serves only a pipeline that has made no state yet."""
        if not isinstance(state, PipelineState):
            raise PipelineError(
                f"state must be the PipelineState that this pipeline's init (or step, run) "
                f"returned, got a {type(state).__name__}"
            )
        if any(
            isinstance(leaf, jax.Array) and leaf.is_deleted()
            for leaf in jax.tree.leaves((state.params, state.opt_state))
        ):
            raise PipelineError(
                "this state was consumed by an earlier step/run (the optimizer state is "
                "updated in place); pass the state that call returned"
            )
        problem = self._count_problem(state)
        layout = None if problem else _state_layout(state)
        if problem is None and layout not in self._state_layouts:
            if not self._state_layouts:
                # nothing made here to compare with (a state of an equal pipeline): the
                # inputs must fit its weights, then it must be what init would make for them
                self._check_inputs(state, x, "the first microbatch")
                self._state_layouts.append(self._expected_layout(x))
            problem = self._layout_problem(state, layout, self._state_layouts[0])
        if problem is not None:
            raise PipelineError(
                f"{problem}: the state was made by another Pipeline (another plan, model or "
                "optimizer). Make it with this pipeline's init (or state_from_variables), "
                "or restore the checkpoint into a template made by this pipeline's init"
            )
        if layout != self._fits_layout:  # items were checked against other weights' shapes
            self._fits.clear()
            self._fits_layout = layout

    def _count_problem(self, state: PipelineState) -> str | None:
        """What in ``state``'s counts of stages and layers differs from this pipeline's."""
        S = self.num_stages
        got: int | None
        for field in ("params", "model_state", "opt_state", "updates"):
            got = len(getattr(state, field))
            if got != S:
                return f"the state has {got} stages ({field}), this pipeline has {S} stages"
        for s, spec in enumerate(self.stage_specs):
            want = spec.last_layer - spec.first_layer + 1
            for field in ("params", "model_state"):
                tree = getattr(state, field)[s]
                got = len(tree) if isinstance(tree, (list, tuple)) else None
                if got != want:
                    return (
                        f"the state's stage {s} holds {got} layers ({field}), this pipeline's "
                        f"stage {s} holds {want} layers ({spec.first_layer}-{spec.last_layer})"
                    )
        return None

    def _layout_problem(self, state: PipelineState, got: Any, want: Any) -> str | None:
        """The first difference between the layout ``got`` of ``state`` and ``want``."""
        names = {
            "params": "parameters",
            "model_state": "model state",
            "opt_state": "optimizer state",
        }
        for f, (field, name) in enumerate(names.items()):
            for s, ((gdef, gshapes), (wdef, wshapes)) in enumerate(
                zip(got[f], want[f], strict=True)
            ):
                if field == "opt_state" and gdef != wdef:
                    return (
                        f"stage {s}'s optimizer state is {_brief(gdef)}, but this pipeline's "
                        f"optimizer makes {_brief(wdef)}"
                    )
                if gdef != wdef:
                    return (
                        f"stage {s}'s {name} is {_brief(gdef)}, this "
                        f"pipeline's model makes {_brief(wdef)} there"
                    )
                if gshapes != wshapes:
                    i = next(
                        i for i, (a, b) in enumerate(zip(gshapes, wshapes, strict=True)) if a != b
                    )
                    path = jax.tree_util.tree_flatten_with_path(getattr(state, field)[s])[0][i][0]
                    if field != "opt_state":  # per layer: name the model's layer
                        layer = self.stage_specs[s].first_layer + path[0].idx
                        name, path = f"{name} of layer {layer}", path[1:]
                    return (
                        f"stage {s}'s {name}, leaf {jax.tree_util.keystr(path)}, has shape "
                        f"{list(gshapes[i])}, this pipeline makes {list(wshapes[i])}"
                    )
        return None

    def _expected_layout(self, x: PyTree) -> Any:
        """The layout of the state init would make on a sample like ``x`` (shapes only;
        it settles the ties and the optimizer as :meth:`state_from_variables` does)."""
        variables = jax.eval_shape(
            partial(_init_layers, self.layers.layers, 0), jax.random.key(0), _abstract(x)
        )[0]
        layers = [variables[sp.first_layer : sp.last_layer + 1] for sp in self.stage_specs]
        params = [[v.get("params", {}) for v in vs] for vs in layers]
        model_state = [[{k: a for k, a in v.items() if k != "params"} for v in vs] for vs in layers]
        self._settle_ties(params)
        views = [
            st.ties.view(p) if st.ties else p for st, p in zip(self.stages, params, strict=True)
        ]
        self._analyse_optimizer(views)
        assert self.stage_optimizer is not None
        opt_state = [jax.eval_shape(self.stage_optimizer.init, v) for v in views]
        return _layout(params, model_state, opt_state)

    def _state_variables(self, state: PipelineState) -> list[Variables]:
        """The per-layer variables of ``state``, as shapes."""
        return [
            {**ms, "params": p}
            for ps, mss in zip(state.params, state.model_state, strict=True)
            for p, ms in zip(ps, mss, strict=True)
        ]

    def _check_inputs(self, state: PipelineState, x: PyTree, where: str) -> Any:
        """Traces the model on ``x`` with ``state``'s weights (shapes only); returns the
        shapes of its output, or raises naming the layer and the shapes that fail."""
        try:
            return self.check_shapes(x, _abstract(self._state_variables(state)))
        except PipelineError as e:
            seen = self._init_shapes
            raise PipelineError(
                f"{where}'s inputs do not fit the model's weights: {str(e).rstrip('.')}. "
                + (f"This pipeline's init saw inputs [{seen}]; give " if seen else "Give ")
                + "inputs of those shapes past the batch dimension (any number of rows), "
                "or a state made for these inputs"
            ) from e

    def _check_items(
        self, state: PipelineState, items: Sequence[Any], what: str, with_targets: bool
    ) -> list[int]:
        """Per item (an ``(inputs, targets)`` pair, or inputs), its rows, after checking
        once per layout that every leaf has those rows, that the model takes the inputs
        with ``state``'s weights and the loss function the targets. Cheap once the call's
        layout is known: one flatten of all the items (the loop over thousands of actions
        that follows must not wait on checks)."""
        whole = _layout_key(items)
        known: list[int] | None = self._fits.get(whole)
        if known is not None:
            return known
        rows = []
        for k, item in enumerate(items):
            key = _layout_key(item)
            n = self._fits.get(key)
            if n is None:
                where = f"{what} {k}"
                parts: tuple[tuple[str, PyTree], ...]
                if with_targets:
                    parts = (("inputs", item[0]), ("targets", item[1]))
                else:
                    parts = (("inputs", item),)
                n = _rows(parts, f"{where}: ")
                y = self._check_inputs(state, parts[0][1], where)
                if with_targets:
                    _check_loss(self.loss_fn, y, item[1], where)
                self._fits[key] = n
            rows.append(n)
        if len(self._fits) > 256:  # calls of ever new lengths or shapes: keep it bounded
            self._fits.clear()
        self._fits[whole] = rows
        return rows

    # -- running ----------------------------------------------------------------------------

    def split_batch(self, batch: tuple[PyTree, PyTree]) -> list[tuple[PyTree, PyTree]]:
        """Splits ``(inputs, targets)`` into ``M`` equal microbatches along axis 0.

        Raises:
          PipelineError: if a leaf of the inputs or targets has other rows (leading
          dimension) than the others, or the rows are not divisible by ``M`` times every
          stage's replicas.
        """
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise PipelineError(
                f"split_batch takes one (inputs, targets) pair, got a {type(batch).__name__}"
                + (f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
            )
        inputs, targets = batch
        n = _rows((("inputs", inputs), ("targets", targets)), "")
        M = self.microbatches
        need = [M * r for r in self.replicas]
        for s, k in enumerate(need):
            if n % k:
                raise PipelineError(
                    f"batch of {n} samples cannot be split into {M} microbatches of equal "
                    f"size, each divisible by stage {s}'s {self.replicas[s]} replicas; use a "
                    f"batch size that is a multiple of {int(np.lcm.reduce(need))}"
                )
        size = n // M
        return [
            jax.tree.map(lambda a, k=k: a[k * size : (k + 1) * size], (inputs, targets))
            for k in range(M)
        ]

    def step(
        self,
        state: PipelineState,
        batch: tuple[PyTree, PyTree],
        *,
        timeline: bool = False,
        collectives: bool = False,
    ) -> tuple[PipelineState, RunMetrics]:
        """One optimizer step of a flush schedule over ``batch = (inputs, targets)``.

        The batch is split into ``M`` microbatches. The state passed in is consumed (its
        optimizer state is updated in place): keep the one returned.
        """
        if self.schedule_name in STREAMING:
            raise PipelineError(
                f"{self.schedule_name} is asynchronous: its updates lag behind the stream, "
                "so one step at a time would drain after every step (2bw would then use "
                "W(t), not W(t-1)); use run(state, microbatches) over a stream"
            )
        return self.run(state, self.split_batch(batch), timeline=timeline, collectives=collectives)

    def run(
        self,
        state: PipelineState,
        microbatches: Sequence[tuple[PyTree, PyTree]],
        *,
        timeline: bool = False,
        on_loss: Callable[[int, jax.Array], None] | None = None,
        collectives: bool = False,
    ) -> tuple[PipelineState, RunMetrics]:
        """Runs the schedule over a stream of ``(inputs, targets)`` microbatches.

        The pipeline fills at the start of the call and drains at its end, so
        consecutive calls are one stream with a drain between them (what a checkpoint
        needs). The state passed in is consumed (its optimizer state is updated in
        place): keep the one returned. With ``timeline=True`` the driver waits for each
        action and records its measured span and the live bytes per device group (so
        the devices do not overlap in that mode, and it is slow: a diagnostic).
        ``on_loss(k, loss)`` is called when microbatch ``k``'s loss is dispatched (an
        unfinished device array: converting it to a float waits for it). Across processes
        (:attr:`multiprocess`) every process calls it, and it returns once the pipeline
        has drained in all of them. ``collectives=True`` counts the all-reduces in the
        compiled program of every operation run (:attr:`RunMetrics.all_reduces`; a
        diagnostic: each distinct program is lowered and compiled once more).

        Raises:
          PipelineError: before any device work, for a state that is consumed or was
          made by another pipeline (another plan, model or optimizer), an item that is
          not an ``(inputs, targets)`` pair, leaves of a microbatch with other rows than
          its first input leaf, inputs the model cannot take with the state's weights,
          targets the loss function cannot take, or a loss that is not a scalar (each
          layout checked once, on shapes).
        """
        microbatches = list(microbatches)
        if not microbatches:
            raise PipelineError("run needs at least one microbatch")
        _check_pairs(microbatches, "run", "microbatches")
        self._check_state(state, microbatches[0][0])
        rows = self._check_items(state, microbatches, "microbatch", with_targets=True)
        self._settle_replication(state)
        split = tuple(st.num_replicas for st in self.stages if not st.round_robin)
        for k, n in enumerate(rows):
            bad = [r for r in split if n < 1 or n % r]
            if bad:
                raise PipelineError(
                    f"microbatch {k} has {n} samples; every microbatch needs a positive "
                    f"multiple of each split stage's replicas {split}"
                )
        for s, st in enumerate(self.stages):
            if st.round_robin and len(microbatches) % st.num_replicas:
                raise PipelineError(
                    f"stage {s} is round-robin over {st.num_replicas} devices and takes "
                    f"whole groups of {st.num_replicas} microbatches: a call over "
                    f"{len(microbatches)} microbatches must be a multiple of "
                    f"{st.num_replicas}"
                )
        prog = self.program(len(microbatches), timeline=timeline, on_loss=on_loss is not None)
        return self._execute(prog, state, microbatches, timeline, on_loss, collectives)

    # -- evaluation and inference -----------------------------------------------------------

    def evaluate(
        self,
        state: PipelineState,
        batches: Iterable[tuple[PyTree, PyTree]],
        *,
        metrics: Callable[[PyTree, PyTree], Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The loss and the loss function's metrics over ``batches`` of ``(inputs,
        targets)``, in eval mode (no dropout, BatchNorm running statistics), forward only,
        through the stages: each stage runs on its own devices with the newest weights
        (nothing is gathered on one device), batch ``k`` at stage ``s`` while batch
        ``k + 1`` runs at stage ``s - 1``. ``state`` is not consumed.

        Returns:
          ``{"loss": ..., "samples": n}``, and the means of the loss function's aux
          outputs (``loss_fn -> (loss, aux)``): a dict ``aux`` merged in (``{"loss",
          "samples", "accuracy", ...}``), any other aux under ``"aux"``. Every mean is
          over the batches weighted by their sizes, which is the mean over the samples
          for a loss (or metric) that is a per-sample mean. ``metrics(outputs, targets)
          -> {name: scalar}``, an evaluation-only function (e.g. accuracy beside a loss
          without aux), adds its means too (computed on the last stage).

        Raises:
          PipelineError: for no batches, or a pipeline spanning processes (not supported
          yet: evaluate on :meth:`variables` there); and as :meth:`run` does for a state
          or batches that do not fit.
        """
        batches = list(batches)
        if not batches:
            raise PipelineError("evaluate needs at least one (inputs, targets) batch")
        _check_pairs(batches, "evaluate", "batches")
        self._check_forward(state, batches[0][0])
        sizes = np.array(self._check_items(state, batches, "batch", True), np.float64)
        outs = self._forward_stream(
            state, [b[0] for b in batches], [b[1] for b in batches], metrics
        )
        weights = sizes / sizes.sum()
        values = jax.device_get(outs)
        extra: dict[str, Any] = {}
        if metrics is not None:  # (loss, aux, metrics) per batch
            extra = jax.tree.map(
                lambda *a: _plain(np.tensordot(weights, np.stack(a).astype(np.float64), axes=1)),
                *[v[2] for v in values],
            )
            values = [with_aux(v[0], v[1]) for v in values]
        losses = [v[0] if isinstance(v, tuple) else v for v in values]
        result: dict[str, Any] = {
            "loss": float(np.dot(weights, np.asarray(losses, np.float64))),
            "samples": int(sizes.sum()),
        }
        if values and isinstance(values[0], tuple):
            aux = jax.tree.map(
                lambda *a: _plain(np.tensordot(weights, np.stack(a).astype(np.float64), axes=1)),
                *[v[1] for v in values],
            )
            if isinstance(aux, Mapping) and not {"loss", "samples"} & set(aux):
                result.update(aux)
            else:
                result["aux"] = aux
        result.update(extra)
        return result

    def predict(
        self, state: PipelineState, inputs: PyTree, *, batch_size: int | None = None
    ) -> PyTree:
        """The model's outputs for ``inputs`` in eval mode, forward only through the
        stages (see :meth:`evaluate`), in batches of ``batch_size`` rows (default: all
        at once), concatenated: arrays on the last stage's devices. ``state`` is not
        consumed."""
        n = _rows((("inputs", inputs),), "")
        if n < 1:
            raise PipelineError("predict needs inputs of at least one row, got 0 rows")
        size = n if batch_size is None else _integer("batch_size", batch_size, 1)
        chunks = [jax.tree.map(lambda a, k=k: a[k : k + size], inputs) for k in range(0, n, size)]
        self._check_forward(state, chunks[0])
        self._check_items(state, chunks, "batch", with_targets=False)
        outs = self._forward_stream(state, chunks, None)
        if len(outs) == 1:
            return outs[0]
        return jax.tree.map(lambda *a: jnp.concatenate(a), *outs)

    def _check_forward(self, state: Any, x: PyTree) -> None:
        """What :meth:`evaluate` and :meth:`predict` refuse before any device work."""
        if self.multiprocess:
            raise PipelineError(
                "evaluate and predict run in one process; across processes gather the "
                "weights with pipe.variables(state) and evaluate them on one device"
            )
        self._check_state(state, x)

    def _forward_stream(
        self,
        state: PipelineState,
        inputs: list[PyTree],
        targets: list[PyTree] | None,
        metrics: Callable[..., Any] | None = None,
    ) -> list[Any]:
        """Eval-mode forwards of a stream through the stages, dispatched as a wavefront
        (stage ``s`` takes item ``k`` at tick ``k + s``): the last stage's outputs, or
        with ``targets`` its losses (and aux)."""
        S, N = self.num_stages, len(inputs)
        with_loss = targets is not None
        progs = [
            st.eval_program(with_loss and s == S - 1, metrics if s == S - 1 else None)
            for s, st in enumerate(self.stages)
        ]
        cur: list[Any] = list(inputs)
        for tick in range(N + S - 1):
            for s in reversed(range(S)):
                k = tick - s
                if not 0 <= k < N:
                    continue
                stage = self.stages[s]
                args = [state.params[s], state.model_state[s], stage.place_eval(cur[k])]
                if with_loss and s == S - 1:
                    assert targets is not None
                    args.append(stage.place_eval(targets[k]))
                cur[k] = progs[s](*args)
        return cur

    # -- lowering and the interpreter -------------------------------------------------------

    def program(
        self, num_microbatches: int, *, timeline: bool = False, on_loss: bool = False
    ) -> Program:
        """The lowered :class:`~pdjax.pipeline.program.Program` of a call over
        ``num_microbatches`` microbatches (cached). ``timeline``: unfused, one operation
        per schedule action (what a timeline records)."""
        key = (num_microbatches, timeline, on_loss)
        prog = self._programs.get(key)
        if prog is None:
            sched = self.schedule(num_microbatches)
            prog = lower(
                sched,
                self.placement,
                remat=self.remat,
                fuse=not timeline,
                coupled=self.coupled,
                run_ahead=self.workarounds.run_ahead,
                one_at_a_time=self.workarounds.one_at_a_time if not timeline else None,
                on_loss=on_loss,
                donate_weights=self.workarounds.donate_weights,
                tied=self._tied_across,
            )
            self._programs[key] = prog
        return prog

    def _bind(
        self, prog: Program, state: PipelineState, x: PyTree, on_loss: Any
    ) -> tuple[list[tuple[Any, tuple[int, ...], tuple[int, ...], tuple[int, ...]]], dict[str, int]]:
        """The program's operations of this process as ``(function, input registers,
        output registers, registers to drop)``, and the register of every slot."""
        # across processes the receiving side binds shapes: key on the microbatch's too
        shapes = _shape_key(x) if self.multiprocess else None
        key = (id(prog), on_loss is not None, shapes)
        hit = self._bound.get(key)
        if hit is not None and hit[0] is prog:
            return hit[1], hit[2]
        self._check_parts(state, x)
        ops = prog.ops[self.process_index]
        slots: dict[str, int] = {}
        for name in prog.inputs[self.process_index]:
            slots.setdefault(name, len(slots))
        for op in ops:
            for name in (*op.ins, *op.outs):
                slots.setdefault(name, len(slots))
        specs = self._activation_specs(state, x) if self.multiprocess else None
        code = []
        for op in ops:
            fn = self._function(op, prog, specs, on_loss)
            code.append(
                (
                    fn,
                    tuple(slots[n] for n in op.ins),
                    tuple(slots[n] for n in op.outs),
                    tuple(slots[n] for n in op.frees),
                )
            )
        self._bound[key] = (prog, code, slots)
        return code, slots

    def _function(self, op: Op, prog: Program, specs: Any, on_loss: Any) -> Any:
        """What the interpreter calls for ``op``: always ``fn(*inputs) -> outputs``."""
        kind = op.kind
        if kind == "GATHER":
            return partial(_gather, self.stages[op.stage])
        if kind == "PART":
            return partial(_part, self.stages[op.stage], op.outs[0].startswith("loss"))
        if kind == "MOVE" and op.part != (-1, -1):
            return self.transport.piece(self.stages[op.stage], self.stages[op.peer], op.part)
        if kind in ("MOVE", "SEND", "RECV", "SENDRECV"):
            src, dst = self.stages[op.stage], self.stages[op.peer]
            slot = op.ins[0] if op.ins else op.outs[0]
            scalar = slot.startswith("q")
            if slot.startswith(("pg", "nw")):  # tied gradients or values: weights' layout
                if kind != "MOVE":
                    raise PipelineError("tied parameters across processes are not supported")
                return self.transport.link(src, dst, None, replicated=True)
            if scalar:
                # jax leaves ShapeDtypeStruct.__init__ unannotated
                spec = jax.ShapeDtypeStruct((), jnp.float32)
            elif specs is None:
                spec = None
            else:  # forward: stage op.stage's output; backward: stage op.peer's output
                spec = specs[min(op.stage, op.peer)]
            link = self.transport.link(src, dst, spec, replicated=scalar)
            if kind == "MOVE":  # within this process: returns a 1-tuple
                return link
            self.transport.connect(src, dst, replicated=scalar)
            if kind == "SEND":
                return lambda v: (link(v), ())[1]
            if kind == "RECV":
                return lambda: (link(None),)
            return lambda v: (link(v),)
        if kind == "LOSS":  # this call's callback (bound programs outlive a call)
            return partial(self._report_loss, op.mb)
        if kind in ("WAIT", "SYNC"):
            return _wait
        prog_fn = self.stages[op.stage].program(kind, op.flags)
        if kind == "KEYS":
            n = prog.num_microbatches
            return lambda rng, offset: prog_fn(rng, offset, n)
        return prog_fn

    def _report_loss(self, k: int, loss: Any) -> tuple[()]:
        """A ``LOSS`` operation: hands microbatch ``k``'s loss to this call's callback."""
        on_loss = self._on_loss
        assert on_loss is not None  # LOSS operations are lowered only for calls with one
        on_loss(k, _loss_of(loss))
        return ()

    def _execute(
        self,
        prog: Program,
        state: PipelineState,
        microbatches: list[tuple[PyTree, PyTree]],
        record: bool,
        on_loss: Callable[[int, jax.Array], None] | None = None,
        collectives: bool = False,
    ) -> tuple[PipelineState, RunMetrics]:
        S, N, last = self.num_stages, len(microbatches), self.num_stages - 1
        code, slots = self._bind(prog, state, microbatches[0][0], on_loss)
        self._on_loss = on_loss
        reg: list[Any] = [None] * len(slots)
        for name, value in self._inputs(state, microbatches).items():
            if name in slots:
                reg[slots[name]] = value
        t0 = time.perf_counter()
        all_reduces = None
        if record:
            spans, peaks = self._interpret_recording(prog, code, reg)
        elif collectives:
            all_reduces = _interpret_counting(prog.ops[self.process_index], code, reg)
        else:
            _interpret(code, reg)
        host = time.perf_counter() - t0
        self.transport.drain()  # the sender must outlive the transfer

        def out(name: str, default: Any) -> Any:
            return reg[slots[name]] if name in slots else default

        outputs = prog.outputs[self.process_index]
        params, opt_state, model_state = [], [], []
        for s in range(S):
            w = next((o for o in outputs if o.startswith(f"w{s}v")), None)
            o = next((o for o in outputs if o.startswith(f"o{s}v")), None)
            st = next((o for o in outputs if o == f"st{s}" or o.startswith(f"st{s}.")), None)
            params.append(out(w, state.params[s]) if w else state.params[s])
            opt_state.append(out(o, state.opt_state[s]) if o else state.opt_state[s])
            model_state.append(out(st, state.model_state[s]) if st else state.model_state[s])
        if self.local[last]:
            losses = [reg[slots[f"loss{k}"]] for k in range(N)]
        else:
            losses = [None] * N
        if self.multiprocess:  # the losses live on the last stage's processes
            if not self.local[last]:  # their shapes: the loss and any aux of a microbatch
                spec = self._loss_spec(state, microbatches[0])
                losses = [jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), spec)] * N
            losses = self._broadcast(last, losses)
        aux = [v[1] for v in losses] if losses and isinstance(losses[0], tuple) else None
        losses = [_loss_of(v) for v in losses]
        new_state = PipelineState(
            params=tuple(params),
            model_state=tuple(model_state),
            opt_state=tuple(opt_state),
            updates=tuple(u + n for u, n in zip(state.updates, prog.updates, strict=True)),
            microbatches=state.microbatches + N,
            rng=state.rng,
        )
        metrics = RunMetrics(
            losses=list(losses),
            aux=aux,
            peak_versions=prog.peak_versions,
            actions=prog.actions,
            host_seconds=host,
            timeline=Timeline(prog.schedule, self.num_groups, tuple(spans)) if record else None,
            peak_bytes=tuple(peaks) if record else None,
            ops=len(code),
            workarounds=self.workarounds.reasons,
            all_reduces=all_reduces,
        )
        if self.multiprocess:
            # Return drained everywhere: this process's results are computed (so what it
            # received has arrived) and so are every other process's (so what it sent has
            # been taken). A process that went on at once could enter an XLA collective
            # (data parallelism, a replicated stage) while a transfer its peer still needs
            # waits behind it.
            # jax leaves block_until_ready unannotated
            jax.block_until_ready(
                [a for a in jax.tree.leaves((new_state, metrics.losses)) if held(a)]
            )
            allgather_json("pipeline run drained")
        return new_state, metrics

    def _inputs(
        self, state: PipelineState, microbatches: list[tuple[PyTree, PyTree]]
    ) -> dict[str, Any]:
        """The caller's slots: weights, states, per-stage PRNG keys (placed once per call,
        wherever the caller's key lives), the inputs and the targets (one transfer each)."""
        last = self.num_stages - 1
        values: dict[str, Any] = {"offset": np.int32(state.microbatches)}
        for s, _stage in enumerate(self.stages):
            if not self.local[s]:
                continue
            values[f"w{s}v0"] = state.params[s]
            values[f"o{s}v0"] = state.opt_state[s]
            values[f"st{s}"] = state.model_state[s]
        values.update(self._placed_rng(state.rng))
        for s, i, name in ((0, 0, "x0."), (last, 1, "t")):
            if not self.local[s]:
                continue
            stage = self.stages[s]
            trees = [mb[i] for mb in microbatches]
            if stage.round_robin:  # one array per group: microbatch k0 + d on device d
                r = stage.num_replicas
                name = "mx0." if i == 0 else f"mt{s}."
                groups = [_concat(trees[k : k + r]) for k in range(0, len(trees), r)]
                placed = self._place_microbatches(stage, groups)
                values.update((f"{name}{k * r}", v) for k, v in enumerate(placed))
            else:
                placed = self._place_microbatches(stage, trees)
                values.update((f"{name}{k}", v) for k, v in enumerate(placed))
        return values

    def _placed_rng(self, rng: jax.Array) -> dict[str, jax.Array]:
        """The caller's key on every local stage's devices; kept while the caller's key is
        the same object (a state passes its key on), so a call moves it only when it is new."""
        cached = self._rng_cache
        if cached is None or cached[0] is not rng:
            placed = {
                f"rng{s}": stage.place_weights(rng)
                for s, stage in enumerate(self.stages)
                if self.local[s]
            }
            self._rng_cache = cached = (rng, placed)
        return cached[1]

    def _place_microbatches(self, stage: Stage, trees: list[PyTree]) -> list[PyTree]:
        """Host microbatches (numpy) go over as one array per leaf and are split on the
        devices by one cached program: two dispatches, not one transfer per microbatch."""
        leaves = jax.tree.leaves(trees)
        placed: list[PyTree]
        if self.multiprocess or not all(isinstance(a, np.ndarray) for a in leaves):
            placed = stage.place_batch(trees)
            return placed
        treedef = jax.tree.structure(trees[0])
        rows = [[np.shape(a)[0] for a in jax.tree.leaves(t)] for t in trees]
        key = (id(stage), treedef, len(trees), tuple(map(tuple, rows)))
        split = self._splitters.get(key)
        if split is None:
            bounds = np.cumsum([0, *(r[0] for r in rows)])
            if any(len(set(r)) != 1 for r in rows):
                placed = stage.place_batch(trees)
                return placed

            def cut(whole: PyTree) -> list[PyTree]:
                return [
                    jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], whole)
                    for lo, hi in itertools.pairwise(bounds)
                ]

            split = self._splitters[key] = jax.jit(cut, out_shardings=stage.batch_sharding)
        whole = jax.tree.map(lambda *a: np.concatenate(a), *trees)
        placed = split(jax.device_put(whole, stage.batch_sharding))
        return placed

    def _interpret_recording(
        self, prog: Program, code: list[Any], reg: list[Any]
    ) -> tuple[list[Span], list[int]]:
        """:func:`_interpret`, waiting for each operation and recording its span and the
        live bytes per device group (a diagnostic: the devices do not overlap)."""
        sched = self.schedule(prog.num_microbatches)
        group_of_device = {
            d: sched.stage_device[s] for s, st in enumerate(self.stages) for d in st.devices
        }
        peaks = [0] * sched.num_groups
        spans: list[Span] = []
        origin = time.perf_counter()
        for op, (fn, ins, outs, frees) in zip(prog.ops[self.process_index], code, strict=True):
            t0 = time.perf_counter()
            res = fn(*[reg[i] for i in ins])
            jax.block_until_ready(res)
            for i, v in zip(outs, res, strict=True):
                reg[i] = v
            for i in frees:
                reg[i] = None
            t1 = time.perf_counter()
            for a in op.actions:
                spans.append(Span(sched.stage_device[a.stage], t0 - origin, t1 - origin, a))
            _track_live_bytes(peaks, group_of_device)
        return spans, peaks

    # -- across processes -------------------------------------------------------------------

    def _activation_specs(self, state: PipelineState, x: PyTree) -> list[Any]:
        """Per stage, the shapes of its output for a microbatch input like ``x`` (what a
        process receives from another process's stage, or sends back as a gradient)."""
        return self._stage_outputs(state, x)

    def _stage_outputs(self, state: PipelineState, x: PyTree) -> list[Any]:
        """The shapes of every stage's output but the last's, for a microbatch like ``x``."""
        x = _abstract(x)
        key = jax.tree.structure(x), tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(x))
        if key not in self._specs:
            specs = []
            rng = jax.random.key(0)
            for s, stage in enumerate(self.stages[:-1]):
                x = jax.eval_shape(
                    stage.microbatch_output,
                    _abstract(state.params[s]),
                    _abstract(state.model_state[s]),
                    x,
                    rng,
                )
                specs.append(x)
            self._specs[key] = specs
        return self._specs[key]

    def _loss_spec(self, state: PipelineState, mb: tuple[PyTree, PyTree]) -> Any:
        """The shapes of what the last stage's forward leaves for a microbatch like ``mb``:
        its loss, or ``(loss, aux)``."""
        x, t = _abstract(mb[0]), _abstract(mb[1])
        y = self._stage_outputs(state, x)[-1] if self.num_stages > 1 else x
        layers = self.stages[-1]
        loss_fn = layers.loss_fn
        assert loss_fn is not None

        def loss(p: Any, st: Any, y: Any, t: Any) -> Any:
            out = layers.microbatch_output(p, st, y, jax.random.key(0))
            return with_aux(*split_loss(loss_fn(out, t)))

        last = self.num_stages - 1
        return jax.eval_shape(
            loss, _abstract(state.params[last]), _abstract(state.model_state[last]), y, t
        )

    def _broadcast(self, s: int, tree: PyTree) -> PyTree:
        """``tree`` of stage ``s`` (real on its process, shapes elsewhere) on every process;
        elsewhere on that process's first device. Every process calls it, in one order;
        values travel through the pipeline's transport."""
        stage = self.stages[s]
        source = stage.devices[0]  # one replica, from the process that holds this device
        if source.process_index == self.process_index:
            tree = jax.tree.map(lambda a: _shard_on(stage.place_weights(a), source), tree)
        return self.transport.broadcast(tree, source)


def _state_layout(state: PipelineState) -> Any:
    """Per field (params, model state, optimizer state), per stage, the tree structure
    and the leaf shapes: what a state must share with the states a pipeline makes (not
    the dtypes, which a caller may change, as a cast to bfloat16 does)."""
    return _layout(state.params, state.model_state, state.opt_state)


def _layout(
    params: Sequence[PyTree], model_state: Sequence[PyTree], opt_state: Sequence[PyTree]
) -> Any:
    """:func:`_state_layout` of a state's three per-stage fields."""

    def per_stage(trees: Sequence[PyTree]) -> tuple[Any, ...]:
        out = []
        for tree in trees:
            leaves, treedef = jax.tree.flatten(tree)
            out.append((treedef, tuple(np.shape(a) for a in leaves)))
        return tuple(out)

    return per_stage(params), per_stage(model_state), per_stage(opt_state)


def _layout_key(tree: PyTree) -> Any:
    """A hashable key of ``tree``'s structure, leaf shapes and dtypes (cheap: one flatten)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple([(np.shape(a), getattr(a, "dtype", None)) for a in leaves])


def _rows(parts: Sequence[tuple[str, PyTree]], where: str) -> int:
    """The rows (leading dimension) that every leaf of the named trees ``parts`` (e.g.
    ``(("inputs", x), ("targets", t))``) shares. Targets with other rows than their
    inputs would be cut at other samples (trained on the wrong targets) or fail deep in
    XLA, so they are refused here, naming the leaf."""
    named: list[tuple[str, tuple[int, ...]]] = [
        (name + jax.tree_util.keystr(path), np.shape(a))
        for name, tree in parts
        for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    if not named:
        raise PipelineError(f"{where}{' and '.join(n for n, _ in parts)} hold no arrays")
    for leaf, shape in named:
        if not shape:
            raise PipelineError(
                f"{where}{leaf} is a scalar, with no leading (batch) dimension: every leaf "
                "of the inputs and targets needs one row per sample"
            )
    first, (n, *_) = named[0]
    for leaf, shape in named:
        if shape[0] != n:
            raise PipelineError(
                f"{where}{leaf} has {shape[0]} rows but {first} has {n}: every leaf of the "
                "inputs and targets needs one row per sample (the same leading dimension); "
                "pass the targets that belong to these inputs"
            )
    return n


def _check_loss(loss_fn: LossFn, y: Any, t: PyTree, where: str) -> None:
    """Traces ``loss_fn`` on the model's output shapes ``y`` and targets ``t``: a loss
    that is not a scalar raises :func:`split_loss`'s error, targets it cannot take raise
    one naming both shapes (rather than an XLA error from inside a stage program)."""
    try:
        jax.eval_shape(lambda y, t: split_loss(loss_fn(y, t)), y, _abstract(t))
    except PdjaxError:
        raise
    except Exception as e:
        raise PipelineError(
            f"{where}: loss_fn cannot take the model's outputs [{_shapes_text(y)}] and the "
            f"targets [{_shapes_text(t)}]: {type(e).__name__}: {str(e).rstrip('.')}. Give "
            "targets that fit "
            "the model's outputs, one row per input row"
        ) from e


def _shapes_text(tree: PyTree) -> str:
    """``float32[4, 8], int32[4]``: the leaves' dtypes and shapes."""
    return ", ".join(f"{jnp.result_type(a)}{list(np.shape(a))}" for a in jax.tree.leaves(tree))


def _brief(treedef: Any, limit: int = 160) -> str:
    """A tree structure as text, cut to ``limit`` characters (an optimizer's can be long)."""
    text = str(treedef).removeprefix("PyTreeDef(").removesuffix(")")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_pairs(items: Sequence[Any], call: str, what: str) -> None:
    """Refuses an item of ``items`` that is not an ``(inputs, targets)`` pair: the whole
    batch passed where its microbatches belong would unpack as inputs and targets."""
    for k, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            shape = f" of shape {list(np.shape(item))}" if hasattr(item, "shape") else ""
            raise PipelineError(
                f"{call} takes a sequence of {what}, each an (inputs, targets) pair; item "
                f"{k} is a {type(item).__name__}{shape}. For one whole batch use "
                + (
                    "run(state, pipe.split_batch((inputs, targets))) or step(state, "
                    "(inputs, targets))"
                    if call == "run"
                    else f"{call}(state, [(inputs, targets)])"
                )
            )


def _integer(name: str, value: Any, least: int) -> int:
    """``value`` of the constructor argument ``name`` as an ``int`` >= ``least``. Bools,
    floats and strings are refused rather than rounded: ``microbatches=2.5`` or ``"2"``
    is a mistake that would otherwise surface as a raw error deep in the schedule."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise PipelineError(
            f"{name} must be an integer >= {least}, got {value!r}"
            f" ({type(value).__name__}); pass a whole number such as {max(least, 1)}"
        )
    return int(value)


def _remat_flags(remat: Any, num_stages: int) -> tuple[bool, ...]:
    """``remat`` as one flag per stage (a bool for all, or a sequence of bools)."""
    if isinstance(remat, (bool, np.bool_)):
        return (bool(remat),) * num_stages
    flags = tuple(remat) if isinstance(remat, (list, tuple)) else None
    if flags is None or not all(isinstance(f, (bool, np.bool_)) for f in flags):
        raise PipelineError(f"remat must be a bool or one bool per stage, got {remat!r}")
    if len(flags) != num_stages:
        raise PipelineError(
            f"remat gives {len(flags)} flags for {num_stages} stages; give one per stage"
        )
    return tuple(bool(f) for f in flags)


def _tied_stages(
    layers: LayerSequence, specs: Sequence[Any]
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Per tied group of ``layers``, its name and the stages (``specs``) holding copies."""
    stage_of = {
        i: s for s, sp in enumerate(specs) for i in range(sp.first_layer, sp.last_layer + 1)
    }
    return tuple(
        (name, tuple(sorted({stage_of[i] for i, _ in leaves})))
        for name, leaves in getattr(layers, "tied_leaves", ())
    )


def _key_str(key: Any) -> str:
    """One key of a pytree path as text (how ``tied=`` paths name it)."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _compose(f: Callable[[Any], Any], g: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda x: f(g(x))


def _shape_key(tree: PyTree) -> Any:
    leaves = jax.tree.leaves(tree)
    return jax.tree.structure(tree), tuple((np.shape(a), str(jnp.result_type(a))) for a in leaves)


def _init_layers(
    layers: Sequence[Any], first: int, key: jax.Array, x: PyTree
) -> tuple[list[Variables], PyTree]:
    """``layers`` (model layers ``first ..``) initialised as :meth:`LayerSequence.init`
    does, and the last one's output."""
    out = []
    for j, layer in enumerate(layers):
        v = layer.init(jax.random.fold_in(key, first + j), x)
        x, _ = layer.apply(v, x, train=False)
        out.append(v)
    return out, x


def _unaliased(tree: PyTree, other: PyTree) -> PyTree:
    """``tree`` with every array that shares a buffer with an array of ``other``, or with
    an earlier array of ``tree``, copied: donating the tree must not donate ``other``'s
    buffers or one buffer twice."""

    def pointers(a: Any) -> set[int]:
        if not isinstance(a, jax.Array) or a.is_deleted():
            return set()
        return {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}

    taken = set().union(*(pointers(a) for a in jax.tree.leaves(other)))

    def one(a: Any) -> Any:
        mine = pointers(a)
        if mine & taken:
            a = jnp.array(a, copy=True)
            mine = pointers(a)
        taken.update(mine)
        return a

    return jax.tree.map(one, tree)


def _interpret(code: list[Any], reg: list[Any]) -> None:
    """Runs a bound program: each operation reads its registers, writes its results and
    drops what nothing reads later. Everything else was decided by the lowering."""
    for fn, ins, outs, frees in code:
        res = fn(*[reg[i] for i in ins])
        for i, v in zip(outs, res):  # noqa: B905 (lengths fixed by the lowering)
            reg[i] = v
        for i in frees:
            reg[i] = None


def _replication_of(
    replication: str | Sequence[str] | None, specs: Sequence[Any], groups: int
) -> tuple[str, ...]:
    """Per device group ``"split"`` or ``"round-robin"`` (see :class:`Pipeline`)."""
    if replication is None:
        modes = tuple(getattr(spec, "replication", "split") for spec in specs[:groups])
    elif isinstance(replication, str):
        modes = (replication,) * groups
    else:
        modes = tuple(replication)
    if len(modes) != groups:
        raise PipelineError(
            f"replication has {len(modes)} entries for {groups} stages; give one per stage "
            "or one word for all"
        )
    for mode in modes:
        if mode not in ("split", "round-robin"):
            raise PipelineError(f"replication must be 'split' or 'round-robin', got {mode!r}")
    return modes


def _stage_devices(
    plan: Any, specs: Sequence[Any], devices: Sequence[jax.Device] | None
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
    topology_ids = getattr(getattr(plan, "topology", None), "device_ids", None)
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


def _scale(schedule: str, microbatches: int, replicas: int, round_robin: bool) -> float:
    """The factor on a stage's summed gradients before its update: the mean over the
    microbatches one update applies (``M``; a round-robin group under ``pipedream``)."""
    if schedule == "pipedream":
        return 1.0 / replicas if round_robin else 1.0
    return 1.0 / microbatches


def _concat(trees: list[PyTree]) -> PyTree:
    """Microbatches concatenated along axis 0 (on the host when they are numpy)."""
    if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(trees)):
        return jax.tree.map(lambda *a: np.concatenate(a), *trees)
    return jax.tree.map(lambda *a: jnp.concatenate(a), *trees)


def _gather(stage: Stage, *pieces: PyTree) -> tuple[PyTree]:
    """A round-robin group from its microbatches, each already on its device (piece ``d``
    on device ``d``): one array per leaf, sharded over the stage's devices, no copy."""
    leaves = [jax.tree.leaves(p) for p in pieces]
    treedef = jax.tree.structure(pieces[0])
    out = []
    for parts in zip(*leaves, strict=True):
        shape = (sum(a.shape[0] for a in parts), *parts[0].shape[1:])
        out.append(jax.make_array_from_single_device_arrays(shape, stage.batch_sharding, parts))
    return (jax.tree.unflatten(treedef, out),)


def _part(stage: Stage, scalars: bool, group: PyTree) -> tuple[PyTree, ...]:
    """A round-robin group's value as one piece per microbatch, each on its own device (no
    copy); ``scalars``: the group's losses, one scalar per microbatch."""
    leaves, treedef = jax.tree.flatten(group)
    per_device = [{sh.device: sh.data for sh in a.addressable_shards} for a in leaves]
    out = []
    for d in stage.devices:
        parts = [m[d] for m in per_device]
        if scalars:  # each device's [1, ...] rows: its microbatch's loss (and aux)
            parts = [a.reshape(a.shape[1:]) for a in parts]
        out.append(jax.tree.unflatten(treedef, parts))
    return tuple(out)


_ALL_REDUCE = re.compile(r"\ball-reduce(?:-start)?\(")


def _interpret_counting(ops: Sequence[Op], code: list[Any], reg: list[Any]) -> dict[str, int]:
    """:func:`_interpret`, counting per operation kind the all-reduces in the compiled
    program each operation runs (each distinct program and argument shapes compiled once
    more, to read its HLO)."""
    counts: dict[str, int] = {}
    texts: dict[Any, int] = {}
    for op, (fn, ins, outs, frees) in zip(ops, code, strict=True):
        args = [reg[i] for i in ins]
        if hasattr(fn, "lower"):
            key = (id(fn), _shape_key(args))
            if key not in texts:
                texts[key] = len(_ALL_REDUCE.findall(fn.lower(*args).compile().as_text()))
            counts[op.kind] = counts.get(op.kind, 0) + texts[key]
        res = fn(*args)
        for i, v in zip(outs, res, strict=True):
            reg[i] = v
        for i in frees:
            reg[i] = None
    return counts


def _plain(a: np.ndarray) -> Any:
    """A 0-d array as a Python float; others as they are."""
    return float(a) if np.ndim(a) == 0 else a


def _loss_of(value: Any) -> jax.Array:
    """The loss in a ``loss`` slot's value (the loss, or ``(loss, aux)``)."""
    loss: jax.Array = value[0] if isinstance(value, tuple) else value
    return loss


def _wait(*values: Any) -> tuple[()]:
    jax.block_until_ready(values)
    return ()


def _remote(sharding: jax.sharding.Sharding, tree: PyTree) -> PyTree:
    """``tree`` as global arrays on another process's devices: shapes, no local data."""
    return jax.tree.map(
        lambda a: jax.make_array_from_single_device_arrays(
            np.shape(a), sharding, [], dtype=jnp.result_type(a)
        ),
        tree,
    )


def _shard_on(array: jax.Array, device: jax.Device) -> jax.Array:
    """The shard of ``array`` that ``device`` holds (a whole replica, for weights)."""
    data: jax.Array = next(sh.data for sh in array.addressable_shards if sh.device == device)
    return data


def _abstract(tree: PyTree) -> PyTree:
    """``tree`` with every leaf replaced by its ``jax.ShapeDtypeStruct``."""
    # jax leaves ShapeDtypeStruct.__init__ unannotated
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)),
        tree,
    )
