"""What every part of :class:`Pipeline <pdjax.pipeline.Pipeline>` reads (its fields,
declared on :class:`_PipelineBase`), and what the pipeline decides once, on its first
state or run: tied copies' places, round-robin stages that must run split, where a
replicated stage sums its gradients, the optimizer's form per stage, and the shapes of
each stage's output."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

import jax
import optax

from pdjax import _xla_cpu
from pdjax._sharding import shard_on
from pdjax._trees import key_str
from pdjax.distributed import allgather_json
from pdjax.errors import PipelineError
from pdjax.layers import LayerSequence, PyTree
from pdjax.partition.plan import StagePlan
from pdjax.pipeline.executor.config import _scale
from pdjax.pipeline.executor.state import PipelineState
from pdjax.pipeline.executor.trees import _abstract
from pdjax.pipeline.lowering import Placement, Program
from pdjax.pipeline.optim import StageOptimizer
from pdjax.pipeline.stage import LossFn, Stage, StageTies
from pdjax.pipeline.transport import Transport
from pdjax.schedules import FLUSHING, STALE, Schedule


class _PipelineBase:
    """The pipeline's fields (set by :class:`Pipeline <pdjax.pipeline.Pipeline>`'s
    constructor; see there) and its decisions taken once."""

    layers: LayerSequence
    schedule_name: str
    microbatches: int
    chunks: int
    vertical_sync: bool
    weight_stashing: bool
    extra_in_flight: int
    grad_allreduce: str
    optimizer_scope: Literal["model", "stage"]
    optimizer: optax.GradientTransformation
    loss_fn: LossFn
    stage_specs: tuple[StagePlan, ...]
    remat: tuple[bool, ...]
    num_groups: int
    stage_device: tuple[int, ...]
    replication: tuple[str, ...]
    replication_notes: list[str]
    stages: list[Stage]
    replicas: tuple[int, ...]
    process_index: int
    owners: tuple[frozenset[int], ...]
    local: tuple[bool, ...]
    tied_stages: tuple[tuple[str, tuple[int, ...]], ...]
    stage_optimizer: StageOptimizer | None
    coupled: bool
    placement: Placement
    transport: Transport
    workarounds: _xla_cpu.Workarounds
    _replication_asked: bool
    _parts_checked: bool
    _settled: bool
    _schedules: dict[tuple[int, int], Schedule]
    _specs: dict[Any, list[Any]]
    _layer_shapes: dict[Any, Any]
    """Per layer, layout of its variables (None: made by init) and input: the variables
    init makes (or None) and the output's shapes (:meth:`check_shapes`)."""
    _programs: dict[Any, Program]
    _bound: dict[Any, Any]
    _rng_cache: tuple[jax.Array, dict[str, jax.Array]] | None
    _on_loss: Callable[[int, jax.Array], None] | None
    _splitters: dict[Any, Any]
    _state_layouts: list[Any]
    _init_shapes: str | None
    _fits: dict[Any, Any]
    _fits_layout: Any

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
                (path[0].idx, tuple(key_str(k) for k in path[1:])): n
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
                partial(shard_on, device=dev), (state.params[s], state.model_state[s])
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

    @property
    def num_stages(self) -> int:
        return len(self.stages)

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

    # -- shapes of the stages' outputs ------------------------------------------------------

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
