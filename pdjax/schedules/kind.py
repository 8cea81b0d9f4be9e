"""A schedule as one object: :class:`ScheduleKind`, what every part of pdjax reads of a
schedule instead of branching on its name.

Each schedule's kind is defined next to its generator, in the module of its family
(:mod:`~pdjax.schedules.flush`, :mod:`~pdjax.schedules.streaming`,
:mod:`~pdjax.schedules.zero_bubble`), which lists its kinds in ``FAMILY``;
:mod:`~pdjax.schedules.registry` collects them. A kind holds its row of the semantics
table (:class:`~pdjax.schedules.semantics.ScheduleSemantics`), its generator under one
call signature (:class:`GenerateArgs`), where its stages sit (:class:`StagePlacement`), its
chunk rule, and the facts the simulator and the runtime need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pdjax.schedules.semantics import ScheduleSemantics

if TYPE_CHECKING:
    from pdjax.schedules.actions import Schedule
    from pdjax.schedules.spec import ScheduleSpec

__all__ = [
    "MODULO",
    "V_SHAPE",
    "GenerateArgs",
    "ScheduleKind",
    "StagePlacement",
    "stages_from",
]


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
    """The arguments of :func:`~pdjax.schedules.generate`, as every kind's
    :attr:`ScheduleKind.build` takes them: the spec, and the shape of the run it is
    generated for (each kind reads what it has)."""

    num_stages: int
    spec: ScheduleSpec
    stream: int | None = None
    steps: int = 1
    num_layers: int | None = None
    replicas: Sequence[int] | None = None

    @property
    def num_microbatches(self) -> int:
        """``M`` (the spec's)."""
        return self.spec.microbatches

    @property
    def chunks(self) -> int:
        """Stages per device group (the spec's)."""
        return self.spec.chunks or 1

    @property
    def replication(self) -> str | tuple[str, ...] | None:
        """Per device group, how its replicas share the work (the spec's)."""
        return self.spec.replication


def _modulo(groups: int, chunks: int) -> tuple[int, ...]:
    return tuple(s % groups for s in range(groups * chunks))


def _v(groups: int, chunks: int) -> tuple[int, ...]:
    stages = groups * chunks
    return tuple(min(s, stages - 1 - s) for s in range(stages))


@dataclasses.dataclass(frozen=True)
class StagePlacement:
    """Where a schedule's (virtual) stages sit on its device groups.

    Attributes:
        groups: ``(P, v) -> `` the device group of each of the ``P v`` stages.
        rule: the rule as the validator states it.
    """

    groups: Callable[[int, int], tuple[int, ...]]
    rule: str


MODULO = StagePlacement(_modulo, "stage s on group s % P")
"""Stage ``s`` on group ``s % P`` (one stage per group, or interleaved's loop)."""
V_SHAPE = StagePlacement(_v, "the V: stage s on group min(s, 2P - 1 - s)")
"""Stages ``0 .. P - 1`` down the groups, ``P .. 2P - 1`` back up (``zb-v``)."""


def stages_from(num_stages: int, stage: int) -> int:
    """1F1B's depth: stage ``s`` of ``P`` holds ``P - s``."""
    return num_stages - stage


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    """One schedule: what it computes, how it is generated, and what the rest of pdjax
    reads of it.

    Attributes:
        semantics: its row of the semantics table (name, flags, formulas, update rule).
        build: the generator under :func:`~pdjax.schedules.generate`'s arguments.
        placement: where its stages sit on the device groups.
        chunks: stages per device group: a fixed count (1; 2 for a V), or None where the
            caller chooses ``v`` (``interleaved``'s ``chunks``).
        needs_microbatches_per_stage: a step's ``M`` microbatches must be at least the
            ``P`` stages (``2bw``: step ``t`` uses ``W(t - 1)`` at every stage).

    How the planner prices a kind is the planner's own
    (:data:`pdjax.partition.pricing.traits.SCHEDULE_TRAITS`), and which kinds ``pdjax bench`` runs
    by default the benchmark's.
    """

    semantics: ScheduleSemantics
    build: Callable[[GenerateArgs], Schedule]
    placement: StagePlacement = MODULO
    chunks: int | None = 1
    needs_microbatches_per_stage: bool = False

    @property
    def name(self) -> str:
        return self.semantics.name

    @property
    def default_chunks(self) -> int:
        """Stages per device group when the caller gives none."""
        return 1 if self.chunks is None else self.chunks

    def chunks_for(self, chosen: int) -> int:
        """Stages per device group with the caller's ``chosen`` ``v``: ``chosen`` where
        the schedule takes it, else its own count."""
        return chosen if self.chunks is None else self.chunks

    @property
    def runs_plan_stages(self) -> bool:
        """Training runs a plan's stages as they are: one stage per device group (a
        chunked schedule cuts the model into equal chunks of its own)."""
        return not self.semantics.chunked

    @property
    def stream_in_steps(self) -> bool:
        """A streaming schedule whose stream is a whole number of steps of ``M``
        (``2bw``); a streaming schedule that updates per microbatch counts steps of 1."""
        row = self.semantics
        return row.streams and not row.updates_per_microbatch

    @property
    def round_robin_by_default(self) -> bool:
        """Round-robin replication is the cheaper mode (one all-reduce per group, not per
        microbatch): the schedule takes it and updates every microbatch."""
        row = self.semantics
        return row.round_robin and row.updates_per_microbatch

    def takes(self, option: str) -> bool:
        """Whether ``option`` (a generator option such as ``"extra_in_flight"``) is this
        schedule's."""
        return option in self.semantics.options

    def stage_groups(self, groups: int, chunks: int = 1) -> tuple[int, ...]:
        """The device group of each of ``groups * chunks`` stages."""
        return self.placement.groups(groups, chunks)

    def label(self, schedule: Schedule) -> str:
        """A short name of ``schedule`` (a schedule of this kind) for tables: its spec's
        :attr:`~pdjax.schedules.ScheduleSpec.label`, with ``rr`` after the name where
        stages are round-robin."""
        label = schedule.spec.label
        if self.chunks is None or "round-robin" not in schedule.replication:
            return label
        return schedule.name + " rr" + label[len(schedule.name) :]
