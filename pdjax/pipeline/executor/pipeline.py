"""The runtime's :class:`Pipeline`: a model split into stages on devices, what its
constructor sets up, its state's making (:meth:`Pipeline.init`), and its training calls
(:meth:`Pipeline.step`, :meth:`Pipeline.run`). It is made of parts it holds, each in its
module: the stage set (:mod:`.stages`), the decisions taken once (:mod:`.decisions`), the
checker of what calls are given (:mod:`.checks`), the program cache (:mod:`.programs`:
schedule, lowered program, bound code), the caller's values into registers and a call's
run (:mod:`.calls`, over the pure interpreter of :mod:`.interpreter`) and the forward-only
calls (:mod:`.forward`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Literal

import jax
import optax

from pdjax.errors import PipelineError
from pdjax.layers import LayerSequence, PyTree, Variables
from pdjax.layers.init_programs import init_on
from pdjax.layers.sharding import ShardingRules
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
from pdjax.pipeline.executor.calls import Feeder, execute
from pdjax.pipeline.executor.checks import Checker, check_pairs, split_batch, state_layout
from pdjax.pipeline.executor.config import (
    check_cover,
    check_scope,
    remat_policies,
    schedule_of,
    stages_of,
)
from pdjax.pipeline.executor.decisions import Decisions
from pdjax.pipeline.executor.forward import Forward
from pdjax.pipeline.executor.interpreter import Step
from pdjax.pipeline.executor.layout import ParamLayout, param_layout
from pdjax.pipeline.executor.programs import ProgramCache
from pdjax.pipeline.executor.stages import build_stages, place
from pdjax.pipeline.executor.state import PipelineState, RunMetrics
from pdjax.pipeline.executor.trees import (
    abstract,
    compose,
    remote,
    shapes_text,
    unaliased,
)
from pdjax.pipeline.lowering import Program, Slot
from pdjax.pipeline.optim import StageOptimizer
from pdjax.pipeline.stage import LossFn, Stage
from pdjax.plan.plan import Plan, StagePlan
from pdjax.schedules import Schedule, ScheduleSpec, schedule_kind, semantics

__all__ = ["Pipeline"]


class Pipeline:
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
        schedule's ``stage_device``); ``even_stages(L, P * v, placement="interleaved",
        chunks=v)`` and ``even_stages(L, 2 * P, placement="zb-v")`` make them. How stage
        devices are read:
        a ``Plan`` whose topology has ``device_ids`` (planned on
        :meth:`Topology.from_devices <pdjax.partition.Topology.from_devices>`, also after
        a JSON round trip) names real devices by ``jax.Device.id``, looked up among
        ``devices`` in any order; a ``Plan`` without them (``Topology.flat``,
        ``from_levels``, presets: topology positions) and a plain sequence of stages (even
        ``plan.stages`` alone) name devices by index into ``devices``.
      loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean loss of a microbatch.
      optimizer: any optax ``GradientTransformation``; each stage keeps its own state.
      schedule: what runs: None (the default) runs a ``Plan`` as planned, its
        :attr:`~pdjax.partition.Plan.schedule`; stages written by hand take a
        :class:`~pdjax.schedules.ScheduleSpec` (the kind, ``M`` microbatches per step,
        chunks, the kind's options, replication, the memory policy per stage) or a
        validated :class:`~pdjax.schedules.Schedule` (built by hand, or read from
        PyTorch's CSV format by :func:`~pdjax.schedules.torch_csv.read_torch_csv`), which then runs
        as it is, for calls of its own microbatch count. Given with a ``Plan``, it replaces
        the plan's. Flush schedules (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``,
        ``zb-h2``, ``zb-v``) train with :meth:`step`, streaming ones (``pipedream``,
        ``2bw``) with :meth:`run`. Stages without either run ``ScheduleSpec("1f1b")``.
      devices: the devices the plan's ids refer to (default ``jax.devices()``): indexed
        by position, or searched by ``jax.Device.id`` for a plan with ``device_ids``.
      transport: how values cross processes (``pdjax.pipeline.transport``):
        ``device_put``, ``collective``, or ``auto`` (``device_put`` unless the pipeline
        spans more than 2 processes on CPU, where only ``collective`` works).
      optimizer_scope: ``"model"`` (default): the optimizer means one update of the whole
        model, as in sequential training. An optimizer that treats each parameter on its
        own runs per stage as it is; one coupled through the gradients' global norm
        (``optax.clip_by_global_norm``) gets the norm exchanged between stages (one scalar
        per stage and update; flush schedules and ``2bw``); any other coupling raises when
        the state is built (:mod:`pdjax.pipeline.optim`). ``"stage"``: run the optimizer on
        each stage alone, knowingly (e.g. clipping each stage by its own norm).
      sharding: how a sharded stage's parameters map onto its mesh (a plan stage's
        :attr:`~pdjax.plan.StagePlan.mesh` with an axis besides ``data``):
        :class:`~pdjax.layers.sharding.ShardingRules`, the logical-axis rules, ZeRO-3 for
        unannotated parameters (``fsdp="auto"``) or a function of each parameter; default
        ``ShardingRules()`` (:data:`~pdjax.layers.sharding.DEFAULT_RULES`). Unused
        when no stage is sharded.

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
      PipelineError: before any device work, for a plan that is not a ``Plan`` or
        a sequence of ``StagePlan``, one that does not cover the model, too few devices,
        a device id not among ``devices``, an unknown schedule, or tied copies on
        several stages with ``pipedream`` or ``2bw`` (whose stages update at their own
        times, so the copies cannot stay one parameter), across processes, or with
        ``optimizer_scope="stage"``.
      ScheduleError: a ``schedule`` that is neither a spec nor a valid ``Schedule``.
    """

    def __init__(
        self,
        layers: LayerSequence,
        plan: Plan | Sequence[StagePlan],
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        *,
        schedule: ScheduleSpec | Schedule | None = None,
        devices: Sequence[jax.Device] | None = None,
        transport: str = "auto",
        optimizer_scope: Literal["model", "stage"] = "model",
        sharding: ShardingRules | None = None,
    ) -> None:
        layers = check_layers(layers, "Pipeline")
        check_loss_fn(loss_fn, "Pipeline")
        check_optimizer(optimizer, "Pipeline")
        devices = check_devices(devices, "Pipeline")
        fixed, spec = schedule_of(plan, schedule)
        check_scope(optimizer_scope)
        self.layers = layers
        #: what runs: the kind, M, chunks, the kind's options (a given Schedule's own)
        self.spec = spec
        self.optimizer_scope = optimizer_scope
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        specs = stages_of(plan)
        self.stage_specs = specs
        check_cover(specs, len(layers))
        self.remat = remat_policies(spec.remat, len(specs))
        name, M = spec.kind, spec.microbatches
        #: the stages and where they run (fixed from here on)
        self.stage_set, rep = build_stages(
            layers,
            specs,
            plan,
            devices,
            schedule=name,
            microbatches=M,
            chunks=spec.chunks or 1,
            remat=self.remat,
            optimizer=optimizer,
            loss_fn=loss_fn,
            replication=spec.replication,
            sharding=sharding,
        )
        if schedule_kind(name).needs_microbatches_per_stage and M < self.num_groups:
            raise PipelineError(
                f"{name} needs microbatches (M) >= stages (P) so that step t can use W(t-1) at "
                f"every stage; got M={M}, P={self.num_groups}"
            )
        self.decisions = Decisions(
            self.stage_set,
            layers,
            rep,
            schedule=name,
            microbatches=M,
            optimizer=optimizer,
            optimizer_scope=optimizer_scope,
            grad_allreduce=spec.grad_allreduce,
        )
        self.decisions.check_tied()
        self.placement, self.transport, self.workarounds = place(self.stage_set, transport, name, M)
        self.programs = ProgramCache(
            spec,
            self.remat,
            self.stage_set,
            self.decisions,
            self.placement,
            self.transport,
            self.workarounds,
            fixed=fixed,
        )
        self.checker = Checker(self.stage_set, layers, loss_fn, self._settle)
        self.forward = Forward(self.stage_set, layers, self.checker, self.decisions, self.transport)
        self.feeder = Feeder(self.stage_set)

    # -- the parts' views, under the names the pipeline has always had ----------------------

    @property
    def schedule_name(self) -> str:
        """The schedule's kind (the spec's)."""
        return self.spec.kind

    @property
    def microbatches(self) -> int:
        """``M``, microbatches per step (the spec's)."""
        return self.spec.microbatches

    @property
    def chunks(self) -> int:
        """Stages per device group (the spec's)."""
        return self.spec.chunks or 1

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Per stage, its programs (:class:`~pdjax.pipeline.stage.Stage`)."""
        return self.stage_set.stages

    @property
    def num_stages(self) -> int:
        return self.stage_set.num_stages

    @property
    def num_groups(self) -> int:
        """Device groups ``P``."""
        return self.stage_set.num_groups

    @property
    def stage_device(self) -> tuple[int, ...]:
        """The device group of each stage (the schedule's ``stage_device``); group ``d``
        runs on the devices of plan stage ``d``."""
        return self.stage_set.stage_device

    @property
    def replicas(self) -> tuple[int, ...]:
        """Per device group, its devices."""
        return self.stage_set.replicas

    @property
    def process_index(self) -> int:
        return self.stage_set.process_index

    @property
    def owners(self) -> tuple[frozenset[int], ...]:
        """Per stage, the processes that hold its devices."""
        return self.stage_set.owners

    @property
    def local(self) -> tuple[bool, ...]:
        """Per stage, whether this process holds some of its devices."""
        return self.stage_set.local

    @property
    def tied_stages(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Per tied group: its name and the stages holding its copies (ascending)."""
        return self.stage_set.tied_stages

    @property
    def multiprocess(self) -> bool:
        """Whether some stages run (also) in other processes (``jax.distributed``)."""
        return self.stage_set.multiprocess

    @property
    def replication(self) -> tuple[str, ...]:
        """Per device group, ``"split"`` or ``"round-robin"``."""
        return self.decisions.replication.modes

    @property
    def replication_notes(self) -> list[str]:
        """The plan's replication choices that run otherwise, one line each."""
        return self.decisions.replication.notes

    @property
    def stage_optimizer(self) -> StageOptimizer | None:
        """The optimizer as every stage runs it (decided on the first state)."""
        return self.decisions.stage_optimizer

    @property
    def coupled(self) -> bool:
        """Whether updates exchange the gradients' global norm."""
        return self.decisions.coupled

    @property
    def grad_allreduce_at(self) -> tuple[str, ...]:
        """Per stage, where its gradients are all-reduced: ``"-"`` (one device),
        ``"update"``, or ``"backward: <why>"``; decided at the first step or run."""
        return self.decisions.grad_allreduce_at()

    def schedule(self, num_microbatches: int) -> Schedule:
        """The validated schedule for a call over ``num_microbatches`` microbatches: the
        stream of ``pipedream`` and ``2bw``, whole steps of ``M`` for the flush schedules."""
        return self.programs.schedule(num_microbatches)

    def program(
        self, num_microbatches: int, *, timeline: bool = False, on_loss: bool = False
    ) -> Program:
        """The lowered :class:`~pdjax.pipeline.lowering.Program` of a call over
        ``num_microbatches`` microbatches (cached). ``timeline``: unfused, one operation
        per schedule action (what a timeline records)."""
        return self.programs.program(num_microbatches, timeline=timeline, on_loss=on_loss)

    def param_layout(self) -> tuple[ParamLayout, ...]:
        """Per stage, how its parameters and optimizer state are laid out
        (:class:`~pdjax.pipeline.executor.layout.ParamLayout`): the parameters as its
        optimizer sees them, its tied groups and their owners, and whether the optimizer
        keeps a phantom leaf for the exchanged global norm. Settled by the first state
        this pipeline makes (:meth:`init`, :meth:`state_from_variables`) or checks."""
        return param_layout(self.stage_set, self.decisions)

    def check_shapes(self, sample: PyTree, variables: Sequence[Variables] | None = None) -> Any:
        """Traces the model layer by layer on ``sample`` (shapes only, no FLOPs), with
        ``variables`` (per layer; default: those init would make for ``sample``), and
        returns the shapes of the model's output (:meth:`Checker.check_shapes
        <pdjax.pipeline.executor.checks.Checker.check_shapes>`).

        Raises:
          PipelineError: naming the stage, the layer and the input shapes that fail.
        """
        return self.checker.check_shapes(sample, variables)

    def _settle(self, stage_params: Sequence[PyTree]) -> tuple[list[PyTree], StageOptimizer]:
        """Settles the ties and the optimizer on a state's per-stage parameters, once
        (dropping programs lowered before the optimizer was known); returns the parameters
        as each stage's optimizer sees them, and it."""
        self.decisions.settle_ties(abstract(stage_params))
        # the optimizer sees each stage's parameters less its tied copies but one per group
        views = [
            st.ties.view(abstract(p)) if st.ties is not None else p
            for st, p in zip(self.stages, stage_params, strict=True)
        ]
        if self.decisions.analyse_optimizer(views):
            self.programs.clear()
        optimizer = self.decisions.stage_optimizer
        assert optimizer is not None
        return views, optimizer

    # what benchmarks/bench_runtime.py drives by hand: a program bound, the caller's values
    def _bind(
        self, prog: Program, state: PipelineState, x: PyTree, on_loss: Any
    ) -> tuple[list[Step], Mapping[Slot, int]]:
        del on_loss  # whether a program reports losses is the program's (its LOSS ops)
        code = self.programs.code(prog, state, x, self.decisions.stage_outputs)
        return list(code.steps), code.slots

    def _inputs(
        self, state: PipelineState, microbatches: list[tuple[PyTree, PyTree]]
    ) -> dict[Slot, Any]:
        return self.feeder.inputs(state, microbatches)

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
        self.checker.init_shapes = shapes_text(sample)
        key = jax.random.fold_in(rng, 0)
        if any(st.sharded for st in self.stages):  # every annotation checked, nothing compiled
            shapes = jax.eval_shape(self.layers.init, key, sample)
            self._shard([v.get("params", {}) for v in shapes])
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
                    # a sharded stage: one layer whole on one device at a time, at most
                    place=stage.place_variables if stage.sharded else None,
                )
                variables += vs
        return self.state_from_variables(variables, jax.random.fold_in(rng, 1))

    def _shard(self, params: Sequence[PyTree]) -> None:
        """Decides each sharded stage's parameter shardings from the model's per-layer
        parameters (arrays or shapes), checking them before anything compiles."""
        for stage, spec in zip(self.stages, self.stage_specs, strict=True):
            stage.shard(list(params[spec.first_layer : spec.last_layer + 1]))

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
        self._shard([p for sp in stage_params for p in sp])
        _, optimizer = self._settle(stage_params)
        params, model_state, opt_state = [], [], []
        for s, (stage, spec) in enumerate(zip(self.stages, self.stage_specs, strict=True)):
            vs = variables[spec.first_layer : spec.last_layer + 1]
            # another process's stage: global arrays with no shard here (shapes only: they
            # size the transfers; orbax saves each process's own shards)
            place = stage.place_weights if self.local[s] else partial(remote, stage.replicated)
            raw = [v.get("params", {}) for v in vs]
            p = stage.place_params(raw) if self.local[s] else place(raw)
            if stage.ties is not None and self.local[s]:
                p = unaliased(p, [])  # tied copies here: one buffer each (donated apart)
            params.append(p)
            model_state.append(place([{k: x for k, x in v.items() if k != "params"} for v in vs]))
            init: Callable[[PyTree], optax.OptState] = (
                optimizer.init if self.local[s] else partial(jax.eval_shape, optimizer.init)
            )
            if stage.ties is not None:
                init = compose(init, stage.ties.view)
            o = stage.place_opt_state(init(p)) if self.local[s] else place(init(p))
            # an optimizer state that holds the parameters' own buffers (cocob, dog,
            # schedule-free keep the initial parameters) would be donated with them
            opt_state.append(unaliased(o, p) if self.local[s] else o)
        state = PipelineState(
            params=tuple(params),
            model_state=tuple(model_state),
            opt_state=tuple(opt_state),
            updates=(0,) * self.num_stages,
            microbatches=0,
            rng=rng,
        )
        self.checker.accept_layout(state_layout(state))
        return state

    # -- running ----------------------------------------------------------------------------

    def split_batch(self, batch: tuple[PyTree, PyTree]) -> list[tuple[PyTree, PyTree]]:
        """Splits ``(inputs, targets)`` into ``M`` equal microbatches along axis 0.

        Raises:
          PipelineError: if a leaf of the inputs or targets has other rows (leading
          dimension) than the others, or the rows are not divisible by ``M`` times every
          stage's replicas.
        """
        return split_batch(batch, self.microbatches, self.stage_set.batch_ways)

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
        if semantics(self.schedule_name).streams:
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
        check_pairs(microbatches, "run", "microbatches")
        self.checker.check_state(state, microbatches[0][0])
        rows = self.checker.check_items(state, microbatches, "microbatch", with_targets=True)
        if self.decisions.settle_replication(state):
            self.programs.clear()
        split = tuple(st.batch_ways for st in self.stages if not st.round_robin)
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
        code = self.programs.code(prog, state, microbatches[0][0], self.decisions.stage_outputs)
        return execute(
            code,
            state,
            microbatches,
            feeder=self.feeder,
            forward=self.forward,
            transport=self.transport,
            workarounds=self.workarounds,
            schedule=self.schedule(len(microbatches)) if timeline else None,
            on_loss=on_loss,
            collectives=collectives,
        )

    # -- the weights out, evaluation and prediction (:mod:`.forward`) ------------------------

    def variables(self, state: PipelineState) -> list[Variables]:
        """The per-layer variables (params and state) of the newest weights, each layer's
        on its stage's devices (``state`` is not consumed).

        In a multi-process run (:attr:`multiprocess`) this is collective: every process
        must call it, and each gets all the variables, another process's stages copied to
        its own first device."""
        return self.forward.variables(state)

    def params(self, state: PipelineState) -> dict[str, Any]:
        """The full parameter tree ``{layer name: params}`` of the newest weights, each
        layer's arrays on its stage's devices. ``state`` is not consumed."""
        return self.forward.params(state)

    def update_nnx(
        self, state: PipelineState, model: Any = None, *, device: jax.Device | None = None
    ) -> Any:
        """Writes the newest weights and model state into the nnx modules the layers were
        built from, on one ``device`` (:func:`pdjax.export.update_nnx`); returns
        ``model`` (the user's whole model, checked to hold them)."""
        return self.forward.update_nnx(state, model, device=device)

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
        return self.forward.linen_variables(state, names, device=device)

    def evaluate(
        self,
        state: PipelineState,
        batches: Iterable[tuple[PyTree, PyTree]],
        *,
        metrics: Callable[[PyTree, PyTree], Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The loss and the loss function's metrics over ``batches`` of ``(inputs,
        targets)``, in eval mode, forward only, through the stages
        (:meth:`Forward.evaluate <pdjax.pipeline.executor.forward.Forward.evaluate>`).
        ``state`` is not consumed.

        Across processes (:attr:`multiprocess`) every process calls it with the same
        batches, and each gets the same dict.

        Raises:
          PipelineError: for no batches; and as :meth:`run` does for a state or batches
          that do not fit.
        """
        return self.forward.evaluate(state, batches, metrics=metrics)

    def predict(
        self, state: PipelineState, inputs: PyTree, *, batch_size: int | None = None
    ) -> PyTree:
        """The model's outputs for ``inputs`` in eval mode, forward only through the
        stages, in batches of ``batch_size`` rows (default: all at once), concatenated:
        arrays on the last stage's devices. ``state`` is not consumed. Across processes
        every process calls it with the same inputs; the processes that hold none of the
        last stage's devices get None."""
        return self.forward.predict(state, inputs, batch_size=batch_size)

    def generate(
        self,
        state: PipelineState,
        prompt_tokens: Any,
        max_new_tokens: int,
        *,
        context: int | None = None,
        cache: bool | Literal["auto"] = "auto",
        microbatches: int = 1,
    ) -> Any:
        """Greedy decoding of a causal language model through the stages: the prompts
        (int token ids ``[B, T]``, one length) followed by ``max_new_tokens`` tokens, each
        the argmax of the last position's logits; int32 ``[B, T + max_new_tokens]`` on
        the host. Eval mode, forward only. ``context``: the most tokens fed (past it the
        window slides over the last ``context``); None feeds them all, refused before any
        work where the model cannot take that many. Across processes every process calls
        it and gets the same tokens (:mod:`pdjax.pipeline.executor.generation`).
        ``state`` is not consumed.

        ``cache``: ``"auto"`` runs the prompt through the stages once and then one
        position per new token, each stage keeping its layers' key/value cache on its
        devices (:mod:`pdjax.pipeline.executor.cached_generation`), where the model
        supports it (the Llama family) and the tokens are those of the uncached path
        (no sliding window, one process); elsewhere it reruns the window per token and
        says so once on the ``pdjax`` logger. ``True`` refuses where the cache does not
        apply; ``False`` always reruns the window. ``microbatches``: the cached path cuts
        the prompts into that many row blocks, which go through the stages as a
        wavefront (stage ``s`` on block ``k`` while stage ``s + 1`` is on ``k - 1``)."""
        return self.forward.generate(
            state,
            prompt_tokens,
            max_new_tokens,
            context=context,
            cache=cache,
            microbatches=microbatches,
        )
