"""What a pipeline decides once, on its first state or run (:class:`Decisions`): tied
copies' places, round-robin stages that must run split, where a replicated stage sums
its gradients, the optimizer's form per stage, and the shapes of each stage's output.
Each decision is written into the stages it concerns before any of their programs is
built; the methods that change what programs would be lowered say so (they return True),
and the pipeline then drops its cached programs."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import jax
import optax

from pdjax._sharding import shard_on
from pdjax.distributed import allgather_json
from pdjax.errors import PipelineError
from pdjax.layers import LayerSequence, PyTree
from pdjax.layers.tied import leaf_positions
from pdjax.pipeline.executor.config import scale
from pdjax.pipeline.executor.stages import Replication, StageSet
from pdjax.pipeline.executor.state import PipelineState
from pdjax.pipeline.executor.trees import abstract
from pdjax.pipeline.optim import StageOptimizer, keeps_model_tree
from pdjax.pipeline.stage import StageTies
from pdjax.precision import LossScaled, computes_in_float16
from pdjax.schedules import FLUSHING, semantics

__all__ = ["Decisions"]


class Decisions:
    """The decisions a pipeline takes once (see the module), over its stage set."""

    def __init__(
        self,
        stage_set: StageSet,
        layers: LayerSequence,
        replication: Replication,
        *,
        schedule: str,
        microbatches: int,
        optimizer: optax.GradientTransformation,
        optimizer_scope: Literal["model", "stage"],
        grad_allreduce: str,
    ) -> None:
        self.stage_set = stage_set
        self.layers = layers
        self.replication = replication
        self.schedule = schedule
        self.microbatches = microbatches
        self.optimizer = optimizer
        self.optimizer_scope = optimizer_scope
        self.grad_allreduce = grad_allreduce
        #: the optimizer as every stage runs it (decided on the first state)
        self.stage_optimizer: StageOptimizer | None = None
        #: whether updates exchange the gradients' global norm
        self.coupled = False
        self.settled = False
        self.parts_checked = False
        self._specs: dict[Any, list[Any]] = {}
        self.check_loss_scaling()

    def check_loss_scaling(self) -> None:
        """Refuses, before any work, float16 without a loss-scaled optimizer, and loss
        scaling where pdjax cannot do it exactly."""
        scaled = isinstance(self.optimizer, LossScaled)
        f16 = [
            layer.name
            for layer in self.layers.layers
            if computes_in_float16(getattr(layer, "policy", None))
        ]
        if f16 and not scaled:
            raise PipelineError(
                f"layer {f16[0]!r} computes in float16, whose gradients underflow without "
                "loss scaling: wrap the optimizer, Pipeline(..., "
                "pdjax.precision.loss_scaled(optimizer)) (jmp's dynamic loss scale), or "
                "use precision='bf16', which has float32's range and needs none"
            )
        if not scaled:
            return
        if semantics(self.schedule).stale:
            raise PipelineError(
                f"a loss-scaled optimizer needs every stage to update with the scale its "
                f"gradients were scaled by, and to skip an overflowing step together; under "
                f"{self.schedule} the stages update at their own times from other weight "
                f"versions, so pdjax does not do it: use a flush schedule "
                f"({', '.join(FLUSHING)}), or precision='bf16' without loss scaling"
            )
        if self.optimizer_scope == "stage" and self.stage_set.num_stages > 1:
            raise PipelineError(
                "a loss-scaled optimizer skips an overflowing step on every stage together "
                "and keeps one loss scale for the model; with optimizer_scope='stage' each "
                "stage would decide alone: use optimizer_scope='model'"
            )

    def check_tied(self) -> None:
        """Refuses tied copies on several stages where they cannot stay one parameter."""
        across = [(name, h) for name, h in self.stage_set.tied_stages if len(h) > 1]
        if not across:
            return
        name, h = across[0]
        what = f"the tied parameter {name!r} has copies on stages {list(h)}"
        if semantics(self.schedule).stale:
            raise PipelineError(
                f"{what}, but under {self.schedule} each stage updates at its own time "
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
        if self.stage_set.multiprocess:
            raise PipelineError(
                f"{what}, whose gradients and new values the stages exchange at each "
                "update; that runs in one process for now: put the stages holding the "
                "copies in one process, or all copies on one stage"
            )

    def settle_ties(self, stage_params: Sequence[PyTree]) -> None:
        """Gives each stage its :class:`~pdjax.pipeline.stage.StageTies` (the leaves of its
        tied copies in its parameters), once, before the optimizer is analysed."""
        ss = self.stage_set
        if not ss.tied_stages or any(st.ties is not None for st in ss.stages):
            return
        # per stage, (layer in the stage, path) -> leaf index; a parameter in a flax
        # metadata box (nn.with_logical_partitioning) by both its spellings
        where = [
            {(int(keys[0]), keys[1:]): n for keys, n in leaf_positions(list(p)).items()}
            for p in stage_params
        ]
        for s, (stage, spec) in enumerate(zip(ss.stages, ss.specs, strict=True)):
            names, copies, holders = [], [], []
            for (name, leaves), (_, h) in zip(self.layers.tied_leaves, ss.tied_stages, strict=True):
                mine = tuple(
                    self._leaf(where[s], i, spec.first_layer, path, name)
                    for i, path in leaves
                    if spec.first_layer <= i <= spec.last_layer
                )
                if len(set(mine)) < len(mine):
                    raise PipelineError(
                        f"tied[{name!r}] lists one parameter of stage {s} twice (as "
                        "'<path>' and '<path>/value'?); list each copy once"
                    )
                if mine:
                    names.append(name)
                    copies.append(mine)
                    holders.append(h)
            if names:
                stage.ties = StageTies(s, tuple(names), tuple(copies), tuple(holders))

    def _leaf(
        self,
        where: dict[tuple[int, tuple[str, ...]], int],
        i: int,
        first: int,
        path: tuple[str, ...],
        group: str,
    ) -> int:
        """The leaf index in its stage's parameters of layer ``i``'s tied copy at ``path``."""
        try:
            return where[(i - first, path)]
        except KeyError:  # check_tied refuses a missing leaf before; kept for clarity
            raise PipelineError(
                f"tied[{group!r}] names {self.layers.names[i]}/{'/'.join(path)}, which is "
                f"not a parameter of layer {self.layers.names[i]!r}"
            ) from None

    def settle_replication(self, state: PipelineState) -> bool:
        """Before the first run: a round-robin stage whose layers keep model state
        (BatchNorm statistics, which ``r`` microbatches at once would update unlike ``r``
        in turn) raises when the caller asked for round-robin, and runs split when only
        the plan did. Returns whether a stage changed (its schedules and programs must be
        made anew)."""
        if self.settled:
            return False
        changed = False
        for s, st in enumerate(self.stage_set.stages):
            if not (st.round_robin and jax.tree.leaves(state.model_state[s])):
                continue
            if self.replication.asked:
                raise PipelineError(
                    f"stage {s} is round-robin (r={st.num_replicas} whole microbatches at "
                    "once) but its layers keep model state (e.g. BatchNorm statistics), which "
                    "r microbatches would update at once, unlike r in turn; use "
                    "replication='split' for this stage"
                )
            st.round_robin = False
            st.scale = scale(self.schedule, self.microbatches, st.num_replicas, False)
            st.whole_reason = "not checked yet"
            self.replication.notes.append(
                f"the plan's round-robin stage {s} runs split: its layers keep model state"
            )
            changed = True
        self.settled = True
        if changed:
            self.replication.modes = self.stage_set.modes
        return changed

    def grad_allreduce_at(self) -> tuple[str, ...]:
        """Per stage, where its gradients are all-reduced (see
        :attr:`Pipeline.grad_allreduce_at <pdjax.pipeline.Pipeline.grad_allreduce_at>`)."""
        out = []
        for st in self.stage_set.stages:
            if st.num_replicas == 1:
                out.append("-")
            elif st.round_robin:
                out.append("update (round-robin)")
            elif st.per_device:
                out.append("update")
            else:
                out.append(f"backward: {st.whole_reason}")
        return tuple(out)

    def check_parts(self, state: PipelineState, x: PyTree) -> None:
        """Decides, once and before any stage program is built, which replicated stages
        sum their gradients per device (:meth:`Stage.check_parts`)."""
        if self.parts_checked:
            return
        ss = self.stage_set
        replicated = [
            s
            for s, st in enumerate(ss.stages)
            if st.num_replicas > 1 and not st.round_robin and not st.sharded
        ]
        if not replicated:
            self.parts_checked = True
            return
        if self.grad_allreduce == "backward":
            for s in replicated:
                ss.stages[s].whole_reason = "asked for (grad_allreduce='backward')"
            self.parts_checked = True
            return
        inputs = [abstract(x), *self.stage_outputs(state, x)]
        for s in replicated:
            stage = ss.stages[s]
            if not ss.local[s]:
                continue
            dev = next(d for d in stage.devices if d.process_index == ss.process_index)
            params, model_state = jax.tree.map(
                partial(shard_on, device=dev), (state.params[s], state.model_state[s])
            )
            stage.check_parts(params, model_state, inputs[s])
        if ss.multiprocess:  # every owner of a stage must build the same programs
            mine = {s: ss.stages[s].per_device for s in replicated if ss.local[s]}
            for theirs in allgather_json(mine):
                for s, ok in theirs.items():
                    stage = ss.stages[int(s)]
                    if not ok and stage.per_device:
                        stage.per_device = False
                        stage.whole_reason = "another process's check of this stage failed"
        self.parts_checked = True  # only once every check has run (a failure re-checks)

    def analyse_optimizer(self, stage_params: Sequence[PyTree]) -> bool:
        """Decides, once, how the optimizer runs per stage (:mod:`pdjax.pipeline.optim`):
        as it is, with the gradients' global norm exchanged, or not at all (raises).
        Returns whether it decided now (the programs lowered before must be made anew)."""
        if self.stage_optimizer is not None:
            return False
        opt = StageOptimizer(
            self.optimizer,
            abstract(stage_params),
            scope=self.optimizer_scope,
            model_tree=keeps_model_tree(self.layers),
        )
        if opt.needs_exchange and semantics(self.schedule).updates_per_microbatch:
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
        for stage in self.stage_set.stages:
            stage.optimizer = opt
        return True

    def stage_outputs(self, state: PipelineState, x: PyTree) -> list[Any]:
        """The shapes of every stage's output but the last's, for a microbatch like ``x``
        (what a process receives from another process's stage, or sends back as a
        gradient)."""
        x = abstract(x)
        key = jax.tree.structure(x), tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(x))
        if key not in self._specs:
            specs = []
            rng = jax.random.key(0)
            for s, stage in enumerate(self.stage_set.stages[:-1]):
                x = jax.eval_shape(
                    stage.microbatch_output,
                    abstract(state.params[s]),
                    abstract(state.model_state[s]),
                    x,
                    rng,
                )
                specs.append(x)
            self._specs[key] = specs
        return self._specs[key]
