"""A pipeline's program cache (:class:`ProgramCache`): per call length, the validated
schedule; per schedule and call form, the lowered program; per program, its code bound
for this process. Built on first use and kept; dropped whole when a decision taken once
changes what would be lowered (:mod:`.decisions`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdjax import _xla_cpu
from pdjax.errors import PipelineError
from pdjax.layers import PyTree
from pdjax.pipeline.executor.decisions import Decisions
from pdjax.pipeline.executor.interpreter import Code, bind
from pdjax.pipeline.executor.stages import StageSet
from pdjax.pipeline.executor.state import PipelineState
from pdjax.pipeline.executor.trees import shape_key
from pdjax.pipeline.lowering import Placement, Program, lower
from pdjax.pipeline.transport import Transport
from pdjax.schedules import Schedule, ScheduleSpec, generate, semantics, validate

__all__ = ["ProgramCache"]


class ProgramCache:
    """Schedules, lowered programs and bound code of one pipeline (see the module)."""

    def __init__(
        self,
        spec: ScheduleSpec,
        remat: tuple[str, ...],
        stage_set: StageSet,
        decisions: Decisions,
        placement: Placement,
        transport: Transport,
        workarounds: _xla_cpu.Workarounds,
        *,
        fixed: Schedule | None = None,
    ) -> None:
        self.spec = spec
        self.remat = remat
        #: a given schedule, run as it is (None: generated from the spec per call length)
        self.fixed = fixed
        self.stage_set = stage_set
        self.decisions = decisions
        self.placement = placement
        self.transport = transport
        self.workarounds = workarounds
        self._schedules: dict[tuple[int, int], Schedule] = {}
        self._programs: dict[Any, Program] = {}
        self._bound: dict[Any, tuple[Program, Code]] = {}
        if fixed is not None:
            self._check_fixed(fixed)

    def clear(self) -> None:
        """Drops every schedule, program and bound code (a decision changed them)."""
        self._schedules.clear()
        self._programs.clear()
        self._bound.clear()

    def schedule(self, num_microbatches: int) -> Schedule:
        """The validated schedule of a call over ``num_microbatches`` microbatches: the
        stream of a streaming schedule, whole steps of ``M`` for the flush schedules."""
        spec = self.spec
        if self.fixed is not None:
            return self._fixed(num_microbatches)
        key = (num_microbatches, spec.microbatches)
        if key not in self._schedules:
            M, name = spec.microbatches, spec.kind
            streaming = semantics(name).streams
            if not streaming and num_microbatches % M:
                raise PipelineError(
                    f"{name} runs whole steps of {M} microbatches; got {num_microbatches}"
                )
            ss = self.stage_set
            sched = generate(
                spec.replace(chunks=ss.chunks, replication=ss.schedule_replication, remat=False),
                ss.num_groups,
                stream=num_microbatches if streaming else None,
                steps=1 if streaming else num_microbatches // M,
                replicas=ss.replicas,
            )
            validate(sched)
            self._schedules[key] = sched
        return self._schedules[key]

    def _check_fixed(self, fixed: Schedule) -> None:
        """Refuses a given schedule whose stages sit other than the pipeline's."""
        ss = self.stage_set
        mine = {
            "stages": ss.num_stages,
            "device groups": ss.num_groups,
            "stage_device": tuple(ss.stage_device),
            "replicas": tuple(ss.replicas),
            "replication": tuple(ss.schedule_replication or ("split",) * ss.num_groups),
        }
        theirs = {
            "stages": fixed.num_stages,
            "device groups": fixed.num_groups,
            "stage_device": tuple(fixed.stage_device),
            "replicas": tuple(fixed.replicas),
            "replication": tuple(fixed.replication or ("split",) * fixed.num_groups),
        }
        for what, want in mine.items():
            if theirs[what] != want:
                raise PipelineError(
                    f"the {fixed.name} schedule given has {what} {theirs[what]}, the pipeline's "
                    f"stages {want}: give a schedule for these stages (or stages for it)"
                )

    def _fixed(self, num_microbatches: int) -> Schedule:
        """The given schedule, for a call of its own length."""
        fixed = self.fixed
        assert fixed is not None
        if num_microbatches != fixed.num_microbatches:
            raise PipelineError(
                f"this pipeline runs the {fixed.name} schedule it was given, "
                f"{fixed.num_microbatches} microbatches long; got a call of {num_microbatches}: "
                f"give {fixed.num_microbatches} microbatches per call, or pass a ScheduleSpec "
                "to run calls of any whole number of steps"
            )
        return fixed

    def program(self, num_microbatches: int, *, timeline: bool, on_loss: bool) -> Program:
        """The lowered program of a call (cached). ``timeline``: unfused, one operation
        per schedule action; ``on_loss``: with ``LOSS`` operations."""
        key = (num_microbatches, timeline, on_loss)
        prog = self._programs.get(key)
        if prog is None:
            w = self.workarounds
            prog = lower(
                self.schedule(num_microbatches),
                self.placement,
                remat=self.remat,
                fuse=not timeline,
                coupled=self.decisions.coupled,
                run_ahead=w.run_ahead,
                one_at_a_time=w.one_at_a_time if not timeline else None,
                on_loss=on_loss,
                donate_weights=w.donate_weights,
                tied=self.stage_set.tied_across,
            )
            self._programs[key] = prog
        return prog

    def code(
        self,
        prog: Program,
        state: PipelineState,
        x: PyTree,
        activation_specs: Callable[[PipelineState, PyTree], Any],
    ) -> Code:
        """``prog`` bound for this process (cached per program, and across processes per
        layout of a microbatch input like ``x``: the receiving side binds shapes)."""
        ss = self.stage_set
        shapes = shape_key(x) if ss.multiprocess else None
        key = (id(prog), shapes)
        hit = self._bound.get(key)
        if hit is not None and hit[0] is prog:
            return hit[1]
        self.decisions.check_parts(state, x)
        specs = activation_specs(state, x) if ss.multiprocess else None
        code = bind(prog, ss.process_index, ss.stages, self.transport, specs)
        self._bound[key] = (prog, code)
        return code
