"""The runtime's :class:`Pipeline`: a model split into stages on devices, what its
constructor sets up, its state's making (:meth:`Pipeline.init`), and its training calls
(:meth:`Pipeline.step`, :meth:`Pipeline.run`). What the calls check, evaluation, and the
interpreter of lowered programs live in the classes it builds on (:mod:`.checks`,
:mod:`.forward`, :mod:`.interpreter`, :mod:`.base`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Literal

import jax
import numpy as np
import optax

from pdjax import _xla_cpu
from pdjax.distributed import check_cpu_transfers
from pdjax.errors import PipelineError
from pdjax.layers import LayerSequence, PyTree, Variables
from pdjax.layers.init_programs import init_on
from pdjax.partition.plan import Plan, StagePlan
from pdjax.pipeline.executor.arguments import (
    check_arrays,
    check_callback,
    check_devices,
    check_flag,
    check_key,
    check_layers,
    check_loss_fn,
    check_optimizer,
    check_stream,
)
from pdjax.pipeline.executor.checks import _check_pairs, _rows, _state_layout
from pdjax.pipeline.executor.config import (
    MAX_MICROBATCHES,
    MICROBATCHES_WHY,
    _check_cover,
    _check_options,
    _integer,
    _remat_flags,
    _replication_of,
    _scale,
    _stage_devices,
    _stages_of,
    _tied_stages,
)
from pdjax.pipeline.executor.interpreter import _Interpreter
from pdjax.pipeline.executor.state import PipelineState, RunMetrics
from pdjax.pipeline.executor.trees import (
    _abstract,
    _compose,
    _remote,
    _shapes_text,
    _unaliased,
)
from pdjax.pipeline.lowering import Placement, StagePlace
from pdjax.pipeline.stage import LossFn, Stage
from pdjax.pipeline.transport import make_transport
from pdjax.schedules import ROUND_ROBIN, SCHEDULES, STREAMING, stage_groups

__all__ = ["Pipeline"]


class Pipeline(_Interpreter):
    """A model split into stages on devices, trained with a pipeline schedule.

    Args:
      layers: the model.
      plan: the stages: a :class:`pdjax.partition.Plan`, or a sequence of
        :class:`pdjax.partition.StagePlan` (layers ``first_layer..last_layer`` inclusive on
        ``devices``) such as :func:`even_stages` makes, or ``StagePlan(0, 1, (0,))`` written
        by hand. For ``interleaved`` with ``chunks=v`` give ``P * v`` stages;
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
        update of staleness (:func:`pdjax.schedules.pipedream`).
      replication: how a replicated stage's devices share its work: ``"split"`` (each
        microbatch split across them) or ``"round-robin"`` (PipeDream's: each device
        takes whole microbatches, ``r`` consecutive ones at once, the gradients
        all-reduced once per group; under ``pipedream`` the stage updates once per group
        of ``r`` with their mean gradient; :func:`~pdjax.schedules.pipedream`);
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
    group; :mod:`pdjax.pipeline.lowering.program`): flush schedules (``gpipe``, ``1f1b``,
    ``interleaved``, ``zb-h1``, ``zb-h2``, ``zb-v``), in one process, with
    ``optimizer_scope="model"``.

    Raises:
      PipelineError: before any device work, for ``microbatches`` or ``chunks`` that is
        not an integer >= 1 (``extra_in_flight``: >= 0), a plan that is not a ``Plan`` or
        a sequence of ``StagePlan``, one that does not cover the model, too few devices,
        a device id not among ``devices``, an unknown schedule, or tied copies on
        several stages with ``pipedream`` or ``2bw`` (whose stages update at their own
        times, so the copies cannot stay one parameter), across processes, or with
        ``optimizer_scope="stage"``.
    """

    def __init__(
        self,
        layers: LayerSequence,
        plan: Plan | Sequence[StagePlan],
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
        layers = check_layers(layers, "Pipeline")
        check_loss_fn(loss_fn, "Pipeline")
        check_optimizer(optimizer, "Pipeline")
        vertical_sync = check_flag("vertical_sync", vertical_sync)
        weight_stashing = check_flag("weight_stashing", weight_stashing)
        devices = check_devices(devices, "Pipeline")
        if not isinstance(schedule, str) or schedule not in SCHEDULES:
            raise PipelineError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
        most, why = MAX_MICROBATCHES, MICROBATCHES_WHY
        microbatches = _integer("microbatches", microbatches, 1, most, why)
        if chunks is None:
            chunks = 2 if schedule == "zb-v" else 1
        chunks = _integer("chunks", chunks, 1, most, why)
        extra_in_flight = _integer("extra_in_flight", extra_in_flight, 0, most, why)
        _check_options(
            schedule,
            chunks=chunks,
            vertical_sync=vertical_sync,
            weight_stashing=weight_stashing,
            extra_in_flight=extra_in_flight,
            grad_allreduce=grad_allreduce,
            optimizer_scope=optimizer_scope,
        )
        self.layers = layers
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.chunks = chunks
        self.vertical_sync = vertical_sync
        self.weight_stashing = weight_stashing
        self.extra_in_flight = extra_in_flight
        self.grad_allreduce = grad_allreduce
        self.optimizer_scope = optimizer_scope
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        specs = _stages_of(plan)
        self.stage_specs = specs
        _check_cover(specs, len(layers))
        self.remat = _remat_flags(remat, len(specs))
        self._group_stages(specs)
        round_robin = self._round_robin(specs, replication)
        self._build_stages(specs, _stage_devices(plan, specs, devices), round_robin)
        self.replicas = tuple(len(spec.devices) for spec in specs[: self.num_groups])
        if schedule == "2bw" and microbatches < self.num_groups:
            raise PipelineError(
                f"2bw needs microbatches (M) >= stages (P) so that step t can use W(t-1) at "
                f"every stage; got M={microbatches}, P={self.num_groups}"
            )
        # multi-controller runs (jax.distributed): the stages this process drives
        self.process_index = jax.process_index()
        # per stage, the processes that hold its devices (a replicated stage may span
        # several: each of them runs the stage's programs, SPMD)
        self.owners = tuple(frozenset(d.process_index for d in st.devices) for st in self.stages)
        self.local = tuple(self.process_index in owners for owners in self.owners)
        #: per tied group: its name and the stages holding its copies (ascending)
        self.tied_stages = _tied_stages(layers, specs)
        self._check_tied()
        self.stage_optimizer = None  # decided on the first state
        self.coupled = False
        self._place(transport)
        self._reset_caches()

    def _group_stages(self, specs: Sequence[StagePlan]) -> None:
        """Sets the device groups: ``num_groups`` and each stage's ``stage_device``."""
        if len(specs) % self.chunks:
            if self.schedule_name == "zb-v":
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
        self.stage_device = stage_groups(self.schedule_name, self.num_groups, self.chunks)

    def _round_robin(
        self, specs: Sequence[StagePlan], replication: str | Sequence[str] | None
    ) -> list[bool]:
        """Sets :attr:`replication` (per device group) and returns per group whether it
        runs round-robin, refusing round-robin where the schedule or ``M`` cannot run it."""
        schedule, microbatches = self.schedule_name, self.microbatches
        self.replication = _replication_of(replication, specs, self.num_groups)
        # the plan's choice (not the caller's) falls back to split where round-robin cannot
        # run; for flush schedules and 2bw the two compute the same
        self._replication_asked = replication is not None
        self.replication_notes = []
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
        if any(round_robin) and schedule not in ROUND_ROBIN:
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
        return round_robin

    def _build_stages(
        self,
        specs: Sequence[StagePlan],
        stage_devices: Sequence[Sequence[jax.Device]],
        round_robin: Sequence[bool],
    ) -> None:
        """Makes :attr:`stages`, each on the devices of its device group."""
        schedule = self.schedule_name
        self.stages = []
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
                    index=s,
                    layers=self.layers.layers[spec.first_layer : spec.last_layer + 1],
                    first_layer=spec.first_layer,
                    devices=list(stage_devices[s]),
                    optimizer=self.optimizer,
                    loss_fn=self.loss_fn if s == len(specs) - 1 else None,
                    remat=self.remat[s],
                    scale=_scale(schedule, self.microbatches, len(spec.devices), round_robin[g]),
                    round_robin=round_robin[g],
                )
            )

    def _place(self, transport: str) -> None:
        """Sets the :attr:`placement` the lowering reads, the transport and the XLA CPU
        workarounds in force."""
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
            1 if self.schedule_name == "pipedream" else self.microbatches,
            self.num_groups,
            collectives=self.multiprocess and transport == "collective",
        )
        if self.multiprocess and transport == "device_put":
            check_cpu_transfers("a pipeline across processes")

    def _reset_caches(self) -> None:
        """What the pipeline builds on first use and then keeps."""
        self._parts_checked = False
        self._settled = False
        self._schedules = {}
        self._specs = {}
        self._layer_shapes = {}
        self._programs = {}
        self._bound = {}
        self._rng_cache = None
        self._on_loss = None
        self._splitters = {}
        # What the API checks once and then trusts (_check_state, _check_items): the
        # layouts of the states this pipeline made, the last one first; the shapes of the
        # sample init saw (for messages); per layout of an item (or of a call's items)
        # found to fit the weights of the state layout _fits_layout, its rows.
        self._state_layouts = []
        self._init_shapes = None
        self._fits = {}
        self._fits_layout = None

    # -- state ------------------------------------------------------------------------------
    def init(self, rng: jax.Array, sample: PyTree) -> PipelineState:
        """Initialises every layer from ``rng`` on a sample microbatch and places the stages.

        ``rng`` also seeds dropout (through ``fold_in(rng, 1)``).

        Raises:
          PipelineError: before any device work, for an ``rng`` that is not one PRNG key
            (``jax.random.key(0)``), a sample leaf that is not an array of numbers, or a
            sample the model cannot take (naming the layer and the shapes).
        """
        check_key(rng, "init")
        check_arrays((("sample", sample),), "init: ")
        self.check_shapes(sample)
        self._init_shapes = _shapes_text(sample)
        key = jax.random.fold_in(rng, 0)
        if self.multiprocess:  # every process builds the whole model (same key, same values)
            variables = jax.jit(self.layers.init)(key, sample)
        else:  # each stage's layers on its own devices, never the whole model on one
            variables = []
            x = sample
            # layers that share an init program run it on one device: once per distinct layer
            home = self.stages[0].devices[0]
            for stage, spec in zip(self.stages, self.stage_specs, strict=True):
                vs, x = init_on(
                    stage.layers,
                    spec.first_layer,
                    stage.place_weights(key),
                    stage.place_weights(x),
                    stage.replicated,
                    home,
                )
                variables += vs
        return self.state_from_variables(variables, jax.random.fold_in(rng, 1))

    def state_from_variables(
        self, variables: Sequence[Variables] | Mapping[str, Any], rng: jax.Array
    ) -> PipelineState:
        """A fresh state from given variables (pre-trained, restored): a per-layer list, or
        the merged tree of :meth:`LayerSequence.merge`. Optimizer state starts anew."""
        check_key(rng, "state_from_variables")
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
        if n < M:
            raise PipelineError(
                f"a batch of {n} samples cannot be split into {M} microbatches: every "
                f"microbatch needs at least one sample; use microbatches <= the batch size "
                f"(Pipeline(..., microbatches=...)) or a batch of at least {M} samples"
            )
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
        check_flag("timeline", timeline)
        check_flag("collectives", collectives)
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
        microbatches = check_stream("microbatches", microbatches, "run")
        check_flag("timeline", timeline)
        check_flag("collectives", collectives)
        check_callback("on_loss", on_loss, "on_loss(k, loss)")
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
        return self._execute(
            prog, state, microbatches, record=timeline, on_loss=on_loss, collectives=collectives
        )
